"""The train state, built in one place: `create_train_state` (any model and chain) and
`from_config` (what `sparsejax train` runs).

A run is two things: `TrainSetup`, frozen and complete when built (the model, the mesh, the flat
layout, the optimizer chain, the loss's settings), and `TrainState`,
the arrays that change every step. The pure steps in `sparsejax.train.step` take both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparsejax import models, optim
from sparsejax.compress import ExchangeState
from sparsejax.flat import FlatLayout
from sparsejax.train import optimizer as optimizer_lib
from sparsejax.train import schedules
from sparsejax.train.mesh import WORKERS

__all__ = ["TrainState", "TrainSetup", "create_train_state", "from_config", "build_model",
           "place", "state_specs", "shard_batch"]


class TrainState(NamedTuple):
  """Everything a run needs to continue exactly.

  step: int32[], steps done (also the data position: batches are a function of the step).
  params: float32[padded_size], the flat parameters (replicated).
  opt_state: the whole chain's state, an `optax.ApplyIfFiniteState` (its counters say how many
    steps in a row were skipped) around an `optimizer.ChainState` (`chain_parts`): its
    `exchange`, the compressor's `ExchangeState`, per worker (leading axis = number of workers);
    its `norm` and `optimizer` replicated.
  batch_stats: BatchNorm running statistics per worker, leading axis = number of workers.
  pending: under a pipelined exchange (`sparsejax.train.pipelined`), the gradient computed and
    not yet applied, a `Pending` (per worker); None otherwise.
  """

  step: jax.Array
  params: jax.Array
  opt_state: Any
  batch_stats: Any
  pending: Any = None

  @property
  def comm_state(self) -> ExchangeState:
    """The compressor's state (per worker): the chain's `exchange` part."""
    return self.chain.exchange

  @property
  def chain(self) -> optimizer_lib.ChainState:
    """The chain's state by name: `.exchange`, `.norm`, `.optimizer`."""
    return optimizer_lib.chain_parts(self.opt_state)

  @property
  def consecutive_skips(self) -> jax.Array:
    """int32[]: steps in a row skipped for non-finite gradients."""
    return self.opt_state.notfinite_count


@dataclasses.dataclass(frozen=True)
class TrainSetup:
  """What the steps need besides the state; complete when built, never changed.

  model: a flax module called as `model.apply(variables, inputs, train=...)`.
  mesh: the ("node", "local") mesh. layout: the flat parameters' layout (padded to "local").
  tx: the whole chain (`optimizer.train_chain`), on the flat face of `layout`.
  num_classes, label_smoothing: for the loss. seed: dropout keys (folded with step and worker).
  learning_rate: the schedule, only to report each step's rate (optional).
  """

  model: nn.Module
  mesh: Mesh
  layout: FlatLayout
  tx: optax.GradientTransformation
  num_classes: int
  label_smoothing: float = 0.0
  seed: int = 0
  learning_rate: Callable | None = None


# ----------------------------------------------------------------------------- placement


def per_worker(x: Any) -> bool:
  """The parts of the chain's state that differ per worker: the compressor's (its residual)."""
  return isinstance(x, ExchangeState)


def map_per_worker(fn: Callable, tree: Any) -> Any:
  """`fn` applied to every leaf of the per-worker parts of `tree`; the rest as it is."""
  return jax.tree.map(lambda x: jax.tree.map(fn, x) if per_worker(x) else x, tree,
                      is_leaf=per_worker)


def _opt_specs(opt_state: Any) -> Any:
  """The chain state's PartitionSpecs: per worker for the compressor's part, else replicated."""
  return jax.tree.map(lambda x: jax.tree.map(lambda _: P(WORKERS), x) if per_worker(x) else P(),
                      opt_state, is_leaf=per_worker)


def state_specs(state: TrainState) -> TrainState:
  """The PartitionSpecs of every field of `state`."""
  return TrainState(P(), P(), _opt_specs(state.opt_state),
                    jax.tree.map(lambda _: P(WORKERS), state.batch_stats),
                    jax.tree.map(lambda _: P(WORKERS), state.pending))


def place(state: TrainState, mesh: Mesh) -> TrainState:
  """Puts every field of `state` on `mesh` with its sharding."""
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state,
                      state_specs(state), is_leaf=lambda x: isinstance(x, P))


def shard_batch(mesh: Mesh, *arrays: np.ndarray) -> tuple[jax.Array, ...]:
  """Global arrays sharded over the workers from this process's part of the batch (all of it
  when there is one process)."""
  sharding = NamedSharding(mesh, P(WORKERS))
  return tuple(jax.tree.map(
      lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a)), a)
      for a in arrays)


# ----------------------------------------------------------------------------- creation


def _init_variables(model: nn.Module, seed: int, example: Any) -> tuple[Any, Any]:
  """(params, batch_stats) of `model` from `seed`. `example`: one example's shape (h, w, c)
  for float images, or a pytree of arrays shaped like one batch of inputs."""
  # The "rbg" generator: XLA:CPU compiles a model's init with it 3-4x faster than with
  # threefry (ResNet-20: 5 s instead of 16 s).
  rng = jax.random.key(seed, impl="rbg")
  if isinstance(example, tuple) and all(isinstance(d, int) for d in example):
    example = jnp.zeros((1,) + example)
  variables = jax.jit(lambda r, x: model.init(r, x, train=False))(rng, example)
  return variables["params"], variables.get("batch_stats", {})


def _init_opt_state(tx: optax.GradientTransformation, mesh: Mesh, flat: jax.Array) -> Any:
  """The chain's state; the compressor's part per worker, so init runs where the axes are
  bound."""
  def init_opt(f):
    return map_per_worker(lambda x: jnp.asarray(x)[None], tx.init(f))

  shapes = jax.eval_shape(jax.shard_map(init_opt, mesh=mesh, in_specs=P(), out_specs=P(),
                                        check_vma=False), flat)
  opt_init = jax.jit(jax.shard_map(init_opt, mesh=mesh, in_specs=P(),
                                   out_specs=_opt_specs(shapes), check_vma=False))
  return opt_init(jax.device_put(flat, NamedSharding(mesh, P())))


def create_train_state(model: nn.Module, mesh: Mesh, example: Any,
                       make_tx: Callable[[FlatLayout], optax.GradientTransformation], *,
                       seed: int = 0, **setup: Any) -> tuple[TrainSetup, TrainState]:
  """The setup and the fresh, placed state of `model` on `mesh`.

  Args:
    model, mesh: see `TrainSetup`. example: one example's shape (h, w, c), or a pytree of arrays
      shaped like a batch of inputs (token ids for the Transformers).
    make_tx: `layout -> chain` (`optimizer.train_chain(...)`, or `build_optimizer` with a config).
    seed: initialises the parameters and seeds the dropout keys.
    **setup: the other fields of `TrainSetup` (num_classes, label_smoothing, ...).
  """
  params, batch_stats = _init_variables(model, seed, example)
  layout = optim.flat_layout(params, pad_to=mesh.shape["local"])
  tx = make_tx(layout)
  flat = layout.ravel(params, jnp.float32)
  stats = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (mesh.size,) + x.shape),
                       batch_stats)
  state = TrainState(jnp.zeros([], jnp.int32), flat, _init_opt_state(tx, mesh, flat), stats)
  return (TrainSetup(model, mesh, layout, tx, seed=seed, **setup), place(state, mesh))


def build_model(config: Any, num_classes: int) -> nn.Module:
  """The model of a validated config's `model` group."""
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
  return models.build(m.name, num_classes=num_classes, dtype=m.dtype, **extra)


def from_config(config: Any, plan: Any, mesh: Mesh, num_classes: int, example: Any
                ) -> tuple[TrainSetup, TrainState]:
  """The setup and fresh state a validated config describes for its `plan`
  (`sparsejax.train.plan`): model, whole optimizer chain (`optimizer.build_optimizer`)."""
  learning_rate = schedules.learning_rate(config.optimizer, plan)
  model = build_model(config, num_classes)

  def make_tx(layout: FlatLayout) -> optax.GradientTransformation:
    return optimizer_lib.build_optimizer(config, plan, layout)

  return create_train_state(model, mesh, example, make_tx, seed=config.seed,
                            num_classes=num_classes, label_smoothing=config.label_smoothing,
                            learning_rate=learning_rate)
