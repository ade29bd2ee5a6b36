"""studies/scaling_model/run.py: its byte model against the library's own accounting, and a run
on the committed benchmark results."""

import json
import math
import os

import pytest

from sparsejax import comm
from studies.scaling_model import run as sm

# end to end (the emulated cluster, the studies, whole recipes): `python -m pytest -m integration`
pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("nodes,local", [(2, 2), (3, 5), (16, 8)])
@pytest.mark.parametrize("algorithm,density", [
    ("dense", 1.0), ("hierarchical", 1.0), ("allgather", 0.003), ("hitopk", 0.0017)])
def test_inter_node_bytes_match_the_libraries_accounting(nodes, local, algorithm, density):
  """With only the network link costing time, time * bandwidth = the bytes on a node's link:
  comm.wire_bytes' per-worker inter-node bytes, times the rings sharing the link."""
  n = 1_234_567
  bw = 1e9
  cl = sm.Cluster(nodes=nodes, local=local, inter_Bps=bw, intra_Bps=math.inf,
                  inter_alpha_s=0.0, intra_alpha_s=0.0, call_s=0.0,
                  select_s=lambda n, k: 0.0, pair_s=0.0, pass_s_per_value=0.0)
  shard = n / local if algorithm == "hitopk" else n
  k = max(1, round(density * shard))
  want = comm.wire_bytes(algorithm, n=n, k=k, nodes=nodes, local=local)["inter"]
  rings = local if algorithm in ("hitopk", "hierarchical") else 1
  got = sm.exchange_time(algorithm, n, density, cl)["total"] * bw
  assert got == pytest.approx(want * rings, rel=1e-9)


def test_runs_on_the_committed_results(tmp_path):
  out = tmp_path / "scaling_model.json"
  assert sm.main(["--out", str(out)]) == 0
  got = json.loads(out.read_text())
  rows = got["calibration"]["rows"]
  assert len(rows) == 24 and sum(r["held_out"] for r in rows) == 12
  assert {r["size"] for r in rows if not r["held_out"]} == {"resnet50"}
  rate = got["calibration_rate_split"]["rows"]
  assert len(rate) == 24 and {r["rate"] for r in rate if r["held_out"]} == {"200mbit"}
  assert {r["size"] for r in rate if not r["held_out"]} == {"resnet50", "transformer_base"}
  assert all(r["predicted_s"] > 0 for r in rows)
  proj = {(r["nodes"], r["algorithm"]): r for r in got["projection"]["rows"]}
  # one node: no network link, so compression cannot help much; 16 nodes: it must
  assert proj[(16, "hitopk-0.001")]["images_per_s"] > proj[(16, "dense")]["images_per_s"]
  assert "| v100_images_per_s |" in (tmp_path / "scaling_model.md").read_text()


def test_missing_inputs_are_named(tmp_path, capsys):
  with pytest.raises(SystemExit):
    sm.main(["--comm", str(tmp_path / "none.json")])
  assert "benchmarks/exchange.py" in capsys.readouterr().err


def test_time_to_accuracy_section_fits_the_link_bound_runs(tmp_path):
  out = tmp_path / "scaling_model.json"
  assert sm.main(["--out", str(out)]) == 0
  got = json.loads(out.read_text())
  cal = got["time_to_accuracy_calibration"]
  rows = cal["rows"]
  assert {r["bandwidth"] for r in rows if not r["held_out"]} == set(sm.TTA_FITTED)
  assert cal["held_out_rows"] == sum(r["held_out"] for r in rows) > 0
  assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in rows)
  # the model's link bytes follow the interface counter (dense rows, limited links)
  for r in rows:
    if r["algorithm"] == "dense" and r["rate_bps"]:
      assert r["link_bytes_model"] == pytest.approx(r["link_bytes"], rel=0.1)
  proj = got["time_to_accuracy_projection"]["rows"]
  assert {r["cluster"] for r in proj} == {name for name, _, _ in sm.PROJECTED_CLUSTERS}
  by = {(r["cluster"], r["algorithm"]): r for r in proj}
  for name, _, _ in sm.PROJECTED_CLUSTERS:
    assert by[(name, "dense")]["vs_dense"] == pytest.approx(1.0)
  # a slower network makes the same cluster's dense exchange a larger share of the step
  slow, fast = sm.PROJECTED_CLUSTERS[1][0], sm.PROJECTED_CLUSTERS[2][0]
  assert by[(slow, "dense")]["exchange_over_compute"] > by[(fast, "dense")]["exchange_over_compute"]
  md = (tmp_path / "scaling_model.md").read_text()
  assert "### 3. The link-bound time-to-accuracy runs" in md
