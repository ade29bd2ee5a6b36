"""`train_and_evaluate(config, workdir)`: the main job, top to bottom."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import tempfile
import threading
import time
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from sparsejax import models
from sparsejax.train import checkpoint
from sparsejax.train import config as config_lib
from sparsejax.train.metrics import MetricsWriter, NullWriter
from sparsejax.train.run import Run
from sparsejax.train.state import place

__all__ = ["train_and_evaluate", "check_workdir", "TooManySkippedSteps"]


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
  def resume(cls, summary_path: str, start: int, saved: dict[str, Any] | None,
             choices: list[dict[str, Any]]) -> _Tally:
    """From zero when the run starts at `start` = 0, else from `saved` (what `record` gave when
    the checkpoint at `start` was written) or, for a checkpoint saved without it, from
    `summary_path`. The wall time counts steps that are redone (the summary may be newer than
    the checkpoint); the clock starts now. `choices` (auto's history, empty) gets the choices
    made before `start` and is the tally's `exchange_choices`."""
    summary = json.load(open(summary_path)) if start and os.path.exists(summary_path) else {}
    previous = saved if start and saved is not None else summary
    wall = max(float(previous.get("wall_time_s", 0.0)), float(summary.get("wall_time_s", 0.0)))
    choices.extend(c for c in previous.get("exchange_choices", []) if c["step"] < start)
    return cls(previous, float(previous.get("bytes_sent", 0.0)),
               int(previous.get("skipped_steps", 0)), wall, previous.get("time_to_target"),
               choices)

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
  """What the loop adds to a `Run`: checkpoints, metrics, the tally, the cadences."""

  run: Run
  ckpt: checkpoint.Checkpointer
  writer: MetricsWriter | NullWriter
  tally: _Tally

  def run_eval(self, step: int) -> None:
    """Evaluates at `step` (the BatchNorm statistics synced first, at the size of the stage
    that just trained)."""
    metrics = self.run.evaluate(step)
    self.writer.write("eval", step, metrics)
    self.tally.add_eval(self.run.config, step, metrics)

  def save(self, step: int) -> None:
    """Starts saving the state as `step` (BatchNorm statistics synced first) with the tally so
    far, without waiting for the files."""
    self.run.sync()
    self.ckpt.save(step, self.run.state, meta=self.tally.record(self.run.config))

  def stop(self, step: int, bar: tqdm, why: str) -> None:
    """Saves the state as `step` when the run stops early (`why`: SIGINT, SIGTERM), as it is:
    its BatchNorm statistics not synced, so that the resumed run equals an uninterrupted one."""
    bar.close()
    print(f"\n{'interrupted' if why == 'SIGINT' else why}: saving a checkpoint at step {step} "
          f"in {self.ckpt.directory}", flush=True)
    self.ckpt.save(step, self.run.state, meta=self.tally.record(self.run.config))

  def log(self, pending: list[dict[str, jax.Array]], done: int, bar: tqdm) -> None:
    """Writes the mean of the `pending` steps' metrics; stops a run that skips too often."""
    config, state = self.run.config, self.run.state
    logged = {**_mean(pending), **self.run.data.stats()}
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

  def after_step(self, done: int) -> None:
    """Evaluates and saves where the config asks, before the last step."""
    config, total = self.run.config, self.run.plan.total_steps
    if done < total and ((config.eval_every_steps and done % config.eval_every_steps == 0)
                         or done in self.run.plan.stage_ends):
      with self.run.aside():
        self.run_eval(done)
    if (config.checkpoint_every_steps and done % config.checkpoint_every_steps == 0
        and done < total):
      with self.run.aside():
        self.save(done)


def _train(job: _Job, start: int, show: bool, preemption: _Preemption
           ) -> tuple[int, str | None]:
  """Steps `start` to the end; returns (steps done, None or what stopped the run early:
  "SIGINT" for Ctrl-C, "SIGTERM" after the step in flight)."""
  run = job.run
  total = run.plan.total_steps
  bar = tqdm(total=total, initial=start, disable=not show, unit="step", dynamic_ncols=True)
  pending: list[dict[str, jax.Array]] = []
  try:
    for step in range(start, total):
      pending.extend(run.step(step, job.writer))
      done = step + 1
      if pending and (done % run.config.log_every_steps == 0 or done == total):
        job.log(pending, done, bar)
        pending = []
      bar.update(1)
      job.after_step(done)
      if preemption.reached(done):
        job.stop(done, bar, "SIGTERM")
        return done, "SIGTERM"
    return total, None
  except KeyboardInterrupt:
    step = int(run.state.step)
    job.stop(step, bar, "SIGINT")
    return step, "SIGINT"
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


def train_and_evaluate(config: Any, workdir: str, *, progress: bool = True) -> dict[str, Any]:
  """Trains `config` (a validated or raw config), writing metrics, checkpoints and
  `summary.json` under `workdir`; resumes from the latest checkpoint there. Returns the summary."""
  config = config_lib.validate(config)
  workdir = check_workdir(workdir)
  summary_path = os.path.join(workdir, "summary.json")
  choices: list[dict[str, Any]] = []  # algorithm "auto": its choices, carried on a resume
  run = Run(config, history=choices)
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), config.keep_checkpoints)
  with _Preemption() as preemption, contextlib.ExitStack() as cleanup:
    cleanup.callback(ckpt.close)  # waits for the last checkpoint and its manifest
    start, run.state = ckpt.restore_latest(run.state, lambda restored: place(restored, run.mesh))
    tally = _Tally.resume(summary_path, start, ckpt.meta(start), choices)
    lead = jax.process_index() == 0  # the process that writes metrics and the summary
    writer = MetricsWriter(workdir, resume_step=start) if lead else NullWriter()
    cleanup.callback(writer.close)
    job = _Job(run, ckpt, writer, tally)
    step, stopped_by = _train(job, start, progress and lead, preemption)
    if not stopped_by:
      job.run_eval(run.plan.total_steps)
      job.save(run.plan.total_steps)

  # --- the summary, once the last checkpoint is written
  summary = _summary(config, job.tally, step, run.plan.total_steps, stopped_by, run.mesh)
  summary["programs"] = run.programs_run()  # (this process's compiles, since its start)
  if lead:
    _write_json(summary_path, summary)
  return summary
