"""Fused optimizer updates over one flat buffer (the paper's "parallel tensor operator").

`fused_sgd`, `fused_lars`, `fused_lamb` and `fused_adamw` compute exactly what the optax optimizers
of the same names compute, but for the whole model at once: the elementwise math runs over one flat
float32 buffer and the per-layer norms of LARS/LAMB are row reductions of that buffer seen as
`(rows, align)` plus one tiny segment sum over rows. The update compiles to a handful of kernels
whatever the number of parameter tensors (optax: several per tensor).

The elementwise passes stay 1-D: per-row values (weight decay under a mask, trust ratios) are
broadcast to `(rows, align)` and flattened, never the big buffers viewed as 2-D. XLA:CPU updates a
donated buffer in place only when the fusion reads it elementwise; through a 2-D view it writes a
fresh buffer and copies it back (3x slower on the ResNet-50 tree).

Two faces over the same kernels, chosen by `layout`:

* `layout=None` (default), a drop-in for the optax optimizer: params and updates are pytrees; the
  state is kept flat (one float32 buffer per moment), laid out by a `FlatLayout` of the tree.
* `layout=FlatLayout(...)`: params, updates and state are 1-D buffers described by `layout` (the
  trainer's face: the aggregated gradient already is one buffer). Build it with
  `FlatLayout.from_tree(params, align=DEFAULT_ALIGN)` so that every row lies inside one leaf; masks
  are still given per leaf.

On CPU both faces run the same update as one C++ kernel (`sparsejax.cpu_kernels`, chosen with
`lax.platform_dependent`): XLA cannot fuse the norm reduction with the pass that consumes it, the
kernel does one tensor at a time while it is in cache; the pytree face passes the leaves to it as
they are. The XLA code below is the path everywhere else (GPU, or no C++ compiler).

State and arithmetic are float32 whatever the parameter dtype; updates are cast back to the dtype of
the incoming updates. `update(updates, state, params, skip=flag)` with a bool scalar `flag` returns
zero updates and the unchanged state where it is set (a step with a non-finite gradient).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from sparsejax import cpu_kernels
from sparsejax.flat import FlatLayout

__all__ = ["DEFAULT_ALIGN", "FusedMomentumState", "FusedAdamState", "fused_sgd", "fused_lars",
           "fused_lamb", "fused_adamw", "flat_layout"]

# Row width of the layouts built here: every leaf starts at a multiple of it. Rows of 256 float32
# values keep row reductions vectorised on CPU and cost at most 255 padding values per leaf.
DEFAULT_ALIGN = 256

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]


class FusedMomentumState(NamedTuple):
  """State of `fused_sgd` and `fused_lars`.

  count: int32[], number of updates so far (drives learning-rate schedules).
  momentum: float32[padded_size], the momentum buffer (None for SGD without momentum).
  """

  count: jax.Array
  momentum: jax.Array | None


class FusedAdamState(NamedTuple):
  """State of `fused_lamb` and `fused_adamw`.

  count: int32[], number of updates so far (bias correction and schedules).
  mu: float32[padded_size], first moment.
  nu: float32[padded_size], second moment.
  """

  count: jax.Array
  mu: jax.Array
  nu: jax.Array


def flat_layout(params: Any, pad_to: int = 1) -> FlatLayout:
  """The row-aligned layout the fused optimizers expect for `params` (align = DEFAULT_ALIGN)."""
  return FlatLayout.from_tree(params, pad_to=pad_to, align=DEFAULT_ALIGN)


# ----------------------------------------------------------------------------- argument checks


def _check_number(name: str, value: Any, low: float | None = None, high: float | None = None,
                  high_open: bool = True) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"{name} must be a real number, got {value!r}")
  value = float(value)
  bad = (not np.isfinite(value) or (low is not None and value < low)
         or (high is not None and (value >= high if high_open else value > high)))
  if bad:
    allowed = f"[{low}, {high}{')' if high_open else ']'}" if high is not None else f">= {low}"
    raise ValueError(f"{name} must be in {allowed}, got {value!r}")
  return value


def _check_lr(learning_rate: ScalarOrSchedule) -> ScalarOrSchedule:
  if callable(learning_rate):
    return learning_rate
  return _check_number("learning_rate", learning_rate, 0.0)


def _check_mask(name: str, mask: Any) -> Any:
  if mask is None or callable(mask) or isinstance(mask, bool):
    return mask
  leaves = jax.tree.leaves(mask)
  if not all(isinstance(m, bool | np.bool_) for m in leaves):
    raise ValueError(f"{name} must be a bool, a tree of bools or a callable returning one; got "
                     f"leaves {[type(m).__name__ for m in leaves][:5]}")
  return mask


# ----------------------------------------------------------------------------- static plan


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything static an update needs about a layout: row view and per-row constants."""

  layout: FlatLayout
  row_ids: np.ndarray        # int32[rows], leaf of each row (num_leaves for padding rows)
  decay_rows: np.ndarray     # float32[rows], weight decay of each row's leaf (0: masked/padding)
  trust_leaves: np.ndarray   # bool[num_leaves + 1], where the trust ratio applies
  valid_len: np.ndarray      # int32[rows], number of real values in each row
  # The CPU kernels' segment table: int64[S + 1] boundaries of the leaves and the gaps between
  # them, float32[S] weight decay, int32[S] flags (1: a real leaf, 2: the trust ratio applies).
  table: tuple[np.ndarray, np.ndarray, np.ndarray]

  @property
  def shape2d(self) -> tuple[int, int]:
    return self.layout.rows, self.layout.align

  def rows(self, x: jax.Array) -> jax.Array:
    """float32[padded_size] -> float32[rows, align] (for row reductions)."""
    return x.reshape(self.shape2d)

  def expand(self, per_row: jax.Array) -> jax.Array:
    """[rows] -> [padded_size]: each row's value repeated over the row's `align` elements."""
    return jnp.broadcast_to(per_row[:, None], self.shape2d).reshape(-1)


def _make_plan(layout: FlatLayout, weight_decay: float, decay_mask: Any,
               trust_mask: Any = True, decay_mask_name: str = "mask",
               trust_mask_name: str = "trust_ratio_mask") -> _Plan:
  row_ids = layout.row_segment_ids
  decay_leaves = np.zeros(layout.num_leaves + 1, np.float32)
  decay_leaves[:-1] = weight_decay * layout.leaf_flags(
      True if decay_mask is None else decay_mask, decay_mask_name)
  trust_leaves = np.zeros(layout.num_leaves + 1, bool)
  trust_leaves[:-1] = layout.leaf_flags(trust_mask, trust_mask_name)
  valid = np.zeros(layout.rows, np.int64)
  for offset, size in zip(layout.offsets, layout.sizes):
    first = offset // layout.align
    full, rest = divmod(size, layout.align)
    valid[first:first + full] = layout.align
    if rest:
      valid[first + full] = rest
  return _Plan(layout, row_ids, decay_leaves[row_ids], trust_leaves, valid.astype(np.int32),
               _segment_table(layout, decay_leaves, trust_leaves))


def _segment_table(layout: FlatLayout, decay_leaves: np.ndarray, trust_leaves: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Segments covering [0, padded_size): each leaf, and each gap of padding as its own."""
  starts, decay, flags = [0], [], []
  for i, (offset, size) in enumerate(zip(layout.offsets, layout.sizes)):
    if offset > starts[-1]:
      starts.append(offset)
      decay.append(0.0)
      flags.append(0)
    starts.append(offset + size)
    decay.append(decay_leaves[i])
    flags.append(1 | (2 if trust_leaves[i] else 0))
  if layout.padded_size > starts[-1]:
    starts.append(layout.padded_size)
    decay.append(0.0)
    flags.append(0)
  return (np.asarray(starts, np.int64), np.asarray(decay, np.float32),
          np.asarray(flags, np.int32))


def _on_cpu(kernel: Callable[[], Any], xla: Callable[[], Any]) -> Any:
  """`kernel()` where the computation is lowered for CPU and the C++ kernels of
  `sparsejax.cpu_kernels` are enabled; `xla()` elsewhere (GPU, no compiler, or `disabled()`)."""
  if not cpu_kernels.enabled():
    return xla()
  return lax.platform_dependent(cpu=kernel, default=xla)


def _row_sums(*xs: jax.Array) -> tuple[jax.Array, ...]:
  """Row sums of several float32[rows, align] expressions in one pass (one variadic reduce).

  On XLA:CPU a variadic reduce keeps the elementwise producers fused into one vectorised loop; a
  plain row reduction of a fused expression is handed to a library kernel that is ~8x slower here.
  """
  zeros = tuple(jnp.zeros([], x.dtype) for x in xs)
  return lax.reduce(xs, zeros, lambda a, b: tuple(x + y for x, y in zip(a, b)), (1,))


def _leaf_norms(plan: _Plan, *xs: jax.Array) -> tuple[jax.Array, ...]:
  """Per-leaf L2 norms, float32[num_leaves + 1] each, of float32[padded_size] expressions."""
  row_sums = _row_sums(*(plan.rows(x * x) for x in xs))
  stacked = jnp.stack(row_sums, axis=1)
  zeros = np.zeros((plan.layout.num_leaves + 1, len(xs)), np.float32)
  sums = jnp.asarray(zeros).at[jnp.asarray(plan.row_ids)].add(
      stacked, indices_are_sorted=True, mode="promise_in_bounds")
  return tuple(jnp.sqrt(sums[:, i]) for i in range(len(xs)))


def _trust_ratio(plan: _Plan, param_norm: jax.Array, update_norm: jax.Array,
                trust_coefficient: float, eps: float) -> jax.Array:
  """float32[padded_size]: optax.scale_by_trust_ratio's factor for each element's leaf."""
  ratio = trust_coefficient * param_norm / (update_norm + eps)
  zero = jnp.logical_or(param_norm == 0.0, update_norm == 0.0)
  ratio = jnp.where(zero | ~jnp.asarray(plan.trust_leaves), 1.0, ratio)
  return plan.expand(ratio[jnp.asarray(plan.row_ids)])


def _learning_rate(learning_rate: ScalarOrSchedule, count: jax.Array) -> jax.Array:
  if callable(learning_rate):
    return jnp.asarray(learning_rate(count), jnp.float32)
  return jnp.float32(learning_rate)


def _decay(plan: _Plan) -> jax.Array:
  """Weight decay of each element (0 where masked): a scalar when every leaf has the same one
  (the padding is zero in params and updates, so its decay does not matter)."""
  real = plan.decay_rows[plan.row_ids < plan.layout.num_leaves]
  if np.all(real == real[0]):
    return jnp.float32(real[0])
  return plan.expand(jnp.asarray(plan.decay_rows))


# ----------------------------------------------------------------------------- the two faces


# A kernel call `(plan, grads, state, params, flat, skip) -> (updates, state)`: grads/params are
# lists of float32 buffers, one flat buffer (flat=True) or one per leaf; skip a bool scalar or
# None (see sparsejax.cpu_kernels.update).
KernelFn = Callable[[_Plan, list, NamedTuple, list | None, bool, jax.Array | None],
                    tuple[list, NamedTuple]]


def _skip_flag(name: str, skip: Any) -> jax.Array | None:
  """`skip` as a bool scalar array (None stays None), or a ValueError naming what is wrong."""
  if skip is None:
    return None
  if jnp.shape(skip) != ():
    raise ValueError(f"{name}: skip must be a scalar (bool), got shape {jnp.shape(skip)}")
  return jnp.asarray(skip).astype(bool)


def _skipped_xla(skip: jax.Array | None, u: jax.Array, old: NamedTuple,
                 new: NamedTuple) -> tuple[jax.Array, NamedTuple]:
  """The XLA path's skip: zero updates, the old state (a select XLA fuses into the update)."""
  if skip is None:
    return u, new
  return jnp.where(skip, 0.0, u), jax.tree.map(lambda o, n: jnp.where(skip, o, n), old, new)


def _skipped_kernel(skip: jax.Array | None, old: NamedTuple, new: NamedTuple) -> NamedTuple:
  """The kernels zero the updates and leave the moments as they are on a skipped step; the count
  is kept here."""
  return new if skip is None else new._replace(count=jnp.where(skip, old.count, new.count))


def _make(name: str, init_flat: Callable[[_Plan], NamedTuple],
          update_flat: Callable[[_Plan, jax.Array, NamedTuple, jax.Array | None], tuple],
          kernel: KernelFn | None, plan_for: Callable[[FlatLayout], _Plan],
          layout: FlatLayout | None, needs_params: bool) -> optax.GradientTransformation:
  """Wraps an update into one of the two faces. `update_flat(plan, g, state, p) -> (u, state)` is
  the XLA path over float32[padded_size] buffers; `kernel` (or None) the CPU kernel path."""
  if layout is not None and not isinstance(layout, FlatLayout):
    raise ValueError(f"{name}: layout must be a sparsejax.flat.FlatLayout or None, got "
                     f"{type(layout).__name__}")
  plans: dict[FlatLayout, _Plan] = {}

  def get_plan(lay: FlatLayout) -> _Plan:
    if lay not in plans:
      plans[lay] = plan_for(lay)
    return plans[lay]

  def check_flat(what: str, x: Any, lay: FlatLayout) -> None:
    if not hasattr(x, "shape") or tuple(x.shape) != (lay.padded_size,):
      raise ValueError(f"{name} with a FlatLayout expects {what} as a 1-D buffer of length "
                       f"{lay.padded_size}, got {getattr(x, 'shape', type(x).__name__)}")

  def check_params(params: Any) -> None:
    if needs_params and params is None:
      raise ValueError(f"{name} needs params in update(updates, state, params)")

  if layout is not None:
    def init_fn(params: jax.Array) -> NamedTuple:
      check_flat("params", params, layout)
      return init_flat(get_plan(layout))

    def update_fn(updates: jax.Array, state: NamedTuple, params: jax.Array | None = None, *,
                  skip: Any = None):
      check_flat("updates", updates, layout)
      check_params(params)
      if needs_params:
        check_flat("params", params, layout)
      skip = _skip_flag(name, skip)
      plan = get_plan(layout)
      g = updates.astype(jnp.float32)
      p = params.astype(jnp.float32) if needs_params else None

      def on_xla():
        u, new_state = update_flat(plan, g, state, p)
        return _skipped_xla(skip, u, state, new_state)

      def on_kernel():
        us, new_state = kernel(plan, [g], state, None if p is None else [p], True, skip)
        return us[0], _skipped_kernel(skip, state, new_state)

      u, state = _on_cpu(on_kernel, on_xla) if kernel else on_xla()
      return u.astype(updates.dtype), state
  else:
    def init_fn(params: Any) -> NamedTuple:
      return init_flat(get_plan(flat_layout(params)))

    def update_fn(updates: Any, state: NamedTuple, params: Any = None, *, skip: Any = None):
      lay = flat_layout(updates)
      check_params(params)
      skip = _skip_flag(name, skip)
      plan = get_plan(lay)

      def on_xla():
        g = lay.ravel(updates, jnp.float32)
        p = lay.ravel(params, jnp.float32) if needs_params else None
        u, new_state = update_flat(plan, g, state, p)
        u, new_state = _skipped_xla(skip, u, state, new_state)
        return jax.tree.leaves(lay.unravel(u)), new_state

      def on_kernel():  # the leaves go to the kernel as they are: no ravel, no unravel
        gs = [x.astype(jnp.float32) for x in lay.treedef.flatten_up_to(updates)]
        ps = ([x.astype(jnp.float32) for x in lay.treedef.flatten_up_to(params)]
              if needs_params else None)
        us, new_state = kernel(plan, gs, state, ps, False, skip)
        return ([u.astype(d) for u, d in zip(us, lay.dtypes)],
                _skipped_kernel(skip, state, new_state))

      us, state = _on_cpu(on_kernel, on_xla) if kernel else on_xla()
      out = jax.tree.unflatten(lay.treedef, us)
      return jax.tree.map(lambda o, x: o.astype(x.dtype), out, updates), state

  return optax.GradientTransformation(init_fn, update_fn)


def _zeros(plan: _Plan) -> jax.Array:
  return jnp.zeros(plan.layout.padded_size, jnp.float32)


# ----------------------------------------------------------------------------- SGD


def fused_sgd(learning_rate: ScalarOrSchedule, *, momentum: float | None = None,
              nesterov: bool = False, weight_decay: float = 0.0, weight_decay_mask: Any = None,
              layout: FlatLayout | None = None) -> optax.GradientTransformation:
  """`optax.chain(optax.add_decayed_weights(weight_decay, weight_decay_mask), optax.sgd(...))`.

  Args:
    learning_rate: a float >= 0 or an optax schedule `count -> lr`.
    momentum: trace decay in [0, 1), or None for plain SGD.
    nesterov: Nesterov momentum.
    weight_decay: coupled weight decay (added to the gradient), >= 0.
    weight_decay_mask: which leaves get weight decay (bool tree, prefix or callable); None = all.
    layout: None for the pytree face, or the `FlatLayout` of flat params/updates.
  """
  learning_rate = _check_lr(learning_rate)
  if momentum is not None:
    momentum = _check_number("momentum", momentum, 0.0, 1.0)
  weight_decay = _check_number("weight_decay", weight_decay, 0.0)
  weight_decay_mask = _check_mask("weight_decay_mask", weight_decay_mask)
  decayed = weight_decay > 0.0

  def plan_for(lay: FlatLayout) -> _Plan:
    return _make_plan(lay, weight_decay, weight_decay_mask, decay_mask_name="weight_decay_mask")

  def init_flat(plan: _Plan) -> FusedMomentumState:
    buf = _zeros(plan) if momentum is not None else None
    return FusedMomentumState(jnp.zeros([], jnp.int32), buf)

  def update_flat(plan, g, state, p):
    lr = _learning_rate(learning_rate, state.count)
    if decayed:
      g = g + _decay(plan) * p
    trace = state.momentum
    if momentum is not None:
      trace = g + momentum * trace
      g = g + momentum * trace if nesterov else trace
    return -lr * g, FusedMomentumState(optax.safe_increment(state.count), trace)

  def kernel(plan, gs, state, ps, flat, skip):
    (trace,), us = cpu_kernels.update(
        "sgd", _learning_rate(learning_rate, state.count), (state.momentum,), gs,
        ps if decayed else None, table=plan.table, flat=flat, skip=skip,
        momentum=np.float32(momentum), nesterov=bool(nesterov), decayed=decayed)
    return us, FusedMomentumState(optax.safe_increment(state.count), trace)

  # Without momentum the update is one elementwise pass: XLA's fusion already is the floor.
  return _make("fused_sgd", init_flat, update_flat, kernel if momentum is not None else None,
               plan_for, layout, needs_params=decayed)


# ----------------------------------------------------------------------------- LARS


def fused_lars(learning_rate: ScalarOrSchedule, *, weight_decay: float = 0.0,
               weight_decay_mask: Any = True, trust_coefficient: float = 0.001, eps: float = 0.0,
               trust_ratio_mask: Any = True, momentum: float = 0.9, nesterov: bool = False,
               layout: FlatLayout | None = None) -> optax.GradientTransformation:
  """`optax.lars`, fused: weight decay, per-layer trust ratio, learning rate, then momentum.

  Args:
    learning_rate: a float >= 0 or an optax schedule.
    weight_decay: >= 0; weight_decay_mask: which leaves get it (bool, tree, prefix or callable).
    trust_coefficient: >= 0, multiplies ||param|| / (||update|| + eps); eps >= 0.
    trust_ratio_mask: which leaves get the trust ratio (the others keep ratio 1).
    momentum: trace decay in [0, 1); nesterov: Nesterov momentum.
    layout: None for the pytree face, or the `FlatLayout` of flat params/updates.
  """
  learning_rate = _check_lr(learning_rate)
  weight_decay = _check_number("weight_decay", weight_decay, 0.0)
  trust_coefficient = _check_number("trust_coefficient", trust_coefficient, 0.0)
  eps = _check_number("eps", eps, 0.0)
  momentum = _check_number("momentum", momentum, 0.0, 1.0)
  weight_decay_mask = _check_mask("weight_decay_mask", weight_decay_mask)
  trust_ratio_mask = _check_mask("trust_ratio_mask", trust_ratio_mask)

  def plan_for(lay: FlatLayout) -> _Plan:
    return _make_plan(lay, weight_decay, weight_decay_mask, trust_ratio_mask,
                      decay_mask_name="weight_decay_mask")

  def init_flat(plan: _Plan) -> FusedMomentumState:
    return FusedMomentumState(jnp.zeros([], jnp.int32), _zeros(plan))

  def update_flat(plan, g, state, p):
    lr = _learning_rate(learning_rate, state.count)
    decay = _decay(plan)
    param_norm, update_norm = _leaf_norms(plan, p, g + decay * p)
    ratio = _trust_ratio(plan, param_norm, update_norm, trust_coefficient, eps)
    u = (g + decay * p) * (ratio * -lr)
    t = u + momentum * state.momentum
    u = u + momentum * t if nesterov else t
    return u, FusedMomentumState(optax.safe_increment(state.count), t)

  def kernel(plan, gs, state, ps, flat, skip):
    (trace,), us = cpu_kernels.update(
        "lars", _learning_rate(learning_rate, state.count), (state.momentum,), gs, ps,
        table=plan.table, flat=flat, skip=skip,
        momentum=np.float32(momentum), nesterov=bool(nesterov),
        trust_coefficient=np.float32(trust_coefficient), eps=np.float32(eps))
    return us, FusedMomentumState(optax.safe_increment(state.count), trace)

  return _make("fused_lars", init_flat, update_flat, kernel, plan_for, layout, needs_params=True)


# ----------------------------------------------------------------------------- Adam family


def _check_adam(b1: float, b2: float, eps: float, eps_root: float) -> tuple[float, ...]:
  return (_check_number("b1", b1, 0.0, 1.0), _check_number("b2", b2, 0.0, 1.0),
          _check_number("eps", eps, 0.0), _check_number("eps_root", eps_root, 0.0))


def _adam_scalars(lr: jax.Array, count_inc: jax.Array, b1: float, b2: float) -> jax.Array:
  """float32[3]: the learning rate and both bias corrections 1 / (1 - b**count), from one
  tiny kernel (fewer launches)."""
  inv = 1.0 / (1.0 - jnp.asarray([b1, b2], jnp.float32) ** count_inc.astype(jnp.float32))
  return jnp.concatenate([jnp.reshape(lr, (1,)), inv])


def _adam_step(plan: _Plan, mu, nu, scalars, eps, eps_root):
  """optax.scale_by_adam's direction from the updated moments, float32[padded_size]."""
  u = (mu * scalars[1]) / (jnp.sqrt(nu * scalars[2] + eps_root) + eps)
  if eps == 0.0 and eps_root == 0.0:
    # 0/0 in the padding would poison the per-leaf norms; real values keep optax's behaviour.
    col = lax.rem(lax.iota(jnp.int32, u.shape[0]), jnp.int32(plan.layout.align))
    u = jnp.where(col < plan.expand(jnp.asarray(plan.valid_len)), u, 0.0)
  return u


def _adam_moments(g, mu, nu, b1: float, b2: float):
  """optax.scale_by_adam's moment updates, float32[padded_size]."""
  return (1.0 - b1) * g + b1 * mu, (1.0 - b2) * (g * g) + b2 * nu


def _adam_attrs(b1: float, b2: float, eps: float, eps_root: float) -> dict[str, np.float32]:
  return {"b1": np.float32(b1), "b2": np.float32(b2), "eps": np.float32(eps),
          "eps_root": np.float32(eps_root)}


def _adam_init(plan: _Plan) -> FusedAdamState:
  return FusedAdamState(jnp.zeros([], jnp.int32), _zeros(plan), _zeros(plan))


def fused_adamw(learning_rate: ScalarOrSchedule, *, b1: float = 0.9, b2: float = 0.999,
                eps: float = 1e-8, eps_root: float = 0.0, weight_decay: float = 1e-4,
                mask: Any = None, layout: FlatLayout | None = None
                ) -> optax.GradientTransformation:
  """`optax.adamw`, fused: Adam direction plus decoupled weight decay, times -learning_rate.

  Args:
    learning_rate: a float >= 0 or an optax schedule.
    b1, b2: moment decays in [0, 1); eps, eps_root: >= 0, as in optax.scale_by_adam.
    weight_decay: >= 0; mask: which leaves get it (bool tree, prefix or callable); None = all.
    layout: None for the pytree face, or the `FlatLayout` of flat params/updates.
  """
  learning_rate = _check_lr(learning_rate)
  b1, b2, eps, eps_root = _check_adam(b1, b2, eps, eps_root)
  weight_decay = _check_number("weight_decay", weight_decay, 0.0)
  mask = _check_mask("mask", mask)
  decayed = weight_decay > 0.0

  def plan_for(lay: FlatLayout) -> _Plan:
    return _make_plan(lay, weight_decay, mask)

  def update_flat(plan, g, state, p):
    count_inc = optax.safe_increment(state.count)
    scalars = _adam_scalars(_learning_rate(learning_rate, state.count), count_inc, b1, b2)
    mu, nu = _adam_moments(g, state.mu, state.nu, b1, b2)
    u = _adam_step(plan, mu, nu, scalars, eps, eps_root)
    if decayed:
      u = u + _decay(plan) * p
    return -scalars[0] * u, FusedAdamState(count_inc, mu, nu)

  def kernel(plan, gs, state, ps, flat, skip):
    count_inc = optax.safe_increment(state.count)
    scalars = _adam_scalars(_learning_rate(learning_rate, state.count), count_inc, b1, b2)
    (mu, nu), us = cpu_kernels.update(
        "adamw", scalars, (state.mu, state.nu), gs, ps if decayed else None, table=plan.table,
        flat=flat, skip=skip, **_adam_attrs(b1, b2, eps, eps_root), decayed=decayed)
    return us, FusedAdamState(count_inc, mu, nu)

  return _make("fused_adamw", _adam_init, update_flat, kernel, plan_for, layout,
               needs_params=decayed)


def fused_lamb(learning_rate: ScalarOrSchedule, *, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-6, eps_root: float = 0.0, weight_decay: float = 0.0,
               mask: Any = None, layout: FlatLayout | None = None
               ) -> optax.GradientTransformation:
  """`optax.lamb`, fused: Adam direction plus weight decay, per-layer trust ratio, learning rate.

  Args:
    learning_rate: a float >= 0 or an optax schedule.
    b1, b2: moment decays in [0, 1); eps, eps_root: >= 0.
    weight_decay: >= 0; mask: which leaves get it (bool tree, prefix or callable); None = all.
    layout: None for the pytree face, or the `FlatLayout` of flat params/updates.
  """
  learning_rate = _check_lr(learning_rate)
  b1, b2, eps, eps_root = _check_adam(b1, b2, eps, eps_root)
  weight_decay = _check_number("weight_decay", weight_decay, 0.0)
  mask = _check_mask("mask", mask)

  def plan_for(lay: FlatLayout) -> _Plan:
    return _make_plan(lay, weight_decay, mask)

  def update_flat(plan, g, state, p):
    count_inc = optax.safe_increment(state.count)
    scalars = _adam_scalars(_learning_rate(learning_rate, state.count), count_inc, b1, b2)
    decay = _decay(plan)
    mu, nu = _adam_moments(g, state.mu, state.nu, b1, b2)

    def direction(mu, nu, p):
      return _adam_step(plan, mu, nu, scalars, eps, eps_root) + decay * p

    # The moments are written once; the direction is recomputed from them in the norm pass and
    # in the final pass instead of being materialised (the barrier stops XLA from sharing it):
    # one less full-size buffer written and read, one less kernel.
    mu_b, nu_b, p_b = lax.optimization_barrier((mu, nu, p))
    param_norm, update_norm = _leaf_norms(plan, p_b, direction(mu_b, nu_b, p_b))
    ratio = _trust_ratio(plan, param_norm, update_norm, 1.0, 0.0)
    u = direction(mu, nu, p)
    return u * (ratio * -scalars[0]), FusedAdamState(count_inc, mu, nu)

  def kernel(plan, gs, state, ps, flat, skip):
    count_inc = optax.safe_increment(state.count)
    scalars = _adam_scalars(_learning_rate(learning_rate, state.count), count_inc, b1, b2)
    (mu, nu), us = cpu_kernels.update(
        "lamb", scalars, (state.mu, state.nu), gs, ps, table=plan.table, flat=flat, skip=skip,
        **_adam_attrs(b1, b2, eps, eps_root))
    return us, FusedAdamState(count_inc, mu, nu)

  return _make("fused_lamb", _adam_init, update_flat, kernel, plan_for, layout, needs_params=True)

