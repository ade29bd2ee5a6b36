"""Collectives for data-parallel gradients, called inside `shard_map` or `pmap` over named axes.

The flat collectives (dense, TopK all-gather) run over one axis name or a tuple of names, as JAX
code binds them (`pmap(axis_name="batch")`, a 1-D `("data",)` mesh, or several mesh axes). The
hierarchical ones take two: a slow `node` axis (the network between machines) and a fast `local`
axis (links inside a machine). Every function takes axis names, never devices, and returns the SUM
over all workers, identical on every worker. The sparse ones are also given in two halves around
the selection (`SparseCollective`: `sparse_allgather`, `sparse_hitopk`), so that selection and
error feedback (`sparsejax.feedback`) stay separate pieces; `topk_allgather` and
`hitopk_allreduce` compose them with `feedback_select` and also return what was not sent (a
`Feedback`).

  dense_allreduce          psum over all axes (a flat ring: every byte crosses the network)
  hierarchical_allreduce   reduce-scatter local, all-reduce node, all-gather local
  topk_allgather           select k, all-gather (values, indices) over all axes, scatter-add
  hitopk_allreduce         HiTopKComm: reduce-scatter local, select k of the shard, all-gather the
                           pairs over node (the only inter-node traffic), all-gather local
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from sparsejax import cpu_kernels
from sparsejax import topk as topk_lib
from sparsejax.feedback import Feedback, check_feedback, feedback_select

__all__ = ["dense_allreduce", "hierarchical_allreduce", "SparseCollective", "sparse_allgather",
           "sparse_hitopk", "topk_allgather", "hitopk_allreduce", "wire_bytes", "axis_size",
           "axis_names", "ALGORITHMS", "SPARSE_ALGORITHMS", "HIERARCHICAL_ALGORITHMS"]

ALGORITHMS = ("dense", "hierarchical", "allgather", "hitopk")
SPARSE_ALGORITHMS = ("allgather", "hitopk")  # the ones that select top-k (and keep a residual)
HIERARCHICAL_ALGORITHMS = ("hierarchical", "hitopk")  # the ones over two axes (slow, fast)


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


def _gather_sum(values, indices, n: int, axes) -> jax.Array:
  """Dense length-n sum of every worker's (values, indices) pairs gathered over `axes`."""
  size = axis_size(axes)
  all_v, all_i = _all_gather(values, axes, size), _all_gather(indices, axes, size)

  def xla(all_v, all_i):  # indices outside [0, n) dropped, negative ones too (as the kernel)
    return jnp.zeros(n, values.dtype).at[all_i].add(all_v, mode="drop",
                                                     wrap_negative_indices=False)

  if values.dtype == jnp.float32 and cpu_kernels.enabled():
    # On CPU one kernel: the zeros and the adds, in the order gathered (as XLA's scatter).
    return lax.platform_dependent(all_v, all_i, default=xla,
                                  cpu=lambda v, i: cpu_kernels.scatter_add(v, i, n))
  return xla(all_v, all_i)


class SparseCollective(NamedTuple):
  """A sparse collective, cut around the selection so that selection and error feedback are
  separate pieces (see `sparsejax.compress.topk_allreduce`).

  name: the algorithm ("allgather", "hitopk"; what `wire_bytes` counts).
  axes: the axis names it runs over (the last one is the axis the buffer is padded for).
  scatter: `x (n,) -> part`: what this worker selects from (x itself for TopK all-gather, this
    worker's shard of its node's sum for HiTopKComm).
  gather: `(values, indices, len(part)) -> total (n,)`: the SUM over all workers of every
    worker's pairs, identical on every worker.
  """

  name: str
  axes: tuple[str, ...]
  scatter: Callable[[jax.Array], jax.Array]
  gather: Callable[[jax.Array, jax.Array, int], jax.Array]


def sparse_allgather(axes: str | Sequence[str]) -> SparseCollective:
  """TopK all-gather's collective: every worker's (value, index) pairs to every other worker
  over `axes`, scatter-added into a dense buffer."""
  names = axes if isinstance(axes, str) else tuple(axes)

  def scatter(x: jax.Array) -> jax.Array:
    _check_1d(x, "topk_allgather")
    axis_size(names)
    return x

  return SparseCollective("allgather", (names,) if isinstance(names, str) else names, scatter,
                          lambda values, indices, n: _gather_sum(values, indices, n, names))


def sparse_hitopk(node_axis: str, local_axis: str) -> SparseCollective:
  """HiTopKComm's collective (Shi et al., 2021): reduce-scatter inside a node (each worker gets
  shard i of its node's sum, length n/M), then the shard's pairs all-gathered over `node_axis`
  (the only inter-node traffic: k pairs instead of n/M values) and scatter-added, and the shards
  all-gathered over `local_axis`."""
  def scatter(x: jax.Array) -> jax.Array:
    n = _check_1d(x, "hitopk_allreduce")
    m = axis_size(local_axis)
    axis_size(node_axis)
    _check_divisible(n, m, local_axis)
    return _reduce_scatter(x, local_axis, m)

  def gather(values: jax.Array, indices: jax.Array, length: int) -> jax.Array:
    shard_total = _gather_sum(values, indices, length, node_axis)
    return _all_gather(shard_total, local_axis, axis_size(local_axis))

  return SparseCollective("hitopk", (node_axis, local_axis), scatter, gather)


def _sparse_allreduce(collective: SparseCollective, x: jax.Array, k: int,
                      residual: Feedback | None, select, momentum: float, nesterov: bool,
                      masking: bool) -> tuple[jax.Array, Feedback]:
  part = collective.scatter(x)
  topk_lib.check_k(part, k)
  check_feedback(residual, part.shape[0], momentum)
  values, indices, new_residual = feedback_select(part, residual, k, select, momentum=momentum,
                                                  nesterov=nesterov, masking=masking)
  return collective.gather(values, indices, part.shape[0]), new_residual


def topk_allgather(x: jax.Array, k: int, *, axes: str | Sequence[str],
                   residual: Feedback | None = None,
                   select=topk_lib.mstopk, momentum: float = 0.0, nesterov: bool = False,
                   momentum_masking: bool = True) -> tuple[jax.Array, Feedback]:
  """TopK all-gather: each worker sends its k largest |x + residual| to every other worker
  (`feedback_select`, then `sparse_allgather(axes)`).

  Args:
    x: this worker's 1-D buffer, length n.
    k: pairs each worker sends, 1 <= k <= n.
    axes: mesh axis name(s) the workers span.
    residual: error feedback from the last step, a `Feedback` of shape (n,) buffers (a velocity
      too with momentum correction), or None.
    select: a selector `(x, k) -> (values, indices)` or its name ("mstopk", "exact", "sampled").
    momentum, nesterov: momentum correction (needs a velocity; 0 = none).
    momentum_masking: zero the velocity where sent (DGC's momentum factor masking).

  Returns:
    `(total, new_residual)`: `total` (n,) is the sum over workers of what each sent, identical on
    every worker; `new_residual` a `Feedback` with `residual = (x + residual) - sent`.
  """
  return _sparse_allreduce(sparse_allgather(axes), x, k, residual, select, momentum, nesterov,
                           momentum_masking)


def hitopk_allreduce(x: jax.Array, k: int, *, node_axis: str, local_axis: str,
                     residual: Feedback | None = None,
                     select=topk_lib.mstopk, momentum: float = 0.0, nesterov: bool = False,
                     momentum_masking: bool = True) -> tuple[jax.Array, Feedback]:
  """HiTopKComm (Shi et al., 2021): dense inside a node, sparse between nodes
  (`sparse_hitopk(node_axis, local_axis)` around `feedback_select`).

  Args:
    x: this worker's 1-D buffer, length n, a multiple of the local axis size M.
    k: pairs sent per shard, 1 <= k <= n/M.
    node_axis, local_axis: mesh axis names.
    residual: error feedback for this worker's shard, a `Feedback` of shape (n/M,) buffers.
    select: selector or its name.
    momentum, nesterov: momentum correction of the shard (of the node's summed gradient: the
      sum of the workers' momenta is the momentum of their sum, so one velocity per shard is exact).
    momentum_masking: zero the velocity where sent (DGC's momentum factor masking).

  Returns:
    `(total, new_residual)`: `total` (n,) the sum over all workers of what was sent, identical on
    every worker; `new_residual` (n/M,) what this worker's shard kept back.
  """
  return _sparse_allreduce(sparse_hitopk(node_axis, local_axis), x, k, residual, select,
                           momentum, nesterov, momentum_masking)


def wire_bytes(algorithm: str, *, n: int, k: int = 0, nodes: int, local: int,
               value_bytes: int = 4, index_bytes: int = 4) -> dict[str, float]:
  """Bytes each worker sends per step over inter-node and intra-node links.

  Ring formulas per collective over a group of G workers and a buffer of B bytes: all-reduce
  2(G-1)/G * B, reduce-scatter (G-1)/G * B, all-gather (G-1) * B_piece. A collective whose group
  spans nodes counts as inter-node (XLA's rings are not node-aware), one inside a node as
  intra-node. `k` is per worker for "allgather" and per shard for "hitopk".

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

  p, pair = nodes * local, value_bytes + index_bytes
  if algorithm == "dense":
    add(p, nodes > 1, 2 * (p - 1) / p * n * value_bytes)
  elif algorithm == "hierarchical":
    add(local, False, (local - 1) / local * n * value_bytes)
    add(nodes, True, 2 * (nodes - 1) / nodes * n / local * value_bytes)
    add(local, False, (local - 1) / local * n * value_bytes)
  elif algorithm == "allgather":
    add(p, nodes > 1, (p - 1) * k * pair)
  else:  # hitopk
    add(local, False, (local - 1) / local * n * value_bytes)
    add(nodes, True, (nodes - 1) * k * pair)
    add(local, False, (local - 1) / local * n * value_bytes)
  return out
