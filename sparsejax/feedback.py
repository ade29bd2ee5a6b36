"""Error feedback, with or without DGC momentum correction: what a worker did not send yet.

A sparse exchange sends only k values of a worker's buffer; error feedback keeps the rest and adds
it to the next step's buffer, so nothing is lost, only delayed (Stich et al. 2018). With momentum
correction (DGC: Lin et al., ICLR 2018) the worker also keeps a velocity and accumulates the
momentum BEFORE the selection, so a value sent late carries the momentum it would have had; the
optimizer after the exchange then runs without momentum.

The memory has ONE type, `Feedback(residual, velocity)` (velocity None without momentum
correction), and one operation, `feedback_select`: the candidates from the buffer and the memory,
the top-k of them, and the memory for the next step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsejax import topk as topk_lib

__all__ = ["Feedback", "AdamCorrection", "adam_direction", "tensor_weights", "init_feedback",
           "check_feedback", "feedback_select"]

Selector = Callable[[jax.Array, int], tuple[jax.Array, jax.Array]] | str


class Feedback(NamedTuple):
  """What a worker (or, for HiTopKComm, a worker's shard) has not sent yet.

  residual: float32[r], the accumulated candidates not sent yet (its dtype is the accumulation
    dtype); zeroed where a value was sent.
  velocity: float32[r] with momentum correction: the local momentum `u <- momentum * u + x`
    (Nesterov: the candidate is `x + momentum * u`); zeroed where sent with momentum factor
    masking (DGC's choice), else it runs on, and sent plus kept is then exactly what momentum SGD
    would have applied. None without momentum correction.
  """

  residual: jax.Array
  velocity: jax.Array | None = None
  second: jax.Array | None = None


class AdamCorrection(NamedTuple):
  """Adam's moments accumulated per worker before selection (momentum correction for AdamW):
  the candidates are the worker's Adam direction `m_hat / (sqrt(v_hat) + eps)`, so error
  feedback delays whole Adam steps and a coordinate sent once in a while still moves as far as
  AdamW would have moved it (plain error feedback in front of Adam shrinks a delayed sum to one
  normalised step). Chain an SGD without momentum (its weight decay is AdamW's decoupled one).
  With b1 = 0 the candidates are the gradient over the worker's sqrt(v_hat) (RMSprop's), and the
  first moment is left to a momentum after the exchange (sparsejax's `adam_first_moment="after"`).
  """

  b1: float
  b2: float
  eps: float


def adam_direction(x: jax.Array, feedback: Feedback, adam: AdamCorrection, count: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`(direction, m, v)`: the bias-corrected Adam direction of gradient `x` after `count`
  earlier steps (optax.scale_by_adam's), and the new first and second moments."""
  m = adam.b1 * feedback.velocity + (1 - adam.b1) * x
  v = adam.b2 * feedback.second + (1 - adam.b2) * x * x
  t = count.astype(jnp.float32) + 1
  m_hat = m / (1 - adam.b1 ** t)
  v_hat = v / (1 - adam.b2 ** t)
  return m_hat / (jnp.sqrt(v_hat) + adam.eps), m, v


def tensor_weights(candidates: jax.Array, segments: jax.Array, num_segments: int) -> jax.Array:
  """float32 per-element weights 2^-round(log2(rms of the element's tensor)): scaled by them,
  every tensor's candidates have an RMS near 1, so one global top-k takes about the same share
  of each tensor's coordinates (`balance="tensor"`). Powers of two: scaling and unscaling are
  exact. `segments`: int32 tensor id of each element (`FlatLayout.segment_ids`)."""
  c = candidates.astype(jnp.float32)
  sq = jax.ops.segment_sum(c * c, segments, num_segments)
  n = jax.ops.segment_sum(jnp.ones_like(c), segments, num_segments)
  rms = jnp.sqrt(sq / jnp.maximum(n, 1.0))
  exponent = jnp.where(rms > 0, -jnp.round(jnp.log2(jnp.where(rms > 0, rms, 1.0))), 0.0)
  return jnp.exp2(jnp.clip(exponent, -60, 60))[segments]


def init_feedback(length: int, momentum: float = 0.0, adam: bool = False) -> Feedback:
  """Zero memory for a buffer of `length` values (a velocity too where `momentum` > 0, both
  Adam moments with `adam`)."""
  zeros = jnp.zeros(length, jnp.float32)
  if adam:
    return Feedback(zeros, jnp.zeros(length, jnp.float32), jnp.zeros(length, jnp.float32))
  return Feedback(zeros, jnp.zeros(length, jnp.float32) if momentum else None)


def check_feedback(feedback: Feedback | None, length: int, momentum: float) -> None:
  """A ValueError naming what does not fit: momentum outside [0, 1), a velocity missing or
  unexpected, or a buffer whose shape is not `(length,)`."""
  if not 0 <= momentum < 1:
    raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
  if feedback is not None and not isinstance(feedback, Feedback):
    raise ValueError(f"the residual must be a sparsejax.feedback.Feedback or None, got "
                     f"{type(feedback).__name__}")
  velocity = None if feedback is None else feedback.velocity
  if momentum and velocity is None:
    raise ValueError("momentum correction needs residual=Feedback(residual, velocity), got "
                     f"{'None' if feedback is None else 'no velocity'}")
  if velocity is not None and not momentum:
    raise ValueError("the residual has a velocity but momentum is 0: pass momentum in (0, 1)")
  for name, r in zip(("residual", "velocity"), feedback or ()):
    if r is not None and r.shape != (length,):
      raise ValueError(f"{name} must have shape ({length},) like the buffer it corrects, "
                       f"got {r.shape}")


def feedback_select(x: jax.Array, feedback: Feedback | None, k: int,
                    select: Selector = topk_lib.mstopk, *, momentum: float = 0.0,
                    nesterov: bool = False, masking: bool = True,
                    adam: AdamCorrection | None = None, count: jax.Array | None = None,
                    scale: float = 1.0, weights: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array, Feedback]:
  """The k largest |candidates| of a 1-D buffer `x` and the memory for the next step.

  The candidates are `x + residual` (plain error feedback), `velocity + residual` with momentum
  correction (`x + momentum * velocity + residual` with Nesterov), `scale * adam_direction(x /
  scale) + residual` with `adam` (the moments after `count` earlier steps; `scale`: how many
  workers' gradients `x` sums, so the Adam direction is taken of their mean), or `x` alone
  without memory. With `weights` (plain error feedback only; `tensor_weights`), the selection is
  of the k largest |weights * candidates|; the values and the memory are the candidates' own.

  Returns:
    `(values, indices, Feedback)`: `values == candidates[indices]` (int32[k]); the new residual is
    the candidates with the sent values zeroed (without memory: `x` with them zeroed), the new
    velocity zeroed there too with `masking`.
  """
  if feedback is None:
    values, indices = topk_lib.get_selector(select)(x, k)
    return values, indices, Feedback(x.at[indices].set(0, unique_indices=True))
  dtype = feedback.residual.dtype
  if adam is not None:
    direction, m, v = adam_direction(x.astype(dtype) / scale, feedback, adam, count)
    values, indices, residual = topk_lib.select_feedback(select, scale * direction,
                                                         feedback.residual, k)
    return values, indices, Feedback(residual, m, v)  # the moments run on (no masking)
  if feedback.velocity is None and weights is not None:
    values, indices, residual = topk_lib.select_feedback(
        select, x.astype(dtype) * weights, feedback.residual * weights, k)
    return values / weights[indices], indices, Feedback(residual / weights)
  if feedback.velocity is None:
    values, indices, residual = topk_lib.select_feedback(select, x.astype(dtype),
                                                         feedback.residual, k)
    return values, indices, Feedback(residual)
  velocity = momentum * feedback.velocity + x.astype(dtype)
  term = x.astype(dtype) + momentum * velocity if nesterov else velocity
  # acc = residual + term; with mstopk on CPU the sum, the selection and the zeroing are one
  # kernel (topk.select_feedback).
  values, indices, residual = topk_lib.select_feedback(select, term, feedback.residual, k)
  if masking:
    velocity = velocity.at[indices].set(0, unique_indices=True)
  return values, indices, Feedback(residual, velocity)
