"""The compressed mean of the gradient over the workers, as optax `GradientTransformation`s.

`topk_allreduce(...)` composes four pieces, each its own function: a selector (`sparsejax.topk`),
error feedback with or without momentum correction (`sparsejax.feedback`), a sparse collective
(`sparsejax.comm.sparse_collective`: TopK all-gather, HiTopKComm, gTop-k, HiTopKComm with
gTop-k between nodes) and a density schedule (`density_levels`,
`_level`). The uncompressed baselines are transforms of their own, named for what they are:
`dense_mean` (one all-reduce) and `hierarchical_mean` (reduce-scatter, all-reduce, all-gather);
`topk_allreduce(algorithm="dense" | "hierarchical")` returns them.

Each is called inside `shard_map` or `pmap` over the axes it is given, like optax's transforms
that take an axis name. `update` ravels the gradient pytree once into a flat float32 buffer, runs
the collective and returns the MEAN over all workers with the gradient's own structure and
dtypes. The state is per worker (the residual differs on every worker), so `init` also runs
inside `shard_map`. Skipping non-finite steps is `sparsejax.apply_if_finite_across`'s job.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from sparsejax import comm
from sparsejax import topk as topk_lib
from sparsejax.feedback import (
  AdamCorrection,
  Correction,
  Feedback,
  MomentumCorrection,
  feedback_dense,
  feedback_select,
  init_feedback,
  legacy_correction,
  tensor_weights,
)
from sparsejax.flat import FlatLayout

__all__ = ["ExchangeState", "TopKAllReduceState", "topk_allreduce", "dense_mean",
           "hierarchical_mean", "density_levels", "level_index"]


class ExchangeState(NamedTuple):
  """Per-worker state of `topk_allreduce`, `dense_mean` and `hierarchical_mean`.

  feedback: what this worker has not sent yet, a `Feedback(residual, velocity)` of float32[r]
    buffers (r = padded n for the flat algorithms, padded n / local for the hierarchical ones
    "hitopk", "higtopk"; velocity only with
    momentum correction); None for the dense baselines or without error feedback (no zero-size
    arrays: XLA and orbax both handle those badly).
  count: int32 number of updates so far (drives `density_schedule`).
  density: float32 density used at the last update (1 for the dense baselines).
  bytes_sent: float32 inter- plus intra-node bytes this worker sent at the last update.
  """

  feedback: Feedback | None
  count: jax.Array
  density: jax.Array
  bytes_sent: jax.Array


TopKAllReduceState = ExchangeState  # the name it had when only topk_allreduce used it


def density_levels(density: float, ratio: float = 4.0) -> tuple[float, ...]:
  """The static densities a schedule is rounded up to: density * ratio**j below 1, then 1."""
  levels, d = [], density
  while d < 1.0:
    levels.append(d)
    d *= ratio
  return tuple(levels) + (1.0,)


def level_index(levels: tuple[float, ...], wanted):
  """Index of the first of `levels` (increasing) at or above the density `wanted`, the last one
  beyond them: an int32[] for a traced `wanted`, a Python int for a number."""
  if isinstance(wanted, jax.Array):
    index = jnp.sum(jnp.asarray(levels, jnp.float32) < wanted * (1 - 1e-6)).astype(jnp.int32)
    return jnp.minimum(index, len(levels) - 1)
  wanted = float(wanted)
  return min(sum(lv < wanted * (1 - 1e-6) for lv in levels), len(levels) - 1)


def _level(levels: tuple[float, ...], schedule: Callable | None, count: jax.Array,
           density_level: int | None, dense_level: bool = False) -> jax.Array | int:
  """The level to run: the caller's `density_level` (a Python int: no switch; `len(levels)` is
  the dense form where `dense_level`), else the one the schedule's density at `count` is
  rounded up to (int32[])."""
  if density_level is not None:
    end = len(levels) + bool(dense_level)
    if (isinstance(density_level, bool) or not isinstance(density_level, int)
        or not 0 <= density_level < end):
      dense = f"; {len(levels)}: the dense form" if dense_level else ""
      raise ValueError(f"density_level must be a Python int in [0, {end}) (an index into the "
                       f"levels {levels}{dense}), got {density_level!r}")
    return density_level
  if len(levels) == 1:
    return 0
  return level_index(levels, jnp.asarray(schedule(count), jnp.float32))


def _check_args(density: Any, algorithm: str, error_feedback: bool,
                correction: Correction | None) -> None:
  if isinstance(density, bool) or not isinstance(density, int | float) or not 0 < density <= 1:
    raise ValueError(f"density must be a number in (0, 1], got {density!r}")
  if algorithm not in comm.ALGORITHMS:
    raise ValueError(f"unknown algorithm {algorithm!r}; allowed: {list(comm.ALGORITHMS)}")
  if correction is None:
    return
  if not isinstance(correction, MomentumCorrection | AdamCorrection):
    raise ValueError(f"correction must be a sparsejax.feedback.MomentumCorrection, "
                     f"AdamCorrection or None, got {correction!r}")
  if not (algorithm in comm.SPARSE_ALGORITHMS and error_feedback):
    raise ValueError(f"a correction ({correction!r}) needs a sparse algorithm "
                     f"{comm.SPARSE_ALGORITHMS} with error feedback, got algorithm={algorithm!r}, "
                     f"error_feedback={error_feedback!r}; otherwise use the optimizer's momentum")
  if isinstance(correction, MomentumCorrection):
    m = correction.momentum
    if isinstance(m, bool) or not isinstance(m, int | float) or not 0 < m < 1:
      raise ValueError(f"MomentumCorrection.momentum must be a number in (0, 1), got {m!r}")
    if not isinstance(correction.masking, bool) or not isinstance(correction.nesterov, bool):
      raise ValueError(f"MomentumCorrection.nesterov and .masking must be True or False, got "
                       f"{correction!r}")
    return
  if not (0 <= correction.b1 < 1 and 0 <= correction.b2 < 1 and correction.eps > 0):
    raise ValueError(f"Adam correction needs b1, b2 in [0, 1) and eps > 0, got {correction}")


def _axes(algorithm: str, axis_name: Any) -> tuple[str, ...]:
  """The axes topk_allreduce runs over: `axis_name`, by default `("node", "local")`."""
  return comm.axis_names(algorithm, ("node", "local") if axis_name is None else axis_name)


def _workers(algorithm: str, axes: tuple[str, ...]) -> tuple[int, int]:
  """(nodes, local): workers over all axes but the last, and over the last (the buffer is padded
  to a multiple of it; for a hierarchical algorithm the two are the slow and the fast axis)."""
  try:
    sizes = [comm.axis_size(a) for a in axes]
  except ValueError as e:
    raise ValueError(f"{algorithm} runs over the axes {axes}: {e}") from e
  return math.prod(sizes[:-1]), sizes[-1]


def _mean_out(total: jax.Array, workers: int, layout: FlatLayout, updates: Any) -> Any:
  """The summed flat buffer as the mean, with the structure and dtypes of `updates`."""
  out = layout.unravel(total / workers)
  return jax.tree.map(lambda o, g: o.astype(g.dtype), out, updates)


def _dense(algorithm: str, axes: tuple[str, ...],
           reduce: Callable[[jax.Array], jax.Array]) -> optax.GradientTransformation:
  """The mean by an uncompressed all-reduce `reduce` (flat buffer -> sum over workers)."""
  def init_fn(params: Any) -> ExchangeState:
    del params
    _workers(algorithm, axes)  # a clear error where the axes are not bound
    return ExchangeState(None, jnp.zeros([], jnp.int32), jnp.float32(1.0),
                         jnp.zeros([], jnp.float32))

  def update_fn(updates: Any, state: ExchangeState, params: Any = None, **extra_args: Any):
    del params, extra_args
    nodes, local = _workers(algorithm, axes)
    layout = FlatLayout.from_tree(updates, pad_to=local)
    total = reduce(layout.ravel(updates, jnp.float32))
    sent = comm.wire_bytes(algorithm, n=layout.padded_size, nodes=nodes, local=local)
    return _mean_out(total, nodes * local, layout, updates), ExchangeState(
        None, state.count + 1, jnp.float32(1.0), jnp.float32(sent["inter"] + sent["intra"]))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dense_mean(axis_name: str | tuple[str, ...] = ("node", "local")
               ) -> optax.GradientTransformation:
  """The uncompressed baseline: the mean over `axis_name` (one name or several) by one psum,
  a flat ring in which every byte crosses the network. State: `ExchangeState` (no feedback)."""
  axes = comm.axis_names("dense", axis_name)
  return _dense("dense", axes, lambda x: comm.dense_allreduce(x, axes=axes))


def hierarchical_mean(node_axis: str = "node", local_axis: str = "local"
                      ) -> optax.GradientTransformation:
  """The uncompressed hierarchical baseline: reduce-scatter over `local_axis` (fast), all-reduce
  of the shard over `node_axis` (slow), all-gather over `local_axis`; the mean over both."""
  axes = comm.axis_names("hierarchical", (node_axis, local_axis))
  return _dense("hierarchical", axes, lambda x: comm.hierarchical_allreduce(
      x, node_axis=node_axis, local_axis=local_axis))


def _balance_weights(part: jax.Array, feedback: Feedback, correction: Correction | None,
                     layout: FlatLayout, part_len: int, collective: comm.SparseCollective,
                     segments: Any) -> jax.Array:
  """`tensor_weights` of this worker's candidates (`feedback_dense`'s: with momentum correction
  the velocity's term): tensors are the leaves of the updates, or `segments` (int ids of a flat
  buffer's elements); the hierarchical algorithms take shard i of them (shard i of a node's
  buffer is worker i's)."""
  ids = np.asarray(layout.segment_ids if segments is None else segments, np.int32)
  if ids.shape[0] > layout.padded_size:
    raise ValueError(f"segments has {ids.shape[0]} ids for a buffer of {layout.size} values")
  count = int(ids.max(initial=0)) + 2  # the last id: padding
  ids = np.concatenate([ids, np.full(layout.padded_size - ids.shape[0], count - 1, np.int32)])
  seg = jnp.asarray(ids)
  if collective.name in comm.HIERARCHICAL_ALGORITHMS:
    seg = lax.dynamic_slice(seg, (lax.axis_index(collective.axes[-1]) * part_len,), (part_len,))
  return tensor_weights(feedback_dense(part, feedback, correction=correction)[0], seg, count)


def _unmasked(correction: Correction | None) -> Correction | None:
  """`correction` with its velocity left unmasked (where a reduction, not a selection, sends)."""
  if isinstance(correction, MomentumCorrection):
    return correction._replace(masking=False)
  return correction


def _dense_run(collective: comm.SparseCollective, part: jax.Array, feedback: Feedback | None,
               correction: Correction | None, extra: dict) -> tuple[jax.Array, Feedback | None]:
  """The dense form of a sparse exchange: every candidate (`feedback_dense`: the gradient plus
  the residual, with the correction's velocity or Adam direction) summed by an all-reduce; the
  residual emptied, the velocity and Adam moments run on (nothing is masked: a dense step with
  momentum correction is momentum SGD's step). `extra`: the correction's arguments, without
  balance weights (everything is sent). `(total (n,), feedback)`."""
  if feedback is None:
    return comm.settle_dense(collective, part), None
  values, kept = feedback_dense(part, feedback, correction=correction, **extra)
  return comm.settle_dense(collective, values), kept


def _bytes_sent(algorithm: str, n: int, part_len: int, levels: tuple[float, ...], nodes: int,
                local: int, whole: Any = None) -> jax.Array:
  """float32[len(levels) + 1]: a worker's bytes sent at each level (with `whole`, its
  positions' all-reduce too), and in the dense form."""
  hierarchical = algorithm in comm.HIERARCHICAL_ALGORITHMS
  extra = 0.0
  if whole is not None:
    count = _whole_table(whole, n, local, hierarchical).shape[1]
    b = comm.wire_bytes("dense", n=count, nodes=nodes, local=1 if hierarchical else local)
    extra = b["inter"] + b["intra"]
  sent = [comm.wire_bytes(algorithm, n=n, k=max(1, round(lv * part_len)), nodes=nodes,
                          local=local) for lv in levels]
  dense = comm.wire_bytes(comm.dense_form(algorithm), n=n, nodes=nodes, local=local)
  return jnp.asarray([s["inter"] + s["intra"] + extra for s in sent]
                     + [dense["inter"] + dense["intra"]], jnp.float32)


def _whole_table(whole: Any, padded: int, local: int, hierarchical: bool) -> np.ndarray:
  """int32[shards, c]: the positions, within each worker's part, of the elements `whole` marks
  (bool over the flat buffer); `part_len` pads a shard with fewer (dropped where used)."""
  mask = np.zeros(padded, bool)
  whole = np.asarray(whole, bool).reshape(-1)
  if whole.shape[0] > padded:
    raise ValueError(f"whole has {whole.shape[0]} flags for a buffer of {padded} values")
  mask[:whole.shape[0]] = whole
  shards = local if hierarchical else 1
  part_len = padded // shards
  rows = [np.flatnonzero(mask[i * part_len:(i + 1) * part_len]) for i in range(shards)]
  width = max(1, max(len(r) for r in rows))
  table = np.full((shards, width), part_len, np.int32)
  for i, r in enumerate(rows):
    table[i, :len(r)] = r
  return table


def _settle(collective: comm.SparseCollective, whole: Any, values: jax.Array,
            indices: jax.Array, kept: Feedback, local: int, masking: bool
            ) -> tuple[jax.Array, Feedback]:
  """`comm.settle` (the pairs), then `_send_whole` (the whole positions)."""
  total, kept = comm.settle(collective, values, indices, kept, kept.residual.shape[0], masking)
  return _send_whole(collective, whole, total, kept, local, masking)


def _send_whole(collective: comm.SparseCollective, whole: Any, total: jax.Array,
                kept: Feedback, local: int, masking: bool) -> tuple[jax.Array, Feedback]:
  """After the pairs: what this worker still holds at the positions `whole` flags
  (`_whole_table`) summed over the workers by an all-reduce of those values alone and added to
  `total`, the residual emptied there (the velocity too with `masking`): these positions are
  sent whole every step. `whole` None: `(total, kept)` as they are."""
  if whole is None:
    return total, kept
  hierarchical = collective.name in comm.HIERARCHICAL_ALGORITHMS
  part_len = kept.residual.shape[0]
  table = _whole_table(whole, part_len * (local if hierarchical else 1), local, hierarchical)
  if hierarchical:
    node_axis, local_axis = collective.axes
    shard = lax.axis_index(local_axis)
    idx = jnp.asarray(table)[shard]
  else:
    idx = jnp.asarray(table[0])
  values = kept.residual.at[idx].get(mode="fill", fill_value=0)
  if hierarchical:
    summed = lax.all_gather(lax.psum(values, node_axis), local_axis)  # [local, c]
    offsets = (np.arange(table.shape[0]) * part_len)[:, None]
    where = np.where(table < part_len, table + offsets, total.shape[0]).reshape(-1)
    total = total.at[jnp.asarray(where)].add(summed.reshape(-1), mode="drop")
  else:
    total = total.at[idx].add(lax.psum(values, collective.axes), mode="drop")
  residual = kept.residual.at[idx].set(0, mode="drop")
  velocity = kept.velocity
  if masking and velocity is not None:
    velocity = velocity.at[idx].set(0, mode="drop")
  return total, kept._replace(residual=residual, velocity=velocity)


def _sparse(collective: comm.SparseCollective, select: Callable, levels: tuple[float, ...],
            density_schedule: Callable | None, error_feedback: bool,
            correction: Correction | None, balance: str = "global", segments: Any = None,
            dense_level: bool = False, whole: Any = None) -> optax.GradientTransformation:
  """The mean through `collective`, `select`ing at one of `levels` a step, error feedback if
  `error_feedback`; `dense_level`: `_dense_run` at level len(levels); `whole`: `_send_whole`."""
  def shapes(tree: Any) -> tuple[FlatLayout, int, int, int]:
    nodes, local = _workers(f"topk_allreduce(algorithm={collective.name!r})", collective.axes)
    layout = FlatLayout.from_tree(tree, pad_to=local)
    part = (layout.padded_size // local if collective.name in comm.HIERARCHICAL_ALGORITHMS
            else layout.padded_size)
    return layout, nodes, local, part

  def init_fn(params: Any) -> ExchangeState:
    part = shapes(params)[-1]
    momentum = correction.momentum if isinstance(correction, MomentumCorrection) else 0.0
    feedback = (init_feedback(part, momentum, isinstance(correction, AdamCorrection))
                if error_feedback else None)
    return ExchangeState(feedback, jnp.zeros([], jnp.int32), jnp.float32(levels[0]),
                         jnp.zeros([], jnp.float32))

  def update_fn(updates: Any, state: ExchangeState, params: Any = None, *,
                density_level: int | None = None, **extra_args: Any):
    del params, extra_args
    layout, nodes, local, part_len = shapes(updates)
    for r in jax.tree.leaves(state.feedback):
      if r.shape != (part_len,):
        raise ValueError(f"state residual has shape {r.shape}, expected ({part_len},): "
                         "was init run inside the same shard_map mesh?")
    part = collective.scatter(layout.ravel(updates, jnp.float32))

    def correction_args(feedback: Feedback | None, balanced: bool = True) -> dict:
      extra = {} if not isinstance(correction, AdamCorrection) else {
          "count": state.count,  # each hierarchical shard sums its node's `local` gradients
          "scale": local if collective.name in comm.HIERARCHICAL_ALGORITHMS else 1}
      if balanced and balance == "tensor" and feedback is not None:
        extra["weights"] = _balance_weights(part, feedback, correction, layout, part_len,
                                            collective, segments)
      return extra

    def at(level: float) -> Callable:
      def run(part: jax.Array, feedback: Feedback | None):
        k = max(1, round(level * part_len))
        topk_lib.check_k(part, k)
        masking = isinstance(correction, MomentumCorrection) and correction.masking
        values, indices, kept = feedback_select(
            part, feedback, k, select,
            correction=correction if collective.reduce is None else _unmasked(correction),
            **correction_args(feedback))
        total, kept = _settle(collective, whole, values, indices, kept, local, masking)
        return total, kept if error_feedback else None
      return run

    index = _level(levels, density_schedule, state.count, density_level, dense_level)
    if isinstance(index, int) and index == len(levels):  # the dense form
      total, feedback = _dense_run(collective, part, state.feedback, correction,
                                   correction_args(state.feedback, balanced=False))
    else:
      runs = [at(level) for level in levels]
      total, feedback = (runs[index](part, state.feedback) if isinstance(index, int)
                         else lax.switch(index, runs, part, state.feedback))
    return _mean_out(total, nodes * local, layout, updates), ExchangeState(
        feedback, state.count + 1, jnp.asarray(levels + (1.0,), jnp.float32)[index], _bytes_sent(
            collective.name, layout.padded_size, part_len, levels, nodes, local, whole)[index])

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def topk_allreduce(density: float, *, algorithm: str = "hitopk",
                   selector: str | Callable = "mstopk",
                   axis_name: str | tuple[str, ...] | None = None,
                   correction: Correction | None = None, error_feedback: bool = True,
                   density_schedule: Callable[[jax.Array], jax.Array] | None = None,
                   balance: str = "global", segments: Any = None, dense_level: bool = False,
                   whole: Any = None, **deprecated: Any) -> optax.GradientTransformation:
  """Mean of the gradient over all workers, sent as top-k (value, index) pairs.

  Args:
    density: fraction of each buffer sent per step, in (0, 1]; `k = max(1, round(density * L))`
      where L is the shard length (padded n / local for "hitopk" and "higtopk", padded n for
      "allgather" and "gtopk").
    algorithm: "hitopk" (HiTopKComm), "allgather" (TopK all-gather), "gtopk" (gTop-k: a
      recursive-doubling merge to k global positions, traffic growing with log2 of the workers),
      "higtopk" (HiTopKComm with gTop-k between the nodes); "hierarchical" or "dense"
      return the uncompressed baselines `hierarchical_mean` / `dense_mean` (density, selector,
      error feedback and schedule are then ignored).
    selector: "mstopk", "exact", "sampled", or a callable `(x, k) -> (values, indices)`.
    axis_name: the axes the workers span, as JAX code binds them: one name
      (`jax.pmap(..., axis_name="batch")`, a 1-D mesh) or a tuple of names for "dense",
      "allgather" and "gtopk"; two names (slow inter-node, fast intra-node) for "hitopk",
      "higtopk" and "hierarchical". None (default): `("node", "local")`.
    correction: None (plain error feedback), `MomentumCorrection(momentum, nesterov=False,
      masking=True)` or `AdamCorrection(b1, b2, eps)` (`sparsejax.feedback`), below.
    error_feedback: keep what was not sent and add it next step (`sparsejax.feedback`).
    density_schedule: optional optax schedule `count -> density` (DGC's warm-up: start dense and
      decay to `density`). Each step's value is rounded up to one of `density_levels(density)`, so
      shapes stay static; each level compiles once and one runs per step (a `lax.switch`). A
      caller that knows the step can pick the level itself and skip the switch (on CPU it cost
      as much as the exchange: the branches' outputs are copied): `update(...,
      density_level=level_index(density_levels(density), schedule(step)))` with a Python int,
      one compiled step per level (what sparsejax's trainer does).
    A `MomentumCorrection` (DGC, Lin et al. 2018; a `Feedback` with a velocity) accumulates
      the momentum per worker BEFORE top-k selection, so the returned mean already carries it:
      chain an optimizer WITHOUT momentum (e.g. `optax.sgd(lr)`). Its `masking` (DGC's momentum
      factor masking, the default) zeroes the velocity where sent; False lets it run on: sent
      plus kept is then exactly what momentum SGD applies (better in sparsejax's convergence
      study). An `AdamCorrection` runs the worker's Adam moments before selection (the
      candidates are Adam directions; `sparsejax.feedback.adam_direction`), so the returned mean
      is the workers' AdamW step without learning rate and decay: chain an SGD without momentum
      whose weight decay is AdamW's (`optax.sgd(lr)` after `optax.add_decayed_weights(wd)`).
      Either needs a sparse algorithm and error feedback.
    balance: "global" (one top-k over the whole buffer) or "tensor": the candidates of each
      tensor scaled by a power of two near 1 / their RMS before the one top-k, so each tensor
      gets about its share of the k (a global top-k starves tensors whose gradients are small,
      such as a Transformer's position embeddings); what is sent is unscaled. Error feedback,
      plain or with a `MomentumCorrection`.
    segments: with balance="tensor" and updates that are already one flat buffer (sparsejax's
      trainer), the tensor id of each of its elements (`FlatLayout.segment_ids`); default: the
      leaves of the updates are the tensors.
    dense_level: also offer the dense form (a sparse algorithm only): `update(...,
      density_level=L)` with L the number of levels (`len(density_levels(density))` with a
      schedule, else 1) sums every candidate (gradient plus residual, with the correction's
      velocity or Adam direction) by an all-reduce ("dense" for the flat algorithms,
      "hierarchical" for the hierarchical ones) and empties the residual: nothing is lost when
      a run switches between sparse and dense exchanges (`sparsejax.train.auto`).
    whole: bool flags over the flat buffer (the updates raveled, `FlatLayout` order; or a
      shorter prefix of it), the elements sent whole every step beside the pairs: what a
      worker still holds there after its selection is summed by an all-reduce of those values
      alone (4 bytes each) and its memory there emptied. For small tensors whose every
      coordinate matters, such as BatchNorm's scales and biases (DGC leaves them
      uncompressed). Needs error feedback.
    **deprecated: `node_axis=`, `local_axis=` (now `axis_name=(node, local)`, or one name),
      `momentum=`, `nesterov=`, `momentum_masking=`, `adam=` (now `correction=`): still taken,
      with a DeprecationWarning, until the next release.

  Returns:
    An `optax.GradientTransformationExtraArgs` with an `ExchangeState` (its update takes the
    optional keyword `density_level`); `init` and `update` must run where the axes are bound
    (inside `shard_map` or `pmap`).

  Example:
    >>> tx = optax.chain(topk_allreduce(0.001), optax.sgd(0.1, momentum=0.9))
    >>> # inside shard_map(..., mesh=Mesh(devices.reshape(2, 4), ("node", "local"))):
    >>> #   updates, state = tx.update(grads, state, params)
    >>> tx = optax.chain(topk_allreduce(0.01, algorithm="allgather", axis_name="batch"),
    ...                  optax.sgd(0.1, momentum=0.9))
    >>> # inside jax.pmap(..., axis_name="batch"): the same calls
  """
  axis_name, correction = _deprecated(deprecated, axis_name, correction)
  _check_args(density, algorithm, error_feedback, correction)
  if balance not in ("global", "tensor"):
    raise ValueError(f"balance must be 'global' or 'tensor', got {balance!r}")
  if balance == "tensor" and (isinstance(correction, AdamCorrection) or not error_feedback):
    raise ValueError(f"balance='tensor' works with error feedback, plain or with a "
                     f"MomentumCorrection, got correction={correction!r}, "
                     f"error_feedback={error_feedback!r}")
  axes = _axes(algorithm, axis_name)
  select = topk_lib.get_selector(selector)
  if dense_level and algorithm not in comm.SPARSE_ALGORITHMS:
    raise ValueError(f"dense_level=True needs a sparse algorithm {comm.SPARSE_ALGORITHMS}, got "
                     f"algorithm={algorithm!r} (already dense)")
  if algorithm == "dense":
    return dense_mean(axes)
  if algorithm == "hierarchical":
    return hierarchical_mean(*axes)
  if whole is not None and not error_feedback:
    raise ValueError("whole= needs error_feedback=True (the whole positions are sent from the "
                     "memory each worker keeps)")
  collective = comm.sparse_collective(algorithm, axes)
  levels = density_levels(density) if density_schedule is not None else (float(density),)
  return _sparse(collective, select, levels, density_schedule, error_feedback, correction,
                 balance, segments, dense_level, whole)


_DEPRECATED = ("node_axis", "local_axis", "momentum", "nesterov", "momentum_masking", "adam")


def _deprecated(old: dict[str, Any], axis_name: Any, correction: Correction | None
                ) -> tuple[Any, Correction | None]:
  """`(axis_name, correction)` with the keywords of earlier releases folded in (each with a
  DeprecationWarning); a TypeError for a keyword topk_allreduce never took."""
  unknown = sorted(set(old) - set(_DEPRECATED))
  if unknown:
    raise TypeError(f"topk_allreduce got unexpected keyword(s) {unknown}; it takes density, "
                    "algorithm, selector, axis_name, correction, error_feedback, "
                    "density_schedule, balance, segments, dense_level, whole")
  if "node_axis" in old or "local_axis" in old:
    if axis_name is not None:
      raise ValueError(f"give the axes either as axis_name or as node_axis/local_axis, not both "
                       f"(axis_name={axis_name!r}, {sorted(old)})")
    names = tuple(a for a in (old.get("node_axis", "node"), old.get("local_axis", "local"))
                  if a is not None)
    axis_name = names[0] if len(names) == 1 else names
    warnings.warn(f"topk_allreduce: node_axis= and local_axis= are deprecated and go in the "
                  f"next release; pass axis_name={axis_name!r}", DeprecationWarning,
                  stacklevel=3)
  spelled = {k: old[k] for k in ("momentum", "nesterov", "adam") if k in old}
  if "momentum_masking" in old:
    spelled["masking"] = old["momentum_masking"]
  if spelled:
    if correction is not None:
      raise ValueError(f"give either correction= or {sorted(spelled)}, not both")
    if "adam" in spelled and (spelled.get("momentum") or spelled.get("nesterov")):
      raise ValueError(f"Adam correction excludes momentum correction, got "
                       f"momentum={spelled.get('momentum')!r}, adam={spelled['adam']!r}")
    if isinstance(spelled.get("masking", True), bool) is False:
      raise ValueError(f"momentum_masking must be True or False, got {spelled['masking']!r}")
    correction = legacy_correction("topk_allreduce", stacklevel=4, **spelled)
  return axis_name, correction
