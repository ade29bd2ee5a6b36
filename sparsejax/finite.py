"""Skipping a step with a non-finite gradient, agreed by every worker: one optax wrapper.

`optax.apply_if_finite(inner, k)` skips a bad step for the whole chain it wraps, but each worker
decides alone: inside `shard_map` one worker with a NaN would skip while the others apply, and
the replicas would drift apart. `apply_if_finite_across(inner, axis_name)` takes the same
decision on every worker: the finiteness of each worker's incoming updates is combined with a
`lax.pmin` over the mesh axes, so a NaN anywhere skips the step everywhere. Called like
`optax.apply_if_finite` (no `axis_name`), it agrees over every axis bound where `update` runs
(shard_map's, pmap's, a named vmap's): its default cannot leave one worker skipping while the
others wait in a collective of the inner chain. A skipped step
returns zero updates and the inner state exactly as it was (parameters, optimizer moments,
compression residuals and counters all unchanged); nothing inside `inner` needs to know.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

__all__ = ["apply_if_finite_across", "all_finite"]


def all_finite(tree: Any) -> jax.Array:
  """bool[]: every value of every leaf of `tree` is finite.

  One fused reduction per leaf: `x - x` is NaN exactly where x is inf or NaN, and 0 elsewhere
  (no overflow). `all(isfinite(x))` made XLA:CPU write a bool mask of the whole buffer first,
  `sum(x * 0)` a buffer of zeros; `max(abs(x))` misses a NaN on XLA:CPU."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  ok = jnp.asarray(True)
  for x in leaves:
    if jnp.size(x):
      ok = ok & jnp.isfinite(jnp.sum(x - x))
  return ok


def _varying(x: Any) -> frozenset:
  """The manual mesh axes `x` (an array or a ShapeDtypeStruct) varies over inside shard_map."""
  kind = x.manual_axis_type if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(
      x).manual_axis_type
  return frozenset() if kind is None else kind.varying


def _vary(x: jax.Array, axes: frozenset) -> jax.Array:
  """`x` marked as varying over `axes` too (both branches of a `lax.cond` inside `shard_map`
  must return the same types; outside it this does nothing)."""
  missing = tuple(sorted(axes - _varying(x)))
  return lax.pcast(x, missing, to="varying") if missing else x


def _bound_axes() -> tuple:
  """The mapped axis names bound where this is traced: shard_map's manual axes, pmap's and a
  named vmap's axis (JAX has no public query for them; `unsafe_get_axis_names` reads the trace's
  axis environment, jax 0.10.x)."""
  from jax._src import core
  return tuple(core.unsafe_get_axis_names())


def apply_if_finite_across(inner: optax.GradientTransformation,
                           axis_name: str | Sequence[str] | None = None,
                           max_consecutive_errors: int | None = None
                           ) -> optax.GradientTransformationExtraArgs:
  """`optax.apply_if_finite(inner, ...)`, with the decision agreed over the mesh axes.

  Args:
    inner: the transform to protect, typically a whole chain (clip, `topk_allreduce`, optimizer).
    axis_name: the axes the workers span (one name or a tuple, as bound by `shard_map` or
      `pmap`); the step is skipped on every worker if any worker's updates are not finite.
      None (default): every axis bound where `update` is traced (all of shard_map's manual
      axes, pmap's axis), found at trace time; outside any mapped context, no collective.
      `()`: no collective, each caller decides alone (exactly `optax.apply_if_finite`; safe
      only when `inner` has no collective).
    max_consecutive_errors: after this many non-finite steps in a row the update is applied
      anyway (optax's behaviour); None (default): never applied, the caller decides when to stop
      (the trainer stops the run after `max_consecutive_skips`).

  Returns:
    A transform whose state is an `optax.ApplyIfFiniteState`: `notfinite_count` (non-finite
    steps in a row), `last_finite` (bool, the last step was finite everywhere),
    `total_notfinite` and `inner_state`. The counters are the same on every worker.

  Example:
    >>> tx = apply_if_finite_across(optax.chain(topk_allreduce(0.01), fused_sgd(0.1, 0.9)),
    ...                             axis_name=("node", "local"))
    >>> # inside shard_map: a NaN on one worker leaves params and every state as they were
  """
  if max_consecutive_errors is not None and (
      isinstance(max_consecutive_errors, bool) or not isinstance(max_consecutive_errors, int)
      or max_consecutive_errors < 0):
    raise ValueError(f"max_consecutive_errors must be an int >= 0 or None, got "
                     f"{max_consecutive_errors!r}")
  axes = (axis_name,) if isinstance(axis_name, str) else axis_name
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: Any) -> optax.ApplyIfFiniteState:
    return optax.ApplyIfFiniteState(notfinite_count=jnp.zeros([], jnp.int32),
                                    last_finite=jnp.array(True),
                                    total_notfinite=jnp.zeros([], jnp.int32),
                                    inner_state=inner.init(params))

  def update_fn(updates: Any, state: optax.ApplyIfFiniteState, params: Any = None,
                **extra_args: Any):
    finite = all_finite(updates)
    over = _bound_axes() if axes is None else tuple(axes)
    unagreed = _varying(finite) - set(over)
    if over and unagreed:  # shard_map's types say some workers could decide otherwise
      raise ValueError(
          f"apply_if_finite_across(axis_name={axis_name!r}): the updates vary over mesh axes "
          f"{sorted(unagreed)} too, so workers along them could skip while the others wait in a "
          f"collective; pass axis_name={tuple(sorted(set(over) | unagreed))!r} (or leave it "
          f"None: every bound axis)")
    if over:
      finite = lax.pmin(finite.astype(jnp.int32), over).astype(bool)
    notfinite_count = jnp.where(finite, 0, optax.safe_increment(state.notfinite_count))
    apply = finite
    if max_consecutive_errors is not None:
      apply = finite | (notfinite_count > max_consecutive_errors)

    def do_update(inner_state):
      out, new_state = inner.update(updates, inner_state, params, **extra_args)
      return out, jax.tree.map(lambda n, o: _vary(jnp.astype(n, o.dtype), _varying(o)),
                               new_state, inner_state)

    def reject_update(inner_state):
      out, new_state = jax.eval_shape(do_update, inner_state)
      return (jax.tree.map(lambda s: _vary(jnp.zeros(s.shape, s.dtype), _varying(s)), out),
              jax.tree.map(lambda o, s: _vary(o, _varying(s)), inner_state, new_state))

    # lax.cond, not a select: the rejected step runs nothing (no collective, no optimizer
    # kernel), and the branch is the same on every worker, so collectives inside stay matched.
    new_updates, inner_state = lax.cond(apply, do_update, reject_update, state.inner_state)
    return new_updates, optax.ApplyIfFiniteState(
        notfinite_count=notfinite_count, last_finite=finite,
        total_notfinite=jnp.where(finite, state.total_notfinite,
                                  optax.safe_increment(state.total_notfinite)),
        inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
