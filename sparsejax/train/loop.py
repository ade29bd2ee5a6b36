"""`train_and_evaluate(config, workdir)`: the main job, top to bottom."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from sparsejax import data as data_lib
from sparsejax import models
from sparsejax.train import checkpoint, schedules
from sparsejax.train import config as config_lib
from sparsejax.train import step as step_lib
from sparsejax.train.mesh import make_mesh
from sparsejax.train.metrics import MetricsWriter, NullWriter
from sparsejax.train.state import TrainSetup, from_config, place, shard_batch

__all__ = ["train_and_evaluate", "evaluate", "check_workdir",
           "TooManySkippedSteps"]


class TooManySkippedSteps(RuntimeError):
  """Raised when `max_consecutive_skips` steps in a row had non-finite gradients."""


def check_workdir(workdir: str) -> str:
  """Creates `workdir` if needed and checks that files can be written there."""
  workdir = os.path.abspath(workdir)
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=workdir):
      pass
  except OSError as e:
    raise ValueError(f"workdir {workdir!r} is not writable: {e.strerror}") from None
  return workdir


def evaluate(setup: TrainSetup, eval_step, state, data: data_lib.Inputs,
             size: int | None) -> dict[str, float]:
  """The eval metrics of `state` over the whole eval set (padding weighted out); `eval_step`
  from `step.jit_eval_step`."""
  totals: dict[str, float] = {}
  for images, labels, weights in data.eval_batches(size):
    sums = jax.device_get(eval_step(state, *shard_batch(setup.mesh, images, labels, weights)))
    for k, v in sums.items():
      totals[k] = totals.get(k, 0.0) + float(v)
  count = totals.pop("count")
  return {k: v / count for k, v in totals.items()}


def _mean(rows: list[dict[str, Any]]) -> dict[str, float]:
  rows = jax.device_get(rows)
  out = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
  out["skipped"] = float(np.sum([r["skipped"] for r in rows]))
  return out


@dataclasses.dataclass
class _Tally:
  """What the summary adds up over a run, carried on from the summary of a resumed run."""

  previous: dict[str, Any]
  bytes_sent: float
  skipped_steps: int
  wall_before: float  # seconds the earlier, resumed parts of the run took
  time_to_target: dict[str, Any] | None
  evals: list[tuple[int, dict[str, float]]] = dataclasses.field(default_factory=list)
  t0: float = dataclasses.field(default_factory=time.time)

  @classmethod
  def resume(cls, summary_path: str, start: int) -> _Tally:
    """From `summary_path` when the run resumes at `start` > 0, else from zero; the clock
    starts now."""
    previous = json.load(open(summary_path)) if start and os.path.exists(summary_path) else {}
    return cls(previous, float(previous.get("bytes_sent", 0.0)),
               int(previous.get("skipped_steps", 0)), float(previous.get("wall_time_s", 0.0)),
               previous.get("time_to_target"))

  def wall_time_s(self) -> float:
    return self.wall_before + time.time() - self.t0

  def add_eval(self, config: Any, step: int, metrics: dict[str, float]) -> None:
    """Keeps `metrics`; notes the time when the config's target metric is first reached."""
    self.evals.append((step, metrics))
    target = config.target_metric
    if (target and self.time_to_target is None
        and metrics.get(target, -np.inf) >= config.target_value):
      self.time_to_target = {"metric": target, "value": metrics[target],
                             "target": config.target_value, "step": step,
                             "wall_time_s": self.wall_time_s()}


@dataclasses.dataclass
class _Job:
  """The pieces of a run that the loop uses and that do not change while it runs."""

  config: Any
  setup: TrainSetup
  data: data_lib.Inputs
  train_step: Callable  # (step, state, *batch) -> (state, metrics)
  eval_step: Callable
  sync: Callable  # state -> state with the BatchNorm statistics averaged over the workers
  ckpt: checkpoint.Checkpointer
  writer: MetricsWriter | NullWriter
  tally: _Tally
  steps_per_epoch: int
  total_steps: int
  stage_ends: set[int]  # steps where a resize stage ends (evaluated when the config asks)

  def run_eval(self, state: Any, step: int) -> Any:
    """Evaluates at `step` (the BatchNorm statistics synced first); returns the synced state."""
    state = self.sync(state)
    # the size of the stage that just trained (at a stage's end, not the next stage's)
    size = schedules.image_size(self.config.data.resize_schedule,
                                max(0, step - 1) / self.steps_per_epoch)
    metrics = evaluate(self.setup, self.eval_step, state, self.data, size)
    self.writer.write("eval", step, metrics)
    self.tally.add_eval(self.config, step, metrics)
    return state

  def save(self, state: Any, step: int) -> Any:
    state = self.sync(state)
    self.ckpt.save(step, state)
    return state

  def log(self, pending: list[dict[str, jax.Array]], done: int, state: Any, bar: tqdm) -> None:
    """Writes the mean of the `pending` steps' metrics; stops a run that skips too often."""
    config = self.config
    logged = {**_mean(pending), **self.data.stats()}
    self.tally.bytes_sent += logged["bytes_sent"] * len(pending)
    self.tally.skipped_steps += int(logged["skipped"])
    self.writer.write("train", done, logged)
    bar.set_postfix(loss=f"{logged['loss']:.3f}", acc=f"{logged['accuracy']:.3f}",
                    MB_per_step=f"{logged['bytes_sent'] / 1e6:.2f}")
    if int(state.consecutive_skips) >= config.max_consecutive_skips:
      raise TooManySkippedSteps(
          f"{int(state.consecutive_skips)} consecutive steps had non-finite gradients "
          f"(max_consecutive_skips = {config.max_consecutive_skips}); stopping at step "
          f"{done}. The last good checkpoint is step {self.ckpt.latest_step()} in "
          f"{self.ckpt.directory}")

  def after_step(self, state: Any, done: int) -> Any:
    """Evaluates and saves where the config asks, before the last step."""
    config = self.config
    if done < self.total_steps and ((config.eval_every_steps
                                     and done % config.eval_every_steps == 0)
                                    or done in self.stage_ends):
      state = self.run_eval(state, done)
    if (config.checkpoint_every_steps and done % config.checkpoint_every_steps == 0
        and done < self.total_steps):
      state = self.save(state, done)
    return state


def _train(job: _Job, state: Any, start: int, show: bool) -> tuple[Any, int, bool]:
  """Steps `start` to the end; returns (state, steps done, interrupted by Ctrl-C)."""
  config, total_steps = job.config, job.total_steps
  bar = tqdm(total=total_steps, initial=start, disable=not show, unit="step", dynamic_ncols=True)
  pending: list[dict[str, jax.Array]] = []
  try:
    for step in range(start, total_steps):
      # progressive resizing: the size comes from the schedule, each size compiles once
      size = schedules.image_size(config.data.resize_schedule, step / job.steps_per_epoch)
      images, labels = job.data.train_batch(step, size)
      state, metrics = job.train_step(step, state, *shard_batch(job.setup.mesh, images, labels))
      pending.append(metrics)
      done = step + 1
      if done % config.log_every_steps == 0 or done == total_steps:
        job.log(pending, done, state, bar)
        pending = []
      bar.update(1)
      state = job.after_step(state, done)
    return state, total_steps, False
  except KeyboardInterrupt:
    step = int(state.step)
    bar.close()
    print(f"\ninterrupted: saving a checkpoint at step {step} in {job.ckpt.directory}")
    job.save(state, step)
    return state, step, True
  finally:
    bar.close()


def _summary(config: Any, tally: _Tally, step: int, total_steps: int, interrupted: bool,
             mesh) -> dict[str, Any]:
  """summary.json's content: the run's length, time, best and final evals, bytes, skips."""
  candidates = [{"step": s, **m} for s, m in tally.evals]
  if tally.previous.get("best_eval"):
    candidates.append(tally.previous["best_eval"])
  # best: the highest accuracy for classifiers, the lowest loss for sequence models
  if config.model.name in models.SEQUENCE_MODELS:
    best = min(candidates, key=lambda e: e["loss"]) if candidates else None
  else:
    best = max(candidates, key=lambda e: e["accuracy"]) if candidates else None
  return {
      "config": config.to_dict(), "steps": int(step), "total_steps": total_steps,
      "interrupted": interrupted,
      "wall_time_s": tally.wall_time_s(),
      "time_to_target": tally.time_to_target,
      "final_eval": tally.evals[-1][1] if tally.evals and not interrupted else None,
      "best_eval": best,
      "bytes_sent": tally.bytes_sent, "skipped_steps": tally.skipped_steps,
      "devices": mesh.size, "mesh": dict(mesh.shape),
  }


def _write_json(path: str, content: dict[str, Any]) -> None:
  """Writes `content` to `path` atomically (aside, then renamed)."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(content, f, indent=1, default=str)
  os.replace(tmp, path)


def _stage_ends(config: Any, steps_per_epoch: int) -> set[int]:
  """The steps where a resize stage ends, when the config evaluates there."""
  if not config.eval_at_stage_boundaries:
    return set()
  stages = schedules.resize_stages(config.data.resize_schedule, config.num_epochs)
  return {round(start * steps_per_epoch) for start, _, _ in stages[1:]}


def _per_level(setup: TrainSetup) -> Callable:
  """`(step, state, *batch) -> (state, metrics)`: the step compiled once per density level, the
  level chosen on the host from the step."""
  train_steps: dict[int | None, Any] = {}

  def train_step(step, state, *batch):
    level = setup.density_level(step)
    if level not in train_steps:
      train_steps[level] = step_lib.jit_train_step(setup, state, level)
    return train_steps[level](state, *batch)
  return train_step


def train_and_evaluate(config: Any, workdir: str, *, progress: bool = True) -> dict[str, Any]:
  """Trains `config` (a validated or raw config), writing metrics, checkpoints and
  `summary.json` under `workdir`; resumes from the latest checkpoint there. Returns the summary."""
  # --- checks that need no compilation
  config = config_lib.validate(config)
  workdir = check_workdir(workdir)
  mesh = make_mesh(config.mesh.nodes, config.mesh.local)
  if config.batch_size % mesh.size:
    raise ValueError(f"global batch_size {config.batch_size} is not divisible by the "
                     f"{mesh.size} devices of the mesh")
  data = data_lib.open_inputs(config)
  steps_per_epoch = data.steps_per_epoch
  total_steps = max(1, math.ceil(config.num_epochs * steps_per_epoch))

  # --- model, transforms, state
  example = data.example(schedules.image_size(config.data.resize_schedule, 0.0))
  setup, state = from_config(config, mesh, data.num_classes, example,
                             steps_per_epoch=steps_per_epoch, total_steps=total_steps)
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), config.keep_checkpoints)
  start = ckpt.latest_step() or 0
  if start:
    state = place(ckpt.restore(start, state), mesh)
  lead = jax.process_index() == 0  # the process that writes metrics and the summary
  writer = MetricsWriter(workdir, resume_step=start) if lead else NullWriter()
  summary_path = os.path.join(workdir, "summary.json")
  job = _Job(config, setup, data, _per_level(setup), step_lib.jit_eval_step(setup, state),
             step_lib.jit_sync_batch_stats(mesh), ckpt, writer, _Tally.resume(summary_path, start),
             steps_per_epoch, total_steps, _stage_ends(config, steps_per_epoch))

  # --- the loop
  state, step, interrupted = _train(job, state, start, progress and lead)
  if not interrupted:
    state = job.run_eval(state, total_steps)
    state = job.save(state, total_steps)
  writer.close()
  ckpt.close()

  # --- the summary
  summary = _summary(config, job.tally, step, total_steps, interrupted, mesh)
  if lead:
    _write_json(summary_path, summary)
  return summary
