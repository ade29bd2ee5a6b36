"""studies/convergence/run.py --quick: the experiment's code path on real data, in CI."""

import json

import pytest

from studies.convergence import run as convergence

# end to end (the emulated cluster, the studies, whole recipes): `python -m pytest -m integration`
pytestmark = pytest.mark.integration


def test_quick_run_writes_table_curves_and_resumes(tmp_path, capsys):
  out = tmp_path / "results" / "convergence.json"
  argv = ["--quick", "--tasks", "kjv", "--variants", "dense,hitopk-0.001-no-ef,hitopk-0.001-mc",
          "--workdir", str(tmp_path / "runs"), "--out", str(out)]
  assert convergence.main(argv) == 0
  # momentum correction needs SGD: skipped for the AdamW task, run for the SGD ones
  assert "kjv hitopk-0.001-mc: skipped" in capsys.readouterr().out
  assert convergence.applies("fashion_mnist", "hitopk-0.001-mc-nomask")
  assert convergence.applies("kjv_sgd", "hitopk-0.001-mc")
  # the long warm-ups are for multi-epoch runs: not in the default set
  assert "hitopk-0.001-wu1" in convergence.VARIANTS
  assert not any(v.endswith("-wu1") for v in convergence.DEFAULT_VARIANTS)
  got = json.loads((tmp_path / "results" / "convergence_quick.json").read_text())
  rows = {r["variant"]: r for r in got["rows"]}
  assert set(rows) == {"dense", "hitopk-0.001-no-ef"} and rows["dense"]["vs_dense"] == 0.0
  # dense sends everything; 13 steps of a 100-step warm-up from 0.25 (down to 0.12) stay on its
  # first level, 0.25 (the levels 0.001 x 250^(j/4))
  assert rows["dense"]["mean_density"] == 1.0
  assert rows["hitopk-0.001-no-ef"]["mean_density"] == pytest.approx(0.25)
  for run in got["runs"]:
    steps = [p["step"] for p in run["curve"]]
    sent = [p["bytes"] for p in run["curve"]]
    assert steps == [10, 13] and run["steps"] == 13  # eval every 10 steps and at the end
    assert sent == sorted(sent) and sent[0] > 0
    assert all(0 < p["loss"] < 10 for p in run["curve"])
    assert run["final"] == run["curve"][-1]["loss"]
  # no error feedback: a state without residual is checkpointed; sparse: fewer bytes than dense
  dense = next(r for r in got["runs"] if r["variant"] == "dense")
  sparse = next(r for r in got["runs"] if r["variant"] != "dense")
  assert sparse["bytes_sent"] < dense["bytes_sent"]
  table = (tmp_path / "results" / "convergence_quick.md").read_text()
  assert "| kjv | hitopk-0.001-no-ef | 1 |" in table
  # a second call reads the finished runs instead of training again
  capsys.readouterr()
  assert convergence.main(argv) == 0
  assert "seed 0:" not in capsys.readouterr().out
  # --collect trains nothing: it summarizes the finished runs, and there are none for --epochs 2
  assert convergence.main([*argv, "--collect"]) == 0
  assert json.loads((tmp_path / "results" / "convergence_quick.json").read_text())["rows"] == \
      got["rows"]
  with pytest.raises(SystemExit):
    convergence.main([*argv, "--collect", "--epochs", "2"])
  assert "no finished run under" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    convergence.main([*argv, "--epochs", "0"])
  assert "--epochs must be > 0, got 0.0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--tasks", "mnist"], "unknown"), (["--variants", "dense,topk"], "unknown"),
    (["--seeds", "-2"], "seeds")])
def test_bad_arguments(argv, match, capsys):
  with pytest.raises(SystemExit):
    convergence.main(argv)
  assert match in capsys.readouterr().err
