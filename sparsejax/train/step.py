"""The pure train and eval steps: forward/backward, compression, fused update, all in one jit.

Each worker (one device of the ("node", "local") mesh) runs `train_step` under `shard_map` on
its slice of the global batch:

  params (flat, replicated) -> unravel -> loss and gradient (per-device BatchNorm statistics)
  -> ravel the gradient into the flat buffer -> setup.tx (apply_if_finite_across around
  compressor, norm, fused optimizer) -> params + update

`jit_train_step` wraps it in `shard_map` and `jit`, once per density level (chosen on the host
by `setup.density_level(step)`); `jit_eval_step` does the same for `eval_step`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparsejax.data import images as image_ops
from sparsejax.train.mesh import WORKERS
from sparsejax.train.optimizer import chain_parts
from sparsejax.train.state import TrainSetup, TrainState, map_per_worker, state_specs

__all__ = ["gradient", "apply_gradient", "train_step", "eval_step", "jit_train_step",
           "jit_eval_step", "jit_sync_batch_stats"]


def _first(tree: Any) -> Any:
  return jax.tree.map(lambda x: x[0], tree)


def _stack(tree: Any) -> Any:
  return jax.tree.map(lambda x: jnp.asarray(x)[None], tree)


def _normalize(inputs):
  """uint8 images (the grain pipeline's batches) -> float32, per-channel mean 0 / std 1 with
  the ImageNet statistics, on the device; anything else passes through."""
  if isinstance(inputs, jax.Array) and inputs.dtype == jnp.uint8:
    mean = jnp.asarray(image_ops.MEAN_RGB, jnp.float32)
    std = jnp.asarray(image_ops.STDDEV_RGB, jnp.float32)
    return (inputs.astype(jnp.float32) - mean) / std
  return inputs


def _mask(labels):
  """Weights of the predictions: 1 per example, or 1 per non-padding token."""
  return (labels != 0).astype(jnp.float32) if labels.ndim > 1 else jnp.ones(labels.shape)


def _correct(logits, labels, weights, num_classes: int) -> dict[str, jax.Array]:
  """Weighted counts of right predictions: top-1, and top-5 when there are over 5 classes.

  One compare pass over the logits: the label's rank is the number of logits ordered before it
  (greater, or equal at a lower index: argmax's and lax.top_k's tie-break), top-1 where it is 0.
  An argmax is a second, variadic reduction (value and index): on XLA:CPU it cost the
  Transformer LM's train step 13 of its 112 ms, and lax.top_k sorts."""
  picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)
  index = jax.lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1)
  before = (logits > picked) | ((logits == picked) & (index < labels[..., None]))
  rank = jnp.sum(before, axis=-1)
  out = {"accuracy": jnp.sum(weights * (rank == 0))}
  if num_classes > 5:
    out["top5_accuracy"] = jnp.sum(weights * (rank < 5))
  return out


def cross_entropy(logits, labels, label_smoothing: float = 0.0):
  """Softmax cross-entropy against integer `labels` smoothed by `label_smoothing` (targets
  (1 - s) one_hot + s / classes, as optax.smooth_labels), without building the one-hot:
  logsumexp - (1 - s) logit[label] - s mean(logits). float32[...] for logits [..., classes]."""
  logits = logits.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
  loss = jax.nn.logsumexp(logits, axis=-1) - (1.0 - label_smoothing) * picked
  if label_smoothing:
    loss -= label_smoothing * jnp.mean(logits, axis=-1)
  return loss


def _loss(setup: TrainSetup, params, batch_stats, inputs, labels, rng):
  logits, mutated = setup.model.apply({"params": params, "batch_stats": batch_stats},
                                      _normalize(inputs), train=True, mutable=["batch_stats"],
                                      rngs={"dropout": rng})
  mask = _mask(labels)
  loss = jnp.sum(mask * cross_entropy(logits, labels, setup.label_smoothing)) / jnp.maximum(
      jnp.sum(mask), 1.0)
  return loss, (logits, mutated.get("batch_stats", {}))


def _local_metrics(setup: TrainSetup, loss, logits, labels) -> dict[str, jax.Array]:
  """This worker's loss and accuracies on its slice (not averaged over the workers)."""
  mask = _mask(labels)
  total = jnp.maximum(jnp.sum(mask), 1.0)
  correct = _correct(logits, labels, mask, setup.num_classes)
  return {"loss": loss, **{k: v / total for k, v in correct.items()}}


def _exchange_metrics(setup: TrainSetup, step, opt_state) -> dict[str, jax.Array]:
  """The exchange's metrics (the same on every worker); `step`: the optimizer step it made."""
  skipped = ~opt_state.last_finite
  parts = chain_parts(opt_state)
  comm_state, norm_state = parts.exchange, parts.norm
  # a skipped step sent nothing and its aggregated gradient is zero
  metrics = {"grad_norm": jnp.where(skipped, 0.0, norm_state.norm),
             "density": comm_state.density,
             "bytes_sent": jnp.where(skipped, 0.0, comm_state.bytes_sent),
             "skipped": skipped.astype(jnp.float32)}
  if setup.learning_rate is not None:
    metrics["learning_rate"] = jnp.asarray(setup.learning_rate(step), jnp.float32)
  return metrics


def gradient(setup: TrainSetup, step, params, batch_stats, inputs, labels
             ) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
  """One worker's forward and backward pass (inside `shard_map`): (flat float32 gradient
  [padded_size], new BatchNorm statistics, this worker's metrics). `step` seeds dropout (folded
  with the worker's index); `batch_stats` without the leading worker axis."""
  rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(setup.seed), step),
                           jax.lax.axis_index(WORKERS))
  (loss, (logits, new_stats)), grads = jax.value_and_grad(
      functools.partial(_loss, setup), has_aux=True)(
      setup.layout.unravel(params), batch_stats, inputs, labels, rng)
  # The flat gradient is written once: without the barrier XLA fuses the ravel's concatenate
  # into each of its readers (the finite check, the norm, the exchange's first pass), and on
  # CPU a concatenate costs about as much as the backward pass of a small model (auto's dense
  # form read it twice: 1.8x plain dense's step on the MLP, 1.05x with the barrier).
  flat = jax.lax.optimization_barrier(setup.layout.ravel(grads, jnp.float32))
  return flat, new_stats, _local_metrics(setup, loss, logits, labels)


def apply_gradient(setup: TrainSetup, state: TrainState, flat_grads, new_stats,
                   density_level: int | None = None, advance: bool = True
                   ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One worker's exchange and update (inside `shard_map`): `flat_grads` through `setup.tx`
  into the params; the BatchNorm statistics become `new_stats` unless the step is skipped.
  `advance`: count the step in `state.step`. Returns (state, the exchange's metrics)."""
  level = {} if density_level is None else {"density_level": density_level}
  opt_state = map_per_worker(lambda x: x[0], state.opt_state)
  batch_stats = _first(state.batch_stats)
  updates, opt_state = setup.tx.update(flat_grads, opt_state, state.params, **level)
  skipped = ~opt_state.last_finite
  new_stats = jax.tree.map(lambda o, n: jnp.where(skipped, o, n), batch_stats, new_stats)
  new_state = state._replace(step=state.step + 1 if advance else state.step,
                             params=state.params + updates,
                             opt_state=map_per_worker(lambda x: x[None], opt_state),
                             batch_stats=_stack(new_stats))
  return new_state, _exchange_metrics(setup, state.step, opt_state)


def train_step(setup: TrainSetup, state: TrainState, inputs, labels,
               density_level: int | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
  """One worker's step (inside `shard_map`; the per-worker parts of `state` with their leading
  axis of 1): `gradient`, then `apply_gradient`. A non-finite gradient on any worker leaves the
  whole state as it was, on every worker (`apply_if_finite_across` in the chain; the BatchNorm
  statistics follow it).

  Inputs may be one array or a tuple of arrays (the encoder-decoder's source and target);
  labels are int32 class ids [batch] or token ids [batch, length] (0 = padding, not counted)."""
  flat_grads, new_stats, local = gradient(setup, state.step, state.params,
                                          _first(state.batch_stats), inputs, labels)
  new_state, metrics = apply_gradient(setup, state, flat_grads, new_stats, density_level)
  return new_state, {**jax.lax.pmean(local, WORKERS), **metrics}


def eval_step(setup: TrainSetup, state: TrainState, inputs, labels, weights
              ) -> dict[str, jax.Array]:
  """One worker's eval sums over its slice, summed over the workers: loss, accuracy (and
  top5_accuracy) and count, each weighted by `weights` (0 = padding) and the token mask."""
  variables = {"params": setup.layout.unravel(state.params),
               "batch_stats": _first(state.batch_stats)}
  logits = setup.model.apply(variables, _normalize(inputs), train=False)
  weights = _mask(labels) * weights.reshape(weights.shape + (1,) * (labels.ndim - 1))
  sums = {"loss": jnp.sum(weights * cross_entropy(logits, labels)),
          **_correct(logits, labels, weights, setup.num_classes),
          "count": jnp.sum(weights)}
  return jax.lax.psum(sums, WORKERS)


def jit_train_step(setup: TrainSetup, state_like: TrainState,
                   density_level: int | None = None) -> Callable:
  """`(state, inputs, labels) -> (state, metrics)`: `train_step` at one density level
  (`setup.density_level(step)`; None: the compressor picks it in the step) over the mesh,
  jitted, the state donated."""
  def body(state, inputs, labels):
    return train_step(setup, state, inputs, labels, density_level)

  specs = state_specs(state_like)
  fn = jax.shard_map(body, mesh=setup.mesh, in_specs=(specs, P(WORKERS), P(WORKERS)),
                     out_specs=(specs, P()), check_vma=False)
  # Pinned output shardings: the state comes back exactly as it went in, so the next call
  # never compiles again.
  shardings = jax.tree.map(lambda s: NamedSharding(setup.mesh, s), specs,
                           is_leaf=lambda x: isinstance(x, P))
  return jax.jit(fn, donate_argnums=0,
                 out_shardings=(shardings, NamedSharding(setup.mesh, P())))


def jit_eval_step(setup: TrainSetup, state_like: TrainState) -> Callable:
  """`(state, inputs, labels, weights) -> sums` of loss, correct, top-5 correct and count."""
  def body(state, inputs, labels, weights):
    return eval_step(setup, state, inputs, labels, weights)

  fn = jax.shard_map(body, mesh=setup.mesh,
                     in_specs=(state_specs(state_like), P(WORKERS), P(WORKERS), P(WORKERS)),
                     out_specs=P(), check_vma=False)
  return jax.jit(fn)


def jit_sync_batch_stats(mesh) -> Callable:
  """`state -> state` with every worker's BatchNorm running statistics replaced by their mean."""
  def body(stats):
    return _stack(jax.lax.pmean(_first(stats), WORKERS))

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(WORKERS), out_specs=P(WORKERS)),
               donate_argnums=0)

  def sync(state: TrainState) -> TrainState:
    if not jax.tree.leaves(state.batch_stats):
      return state
    return state._replace(batch_stats=fn(state.batch_stats))
  return sync
