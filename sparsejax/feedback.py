"""Error feedback, with or without DGC momentum correction: what a worker did not send yet.

A sparse exchange sends only k values of a worker's buffer; error feedback keeps the rest and adds
it to the next step's buffer, so nothing is lost, only delayed (Stich et al. 2018). With momentum
correction (DGC: Lin et al., ICLR 2018) the worker also keeps a velocity and accumulates the
momentum BEFORE the selection, so a value sent late carries the momentum it would have had; the
optimizer after the exchange then runs without momentum.

The memory has ONE type, `Feedback(residual, velocity, second)`, and the piece an exchange
(`sparsejax.compress.exchange`) takes is `error_feedback(correction)`: it makes the memory
(`init`) and each step's candidates (`candidates`: this step's term, its velocity or Adam
direction, beside the residual: the candidates are `term + residual`). The selection is then one
call (`sparsejax.topk.select_feedback`), and what the exchange did not send is the next memory. A
correction is one typed value, `MomentumCorrection(momentum, nesterov, masking)` or
`AdamCorrection(b1, b2, eps)`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Feedback", "MomentumCorrection", "AdamCorrection", "Correction", "ErrorFeedback",
           "error_feedback", "adam_direction", "init_feedback", "check_feedback"]


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


def _momentum_term(x: jax.Array, feedback: Feedback, correction: MomentumCorrection
                   ) -> tuple[jax.Array, jax.Array]:
  """(new velocity, candidate term): `momentum * u + x`, and with Nesterov `x + momentum * u`."""
  velocity = correction.momentum * feedback.velocity + x
  return velocity, x + correction.momentum * velocity if correction.nesterov else velocity


class ErrorFeedback(NamedTuple):
  """The error-feedback piece of an exchange (`error_feedback` builds it): the memory and each
  step's candidates under `correction` (None: plain error feedback)."""

  correction: Correction | None = None

  @property
  def masking(self) -> bool:
    """Whether the velocity is zeroed where a value is sent (DGC's momentum factor masking)."""
    return isinstance(self.correction, MomentumCorrection) and self.correction.masking

  def init(self, length: int) -> Feedback:
    """Zero memory for a part of `length` values (a velocity with momentum correction, both
    Adam moments with Adam correction)."""
    c = self.correction
    return init_feedback(length, c.momentum if isinstance(c, MomentumCorrection) else 0.0,
                         isinstance(c, AdamCorrection))

  def candidates(self, x: jax.Array, memory: Feedback, count: jax.Array | None = None,
                 scale: float = 1.0) -> tuple[jax.Array, Feedback]:
    """`(term, memory)`: this step's term of the candidates (which are `term +
    memory.residual`) and the memory with its velocity or Adam moments run on (not masked; the
    residual as it was). The term is `x` (plain error feedback), the new velocity (`x +
    momentum * velocity` with Nesterov) with a `MomentumCorrection`, or `scale *
    adam_direction(x / scale)` with an `AdamCorrection` (the moments after `count` earlier
    steps; `scale`: how many workers' gradients `x` sums, so the direction is their mean's)."""
    x = x.astype(memory.residual.dtype)
    c = self.correction
    if isinstance(c, AdamCorrection):
      direction, m, v = adam_direction(x / scale, memory, c, count)
      return scale * direction, memory._replace(velocity=m, second=v)
    if isinstance(c, MomentumCorrection):
      velocity, term = _momentum_term(x, memory, c)
      return term, memory._replace(velocity=velocity)
    return x, memory


def error_feedback(correction: Correction | None = None) -> ErrorFeedback:
  """The error-feedback piece: plain (None), or with a `MomentumCorrection` or an
  `AdamCorrection` (checked here: a clear error names a bad value)."""
  if correction is None:
    return ErrorFeedback()
  if not isinstance(correction, MomentumCorrection | AdamCorrection):
    raise ValueError(f"correction must be a sparsejax.feedback.MomentumCorrection, "
                     f"AdamCorrection or None, got {correction!r}")
  if isinstance(correction, MomentumCorrection):
    m = correction.momentum
    if isinstance(m, bool) or not isinstance(m, int | float) or not 0 < m < 1:
      raise ValueError(f"MomentumCorrection.momentum must be a number in (0, 1), got {m!r}")
    if not isinstance(correction.masking, bool) or not isinstance(correction.nesterov, bool):
      raise ValueError(f"MomentumCorrection.nesterov and .masking must be True or False, got "
                       f"{correction!r}")
  elif not (0 <= correction.b1 < 1 and 0 <= correction.b2 < 1 and correction.eps > 0):
    raise ValueError(f"Adam correction needs b1, b2 in [0, 1) and eps > 0, got {correction}")
  return ErrorFeedback(correction)
