"""Error feedback, with or without DGC momentum correction: what a worker did not send yet.

A sparse exchange sends only k values of a worker's buffer; error feedback keeps the rest and adds
it to the next step's buffer, so nothing is lost, only delayed (Stich et al. 2018). With momentum
correction (DGC: Lin et al., ICLR 2018) the worker also keeps a velocity and accumulates the
momentum BEFORE the selection, so a value sent late carries the momentum it would have had; the
optimizer after the exchange then runs without momentum.

The memory has ONE type, `Feedback(residual, velocity)` (velocity None without momentum
correction), and one operation, `feedback_select`: the candidates from the buffer and the memory,
the top-k of them, and the memory for the next step. A correction is one typed value,
`MomentumCorrection(momentum, nesterov, masking)` or `AdamCorrection(b1, b2, eps)`, passed as
`correction=` here and to `sparsejax.topk_allreduce`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sparsejax import topk as topk_lib

__all__ = ["Feedback", "MomentumCorrection", "AdamCorrection", "Correction", "legacy_correction",
           "adam_direction", "tensor_weights", "init_feedback",
           "check_feedback", "feedback_select", "feedback_dense"]

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


class MomentumCorrection(NamedTuple):
  """DGC momentum correction (Lin et al. 2018): each worker's momentum accumulated before
  selection (a velocity beside the residual), so a value sent late carries the momentum it
  would have had; chain an optimizer without momentum behind the exchange. `masking`: zero the
  velocity where sent (DGC's momentum factor masking); False lets it run on, and sent plus kept
  is then exactly what momentum SGD applies."""

  momentum: float
  nesterov: bool = False
  masking: bool = True


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


Correction = MomentumCorrection | AdamCorrection  # what `correction=` takes (or None)


def legacy_correction(where: str, momentum: float = 0.0, nesterov: bool = False,
                      masking: bool = True, adam: AdamCorrection | None = None,
                      stacklevel: int = 3) -> Correction | None:
  """The `correction` the keywords `momentum`, `nesterov`, `momentum_masking` / `masking` and
  `adam` of earlier releases spell, with a DeprecationWarning naming the new spelling (none is
  raised where they are all at their defaults)."""
  if adam is not None:
    new = f"correction={adam!r}"
    correction: Correction | None = adam
    if momentum or nesterov or masking is not True:
      correction = None  # (both given: the caller's checks refuse it by name)
  elif momentum or nesterov or masking is not True:
    correction = MomentumCorrection(momentum, nesterov, masking)
    new = f"correction={correction!r}"
  else:
    return None
  warnings.warn(f"{where}: momentum=, nesterov=, momentum_masking= and adam= are deprecated and "
                f"go in the next release; pass {new} (sparsejax.feedback)",
                DeprecationWarning, stacklevel=stacklevel)
  return correction


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


def _plain(x: jax.Array, feedback: Feedback, k: int, select: Selector
           ) -> tuple[jax.Array, jax.Array, Feedback]:
  values, indices, residual = topk_lib.select_feedback(select, x, feedback.residual, k)
  return values, indices, Feedback(residual)


def _select_weighted(select: Selector, x: jax.Array, residual: jax.Array, k: int,
                     weights: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`topk.select_feedback` of `weights * (x + residual)`, the values and the memory unweighted
  (the weights are powers of two: exact)."""
  values, indices, kept = topk_lib.select_feedback(select, x * weights, residual * weights, k)
  return values / weights[indices], indices, kept / weights


def _weighted(x: jax.Array, feedback: Feedback, k: int, select: Selector, weights: jax.Array
              ) -> tuple[jax.Array, jax.Array, Feedback]:
  values, indices, residual = _select_weighted(select, x, feedback.residual, k, weights)
  return values, indices, Feedback(residual)


def _momentum_term(x: jax.Array, feedback: Feedback, correction: MomentumCorrection
                   ) -> tuple[jax.Array, jax.Array]:
  """(new velocity, candidate term): `momentum * u + x`, and with Nesterov `x + momentum * u`."""
  velocity = correction.momentum * feedback.velocity + x
  return velocity, x + correction.momentum * velocity if correction.nesterov else velocity


def _momentum(x: jax.Array, feedback: Feedback, k: int, select: Selector,
              correction: MomentumCorrection, weights: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array, Feedback]:
  velocity, term = _momentum_term(x, feedback, correction)
  # acc = residual + term; with mstopk on CPU the sum, the selection and the zeroing are one
  # kernel (topk.select_feedback).
  if weights is None:
    values, indices, residual = topk_lib.select_feedback(select, term, feedback.residual, k)
  else:
    values, indices, residual = _select_weighted(select, term, feedback.residual, k, weights)
  if correction.masking:
    velocity = velocity.at[indices].set(0, unique_indices=True)
  return values, indices, Feedback(residual, velocity)


def _adam(x: jax.Array, feedback: Feedback, k: int, select: Selector, correction: AdamCorrection,
          count: jax.Array | None, scale: float) -> tuple[jax.Array, jax.Array, Feedback]:
  direction, m, v = adam_direction(x / scale, feedback, correction, count)
  values, indices, residual = topk_lib.select_feedback(select, scale * direction,
                                                       feedback.residual, k)
  return values, indices, Feedback(residual, m, v)  # the moments run on (no masking)


def feedback_dense(x: jax.Array, feedback: Feedback, *, correction: Correction | None = None,
                   count: jax.Array | None = None, scale: float = 1.0
                   ) -> tuple[jax.Array, Feedback]:
  """Every candidate of `feedback_select` (the same `correction`, `count`, `scale`), for a step
  that sends them all: `(candidates, Feedback)` with the residual emptied and the velocity or
  Adam moments run on, unmasked. No selection and no scatter: the dense form of a sparse
  exchange costs what a dense exchange costs."""
  x = x.astype(feedback.residual.dtype)
  empty = jnp.zeros_like(feedback.residual)
  if isinstance(correction, AdamCorrection):
    direction, m, v = adam_direction(x / scale, feedback, correction, count)
    return scale * direction + feedback.residual, Feedback(empty, m, v)
  if isinstance(correction, MomentumCorrection) and feedback.velocity is not None:
    velocity, term = _momentum_term(x, feedback, correction)
    return term + feedback.residual, Feedback(empty, velocity)
  if correction is not None and not isinstance(correction, MomentumCorrection):
    raise ValueError(f"correction must be a sparsejax.feedback.MomentumCorrection, "
                     f"AdamCorrection or None, got {correction!r}")
  return x + feedback.residual, Feedback(empty)


def feedback_select(x: jax.Array, feedback: Feedback | None, k: int,
                    select: Selector = topk_lib.mstopk, *, correction: Correction | None = None,
                    count: jax.Array | None = None, scale: float = 1.0,
                    weights: jax.Array | None = None, **deprecated: Any
                    ) -> tuple[jax.Array, jax.Array, Feedback]:
  """The k largest |candidates| of a 1-D buffer `x` and the memory for the next step.

  The candidates are `x + residual` (plain error feedback), `velocity + residual` with a
  `MomentumCorrection` (`x + momentum * velocity + residual` with Nesterov), `scale *
  adam_direction(x / scale) + residual` with an `AdamCorrection` (the moments after `count`
  earlier steps; `scale`: how many workers' gradients `x` sums, so the Adam direction is taken
  of their mean), or `x` alone without memory. With `weights` (plain error feedback or a
  `MomentumCorrection`; `tensor_weights`), the selection is of the k largest |weights *
  candidates|; the values and the memory are the candidates' own. (`momentum=`, `nesterov=`,
  `masking=`, `adam=`: the correction as earlier releases spelled it, deprecated.)

  Returns:
    `(values, indices, Feedback)`: `values == candidates[indices]` (int32[k]); the new residual is
    the candidates with the sent values zeroed (without memory: `x` with them zeroed), the new
    velocity zeroed there too with momentum masking.
  """
  if deprecated:
    unknown = set(deprecated) - {"momentum", "nesterov", "masking", "adam"}
    if unknown:
      raise TypeError(f"feedback_select got unexpected keyword(s) {sorted(unknown)}")
    correction = correction or legacy_correction("feedback_select", **deprecated)
  if feedback is None:
    values, indices = topk_lib.get_selector(select)(x, k)
    return values, indices, Feedback(x.at[indices].set(0, unique_indices=True))
  x = x.astype(feedback.residual.dtype)
  if correction is not None and not isinstance(correction, MomentumCorrection | AdamCorrection):
    raise ValueError(f"correction must be a sparsejax.feedback.MomentumCorrection, "
                     f"AdamCorrection or None, got {correction!r}")
  if feedback.velocity is not None and correction is None:
    raise ValueError("a Feedback with a velocity needs correction=MomentumCorrection(...) or "
                     "AdamCorrection(...)")
  if weights is not None and isinstance(correction, AdamCorrection):
    raise ValueError("weights (balance='tensor') work with plain error feedback or a "
                     f"MomentumCorrection, not {correction!r}")
  if isinstance(correction, AdamCorrection):
    return _adam(x, feedback, k, select, correction, count, scale)
  if isinstance(correction, MomentumCorrection) and feedback.velocity is not None:
    return _momentum(x, feedback, k, select, correction, weights)
  if weights is not None:
    return _weighted(x, feedback, k, select, weights)
  return _plain(x, feedback, k, select)
