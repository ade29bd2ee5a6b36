"""studies/time_to_accuracy/limit.py: the runs' order, the ratios against hand-computed values,
and (integration tier) its --quick run on the emulated cluster."""

import importlib.util
import json

import pytest

from studies.time_to_accuracy import limit


def test_each_seed_alternates_the_links_and_rotates_the_systems():
  runs = limit.schedule(["a", "b"], ["dense", "torch-ddp"], ["10mbit"], 2)
  # the systems and dense over the whole recipe at the unlimited link, DDP to the target
  assert runs[:4] == [(0, "unlimited", "a", True), (0, "unlimited", "b", True),
                      (0, "unlimited", "dense", True), (0, "unlimited", "torch-ddp", False)]
  assert runs[4:8] == [(0, "10mbit", s, False) for s in ("a", "b", "dense", "torch-ddp")]
  # seed 1: the slow link first, every list turned by one
  assert runs[8:12] == [(1, "10mbit", s, False) for s in ("b", "dense", "torch-ddp", "a")]
  assert runs[12:] == [(1, "unlimited", "b", True), (1, "unlimited", "dense", True),
                       (1, "unlimited", "torch-ddp", False), (1, "unlimited", "a", True)]


def test_the_links_take_turns_between_seeds():
  runs = limit.schedule(["a"], [], ["1gbit", "10mbit"], 4)
  firsts = [list(dict.fromkeys(link for s, link, _, _ in runs if s == seed)) for seed in range(4)]
  assert firsts == [["unlimited", "1gbit", "10mbit"], ["1gbit", "10mbit", "unlimited"],
                    ["10mbit", "unlimited", "1gbit"], ["unlimited", "1gbit", "10mbit"]]
  assert [(r[2], r[3]) for r in runs if r[1] == "unlimited"][:2] == [("a", True), ("dense", True)]


def _run(system, seed, link, t, final=None, after=None):
  row = {"system": system, "seed": seed, "link": link, "final": final,
         "reached": None if t is None else {"step": 10, "train_time_s": t}}
  if after is not None:
    row["after_dense"] = after
  return row


def test_ratios_are_taken_within_a_seed():
  meta = {"systems": ["s"], "baselines": ["dense", "torch-ddp"], "link": "10mbit", "seeds": 2,
          "target_metric": "loss"}
  runs = [_run("s", 0, "unlimited", 10.0, final=4.0, after=6.0),
          _run("s", 0, "10mbit", 13.0, after=7.2),
          _run("dense", 0, "unlimited", 9.0, final=4.04),
          _run("dense", 0, "10mbit", 39.0), _run("torch-ddp", 0, "10mbit", 26.0),
          _run("s", 1, "unlimited", 20.0, final=4.1),
          _run("s", 1, "10mbit", 30.0), _run("dense", 1, "unlimited", 9.0, final=4.0),
          _run("dense", 1, "10mbit", None), _run("torch-ddp", 1, "10mbit", 60.0)]
  whole = limit.analyse({"meta": meta, "runs": runs})["s"]
  got = whole["links"]["10mbit"]
  assert got["limit"] == pytest.approx([1.3, 1.5])
  assert got["limit_after_dense"] == pytest.approx([1.2])  # seed 1 has no dense start
  assert got["dense_over"] == pytest.approx([3.0])  # seed 1's dense missed the target
  assert got["torch-ddp_over"] == pytest.approx([2.0, 2.0])
  assert whole["final_vs_dense"] == pytest.approx([100 * -0.04 / 4.04, 100 * 0.1 / 4.0])
  table = limit.make_table({"meta": {**meta, "task": "t", "nodes": 2, "target": 4.5,
                                     "command": "c", "commit": "x", "machine": "m", "cpus": 2,
                                     "date": "d"}, "runs": runs}, {"s": whole})
  assert ("| s | 10mbit | 10 / 10 / 10 | 10.0 / 15.0 / 20.0 | 13.0 / 21.5 / 30.0 | "
          "1.30 / 1.40 / 1.50 |" in table)
  assert "dense seed 1 at 10mbit" in table  # said, not dropped silently
  # dense's step at the link over its unlimited step, within a seed (seed 1 missed at the link)
  assert limit.dense_step_over_unlimited({"meta": meta, "runs": runs}) == {
      "10mbit": pytest.approx([39.0 / 9.0])}
  assert "10mbit 4.33 / 4.33 / 4.33" in table


def test_a_table_without_baselines_has_no_empty_column():
  meta = {"systems": ["s"], "baselines": [], "link": "10mbit", "seeds": 1,
          "target_metric": "loss", "task": "t", "nodes": 2, "target": 4.5, "command": "c",
          "commit": "x", "machine": "m", "cpus": 2, "date": "d"}
  runs = [_run("s", 0, "unlimited", 10.0, final=4.0), _run("s", 0, "10mbit", 13.0),
          _run("dense", 0, "unlimited", 9.0, final=4.04)]
  table = limit.make_table({"meta": meta, "runs": runs}, limit.analyse({"meta": meta,
                                                                          "runs": runs}))
  header, rule, row = table.splitlines()[2:5]
  assert "|  |" not in header and "|  |" not in row
  assert header.count("|") == rule.count("|") == row.count("|") == 9


def test_a_stopped_run_is_resumed_only_by_its_own_command_and_commit(tmp_path):
  """`--resume` keeps the runs a stopped command finished (each its own process's clock) and
  runs the rest; the failed ones run again; another command's or commit's file is refused."""
  meta = {**{k: "v" for k in limit.RESUMED_META}, "commit": "abc1234"}
  partial = tmp_path / "x.partial.json"
  runs = [_run("s", 0, "unlimited", 10.0, final=4.0), _run("dense", 0, "unlimited", 9.0)]
  partial.write_text(json.dumps({"meta": {**meta, "date": "2026-12-07"}, "runs": runs,
                                 "failed": [{"system": "s", "seed": 0, "link": "10mbit"}]}))
  got, done = limit._resumed(str(partial), {"meta": meta, "runs": []})
  assert done == {(0, "unlimited", "s"), (0, "unlimited", "dense")}
  assert got["runs"] == runs and "failed" not in got
  assert got["meta"]["date"] == "2026-12-07" and len(got["meta"]["resumed"]) == 1
  with pytest.raises(ValueError, match="its commit is 'abc1234', this command's 'w'"):
    limit._resumed(str(partial), {"meta": {**meta, "commit": "w"}, "runs": []})
  with pytest.raises(ValueError, match="its cpus is 'v', this command's 16"):
    limit._resumed(str(partial), {"meta": {**meta, "cpus": 16}, "runs": []})
  with pytest.raises(ValueError, match="needs a committed checkout.*'abc1234\\+dirty'"):
    limit._resumed(str(partial), {"meta": {**meta, "commit": "abc1234+dirty"}, "runs": []})
  with pytest.raises(ValueError, match="no .*nothing.partial.json to go on from"):
    limit._resumed(str(tmp_path / "nothing.partial.json"), {"meta": meta, "runs": []})


def test_dense_step_over_unlimited_divides_steps_not_times():
  meta = {"systems": ["s"], "baselines": ["dense"], "links": ["1gbit", "10mbit"], "seeds": 1}
  runs = [{"system": "dense", "seed": 0, "link": link, "reached": {"step": step, "train_time_s": t}}
          for link, step, t in (("unlimited", 120, 6.0), ("1gbit", 144, 18.0),
                                ("10mbit", 96, 48.0))]
  runs.append({"system": "s", "seed": 0, "link": "10mbit",
               "reached": {"step": 7, "train_time_s": 1.0}})
  got = limit.dense_step_over_unlimited({"meta": meta, "runs": runs})
  assert got == {"1gbit": pytest.approx([(18 / 144) / (6 / 120)]),
                 "10mbit": pytest.approx([(48 / 96) / (6 / 120)])}
  assert limit.dense_step_over_unlimited({"meta": {**meta, "baselines": []}, "runs": runs[3:]}) \
      == {"1gbit": [], "10mbit": []}


def test_a_bad_link_or_system_is_refused_before_any_run(capsys, tmp_path):
  out = str(tmp_path / "x.json")
  with pytest.raises(SystemExit):
    limit.main(["--link", "unlimited", "--out", out])
  assert "not unlimited" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    limit.main(["--links", "1gbit,unlimited", "--out", out])
  assert "'1gbit,unlimited'" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    limit.main(["--systems", "torch-ddp", "--out", out])
  assert "PyTorch's go in --baselines" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    limit.main(["--systems", "no-such-system", "--out", out])
  (tmp_path / "x.partial.json").write_text("{}")  # a stopped command's runs: not overwritten
  with pytest.raises(SystemExit):
    limit.main(["--quick", "--out", out])
  assert "go on with --resume" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.slow  # (about 90 s: out of CI's budget; the study's runs are tested there)
def test_quick_run_trains_both_links_end_to_end(tmp_path):
  from tests.conftest import need_root
  need_root("limit study")
  out = tmp_path / "limit.json"
  assert limit.main(["--quick", "--out", str(out)]) == 0
  got = json.loads(out.read_text())
  seen = {(r["system"], r["link"]) for r in got["runs"]}
  assert seen == {("hitopk-0.01", "unlimited"), ("dense", "unlimited"),
                  ("hitopk-0.01", "200mbit"), ("dense", "200mbit")}
  for r in got["runs"]:
    assert r["reached"], r  # the quick target
    whole = r["link"] == "unlimited"
    assert (r["final"] is not None) == whole
    if not whole:  # stopped at the target
      assert r["curve"][-1]["step"] == r["reached"]["step"]
  a = got["analysis"]["hitopk-0.01"]["links"]["200mbit"]
  assert len(a["limit"]) == 1 and a["limit"][0] > 0.5
  assert "Command: `python -m studies.time_to_accuracy.limit --quick" in (
      out.with_suffix(".md").read_text())
  assert got["meta"]["commit"] != "unknown"
  # the figure's plot, its one slow link beside the unlimited one
  if importlib.util.find_spec("matplotlib"):
    assert out.with_suffix(".png").stat().st_size > 0
