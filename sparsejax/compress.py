"""The compressed mean of the gradient over the workers, as optax transforms built from pieces.

A sparse exchange is a few pieces, each with one job and its own state, put together by one
optax transform, `exchange`:

    exchange(collective,                  # the collective's two halves around the selection:
                                          #   sparse_allgather, sparse_hitopk, sparse_gtopk, ...
             density_schedule(density),   # the static levels and which one a step runs
             feedback=error_feedback(c),  # the memory; the candidates (momentum or Adam first)
             selector="mstopk")           # the top k of the candidates, one call

Each step: the gradient pytree is raveled once into a flat float32 buffer; the collective's
`scatter` gives this worker's part; the feedback turns it into candidates; one selection picks the
k largest at the step's level; the collective's `gather` (or `reduce`, for gTop-k) sums the pairs
over the workers; what was not sent is the next memory; the mean comes back with the gradient's
structure and dtypes. Error feedback closes a loop around the selection and the collective (its
next memory is what they did not send), so it is a piece the exchange threads through the step,
not a link in an `optax.chain`; the pieces are NamedTuples of pure functions, as
`SparseCollective` is. The state is per worker (`ExchangeState`: the memory, the step count, the
density and bytes of the last step), so `init` also runs where the axes are bound.

`topk_allreduce(density, algorithm=..., correction=..., schedule=...)` is that for the common
case. Beside the core, two options: `tensor_balance` (each tensor's candidates scaled before the
one selection) and `send_whole` (chosen elements sent whole every step); and the dense form, a
level of `density_schedule(..., dense_form=True)` that all-reduces every candidate, empties
the residual and makes the correction's state the workers' mean (the switch's work, once), with
its steady step beside it (the gradient all-reduced, then the correction run on the mean: plain
dense's work, for the steps after). The uncompressed baselines are `dense_mean` (one all-reduce) and
`hierarchical_mean` (reduce-scatter, all-reduce, all-gather). Skipping non-finite steps is
`sparsejax.apply_if_finite_across`'s job.
"""

from __future__ import annotations

import math
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
  ErrorFeedback,
  Feedback,
  error_feedback,
)
from sparsejax.flat import FlatLayout

__all__ = ["ExchangeState", "exchange", "topk_allreduce", "dense_mean", "hierarchical_mean",
           "DensitySchedule", "density_schedule", "density_levels", "level_index",
           "TensorBalance", "tensor_balance", "tensor_weights", "SendWhole", "send_whole"]


class ExchangeState(NamedTuple):
  """Per-worker state of `exchange` (and so `topk_allreduce`), `dense_mean` and
  `hierarchical_mean`: each piece's part by name.

  feedback: the error-feedback piece's memory, a `Feedback(residual, velocity, second)` of
    float32[r] buffers (r = padded n for the flat algorithms, padded n / local for the
    hierarchical ones "hitopk", "higtopk"); None for the dense baselines or without error
    feedback (no zero-size arrays: XLA and orbax both handle those badly).
  count: int32 number of updates so far (drives the density schedule).
  density: float32 density used at the last update (1 for the dense baselines and forms).
  bytes_sent: float32 inter- plus intra-node bytes this worker sent at the last update.
  """

  feedback: Feedback | None
  count: jax.Array
  density: jax.Array
  bytes_sent: jax.Array


# ----------------------------------------------------------------------------- density schedule

def density_levels(density: float, start: float | None = None,
                   ratio: float = 4.0) -> tuple[float, ...]:
  """The static densities a schedule is rounded up to (each compiles once): without `start`,
  density * ratio**j below 1, then 1. With `start` (the schedule's first density, above
  `density`): the geometric grid from `density` to `start` in the fewest steps of at most
  `ratio` (DGC's warm-up decays 4x a stage; a float32 rounding of `start` does not add one),
  then start * ratio**j below 1 (for a schedule that rises past its start), then 1, so that a
  warm-up runs its first steps at the density it asks for (0.04 from 0.25: 0.04, 0.1, 0.25;
  not 0.16, 0.64, which send 2.56x the pairs asked for) and no level is more than `ratio`
  above the schedule."""
  start = None if start is None else float(start)
  if start is None or not density < start <= 1.0:
    levels, d = [], density
  else:
    stages = max(1, math.ceil(math.log(start / density) / math.log(ratio) - 1e-6))
    step = (start / density) ** (1.0 / stages)
    levels, d = [density * step**j for j in range(stages)], start
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


class DensitySchedule(NamedTuple):
  """The density-schedule piece: the static densities a step may run at (`levels`, increasing;
  one without a schedule), the optax schedule `count -> density` that picks one in the step
  (rounded up to a level), and whether level `len(levels)` is the dense form."""

  levels: tuple[float, ...]
  schedule: Callable | None = None
  dense_form: bool = False

  def index(self, count: jax.Array, density_level: int | None) -> jax.Array | int:
    """The level to run: the caller's `density_level` (a Python int: no switch;
    `len(levels)` is the dense form where there is one), else the one the schedule's density
    at `count` is rounded up to (int32[])."""
    levels = self.levels
    if density_level is not None:
      end = len(levels) + 2 * bool(self.dense_form)
      if (isinstance(density_level, bool) or not isinstance(density_level, int)
          or not 0 <= density_level < end):
        dense = (f"; {len(levels)}: the dense form, {len(levels) + 1}: its steady step"
                 if self.dense_form else "")
        raise ValueError(f"density_level must be a Python int in [0, {end}) (an index into the "
                         f"levels {levels}{dense}), got {density_level!r}")
      return density_level
    if len(levels) == 1:
      return 0
    return level_index(levels, jnp.asarray(self.schedule(count), jnp.float32))


def density_schedule(density: float, schedule: Callable | None = None,
                     dense_form: bool = False) -> DensitySchedule:
  """The density-schedule piece for a final `density` in (0, 1]: one level without `schedule`,
  else `density_levels(density, schedule(0))`, each step's `schedule(count)` rounded up to one
  of them (DGC's warm-up: start dense and decay to `density`); shapes stay static, each level
  compiles once. `dense_form`: also offer the exchange's dense form (level `len(levels)`:
  every candidate summed, the residual emptied, the correction's state made the workers' mean)
  and its steady step (level `len(levels) + 1`, for a step after a dense-form step: the gradient
  summed first and the correction run on the mean, as plain dense runs its optimizer; the
  residual, empty, not touched). In pairs4 both keep their bfloat16 roundings in the residual
  (the steady step with a correction sums float32: `_steady`)."""
  if isinstance(density, bool) or not isinstance(density, int | float) or not 0 < density <= 1:
    raise ValueError(f"density must be a number in (0, 1], got {density!r}")
  if schedule is not None and not callable(schedule):
    raise ValueError(f"schedule must be an optax schedule (count -> density) or None, got "
                     f"{schedule!r}")
  levels = (float(density),) if schedule is None else density_levels(density, _start(schedule))
  return DensitySchedule(levels, schedule, bool(dense_form))


def _start(schedule: Callable) -> float | None:
  """The schedule's first density, `schedule(0)` (None where it cannot be read now: a schedule
  built under a trace; its levels are then density * 4**j)."""
  try:
    return float(schedule(0))
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


# ----------------------------------------------------------------------------- the options

def tensor_weights(candidates: jax.Array, segments: jax.Array, num_segments: int) -> jax.Array:
  """float32 per-element weights 2^-round(log2(rms of the element's tensor)): scaled by them,
  every tensor's candidates have an RMS near 1, so one global top-k takes about the same share
  of each tensor's coordinates (`tensor_balance`). Powers of two: scaling and unscaling are
  exact. `segments`: int32 tensor id of each element (`FlatLayout.segment_ids`)."""
  c = candidates.astype(jnp.float32)
  sq = jax.ops.segment_sum(c * c, segments, num_segments)
  n = jax.ops.segment_sum(jnp.ones_like(c), segments, num_segments)
  rms = jnp.sqrt(sq / jnp.maximum(n, 1.0))
  exponent = jnp.where(rms > 0, -jnp.round(jnp.log2(jnp.where(rms > 0, rms, 1.0))), 0.0)
  return jnp.exp2(jnp.clip(exponent, -60, 60))[segments]


class TensorBalance(NamedTuple):
  """The per-tensor balance piece (`tensor_balance`): the tensor id of each element of the flat
  buffer (`FlatLayout.segment_ids`), or None for the leaves of the updates."""

  segments: Any = None

  def weights(self, candidates: jax.Array, layout: FlatLayout,
              collective: comm.SparseCollective) -> jax.Array:
    """`tensor_weights` of this worker's candidates; the hierarchical algorithms take shard i
    of the ids (shard i of a node's buffer is worker i's)."""
    part_len = candidates.shape[0]
    ids = np.asarray(layout.segment_ids if self.segments is None else self.segments, np.int32)
    if ids.shape[0] > layout.padded_size:
      raise ValueError(f"segments has {ids.shape[0]} ids for a buffer of {layout.size} values")
    count = int(ids.max(initial=0)) + 2  # the last id: padding
    ids = np.concatenate([ids, np.full(layout.padded_size - ids.shape[0], count - 1, np.int32)])
    seg = jnp.asarray(ids)
    if collective.name in comm.HIERARCHICAL_ALGORITHMS:
      seg = lax.dynamic_slice(seg, (lax.axis_index(collective.axes[-1]) * part_len,),
                              (part_len,))
    return tensor_weights(candidates, seg, count)


def tensor_balance(segments: Any = None) -> TensorBalance:
  """Each tensor's candidates scaled by a power of two near 1 / their RMS before the one top-k,
  so each tensor gets about its share of the k (a global top-k starves tensors whose gradients
  are small, such as a Transformer's position embeddings); what is sent is unscaled. Tensors are
  the leaves of the updates, or `segments` (the tensor id of each element of updates that are
  already one flat buffer). Needs error feedback, plain or with a `MomentumCorrection`."""
  return TensorBalance(segments)


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


class SendWhole(NamedTuple):
  """The piece that sends chosen elements whole every step (`send_whole`): bool `flags` over the
  flat buffer (the updates raveled, `FlatLayout` order; or a shorter prefix of it)."""

  flags: Any

  def bytes(self, n: int, nodes: int, local: int, hierarchical: bool) -> float:
    """A worker's bytes a step for the all-reduce of the flagged positions."""
    count = _whole_table(self.flags, n, local, hierarchical).shape[1]
    b = comm.wire_bytes("dense", n=count, nodes=nodes, local=1 if hierarchical else local)
    return b["inter"] + b["intra"]

  def send(self, collective: comm.SparseCollective, total: jax.Array, kept: Feedback,
           local: int, masking: bool) -> tuple[jax.Array, Feedback]:
    """After the pairs: what this worker still holds at the flagged positions summed over the
    workers by an all-reduce of those values alone and added to `total`, the residual emptied
    there (the velocity too with `masking`)."""
    hierarchical = collective.name in comm.HIERARCHICAL_ALGORITHMS
    part_len = kept.residual.shape[0]
    table = _whole_table(self.flags, part_len * (local if hierarchical else 1), local,
                         hierarchical)
    if hierarchical:
      node_axis, local_axis = collective.axes
      idx = jnp.asarray(table)[lax.axis_index(local_axis)]
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


def send_whole(flags: Any) -> SendWhole:
  """The elements `flags` marks sent whole every step beside the pairs: what a worker still
  holds there after its selection is summed by an all-reduce of those values alone (4 bytes
  each) and its memory there emptied. For small tensors whose every coordinate matters, such as
  BatchNorm's scales and biases (DGC leaves them uncompressed). Needs error feedback."""
  return SendWhole(flags)


# ----------------------------------------------------------------------------- the exchange

def _axes(algorithm: str, axis_name: Any) -> tuple[str, ...]:
  """The axes an exchange runs over: `axis_name`, by default `("node", "local")`."""
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


def _bytes_sent(collective: comm.SparseCollective, n: int, part_len: int,
                levels: tuple[float, ...], nodes: int, local: int,
                whole: SendWhole | None, corrected: bool = False) -> jax.Array:
  """float32[len(levels) + 2]: a worker's bytes sent at each level (with `whole`, its
  positions' all-reduce too), and in the dense form and its steady step."""
  algorithm = collective.name
  hierarchical = algorithm in comm.HIERARCHICAL_ALGORITHMS
  extra = 0.0 if whole is None else whole.bytes(n, nodes, local, hierarchical)
  sent = [comm.wire_bytes(algorithm, n=n, k=max(1, round(lv * part_len)), nodes=nodes,
                          local=local, wire=collective.wire) for lv in levels]
  dense, steady = (comm.wire_bytes(comm.dense_form(algorithm), n=n, nodes=nodes, local=local,
                                   wire=w) for w in (collective.wire,
                                                     comm.steady_wire(collective.wire, corrected)))
  return jnp.asarray([s["inter"] + s["intra"] + extra for s in sent]
                     + [dense["inter"] + dense["intra"], steady["inter"] + steady["intra"]],
                     jnp.float32)


def _check_pieces(collective: Any, levels: Any, feedback: Any, balance: Any,
                  whole: Any) -> None:
  """Clear errors for pieces that do not fit: wrong types, an option without the feedback it
  needs."""
  for name, value, kind in (("collective", collective, comm.SparseCollective),
                            ("levels", levels, DensitySchedule),
                            ("feedback", feedback, ErrorFeedback | None),
                            ("balance", balance, TensorBalance | None),
                            ("whole", whole, SendWhole | None)):
    if not isinstance(value, kind):
      raise ValueError(f"exchange: {name} must be a {kind}, got {value!r}")
  if collective.wire != "pairs8" and feedback is None:
    raise ValueError(f"wire {collective.wire!r} needs error feedback (each value's rounding "
                     "error is kept in the memory)")
  if whole is not None and feedback is None:
    raise ValueError("send_whole needs error feedback (the whole positions are sent from the "
                     "memory each worker keeps)")
  if balance is not None and (feedback is None
                              or isinstance(feedback.correction, AdamCorrection)):
    raise ValueError(f"tensor_balance works with error feedback, plain or with a "
                     f"MomentumCorrection, got feedback={feedback!r}")


def exchange(collective: comm.SparseCollective, levels: DensitySchedule, *,
             feedback: ErrorFeedback | None = None, selector: str | Callable = "mstopk",
             balance: TensorBalance | None = None, whole: SendWhole | None = None
             ) -> optax.GradientTransformationExtraArgs:
  """The mean of the gradient over the workers through a sparse `collective`, from pieces.

  Args:
    collective: a `comm.SparseCollective` (`comm.sparse_collective(algorithm, axes)`): where a
      worker's part comes from and how the pairs are summed.
    levels: a `density_schedule(...)`: the densities a step may run at, and which one it does.
    feedback: `error_feedback(correction)`: keep what was not sent and add it next step (None:
      no memory).
    selector: "mstopk", "exact", "sampled" or a callable `(x, k) -> (values, indices)`.
    balance: `tensor_balance(...)` or None. whole: `send_whole(...)` or None.

  Returns:
    An `optax.GradientTransformationExtraArgs` with an `ExchangeState`; its update takes the
    optional keyword `density_level` (a Python int: the level, chosen by a caller that knows
    the step, one compiled step per level; default: the schedule's, by a switch in the step).
    `init` and `update` must run where the axes are bound (inside `shard_map` or `pmap`).
  """
  _check_pieces(collective, levels, feedback, balance, whole)
  hierarchical = collective.name in comm.HIERARCHICAL_ALGORITHMS
  pieces = _Pieces(collective, feedback, topk_lib.get_selector(selector), balance, whole)

  def shapes(tree: Any) -> tuple[FlatLayout, int, int, int]:
    nodes, local = _workers(f"exchange({collective.name!r})", collective.axes)
    layout = FlatLayout.from_tree(tree, pad_to=local)
    return layout, nodes, local, layout.padded_size // local if hierarchical else layout.padded_size

  def update_fn(updates: Any, state: ExchangeState, params: Any = None, *,
                density_level: int | None = None, **extra_args: Any):
    del params, extra_args
    layout, nodes, local, part_len = shapes(updates)
    for r in jax.tree.leaves(state.feedback):
      if r.shape != (part_len,):
        raise ValueError(f"state residual has shape {r.shape}, expected ({part_len},): "
                         "was init run inside the same shard_map mesh?")
    part = collective.scatter(layout.ravel(updates, jnp.float32))

    index = levels.index(state.count, density_level)
    density = jnp.asarray(levels.levels + (1.0, 1.0), jnp.float32)[index]
    sent = _bytes_sent(collective, layout.padded_size, part_len, levels.levels, nodes, local,
                       whole, pieces.corrected)[index]

    def at(level: float | None) -> Callable:
      """This step at `level` (None: the dense form): `(part, memory) -> (total, memory)`."""
      def run(part: jax.Array, memory: Feedback | None):
        if feedback is None and level is None:  # no memory: everything, or the top k sent
          return comm.settle_dense(collective, part), None
        if feedback is None:
          values, indices = pieces.select(part, max(1, round(level * part_len)))
          kept = Feedback(part.at[indices].set(0, unique_indices=True))
          return comm.settle(collective, values, indices, kept, part_len, False)[0], None
        term, memory = feedback.candidates(part, memory, state.count,
                                           local if hierarchical else 1)
        return _send(pieces, term, memory, level, layout, local)
      return run

    def steady(part: jax.Array, memory: Feedback | None):
      """The dense form's steady step (after a dense-form step): the sum first, then the
      correction on each party's share of it (`_steady`)."""
      if feedback is None:
        return comm.settle_dense(collective, part), None
      return _steady(pieces, part, memory, state.count, local if hierarchical else 1)

    runs = [at(level) for level in levels.levels] + [at(None), steady]
    total, memory = (runs[index](part, state.feedback) if isinstance(index, int)
                     else lax.switch(index, runs[:len(levels.levels)], part, state.feedback))
    return _mean_out(total, nodes * local, layout, updates), ExchangeState(
        memory, state.count + 1, density, sent)

  def init_fn(params: Any) -> ExchangeState:
    part = shapes(params)[-1]
    return ExchangeState(None if feedback is None else feedback.init(part),
                         jnp.zeros([], jnp.int32), jnp.float32(levels.levels[0]),
                         jnp.zeros([], jnp.float32))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class _Pieces(NamedTuple):
  """An exchange's pieces, checked (`exchange`)."""

  collective: comm.SparseCollective
  feedback: ErrorFeedback | None
  select: Callable
  balance: TensorBalance | None
  whole: SendWhole | None

  @property
  def corrected(self) -> bool:
    """Whether a correction runs (the dense form's steady steps then sum float32:
    `comm.steady_wire`)."""
    return self.feedback is not None and self.feedback.correction is not None


def _send(pieces: _Pieces, term: jax.Array, memory: Feedback, level: float | None,
          layout: FlatLayout, local: int) -> tuple[jax.Array, Feedback]:
  """The candidates `term + memory.residual` sent at `level`: `(total, what is kept)`. The
  dense form (None) sums every candidate and empties the residual (in pairs4 it keeps what
  the values' rounding to bfloat16 took off: `comm.settle_dense_kept`); a level selects its k once
  (weighted with `balance`), masks the velocity where sent (with momentum masking; a reduction
  masks where it sent), sums the pairs over the workers, then sends the `whole` positions."""
  collective, part_len = pieces.collective, term.shape[0]
  if level is not None:
    k = max(1, round(level * part_len))
    weights = (None if pieces.balance is None
               else pieces.balance.weights(term + memory.residual, layout, collective))
    values, indices, residual = topk_lib.select_feedback(pieces.select, term, memory.residual,
                                                         k, weights)
    memory = memory._replace(residual=residual)
    masking = pieces.feedback.masking
    if masking and collective.reduce is None:
      memory = memory._replace(velocity=memory.velocity.at[indices].set(0,
                                                                        unique_indices=True))
    total, memory = comm.settle(collective, values, indices, memory, part_len, masking)
    if pieces.whole is not None:
      total, memory = pieces.whole.send(collective, total, memory, local, masking)
    return total, memory
  total, kept = comm.settle_dense_kept(collective, term + memory.residual)
  parties = comm.dense_parties(collective)  # (the correction's state: their mean from here)
  return total, memory._replace(
      residual=kept,
      velocity=None if memory.velocity is None else lax.pmean(memory.velocity, parties),
      second=None if memory.second is None else lax.pmean(memory.second, parties))


def _steady(pieces: _Pieces, part: jax.Array, memory: Feedback, count: jax.Array,
            scale: int) -> tuple[jax.Array, Feedback]:
  """The dense form's steady step: `part` summed over the parties first, then the correction
  run on one party's share of the sum (the parties' mean) and the result scaled back to a sum:
  momentum or Adam on the mean gradient, as plain dense runs its optimizer, and with the
  parties' states equal (a dense-form step made them the mean) they stay equal. In pairs8 the
  residual is empty after a dense-form step and is not touched (no pass over it). In pairs4
  without a correction the residual holds the last rounding errors (gradient and candidate
  are one), sent with `part` (`comm.dense_sum`) and replaced by this step's; with a correction
  the sum stays float32 (the residual holds candidates, the correction's units, and a
  gradient's rounding error would have no place in it: `comm.steady_wire`)."""
  collective = pieces.collective
  parties = comm.dense_parties(collective)
  count_parties = comm.axis_size(parties)
  if comm.steady_wire(collective.wire, pieces.corrected) == "pairs8":
    summed = lax.psum(part, parties)
  else:
    summed, kept = comm.dense_sum(part + memory.residual, parties, collective.wire)
    memory = memory._replace(residual=kept)
  share = summed / count_parties
  term, memory = pieces.feedback.candidates(share, memory, count, scale)
  return comm.gather_dense(collective, term * count_parties), memory


def topk_allreduce(density: float, *, algorithm: str = "hitopk",
                   axis_name: str | tuple[str, ...] | None = None,
                   selector: str | Callable = "mstopk", correction: Correction | None = None,
                   schedule: Callable[[jax.Array], jax.Array] | None = None
                   ) -> optax.GradientTransformation:
  """Mean of the gradient over all workers, sent as top-k (value, index) pairs with error
  feedback: `exchange(sparse_collective(algorithm, axes), density_schedule(density, schedule),
  feedback=error_feedback(correction), selector=selector)`.

  Args:
    density: fraction of each buffer sent per step, in (0, 1]; `k = max(1, round(density * L))`
      where L is the shard length (padded n / local for "hitopk" and "higtopk", padded n for
      "allgather" and "gtopk").
    algorithm: "hitopk" (HiTopKComm), "allgather" (TopK all-gather), "gtopk" (gTop-k: a
      recursive-doubling merge to k global positions, traffic growing with log2 of the workers),
      "higtopk" (HiTopKComm with gTop-k between the nodes); "hierarchical" or "dense" return the
      uncompressed baselines `hierarchical_mean` / `dense_mean`.
    axis_name: the axes the workers span, as JAX code binds them: one name
      (`jax.pmap(..., axis_name="batch")`, a 1-D mesh) or a tuple of names for "dense",
      "allgather" and "gtopk"; two names (slow inter-node, fast intra-node) for "hitopk",
      "higtopk" and "hierarchical". None (default): `("node", "local")`.
    selector: "mstopk", "exact", "sampled", or a callable `(x, k) -> (values, indices)`.
    correction: None (plain error feedback), `MomentumCorrection(momentum, nesterov=False,
      masking=True)` or `AdamCorrection(b1, b2, eps)` (`sparsejax.feedback`). A momentum
      correction (DGC, Lin et al. 2018) accumulates each worker's momentum BEFORE the selection,
      so the mean already carries it: chain an optimizer WITHOUT momentum (`optax.sgd(lr)`);
      its `masking` (DGC's momentum factor masking) zeroes the velocity where sent, False lets
      it run on. An Adam correction runs the worker's Adam moments before the selection (the
      candidates are Adam directions): chain an SGD without momentum whose weight decay is
      AdamW's.
    schedule: optional optax schedule `count -> density` (DGC's warm-up: start dense and decay
      to `density`), rounded up to `density_levels(density, schedule(0))` each step (a
      `lax.switch` over the levels; a caller that knows the step picks the level on the host
      instead: `update(..., density_level=level_index(density_levels(density, schedule(0)),
      schedule(step)))`, one compiled step per level, what sparsejax's trainer does).

  Returns:
    An `optax.GradientTransformationExtraArgs` with an `ExchangeState` (see `exchange`).

  Example:
    >>> tx = optax.chain(topk_allreduce(0.001), optax.sgd(0.1, momentum=0.9))
    >>> # inside shard_map(..., mesh=Mesh(devices.reshape(2, 4), ("node", "local"))):
    >>> #   updates, state = tx.update(grads, state, params)
    >>> tx = optax.chain(topk_allreduce(0.01, algorithm="allgather", axis_name="batch"),
    ...                  optax.sgd(0.1, momentum=0.9))
    >>> # inside jax.pmap(..., axis_name="batch"): the same calls
  """
  levels = density_schedule(density, schedule)
  feedback = error_feedback(correction)
  axes = _axes(algorithm, axis_name)
  if algorithm in comm.SPARSE_ALGORITHMS:
    return exchange(comm.sparse_collective(algorithm, axes), levels, feedback=feedback,
                    selector=selector)
  if correction is not None:
    raise ValueError(f"a correction ({correction!r}) needs a sparse algorithm "
                     f"{comm.SPARSE_ALGORITHMS}, got algorithm={algorithm!r}; otherwise use the "
                     "optimizer's momentum")
  topk_lib.get_selector(selector)
  return dense_mean(axes) if algorithm == "dense" else hierarchical_mean(*axes)
