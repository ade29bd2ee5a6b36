"""studies/worker_scaling/run.py: its system names and the densities they run at (the runs
themselves are the study's; a two-worker run is in the integration tier)."""

import json
import os

import pytest

from sparsejax import comm
from studies.worker_scaling import run as ws

N = 1_863_690  # the Fashion-MNIST MLP's parameters


@pytest.mark.parametrize("workers", [2, 4, 8, 16])
def test_gtopk_at_equal_bytes_sends_what_allgather_sends(workers):
  d = ws.density_at("gtopk-0.01-mc-bytes", workers, N)
  k, k_eq = round(0.01 * N), round(d * N)
  allgather = comm.wire_bytes("allgather", n=N, k=k, nodes=workers, local=1)["inter"]
  gtopk = comm.wire_bytes("gtopk", n=N, k=k_eq, nodes=workers, local=1)["inter"]
  assert gtopk == pytest.approx(allgather, rel=1e-3)
  assert (d > 0.01) == (workers > 2)  # log2 P rounds of pairs against P - 1 pieces


def test_the_k_rules_grow_with_the_workers_and_stop_at_density_one():
  assert ws.density_at("gtopk-0.01", 16, N) == 0.01
  assert ws.density_at("gtopk-0.01-sqrtP", 2, N) == pytest.approx(0.01)
  assert ws.density_at("gtopk-0.01-sqrtP", 16, N) == pytest.approx(0.01 * 8 ** 0.5)
  assert ws.density_at("gtopk-0.01-P", 16, N) == pytest.approx(0.08)
  assert ws.density_at("gtopk-0.5-P", 16, N) == 1.0
  assert ws.parse_system("allgather-0.01-mc") == ("allgather", 0.01, True, "", False, 1.0)


def test_masking_and_a_longer_warm_up_reach_the_run_config():
  config = os.path.join(ws.ROOT, "configs", "tta_fmnist_mlp.py")
  masked = ws.run_config(config, [], "gtopk-0.01-mcm-w4", 16, 0, N)
  plain = ws.run_config(config, [], "gtopk-0.01-mc", 16, 0, N)
  assert masked.experimental.momentum_masking and not plain.experimental.momentum_masking
  assert masked.compression.warmup_epochs == pytest.approx(4 * plain.compression.warmup_epochs)
  assert masked.mesh.nodes == 16 and masked.compression.algorithm == "gtopk"


@pytest.mark.parametrize("bad", ["dense-0.1", "allgather", "allgather-0.01-bytes", "gtopk-2",
                                 "topk-0.01", "gtopk-0.01-mc-sqrt",
                                 "gtopk-0.01-w0", "gtopk-0.01-w4-P"])
def test_a_bad_system_name_is_named(bad):
  with pytest.raises(ValueError, match=f"system '{bad}'"):
    ws.parse_system(bad)


def test_the_table_compares_gtopk_with_allgather_at_the_same_workers(tmp_path):
  runs = [{"task": "t", "workers": p, "system": s, "seed": seed, "density": 0.01,
           "steps_to_target": steps, "final": final, "steps": 100, "bytes_sent_per_step": 8e4}
          for p, s, seed, steps, final in [
              (16, "allgather-0.01-mc", 0, 40, 0.90), (16, "allgather-0.01-mc", 1, 50, 0.91),
              (16, "gtopk-0.01-mc", 0, 60, 0.89), (16, "gtopk-0.01-mc", 1, 80, 0.88),
              (16, "gtopk-0.04-mc", 0, None, 0.80), (16, "gtopk-0.04-mc", 1, 44, 0.90)]]
  meta = {"config": "configs/x.py", "metric": "accuracy", "target": 0.85, "seeds": 2,
          "systems": ["allgather-0.01-mc", "gtopk-0.01-mc", "gtopk-0.04-mc"], "workers": [16],
          "command": "python studies/worker_scaling/run.py", "machine": "x", "cpus": 2,
          "date": "today"}
  path = tmp_path / "r.json"
  path.write_text(json.dumps({"meta": meta, "runs": runs}))
  assert ws.main(["--from-results", str(path), "--out", str(tmp_path / "o.json")]) == 0
  rows = {r["system"]: r for r in json.loads((tmp_path / "o.json").read_text())["rows"]}
  assert rows["gtopk-0.01-mc"]["steps_over_allgather"] == pytest.approx(70 / 45)
  assert rows["gtopk-0.01-mc"]["final_minus_allgather"] == pytest.approx(0.885 - 0.905)
  assert rows["gtopk-0.04-mc"]["reached"] == 1 and "steps_over_allgather" not in rows[
      "gtopk-0.04-mc"]  # (no all-gather at 0.04, and a seed that never reached the target)
  assert "| gtopk-0.01-mc | 16 |" in (tmp_path / "o.md").read_text()
