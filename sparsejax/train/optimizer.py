"""The one place a config becomes the whole optimizer chain: what the config says is what runs.

    apply_if_finite_across(                  # a non-finite gradient on any worker: no change
        named_chain(compressor,              # topk_allreduce / dense_mean / hierarchical_mean,
                                             # then record_norm(): the aggregated gradient's norm
                    fused optimizer),        # fused_sgd / lars / lamb / adamw on the flat buffer
        WORKERS)

The chain's state is a `ChainState`, read by name, never by position: `exchange` (the
compressor's `ExchangeState`, per worker), `norm` (record_norm's `NormState`) and `optimizer`
(the fused optimizer's state). From a train state: `chain_parts(state.opt_state)`; rebuilt with
`replace_parts(state.opt_state, exchange=...)`.

With DGC momentum correction (`compression.momentum_correction` and a sparse algorithm) the
config's momentum and Nesterov run in the compressor, on what has not been sent yet, its weight
decay is added to the gradient in front of the compressor (so it passes through the momentum
too; LARS: its trust ratio too, each worker's own), and the optimizer is plain SGD: `split`
says where each part of the optimizer runs, and `build_optimizer` puts the parts together.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from sparsejax import comm, optim
from sparsejax.compress import (
  DensitySchedule,
  exchange,
  send_whole,
  tensor_balance,
  topk_allreduce,
)
from sparsejax.feedback import AdamCorrection, Correction, MomentumCorrection, error_feedback
from sparsejax.finite import apply_if_finite_across
from sparsejax.flat import FlatLayout
from sparsejax.train import schedules
from sparsejax.train.mesh import WORKERS

__all__ = ["build_optimizer", "Split", "split", "MomentumCorrection", "momentum_correction",
           "compressor",
           "fused_optimizer", "weight_decay_first", "lars_first", "learning_rate_first",
           "train_chain", "optimizer_behind_exchange", "decay_mask", "FUSED", "NormState",
           "record_norm", "ChainState", "named_chain", "chain_parts", "replace_parts",
           "TRUST_RATIOS"]

# lars_first's trust ratio: each worker's own, or the workers' mean's (sketched)
TRUST_RATIOS = ("worker", "mean")


def decay_mask(params: Any) -> Any:
  """Weight decay (and LARS trust ratio) only on kernels: never on BatchNorm and biases."""
  return jax.tree.map(lambda x: len(x.shape) > 1, params)


class NormState(NamedTuple):
  """norm: float32[], the L2 norm of the updates that last passed through `record_norm`."""

  norm: jax.Array


def record_norm() -> optax.GradientTransformation:
  """Passes the updates through unchanged; its state keeps their L2 norm (a metric)."""
  def update_fn(updates, state, params=None):
    del state, params
    return updates, NormState(optax.tree.norm(updates))

  return optax.GradientTransformation(lambda _: NormState(jnp.zeros([], jnp.float32)), update_fn)


class ChainState(NamedTuple):
  """The state of `named_chain` (and so of `train_chain`'s inner chain), part by part.

  exchange: the compressor's state, an `ExchangeState` per worker (leading axis = workers).
  norm: a `NormState`, the aggregated gradient's norm (a metric).
  optimizer: the state of the optimizer behind the exchange (replicated).
  """

  exchange: Any
  norm: NormState
  optimizer: Any


def named_chain(compress: optax.GradientTransformation,
                optimizer: optax.GradientTransformation
                ) -> optax.GradientTransformationExtraArgs:
  """`optax.chain(compress, record_norm(), optimizer)` with its state a `ChainState` instead of
  a tuple. As `optax.chain`: the parts run in that order, each gets `params` and every extra
  keyword argument (`density_level`, ...) if it takes extra arguments, none otherwise."""
  parts = ChainState(*(optax.with_extra_args_support(t)
                       for t in (compress, record_norm(), optimizer)))

  def init_fn(params: Any) -> ChainState:
    return ChainState(*(t.init(params) for t in parts))

  def update_fn(updates: Any, state: ChainState, params: Any = None, **extra_args: Any):
    new_state = []
    for t, s in zip(parts, state, strict=True):
      updates, s = t.update(updates, s, params, **extra_args)
      new_state.append(s)
    return updates, ChainState(*new_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def chain_parts(opt_state: Any) -> ChainState:
  """The `ChainState` inside the trainer's whole chain state (`train_chain`'s: an
  `optax.ApplyIfFiniteState` around it)."""
  return opt_state.inner_state


def replace_parts(opt_state: Any, **parts: Any) -> Any:
  """`opt_state` (`train_chain`'s) with the named parts of its `ChainState` replaced, e.g.
  `replace_parts(opt_state, exchange=new_exchange)`."""
  return opt_state._replace(inner_state=chain_parts(opt_state)._replace(**parts))


def momentum_correction(config: Any, plan: Any) -> MomentumCorrection | None:
  """The config's momentum correction, or None when it has none (off, or a dense exchange:
  nothing is delayed there)."""
  c, o = config.compression, config.optimizer
  if not (c.momentum_correction and plan.sparse):
    return None
  return MomentumCorrection(o.momentum, o.nesterov, config.experimental.momentum_masking)


def compressor(config: Any, plan: Any, correction: Correction | None = None,
               layout: FlatLayout | None = None) -> optax.GradientTransformation:
  """The exchange a validated config describes for its plan (the plan's algorithm, density
  levels and dense form; the `compression` group's selector and error feedback; the
  `experimental` group's balance and whole vectors), with a momentum or Adam `correction` if
  given, over the trainer's ("node", "local") workers. `layout`: the flat buffer's, for the
  per-tensor options."""
  c, e = config.compression, config.experimental
  if not plan.sparse:
    return topk_allreduce(c.density, algorithm=plan.algorithm, axis_name=WORKERS)
  if (e.whole_vectors or e.balance == "tensor") and layout is None:
    raise ValueError("experimental.whole_vectors and balance='tensor' need the flat layout "
                     "(layout=)")
  # the leaves of one dimension or none: BatchNorm's scales and biases, the biases
  whole = (send_whole(layout.leaf_mask(lambda t: jax.tree.map(lambda x: len(x.shape) <= 1, t)))
           if e.whole_vectors else None)
  balance = tensor_balance(layout.segment_ids) if e.balance == "tensor" else None
  levels = DensitySchedule(plan.levels, plan.density_schedule(), plan.dense_form)  # (the plan's)
  collective = comm.sparse_collective(plan.algorithm, WORKERS, e.wire)
  feedback = error_feedback(correction) if c.error_feedback else None
  return exchange(collective, levels, feedback=feedback, selector=c.selector, balance=balance,
                  whole=whole)


# the fused optimizers by the config's `optimizer.name`, and each one's hyper-parameters from
# the `optimizer` group (`freeze`: adamw's second moment frozen from this step, 0: never)
FUSED = {"sgd": optim.fused_sgd, "lars": optim.fused_lars, "lamb": optim.fused_lamb,
         "adamw": optim.fused_adamw}
_HYPER = {
    "sgd": lambda o, freeze: dict(momentum=o.momentum or None, nesterov=o.nesterov,
                                  weight_decay=o.weight_decay, weight_decay_mask=decay_mask),
    "lars": lambda o, freeze: dict(weight_decay=o.weight_decay, weight_decay_mask=decay_mask,
                                   trust_coefficient=o.trust_coefficient,
                                   trust_ratio_mask=decay_mask, momentum=o.momentum,
                                   nesterov=o.nesterov),
    "lamb": lambda o, freeze: dict(b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                                   mask=decay_mask),
    "adamw": lambda o, freeze: dict(b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                                    mask=decay_mask, freeze_variance_after=freeze or None),
}


def fused_optimizer(opt: Any, learning_rate: optax.ScalarOrSchedule, layout: FlatLayout,
                    freeze_variance_step: int = 0) -> optax.GradientTransformation:
  """The fused optimizer of the config's `optimizer` group (`FUSED[opt.name]`), on the flat
  face of `layout` (`freeze_variance_step`: adamw's second moment frozen from this step, 0:
  never)."""
  if opt.name not in FUSED:
    raise ValueError(f"unknown optimizer {opt.name!r}; allowed: {', '.join(FUSED)}")
  return FUSED[opt.name](learning_rate, layout=layout,
                         **_HYPER[opt.name](opt, freeze_variance_step))


def weight_decay_first(inner: optax.GradientTransformation, weight_decay: float,
                       layout: FlatLayout) -> optax.GradientTransformationExtraArgs:
  """`inner` fed the flat gradient plus `weight_decay * params` on the leaves of `decay_mask`
  (coupled weight decay in front of the compressor, as DGC has it). Its state is `inner`'s."""
  if not weight_decay:
    return optax.with_extra_args_support(inner)
  mask = decay_mask(layout.shape_tree())

  def update_fn(updates, state, params=None, **extra_args):
    grads, values = layout.unravel(updates), layout.unravel(params)
    grads = jax.tree.map(lambda g, p, m: g + weight_decay * p if m else g, grads, values, mask)
    return inner.update(layout.ravel(grads, jnp.float32), state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def learning_rate_first(inner: optax.GradientTransformation,
                        learning_rate: optax.ScalarOrSchedule
                        ) -> optax.GradientTransformationExtraArgs:
  """`inner` (the compressor, whose state counts its updates: `ExchangeState.count`) fed the
  updates times the learning rate of this step, so that its residual and velocity hold steps,
  not gradients: a value sent late moves the parameters at the learning rate of the step it
  came from (error feedback in parameter space, Karimireddy et al. 2019), not at the rate in
  force when it is sent. Behind the exchange then: an SGD at rate 1. Its state is `inner`'s."""
  rate = learning_rate if callable(learning_rate) else (lambda count: learning_rate)

  def update_fn(updates, state, params=None, **extra_args):
    scale = jnp.asarray(rate(state.count), jnp.float32)
    return inner.update(jax.tree.map(lambda u: u * scale.astype(u.dtype), updates), state,
                        params, **extra_args)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def lars_first(inner: optax.GradientTransformation, weight_decay: float,
               trust_coefficient: float, layout: FlatLayout, trust_ratio: str = "worker"
               ) -> optax.GradientTransformationExtraArgs:
  """`inner` fed LARS's direction of this worker's gradient: on each kernel (`decay_mask`)
  `trust_coefficient * ||p|| / ||g + weight_decay * p|| * (g + weight_decay * p)`, the
  gradient elsewhere (optax.lars's decay and trust ratio, before its learning rate and momentum).
  With momentum correction in `inner` and an SGD without momentum behind it, that is LARS with
  each worker's momentum accumulated before the selection: a coordinate sent late moves as far
  as LARS would have moved it. `trust_ratio` (`experimental.lars_trust_ratio`): "worker", each
  worker's own (from its gradient: its norm is larger than the mean gradient's, so its step is
  shorter than LARS's); "mean", the norm of the workers' mean estimated from count sketches (a
  small all-reduce, `sparsejax.sketch`), the same ratio on every worker:
  `optim.lars_direction`. Its state is `inner`'s."""
  if trust_ratio not in TRUST_RATIOS:
    raise ValueError(f"trust_ratio={trust_ratio!r}: must be one of {TRUST_RATIOS}")
  direction = optim.lars_direction(layout, weight_decay, decay_mask, trust_coefficient,
                                   trust_ratio_mask=decay_mask,
                                   axes=WORKERS if trust_ratio == "mean" else None)

  def update_fn(updates, state, params=None, **extra_args):
    return inner.update(direction(updates, params), state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def train_chain(compress: optax.GradientTransformation,
                optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """`apply_if_finite_across(named_chain(compress, optimizer), WORKERS)`: the shape of every
  chain the trainer runs; its `inner_state` is a `ChainState` (`TrainState.comm_state` is its
  `exchange` part)."""
  chain = named_chain(compress, optimizer)
  return apply_if_finite_across(chain, WORKERS)


class Split(NamedTuple):
  """Where each part of the config's optimizer runs around the exchange (`split`).

  correction: in the exchange, per worker: a `MomentumCorrection` or `AdamCorrection` (None:
    nothing). front: in front of the exchange: "" (nothing), "decay" (SGD's weight decay) or
    "lars" (LARS's weight decay and trust ratio). rate_first: the learning rate in front too
    (error feedback in parameter space). behind: the optimizer group behind the exchange (the
    config's own, or an SGD for what the exchange left). rate_scale: the learning rate behind
    it is the schedule's times this (1 when `rate_first`: none)."""

  correction: Correction | None
  front: str
  rate_first: bool
  behind: Any
  rate_scale: float


def split(config: Any, plan: Any) -> Split:
  """Where a validated config's optimizer runs (`Split`). Without momentum correction, all of it
  behind the exchange. With DGC's (SGD, LARS): the momentum and Nesterov in the exchange, the
  weight decay (LARS: and the trust ratio) in front of it, an SGD with neither behind it. With
  AdamW's: the second moment in the exchange (and with `adam_first_moment="before"` the first),
  behind it an SGD whose weight decay is AdamW's: "after", a momentum b1 on the exchanged
  normalised gradients at rate lr * (1 - b1) (Adam's first moment is an average; the trace
  sums), the decay inside it (at steady state -lr * wd * p a step, as AdamW's); "before", no
  momentum, -lr * (direction + wd * p)."""
  o = config.optimizer
  correction = momentum_correction(config, plan)
  if correction is None:
    return Split(None, "", False, o, 1.0)
  if o.name == "adamw":
    before = config.experimental.adam_first_moment == "before"
    return Split(AdamCorrection(o.b1 if before else 0.0, o.b2, o.eps), "", False,
                 _sgd(0.0 if before else o.b1, o.weight_decay), 1.0 if before else 1 - o.b1)
  return Split(correction, "decay" if o.name == "sgd" else "lars",
               config.experimental.feedback_in == "steps", _sgd(0.0, 0.0), 1.0)


def _sgd(momentum: float, weight_decay: float) -> ml_collections.ConfigDict:
  """An `optimizer` group of plain SGD (no Nesterov) for behind the exchange."""
  return ml_collections.ConfigDict({"name": "sgd", "momentum": momentum, "nesterov": False,
                                    "weight_decay": weight_decay})


def build_optimizer(config: Any, plan: Any, layout: FlatLayout) -> optax.GradientTransformation:
  """The whole chain a validated config describes for its `plan` (`sparsejax.train.plan`), on
  the flat face of `layout`: the exchange with what `split` puts in and in front of it, then
  the optimizer behind it."""
  learning_rate = schedules.learning_rate(config.optimizer, plan)
  s, o = split(config, plan), config.optimizer
  rate = 1.0 if s.rate_first else _scaled(learning_rate, s.rate_scale)
  behind = fused_optimizer(s.behind, rate, layout, plan.freeze_variance_step)
  exchange = compressor(config, plan, s.correction, layout)
  if s.rate_first:
    exchange = learning_rate_first(exchange, learning_rate)
  if s.front == "decay":
    exchange = weight_decay_first(exchange, o.weight_decay, layout)
  elif s.front == "lars":
    exchange = lars_first(exchange, o.weight_decay, o.trust_coefficient, layout,
                          config.experimental.lars_trust_ratio)
  return train_chain(exchange, behind)


def _scaled(learning_rate: optax.ScalarOrSchedule, scale: float) -> optax.ScalarOrSchedule:
  """`learning_rate` times `scale` (itself where `scale` is 1)."""
  if scale == 1.0:
    return learning_rate
  if callable(learning_rate):
    return lambda step: learning_rate(step) * scale
  return learning_rate * scale


def optimizer_behind_exchange(config: Any, plan: Any, layout: FlatLayout
                              ) -> optax.GradientTransformation:
  """The optimizer behind the exchange in `build_optimizer`'s chain, alone (its state is the
  chain's `optimizer` part, `chain_parts(opt_state).optimizer`), for a config without momentum
  correction: fed any gradient, it makes the update the chain would make had the exchange
  returned that gradient."""
  s = split(config, plan)
  if s.correction is not None:
    raise ValueError("the optimizer behind the exchange is the optimizer alone only without "
                     "compression.momentum_correction (with it, part of it is in the exchange)")
  learning_rate = schedules.learning_rate(config.optimizer, plan)
  return fused_optimizer(s.behind, learning_rate, layout, plan.freeze_variance_step)
