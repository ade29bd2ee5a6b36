"""studies/coverage/run.py: which tensors a global top-k sends, per tensor, read from the error
feedback residual of a real training run (a small MLP on scikit-learn's digits)."""

import json
import os
import subprocess
import sys

import pytest

from studies.time_to_accuracy import systems as tta_systems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# end to end (the emulated cluster, the studies, whole recipes): `python -m pytest -m integration`
pytestmark = pytest.mark.integration

SETS = [f"--set={s}" for s in tta_systems.QUICK_SETS]


def _run(tmp_path, name, *extra):
  """The script in its own process (it makes the mesh's CPU devices; this one has 8)."""
  out = tmp_path / f"{name}.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  run = subprocess.run([sys.executable, "-m", "studies.coverage.run",
                        "--config", os.path.join(ROOT, "configs", "tta_fmnist_mlp.py"), *SETS,
                        *extra, "--steps", "12", "--window", "5", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
  assert run.returncode == 0, run.stderr[-3000:]
  return json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_everything_is_covered_when_everything_is_sent(tmp_path):
  got, md = _run(tmp_path, "dense", "--set=compression.density=1.0",
                 "--set=compression.warmup_epochs=0.0")
  names = [t["tensor"] for t in got["tensors"]]
  assert names == ["head/bias", "head/kernel", "hidden_0/bias", "hidden_0/kernel"]
  for t in got["tensors"]:
    assert t["window_coverage"] == [1.0, 1.0]  # 12 steps: two whole windows of 5
    assert t["sent_per_step"] == t["size"]
  assert "| hidden_0/kernel | 16,384 | 1.000 / 1.000 / 1.000 |" in md
  assert "Command: `python -m studies.coverage.run --config configs/tta_fmnist_mlp.py" in md


def test_a_sparse_run_sends_at_least_k_and_leaves_some_coordinates_out(tmp_path):
  got, _ = _run(tmp_path, "sparse", "--set=compression.density=0.01",
                "--set=compression.warmup_epochs=0.0")
  size = sum(t["size"] for t in got["tensors"])
  per_step = sum(t["sent_per_step"] for t in got["tensors"])
  # k = 1% of the (padded) buffer; coordinates whose candidate is exactly zero (digits' blank
  # border pixels) count as sent too
  assert per_step >= 0.01 * size - 1
  assert per_step < 0.5 * size
  assert min(min(t["window_coverage"]) for t in got["tensors"]) < 1.0
  assert abs(sum(t["model_share"] for t in got["tensors"]) - 1.0) < 1e-9
