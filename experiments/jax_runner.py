"""The time-to-accuracy study's sparsejax runner: one process's share of a run of the trainer
`sparsejax train` builds, its steps compiled before the clock starts (the PyTorch peer's runner
is experiments/torch_peer.py; the driver and the analysis are experiments/time_to_accuracy.py)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["JaxRun"]


class JaxRun:
  """One process's share of a sparsejax run: the trainer `sparsejax train` builds, compiled."""

  def __init__(self, config, mesh_shape: tuple[int, int]):
    import jax

    from sparsejax import data as data_lib
    from sparsejax.train.mesh import make_mesh
    from sparsejax.train.state import from_config
    from sparsejax.train.step import jit_eval_step, jit_train_step
    self.config = config
    self.data = data_lib.open_inputs(config)
    self.total = max(1, math.ceil(config.num_epochs * self.data.steps_per_epoch))
    mesh = make_mesh(*mesh_shape)
    self.setup, self.state = from_config(config, mesh, self.data.num_classes,
                                         self.data.example(None),
                                         steps_per_epoch=self.data.steps_per_epoch,
                                         total_steps=self.total)
    first = self.batch(0)
    # one step per density level the run passes through (the trainer's choice, as `sparsejax
    # train`), compiled before the clock starts (PyTorch has nothing to compile)
    self.levels = [self.setup.density_level(s) for s in range(self.total)]
    self.auto = self._auto(config, first)
    extra = [self.auto.dense_level] if self.auto else []
    self.step_fns = {level: jit_train_step(self.setup, self.state, level).lower(
        self.state, *first).compile() for level in dict.fromkeys(self.levels + extra)}
    self.eval_fn = jit_eval_step(self.setup, self.state)
    self.jax = jax

  def _auto(self, config, first):
    """Algorithm "auto"'s chooser, its probes compiled (one measurement before the clock)."""
    if config.compression.algorithm != "auto":
      return None
    from sparsejax.train import optimizer as optimizer_lib
    from sparsejax.train import schedules
    from sparsejax.train.auto import AutoExchange
    density = schedules.density(config.compression, self.data.steps_per_epoch)
    auto = AutoExchange(config, self.setup, self.state, sparse_level=self.setup.density_level,
                        dense_level=optimizer_lib.dense_level_index(config.compression, density),
                        history=[])
    auto.measure(self.state, first)
    return auto

  def batch(self, step: int):
    from sparsejax.train.state import shard_batch
    return shard_batch(self.setup.mesh, *self.data.train_batch(step, None))

  def step(self, step: int, wait: bool = False, level_step: int | None = None):
    """One step on batch `step`, at the density level of step `level_step` (default `step`)."""
    batch = self.batch(step)
    if self.auto is not None and level_step is None:  # auto measures and chooses (on the clock)
      from sparsejax.train.metrics import NullWriter
      self.auto.before_step(step, self.state, batch, NullWriter())
      level = self.auto.level(step)
    else:
      level = self.levels[min(step if level_step is None else level_step, self.total - 1)]
    self.state, metrics = self.step_fns[level](self.state, *batch)
    if wait:
      self.jax.block_until_ready(self.state)
    return metrics

  def wait(self) -> None:
    self.jax.block_until_ready(self.state)

  def evaluate(self) -> dict[str, float]:
    from sparsejax.train.loop import evaluate
    return evaluate(self.setup, self.eval_fn, self.state, self.data, None)

  def set_step(self, step: int) -> None:
    """Moves the step counters: the train state's (learning rate) and every worker's
    compression state's (the density schedule)."""
    def put(old):
      value = np.full(old.shape, step, np.int32)
      return self.jax.make_array_from_callback(old.shape, old.sharding, lambda i: value[i])
    opt = self.state.opt_state  # apply_if_finite_across((compressor, norm, optimizer))
    comm = opt.inner_state[0]
    inner = (comm._replace(count=put(comm.count)), *opt.inner_state[1:])
    self.state = self.state._replace(step=put(self.state.step),
                                     opt_state=opt._replace(inner_state=inner))
