"""benchmarks/exchange.py --local: every JAX exchange of the benchmark runs and is timed."""

import json

import pytest

from benchmarks import exchange as bench_comm

# end to end (the emulated cluster, the studies, whole recipes): `python -m pytest -m integration`
pytestmark = pytest.mark.integration


def test_local_mode_times_every_exchange(tmp_path):
  out = tmp_path / "local.json"
  assert bench_comm.main(["--local", "--sizes", "tiny", "--reps", "2", "--out", str(out)]) == 0
  got = json.loads(out.read_text())
  rows = {r["algorithm"]: r for r in got["results"]}
  assert set(rows) == {"dense", "hierarchical", "allgather-0.01", "allgather-0.001",
                       "hitopk-0.01", "hitopk-0.001"}
  for r in rows.values():
    assert r["size"] == "tiny" and r["n"] == 40_008 and r["rate"] == "in-process"
    assert 0 < r["min_s"] <= r["median_s"] and r["reps"] == 2
  assert "| in-process | tiny | hitopk-0.001 |" in (tmp_path / "local.md").read_text()
