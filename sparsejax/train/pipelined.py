"""A one-step pipelined exchange: step t's gradient is computed while step t-1's is exchanged and
applied (Pipe-SGD; DGC and LAGS-SGD overlap the same way). Config `overlap.pipeline`.

Loop step t computes g_t at the current parameters p_t and applies g_{t-1}: p_{t+1} = p_t +
update(g_{t-1}), so every gradient is applied one step late (staleness 1; the first step only
computes, the last one also applies its own gradient, so a run makes as many updates as it has
steps). Nothing in either half waits for the other, so the link can work while the backward
pass computes. `state.pending` carries the computed, unapplied gradient (with its BatchNorm
statistics and metrics) from one step to the next, and through a checkpoint.

Two placements of the same arithmetic:
- "program": both halves in one jitted program. On GPU, XLA's latency-hiding scheduler runs the
  exchange's collectives asynchronously beside the gradient's kernels. On XLA:CPU they run one
  after the other (measured: docs/overlap.md), so there it only checks the arithmetic.
- "device": each worker is two devices of its process (one mesh per half, paired by position);
  the gradient runs on the compute mesh, the exchange and update on the state's mesh, as two
  programs dispatched back to back. XLA:CPU runs two devices' programs at once (a gloo
  collective blocks a thread of its device, not the other device): the CPU path. The parameters
  go to the compute devices and the gradient back as local copies, never over the link.

A step's logged metrics are those of the gradient it applies (computed one step earlier).

Weight prediction (`predict`, config `overlap.predict`): g_t is taken not at p_t
but at a guess of p_{t+1}, where it will be applied. With a perfect guess the run is the
unpipelined run's, step for step.
- "last" (SpecTrain, Chen et al. 2018; PipeMare): p_t + (p_t - p_{t-1}), the parameters
  extrapolated by the last update; right when consecutive updates are alike, as momentum and
  Adam's first moment make them. `Pending.update` carries that last update. Its error,
  u_t - u_{t-1}, moves with the gradient being applied.
- "local": p_t + the optimizer's update (its state as the exchange half finds it) fed the
  worker's own g_{t-1} instead of the workers' mean: exactly p_{t+1} but for the part of the mean
  the worker has not seen (g_i - mean, zero-mean noise uncorrelated with the mean gradient
  where workers' batches are independent). Costs one optimizer update on the compute half;
  needs the optimizer alone (`optimizer_lib.optimizer_behind_exchange`: no momentum correction).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparsejax.train import optimizer as optimizer_lib
from sparsejax.train import step as step_lib
from sparsejax.train.mesh import WORKERS, make_mesh
from sparsejax.train.state import TrainSetup, TrainState, state_specs

__all__ = ["PLACEMENTS", "PREDICTIONS", "Pending", "split_devices", "with_pending", "Pipeline",
           "from_config", "meshes"]

PLACEMENTS = ("program", "device")
PREDICTIONS = ("", "last", "local")  # weight prediction: off, or how (see the module)


class Pending(NamedTuple):
  """A computed gradient not yet applied, per worker (leading axis = number of workers).

  grads: float32[workers, padded_size]. batch_stats: the BatchNorm statistics its forward pass
  produced. metrics: {name: float32[workers]}, its loss and accuracies on the worker's slice.
  update: float32[workers, padded_size], the last update applied to the parameters (each worker
  the same; zeros unless the pipeline predicts weights).
  """

  grads: jax.Array
  batch_stats: Any
  metrics: dict[str, jax.Array]
  update: jax.Array


def split_devices(devices: Sequence[jax.Device]) -> tuple[list[jax.Device], list[jax.Device]]:
  """(state devices, compute devices): each process's devices (by id) in pairs, the first of a
  pair holds the state and runs the exchange, the second computes gradients. Each process must
  have an even number of devices."""
  by_process: dict[int, list[jax.Device]] = {}
  for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
    by_process.setdefault(d.process_index, []).append(d)
  odd = {p: len(ds) for p, ds in by_process.items() if len(ds) % 2}
  if odd:
    raise ValueError(f"overlap.pipeline='device' needs an even number of devices per "
                     f"process (two per worker), got {odd} (process: devices); on CPU set "
                     "mesh.num_devices to twice the workers, or launch with "
                     "--devices-per-proc 2 x the workers per process")
  flat = [d for ds in by_process.values() for d in ds]
  return flat[0::2], flat[1::2]


def _pending(setup: TrainSetup, params, batch_stats, step, inputs, labels, update,
             shift: jax.Array | None = None) -> Pending:
  """One worker's gradient as a `Pending` (inside `shard_map`; `batch_stats` and `update` per
  worker), taken at `params + shift` (at `params` if None); the update passed through."""
  at = params if shift is None else params + shift
  grads, stats, metrics = step_lib.gradient(setup, step, at, step_lib._first(batch_stats),
                                            inputs, labels)
  return Pending(grads[None], step_lib._stack(stats), step_lib._stack(metrics), update)


def with_pending(setup: TrainSetup, state: TrainState, example: Sequence[jax.Array]
                 ) -> TrainState:
  """`state` with a zero `Pending` of the right shapes (placed per worker on `setup.mesh`) for
  the batch `example` (inputs, labels)."""
  def body(state, inputs, labels):
    return _pending(setup, state.params, state.batch_stats, state.step, inputs, labels,
                    jnp.zeros_like(state.params)[None])

  specs = state_specs(state)
  shapes = jax.eval_shape(jax.shard_map(
      body, mesh=setup.mesh, in_specs=(specs, P(WORKERS), P(WORKERS)), out_specs=P(WORKERS),
      check_vma=False), state, *example)
  sharding = NamedSharding(setup.mesh, P(WORKERS))
  zeros = jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), sharding), shapes)
  return state._replace(pending=zeros)


def _move(x: jax.Array, to: Mesh) -> jax.Array:
  """`x` (on a mesh of the same shape as `to`) on `to`, same spec: each local shard copied to
  the device at its mesh position (within the process: no collective)."""
  pairs = dict(zip(x.sharding.mesh.devices.flat, to.devices.flat, strict=True))
  shards = [jax.device_put(s.data, pairs[s.device]) for s in x.addressable_shards]
  return jax.make_array_from_single_device_arrays(
      x.shape, NamedSharding(to, x.sharding.spec), shards)


def _shard_mapped(mesh: Mesh, body: Callable, in_specs: Any, out_specs: Any, **jit: Any
                  ) -> Callable:
  fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), out_specs,
                           is_leaf=lambda x: isinstance(x, P))
  return jax.jit(fn, out_shardings=shardings, **jit)


class Pipeline:
  """`(step, state, *batch) -> (state, metrics)` for the train loop, pipelined (see the module).

  setup: the run's setup (its mesh holds the state). state_like: a state with its `pending`.
  level_of: `step -> density level | None`, as the loop's. total_steps: where the last step
  also applies its own gradient. placement: "program" or "device". compute_mesh: the compute
  devices' mesh, same shape as `setup.mesh` (placement "device"). start: the first pipelined
  step (the steps before it run unpipelined, `step.train_step`: the early, fast-moving steps
  are where a late gradient costs most; the start step only computes). predict: weight
  prediction, one of `PREDICTIONS` (see the module). optimizer: for "local", the optimizer
  behind the exchange in `setup.tx` (its state the chain's `optimizer` part).
  """

  def __init__(self, setup: TrainSetup, state_like: TrainState, level_of: Callable,
               total_steps: int, placement: str = "device", compute_mesh: Mesh | None = None,
               start: int = 0, predict: str = "",
               optimizer: optax.GradientTransformation | None = None):
    if placement not in PLACEMENTS:
      raise ValueError(f"pipeline placement {placement!r}: allowed {', '.join(PLACEMENTS)}")
    if predict not in PREDICTIONS:
      raise ValueError(f"pipeline weight prediction {predict!r}: allowed '' (off), 'last' or "
                       "'local'")
    if predict == "local" and optimizer is None:
      raise ValueError("pipeline weight prediction 'local' needs the optimizer behind the "
                       "exchange (optimizer_lib.optimizer_behind_exchange)")
    if placement == "device" and (compute_mesh is None
                                  or compute_mesh.devices.shape != setup.mesh.devices.shape):
      raise ValueError("pipeline placement 'device' needs a compute mesh shaped as the state's")
    if start < 0:
      raise ValueError(f"pipeline start step must be >= 0, got {start}")
    self.setup, self.level_of, self.total, self.start = setup, level_of, total_steps, start
    self.predict, self.optimizer = predict, optimizer
    self.placement, self.compute_mesh = placement, compute_mesh
    self.specs, self.specs_like = state_specs(state_like), state_like
    self._compiled: dict[tuple[str, Any], Callable] = {}
    self._settled = False

  # ------------------------------------------------------------------ the two halves

  def _lead(self, state: TrainState) -> tuple:
    """What the compute half needs from `state` beyond the parameters: under "local" the
    pending (unexchanged) gradient and the optimizer's state; else nothing."""
    if self.predict != "local":
      return ()
    return state.pending.grads, state.chain.optimizer

  def _compute_body(self, params, batch_stats, step, update, lead, inputs, labels) -> Pending:
    shift = None
    if self.predict == "last":
      shift = update[0]
    elif self.predict == "local":  # the update the optimizer would make of this worker's own
      grads, opt_state = lead      # gradient: p_{t+1} but for the part of the mean not seen
      shift, _ = self.optimizer.update(grads[0], opt_state, params)
      # a non-finite late gradient is skipped by the exchange; guessed from, it would make
      # every later gradient non-finite too: no guess then
      shift = jnp.where(jnp.all(jnp.isfinite(shift)), shift, jnp.zeros_like(shift))
    return _pending(self.setup, params, batch_stats, step, inputs, labels, update, shift)

  def _apply_body(self, state: TrainState, level: Any, advance: bool):
    """The pending gradient applied; with `predict` "last", the update it made kept in the
    pending."""
    pending = state.pending
    new_state, metrics = step_lib.apply_gradient(
        self.setup, state, pending.grads[0], step_lib._first(pending.batch_stats), level,
        advance)
    if self.predict == "last":
      new_state = new_state._replace(pending=pending._replace(
          update=(new_state.params - state.params)[None]))
    local = jax.tree.map(lambda x: x[0], pending.metrics)
    if self.setup.learning_rate is not None:  # the optimizer's step: the gradient's, one back
      metrics["learning_rate"] = jnp.asarray(self.setup.learning_rate(state.step - 1),
                                             jnp.float32)
    return new_state, {**jax.lax.pmean(local, WORKERS), **metrics}

  def _fn(self, kind: str, level: Any = None) -> Callable:
    key = (kind, level)
    if key not in self._compiled:
      self._compiled[key] = self._build(kind, level)
    return self._compiled[key]

  def _build(self, kind: str, level: Any) -> Callable:
    s, w = self.specs, P(WORKERS)
    if kind == "compute":  # (params, batch_stats, step, update, lead, inputs, labels) -> Pending
      return _shard_mapped(self.compute_mesh or self.setup.mesh, self._compute_body,
                           (P(), s.batch_stats, P(), w, self._lead(s), w, w), s.pending)
    if kind == "plain":  # the unpipelined step, before `start`
      return step_lib.jit_train_step(self.setup, self.specs_like, level)
    if kind == "settle":  # state -> state, through one program: arrays that `place` or a
      # restore made on several processes come out as ones whose shards `_move` can copy
      return _shard_mapped(self.setup.mesh, lambda st: st, (s,), s, donate_argnums=0)
    if kind == "count":  # state -> state with step + 1 (the first step: compute only)
      return _shard_mapped(self.setup.mesh, lambda st: st._replace(step=st.step + 1), (s,), s,
                           donate_argnums=0)
    if kind in ("apply", "drain"):  # state -> (state, metrics), the state donated
      return _shard_mapped(self.setup.mesh,
                           functools.partial(self._apply_body, level=level,
                                             advance=kind == "apply"),
                           (s,), (s, P()), donate_argnums=0)

    def both(state, inputs, labels):  # "program": one program, the two halves independent
      pending = self._compute_body(state.params, state.batch_stats, state.step,
                                   state.pending.update, self._lead(state), inputs, labels)
      new_state, metrics = self._apply_body(state, level, advance=True)
      return new_state._replace(pending=pending._replace(update=new_state.pending.update)), metrics
    return _shard_mapped(self.setup.mesh, both, (s, w, w), (s, P()), donate_argnums=0)

  # ------------------------------------------------------------------ one loop step

  def gradient(self, state: TrainState, batch: Sequence[jax.Array]) -> Pending:
    """The batch's gradient at `state`'s parameters, computed (on the compute devices under
    "device") and brought back as a `Pending` on the state's mesh. Dispatched, not waited for."""
    mesh = self.compute_mesh or self.setup.mesh
    move = (lambda x: _move(x, mesh)) if self.compute_mesh is not None else (lambda x: x)
    args = jax.tree.map(move, (state.params, state.batch_stats, state.step,
                               state.pending.update, self._lead(state), *batch))
    pending = self._fn("compute")(*args)
    if self.compute_mesh is None:
      return pending
    return jax.tree.map(lambda x: _move(x, self.setup.mesh), pending)

  def steady(self, state: TrainState, batch: Sequence[jax.Array], level: Any
             ) -> tuple[TrainState, dict[str, jax.Array]]:
    """The pipelined step: the batch's gradient computed while the pending one is applied at
    density `level`; returns (state, the applied gradient's metrics)."""
    if self.placement == "program":
      return self._fn("both", level)(state, *batch)
    pending = self.gradient(state, batch)  # dispatched back to back: the exchange runs
    state, metrics = self.apply(state, level)  # while the gradient computes
    return state._replace(pending=pending._replace(update=state.pending.update)), metrics

  def apply(self, state: TrainState, level: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    """The pending gradient exchanged at density `level` and applied (the state donated; its
    `pending` left as it was); returns (state, metrics). Dispatched, not waited for."""
    return self._fn("apply", level)(state)

  def __call__(self, step: int, state: TrainState, *batch: jax.Array
               ) -> tuple[TrainState, list[dict[str, jax.Array]]]:
    """Loop step `step`: returns the state and the metrics of the gradients applied in it
    (none in the first step, two in the last)."""
    if step < self.start:
      state, metrics = self._fn("plain", self.level_of(step))(state, *batch)
      return state, [metrics]
    if not self._settled:
      state, self._settled = self._fn("settle")(state), True
    if step == self.start:  # nothing computed yet: compute only; its metrics come next step
      pending = self.gradient(state, batch)
      state, metrics = self._fn("count")(state)._replace(pending=pending), []
    else:
      state, applied = self.steady(state, batch, self.level_of(step - 1))
      metrics = [applied]
    if step == self.total - 1:  # the last step also applies its own gradient
      state, applied = self._fn("drain", self.level_of(step))(state)
      metrics.append(applied)
    return state, metrics

  def compile(self, state: TrainState, batch: Sequence[jax.Array], levels: Sequence[Any]
              ) -> None:
    """Compiles every program a run through `levels` (in order) uses, now (nothing runs,
    nothing donated)."""
    steady = "both" if self.placement == "program" else "apply"
    args = {"settle": (state,), "count": (state,), "drain": (state,), "apply": (state,),
            "both": (state, *batch), "plain": (state, *batch)}
    wanted = [("settle", None), ("count", None), ("drain", levels[-1])] + [
        (steady, level) for level in levels[self.start:]] + [
        ("plain", level) for level in levels[:self.start]]
    for kind, level in dict.fromkeys(wanted):
      fn = self._fn(kind, level)
      if hasattr(fn, "lower"):  # not compiled yet
        self._compiled[(kind, level)] = fn.lower(*args[kind]).compile()
    mesh = self.compute_mesh or self.setup.mesh
    like = jax.tree.map(  # the compute half's arguments, as they will arrive on its mesh
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=NamedSharding(mesh, x.sharding.spec)),
        (state.params, state.batch_stats, state.step, state.pending.update, self._lead(state),
         *batch))
    self._compiled[("compute", None)] = self._fn("compute").lower(*like).compile()


def from_config(config: Any, plan: Any, setup: TrainSetup, state_like: TrainState,
                compute_mesh: Mesh | None = None) -> Pipeline:
  """The pipeline a validated config's `overlap` group describes for its `plan`
  (`state_like` with its `pending`)."""
  o = config.overlap
  optimizer = None
  if o.predict == "local":
    optimizer = optimizer_lib.optimizer_behind_exchange(config, plan, setup.layout)
  return Pipeline(setup, state_like, plan.level, plan.total_steps, o.pipeline, compute_mesh,
                  start=plan.pipeline_start, predict=o.predict, optimizer=optimizer)


def meshes(nodes: int, local: int, placement: str) -> tuple[Mesh, Mesh | None]:
  """(the state's mesh, the compute mesh or None) for a pipelined run's ("node", "local")."""
  if placement != "device":
    return make_mesh(nodes, local), None
  state_devices, compute_devices = split_devices(jax.devices())
  return make_mesh(nodes, local, state_devices), make_mesh(nodes, local, compute_devices)
