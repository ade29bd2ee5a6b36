"""The time-to-accuracy study's sparsejax runner: one process's share of a run of the trainer
`sparsejax train` builds, its steps compiled before the clock starts (the PyTorch peer's runner
is torch_peer.py beside it; the driver is run.py, the analysis analysis.py)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["JaxRun"]


class JaxRun:
  """One process's share of a sparsejax run: the trainer `sparsejax train` builds, compiled."""

  def __init__(self, config, mesh_shape: tuple[int, int]):
    import jax

    from sparsejax import data as data_lib
    from sparsejax.train import pipelined, schedules
    from sparsejax.train.auto import measuring
    from sparsejax.train.mesh import make_mesh
    from sparsejax.train.state import from_config
    from sparsejax.train.step import jit_eval_step, jit_sync_batch_stats, jit_train_step
    self.config = config
    self.data = data_lib.open_inputs(config)
    self.total = max(1, math.ceil(config.num_epochs * self.data.steps_per_epoch))
    # progressive resizing: each step's image size (`sparsejax train`'s rule); evaluated at
    # the size of the last step taken
    self.sizes = [schedules.image_size(config.data.resize_schedule,
                                       s / self.data.steps_per_epoch) for s in range(self.total)]
    self.size = self.sizes[0]
    placement = config.overlap.pipeline
    if placement and len(set(self.sizes)) > 1:
      raise ValueError("the study's pipelined runner trains at one image size; got "
                       f"data.resize_schedule={tuple(config.data.resize_schedule)} with "
                       f"overlap.pipeline={placement!r}")
    mesh, compute_mesh = (pipelined.meshes(*mesh_shape, placement) if placement
                          else (make_mesh(*mesh_shape), None))
    self.setup, self.state = from_config(config, mesh, self.data.num_classes,
                                         self.data.example(self.size),
                                         steps_per_epoch=self.data.steps_per_epoch,
                                         total_steps=self.total)
    self.sync = jit_sync_batch_stats(self.setup.mesh)
    first = self.batch(0)
    # one step per density level the run passes through (the trainer's choice, as `sparsejax
    # train`), compiled before the clock starts (PyTorch has nothing to compile)
    self.levels = [self.setup.density_level(s) for s in range(self.total)]
    self.jax = jax
    self.pipe = None
    if placement:  # the pipelined exchange (sparsejax.train.pipelined), compiled likewise
      self.state = pipelined.with_pending(self.setup, self.state, first)
      self.pipe = pipelined.from_config(config, self.setup, self.state,
                                        steps_per_epoch=self.data.steps_per_epoch,
                                        total_steps=self.total, compute_mesh=compute_mesh)
      self.pipe.compile(self.state, first, self.levels)
      self.auto, self.auto_measures, self.step_fns = None, False, {}
      self.eval_fn = jit_eval_step(self.setup, self.state)
      return
    extra = [self._dense_level(config)] if config.compression.algorithm == "auto" else []
    # (level, image size) -> the step compiled for it: the pairs the run passes through, and
    # auto's forms (its dense level, the final density) at every size
    pairs = list(zip(self.levels, self.sizes))
    pairs += [(level, size) for size in dict.fromkeys(self.sizes)
              for level in extra + ([self.levels[-1]] if extra else [])]
    self.step_fns = {}
    for level, size in dict.fromkeys(pairs):
      batch = first if size == self.size else self.batch(self.sizes.index(size))
      self.step_fns[level, size] = jit_train_step(self.setup, self.state, level).lower(
          self.state, *batch).compile()
    self.auto = self._auto(config, first)
    self.auto_measures = self.auto is not None and measuring(config)
    self.eval_fn = jit_eval_step(self.setup, self.state)

  def _dense_level(self, config) -> int:
    from sparsejax.train import optimizer as optimizer_lib
    from sparsejax.train import schedules
    density = schedules.density(config.compression, self.data.steps_per_epoch)
    return optimizer_lib.dense_level_index(config, density)

  def _auto(self, config, first):
    """Algorithm "auto"'s chooser, its probes and both forms' steps run once before the
    clock (compiled: the first measurement, on the clock, times both forms)."""
    if config.compression.algorithm != "auto":
      return None
    from sparsejax.train.auto import AutoExchange
    auto = AutoExchange(config, self.setup, self.state, sparse_level=self.setup.density_level,
                        dense_level=self._dense_level(config), history=[],
                        steps_per_epoch=self.data.steps_per_epoch, total_steps=self.total,
                        compiled=lambda level: self.step_fns[level, self.size])
    auto.compile(self.state, first)
    return auto

  def aside(self):
    """A context for work between steps that auto leaves out of the steps' time."""
    import contextlib
    return self.auto.paused(self.state) if self.auto is not None else contextlib.nullcontext()

  def batch(self, step: int, size_step: int | None = None):
    """Batch `step` at the image size of step `size_step` (default `step`)."""
    from sparsejax.train.state import shard_batch
    size = self.sizes[min(step if size_step is None else size_step, self.total - 1)]
    return shard_batch(self.setup.mesh, *self.data.train_batch(step, size))

  def step(self, step: int, wait: bool = False, level_step: int | None = None):
    """One step on batch `step`, at the density level and image size of step `level_step`
    (default `step`)."""
    at = step if level_step is None else level_step
    self.size = self.sizes[min(at, self.total - 1)]
    batch = self.batch(step, at)
    if self.pipe is not None:
      return self._pipelined_step(step, batch, wait, level_step)
    if self.auto is not None and level_step is None:  # auto measures and chooses (on the clock)
      from sparsejax.train.metrics import NullWriter
      self.auto.before_step(step, self.state, batch, NullWriter())
      level = self.auto.level(step)
    elif self.auto is not None and not self.auto_measures:  # forms fixed by step
      level = self.auto.level(min(step if level_step is None else level_step, self.total - 1))
    else:
      level = self.levels[min(step if level_step is None else level_step, self.total - 1)]
    self.state, metrics = self.step_fns[level, self.size](self.state, *batch)
    if wait:
      self.jax.block_until_ready(self.state)
    return metrics

  def _pipelined_step(self, step: int, batch, wait: bool, level_step: int | None):
    """A pipelined step: the loop's (`level_step` None), or the steady step at the level of
    `level_step` (the sweep: the gradient computed while the pending one is applied)."""
    if level_step is None:
      self.state, metrics = self.pipe(step, self.state, *batch)
      metrics = metrics[-1] if metrics else None
    else:
      level = self.levels[min(level_step, self.total - 1)]
      self.state, metrics = self.pipe.steady(self.state, batch, level)
    if wait:
      self.jax.block_until_ready(self.state)
    return metrics

  def pipeline_phases(self, step: int, level_step: int, reps: int) -> dict[str, float]:
    """The pipelined step's halves at the level of `level_step`, each alone (the gradient, then
    the exchange and update: medians of `reps`, seconds), and a timeline of `reps` steady steps
    with both dispatched together: when each half ends, seen by a thread waiting on it (medians,
    seconds from the dispatch)."""
    import statistics
    import threading
    import time
    jax, pipe = self.jax, self.pipe
    level = self.levels[min(level_step, self.total - 1)]
    alone: dict[str, list[float]] = {"compute_s": [], "exchange_s": []}
    ends: dict[str, list[float]] = {"compute_end_s": [], "exchange_end_s": []}
    for i in range(reps):
      batch = self.batch(step + i)
      t0 = time.perf_counter()
      pending = jax.block_until_ready(pipe.gradient(self.state, batch))
      alone["compute_s"].append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      self.state = jax.block_until_ready(pipe.apply(self.state, level)[0])._replace(
          pending=pending)
      alone["exchange_s"].append(time.perf_counter() - t0)
    for i in range(reps):
      batch = self.batch(step + reps + i)
      t0 = time.perf_counter()
      pending = pipe.gradient(self.state, batch)
      state, _ = pipe.apply(self.state, level)
      waiters = [threading.Thread(target=lambda k=k, x=x, t0=t0: (
          jax.block_until_ready(x), ends[k].append(time.perf_counter() - t0)))
          for k, x in (("compute_end_s", pending), ("exchange_end_s", state))]
      for w in waiters:
        w.start()
      for w in waiters:
        w.join()
      self.state = state._replace(pending=pending)
    return {k: statistics.median(v) for k, v in {**alone, **ends}.items()}

  def wait(self) -> None:
    self.jax.block_until_ready(self.state)

  def evaluate(self) -> dict[str, float]:
    from sparsejax.train.loop import evaluate
    # (as `sparsejax train`: the BatchNorm statistics averaged over the workers first, and the
    # run goes on from them)
    self.state = self.sync(self.state)
    return evaluate(self.setup, self.eval_fn, self.state, self.data, self.size)

  def set_step(self, step: int) -> None:
    """Moves the step counters: the train state's (learning rate) and every worker's
    compression state's (the density schedule)."""
    def put(old):
      value = np.full(old.shape, step, np.int32)
      return self.jax.make_array_from_callback(old.shape, old.sharding, lambda i: value[i])
    from sparsejax.train.optimizer import replace_parts
    comm = self.state.comm_state  # the chain's `exchange` part
    self.state = self.state._replace(step=put(self.state.step), opt_state=replace_parts(
        self.state.opt_state, exchange=comm._replace(count=put(comm.count))))
