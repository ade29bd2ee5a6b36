"""Collectives for data-parallel gradients, called inside `shard_map` or `pmap` over named axes.

The flat collectives (dense, TopK all-gather) run over one axis name or a tuple of names, as JAX
code binds them (`pmap(axis_name="batch")`, a 1-D `("data",)` mesh, or several mesh axes). The
hierarchical ones take two: a slow `node` axis (the network between machines) and a fast `local`
axis (links inside a machine). Every function takes axis names, never devices, and returns the SUM
over all workers, identical on every worker. The sparse ones are also given in two halves around
the selection (`SparseCollective`: `sparse_allgather`, `sparse_hitopk`, `sparse_gtopk`,
`sparse_higtopk`), so that selection and error feedback (`sparsejax.feedback`) stay separate
pieces; `topk_allgather`, `hitopk_allreduce`, `gtopk_allreduce` and `higtopk_allreduce` compose
them with the error-feedback piece and one selection, and also return what was not sent (a
`Feedback`).

  dense_allreduce          psum over all axes (a flat ring: every byte crosses the network)
  hierarchical_allreduce   reduce-scatter local, all-reduce node, all-gather local
  topk_allgather           select k, all-gather (values, indices) over all axes, scatter-add:
                           each worker receives 2k(P-1) values
  hitopk_allreduce         HiTopKComm: reduce-scatter local, select k of the shard, all-gather the
                           pairs over node (the only inter-node traffic), all-gather local
  gtopk_allreduce          gTop-k: select k, merge the pairs by recursive doubling (log2 P rounds
                           of k pairs, each keeping the k largest sums) into one global set of k
                           positions, then the sum there of what the workers selected (a psum
                           of k values): about 2k log2 P + 2k values per worker
  higtopk_allreduce        HiTopKComm with gTop-k between the nodes
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from sparsejax import cpu_kernels
from sparsejax import topk as topk_lib
from sparsejax import wire as wire_lib
from sparsejax.feedback import (
  Correction,
  Feedback,
  MomentumCorrection,
  check_feedback,
  error_feedback,
)

__all__ = ["dense_allreduce", "hierarchical_allreduce", "SparseCollective", "sparse_allgather",
           "sparse_hitopk", "sparse_gtopk", "sparse_higtopk", "sparse_collective",
           "topk_allgather",
           "hitopk_allreduce", "gtopk_allreduce", "higtopk_allreduce", "gtopk_positions",
           "gtopk_sums", "merge_top", "gtopk_settle", "gather_pairs", "scatter_pairs",
           "settle", "settle_dense", "settle_dense_kept", "dense_sum",
           "dense_parties", "gather_dense", "dense_form", "wire_bytes", "steady_wire",
           "denser_than_dense",
           "axis_size", "axis_names",
           "ALGORITHMS", "SPARSE_ALGORITHMS", "HIERARCHICAL_ALGORITHMS"]

ALGORITHMS = ("dense", "hierarchical", "allgather", "hitopk", "gtopk", "higtopk")
# the ones that select top-k (and keep a residual)
SPARSE_ALGORITHMS = ("allgather", "hitopk", "gtopk", "higtopk")
# the ones over two axes (slow, fast)
HIERARCHICAL_ALGORITHMS = ("hierarchical", "hitopk", "higtopk")


def axis_names(algorithm: str, axes: str | Sequence[str]) -> tuple[str, ...]:
  """The axis names `algorithm` runs over, checked: one name or several for the flat algorithms
  (dense, allgather), exactly two (slow, fast) for the hierarchical ones (hierarchical, hitopk)."""
  if algorithm not in ALGORITHMS:
    raise ValueError(f"unknown algorithm {algorithm!r}; allowed: {list(ALGORITHMS)}")
  names = (axes,) if isinstance(axes, str) else axes
  if (not isinstance(names, tuple | list) or not names
      or not all(isinstance(a, str) and a for a in names)):
    raise ValueError(f"mesh axes must be an axis name or a tuple of axis names, got {axes!r}")
  names = tuple(names)
  if len(set(names)) != len(names):
    raise ValueError(f"mesh axes must be distinct, got {names}")
  if algorithm in HIERARCHICAL_ALGORITHMS and len(names) != 2:
    raise ValueError(f"algorithm {algorithm!r} needs two mesh axes (slow inter-node, fast "
                     f"intra-node), got {names}; over one axis (jax.pmap, a 1-D mesh) use "
                     f"'allgather' (sparse) or 'dense'")
  return names


def axis_size(name: str | Sequence[str]) -> int:
  """Size of a bound axis (or the product over several); a clear error where it is not bound."""
  if name is None or (not isinstance(name, str) and not all(isinstance(a, str) for a in name)):
    raise ValueError(f"an axis name (a str) or a tuple of them is needed, got {name!r}")
  names = (name,) if isinstance(name, str) else tuple(name)
  size = 1
  for a in names:
    try:
      size *= lax.axis_size(a)
    except NameError as e:
      raise ValueError(f"axis {a!r} is not bound: call this inside jax.shard_map over a mesh "
                       f"that has an axis named {a!r}, or inside jax.pmap(..., "
                       f"axis_name={a!r})") from e
  return size


def _check_1d(x: jax.Array, what: str) -> int:
  if jnp.ndim(x) != 1:
    raise ValueError(f"{what} expects a 1-D buffer, got shape {jnp.shape(x)}; ravel the gradient "
                     "with sparsejax.flat.FlatLayout first")
  return x.shape[0]


def _check_divisible(n: int, m: int, local_axis: str) -> None:
  if n % m:
    raise ValueError(f"buffer length {n} is not a multiple of the {local_axis!r} axis size {m}; "
                     f"pad it (FlatLayout.from_tree(tree, pad_to={m}))")


def dense_allreduce(x: jax.Array, *, axes: str | Sequence[str]) -> jax.Array:
  """Sum of `x` over `axes` (one all-reduce)."""
  axis_size(axes)
  return lax.psum(x, axes if isinstance(axes, str) else tuple(axes))


def hierarchical_allreduce(x: jax.Array, *, node_axis: str, local_axis: str) -> jax.Array:
  """Sum of 1-D `x` over both axes: reduce-scatter over `local_axis`, all-reduce of the shard
  over `node_axis`, all-gather over `local_axis`. len(x) must be a multiple of the local size."""
  n = _check_1d(x, "hierarchical_allreduce")
  m = axis_size(local_axis)
  axis_size(node_axis)
  _check_divisible(n, m, local_axis)
  shard = _reduce_scatter(x, local_axis, m)
  shard = lax.psum(shard, node_axis)
  return _all_gather(shard, local_axis, m)


def _reduce_scatter(x: jax.Array, axis: str, size: int) -> jax.Array:
  """This worker's shard of the sum of `x` over `axis`; over one worker `x` itself (XLA:CPU
  copies the whole buffer for a collective over one device)."""
  return x if size == 1 else lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)


def _all_gather(x: jax.Array, axis: str | tuple[str, ...], size: int) -> jax.Array:
  """The workers' `x` over `axis`, concatenated; over one worker `x` itself."""
  return x if size == 1 else lax.all_gather(x, axis, axis=0, tiled=True)


def _pack(values: jax.Array, indices: jax.Array) -> jax.Array | None:
  """(values, indices) as one int32[2, k] buffer (float32 values bitcast), so that a pair set
  moves in ONE collective (each has a fixed latency); None for other value dtypes."""
  if values.dtype != jnp.float32 or indices.dtype != jnp.int32:
    return None
  return jnp.stack([lax.bitcast_convert_type(values, jnp.int32), indices])


def _unpack(both: jax.Array) -> tuple[jax.Array, jax.Array]:
  return lax.bitcast_convert_type(both[0], jnp.float32), both[1]


def gather_pairs(values: jax.Array, indices: jax.Array, axes
                 ) -> tuple[jax.Array, jax.Array]:
  """Every worker's k (value, index) pairs over `axes`, concatenated (P*k of each): TopK
  all-gather's network part, one all-gather."""
  size = axis_size(axes)
  both = _pack(values, indices)
  if both is None:
    return _all_gather(values, axes, size), _all_gather(indices, axes, size)
  return _unpack(_all_gather(both, axes, size).reshape(size, 2, -1).transpose(1, 0, 2)
                 .reshape(2, -1))


def _gather_sum(values, indices, n: int, axes) -> jax.Array:
  """Dense length-n sum of every worker's (values, indices) pairs gathered over `axes`."""
  return scatter_pairs(*gather_pairs(values, indices, axes), n)


def scatter_pairs(all_v: jax.Array, all_i: jax.Array, n: int) -> jax.Array:
  """The dense length-n sum of (value, index) pairs (a position may repeat); indices outside
  [0, n) are dropped. TopK all-gather's local part, after `gather_pairs`."""
  def xla(all_v, all_i):  # indices outside [0, n) dropped, negative ones too (as the kernel)
    return jnp.zeros(n, all_v.dtype).at[all_i].add(all_v, mode="drop",
                                                    wrap_negative_indices=False)

  if all_v.dtype == jnp.float32 and cpu_kernels.enabled():
    # On CPU one kernel: the zeros and the adds, in the order gathered (as XLA's scatter).
    return lax.platform_dependent(all_v, all_i, default=xla,
                                  cpu=lambda v, i: cpu_kernels.scatter_add(v, i, n))
  return xla(all_v, all_i)


class SparseCollective(NamedTuple):
  """A sparse collective, cut around the selection so that selection and error feedback are
  separate pieces (see `sparsejax.compress.topk_allreduce`; `settle` runs the second half).

  name: the algorithm (one of SPARSE_ALGORITHMS; what `wire_bytes` counts).
  axes: the axis names it runs over (the last one is the axis the buffer is padded for).
  scatter: `x (n,) -> part`: what this worker selects from (x itself for the flat algorithms,
    this worker's shard of its node's sum for the hierarchical ones).
  gather: `(values, indices, len(part)) -> total (n,)`: the SUM over all workers of every
    worker's pairs, identical on every worker; what a worker selected is what it sent.
  reduce: instead of `gather`, for a collective that decides over all workers which positions
    are sent (gTop-k): `(values, indices, kept, len(part), masking) -> (total, kept)`, where
    `kept` is the memory after the selection (the candidates with the selected values zeroed;
    its velocity NOT masked: the selection is not what is sent) and the returned one
    keeps exactly what was not sent, the velocity zeroed where sent with `masking`.
  wire: the pairs' wire format (`sparsejax.wire`): "pairs8", or "pairs4" (a `reduce` that
    keeps each value's bfloat16 rounding error in the memory).
  """

  name: str
  axes: tuple[str, ...]
  scatter: Callable[[jax.Array], jax.Array]
  gather: Callable[[jax.Array, jax.Array, int], jax.Array] | None
  reduce: Callable[..., tuple[jax.Array, Feedback]] | None = None
  wire: str = "pairs8"


def settle(collective: SparseCollective, values: jax.Array, indices: jax.Array,
           kept: Feedback, length: int, masking: bool) -> tuple[jax.Array, Feedback]:
  """The exchange after the selection: `(total, kept)`, the sum over all workers of what was
  sent and this worker's memory of what it did not send."""
  if collective.reduce is None:
    return collective.gather(values, indices, length), kept
  return collective.reduce(values, indices, kept, length, masking)


def settle_dense(collective: SparseCollective, part: jax.Array) -> jax.Array:
  """The dense form of the exchange after the selection: every value of every worker's `part`
  summed (n,), identical on every worker, by all-reduce instead of (value, index) pairs: over
  all axes for the flat algorithms; over `node_axis` and then gathered over `local_axis` for
  the hierarchical ones (`part` is the worker's shard of its node's sum, as `scatter` gave it).
  Its bytes are `wire_bytes(dense_form(collective.name), ...)`."""
  return gather_dense(collective, lax.psum(part, dense_parties(collective)))


def settle_dense_kept(collective: SparseCollective, part: jax.Array
                      ) -> tuple[jax.Array, jax.Array]:
  """`settle_dense` in the collective's wire: `(total, kept)`. In pairs8 the values cross as
  float32 and nothing is kept (zeros); in pairs4 they cross the dense parties as bfloat16
  (`dense_sum`) and `kept` (part's length) is what the rounding took off this worker's values
  and, where it owns the sum, the sum's: the total plus every worker's `kept` is the sum of the
  parts. Its bytes are `wire_bytes(dense_form(collective.name), ..., wire=collective.wire)`."""
  summed, kept = dense_sum(part, dense_parties(collective), collective.wire)
  return gather_dense(collective, summed), kept


def dense_sum(x: jax.Array, parties: tuple[str, ...], wire: str = "pairs8"
              ) -> tuple[jax.Array, jax.Array]:
  """The sum of 1-D float32 `x` over `parties` and what this worker keeps of it: `(sum, kept)`.

  pairs8: one float32 all-reduce, nothing kept (zeros). pairs4: the values on the wire as
  bfloat16, summed exactly in float32: each worker rounds its `x` (keeping the error), sends
  chunk j of the rounded values to worker j (an all-to-all), worker j sums its chunk in float32,
  rounds the sum (keeping that error at the chunk's positions) and the rounded chunks are
  all-gathered: 4 (G-1)/G bytes a value per worker against float32's ring all-reduce's 8 (G-1)/G,
  and `sum + kept summed over the parties` is the sum of `x` (each rounding error stays with
  the worker that made it, to be sent next step). Over one worker, `(x, 0)`."""
  n, size = _check_1d(x, "dense_sum"), axis_size(parties)
  if wire_lib.check_wire(wire) == "pairs8":
    return lax.psum(x, parties), jnp.zeros_like(x)
  if size == 1:
    return x, jnp.zeros_like(x)
  sent, kept = wire_lib.round_values(x)
  chunk = -(-n // size)
  # (on the wire as uint16 bits: XLA:CPU carries a bfloat16 collective as float32)
  bits = lambda v: lax.bitcast_convert_type(v.astype(jnp.bfloat16), jnp.uint16)  # noqa: E731
  value = lambda b: lax.bitcast_convert_type(b, jnp.bfloat16).astype(jnp.float32)  # noqa: E731
  rows = jnp.pad(bits(sent), (0, chunk * size - n)).reshape(size, chunk)
  mine = lax.all_to_all(rows, parties, 0, 0)  # row i: worker i's values of my chunk
  exact = value(mine).sum(0)
  rounded, error = wire_lib.round_values(exact)
  owner = lax.axis_index(parties) * chunk
  kept = jnp.pad(kept, (0, chunk * size - n))
  kept = lax.dynamic_update_slice(kept, lax.dynamic_slice(kept, (owner,), (chunk,)) + error,
                                  (owner,))
  total = value(_all_gather(bits(rounded), parties, size))
  return total[:n], kept[:n]


def dense_parties(collective: SparseCollective) -> tuple[str, ...]:
  """The axes whose workers' parts `settle_dense` sums at each position: the node axis for the
  hierarchical algorithms (a worker's part is its shard of its node's sum), else every axis."""
  if collective.name in HIERARCHICAL_ALGORITHMS:
    return (collective.axes[0],)
  return tuple(collective.axes)


def gather_dense(collective: SparseCollective, summed: jax.Array) -> jax.Array:
  """The whole buffer (n,) from a part summed over `dense_parties`: gathered over the local
  axis for the hierarchical algorithms, as it is for the flat ones."""
  if collective.name in HIERARCHICAL_ALGORITHMS:
    local_axis = collective.axes[1]
    return _all_gather(summed, local_axis, axis_size(local_axis))
  return summed


def dense_form(algorithm: str) -> str:
  """The uncompressed algorithm with the same shape as `algorithm`: "hierarchical" for the
  hierarchical ones, "dense" for the flat ones."""
  return "hierarchical" if algorithm in HIERARCHICAL_ALGORITHMS else "dense"


def _whole(names: str | tuple[str, ...], what: str) -> Callable[[jax.Array], jax.Array]:
  """The flat algorithms' scatter: the worker's whole buffer, checked (1-D, axes bound)."""
  def scatter(x: jax.Array) -> jax.Array:
    _check_1d(x, what)
    axis_size(names)
    return x
  return scatter


def _gather4_sum(values: jax.Array, indices: jax.Array, n: int, axes) -> jax.Array:
  """`_gather_sum` with the pairs on the wire as pairs4 (`sparsejax.wire`): one all-gather
  of uint32 words."""
  size = axis_size(axes)
  words = wire_lib.pack(values, indices, n)
  return scatter_pairs(*wire_lib.unpack(_all_gather(words, axes, size), values.shape[0], n), n)


def _rounded(gather: Callable[[jax.Array, jax.Array, int], jax.Array]
             ) -> Callable[..., tuple[jax.Array, Feedback]]:
  """A `reduce` that sends the pairs' values rounded to bfloat16 through `gather` (pairs4) and
  keeps each rounding error in the memory, where the value was; the velocity zeroed where
  sent with `masking`."""
  def reduce(values, indices, kept: Feedback, length: int, masking: bool):
    sent, error = wire_lib.round_values(values.astype(jnp.float32))
    residual = kept.residual.at[indices].add(error.astype(kept.residual.dtype),
                                             unique_indices=True)
    velocity = kept.velocity
    if masking and velocity is not None:
      velocity = velocity.at[indices].set(0, unique_indices=True)
    return gather(sent, indices, length), kept._replace(residual=residual, velocity=velocity)
  return reduce


def sparse_allgather(axes: str | Sequence[str], wire: str = "pairs8") -> SparseCollective:
  """TopK all-gather's collective: every worker's (value, index) pairs to every other worker
  over `axes`, scatter-added into a dense buffer; `wire`: "pairs8" or "pairs4"."""
  names = axes if isinstance(axes, str) else tuple(axes)
  gather = (_gather4_sum if wire_lib.check_wire(wire) == "pairs4" else _gather_sum)

  def total(values, indices, n):
    return gather(values, indices, n, names)

  return SparseCollective("allgather", (names,) if isinstance(names, str) else names,
                          _whole(names, "topk_allgather"),
                          None if wire == "pairs4" else total,
                          _rounded(total) if wire == "pairs4" else None, wire)


def _node_shard(node_axis: str, local_axis: str, what: str) -> Callable[[jax.Array], jax.Array]:
  """The hierarchical algorithms' scatter: this worker's shard of its node's sum (n/M values),
  by a reduce-scatter over `local_axis`."""
  def scatter(x: jax.Array) -> jax.Array:
    n = _check_1d(x, what)
    m = axis_size(local_axis)
    axis_size(node_axis)
    _check_divisible(n, m, local_axis)
    return _reduce_scatter(x, local_axis, m)
  return scatter


def sparse_hitopk(node_axis: str, local_axis: str, wire: str = "pairs8") -> SparseCollective:
  """HiTopKComm's collective (Shi et al., 2021): reduce-scatter inside a node (each worker gets
  shard i of its node's sum, length n/M), then the shard's pairs all-gathered over `node_axis`
  (the only inter-node traffic: k pairs instead of n/M values; `wire`: "pairs8" or "pairs4")
  and scatter-added, and the shards all-gathered over `local_axis`."""
  pairs = _gather4_sum if wire_lib.check_wire(wire) == "pairs4" else _gather_sum

  def gather(values: jax.Array, indices: jax.Array, length: int) -> jax.Array:
    shard_total = pairs(values, indices, length, node_axis)
    return _all_gather(shard_total, local_axis, axis_size(local_axis))

  return SparseCollective("hitopk", (node_axis, local_axis),
                          _node_shard(node_axis, local_axis, "hitopk_allreduce"),
                          None if wire == "pairs4" else gather,
                          _rounded(gather) if wire == "pairs4" else None, wire)


# ----------------------------------------------------------------------------- gTop-k

def merge_top(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array], k: int,
               length: int) -> tuple[jax.Array, jax.Array]:
  """The k pairs of largest |value| among two sets of (value, index) pairs, a position in both
  taking the sum of its two values. Index `length` marks "no pair" (value 0). The result does
  not depend on the order of `a` and `b` (both partners of a merge compute the same bits).

  Two ways, chosen by size: a sort of the 2k pairs by index (duplicates side by side) and a
  top-k of the 2k; or, where k is a thirty-second of `length` or more (the density warm-up's high
  levels), the pairs added into a dense buffer and MSTopK over it: one pass over `length`
  values instead of a comparison sort of 2k (XLA:CPU's sort of 930K pairs took a second)."""
  if 32 * k >= length:
    dense = jnp.zeros(length + 1, a[0].dtype).at[a[1]].add(a[0]).at[b[1]].add(b[0])[:length]
    return topk_lib.mstopk(dense, k)
  indices, values = lax.sort((jnp.concatenate([a[1], b[1]]), jnp.concatenate([a[0], b[0]])),
                             num_keys=1)
  same_next = jnp.concatenate([indices[1:] == indices[:-1], jnp.zeros(1, bool)])
  same_prev = jnp.concatenate([jnp.zeros(1, bool), indices[1:] == indices[:-1]])
  # a position in both sets: the first copy takes the sum, the second becomes "no pair"
  values = jnp.where(same_prev, jnp.zeros_like(values),
                     values + jnp.where(same_next, jnp.roll(values, -1), jnp.zeros_like(values)))
  indices = jnp.where(same_prev, length, indices)
  _, top = lax.top_k(jnp.abs(values), k)
  return values[top], indices[top]


def _swap(pairs: tuple[jax.Array, jax.Array], axes, d: int, q: int, p: int,
          rank: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The pairs of the partner `rank ^ d` (among the first `q` of `p` workers), as one
  collective of (values, indices) packed together where they pack (`_pack`).

  With `p` even: an all-gather over the groups {s, s ^ d} (the `p - q` extra workers, idle in
  this round, paired among themselves: their exchange is wasted traffic on their own links, the
  price of all-gather groups of one size). Not a `ppermute`, because on XLA:CPU's gloo a swap is
  half duplex (the two directions of one pair take turns: 2x one direction's time on a
  link-bound cluster) while a two-worker all-gather overlaps them (about 1.3-1.5x; both
  measured on the emulated cluster). All-gather groups must have one size and cover every
  worker, so with `p` odd the swap is a `ppermute`."""
  both = _pack(*pairs)
  if p % 2:
    perm = [(s, s ^ d) for s in range(q)]
    return lax.ppermute(pairs, axes, perm) if both is None else _unpack(
        lax.ppermute(both, axes, perm))
  groups = [[s, s ^ d] for s in range(q) if not s & d] + [[e, e + 1] for e in range(q, p, 2)]
  upper = (rank & d) != 0  # this worker's place in its group; the partner has the other
  if both is None:
    return tuple(jnp.where(upper, g[0], g[1]) for g in
                 (lax.all_gather(x, axes, axis_index_groups=groups) for x in pairs))
  got = lax.all_gather(both, axes, axis_index_groups=groups)
  return _unpack(jnp.where(upper, got[0], got[1]))


def gtopk_positions(values: jax.Array, indices: jax.Array, length: int,
                    axes: str | tuple[str, ...]) -> jax.Array:
  """gTop-k's global selection (Shi et al., ICDCS 2019): int32[k] positions, the same on every
  worker of `axes`, from each worker's k (value, index) pairs, by recursive doubling: in round r
  each worker swaps its current k pairs with the worker 2^r away and keeps the k largest sums
  (`merge_top`), log2(P) rounds of k pairs. With P not a power of two, the P - Q workers past
  the largest power of two Q first hand their pairs to worker i - Q and get the result back.
  Index `length` marks a slot with no position (fewer than k distinct ones)."""
  p, k = axis_size(axes), values.shape[0]
  rank = lax.axis_index(axes)
  q = 1 << (p.bit_length() - 1)
  pairs = (values, indices)
  if p > q:  # fold the extra workers in (one way: a ppermute)
    packed = _pack(*pairs)
    fold = [(q + e, e) for e in range(p - q)]
    got = (lax.ppermute(pairs, axes, fold) if packed is None
           else _unpack(lax.ppermute(packed, axes, fold)))
    mine = rank < p - q
    pairs = merge_top(pairs, (jnp.where(mine, got[0], 0), jnp.where(mine, got[1], length)),
                       k, length)
  d = 1
  while d < q:
    pairs = merge_top(pairs, _swap(pairs, axes, d, q, p, rank), k, length)
    d <<= 1
  positions = pairs[1]
  if p > q:  # the extra workers get the result
    got = lax.ppermute(positions, axes, [(e, q + e) for e in range(p - q)])
    positions = jnp.where(rank >= q, got, positions)
  return positions


def _selected_at(values: jax.Array, indices: jax.Array, positions: jax.Array,
                 length: int) -> jax.Array:
  """This worker's selected `values` at `positions` (0 where it selected nothing, and at "no
  pair"): O(k log k), without writing a whole buffer; where k is a thirty-second of the buffer
  or more (as `merge_top`), a buffer written once instead of a comparison sort of k."""
  if 32 * indices.shape[0] >= length:
    whole = jnp.zeros(length + 1, values.dtype).at[indices].set(values, unique_indices=True)
    return whole[positions]
  order = jnp.argsort(indices)
  mine, vals = indices[order], values[order]
  at = jnp.clip(jnp.searchsorted(mine, positions), 0, mine.shape[0] - 1)
  return jnp.where(mine[at] == positions, vals[at], jnp.zeros_like(vals[at]))


def gtopk_sums(values: jax.Array, indices: jax.Array, length: int,
               axes: str | tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
  """gTop-k's network part: `(positions, sums)`, the k global positions (`gtopk_positions`)
  and at each the sum of the values the workers that selected it sent (one psum of k values).
  A worker that did not select a position sends nothing there and keeps its candidate, as in
  Shi et al. (summing every worker's candidate there, the rule until 2026-12, needed 2.3x /
  2.8x all-gather's steps to the target at 8 / 16 workers, `studies/worker_scaling`)."""
  positions = gtopk_positions(values, indices, length, axes)
  return positions, lax.psum(_selected_at(values, indices, positions, length), axes)


def gtopk_settle(values: jax.Array, indices: jax.Array, kept: Feedback, positions: jax.Array,
                 sums: jax.Array, length: int, masking: bool) -> tuple[jax.Array, Feedback]:
  """gTop-k's local part, after `gtopk_sums`: `(total, memory)`, the dense sum (length
  `length`, `sums` at `positions`) and this worker's memory: `kept` (its residual after the
  selection) with the values it selected and a merge dropped put back, so that only what it
  sent leaves it (nothing is lost or sent twice); with `masking` the velocity is zeroed where
  it sent."""
  total = jnp.zeros(length, values.dtype).at[positions].set(sums.astype(values.dtype),
                                                            mode="drop")
  sent = jnp.zeros(length + 1, bool).at[positions].set(True)[indices]
  residual = kept.residual.at[indices].set(
      jnp.where(sent, 0, values).astype(kept.residual.dtype), unique_indices=True)
  velocity = kept.velocity
  if masking and velocity is not None:
    velocity = velocity.at[jnp.where(sent, indices, length)].set(0, mode="drop")
  return total, kept._replace(residual=residual, velocity=velocity)


def _gtopk_reduce(axes: str | tuple[str, ...]) -> Callable[..., tuple[jax.Array, Feedback]]:
  """gTop-k's exchange after the selection: `gtopk_sums` (network), `gtopk_settle` (local)."""
  def reduce(values, indices, kept: Feedback, length: int, masking: bool):
    positions, sums = gtopk_sums(values, indices, length, axes)
    return gtopk_settle(values, indices, kept, positions, sums, length, masking)
  return reduce


def sparse_gtopk(axes: str | Sequence[str]) -> SparseCollective:
  """gTop-k's collective over `axes` (any axis or tuple of axes): every worker offers its k
  pairs, `gtopk_positions` merges them into k global positions, and the values the workers
  selected there are summed (`_gtopk_reduce`)."""
  names = axes if isinstance(axes, str) else tuple(axes)
  return SparseCollective("gtopk", (names,) if isinstance(names, str) else names,
                          _whole(names, "gtopk_allreduce"), None, _gtopk_reduce(names))


def sparse_higtopk(node_axis: str, local_axis: str) -> SparseCollective:
  """HiTopKComm with gTop-k between the nodes: reduce-scatter inside a node, gTop-k of the
  shard's pairs over `node_axis` (about 2k log2 N + 2k values per worker instead of HiTopKComm's
  2k(N-1)), all-gather of the shards over `local_axis`."""
  inter = _gtopk_reduce(node_axis)

  def reduce(values, indices, kept: Feedback, length: int, masking: bool):
    shard_total, kept = inter(values, indices, kept, length, masking)
    return _all_gather(shard_total, local_axis, axis_size(local_axis)), kept

  return SparseCollective("higtopk", (node_axis, local_axis),
                          _node_shard(node_axis, local_axis, "higtopk_allreduce"), None, reduce)


WIRE_ALGORITHMS = ("allgather", "hitopk")  # the ones whose pairs may travel as pairs4


def sparse_collective(algorithm: str, axes: str | Sequence[str],
                      wire: str = "pairs8") -> SparseCollective:
  """The `SparseCollective` of a sparse algorithm over its axes (checked by `axis_names`), its
  pairs in the `wire` format ("pairs4": TopK all-gather and HiTopKComm only)."""
  names = axis_names(algorithm, axes)
  if algorithm not in SPARSE_ALGORITHMS:
    raise ValueError(f"{algorithm!r} is not a sparse algorithm; allowed: {list(SPARSE_ALGORITHMS)}")
  if wire_lib.check_wire(wire) != "pairs8" and algorithm not in WIRE_ALGORITHMS:
    raise ValueError(f"wire {wire!r} is for {', '.join(WIRE_ALGORITHMS)}, got {algorithm!r} "
                     "(its merges add values on the way: pairs8)")
  return {"allgather": lambda: sparse_allgather(names, wire),
          "gtopk": lambda: sparse_gtopk(names),
          "hitopk": lambda: sparse_hitopk(*names, wire),
          "higtopk": lambda: sparse_higtopk(*names)}[algorithm]()


def _sparse_allreduce(collective: SparseCollective, x: jax.Array, k: int,
                      residual: Feedback | None, select, correction: Correction | None
                      ) -> tuple[jax.Array, Feedback]:
  """`collective` around one selection of k: with `residual`, error feedback under
  `correction` (plain without); returns `(total, what this worker keeps)`."""
  part = collective.scatter(x)
  topk_lib.check_k(part, k)
  feedback = error_feedback(correction)
  momentum = correction.momentum if isinstance(correction, MomentumCorrection) else 0.0
  check_feedback(residual, part.shape[0], momentum)
  if residual is None:
    if correction is not None:
      raise ValueError(f"a correction ({correction!r}) needs residual=Feedback(...)")
    values, indices = topk_lib.get_selector(select)(part, k)
    kept = Feedback(part.at[indices].set(0, unique_indices=True))
    return settle(collective, values, indices, kept, part.shape[0], False)
  term, memory = feedback.candidates(part, residual)
  values, indices, kept = topk_lib.select_feedback(select, term, memory.residual, k)
  memory = memory._replace(residual=kept)
  if feedback.masking and collective.reduce is None:
    memory = memory._replace(velocity=memory.velocity.at[indices].set(0, unique_indices=True))
  return settle(collective, values, indices, memory, part.shape[0], feedback.masking)


def topk_allgather(x: jax.Array, k: int, *, axes: str | Sequence[str],
                   residual: Feedback | None = None, select=topk_lib.mstopk,
                   correction: Correction | None = None) -> tuple[jax.Array, Feedback]:
  """TopK all-gather: each worker sends its k largest |x + residual| to every other worker
  (the error-feedback piece and one selection, then `sparse_allgather(axes)`).

  Args:
    x: this worker's 1-D buffer, length n.
    k: pairs each worker sends, 1 <= k <= n.
    axes: mesh axis name(s) the workers span.
    residual: error feedback from the last step, a `Feedback` of shape (n,) buffers (a velocity
      too with momentum correction), or None.
    select: a selector `(x, k) -> (values, indices)` or its name ("mstopk", "exact", "sampled").
    correction: None or a `MomentumCorrection` (needs a velocity in `residual`).

  Returns:
    `(total, new_residual)`: `total` (n,) is the sum over workers of what each sent, identical on
    every worker; `new_residual` a `Feedback` with `residual = (x + residual) - sent`.
  """
  return _sparse_allreduce(sparse_allgather(axes), x, k, residual, select, correction)


def hitopk_allreduce(x: jax.Array, k: int, *, node_axis: str, local_axis: str,
                     residual: Feedback | None = None, select=topk_lib.mstopk,
                     correction: Correction | None = None) -> tuple[jax.Array, Feedback]:
  """HiTopKComm (Shi et al., 2021): dense inside a node, sparse between nodes
  (`sparse_hitopk(node_axis, local_axis)` around one selection).

  Args:
    x: this worker's 1-D buffer, length n, a multiple of the local axis size M.
    k: pairs sent per shard, 1 <= k <= n/M.
    node_axis, local_axis: mesh axis names.
    residual: error feedback for this worker's shard, a `Feedback` of shape (n/M,) buffers.
    select: selector or its name.
    correction: None or a `MomentumCorrection` of the shard (of the node's summed gradient: the
      sum of the workers' momenta is the momentum of their sum, so one velocity per shard is
      exact).

  Returns:
    `(total, new_residual)`: `total` (n,) the sum over all workers of what was sent, identical on
    every worker; `new_residual` (n/M,) what this worker's shard kept back.
  """
  return _sparse_allreduce(sparse_hitopk(node_axis, local_axis), x, k, residual, select,
                           correction)


def gtopk_allreduce(x: jax.Array, k: int, *, axes: str | Sequence[str],
                    residual: Feedback | None = None, select=topk_lib.mstopk,
                    correction: Correction | None = None) -> tuple[jax.Array, Feedback]:
  """gTop-k (Shi et al., ICDCS 2019): each worker selects its k largest |x + residual|, the
  pairs are merged by recursive doubling into k positions common to all workers, and at those
  positions the values the workers selected are summed (a psum of k values). Traffic per worker
  grows with log2 P (TopK all-gather's with P). Arguments as `topk_allgather`; with a masking
  `MomentumCorrection` the velocity is zeroed where this worker sent (not where it selected and
  a merge dropped: that value is still to be sent).

  Returns:
    `(total, new_residual)`: `total` (n,) at the k global positions the sum of what the workers
    selected there (zero elsewhere), identical on every worker; `new_residual` this worker's
    candidates less what it sent (what it did not select, or selected and the merge dropped,
    stays in it).
  """
  return _sparse_allreduce(sparse_gtopk(axes), x, k, residual, select, correction)


def higtopk_allreduce(x: jax.Array, k: int, *, node_axis: str, local_axis: str,
                      residual: Feedback | None = None, select=topk_lib.mstopk,
                      correction: Correction | None = None) -> tuple[jax.Array, Feedback]:
  """HiTopKComm with gTop-k between the nodes (`sparse_higtopk`); arguments and results as
  `hitopk_allreduce` (k per shard, the residual per shard)."""
  return _sparse_allreduce(sparse_higtopk(node_axis, local_axis), x, k, residual, select,
                           correction)


def wire_bytes(algorithm: str, *, n: int, k: int = 0, nodes: int, local: int,
               wire: str = "pairs8") -> dict[str, float]:
  """Bytes each worker sends per step over inter-node and intra-node links.

  Ring formulas per collective over a group of G workers and a buffer of B bytes: all-reduce
  2(G-1)/G * B, reduce-scatter (G-1)/G * B, all-gather (G-1) * B_piece. A collective whose group
  spans nodes counts as inter-node (XLA's rings are not node-aware), one inside a node as
  intra-node. `k` is per worker for the flat sparse algorithms and per shard for the
  hierarchical ones. gTop-k: k pairs to the partner per round (log2 Q rounds, Q the largest
  power of two <= the group), the positions handed back to the P - Q extra workers, and an
  all-reduce of k values: worker 0's bytes (with P even and not a power of two an extra worker
  sends a little more: the fold's k pairs and the wasted swaps of `_swap`). `wire`: the pairs'
  format (`sparsejax.wire.bytes_per_worker`: pairs8, 8 bytes a pair; pairs4, 4 bytes a pair and
  a count per 2^16-position block of the buffer the indices point into), and for the dense
  forms (dense, hierarchical) the values' across their parties (`dense_sum`: pairs4, bfloat16).

  Returns:
    `{"inter": bytes, "intra": bytes}`.
  """
  if algorithm not in ALGORITHMS:
    raise ValueError(f"unknown algorithm {algorithm!r}; allowed: {list(ALGORITHMS)}")
  if nodes < 1 or local < 1:
    raise ValueError(f"nodes and local must be >= 1, got nodes={nodes}, local={local}")
  out = {"inter": 0.0, "intra": 0.0}

  def add(group: int, spans_nodes: bool, nbytes: float) -> None:
    if group > 1:
      out["inter" if spans_nodes else "intra"] += nbytes

  p, value_bytes, index_bytes = nodes * local, 4, 4
  length = n // local if algorithm in HIERARCHICAL_ALGORITHMS else n
  piece = sum(wire_lib.bytes_per_worker(wire, k, length))  # one worker's pairs
  summed_bytes = 2 if wire == "pairs4" else value_bytes  # the dense forms' (`dense_sum`)
  if algorithm == "dense":
    add(p, nodes > 1, 2 * (p - 1) / p * n * summed_bytes)
  elif algorithm == "hierarchical":
    add(local, False, (local - 1) / local * n * value_bytes)
    add(nodes, True, 2 * (nodes - 1) / nodes * n / local * summed_bytes)
    add(local, False, (local - 1) / local * n * value_bytes)
  elif algorithm == "allgather":
    add(p, nodes > 1, (p - 1) * piece)
  elif algorithm == "gtopk":
    _gtopk_bytes(add, p, local, k, value_bytes, index_bytes)
  else:  # hitopk, higtopk
    add(local, False, (local - 1) / local * n * value_bytes)
    if algorithm == "hitopk":
      add(nodes, True, (nodes - 1) * piece)
    else:  # a gTop-k group per shard, over the nodes: every step crosses them
      _gtopk_bytes(add, nodes, 1, k, value_bytes, index_bytes)
    add(local, False, (local - 1) / local * n * value_bytes)
  return out


def steady_wire(wire: str, corrected: bool) -> str:
  """The wire of an exchange's dense form in its steady steps (`compress._steady`): `wire`
  without a correction; float32 (pairs8) with one, whose residual holds the correction's
  candidates, where a gradient's rounding error has no place."""
  return "pairs8" if corrected else wire_lib.check_wire(wire)


def denser_than_dense(algorithm: str, densities: tuple[float, ...], nodes: int, local: int,
                      wire: str = "pairs8", corrected: bool = False) -> tuple[int, ...]:
  """The indices of `densities` whose pairs in `wire` would send more bytes than the dense form
  of `algorithm` in what a dense level's steps send but for its first (`steady_wire(wire,
  corrected)`: float32 with a correction) at `nodes` x `local` workers: `wire_bytes` on a
  shard of 2^20 values (the ratio does not depend on the buffer but through k's rounding and
  pairs4's block counts). () for the dense algorithms."""
  if algorithm not in SPARSE_ALGORITHMS:
    return ()
  shard = 1 << 20
  n = shard * (local if algorithm in HIERARCHICAL_ALGORITHMS else 1)
  dense = wire_bytes(dense_form(algorithm), n=n, nodes=nodes, local=local,
                     wire=steady_wire(wire, corrected))
  out = []
  for i, d in enumerate(densities):
    pairs = wire_bytes(algorithm, n=n, k=max(1, round(d * shard)), nodes=nodes, local=local,
                       wire=wire)
    if pairs["inter"] + pairs["intra"] > dense["inter"] + dense["intra"]:
      out.append(i)
  return tuple(out)


def _gtopk_bytes(add: Callable[[int, bool, float], None], p: int, local: int, k: int,
                 value_bytes: int, index_bytes: int) -> None:
  """Bytes worker 0 of a gTop-k group of `p` (node-major, `local` per node) sends: a round's k
  pairs to worker d = 1, 2, 4, ... < Q (Q the largest power of two <= p; inter-node once
  d >= local), k indices to worker Q if p > Q, its share of the ring all-reduce of k values."""
  q = 1 << (p.bit_length() - 1)
  d = 1
  while d < q:
    add(2, d >= local, k * (value_bytes + index_bytes))
    d <<= 1
  if p > q:
    add(2, q >= local, k * index_bytes)
  add(p, p > local, 2 * (p - 1) / p * k * value_bytes)
