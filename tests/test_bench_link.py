"""benchmarks/link.py (one message's time against its size over the emulated link): one run
end to end, its table, the queue reaching tc, and the checks of its arguments."""

import json

import pytest

from benchmarks import link as bench_link
from sparsejax import cluster
from tests.conftest import need_root


@pytest.mark.parametrize("text,want", [("16k", 16384), ("3m", 3 * 2**20), ("1000", 1000)])
def test_sizes_are_bytes_with_k_or_m(text, want):
  assert bench_link.parse_size(text) == want


@pytest.mark.parametrize("text", ["", "1g", "k", "1.5m", "-4", "0", "1001"])
def test_a_bad_size_is_named(text):
  with pytest.raises(ValueError, match=f"size {text!r}: give a positive number of bytes"):
    bench_link.parse_size(text)


@pytest.mark.parametrize("argv,named", [
    (["--sizes", "16k,7"], "size '7'"), (["--rates", "fast"], "fast"),
    (["--queues", "0"], "queue 0: must be in"), (["--gaps", "-1"], "gap -1: must be in"),
    (["--reps", "0"], "--reps and --runs must be at least 1, got 0 and 3")])
def test_bad_arguments_are_refused_before_any_cluster(argv, named, capsys):
  with pytest.raises(SystemExit) as e:
    bench_link.main(argv)
  assert e.value.code == 2 and named in capsys.readouterr().err


def test_the_queue_reaches_tc_as_tbf_latency(monkeypatch):
  calls = []
  monkeypatch.setattr(cluster, "_run", lambda *cmd: calls.append(cmd))
  cluster.set_link_rate("sjxtest", 2, 10**8, burst_bytes=4096, queue_s=0.05)
  assert len(calls) == 4  # both ends of each node's link
  for cmd in calls:
    assert cmd[-7:] == ("tbf", "rate", "100000000bit", "burst", "4096", "latency", "50ms")


@pytest.mark.parametrize("size,gap_s,want", [
    (200_000, 0.0, 200_000 * 8 / 10**7),            # back to back: an empty bucket
    (200_000, 0.1, (200_000 - 16384) * 8 / 10**7),  # 0.1 s refills more than the burst
    (200_000, 0.005, (200_000 - 6250) * 8 / 10**7),  # 5 ms refills 6,250 bytes at 10 Mbit/s
    (8_000, 0.1, 0.0)])                              # all of it within the burst
def test_the_bound_credits_what_the_gap_refilled_up_to_the_burst(size, gap_s, want):
  assert bench_link.link_bound_s(size, gap_s, 10**7) == pytest.approx(want)
  assert bench_link.link_bound_s(size, gap_s, None) == 0.0


@pytest.mark.parametrize("queue_s", [0.0, 0.0005, 11.0])
def test_a_queue_outside_its_range_is_refused_before_any_tc_call(queue_s):
  with pytest.raises(ValueError, match=f"queue_s must be in .*got {queue_s}"):
    cluster.set_link_rate("nosuchcluster", 1, 10**8, queue_s=queue_s)


def test_the_table_gives_min_median_max_over_runs():
  meta = {"command": "python -m benchmarks.link", "machine": "x86_64", "cpus": 2,
          "date": "2026-01-01"}
  rows = [{"rate": "100mbit", "queue_s": 0.4, "gap_s": 0.1, "what": "psum", "size": 65536,
           "median_s": m, "q3_s": m + 0.001 * i, "bytes_s": 0.004, "excess_s": m - 0.004}
          for i, m in enumerate((0.007, 0.005, 0.006), 1)]
  table = bench_link.make_table(rows, meta)
  assert ("| 100mbit | 0.4 | 0.1 | psum | 64 | 0.0050 / 0.0060 / 0.0070 | 0.0040 | "
          "1.0 / 2.0 / 3.0 | 1.0 / 2.0 / 3.0 |") in table
  assert table.endswith("Command: `python -m benchmarks.link`; machine: x86_64 (2 cores); "
                        "date: 2026-01-01.")


@pytest.mark.integration
def test_one_run_end_to_end(tmp_path):
  need_root("benchmark")
  out = tmp_path / "link.json"
  assert bench_link.main(["--rates", "200mbit", "--queues", "0.4,0.05", "--sizes", "16k,200004",
                          "--gaps", "0", "--reps", "2", "--runs", "1", "--out", str(out)]) == 0
  got = json.loads(out.read_text())
  cases = {(r["queue_s"], r["what"], r["size"]) for r in got["rows"]}
  whats = ("tcp", "all_gather", "psum", "all_to_all")
  assert cases == {(q, w, n) for q in (0.4, 0.05) for w in whats for n in (16384, 200004)}
  for r in got["rows"]:
    assert r["bytes_s"] == pytest.approx(r["size"] * 8 / 200e6)  # no gap: no burst credit
    assert r["reps"] == 2 and 0 < r["min_s"] <= r["median_s"] <= r["q3_s"]
    if r["size"] > 16384:  # crossed the limited link: at least most of its bytes' time
      assert r["median_s"] > 0.7 * r["bytes_s"]
  assert got["meta"]["queues_s"] == "0.4,0.05" and got["meta"]["burst_bytes"] == 16384
  md = out.with_suffix(".md").read_text()
  assert "| 200mbit | 0.05 | 0 | all_to_all | 195.316 |" in md
  assert "Command: `python -m benchmarks.link --rates 200mbit" in md
