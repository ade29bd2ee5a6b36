"""Checkpoints: manifests, damaged and half-written steps skipped on resume, a clear error when
none is intact, SIGTERM saving the step in flight."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import ROOT, read_csv, small_config

from sparsejax.train import checkpoint, train_and_evaluate
from sparsejax.train.checkpoint import DAMAGED, MANIFEST, META, Checkpointer, check_manifest
from sparsejax.train.loop import _Preemption

# The runs here: test_train.small_config (22 steps: checkpoints at 10, 20, 22; the DGC warm-up)
# with a small MLP at one image size for its ResNet-20. What is checked here (manifests, damaged
# steps, SIGTERM's save, the exact resume) is the same for any model, and ResNet-20's compiles
# were most of these tests' time (on 2 cores 71 s with a cold compilation cache, now 27 s);
# ResNet-20's exact resume (with its batch statistics) across a resize is test_train's
# test_resumed_run_has_exactly_the_metrics_of_the_uninterrupted_run.
MLP = {"model.name": "mlp", "model.hidden": (64,), "data.resize_schedule": ()}


def mlp_config():
  return small_config(**MLP)


# the CLI's equivalent of mlp_config
SMALL = ["--set", "num_epochs=2.0", "--set", "log_every_steps=1", "--set", "eval_every_steps=10",
         "--set", "checkpoint_every_steps=10", "--set", "compression.warmup_epochs=1.0",
         "--set", "model.name=mlp", "--set", "model.hidden=(64,)",
         "--set", "data.resize_schedule=()"]


def biggest_file(step_dir) -> str:
  """The relative path of the largest file of a step (one of the arrays' data files)."""
  paths = [os.path.join(r, n) for r, _, names in os.walk(step_dir) for n in names]
  return os.path.relpath(max(paths, key=os.path.getsize), step_dir).replace(os.sep, "/")


def corrupt(step_dir, how: str = "flip") -> str:
  """Damages the largest file of `step_dir` (`how`: flip bytes, truncate, delete); returns its
  relative path."""
  rel = biggest_file(step_dir)
  path = os.path.join(step_dir, rel)
  data = bytearray(open(path, "rb").read())
  if how == "delete":
    os.remove(path)
    return rel
  if how == "truncate":
    data = data[:len(data) // 2]
  else:
    data[::97] = bytes(b ^ 0x5A for b in data[::97])
  with open(path, "wb") as f:
    f.write(bytes(data))
  return rel


def cli_train(workdir, *extra, **popen):
  """`python -m sparsejax.cli train` on the quickstart config shortened as mlp_config."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  command = [sys.executable, "-m", "sparsejax.cli", "train",
             os.path.join(ROOT, "configs", "quickstart.py"), "--workdir", str(workdir),
             "--no-progress", *SMALL, *extra]
  return subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, **popen)


@pytest.fixture
def saved(tmp_path):
  """A Checkpointer holding steps 1, 2, 3 of a small state (all with manifests), the state."""
  rng = np.random.default_rng(0)
  state = {"w": jnp.asarray(rng.normal(size=(256, 64)), jnp.float32), "step": jnp.int32(0)}
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3)
  for step in (1, 2, 3):
    ckpt.save(step, {"w": state["w"] * step, "step": jnp.int32(step)}, meta={"step": step})
  ckpt.close()
  return str(tmp_path / "ckpt"), state


def test_manifest_lists_every_file_and_saves_run_in_the_background(saved):
  directory, state = saved
  step_dir = os.path.join(directory, "3")
  with open(os.path.join(step_dir, MANIFEST)) as f:
    files = json.load(f)["files"]
  on_disk = {os.path.relpath(os.path.join(r, n), step_dir).replace(os.sep, "/")
             for r, _, names in os.walk(step_dir) for n in names} - {MANIFEST}
  assert set(files) == on_disk and META in files
  assert all(size == os.path.getsize(os.path.join(step_dir, rel))
             for rel, (size, _) in files.items())
  assert check_manifest(step_dir) is None
  # the arrays are copied when save returns: the caller may donate them to the next step
  ckpt = Checkpointer(directory, keep=3)
  w = state["w"] * 4
  ckpt.save(4, {"w": w, "step": jnp.int32(4)}, meta={"step": 4})
  jax.jit(lambda x: x + 1, donate_argnums=0)(w)
  ckpt.close()
  ckpt = Checkpointer(directory, keep=3)
  step, got = ckpt.restore_latest(jax.tree.map(jnp.zeros_like, state))
  ckpt.close()
  assert step == 4 and ckpt.meta(4) == {"step": 4}
  np.testing.assert_array_equal(got["w"], np.asarray(state["w"]) * 4)
  assert sorted(os.listdir(directory)) == ["2", "3", "4"]  # keep=3


@pytest.mark.parametrize("how", ["flip", "truncate", "delete", "no manifest"])
def test_a_damaged_or_half_written_newest_step_is_skipped(saved, how, capsys):
  directory, state = saved
  if how == "no manifest":  # orbax finished the step, the manifest was never written
    os.remove(os.path.join(directory, "3", MANIFEST))
    rel = MANIFEST
  else:
    rel = corrupt(os.path.join(directory, "3"), how)
  ckpt = Checkpointer(directory, keep=3)
  step, got = ckpt.restore_latest(jax.tree.map(jnp.zeros_like, state))
  assert step == 2 and int(got["step"]) == 2
  np.testing.assert_array_equal(got["w"], np.asarray(state["w"]) * 2)
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and "step 3" in lines[0] and rel in lines[0]
  assert "resuming from step 2" in lines[0]
  # moved aside, so that orbax saves step 3 again
  assert sorted(os.listdir(directory)) == ["1", "2", DAMAGED]
  assert os.listdir(os.path.join(directory, DAMAGED)) == ["3"]
  ckpt.save(3, got)
  ckpt.close()
  assert check_manifest(os.path.join(directory, "3")) is None


def test_no_intact_checkpoint_is_a_one_line_error(saved):
  directory, state = saved
  damaged = {step: corrupt(os.path.join(directory, str(step))) for step in (1, 2, 3)}
  ckpt = Checkpointer(directory, keep=3)
  with pytest.raises(checkpoint.CheckpointError) as error:
    ckpt.restore_latest(state)
  ckpt.close()
  message = str(error.value)
  assert "\n" not in message and "no intact checkpoint" in message
  for step, rel in damaged.items():
    assert f"step {step} ({rel}: contents changed" in message
  assert sorted(os.listdir(directory)) == ["1", "2", "3"]  # left for inspection


# orbax leaves a coroutine unawaited when tensorstore fails to read
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_checkpoints_written_before_manifests_are_tried_with_orbax(saved, capsys):
  directory, state = saved
  for step in (1, 2, 3):
    os.remove(os.path.join(directory, str(step), MANIFEST))
  corrupt(os.path.join(directory, "3"))
  ckpt = Checkpointer(directory, keep=3)
  step, got = ckpt.restore_latest(jax.tree.map(jnp.zeros_like, state))
  ckpt.close()
  assert step == 2
  np.testing.assert_array_equal(got["w"], np.asarray(state["w"]) * 2)
  line = capsys.readouterr().err.strip()
  assert "step 3 (orbax cannot restore it:" in line and "resuming from step 2" in line
  assert "\n" not in line


def test_sigterm_handler_only_in_the_main_thread_and_restored_afterwards():
  def mine(signum, frame):
    pass
  previous = signal.signal(signal.SIGTERM, mine)
  try:
    with _Preemption() as preemption:
      os.kill(os.getpid(), signal.SIGTERM)
      for _ in range(100):  # the handler runs between bytecodes of the main thread
        if preemption.requested:
          break
        time.sleep(0.01)
      assert preemption.requested
    assert signal.getsignal(signal.SIGTERM) is mine
    other = []
    thread = threading.Thread(target=lambda: other.append(_Preemption().__enter__()))
    thread.start()
    thread.join()
    assert other and signal.getsignal(signal.SIGTERM) is mine
  finally:
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("full"))
  summary = train_and_evaluate(mlp_config(), workdir, progress=False)
  return workdir, summary


def same_metrics(got_dir, want_dir):
  for name in ("train.csv", "eval.csv"):
    want, got = (read_csv(os.path.join(d, name)) for d in (want_dir, got_dir))
    assert [r["step"] for r in got] == [r["step"] for r in want], name
    for w, g in zip(want, got):
      assert w == g, (name, w, g)


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
def test_a_run_resumes_from_the_newest_intact_checkpoint(full_run, tmp_path, capsys):
  workdir, summary = full_run
  resumed = str(tmp_path / "resumed")
  shutil.copytree(workdir, resumed)
  # the last checkpoint damaged after the run; its summary.json (of step 22) is kept
  rel = corrupt(os.path.join(resumed, "checkpoints", "22"))
  again = train_and_evaluate(mlp_config(), resumed, progress=False)
  err = capsys.readouterr().err
  assert f"step 22 ({rel}: contents changed (CRC32 differs))" in err
  assert "resuming from step 20" in err
  same_metrics(resumed, workdir)
  # the tally resumes from what was saved with step 20, not from the newer summary
  assert again["bytes_sent"] == summary["bytes_sent"]
  assert again["best_eval"] == summary["best_eval"] and again["steps"] == 22
  assert sorted(os.listdir(os.path.join(resumed, "checkpoints"))) == ["10", "20", "22", DAMAGED]


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
def test_cli_says_in_one_line_that_no_checkpoint_is_intact(full_run, tmp_path):
  workdir, _ = full_run
  broken = tmp_path / "broken"
  shutil.copytree(os.path.join(workdir, "checkpoints", "10"), broken / "checkpoints" / "10")
  rel = corrupt(str(broken / "checkpoints" / "10"))
  process = cli_train(broken)
  out, err = process.communicate(timeout=300)
  assert process.returncode == 5, (out, err)
  assert "Traceback" not in out + err
  lines = [line for line in err.splitlines() if "sparsejax train:" in line]
  assert len(lines) == 1, err
  assert "no intact checkpoint" in lines[0] and f"step 10 ({rel}: contents changed" in lines[0]


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
def test_sigterm_saves_the_step_in_flight_and_the_run_resumes_exactly(full_run, tmp_path):
  workdir, _ = full_run
  run = tmp_path / "preempted"
  process = cli_train(run)
  seen = 0
  deadline = time.time() + 240
  while seen < 3 and time.time() < deadline and process.poll() is None:
    time.sleep(0.02)
    if (run / "train.csv").exists():
      rows = read_csv(run / "train.csv")
      seen = int(rows[-1]["step"]) if rows else 0
  assert process.poll() is None, process.communicate()
  process.send_signal(signal.SIGTERM)
  out, err = process.communicate(timeout=120)
  assert process.returncode == 143, (out, err)
  summary = json.loads((run / "summary.json").read_text())
  assert summary["interrupted"] and summary["interrupted_by"] == "SIGTERM"
  steps = sorted(int(s) for s in os.listdir(run / "checkpoints"))
  assert steps[-1] == summary["steps"] >= seen and summary["steps"] < 22
  assert f"SIGTERM: saving a checkpoint at step {steps[-1]}" in out
  assert check_manifest(str(run / "checkpoints" / str(steps[-1]))) is None
  again = train_and_evaluate(mlp_config(), str(run), progress=False)
  assert not again["interrupted"] and again["steps"] == 22
  same_metrics(str(run), workdir)
