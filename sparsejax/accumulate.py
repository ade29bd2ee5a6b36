"""Gradient accumulation that runs the wrapped transform only when it applies.

`optax.MultiSteps(inner, k)` computes `inner.update` on every micro-step and keeps its result only
on the k-th (a select between old and new state). With `topk_allreduce` inside `inner` that is a
top-k selection and a collective per micro-step whose result is thrown away. `multi_steps(inner,
k)` is the same transform, state and numbers (`optax.MultiStepsState`, the mean of the micro-step
gradients handed to `inner` on every k-th call, zero updates in between), but calls `inner.update`
under `lax.cond`: the selection and the collectives run once per accumulated step. Every worker
takes the same branch (the micro-step count is the same everywhere), so collectives inside
`inner` stay matched under `shard_map` and `pmap` (under `shard_map` with `check_vma=False`, as
for `topk_allreduce` itself; optax.MultiSteps needs it too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

__all__ = ["multi_steps"]


def multi_steps(inner: optax.GradientTransformation,
                every_k_schedule: int | Callable[[jax.Array], jax.Array],
                use_grad_mean: bool = True, accumulator_dtype: Any = jnp.float32
                ) -> optax.GradientTransformationExtraArgs:
  """`optax.MultiSteps(inner, every_k_schedule, use_grad_mean)`, with `inner` run only on the
  micro-steps that apply an update.

  Args:
    inner: the transform applied to the accumulated gradient (e.g.
      `optax.chain(sparsejax.topk_allreduce(...), optax.sgd(...))`).
    every_k_schedule: micro-steps per update, an int >= 1 or a function of the update count.
    use_grad_mean: average the micro-step gradients (True, optax's default) or sum them.
    accumulator_dtype: dtype of the accumulated gradient.
    (optax's `should_skip_update_fn` is not offered: skip non-finite steps inside `inner`.)

  Returns:
    A transform whose state is an `optax.MultiStepsState` (so
    `optax.MultiSteps(inner, k).has_updated(state)` works on it); extra `update` arguments are
    passed to `inner`.

  Example:
    >>> tx = multi_steps(optax.chain(topk_allreduce(0.01), optax.sgd(0.1, momentum=0.9)), 4)
    >>> # inside shard_map: updates are zero on 3 micro-steps of 4; top-k runs on the 4th only.
  """
  if isinstance(every_k_schedule, bool) or not (
      callable(every_k_schedule)
      or (isinstance(every_k_schedule, int) and every_k_schedule >= 1)):
    raise ValueError(f"every_k_schedule must be an int >= 1 or a schedule, got "
                     f"{every_k_schedule!r}")
  reference = optax.MultiSteps(inner, every_k_schedule, use_grad_mean,
                               accumulator_dtype=accumulator_dtype)
  inner = optax.with_extra_args_support(inner)
  schedule = every_k_schedule if callable(every_k_schedule) else (lambda _: every_k_schedule)
  acc_dtype = jax.dtypes.canonicalize_dtype(accumulator_dtype)

  def update_fn(updates: Any, state: optax.MultiStepsState, params: Any = None,
                **extra_args: Any):
    k_steps = schedule(state.gradient_step)
    if use_grad_mean:
      acc = jax.tree.map(lambda g, a: a + (g - a) / (state.mini_step + 1), updates,
                         state.acc_grads)
    else:
      acc = jax.tree.map(lambda g, a: g + a, updates, state.acc_grads)
    emit = state.mini_step == (k_steps - 1)
    grads = optax.tree.cast_like(acc, updates)

    def apply(grads, inner_state):
      out, new_inner = inner.update(grads, inner_state, params, **extra_args)
      return out, jax.tree.map(lambda n, o: jnp.astype(n, o.dtype), new_inner, inner_state)

    def wait(grads, inner_state):
      shapes, _ = jax.eval_shape(apply, grads, inner_state)
      return optax.tree.zeros_like(shapes), inner_state

    out, inner_state = lax.cond(emit, apply, wait, grads, state.inner_opt_state)
    new_state = optax.MultiStepsState(
        mini_step=optax.safe_increment(state.mini_step) % k_steps,
        gradient_step=jnp.where(emit, optax.safe_increment(state.gradient_step),
                                state.gradient_step),
        inner_opt_state=inner_state,
        acc_grads=jax.tree.map(lambda a: jnp.astype(jnp.where(emit, 0, a), acc_dtype), acc),
        skip_state=state.skip_state)
    return out, new_state

  return optax.GradientTransformationExtraArgs(reference.init, update_fn)
