"""`train_and_evaluate(config, workdir)`: the main job, top to bottom."""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from sparsejax import comm, models
from sparsejax import data as data_lib
from sparsejax.train import checkpoint, schedules
from sparsejax.train import config as config_lib
from sparsejax.train import step as step_lib
from sparsejax.train.mesh import make_mesh
from sparsejax.train.metrics import MetricsWriter, NullWriter

__all__ = ["train_and_evaluate", "build_trainer", "evaluate", "check_workdir",
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


def build_trainer(config: Any, mesh, num_classes: int, steps_per_epoch: int, total_steps: int
                  ) -> step_lib.Trainer:
  """The `Trainer` a validated config describes: model, compression, fused optimizer, schedules."""
  m = config.model
  if m.name in models.SEQUENCE_MODELS:
    extra = {k: m[k] for k in ("d_model", "num_heads", "d_ff", "num_layers") if m[k]}
    if m.dropout >= 0:
      extra["dropout"] = m.dropout
    # positions: a language model sees seq_len tokens, a translation model seq_len per side
    extra["max_len"] = (config.data.seq_len if m.name == "transformer_lm"
                        else max(256, config.data.seq_len))
  elif m.name == "mlp":
    extra = {"hidden": tuple(m.hidden)} if m.hidden else {}
  else:
    extra = {"num_filters": m.num_filters} if m.num_filters else {}
  model = models.build(config.model.name, num_classes=num_classes, dtype=config.model.dtype,
                       **extra)
  lr = schedules.learning_rate(config.optimizer, steps_per_epoch, total_steps)
  opt, corrected = config.optimizer, {}
  if (config.compression.momentum_correction
      and config.compression.algorithm in comm.SPARSE_ALGORITHMS):
    # DGC momentum correction: the momentum moves from the optimizer into the compressor, and
    # the weight decay into the gradient before it (so it passes through the momentum too)
    corrected = {"momentum": opt.momentum, "nesterov": opt.nesterov,
                 "momentum_masking": config.compression.momentum_masking,
                 "weight_decay": opt.weight_decay}
    opt = ml_collections.ConfigDict(opt.to_dict())
    opt.momentum, opt.nesterov, opt.weight_decay = 0.0, False, 0.0
  return step_lib.Trainer(
      model, mesh, config.compression,
      lambda layout: step_lib.build_optimizer(opt, lr, layout), **corrected,
      num_classes=num_classes, label_smoothing=config.label_smoothing,
      density_schedule=schedules.density(config.compression, steps_per_epoch), learning_rate=lr,
      seed=config.seed)


def evaluate(trainer: step_lib.Trainer, eval_step, state, data: data_lib.Inputs,
             size: int | None) -> dict[str, float]:
  """The eval metrics of `state` over the whole eval set (padding weighted out)."""
  totals: dict[str, float] = {}
  for images, labels, weights in data.eval_batches(size):
    sums = jax.device_get(eval_step(state, *trainer.shard_batch(images, labels, weights)))
    for k, v in sums.items():
      totals[k] = totals.get(k, 0.0) + float(v)
  count = totals.pop("count")
  return {k: v / count for k, v in totals.items()}


def _mean(rows: list[dict[str, Any]]) -> dict[str, float]:
  rows = jax.device_get(rows)
  out = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
  out["skipped"] = float(np.sum([r["skipped"] for r in rows]))
  return out


def train_and_evaluate(config: Any, workdir: str, *, progress: bool = True) -> dict[str, Any]:
  """Trains `config` (a validated or raw config), writing metrics, checkpoints and
  `summary.json` under `workdir`; resumes from the latest checkpoint there. Returns the summary."""
  # --- checks that need no compilation
  config = config_lib.validate(config)
  workdir = check_workdir(workdir)
  mesh = make_mesh(config.mesh.nodes, config.mesh.local)
  workers = mesh.size
  if config.batch_size % workers:
    raise ValueError(f"global batch_size {config.batch_size} is not divisible by the "
                     f"{workers} devices of the mesh")
  data = data_lib.open_inputs(config)
  steps_per_epoch = data.steps_per_epoch
  total_steps = max(1, math.ceil(config.num_epochs * steps_per_epoch))

  # --- model, transforms, state
  trainer = build_trainer(config, mesh, data.num_classes, steps_per_epoch, total_steps)
  state = trainer.init(config.seed, data.example(
      schedules.image_size(config.data.resize_schedule, 0.0)))
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), config.keep_checkpoints)
  start = ckpt.latest_step() or 0
  if start:
    state = trainer.place(ckpt.restore(start, state))
  train_steps: dict[int | None, Any] = {}  # one compiled step per density level

  def train_step(step, state, *batch):
    level = trainer.density_level(step)
    if level not in train_steps:
      train_steps[level] = trainer.train_step_fn(state, level)
    return train_steps[level](state, *batch)

  eval_step = trainer.eval_step_fn(state)
  sync = trainer.sync_batch_stats_fn()
  lead = jax.process_index() == 0  # the process that writes metrics and the summary
  writer = MetricsWriter(workdir, resume_step=start) if lead else NullWriter()
  evals: list[tuple[int, dict[str, float]]] = []
  summary_path = os.path.join(workdir, "summary.json")
  previous = json.load(open(summary_path)) if start and os.path.exists(summary_path) else {}
  bytes_sent = float(previous.get("bytes_sent", 0.0))
  skipped_steps = int(previous.get("skipped_steps", 0))
  wall_before = float(previous.get("wall_time_s", 0.0))
  time_to_target = previous.get("time_to_target")
  stage_ends = ({round(start * steps_per_epoch) for start, _, _ in schedules.resize_stages(
      config.data.resize_schedule, config.num_epochs)[1:]}
      if config.eval_at_stage_boundaries else set())

  def run_eval(state, step):
    nonlocal time_to_target
    state = sync(state)
    # the size of the stage that just trained (at a stage's end, not the next stage's)
    size = schedules.image_size(config.data.resize_schedule, max(0, step - 1) / steps_per_epoch)
    metrics = evaluate(trainer, eval_step, state, data, size)
    writer.write("eval", step, metrics)
    evals.append((step, metrics))
    target = config.target_metric
    if target and time_to_target is None and metrics.get(target, -np.inf) >= config.target_value:
      time_to_target = {"metric": target, "value": metrics[target], "target": config.target_value,
                        "step": step, "wall_time_s": wall_before + time.time() - t0}
    return state

  def save(state, step):
    state = sync(state)
    ckpt.save(step, state)
    return state

  # --- the loop
  t0 = time.time()
  bar = tqdm(total=total_steps, initial=start, disable=not (progress and lead), unit="step",
             dynamic_ncols=True)
  pending: list[dict[str, jax.Array]] = []
  step = start
  interrupted = False
  try:
    for step in range(start, total_steps):
      # progressive resizing: the size comes from the schedule, each size compiles once
      size = schedules.image_size(config.data.resize_schedule, step / steps_per_epoch)
      images, labels = data.train_batch(step, size)
      state, metrics = train_step(step, state, *trainer.shard_batch(images, labels))
      pending.append(metrics)
      done = step + 1
      if done % config.log_every_steps == 0 or done == total_steps:
        logged = {**_mean(pending), **data.stats()}
        bytes_sent += logged["bytes_sent"] * len(pending)
        skipped_steps += int(logged["skipped"])
        pending = []
        writer.write("train", done, logged)
        bar.set_postfix(loss=f"{logged['loss']:.3f}", acc=f"{logged['accuracy']:.3f}",
                        MB_per_step=f"{logged['bytes_sent'] / 1e6:.2f}")
        if int(state.consecutive_skips) >= config.max_consecutive_skips:
          raise TooManySkippedSteps(
              f"{int(state.consecutive_skips)} consecutive steps had non-finite gradients "
              f"(max_consecutive_skips = {config.max_consecutive_skips}); stopping at step "
              f"{done}. The last good checkpoint is step {ckpt.latest_step()} in {ckpt.directory}")
      bar.update(1)
      if done < total_steps and ((config.eval_every_steps and done % config.eval_every_steps == 0)
                                 or done in stage_ends):
        state = run_eval(state, done)
      if (config.checkpoint_every_steps and done % config.checkpoint_every_steps == 0
          and done < total_steps):
        state = save(state, done)
    step = total_steps
  except KeyboardInterrupt:
    interrupted = True
    step = int(state.step)
    bar.close()
    print(f"\ninterrupted: saving a checkpoint at step {step} in {ckpt.directory}")
    save(state, step)
  finally:
    bar.close()
  if not interrupted:
    state = run_eval(state, total_steps)
    state = save(state, total_steps)
  writer.close()
  ckpt.close()

  # --- the summary
  candidates = [{"step": s, **m} for s, m in evals]
  if previous.get("best_eval"):
    candidates.append(previous["best_eval"])
  # best: the highest accuracy for classifiers, the lowest loss for sequence models
  if config.model.name in models.SEQUENCE_MODELS:
    best = min(candidates, key=lambda e: e["loss"]) if candidates else None
  else:
    best = max(candidates, key=lambda e: e["accuracy"]) if candidates else None
  summary = {
      "config": config.to_dict(), "steps": int(step), "total_steps": total_steps,
      "interrupted": interrupted,
      "wall_time_s": wall_before + time.time() - t0,
      "time_to_target": time_to_target,
      "final_eval": evals[-1][1] if evals and not interrupted else None,
      "best_eval": best,
      "bytes_sent": bytes_sent, "skipped_steps": skipped_steps,
      "devices": workers, "mesh": dict(mesh.shape),
  }
  if lead:
    tmp = summary_path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(summary, f, indent=1, default=str)
    os.replace(tmp, summary_path)
  return summary
