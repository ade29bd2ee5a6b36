"""benchmarks/failover.py (how fast a lost node is noticed on the emulated cluster): one
trial end to end, and the table from given trials."""

import json
import re

import pytest

from benchmarks import failover as bench_failover
from sparsejax import cluster
from tests.conftest import need_root

# end to end (the emulated cluster, the studies, whole recipes): `python -m pytest -m integration`
pytestmark = pytest.mark.integration


def test_one_trial_end_to_end(tmp_path):
  need_root("benchmark")
  out = tmp_path / "bench_failover.json"
  assert bench_failover.main(["--nodes", "2", "--runs", "1", "--victims", "last", "--modes",
                              "launcher", "--out", str(out)]) == 0
  got = json.loads(out.read_text())
  [trial] = got["trials"]
  assert trial["named_right"] and trial["rc"] == 128 + 9
  assert 0 <= trial["noticed_s"] < 5 and trial["ended_s"] < 5 + 2
  assert any("lost node 1 (rank 1, killed by SIGKILL)" in line for line in trial["launcher_lines"])
  md = out.with_suffix(".md").read_text()
  assert "| last node (rank 1) | SIGKILL | launcher |" in md
  assert "Command: `python -m benchmarks.failover --nodes 2" in md
  [built] = [line for line in trial["launcher_lines"] if " emulated cluster " in line]
  prefix = re.search(r"emulated cluster (\w+): ", built).group(1)
  assert cluster.EmulatedCluster.leftovers(prefix + "-") == []


def test_the_table_gives_min_median_max_over_runs():
  meta = {"nodes": 4, "runs": 3, "job": "collectives", "rate": "1gbit", "heartbeat_timeout_s": 3,
          "command": "python -m benchmarks.failover", "machine": "x86_64", "cpus": 2,
          "date": "2026-01-01"}
  trials = [{"victim_label": "coordinator", "victim": 0, "signal": "SIGKILL", "mode": "self",
             "noticed_s": 0.01 * i, "ended_s": e, "named_right": True,
             "launcher_lines": ["... SIGKILL after the 60 s grace: none)"]}
            for i, e in enumerate((0.3, 0.1, 0.2), 1)]
  table = bench_failover.make_table({"meta": meta, "trials": trials})
  assert "| coordinator (rank 0) | SIGKILL | self | 0.01 / 0.02 / 0.03 | 0.10 / 0.20 / 0.30 | " \
         "3/3 | 0/3 |" in table
