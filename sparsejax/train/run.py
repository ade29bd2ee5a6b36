"""`Run`: one run of a config, built once: its plan, inputs, mesh, model and chain, state and
compiled steps. `train_and_evaluate` drives it; a study or a benchmark that trains, times a step
or a form at a link, or evaluates uses it as it is, so that there is one trainer.

    run = Run(config)              # a validated or raw config
    run.compile()                  # optional: every program the run passes through, now
    for step in range(run.plan.total_steps):
      run.step(step)               # the loop's step: the plan's (or auto's) form and level
    metrics = run.evaluate()

The train state is `run.state` (placed on `run.mesh`); `run.step` replaces it. `step_at(step,
at)` runs batch `step` at the form, density level and image size of step `at` (a study's sweep
holds one level while it times the link); `set_step` moves the step counters; `aside()` is a
context for work between steps that `auto` leaves out of the steps' time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from sparsejax import data as data_lib
from sparsejax.train import auto as auto_lib
from sparsejax.train import config as config_lib
from sparsejax.train import pipelined as pipeline_lib
from sparsejax.train import step as step_lib
from sparsejax.train.metrics import NullWriter
from sparsejax.train.optimizer import replace_parts
from sparsejax.train.plan import Plan, make_plan
from sparsejax.train.state import TrainSetup, from_config, shard_batch

__all__ = ["Run", "evaluate"]


def evaluate(setup: TrainSetup, eval_step: Callable, state: Any, data: data_lib.Inputs,
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


class Run:
  """One run of a config (see the module).

  Attributes:
    config: the validated config. plan: its `Plan` (every duration in steps). data: the
      inputs (`sparsejax.data.Inputs`). mesh: the ("node", "local") mesh of the state.
    setup, state: the `TrainSetup` and the current `TrainState`.
    auto: algorithm "auto"'s chooser (`auto.AutoExchange`), else None.
    pipeline: the pipelined exchange (`pipelined.Pipeline`) where `overlap.pipeline` is set,
      else None.
  """

  def __init__(self, config: Any, *, history: list[dict[str, Any]] | None = None):
    """`history`: algorithm "auto"'s choices so far (a resumed run's), appended to."""
    config = config_lib.validate(config)
    self.config = config
    placement = config.overlap.pipeline
    self.mesh, compute_mesh = pipeline_lib.meshes(config.mesh.nodes, config.mesh.local,
                                                  placement)
    if config.batch_size % self.mesh.size:
      raise ValueError(f"global batch_size {config.batch_size} is not divisible by the "
                       f"{self.mesh.size} devices of the mesh")
    self.data = data_lib.open_inputs(config)
    self.plan: Plan = make_plan(config, self.data.steps_per_epoch,
                                (self.mesh.shape["node"], self.mesh.shape["local"]))
    if jax.process_index() == 0:
      for note in self.plan.notes():
        print(f"sparsejax plan: {note}", flush=True)
    self._size = self.plan.image_size(0)
    self.setup, self.state = from_config(config, self.plan, self.mesh, self.data.num_classes,
                                         self.data.example(self._size))
    self._compiled: dict[Any, Callable] = {}  # (level, image size) -> its compiled train step
    self.compile_s: dict[Any, float] = {}  # (level, image size) -> seconds its compile took
    self.programs: dict[Any, dict[str, Any]] = {}  # the programs run, in order (`programs_run`)
    self.pipeline = None
    if placement:  # the pipelined exchange carries the computed gradient in the state
      self.state = pipeline_lib.with_pending(self.setup, self.state, self.batch(0))
      self.pipeline = pipeline_lib.from_config(config, self.plan, self.setup, self.state,
                                               compute_mesh)
    self.auto = None
    if config.compression.algorithm == "auto":
      self.auto = auto_lib.AutoExchange(config, self.plan, self.setup,
                                        history=[] if history is None else history)
    self._eval = step_lib.jit_eval_step(self.setup, self.state)
    self._sync = step_lib.jit_sync_batch_stats(self.mesh)

  @property
  def size(self) -> int | None:
    """The image size of the step that ran last (the first step's before any; None: the
    data's own)."""
    return self._size

  # --- programs

  def program(self, level: int | None, batch: tuple[jax.Array, ...]) -> Callable:
    """`(state, inputs, labels) -> (state, metrics)`: the train step at density `level` for
    the current image size, compiled for `batch`'s shapes (ahead where `compile` did, else now,
    timed: `compile_s`; the state donated)."""
    key = (level, self._size)
    if key not in self._compiled:
      t0 = time.perf_counter()
      self._compiled[key] = step_lib.jit_train_step(self.setup, self.state, level).lower(
          self.state, *batch).compile()
      self.compile_s[key] = time.perf_counter() - t0
    return self._compiled[key]

  def _run_program(self, step: int, level: int | None, batch: tuple[jax.Array, ...]
                   ) -> dict[str, jax.Array]:
    """Runs the train step at `level` on `batch` (replacing `state`), recording the program's
    first step and telling auto which level ran (with the program's compile seconds the first
    time)."""
    fn = self.program(level, batch)
    key = (level, self._size)
    first = key not in self.programs
    if first:
      self.programs[key] = {"level": level, "size": self._size, "first_step": step,
                            "compile_s": self.compile_s[key],
                            "form": None if self.auto is None else self.auto.form_at(step)}
    if self.auto is not None:
      self.auto.ran(level, self.compile_s[key] if first else None)
    self.state, metrics = fn(self.state, *batch)
    return metrics

  def programs_run(self) -> list[dict[str, Any]]:
    """The train steps the run has taken, each at its first step: {"level", "size",
    "first_step", "compile_s" (its compilation, ahead or at that step), "form" (auto's form in
    force at that step, a density warm-up's level that runs the dense form's exchange
    included; None for a fixed algorithm)}."""
    return list(self.programs.values())

  def compile(self) -> None:
    """Compiles, now, every train step the run passes through (each density level at each
    image size it meets; under "auto" both forms at every size and the dense form's steady
    step; auto's probes compile in its first measurement, which counts them), timing each
    (`compile_s`): for a caller that keeps compilation off its clock. Nothing runs on
    `state`."""
    plan = self.plan
    if self.pipeline is not None:
      if len(plan.stages) > 1:
        raise ValueError("the pipelined exchange compiles ahead at one image size; got "
                         f"data.resize_schedule={tuple(self.config.data.resize_schedule)}")
      self.pipeline.compile(self.state, self.batch(0),
                            [plan.level(s) for s in range(plan.total_steps)])
      return
    changes = sorted({t for table in (plan.stages, plan.level_steps, plan.forms)
                      for s, _ in table for t in (s, s + 1) if t < plan.total_steps})
    # (and the step after each: the dense form's steady step follows its first)
    pairs = {(plan.level(s), plan.image_size(s)): s for s in reversed(changes)}
    if self.auto is not None:
      final = plan.sparse_level(plan.total_steps - 1)
      for first, size in plan.stages:
        for level in (plan.dense_level, plan.steady_level, final):
          pairs.setdefault((level, size), first)
    now = self._size
    for (level, size), step in pairs.items():
      if (level, size) not in self._compiled:
        self._size = size
        self.program(level, self.batch(step))
    self._size = now

  # --- steps

  def batch(self, step: int, at: int | None = None) -> tuple[jax.Array, ...]:
    """Training batch `step` at the image size of step `at` (default `step`), sharded."""
    size = self.plan.image_size(min(step if at is None else at, self.plan.total_steps - 1))
    return shard_batch(self.mesh, *self.data.train_batch(step, size))

  def step(self, step: int, writer: Any = None) -> list[dict[str, jax.Array]]:
    """The loop's step `step` on its batch: the form and level the plan gives it (auto's
    choice where it measures; `writer` gets auto's choices), pipelined where configured.
    Replaces `state`; returns the metrics of each update made (none or two in a pipeline's
    first and last steps), not waited for."""
    self._size = self.plan.image_size(step)
    batch = self.batch(step)
    if self.pipeline is not None:
      self.state, metrics = self.pipeline(step, self.state, *batch)
      return metrics
    if self.auto is not None:
      self.auto.before_step(step, self.state, batch, writer or NullWriter())
      level = self.auto.level(step)
    else:
      level = self.plan.level(step)
    return [self._run_program(step, level, batch)]

  def step_at(self, step: int, at: int) -> dict[str, jax.Array] | None:
    """Batch `step` at the density level and image size of step `at` (auto: its form fixed
    by the plan there, or its form in force): what a sweep times. Under a pipeline, the
    steady pipelined step at that level. Not waited for."""
    at = min(at, self.plan.total_steps - 1)
    self._size = self.plan.image_size(at)
    batch = self.batch(step, at)
    level = self.auto.level(at) if self.auto is not None else self.plan.level(at)
    if self.pipeline is not None:
      self.state, metrics = self.pipeline.steady(self.state, batch, level)
      return metrics
    return self._run_program(at, level, batch)  # (recorded at the step whose program it is)

  def wait(self) -> None:
    """Blocks until every step dispatched so far is done."""
    jax.block_until_ready(self.state)

  def aside(self) -> Any:
    """A context for work between steps (an evaluation, a checkpoint) that algorithm "auto"
    leaves out of the steps' time."""
    return self.auto.paused(self.state) if self.auto is not None else contextlib.nullcontext()

  # --- between steps

  def sync(self) -> None:
    """Every worker's BatchNorm running statistics replaced by their mean (in `state`)."""
    self.state = self._sync(self.state)

  def evaluate(self, step: int | None = None) -> dict[str, float]:
    """The eval metrics over the whole eval set after `sync`, at the image size of the step
    before `step` (default: of the step that ran last): the size the run has trained at."""
    self.sync()
    size = self._size if step is None else self.plan.image_size(max(0, step - 1))
    return evaluate(self.setup, self._eval, self.state, self.data, size)

  def set_step(self, step: int) -> None:
    """Moves the step counters to `step`: the train state's (the learning rate) and every
    worker's exchange state's (its density schedule)."""
    def put(old):
      value = np.full(old.shape, step, np.int32)
      return jax.make_array_from_callback(old.shape, old.sharding, lambda i: value[i])
    exchange = self.state.comm_state
    self.state = self.state._replace(step=put(self.state.step), opt_state=replace_parts(
        self.state.opt_state, exchange=exchange._replace(count=put(exchange.count))))
