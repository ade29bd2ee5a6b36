"""Gradient compression as an optax `GradientTransformation`: top-k all-reduce with error feedback.

`topk_allreduce(...)` is called inside `shard_map` or `pmap` over the axes it is given (one name or
several for dense and TopK all-gather, `(node, local)` for the hierarchical algorithms), like
optax's transforms that take an axis name. `update` ravels the gradient pytree once into a flat
float32 buffer, adds the residual, runs the chosen collective and returns the MEAN over all workers
with the gradient's own structure and dtypes. Its state is per worker (the residual differs on
every worker), so `init` also runs inside `shard_map`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from sparsejax import comm
from sparsejax import topk as topk_lib
from sparsejax.flat import FlatLayout

__all__ = ["TopKAllReduceState", "topk_allreduce", "density_levels", "level_index"]


class TopKAllReduceState(NamedTuple):
  """Per-worker state of `topk_allreduce`.

  residual: float32[r], what this worker has not sent yet (r = padded n for "allgather", padded
    n / local for "hitopk"); with momentum correction a `comm.Corrected(residual, velocity)` pair
    of such arrays; None for the dense algorithms or without error feedback (no zero-size
    arrays: XLA and orbax both handle those badly).
  count: int32 number of updates so far (drives `density_schedule`).
  density: float32 density used at the last update.
  bytes_sent: float32 inter- plus intra-node bytes this worker sent at the last update.
  skipped: bool, True if the last update saw a non-finite gradient and was skipped.
  skipped_steps: int32 number of skipped updates so far.
  """

  residual: jax.Array | comm.Corrected | None
  count: jax.Array
  density: jax.Array
  bytes_sent: jax.Array
  skipped: jax.Array
  skipped_steps: jax.Array


def density_levels(density: float, ratio: float = 4.0) -> tuple[float, ...]:
  """The static densities a schedule is rounded up to: density * ratio**j below 1, then 1."""
  levels, d = [], density
  while d < 1.0:
    levels.append(d)
    d *= ratio
  return tuple(levels) + (1.0,)


def _check_density(name: str, value: float) -> None:
  if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
    raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")


def _all_finite(x: jax.Array) -> jax.Array:
  """bool[]: every value of `x` is finite. One reduction, max |x|, which is inf or NaN exactly
  when some value is (`all(isfinite(x))` made XLA:CPU write a bool mask of the whole buffer
  first, and `sum(x * 0)` a buffer of zeros)."""
  return jnp.isfinite(jnp.max(jnp.abs(x)))


def level_index(levels: tuple[float, ...], wanted):
  """Index of the first of `levels` (increasing) at or above the density `wanted`, the last one
  beyond them: jnp for a traced `wanted`, a Python int for a number."""
  if isinstance(wanted, jax.Array):
    index = jnp.sum(jnp.asarray(levels, jnp.float32) < wanted * (1 - 1e-6)).astype(jnp.int32)
    return jnp.minimum(index, len(levels) - 1)
  wanted = float(wanted)
  return min(sum(lv < wanted * (1 - 1e-6) for lv in levels), len(levels) - 1)


def _axes(algorithm: str, axis_name: Any, node_axis: str | None,
          local_axis: str | None) -> tuple[str, ...]:
  """The axes topk_allreduce runs over, from `axis_name` or `(node_axis, local_axis)`."""
  if axis_name is not None:
    if (node_axis, local_axis) != ("node", "local"):
      raise ValueError(f"give the axes either as axis_name or as node_axis/local_axis, not both "
                       f"(axis_name={axis_name!r}, node_axis={node_axis!r}, "
                       f"local_axis={local_axis!r})")
    return comm.axis_names(algorithm, axis_name)
  pair = tuple(a for a in (node_axis, local_axis) if a is not None)
  if algorithm in comm.HIERARCHICAL_ALGORITHMS and len(pair) != 2:
    raise ValueError(f"algorithm {algorithm!r} needs two axes, node_axis (slow) and local_axis "
                     f"(fast), got node_axis={node_axis!r}, local_axis={local_axis!r}; over one "
                     f"axis use 'allgather' (sparse) or 'dense'")
  if not pair:
    raise ValueError("node_axis and local_axis are both None: name the axes (axis_name=...)")
  return comm.axis_names(algorithm, pair)


def topk_allreduce(density: float, *, algorithm: str = "hitopk",
                   selector: str | Callable = "mstopk",
                   axis_name: str | tuple[str, ...] | None = None,
                   node_axis: str | None = "node", local_axis: str | None = "local",
                   error_feedback: bool = True,
                   density_schedule: Callable[[jax.Array], jax.Array] | None = None,
                   momentum: float = 0.0, nesterov: bool = False,
                   momentum_masking: bool = True) -> optax.GradientTransformation:
  """Mean of the gradient over all workers, sent as top-k (value, index) pairs.

  Args:
    density: fraction of each buffer sent per step, in (0, 1]; `k = max(1, round(density * L))`
      where L is the shard length (padded n / local for "hitopk", padded n for "allgather").
    algorithm: "hitopk" (HiTopKComm), "allgather" (TopK all-gather), "hierarchical" or "dense"
      (uncompressed baselines; density is then ignored).
    selector: "mstopk", "exact", "sampled", or a callable `(x, k) -> (values, indices)`.
    axis_name: the axes the workers span, as JAX code binds them: one name
      (`jax.pmap(..., axis_name="batch")`, a 1-D mesh) or a tuple of names for "dense" and
      "allgather"; two names (slow inter-node, fast intra-node) for "hitopk" and "hierarchical".
      None (default): `(node_axis, local_axis)`.
    node_axis, local_axis: the same as two names (slow, fast), the default spelling; a None one
      is left out (for the flat algorithms). Give either these or `axis_name`.
    error_feedback: keep what was not sent and add it next step.
    density_schedule: optional optax schedule `count -> density` (DGC's warm-up: start dense and
      decay to `density`). Each step's value is rounded up to one of `density_levels(density)`, so
      shapes stay static; each level compiles once and one runs per step (a `lax.switch`). A
      caller that knows the step can pick the level itself and skip the switch (on CPU it cost
      as much as the exchange: the branches' outputs are copied): `update(...,
      density_level=level_index(density_levels(density), schedule(step)))` with a Python int,
      one compiled step per level (what sparsejax's trainer does).
    momentum, nesterov: momentum correction (DGC, Lin et al. 2018; `comm.Corrected`): the
      momentum is accumulated per worker BEFORE top-k selection, so the returned mean already
      carries it: chain an optimizer WITHOUT momentum (e.g. `optax.sgd(lr)`).
      0 (default) = plain error feedback; needs a sparse algorithm and error feedback.
    momentum_masking: with momentum correction, also zero the velocity where sent (DGC's
      momentum factor masking). False lets it run on: sent plus kept is then exactly what
      momentum SGD applies (better in sparsejax's convergence study, see the README).

  Returns:
    An `optax.GradientTransformationExtraArgs` (its update takes the optional keyword
    `density_level`); `init` and `update` must run where the axes are bound (inside `shard_map`
    or `pmap`).

  Example:
    >>> tx = optax.chain(topk_allreduce(0.001), optax.sgd(0.1, momentum=0.9))
    >>> # inside shard_map(..., mesh=Mesh(devices.reshape(2, 4), ("node", "local"))):
    >>> #   updates, state = tx.update(grads, state, params)
    >>> tx = optax.chain(topk_allreduce(0.01, algorithm="allgather", axis_name="batch"),
    ...                  optax.sgd(0.1, momentum=0.9))
    >>> # inside jax.pmap(..., axis_name="batch"): the same calls
  """
  _check_density("density", density)
  if algorithm not in comm.ALGORITHMS:
    raise ValueError(f"unknown algorithm {algorithm!r}; allowed: {list(comm.ALGORITHMS)}")
  axes = _axes(algorithm, axis_name, node_axis, local_axis)
  select = topk_lib.get_selector(selector)
  sparse = algorithm in comm.SPARSE_ALGORITHMS
  if isinstance(momentum, bool) or not isinstance(momentum, int | float) or not 0 <= momentum < 1:
    raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
  if momentum and not (sparse and error_feedback):
    raise ValueError(f"momentum correction (momentum={momentum!r}) needs a sparse algorithm "
                     f"(hitopk, allgather) with error feedback, got algorithm={algorithm!r}, "
                     f"error_feedback={error_feedback!r}; otherwise use the optimizer's momentum")
  if nesterov and not momentum:
    raise ValueError("nesterov=True needs momentum > 0")
  if not isinstance(momentum_masking, bool):
    raise ValueError(f"momentum_masking must be True or False, got {momentum_masking!r}")
  if not sparse:  # everything is sent: density 1, whatever the schedule says
    levels: tuple[float, ...] = (1.0,)
  elif density_schedule is not None:
    levels = density_levels(density)
  else:
    levels = (float(density),)

  def shapes(tree: Any) -> tuple[FlatLayout, int, int, int]:
    # nodes: workers over all axes but the last; local: over the last (the buffer is padded to a
    # multiple of it; for a hierarchical algorithm the two are the slow and the fast axis).
    try:
      sizes = [comm.axis_size(a) for a in axes]
    except ValueError as e:
      raise ValueError(f"topk_allreduce(algorithm={algorithm!r}) runs over the axes {axes}: "
                       f"{e}") from e
    nodes, local = math.prod(sizes[:-1]), sizes[-1]
    layout = FlatLayout.from_tree(tree, pad_to=local)
    shard = layout.padded_size // local if algorithm == "hitopk" else layout.padded_size
    return layout, nodes, local, shard

  def init_fn(params: Any) -> TopKAllReduceState:
    _, _, _, shard = shapes(params)
    residual = jnp.zeros(shard, jnp.float32) if (sparse and error_feedback) else None
    if momentum:
      residual = comm.Corrected(residual, jnp.zeros(shard, jnp.float32))
    return TopKAllReduceState(residual, jnp.zeros([], jnp.int32),
                              jnp.float32(levels[0]), jnp.zeros([], jnp.float32),
                              jnp.zeros([], bool), jnp.zeros([], jnp.int32))

  def update_fn(updates: Any, state: TopKAllReduceState, params: Any = None, *,
                density_level: int | None = None, **extra_args: Any):
    del params, extra_args
    layout, nodes, local, shard = shapes(updates)
    if error_feedback and sparse:
      for r in jax.tree.leaves(state.residual):
        if r.shape != (shard,):
          raise ValueError(f"state residual has shape {r.shape}, expected ({shard},): "
                           "was init run inside the same shard_map mesh?")
    flat = layout.ravel(updates, jnp.float32)
    finite = lax.pmin(_all_finite(flat).astype(jnp.int32), axes).astype(bool)
    if sparse:  # keep NaN out of the selection; a dense sum is simply masked afterwards
      flat = jnp.where(finite, flat, 0.0)
    residual = state.residual if (sparse and error_feedback) else None
    n = layout.padded_size

    def run(level: float):
      def branch(flat, residual):
        if not sparse:
          if algorithm == "dense":
            total = comm.dense_allreduce(flat, axes=axes)
          else:
            total = comm.hierarchical_allreduce(flat, node_axis=axes[0], local_axis=axes[1])
          sent = comm.wire_bytes(algorithm, n=n, nodes=nodes, local=local)
          return total, residual, jnp.float32(sent["inter"] + sent["intra"])
        k = max(1, round(level * shard))
        if algorithm == "hitopk":
          total, new_res = comm.hitopk_allreduce(flat, k, node_axis=axes[0],
                                                 local_axis=axes[1], residual=residual,
                                                 select=select, momentum=momentum,
                                                 nesterov=nesterov,
                                                 momentum_masking=momentum_masking)
        else:
          total, new_res = comm.topk_allgather(flat, k, axes=axes, residual=residual,
                                               select=select, momentum=momentum,
                                               nesterov=nesterov,
                                               momentum_masking=momentum_masking)
        sent = comm.wire_bytes(algorithm, n=n, k=k, nodes=nodes, local=local)
        return total, (new_res if residual is not None else None), \
            jnp.float32(sent["inter"] + sent["intra"])
      return branch

    if density_level is not None:  # chosen by the caller, who knows the step: no lax.switch
      if (isinstance(density_level, bool) or not isinstance(density_level, int)
          or not 0 <= density_level < len(levels)):
        raise ValueError(f"density_level must be a Python int in [0, {len(levels)}) (an index "
                         f"into the levels {levels}), got {density_level!r}")
      index = jnp.int32(density_level)
      total, new_res, sent = run(levels[density_level])(flat, residual)
    elif len(levels) == 1:
      index = jnp.int32(0)
      total, new_res, sent = run(levels[0])(flat, residual)
    else:
      index = level_index(levels, jnp.asarray(density_schedule(state.count), jnp.float32))
      total, new_res, sent = lax.switch(index, [run(lv) for lv in levels], flat, residual)

    mean = jnp.where(finite, total / (nodes * local), 0.0)
    if residual is not None:
      new_res = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_res, state.residual)
    else:
      new_res = state.residual
    out = layout.unravel(mean)
    out = jax.tree.map(lambda o, g: o.astype(g.dtype), out, updates)
    skipped = ~finite
    new_state = TopKAllReduceState(
        new_res, state.count + 1, jnp.asarray(levels, jnp.float32)[index], sent, skipped,
        state.skipped_steps + skipped.astype(jnp.int32))
    return out, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)

