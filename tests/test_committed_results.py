"""Every committed study result analyses again, from its JSON alone, to the table committed
beside it: the time-to-accuracy study's (`analysis.report`), auto's end-to-end results
(`end_to_end.py --from-results`, with the arguments their command recorded) and the worker
scaling study's (each script's `--from-results`)."""

import glob
import json
import os
import shlex

import pytest

from sparsejax.bench import ROOT
from studies.auto import end_to_end
from studies.convergence import run as convergence
from studies.time_to_accuracy import analysis, limit, systems
from studies.worker_scaling import applied, at_nodes, projected, residuals
from studies.worker_scaling import run as worker_scaling

# end to end (the emulated cluster, the studies, whole recipes): `python -m pytest -m integration`
pytestmark = pytest.mark.integration


def _committed(pattern: str) -> list[str]:
  return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _table(path: str) -> str:
  with open(path) as f:
    return f.read()


def _same_table(got_json: str, committed_json: str) -> None:
  want = _table(os.path.join(ROOT, os.path.splitext(committed_json)[0] + ".md"))
  assert _table(os.path.splitext(got_json)[0] + ".md") == want, committed_json


def _by_limit(name: str) -> bool:
  """Whether `studies.time_to_accuracy.limit` wrote the result (its recorded command)."""
  with open(os.path.join(ROOT, name)) as f:
    return limit.MODULE in json.load(f)["meta"].get("command", "")


_TTA = _committed("studies/time_to_accuracy/results/*.json")
_LIMITS = [name for name in _TTA if _by_limit(name)]


@pytest.mark.parametrize("name", [name for name in _TTA if name not in _LIMITS])
def test_a_time_to_accuracy_result_analyses_to_its_table(name, tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  with open(name) as f:
    results = json.load(f)
  out = str(tmp_path / os.path.basename(name))
  analysis.report(results, out)
  _same_table(out, name)


@pytest.mark.parametrize("name", _LIMITS)
def test_a_limit_ratio_result_analyses_to_its_table(name, tmp_path):
  out = str(tmp_path / os.path.basename(name))
  assert limit.main(["--from-results", os.path.join(ROOT, name), "--out", out]) == 0
  _same_table(out, name)


@pytest.mark.parametrize("name", _committed("studies/auto/results/*.json"))
def test_an_auto_result_is_judged_again_to_its_table(name, tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  with open(name) as f:
    meta = json.load(f)["meta"]
  words = shlex.split(meta["command"])
  argv = words[3:] if words[1] == "-m" else words[2:]  # (python -m module | python file.py)
  out = str(tmp_path / os.path.basename(name))
  argv[argv.index("--out") + 1] = out
  if "reference" in meta:  # (a reference outside the checkout recorded as $REFERENCE)
    argv[argv.index("--reference") + 1] = meta["reference"]
  assert end_to_end.main([*argv, "--from-results", name]) == 0
  _same_table(out, name)


@pytest.mark.parametrize("name", _committed("studies/worker_scaling/results/*.json"))
def test_a_worker_scaling_result_writes_its_table_again(name, tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  base = os.path.basename(name)
  study = (applied if base.startswith("applied") else at_nodes if base.startswith("at_nodes")
           else projected if base.startswith("projected")
           else residuals if base.startswith("residuals") else worker_scaling)
  out = str(tmp_path / base)
  assert study.main(["--from-results", name, "--out", out]) == 0
  _same_table(out, name)


@pytest.mark.parametrize("system", sorted(systems.SYSTEMS))
def test_every_time_to_accuracy_system_builds_a_valid_config(system, monkeypatch):
  """Each study system is a valid config on one of the study's tasks (its keys are current:
  a renamed key would fail with the one-line error naming the new one)."""
  monkeypatch.chdir(ROOT)
  errors = []
  for task in ("configs/tta_fmnist_mlp.py", "configs/tta_kjv_lm.py",
               "configs/tta_fmnist_resnet.py"):
    try:
      systems.load_task(task, [], system)
      return
    except ValueError as e:
      errors.append(f"{task}: {e}")
  raise AssertionError("\n".join(errors))


@pytest.mark.parametrize("variant", sorted(convergence.VARIANTS))
def test_every_convergence_variant_builds_a_valid_config(variant):
  from sparsejax.train import config as config_lib
  task = "kjv" if not convergence.VARIANTS[variant].get("momentum_correction") else "fashion_mnist"
  config_lib.validate(convergence.apply_variant(convergence.TASKS[task][0](True), variant))


def test_auto_s_prior_is_the_studys_measured_factors():
  """`auto.model.STEP_FACTORS` equals what studies/time_to_accuracy/factors.py computes from the
  committed result files: a rerun that moves a factor moves auto's prior, or this fails."""
  from sparsejax.train.auto.model import STEP_FACTORS
  from studies.time_to_accuracy.factors import pooled
  assert STEP_FACTORS == pooled()
