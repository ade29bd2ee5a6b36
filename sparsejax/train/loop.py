"""`train_and_evaluate(config, workdir)`: the main job, top to bottom."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from sparsejax import data as data_lib
from sparsejax import models
from sparsejax.train import auto as auto_lib
from sparsejax.train import checkpoint, schedules
from sparsejax.train import config as config_lib
from sparsejax.train import optimizer as optimizer_lib
from sparsejax.train import pipelined as pipeline_lib
from sparsejax.train import step as step_lib
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
  """What the summary adds up over a run, carried on from the checkpoint a run resumes from."""

  previous: dict[str, Any]
  bytes_sent: float
  skipped_steps: int
  wall_before: float  # seconds the earlier, resumed parts of the run took
  time_to_target: dict[str, Any] | None
  exchange_choices: list[dict[str, Any]]  # algorithm "auto": every choice (auto.AutoExchange)
  evals: list[tuple[int, dict[str, float]]] = dataclasses.field(default_factory=list)
  t0: float = dataclasses.field(default_factory=time.time)

  @classmethod
  def resume(cls, summary_path: str, start: int, saved: dict[str, Any] | None) -> _Tally:
    """From zero when the run starts at `start` = 0, else from `saved` (what `record` gave when
    the checkpoint at `start` was written) or, for a checkpoint saved without it, from
    `summary_path`. The wall time counts steps that are redone (the summary may be newer than
    the checkpoint); the clock starts now."""
    summary = json.load(open(summary_path)) if start and os.path.exists(summary_path) else {}
    previous = saved if start and saved is not None else summary
    wall = max(float(previous.get("wall_time_s", 0.0)), float(summary.get("wall_time_s", 0.0)))
    return cls(previous, float(previous.get("bytes_sent", 0.0)),
               int(previous.get("skipped_steps", 0)), wall, previous.get("time_to_target"),
               [c for c in previous.get("exchange_choices", []) if c["step"] < start])

  def wall_time_s(self) -> float:
    return self.wall_before + time.time() - self.t0

  def best(self, config: Any) -> dict[str, Any] | None:
    """The best eval so far, earlier parts of the run included: the highest accuracy for
    classifiers, the lowest loss for sequence models."""
    candidates = [{"step": s, **m} for s, m in self.evals]
    if self.previous.get("best_eval"):
      candidates.append(self.previous["best_eval"])
    if not candidates:
      return None
    if config.model.name in models.SEQUENCE_MODELS:
      return min(candidates, key=lambda e: e["loss"])
    return max(candidates, key=lambda e: e["accuracy"])

  def record(self, config: Any) -> dict[str, Any]:
    """What a run resumed from a checkpoint written now carries on (`resume`'s `saved`)."""
    return {"bytes_sent": self.bytes_sent, "skipped_steps": self.skipped_steps,
            "wall_time_s": self.wall_time_s(), "time_to_target": self.time_to_target,
            "best_eval": self.best(config), "exchange_choices": list(self.exchange_choices)}

  def add_eval(self, config: Any, step: int, metrics: dict[str, float]) -> None:
    """Keeps `metrics`; notes the time when the config's target metric is first reached."""
    self.evals.append((step, metrics))
    target = config.target_metric
    if (target and self.time_to_target is None and target in metrics
        and config_lib.target_reached(target, metrics[target], config.target_value)):
      self.time_to_target = {"metric": target, "value": metrics[target],
                             "target": config.target_value, "step": step,
                             "wall_time_s": self.wall_time_s()}


class _Preemption:
  """SIGTERM (what clouds send some seconds before they preempt a machine) asks the loop to save
  after the step in flight and stop. One process: while entered in the main thread, SIGTERM only
  sets `requested` (the previous handler is restored on exit). Several processes: jax's
  preemption service (started by jax.distributed, its own SIGTERM handler) picks a step that all
  processes stop at."""

  def __init__(self) -> None:
    self.requested = False
    self._previous: Any = None
    self._installed = False

  def _note(self, signum: int, frame: Any) -> None:
    del signum, frame
    self.requested = True

  def __enter__(self) -> _Preemption:
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._note)
      self._installed = True
    return self

  def __exit__(self, *exc_info: Any) -> None:
    if self._installed:  # None: a handler not set from Python, treated as the default
      signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
      self._installed = False

  def reached(self, step: int) -> bool:
    """Whether to stop after `step` (all processes agree on it)."""
    if jax.process_count() == 1:
      return self.requested
    from jax.experimental import multihost_utils
    try:
      return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:  # the preemption service is off (jax_enable_preemption_service)
      return False


@dataclasses.dataclass
class _Job:
  """The pieces of a run that the loop uses and that do not change while it runs."""

  config: Any
  setup: TrainSetup
  data: data_lib.Inputs
  train_step: Callable  # (step, state, *batch) -> (state, [metrics of each update made])
  eval_step: Callable
  sync: Callable  # state -> state with the BatchNorm statistics averaged over the workers
  ckpt: checkpoint.Checkpointer
  writer: MetricsWriter | NullWriter
  tally: _Tally
  steps_per_epoch: int
  total_steps: int
  stage_ends: set[int]  # steps where a resize stage ends (evaluated when the config asks)
  auto: auto_lib.AutoExchange | None = None  # algorithm "auto": chooses the form before a step

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
    """Starts saving `state` as `step` (BatchNorm statistics synced first) with the tally so
    far; returns the synced state without waiting for the files."""
    state = self.sync(state)
    self.ckpt.save(step, state, meta=self.tally.record(self.config))
    return state

  def stop(self, state: Any, step: int, bar: tqdm, why: str) -> None:
    """Saves `state` as `step` when the run stops early (`why`: SIGINT, SIGTERM), as it is: its
    BatchNorm statistics not synced, so that the resumed run equals an uninterrupted one."""
    bar.close()
    print(f"\n{'interrupted' if why == 'SIGINT' else why}: saving a checkpoint at step {step} "
          f"in {self.ckpt.directory}", flush=True)
    self.ckpt.save(step, state, meta=self.tally.record(self.config))

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
      with self.aside(state):
        state = self.run_eval(state, done)
    if (config.checkpoint_every_steps and done % config.checkpoint_every_steps == 0
        and done < self.total_steps):
      with self.aside(state):
        state = self.save(state, done)
    return state

  def aside(self, state: Any) -> Any:
    """A context for work between steps that algorithm "auto" leaves out of the steps' time."""
    return self.auto.paused(state) if self.auto is not None else contextlib.nullcontext()


def _train(job: _Job, state: Any, start: int, show: bool,
           preemption: _Preemption) -> tuple[Any, int, str | None]:
  """Steps `start` to the end; returns (state, steps done, None or what stopped the run early:
  "SIGINT" for Ctrl-C, "SIGTERM" after the step in flight)."""
  config, total_steps = job.config, job.total_steps
  bar = tqdm(total=total_steps, initial=start, disable=not show, unit="step", dynamic_ncols=True)
  pending: list[dict[str, jax.Array]] = []
  try:
    for step in range(start, total_steps):
      # progressive resizing: the size comes from the schedule, each size compiles once
      size = schedules.image_size(config.data.resize_schedule, step / job.steps_per_epoch)
      images, labels = job.data.train_batch(step, size)
      batch = shard_batch(job.setup.mesh, images, labels)
      if job.auto is not None:
        job.auto.before_step(step, state, batch, job.writer)
      state, metrics = job.train_step(step, state, *batch)
      pending.extend(metrics)
      done = step + 1
      if pending and (done % config.log_every_steps == 0 or done == total_steps):
        job.log(pending, done, state, bar)
        pending = []
      bar.update(1)
      state = job.after_step(state, done)
      if preemption.reached(done):
        job.stop(state, done, bar, "SIGTERM")
        return state, done, "SIGTERM"
    return state, total_steps, None
  except KeyboardInterrupt:
    step = int(state.step)
    job.stop(state, step, bar, "SIGINT")
    return state, step, "SIGINT"
  finally:
    bar.close()


def _summary(config: Any, tally: _Tally, step: int, total_steps: int, stopped_by: str | None,
             mesh) -> dict[str, Any]:
  """summary.json's content: the run's length, time, best and final evals, bytes, skips."""
  interrupted = stopped_by is not None
  return {
      "config": config.to_dict(), "steps": int(step), "total_steps": total_steps,
      "interrupted": interrupted, "interrupted_by": stopped_by,
      "wall_time_s": tally.wall_time_s(),
      "time_to_target": tally.time_to_target,
      "final_eval": tally.evals[-1][1] if tally.evals and not interrupted else None,
      "best_eval": tally.best(config),
      "bytes_sent": tally.bytes_sent, "skipped_steps": tally.skipped_steps,
      "exchange_choices": tally.exchange_choices, "devices": mesh.size, "mesh": dict(mesh.shape),
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
  return set(schedules.stage_starts(config.data.resize_schedule, config.num_epochs,
                                    steps_per_epoch))


class _PerLevel:
  """The train step compiled once per density level."""

  def __init__(self, setup: TrainSetup, state_like: Any):
    self.setup, self.state_like = setup, state_like
    self._steps: dict[int | None, Callable] = {}

  def compiled(self, level: int | None) -> Callable:
    """`(state, *batch) -> (state, metrics)` at `level` (jitted on first use, the state
    donated)."""
    if level not in self._steps:
      self._steps[level] = step_lib.jit_train_step(self.setup, self.state_like, level)
    return self._steps[level]

  def by(self, level_of: Callable[[int], int | None]) -> Callable:
    """`(step, state, *batch) -> (state, [metrics])`, the level chosen on the host from the
    step (`level_of`)."""
    def train_step(step, state, *batch):
      state, metrics = self.compiled(level_of(step))(state, *batch)
      return state, [metrics]
    return train_step


def _train_step(config: Any, setup: TrainSetup, state: Any, per_level: _PerLevel,
                auto: auto_lib.AutoExchange | None, steps_per_epoch: int, total_steps: int,
                compute_mesh: Any) -> Callable:
  """The loop's `(step, state, *batch) -> (state, [metrics])`: pipelined where
  `overlap.pipeline` says so, else one compiled step per density level."""
  if state.pending is None:
    return per_level.by(auto.level if auto else setup.density_level)
  return pipeline_lib.from_config(config, setup, state, steps_per_epoch=steps_per_epoch,
                                  total_steps=total_steps, compute_mesh=compute_mesh)


def _auto(config: Any, setup: TrainSetup, state: Any, steps_per_epoch: int, total_steps: int,
          tally: _Tally, per_level: _PerLevel) -> auto_lib.AutoExchange | None:
  """The chooser of algorithm "auto" (None for the others), its history carried in `tally`."""
  if config.compression.algorithm != "auto":
    return None
  density = schedules.density(config.compression, steps_per_epoch)
  return auto_lib.AutoExchange(
      config, setup, state, sparse_level=setup.density_level,
      dense_level=optimizer_lib.dense_level_index(config, density),
      history=tally.exchange_choices, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
      compiled=per_level.compiled)


def train_and_evaluate(config: Any, workdir: str, *, progress: bool = True) -> dict[str, Any]:
  """Trains `config` (a validated or raw config), writing metrics, checkpoints and
  `summary.json` under `workdir`; resumes from the latest checkpoint there. Returns the summary."""
  # --- checks that need no compilation
  config = config_lib.validate(config)
  workdir = check_workdir(workdir)
  placement = config.overlap.pipeline
  mesh, compute_mesh = pipeline_lib.meshes(config.mesh.nodes, config.mesh.local, placement)
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
  if placement:  # the pipelined exchange carries the computed gradient in the state
    state = pipeline_lib.with_pending(setup, state, shard_batch(mesh, *data.train_batch(
        0, schedules.image_size(config.data.resize_schedule, 0.0))))
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), config.keep_checkpoints)
  with _Preemption() as preemption, contextlib.ExitStack() as cleanup:
    cleanup.callback(ckpt.close)  # waits for the last checkpoint and its manifest
    start, state = ckpt.restore_latest(state, lambda restored: place(restored, mesh))
    lead = jax.process_index() == 0  # the process that writes metrics and the summary
    writer = MetricsWriter(workdir, resume_step=start) if lead else NullWriter()
    cleanup.callback(writer.close)
    summary_path = os.path.join(workdir, "summary.json")
    tally = _Tally.resume(summary_path, start, ckpt.meta(start))
    per_level = _PerLevel(setup, state)
    auto = _auto(config, setup, state, steps_per_epoch, total_steps, tally, per_level)
    job = _Job(config, setup, data, _train_step(config, setup, state, per_level, auto,
                                                steps_per_epoch, total_steps, compute_mesh),
               step_lib.jit_eval_step(setup, state), step_lib.jit_sync_batch_stats(mesh), ckpt,
               writer, tally, steps_per_epoch, total_steps, _stage_ends(config, steps_per_epoch),
               auto)

    # --- the loop
    state, step, stopped_by = _train(job, state, start, progress and lead, preemption)
    if not stopped_by:
      state = job.run_eval(state, total_steps)
      job.save(state, total_steps)

  # --- the summary, once the last checkpoint is written
  summary = _summary(config, job.tally, step, total_steps, stopped_by, mesh)
  if lead:
    _write_json(summary_path, summary)
  return summary
