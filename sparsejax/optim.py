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

Like optax's optimizers they take their optax namesake's arguments in the same positions, accept
and ignore extra `update` arguments, and work under `optax.inject_hyperparams`: every numeric
hyperparameter may be a scalar array (traced under jit) instead of a Python number; Python numbers
are checked at construction, arrays when their value is known. Complex parameters travel as two
real values per element (the update is optax's, `|g|^2` included). An empty tree has an empty
state (`optax.tree.map_params` relies on it); the moments count as the params' stand-in there.

State and arithmetic are float32 whatever the parameter dtype (unless `accumulator_dtype` /
`mu_dtype` asks for another storage dtype); updates are cast back to the dtype of the incoming
updates. Skipping a step with a non-finite gradient is not their business: wrap the chain in
`sparsejax.apply_if_finite_across`.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from sparsejax import cpu_kernels, sketch
from sparsejax.flat import FlatLayout

__all__ = ["DEFAULT_ALIGN", "FusedMomentumState", "FusedAdamState", "fused_sgd", "fused_lars",
           "fused_lamb", "fused_adamw", "frozen_bound", "flat_layout", "lars_direction"]

# Row width of the layouts built here: every leaf starts at a multiple of it. Rows of 256 float32
# values keep row reductions vectorised on CPU and cost at most 255 padding values per leaf.
DEFAULT_ALIGN = 256

# A hyperparameter: a Python number, or a scalar array (optax.inject_hyperparams passes those).
Scalar = float | jax.Array
ScalarOrSchedule = Scalar | Callable[[jax.Array], jax.Array]


class FusedMomentumState(NamedTuple):
  """State of `fused_sgd` and `fused_lars`.

  count: int32[], number of updates so far (drives learning-rate schedules).
  momentum: float32[padded_size] (or `accumulator_dtype`), the momentum buffer (None for SGD
    without momentum).
  """

  count: jax.Array
  momentum: jax.Array | None


class FusedAdamState(NamedTuple):
  """State of `fused_lamb` and `fused_adamw`.

  count: int32[], number of updates so far (bias correction and schedules).
  mu: float32[padded_size] (or `mu_dtype`), first moment.
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


def _check_scalar(name: str, value: Any, low: float | None = None, high: float | None = None,
                  high_open: bool = True) -> Scalar:
  """A Python real -> float, checked; a scalar array -> float32[] (checked when concrete)."""
  if isinstance(value, jax.Array | np.ndarray) and not isinstance(value, np.generic):
    dtype = jnp.result_type(value)
    if jnp.shape(value) != () or not (jnp.issubdtype(dtype, jnp.number)):
      raise ValueError(f"{name} must be a real number or a scalar array, got an array of shape "
                       f"{jnp.shape(value)} and dtype {dtype}")
    if jnp.issubdtype(dtype, jnp.complexfloating):  # inject_hyperparams with complex params
      value = jnp.real(value)
    if not isinstance(value, jax.core.Tracer):
      _check_number(name, float(value), low, high, high_open)
    return jnp.asarray(value, jnp.float32)
  return _check_number(name, value, low, high, high_open)


def _check_lr(learning_rate: ScalarOrSchedule, name: str = "learning_rate") -> ScalarOrSchedule:
  if callable(learning_rate):
    return learning_rate
  return _check_scalar(name, learning_rate, 0.0)


def _check_mask(name: str, mask: Any) -> Any:
  if mask is None or callable(mask) or isinstance(mask, bool):
    return mask
  leaves = jax.tree.leaves(mask)
  if not all(isinstance(m, bool | np.bool_) for m in leaves):
    raise ValueError(f"{name} must be a bool, a tree of bools or a callable returning one; got "
                     f"leaves {[type(m).__name__ for m in leaves][:5]}")
  return mask


def _check_state_dtype(name: str, dtype: Any) -> np.dtype:
  """The storage dtype of a moment buffer: float32 for None; a complex dtype means its parts'."""
  if dtype is None:
    return np.dtype(np.float32)
  try:
    dtype = jax.dtypes.canonicalize_dtype(dtype)
  except TypeError as e:
    raise ValueError(f"{name} must be a floating or complex dtype or None, got {dtype!r}") from e
  if jnp.issubdtype(dtype, jnp.complexfloating):
    dtype = jnp.finfo(dtype).dtype  # the flat buffer holds complex values as pairs of reals
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{name} must be a floating or complex dtype or None, got {dtype}")
  return np.dtype(dtype)


def _is_zero(x: Scalar) -> bool:
  """True only for a Python zero (an array may be anything at run time)."""
  return isinstance(x, float | int) and x == 0.0


def _at(value: ScalarOrSchedule, count: jax.Array) -> jax.Array:
  """float32[]: a hyperparameter's value at step `count` (schedules are called with it)."""
  return jnp.asarray(value(count) if callable(value) else value, jnp.float32)


# ----------------------------------------------------------------------------- static plan


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything static an update needs about a layout: row view and per-row constants."""

  layout: FlatLayout
  row_ids: np.ndarray        # int32[rows], leaf of each row (num_leaves for padding rows)
  decay_rows: np.ndarray     # float32[rows], 1 where the leaf of a row gets weight decay
  trust_leaves: np.ndarray   # bool[num_leaves + 1], where the trust ratio applies
  valid_len: np.ndarray      # int32[rows], number of real values in each row
  # The CPU kernels' segment table: int64[S + 1] boundaries of the leaves and the gaps between
  # them, float32[S] weight-decay mask, int32[S] flags (1: a real leaf, 2: the trust ratio).
  table: tuple[np.ndarray, np.ndarray, np.ndarray]

  @property
  def shape2d(self) -> tuple[int, int]:
    return self.layout.rows, self.layout.align

  @property
  def has_complex(self) -> bool:
    return any(self.layout.is_complex)

  def rows(self, x: jax.Array) -> jax.Array:
    """float32[padded_size] -> float32[rows, align] (for row reductions)."""
    return x.reshape(self.shape2d)

  def expand(self, per_row: jax.Array) -> jax.Array:
    """[rows] -> [padded_size]: each row's value repeated over the row's `align` elements."""
    return jnp.broadcast_to(per_row[:, None], self.shape2d).reshape(-1)

  def pair_sum(self, x: jax.Array) -> jax.Array:
    """float32[padded_size]: at each half of a complex element, the sum of x over both halves
    (`|g|^2` from the squares of its parts); x as it is elsewhere."""
    if not self.has_complex:
      return x
    lay = self.layout
    first = np.zeros(lay.padded_size, bool)   # the real part of a complex element
    second = np.zeros(lay.padded_size, bool)  # its imaginary part
    for offset, size, cplx in zip(lay.offsets, lay.sizes, lay.is_complex):
      if cplx:
        first[offset:offset + size:2] = True
        second[offset + 1:offset + size:2] = True
    nxt, prev = jnp.roll(x, -1), jnp.roll(x, 1)
    return x + jnp.where(first, nxt, jnp.where(second, prev, 0.0))


def _make_plan(layout: FlatLayout, decay_mask: Any, trust_mask: Any = True,
               decay_mask_name: str = "mask",
               trust_mask_name: str = "trust_ratio_mask") -> _Plan:
  row_ids = layout.row_segment_ids
  decay_leaves = np.zeros(layout.num_leaves + 1, np.float32)
  decay_leaves[:-1] = layout.leaf_flags(True if decay_mask is None else decay_mask,
                                        decay_mask_name)
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
                trust_coefficient: Scalar, eps: Scalar) -> jax.Array:
  """float32[padded_size]: optax.scale_by_trust_ratio's factor for each element's leaf."""
  ratio = trust_coefficient * param_norm / (update_norm + eps)
  zero = jnp.logical_or(param_norm == 0.0, update_norm == 0.0)
  ratio = jnp.where(zero | ~jnp.asarray(plan.trust_leaves), 1.0, ratio)
  return plan.expand(ratio[jnp.asarray(plan.row_ids)])


def _decay(plan: _Plan, weight_decay: jax.Array) -> jax.Array:
  """Weight decay of each element (0 where masked): a scalar when every leaf gets it (the
  padding is zero in params and updates, so its decay does not matter)."""
  real = plan.decay_rows[plan.row_ids < plan.layout.num_leaves]
  if np.all(real == real[0]):
    return weight_decay * jnp.float32(real[0])
  return weight_decay * plan.expand(jnp.asarray(plan.decay_rows))


def _scalars(*values: Scalar) -> jax.Array:
  """float32[k]: the traced scalars of a kernel call, in its order."""
  return jnp.stack([jnp.asarray(v, jnp.float32) for v in values])


# ----------------------------------------------------------------------------- the two faces


# A kernel call `(plan, grads, state, params, flat) -> (updates, state)`: grads/params are
# lists of float32 buffers, one flat buffer (flat=True) or one per leaf (see
# sparsejax.cpu_kernels.update).
KernelFn = Callable[[_Plan, list, NamedTuple, list | None, bool], tuple[list, NamedTuple]]


def _as_float32(state: NamedTuple) -> NamedTuple:
  """The state with its moment buffers in float32 (a no-op for float32 storage)."""
  return jax.tree.map(lambda x: x.astype(jnp.float32)
                      if jnp.issubdtype(x.dtype, jnp.floating) else x, state)


def _stored_like(new: NamedTuple, old: NamedTuple) -> NamedTuple:
  return jax.tree.map(lambda n, o: n.astype(o.dtype), new, old)


def _leaf_to_real(x: jax.Array) -> jax.Array:
  """A leaf as the float32 values the kernels read: a complex one as (re, im) pairs, 1-D."""
  if jnp.iscomplexobj(x):
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1).reshape(-1).astype(jnp.float32)
  return x.astype(jnp.float32)


def _leaf_from_real(u: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
  if jnp.issubdtype(dtype, jnp.complexfloating):
    pair = u.reshape(*shape, 2)
    return lax.complex(pair[..., 0], pair[..., 1]).astype(dtype)
  return u.astype(dtype)


def _empty(tree: Any) -> bool:
  return not jax.tree.leaves(tree)


@dataclasses.dataclass
class _Update:
  """What both faces of a fused optimizer share: the update, its checks and its plans."""

  name: str
  init_state: Callable[[Callable[[np.dtype], Any]], NamedTuple]
  update_flat: Callable[[_Plan, jax.Array, NamedTuple, jax.Array | None], tuple]
  kernel: KernelFn | None
  plan_for: Callable[[FlatLayout], _Plan]
  needs_params: bool
  pairs_matter: bool
  plans: dict[FlatLayout, _Plan] = dataclasses.field(default_factory=dict)

  def plan(self, lay: FlatLayout) -> _Plan:
    if lay not in self.plans:
      self.plans[lay] = self.plan_for(lay)
    return self.plans[lay]

  def check_flat(self, what: str, x: Any, lay: FlatLayout) -> None:
    if not hasattr(x, "shape") or tuple(x.shape) != (lay.padded_size,):
      raise ValueError(f"{self.name} with a FlatLayout expects {what} as a 1-D buffer of length "
                       f"{lay.padded_size}, got {getattr(x, 'shape', type(x).__name__)}")

  def check_params(self, params: Any) -> None:
    if self.needs_params and params is None:
      raise ValueError(f"{self.name} needs params in update(updates, state, params)")

  def empty_init(self, params: Any) -> NamedTuple:
    # No leaves (an empty tree, or optax.tree.map_params' placeholder): the moments are `params`
    # itself, as in optax, where they are trees of the params' structure.
    return self.init_state(lambda dtype: params)

  @staticmethod
  def empty_update(updates: Any, state: NamedTuple):
    return updates, state._replace(count=optax.safe_increment(state.count))

  def use_kernel(self, plan: _Plan) -> bool:
    return self.kernel is not None and not (self.pairs_matter and plan.has_complex)


def _flat_face(u: _Update, layout: FlatLayout) -> tuple[Callable, Callable]:
  """`(init_fn, update_fn)` over float32[layout.padded_size] buffers."""
  def init_fn(params: jax.Array) -> NamedTuple:
    if _empty(params):
      return u.empty_init(params)
    u.check_flat("params", params, layout)
    u.plan(layout)  # a mask that does not match the parameters fails here
    return u.init_state(lambda dtype: jnp.zeros(layout.padded_size, dtype))

  def update_fn(updates: jax.Array, state: NamedTuple, params: jax.Array | None = None,
                **extra_args: Any):
    del extra_args  # accepted and ignored, as optax's transforms do
    if _empty(updates):
      return u.empty_update(updates, state)
    u.check_flat("updates", updates, layout)
    u.check_params(params)
    if u.needs_params:
      u.check_flat("params", params, layout)
    plan = u.plan(layout)
    g = updates.astype(jnp.float32)
    p = params.astype(jnp.float32) if u.needs_params else None
    state32 = _as_float32(state)

    def on_xla():
      return u.update_flat(plan, g, state32, p)

    def on_kernel():
      us, new_state = u.kernel(plan, [g], state32, None if p is None else [p], True)
      return us[0], new_state

    out, new_state = _on_cpu(on_kernel, on_xla) if u.use_kernel(plan) else on_xla()
    return out.astype(updates.dtype), _stored_like(new_state, state)

  return init_fn, update_fn


def _tree_face(u: _Update) -> tuple[Callable, Callable]:
  """`(init_fn, update_fn)` over pytrees (laid out on every call, plans cached per layout)."""
  def init_fn(params: Any) -> NamedTuple:
    if _empty(params):
      return u.empty_init(params)
    size = u.plan(flat_layout(params)).layout.padded_size
    return u.init_state(lambda dtype: jnp.zeros(size, dtype))

  def update_fn(updates: Any, state: NamedTuple, params: Any = None, **extra_args: Any):
    del extra_args  # accepted and ignored, as optax's transforms do
    if _empty(updates):
      return u.empty_update(updates, state)
    lay = flat_layout(updates)
    u.check_params(params)
    plan = u.plan(lay)
    state32 = _as_float32(state)

    def on_xla():
      g = lay.ravel(updates, jnp.float32)
      p = lay.ravel(params, jnp.float32) if u.needs_params else None
      out, new_state = u.update_flat(plan, g, state32, p)
      return jax.tree.leaves(lay.unravel(out)), new_state

    def on_kernel():  # the leaves go to the kernel as they are: no ravel, no unravel
      gs = [_leaf_to_real(x) for x in lay.treedef.flatten_up_to(updates)]
      ps = ([_leaf_to_real(x) for x in lay.treedef.flatten_up_to(params)]
            if u.needs_params else None)
      us, new_state = u.kernel(plan, gs, state32, ps, False)
      return ([_leaf_from_real(x, s, d) for x, s, d in zip(us, lay.shapes, lay.dtypes)],
              new_state)

    us, new_state = _on_cpu(on_kernel, on_xla) if u.use_kernel(plan) else on_xla()
    out = jax.tree.unflatten(lay.treedef, us)
    return (jax.tree.map(lambda o, x: o.astype(x.dtype), out, updates),
            _stored_like(new_state, state))

  return init_fn, update_fn


def _make(name: str, init_state: Callable[[Callable[[np.dtype], Any]], NamedTuple],
          update_flat: Callable[[_Plan, jax.Array, NamedTuple, jax.Array | None], tuple],
          kernel: KernelFn | None, plan_for: Callable[[FlatLayout], _Plan],
          layout: FlatLayout | None, needs_params: bool, pairs_matter: bool = False
          ) -> optax.GradientTransformationExtraArgs:
  """Wraps an update into one of the two faces.

  `init_state(buffer)` builds the state from `buffer(dtype)`, which makes one moment buffer;
  `update_flat(plan, g, state, p) -> (u, state)` is the XLA path over float32[padded_size]
  buffers; `kernel` (or None) the CPU kernel path. `pairs_matter`: the update mixes the two parts
  of a complex value (Adam's |g|^2), which only the XLA path does.
  """
  if layout is not None and not isinstance(layout, FlatLayout):
    raise ValueError(f"{name}: layout must be a sparsejax.flat.FlatLayout or None, got "
                     f"{type(layout).__name__}")
  u = _Update(name, init_state, update_flat, kernel, plan_for, needs_params, pairs_matter)
  init_fn, update_fn = _flat_face(u, layout) if layout is not None else _tree_face(u)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ----------------------------------------------------------------------------- SGD


def fused_sgd(learning_rate: ScalarOrSchedule, momentum: Scalar | None = None,
              nesterov: bool = False, accumulator_dtype: Any = None, *,
              weight_decay: ScalarOrSchedule | None = None, weight_decay_mask: Any = None,
              layout: FlatLayout | None = None) -> optax.GradientTransformationExtraArgs:
  """`optax.chain(optax.add_decayed_weights(weight_decay, weight_decay_mask), optax.sgd(...))`.

  Args:
    learning_rate: >= 0 (a number or scalar array) or an optax schedule `count -> lr`.
    momentum: trace decay in [0, 1), or None for plain SGD.
    nesterov: Nesterov momentum.
    accumulator_dtype: storage dtype of the momentum buffer (None: float32; a complex dtype
      means its parts' dtype, since complex values are stored as pairs of reals).
    weight_decay: coupled weight decay (added to the gradient), >= 0, or a schedule; None (the
      default) = none, which stays static under `optax.inject_hyperparams` (a 0.0 default would
      arrive there as an array, and `update` would then need params, unlike `optax.sgd`).
    weight_decay_mask: which leaves get weight decay (bool tree, prefix or callable); None = all.
    layout: None for the pytree face, or the `FlatLayout` of flat params/updates.
  """
  learning_rate = _check_lr(learning_rate)
  if momentum is not None:
    momentum = _check_scalar("momentum", momentum, 0.0, 1.0)
  if weight_decay is None:
    weight_decay = 0.0
  weight_decay = _check_lr(weight_decay, "weight_decay")
  weight_decay_mask = _check_mask("weight_decay_mask", weight_decay_mask)
  dtype = _check_state_dtype("accumulator_dtype", accumulator_dtype)
  decayed = not _is_zero(weight_decay)
  nesterov = bool(nesterov)

  def plan_for(lay: FlatLayout) -> _Plan:
    return _make_plan(lay, weight_decay_mask, decay_mask_name="weight_decay_mask")

  def init_state(buffer) -> FusedMomentumState:
    return FusedMomentumState(jnp.zeros([], jnp.int32),
                              buffer(dtype) if momentum is not None else None)

  def update_flat(plan, g, state, p):
    lr = _at(learning_rate, state.count)
    if decayed:
      g = g + _decay(plan, _at(weight_decay, state.count)) * p
    trace = state.momentum
    if momentum is not None:
      trace = g + momentum * trace
      g = g + momentum * trace if nesterov else trace
    return -lr * g, FusedMomentumState(optax.safe_increment(state.count), trace)

  def kernel(plan, gs, state, ps, flat):
    scalars = _scalars(_at(learning_rate, state.count), momentum,
                       _at(weight_decay, state.count) if decayed else 0.0)
    (trace,), us = cpu_kernels.update(
        "sgd", scalars, (state.momentum,), gs, ps if decayed else None, table=plan.table,
        flat=flat, nesterov=nesterov, decayed=decayed)
    return us, FusedMomentumState(optax.safe_increment(state.count), trace)

  # Without momentum the update is one elementwise pass: XLA's fusion already is the floor.
  return _make("fused_sgd", init_state, update_flat, kernel if momentum is not None else None,
               plan_for, layout, needs_params=decayed)


# ----------------------------------------------------------------------------- LARS


def fused_lars(learning_rate: ScalarOrSchedule, weight_decay: ScalarOrSchedule = 0.0,
               weight_decay_mask: Any = True, trust_coefficient: Scalar = 0.001,
               eps: Scalar = 0.0, trust_ratio_mask: Any = True, momentum: Scalar = 0.9,
               nesterov: bool = False, *, layout: FlatLayout | None = None
               ) -> optax.GradientTransformationExtraArgs:
  """`optax.lars`, fused: weight decay, per-layer trust ratio, learning rate, then momentum.

  Args:
    learning_rate: >= 0 (a number or scalar array) or an optax schedule.
    weight_decay: >= 0 or a schedule; weight_decay_mask: which leaves get it (bool, tree,
      prefix or callable).
    trust_coefficient: >= 0, multiplies ||param|| / (||update|| + eps); eps >= 0.
    trust_ratio_mask: which leaves get the trust ratio (the others keep ratio 1).
    momentum: trace decay in [0, 1); nesterov: Nesterov momentum.
    layout: None for the pytree face, or the `FlatLayout` of flat params/updates.
  """
  learning_rate = _check_lr(learning_rate)
  weight_decay = _check_lr(weight_decay, "weight_decay")
  trust_coefficient = _check_scalar("trust_coefficient", trust_coefficient, 0.0)
  eps = _check_scalar("eps", eps, 0.0)
  momentum = _check_scalar("momentum", momentum, 0.0, 1.0)
  weight_decay_mask = _check_mask("weight_decay_mask", weight_decay_mask)
  trust_ratio_mask = _check_mask("trust_ratio_mask", trust_ratio_mask)
  nesterov = bool(nesterov)

  def plan_for(lay: FlatLayout) -> _Plan:
    return _make_plan(lay, weight_decay_mask, trust_ratio_mask,
                      decay_mask_name="weight_decay_mask")

  def init_state(buffer) -> FusedMomentumState:
    return FusedMomentumState(jnp.zeros([], jnp.int32), buffer(np.dtype(np.float32)))

  def update_flat(plan, g, state, p):
    lr = _at(learning_rate, state.count)
    decay = _decay(plan, _at(weight_decay, state.count))
    param_norm, update_norm = _leaf_norms(plan, p, g + decay * p)
    ratio = _trust_ratio(plan, param_norm, update_norm, trust_coefficient, eps)
    u = (g + decay * p) * (ratio * -lr)
    t = u + momentum * state.momentum
    u = u + momentum * t if nesterov else t
    return u, FusedMomentumState(optax.safe_increment(state.count), t)

  def kernel(plan, gs, state, ps, flat):
    scalars = _scalars(_at(learning_rate, state.count), momentum,
                       _at(weight_decay, state.count), trust_coefficient, eps)
    (trace,), us = cpu_kernels.update(
        "lars", scalars, (state.momentum,), gs, ps, table=plan.table, flat=flat,
        nesterov=nesterov)
    return us, FusedMomentumState(optax.safe_increment(state.count), trace)

  return _make("fused_lars", init_state, update_flat, kernel, plan_for, layout, needs_params=True)


def lars_direction(layout: FlatLayout, weight_decay: Scalar = 0.0, weight_decay_mask: Any = True,
                   trust_coefficient: Scalar = 0.001, eps: Scalar = 0.0,
                   trust_ratio_mask: Any = True, *, axes: str | Sequence[str] | None = None,
                   buckets: int = 256) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """`(g, p) -> direction` on the flat face of `layout`: optax.lars's update before its learning
  rate and momentum, `(g + weight_decay * p)` times each leaf's trust ratio (`fused_lars`'s
  pieces; for momentum correction, where each worker scales its own gradient before the
  exchange).

  `axes=None`: the trust ratio from this worker's own `g + weight_decay * p`. With the workers'
  mesh `axes` (inside `shard_map`), from the norm of the workers' mean of it, as LARS after a
  dense exchange has it, estimated from count sketches of `buckets` bins a leaf
  (`sparsejax.sketch.mean_norms`: one all-reduce of `buckets + 2` floats a leaf of
  `trust_ratio_mask`, the only ones whose norm is read); every worker
  then scales by the same ratio, so the mean of the directions is LARS's direction of the mean
  gradient. The sketch's hash is drawn from the parameters' norms (the same on every worker,
  new every step)."""
  weight_decay = _check_scalar("weight_decay", weight_decay, 0.0)
  trust_coefficient = _check_scalar("trust_coefficient", trust_coefficient, 0.0)
  eps = _check_scalar("eps", eps, 0.0)
  decay_mask = _check_mask("weight_decay_mask", weight_decay_mask)
  trust_mask = _check_mask("trust_ratio_mask", trust_ratio_mask)
  plan = _make_plan(layout, decay_mask, trust_mask, decay_mask_name="weight_decay_mask")
  # only the leaves whose trust ratio applies are sketched (the others' norms are not read):
  # their segments renumbered 0.., every other row left out (segment `sketched.size`)
  sketched = np.flatnonzero(plan.trust_leaves)
  segment = np.full(layout.num_leaves + 1, sketched.size, np.int32)
  segment[sketched] = np.arange(sketched.size)

  def direction(g: jax.Array, p: jax.Array) -> jax.Array:
    g, p = g.astype(jnp.float32), p.astype(jnp.float32)
    d = g + _decay(plan, jnp.float32(weight_decay)) * p
    param_norm, update_norm = _leaf_norms(plan, p, d)
    if axes is not None and sketched.size:
      seed = lax.bitcast_convert_type(jnp.sum(param_norm), jnp.uint32)
      update_norm = update_norm.at[sketched].set(sketch.mean_norms(
          plan.rows(d), segment[plan.row_ids], sketched.size, axes, buckets=buckets, seed=seed,
          own_norms=update_norm[sketched]))
    return d * _trust_ratio(plan, param_norm, update_norm, trust_coefficient, eps)

  return direction


# ----------------------------------------------------------------------------- Adam family


def _check_adam(b1: Scalar, b2: Scalar, eps: Scalar, eps_root: Scalar) -> tuple[Scalar, ...]:
  return (_check_scalar("b1", b1, 0.0, 1.0), _check_scalar("b2", b2, 0.0, 1.0),
          _check_scalar("eps", eps, 0.0), _check_scalar("eps_root", eps_root, 0.0))


def _adam_scalars(lr: jax.Array, count_inc: jax.Array, b1: Scalar, b2: Scalar,
                  nesterov: bool, variance_count: jax.Array | None = None) -> jax.Array:
  """float32[4]: the learning rate and the bias-correction factors (cm, cv, cg) of
  `m * cm + g * cg` and `v * cv` (optax.scale_by_adam's mu_hat and nu_hat), from one tiny kernel
  (fewer launches). `variance_count`: the updates the second moment has had (default
  `count_inc`; fewer when it is frozen)."""
  t = count_inc.astype(jnp.float32)
  tv = t if variance_count is None else variance_count.astype(jnp.float32)
  b1, b2 = jnp.asarray(b1, jnp.float32), jnp.asarray(b2, jnp.float32)
  cv = 1.0 / (1.0 - b2 ** tv)
  if nesterov:
    cm, cg = b1 / (1.0 - b1 ** (t + 1.0)), (1.0 - b1) / (1.0 - b1 ** t)
  else:
    cm, cg = 1.0 / (1.0 - b1 ** t), jnp.zeros([], jnp.float32)
  return jnp.stack([jnp.asarray(lr, jnp.float32), cm, cv, cg])


def _adam_step(plan: _Plan, mu, nu, g, scalars, eps, eps_root, nesterov: bool):
  """optax.scale_by_adam's direction from the updated moments, float32[padded_size]."""
  m = mu * scalars[1] + g * scalars[3] if nesterov else mu * scalars[1]
  u = m / (jnp.sqrt(nu * scalars[2] + eps_root) + eps)
  if not (isinstance(eps, float) and isinstance(eps_root, float)) or eps == eps_root == 0.0:
    # 0/0 in the padding would poison the per-leaf norms (eps and eps_root may be 0 when traced);
    # real values keep optax's behaviour.
    col = lax.rem(lax.iota(jnp.int32, u.shape[0]), jnp.int32(plan.layout.align))
    u = jnp.where(col < plan.expand(jnp.asarray(plan.valid_len)), u, 0.0)
  return u


def frozen_bound(b1: Scalar, b2: Scalar, nesterov: bool = False) -> jax.Array:
  """The most Adam's direction |m_hat / sqrt(v_hat)| can be at any coordinate while its second
  moment runs (eps aside), by Cauchy-Schwarz over the two averages: (1 - b1) / sqrt((1 - b2)
  (1 - b1^2 / b2)), 1.70 at (0.9, 0.98); the bias corrections never take it above that. With
  Nesterov's gradient term, b1 times that plus max(1, (1 - b1) / sqrt(1 - b2)) (the term's
  bias correction can take it to 1 in the first steps). Infinite where b1^2 >= b2 (no bound).

  A frozen second moment loses it: a coordinate whose gradients outgrow its variance at the
  freeze (an embedding row of a token rare or absent until then) steps lr |m| / sqrt(v) without
  limit. `fused_adamw(freeze_variance_after=...)` keeps it instead."""
  b1, b2 = jnp.asarray(b1, jnp.float32), jnp.asarray(b2, jnp.float32)
  bound = (1.0 - b1) / jnp.sqrt((1.0 - b2) * jnp.maximum(1.0 - b1 * b1 / b2, 0.0))
  if nesterov:
    bound = b1 * bound + jnp.maximum(1.0, (1.0 - b1) / jnp.sqrt(1.0 - b2))
  return jnp.where(b1 * b1 < b2, bound, jnp.inf)


def _adam_moments(plan: _Plan, g, mu, nu, b1: Scalar, b2: Scalar):
  """optax.scale_by_adam's moment updates, float32[padded_size] (|g|^2 for complex values)."""
  return (1.0 - b1) * g + b1 * mu, (1.0 - b2) * plan.pair_sum(g * g) + b2 * nu


def fused_adamw(learning_rate: ScalarOrSchedule, b1: Scalar = 0.9, b2: Scalar = 0.999,
                eps: Scalar = 1e-8, eps_root: Scalar = 0.0, mu_dtype: Any = None,
                weight_decay: ScalarOrSchedule = 1e-4, mask: Any = None, *,
                nesterov: bool = False, freeze_variance_after: int | None = None,
                layout: FlatLayout | None = None) -> optax.GradientTransformationExtraArgs:
  """`optax.adamw`, fused: Adam direction plus decoupled weight decay, times -learning_rate.

  Args:
    learning_rate: >= 0 (a number or scalar array) or an optax schedule.
    b1, b2: moment decays in [0, 1); eps, eps_root: >= 0, as in optax.scale_by_adam.
    mu_dtype: storage dtype of the first moment (None: float32; complex: its parts' dtype).
    weight_decay: >= 0 or a schedule; mask: which leaves get it (bool tree, prefix or
      callable); None = all.
    nesterov: Nesterov momentum (NAdamW), as optax.adamw(nesterov=True).
    freeze_variance_after: None, or a step count >= 1 after which the second moment stops
      changing (with its bias correction): 1-bit Adam's frozen variance (Tang et al., 2021).
      Adam is then linear in the gradients, so a delayed, bursty gradient (error feedback)
      moves the parameters as far as the gradients it holds. Once frozen, each coordinate's
      direction keeps the bound it had while the variance ran (`frozen_bound`): clipped to it,
      so that a coordinate whose gradients outgrow its frozen variance steps no farther than
      Adam could have (on the two LM tasks it acts on 0.3-0.7% of the coordinates a step).
    layout: None for the pytree face, or the `FlatLayout` of flat params/updates.
  """
  learning_rate = _check_lr(learning_rate)
  b1, b2, eps, eps_root = _check_adam(b1, b2, eps, eps_root)
  if freeze_variance_after is not None and (
      isinstance(freeze_variance_after, bool) or not isinstance(freeze_variance_after, int)
      or freeze_variance_after < 1):
    raise ValueError(f"freeze_variance_after must be None or an int >= 1, got "
                     f"{freeze_variance_after!r}")
  mu_dtype = _check_state_dtype("mu_dtype", mu_dtype)
  weight_decay = _check_lr(weight_decay, "weight_decay")
  mask = _check_mask("mask", mask)
  decayed = not _is_zero(weight_decay)
  nesterov = bool(nesterov)

  def plan_for(lay: FlatLayout) -> _Plan:
    return _make_plan(lay, mask)

  def init_state(buffer) -> FusedAdamState:
    return FusedAdamState(jnp.zeros([], jnp.int32), buffer(mu_dtype),
                          buffer(np.dtype(np.float32)))

  def variance(count_inc):
    """(this step's b2: 1 once frozen, the second moment's update count, the direction's
    bound: `frozen_bound` once frozen, else infinite)."""
    if freeze_variance_after is None:
      return b2, None, jnp.asarray(jnp.inf, jnp.float32)
    frozen = count_inc > freeze_variance_after
    return (jnp.where(frozen, 1.0, b2), jnp.minimum(count_inc, freeze_variance_after),
            jnp.where(frozen, frozen_bound(b1, b2, nesterov), jnp.inf))

  def update_flat(plan, g, state, p):
    count_inc = optax.safe_increment(state.count)
    b2_now, tv, bound = variance(count_inc)
    scalars = _adam_scalars(_at(learning_rate, state.count), count_inc, b1, b2, nesterov, tv)
    mu, nu = _adam_moments(plan, g, state.mu, state.nu, b1, b2_now)
    u = _adam_step(plan, mu, nu, g, scalars, eps, eps_root, nesterov)
    if freeze_variance_after is not None:
      u = jnp.clip(u, -bound, bound)  # (NaN stays NaN, for the finite check)
    if decayed:
      u = u + _decay(plan, _at(weight_decay, state.count)) * p
    return -scalars[0] * u, FusedAdamState(count_inc, mu, nu)

  def kernel(plan, gs, state, ps, flat):
    count_inc = optax.safe_increment(state.count)
    b2_now, tv, bound = variance(count_inc)
    scalars = _adam_scalars(_at(learning_rate, state.count), count_inc, b1, b2, nesterov, tv)
    scalars = jnp.concatenate([scalars, _scalars(
        b1, b2_now, eps, eps_root, _at(weight_decay, state.count) if decayed else 0.0, bound)])
    (mu, nu), us = cpu_kernels.update(
        "adamw", scalars, (state.mu, state.nu), gs, ps if decayed else None, table=plan.table,
        flat=flat, decayed=decayed, nesterov=nesterov)
    return us, FusedAdamState(count_inc, mu, nu)

  return _make("fused_adamw", init_state, update_flat, kernel, plan_for, layout,
               needs_params=decayed, pairs_matter=True)


def fused_lamb(learning_rate: ScalarOrSchedule, b1: Scalar = 0.9, b2: Scalar = 0.999,
               eps: Scalar = 1e-6, eps_root: Scalar = 0.0,
               weight_decay: ScalarOrSchedule = 0.0, mask: Any = None, *,
               layout: FlatLayout | None = None) -> optax.GradientTransformationExtraArgs:
  """`optax.lamb`, fused: Adam direction plus weight decay, per-layer trust ratio, learning rate.

  Args:
    learning_rate: >= 0 (a number or scalar array) or an optax schedule.
    b1, b2: moment decays in [0, 1); eps, eps_root: >= 0.
    weight_decay: >= 0 or a schedule; mask: which leaves get it (bool tree, prefix or
      callable); None = all.
    layout: None for the pytree face, or the `FlatLayout` of flat params/updates.
  """
  learning_rate = _check_lr(learning_rate)
  b1, b2, eps, eps_root = _check_adam(b1, b2, eps, eps_root)
  weight_decay = _check_lr(weight_decay, "weight_decay")
  mask = _check_mask("mask", mask)

  def plan_for(lay: FlatLayout) -> _Plan:
    return _make_plan(lay, mask)

  def init_state(buffer) -> FusedAdamState:
    f32 = np.dtype(np.float32)
    return FusedAdamState(jnp.zeros([], jnp.int32), buffer(f32), buffer(f32))

  def update_flat(plan, g, state, p):
    count_inc = optax.safe_increment(state.count)
    scalars = _adam_scalars(_at(learning_rate, state.count), count_inc, b1, b2, False)
    decay = _decay(plan, _at(weight_decay, state.count))
    mu, nu = _adam_moments(plan, g, state.mu, state.nu, b1, b2)

    def direction(mu, nu, p):
      return _adam_step(plan, mu, nu, None, scalars, eps, eps_root, False) + decay * p

    # The moments are written once; the direction is recomputed from them in the norm pass and
    # in the final pass instead of being materialised (the barrier stops XLA from sharing it):
    # one less full-size buffer written and read, one less kernel.
    mu_b, nu_b, p_b = lax.optimization_barrier((mu, nu, p))
    param_norm, update_norm = _leaf_norms(plan, p_b, direction(mu_b, nu_b, p_b))
    ratio = _trust_ratio(plan, param_norm, update_norm, 1.0, 0.0)
    u = direction(mu, nu, p)
    return u * (ratio * -scalars[0]), FusedAdamState(count_inc, mu, nu)

  def kernel(plan, gs, state, ps, flat):
    count_inc = optax.safe_increment(state.count)
    scalars = _adam_scalars(_at(learning_rate, state.count), count_inc, b1, b2, False)
    scalars = jnp.concatenate([scalars, _scalars(b1, b2, eps, eps_root,
                                                 _at(weight_decay, state.count))])
    (mu, nu), us = cpu_kernels.update(
        "lamb", scalars, (state.mu, state.nu), gs, ps, table=plan.table, flat=flat)
    return us, FusedAdamState(count_inc, mu, nu)

  return _make("fused_lamb", init_state, update_flat, kernel, plan_for, layout,
               needs_params=True, pairs_matter=True)
