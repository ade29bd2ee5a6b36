"""The sharded train and eval steps: forward/backward, compression, fused update, all in one jit.

Each worker (one device of the ("node", "local") mesh) runs the body under `shard_map` on its slice
of the global batch:

  params (flat, replicated) -> unravel -> loss and gradient (per-device BatchNorm statistics)
  -> ravel the gradient into the flat buffer -> topk_allreduce (residual, MSTopK, HiTopKComm)
  -> fused optimizer on the flat buffer -> params + update

The compressor and the optimizer are one chain wrapped in `apply_if_finite_across`: a step with
a non-finite gradient on any worker changes nothing, on every worker. The train state holds the
replicated parts once (params, step, the optimizer's and the wrapper's state) and the per-worker
parts (the compressor's state, BatchNorm statistics) with a leading worker axis.
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

from sparsejax import optim
from sparsejax.comm import SPARSE_ALGORITHMS
from sparsejax.compress import ExchangeState, density_levels, level_index, topk_allreduce
from sparsejax.data import images as image_ops
from sparsejax.finite import apply_if_finite_across
from sparsejax.flat import FlatLayout
from sparsejax.train.mesh import WORKERS

__all__ = ["TrainState", "Trainer", "build_optimizer", "NormState", "record_norm"]


def _per_worker(x: Any) -> bool:
  """The parts of the state that differ per worker: the compressor's (its residual)."""
  return isinstance(x, ExchangeState)


def _map_per_worker(fn: Callable, tree: Any) -> Any:
  """`fn` applied to every leaf of the per-worker parts of `tree`; the rest as it is."""
  return jax.tree.map(lambda x: jax.tree.map(fn, x) if _per_worker(x) else x, tree,
                      is_leaf=_per_worker)


class TrainState(NamedTuple):
  """Everything a run needs to continue exactly.

  step: int32[], steps done (also the data position: batches are a function of the step).
  params: float32[padded_size], the flat parameters (replicated).
  opt_state: the whole chain's state, an `optax.ApplyIfFiniteState` (its counters say how many
    steps in a row were skipped) around `(compressor state, norm, optimizer state)`: the
    compressor's `ExchangeState` per worker (leading axis = number of workers), the rest
    replicated.
  batch_stats: BatchNorm running statistics per worker, leading axis = number of workers.
  """

  step: jax.Array
  params: jax.Array
  opt_state: Any
  batch_stats: Any

  @property
  def comm_state(self) -> ExchangeState:
    """The compressor's state (per worker)."""
    return self.opt_state.inner_state[0]

  @property
  def consecutive_skips(self) -> jax.Array:
    """int32[]: steps in a row skipped for non-finite gradients."""
    return self.opt_state.notfinite_count


class NormState(NamedTuple):
  """norm: float32[], the L2 norm of the updates that last passed through `record_norm`."""

  norm: jax.Array


def record_norm() -> optax.GradientTransformation:
  """Passes the updates through unchanged; its state keeps their L2 norm (a metric)."""
  def update_fn(updates, state, params=None):
    del state, params
    return updates, NormState(optax.tree.norm(updates))

  return optax.GradientTransformation(lambda _: NormState(jnp.zeros([], jnp.float32)), update_fn)


def decay_mask(params: Any) -> Any:
  """Weight decay (and LARS trust ratio) only on kernels: never on BatchNorm and biases."""
  return jax.tree.map(lambda x: len(x.shape) > 1, params)


def build_optimizer(opt, schedule: optax.Schedule, layout: FlatLayout
                    ) -> optax.GradientTransformation:
  """The fused optimizer of the config's `optimizer` group, on the flat face of `layout`."""
  if opt.name == "sgd":
    return optim.fused_sgd(schedule, momentum=opt.momentum or None, nesterov=opt.nesterov,
                           weight_decay=opt.weight_decay, weight_decay_mask=decay_mask,
                           layout=layout)
  if opt.name == "lars":
    return optim.fused_lars(schedule, weight_decay=opt.weight_decay,
                            weight_decay_mask=decay_mask, trust_coefficient=opt.trust_coefficient,
                            trust_ratio_mask=decay_mask, momentum=opt.momentum,
                            nesterov=opt.nesterov, layout=layout)
  if opt.name == "lamb":
    return optim.fused_lamb(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                            weight_decay=opt.weight_decay, mask=decay_mask, layout=layout)
  if opt.name == "adamw":
    return optim.fused_adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                             weight_decay=opt.weight_decay, mask=decay_mask, layout=layout)
  raise ValueError(f"unknown optimizer {opt.name!r}; allowed: sgd, lars, lamb, adamw")


def _opt_specs(opt_state: Any) -> Any:
  """The chain state's PartitionSpecs: per worker for the compressor's part, else replicated."""
  return jax.tree.map(lambda x: jax.tree.map(lambda _: P(WORKERS), x) if _per_worker(x) else P(),
                      opt_state, is_leaf=_per_worker)


def _first(tree: Any) -> Any:
  return jax.tree.map(lambda x: x[0], tree)


def _stack(tree: Any) -> Any:
  return jax.tree.map(lambda x: jnp.asarray(x)[None], tree)


@dataclasses.dataclass
class Trainer:
  """Builds the state and the jitted steps for one model, mesh and set of transforms.

  Args:
    model: a flax module called as `model.apply(variables, images, train=...)`.
    mesh: the ("node", "local") mesh.
    compression: the config's `compression` group; density_schedule: optional DGC schedule.
    make_optimizer: `layout -> GradientTransformation` (flat face).
    num_classes, label_smoothing: for the loss.
    learning_rate: the optimizer's schedule, reported per step (optional).
    seed: seeds the dropout keys (folded with the step and the worker index).
    momentum, nesterov, momentum_masking: momentum correction in the compressor
      (`topk_allreduce`); momentum 0 = none (else the optimizer from `make_optimizer` must have
      no momentum of its own).
    weight_decay: coupled weight decay added to the gradient before compression, on the leaves
      of `decay_mask` (with momentum correction it then passes through the momentum, as in DGC;
      the optimizer must then have no weight decay of its own); 0 = none.

  Inputs may be one array or a tuple of arrays (the encoder-decoder's source and target); labels
  are int32 class ids [batch] or token ids [batch, length] (0 = padding, not counted).
  """

  model: nn.Module
  mesh: Mesh
  compression: Any
  make_optimizer: Callable[[FlatLayout], optax.GradientTransformation]
  num_classes: int
  label_smoothing: float = 0.0
  density_schedule: Callable | None = None
  learning_rate: Callable | None = None  # the schedule, only to report the rate of each step
  seed: int = 0  # dropout randomness: a key per (step, worker) folded from it
  momentum: float = 0.0  # DGC momentum correction inside topk_allreduce
  nesterov: bool = False
  momentum_masking: bool = True
  weight_decay: float = 0.0  # added to the gradient before compression

  def __post_init__(self):
    self.num_workers = self.mesh.size
    self.local = self.mesh.shape["local"]
    c = self.compression
    self.comm = topk_allreduce(c.density, algorithm=c.algorithm, selector=c.selector,
                               error_feedback=c.error_feedback,
                               density_schedule=self.density_schedule,
                               momentum=self.momentum, nesterov=self.nesterov,
                               momentum_masking=self.momentum_masking)
    self.layout: FlatLayout | None = None
    self.optimizer: optax.GradientTransformation | None = None
    self.tx: optax.GradientTransformation | None = None

  # ------------------------------------------------------------------ placement helpers

  def _put(self, tree: Any, spec: P) -> Any:
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(self.mesh, spec)), tree)

  def state_specs(self, state: TrainState) -> TrainState:
    return TrainState(P(), P(), _opt_specs(state.opt_state),
                      jax.tree.map(lambda _: P(WORKERS), state.batch_stats))

  # ------------------------------------------------------------------ init

  def init(self, seed: int, example: Any) -> TrainState:
    """Fresh state from `seed`. `example`: one example's shape (h, w, c) for float images, or a
    pytree of arrays shaped like one batch of inputs (token ids for the Transformers)."""
    # The "rbg" generator: XLA:CPU compiles a model's init with it 3-4x faster than with
    # threefry (ResNet-20: 5 s instead of 16 s).
    rng = jax.random.key(seed, impl="rbg")
    if isinstance(example, tuple) and all(isinstance(d, int) for d in example):
      example = jnp.zeros((1,) + example)
    variables = jax.jit(lambda r, x: self.model.init(r, x, train=False))(rng, example)
    params, batch_stats = variables["params"], variables.get("batch_stats", {})
    self.layout = optim.flat_layout(params, pad_to=self.local)
    self.optimizer = self.make_optimizer(self.layout)
    self.tx = apply_if_finite_across(optax.chain(self.comm, record_norm(), self.optimizer),
                                     WORKERS)
    flat = self.layout.ravel(params, jnp.float32)

    def init_opt(f):
      return _map_per_worker(lambda x: jnp.asarray(x)[None], self.tx.init(f))

    # the compressor's state is per worker: init runs where the axes are bound
    shapes = jax.eval_shape(jax.shard_map(init_opt, mesh=self.mesh, in_specs=P(),
                                          out_specs=P(), check_vma=False), flat)
    opt_init = jax.jit(jax.shard_map(init_opt, mesh=self.mesh, in_specs=P(),
                                     out_specs=_opt_specs(shapes), check_vma=False))
    opt_state = opt_init(self._put(flat, P()))
    stats = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (self.num_workers,) + x.shape),
                         batch_stats)
    state = TrainState(jnp.zeros([], jnp.int32), flat, opt_state, stats)
    return self.place(state)

  def place(self, state: TrainState) -> TrainState:
    """Puts every field of `state` on the mesh with its sharding."""
    specs = self.state_specs(state)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(self.mesh, s)), state, specs,
                        is_leaf=lambda x: isinstance(x, P))

  def shard_batch(self, *arrays: np.ndarray) -> tuple[jax.Array, ...]:
    """Global arrays sharded over the workers from this process's part of the batch (all of it
    when there is one process)."""
    sharding = NamedSharding(self.mesh, P(WORKERS))
    return tuple(jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a)), a)
        for a in arrays)

  # ------------------------------------------------------------------ the steps

  @staticmethod
  def _normalize(inputs):
    """uint8 images (the grain pipeline's batches) -> float32, per-channel mean 0 / std 1 with
    the ImageNet statistics, on the device; anything else passes through."""
    if isinstance(inputs, jax.Array) and inputs.dtype == jnp.uint8:
      mean = jnp.asarray(image_ops.MEAN_RGB, jnp.float32)
      std = jnp.asarray(image_ops.STDDEV_RGB, jnp.float32)
      return (inputs.astype(jnp.float32) - mean) / std
    return inputs

  @staticmethod
  def _mask(labels):
    """Weights of the predictions: 1 per example, or 1 per non-padding token."""
    return (labels != 0).astype(jnp.float32) if labels.ndim > 1 else jnp.ones(labels.shape)

  def _loss(self, params, batch_stats, inputs, labels, rng):
    logits, mutated = self.model.apply({"params": params, "batch_stats": batch_stats},
                                       self._normalize(inputs),
                                       train=True, mutable=["batch_stats"],
                                       rngs={"dropout": rng})
    targets = optax.smooth_labels(jax.nn.one_hot(labels, self.num_classes), self.label_smoothing)
    mask = self._mask(labels)
    loss = jnp.sum(mask * optax.softmax_cross_entropy(logits, targets)) / jnp.maximum(
        jnp.sum(mask), 1.0)
    return loss, (logits, mutated.get("batch_stats", {}))

  def _accuracy(self, logits, labels) -> dict[str, jax.Array]:
    mask = self._mask(labels)
    total = jnp.maximum(jnp.sum(mask), 1.0)
    out = {"accuracy": jnp.sum(mask * (jnp.argmax(logits, -1) == labels)) / total}
    if self.num_classes > 5:
      top5 = jax.lax.top_k(logits, 5)[1]
      out["top5_accuracy"] = jnp.sum(mask * jnp.any(top5 == labels[..., None], axis=-1)) / total
    return out

  def density_level(self, step: int) -> int | None:
    """The compressor's density level at `step` (an index into its levels), or None when the
    density has no schedule or the exchange is dense (one level)."""
    c = self.compression
    if self.density_schedule is None or c.algorithm not in SPARSE_ALGORITHMS:
      return None
    return level_index(density_levels(c.density), float(self.density_schedule(step)))

  def train_step_fn(self, state_like: TrainState, density_level: int | None = None) -> Callable:
    """`(state, images, labels) -> (state, metrics)`, jitted, the state donated; at the given
    density level (`density_level(step)`), else the compressor picks it in the step."""
    layout, tx = self.layout, self.tx
    level = {} if density_level is None else {"density_level": density_level}

    def body(state: TrainState, images, labels):
      opt_state = _map_per_worker(lambda x: x[0], state.opt_state)
      batch_stats = _first(state.batch_stats)
      params = layout.unravel(state.params)
      rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), state.step),
                               jax.lax.axis_index(WORKERS))
      (loss, (logits, new_stats)), grads = jax.value_and_grad(self._loss, has_aux=True)(
          params, batch_stats, images, labels, rng)
      if self.weight_decay:
        grads = jax.tree.map(lambda g, p, m: g + self.weight_decay * p if m else g,
                             grads, params, decay_mask(params))
      flat_grads = layout.ravel(grads, jnp.float32)
      # A non-finite gradient on any worker: zero updates and the whole chain's state as it was
      # (apply_if_finite_across), on every worker.
      updates, opt_state = tx.update(flat_grads, opt_state, state.params, **level)
      skipped = ~opt_state.last_finite

      def keep(old, new):
        return jax.tree.map(lambda o, n: jnp.where(skipped, o, n), old, new)

      new_state = TrainState(
          state.step + 1, state.params + updates,
          _map_per_worker(lambda x: x[None], opt_state), _stack(keep(batch_stats, new_stats)))
      comm_state, norm_state = opt_state.inner_state[0], opt_state.inner_state[1]
      metrics = {"loss": loss, **self._accuracy(logits, labels)}
      metrics = jax.lax.pmean(metrics, WORKERS)
      # a skipped step sent nothing and its aggregated gradient is zero
      metrics.update(grad_norm=jnp.where(skipped, 0.0, norm_state.norm),
                     density=comm_state.density,
                     bytes_sent=jnp.where(skipped, 0.0, comm_state.bytes_sent),
                     skipped=skipped.astype(jnp.float32))
      if self.learning_rate is not None:
        metrics["learning_rate"] = jnp.asarray(self.learning_rate(state.step), jnp.float32)
      return new_state, metrics

    specs = self.state_specs(state_like)
    fn = jax.shard_map(body, mesh=self.mesh, in_specs=(specs, P(WORKERS), P(WORKERS)),
                       out_specs=(specs, P()), check_vma=False)
    # Pinned output shardings: the state comes back exactly as it went in, so the next call
    # never compiles again.
    shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                             is_leaf=lambda x: isinstance(x, P))
    return jax.jit(fn, donate_argnums=0,
                   out_shardings=(shardings, NamedSharding(self.mesh, P())))

  def eval_step_fn(self, state_like: TrainState) -> Callable:
    """`(state, images, labels, weights) -> sums` of loss, correct, top-5 correct and count."""
    layout = self.layout

    def body(state: TrainState, images, labels, weights):
      variables = {"params": layout.unravel(state.params),
                   "batch_stats": _first(state.batch_stats)}
      logits = self.model.apply(variables, self._normalize(images), train=False)
      targets = jax.nn.one_hot(labels, self.num_classes)
      weights = self._mask(labels) * weights.reshape(weights.shape + (1,) * (labels.ndim - 1))
      sums = {"loss": jnp.sum(weights * optax.softmax_cross_entropy(logits, targets)),
              "accuracy": jnp.sum(weights * (jnp.argmax(logits, -1) == labels)),
              "count": jnp.sum(weights)}
      if self.num_classes > 5:
        top5 = jax.lax.top_k(logits, 5)[1]
        sums["top5_accuracy"] = jnp.sum(weights * jnp.any(top5 == labels[..., None], axis=-1))
      return jax.lax.psum(sums, WORKERS)

    specs = self.state_specs(state_like)
    fn = jax.shard_map(body, mesh=self.mesh,
                       in_specs=(specs, P(WORKERS), P(WORKERS), P(WORKERS)), out_specs=P(),
                       check_vma=False)
    return jax.jit(fn)

  def sync_batch_stats_fn(self) -> Callable:
    """`state -> state` with every worker's BatchNorm running statistics replaced by their mean."""
    def body(stats):
      return _stack(jax.lax.pmean(_first(stats), WORKERS))

    fn = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P(WORKERS), out_specs=P(WORKERS)),
                 donate_argnums=0)

    def sync(state: TrainState) -> TrainState:
      if not jax.tree.leaves(state.batch_stats):
        return state
      return state._replace(batch_stats=fn(state.batch_stats))
    return sync
