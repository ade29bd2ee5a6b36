"""The cost of one gradient exchange: an alpha-beta model of every algorithm of `sparsejax.comm`.

One model for the studies, the projections and (later) the choice of algorithm at run time:
`exchange_time(algorithm, n, density, cluster, wire)` returns the seconds of each part of the
exchange of an n-value float32 gradient (its pairs in `wire`'s format) on a `Cluster` (nodes x
local workers; what its links and its workers' local work cost). Every collective is what
`comm` runs:

  ring collectives    a ring all-reduce of B bytes over G workers: 2(G-1) steps of latency
                      alpha and 2(G-1)/G * B on each link; reduce-scatter (G-1) steps and
                      (G-1)/G * B; all-gather of b bytes a worker (G-1) steps and (G-1) * b.
                      With G workers a node next to each other a ring over all workers crosses
                      each node's link once each way; G rings spanning the nodes (one per local
                      rank) share it (HiTopKComm's and the hierarchical all-reduce's inter-node
                      step).
  gTop-k rounds       log2(Q) rounds (Q the largest power of two <= the group) of a pairwise
                      exchange of k (value, index) pairs and a merge of the 2k candidates; a
                      round's exchange takes `swap_factor` times one direction's transfer
                      (1: full duplex, as NCCL's send/recv; more where the transport makes the
                      two directions take turns; `odd_swap_factor` in a group of odd size, where
                      `comm` swaps by ppermute); with P > Q a fold (k pairs one way, a merge)
                      and an unfold (k indices one way); then a ring all-reduce of the k sums.

Local work: MSTopK (`select_s`), elementwise passes over the buffer (`pass_s_per_value`), pairs
scatter-added (`pair_s`). Parts are named so the network part can be told from the local one
(`NETWORK_PARTS`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from sparsejax import wire as wire_lib

__all__ = ["Cluster", "exchange_time", "network_time", "NETWORK_PARTS", "VALUE_BYTES",
           "PAIR_BYTES"]

VALUE_BYTES = 4  # float32
PAIR_BYTES = 8   # float32 value + int32 index
LOCAL_PARTS = ("select", "passes")
NETWORK_PARTS = ("allreduce", "intra_reduce_scatter", "inter_allreduce", "intra_allgather",
                 "allgather", "inter_allgather", "rounds", "fold", "unfold", "sums")


@dataclasses.dataclass(frozen=True)
class Cluster:
  """What the model needs to know about a cluster (bandwidths in bytes/s per direction)."""
  nodes: int
  local: int                 # workers per node
  inter_Bps: float           # a node's network link
  intra_Bps: float           # between workers of a node
  inter_alpha_s: float       # latency per ring step (or message) across nodes
  intra_alpha_s: float       # latency per ring step inside a node
  call_s: float              # fixed cost per collective call (dispatch, synchronisation)
  select_s: Callable[[float, int], float]  # MSTopK's seconds for (values searched, k)
  pair_s: float              # per (value, index) pair scatter-added
  pass_s_per_value: float    # one elementwise pass (read + write) over a float32 buffer
  merge_s_per_pair: float = 0.0  # gTop-k: a merge costs this per candidate pair (2k a merge)
  swap_factor: float = 1.0   # a pairwise exchange's time over one direction's transfer
  odd_swap_factor: float = 1.0  # the same in a group of odd size (comm swaps by ppermute there)
  allreduce_tree: bool = False  # all-reduces may take a tree (NCCL's choice at small sizes)
  allreduce_pipelined: bool = False  # a ring all-reduce's steps overlap (no per-step latency)


def _ring(parts: dict[str, float], cl: Cluster, name: str, group: int, spans: bool,
          steps: int, link_bytes: float, tree_bytes: float | None = None) -> None:
  """Adds a collective over `group` workers to `parts[name]` (nothing over one worker). An
  all-reduce (`tree_bytes`: what a tree puts on a link) takes a tree where the cluster allows
  and it is faster: 2 log2(G) steps instead of 2(G-1) (NCCL's trees; gloo's rings here); with
  `allreduce_pipelined` its ring's steps overlap each other (gloo's ring all-reduce sends its
  chunks in a pipeline: on the emulated cluster its time is its bytes at the link's rate)."""
  if group <= 1:
    return
  bw = cl.inter_Bps if spans else cl.intra_Bps
  alpha = cl.inter_alpha_s if spans else cl.intra_alpha_s
  if tree_bytes is not None and cl.allreduce_pipelined:
    alpha = 0.0
  seconds = steps * alpha + link_bytes / bw
  if cl.allreduce_tree and tree_bytes is not None:
    seconds = min(seconds, 2 * math.ceil(math.log2(group)) * alpha + tree_bytes / bw)
  parts[name] = parts.get(name, 0.0) + cl.call_s + seconds


def _gtopk(parts: dict[str, float], cl: Cluster, group: int, local: int, k: int,
           rings: int) -> None:
  """gTop-k over `group` workers placed `local` a node (node-major). In a round across nodes
  all `cl.local` workers of a node exchange at once over its link; the sums' all-reduce is
  `rings` rings sharing the link (1 for flat gTop-k; one per local rank for
  HiTopKComm-gTop-k)."""
  q = 1 << (group.bit_length() - 1)
  merge = cl.merge_s_per_pair * 2 * k

  def message(spans: bool, nbytes: float, factor: float = 1.0) -> float:
    bw, alpha = ((cl.inter_Bps, cl.inter_alpha_s) if spans else (cl.intra_Bps, cl.intra_alpha_s))
    return cl.call_s + alpha + factor * nbytes * (cl.local if spans else 1) / bw

  def crosses(pairs) -> bool:  # does a message of this step leave its node?
    return any(s // local != t // local for s, t in pairs)

  swap = cl.swap_factor if group % 2 == 0 else cl.odd_swap_factor
  d = 1
  while d < q:
    parts["rounds"] = parts.get("rounds", 0.0) + merge + message(
        crosses((s, s ^ d) for s in range(q)), k * PAIR_BYTES, swap)
    d <<= 1
  if group > q:
    fold = [(q + e, e) for e in range(group - q)]
    parts["fold"] = message(crosses(fold), k * PAIR_BYTES) + merge
    parts["unfold"] = message(crosses(fold), k * (PAIR_BYTES - VALUE_BYTES))
  spans = group > local
  steps = 2 * (group - 1)
  _ring(parts, dataclasses.replace(cl, inter_Bps=cl.inter_Bps / rings) if spans else cl,
        "sums", group, spans, steps, 2 * (group - 1) / group * k * VALUE_BYTES,
        2 * k * VALUE_BYTES)


def exchange_time(algorithm: str, n: int, density: float, cl: Cluster,
                  wire: str = "pairs8") -> dict[str, float]:
  """Seconds of each part of the exchange of `n` float32 values (k per worker for the flat
  algorithms, per shard of n/local for the hierarchical ones, `max(1, round(density * L))`);
  "total" their sum. `wire` (`sparsejax.wire`): the pairs' format (pairs4: 4 bytes a pair and
  a count a block, `wire.bytes_per_worker`), and for the dense forms the values' between the
  parties they sum over (pairs4: bfloat16, `comm.dense_sum`), as `comm.wire_bytes` counts."""
  N, G = cl.nodes, cl.local
  P = N * G
  S = n * VALUE_BYTES
  summed = n * (2 if wire_lib.check_wire(wire) == "pairs4" else VALUE_BYTES)
  parts: dict[str, float] = {}
  if algorithm == "dense":
    _ring(parts, cl, "allreduce", P, N > 1, 2 * (P - 1), 2 * (P - 1) / P * summed, 2 * summed)
  elif algorithm == "hierarchical":
    _ring(parts, cl, "intra_reduce_scatter", G, False, G - 1, (G - 1) / G * S)
    _ring(parts, cl, "inter_allreduce", N, True, 2 * (N - 1),
          G * 2 * (N - 1) / N * summed / G, 2 * summed)
    _ring(parts, cl, "intra_allgather", G, False, G - 1, (G - 1) / G * S)
  elif algorithm in ("allgather", "gtopk"):
    k = max(1, round(density * n))
    parts["select"] = cl.select_s(n, k)
    if algorithm == "allgather":
      _ring(parts, cl, "allgather", P, N > 1, P - 1,
            (P - 1) * sum(wire_lib.bytes_per_worker(wire, k, n)))
      # residual add, zero fill, residual update; P * k pairs scatter-added
      parts["passes"] = 3 * cl.pass_s_per_value * n + cl.pair_s * P * k
    else:
      _gtopk(parts, cl, P, G, k, 1)
      parts["passes"] = 3 * cl.pass_s_per_value * n + cl.pair_s * 2 * k
  elif algorithm in ("hitopk", "higtopk"):
    shard = n / G
    k = max(1, round(density * shard))
    _ring(parts, cl, "intra_reduce_scatter", G, False, G - 1, (G - 1) / G * S)
    parts["select"] = cl.select_s(shard, k)
    if algorithm == "hitopk":
      _ring(parts, cl, "inter_allgather", N, True, N - 1,
            G * (N - 1) * sum(wire_lib.bytes_per_worker(wire, k, n // G)))
      parts["passes"] = 3 * cl.pass_s_per_value * shard + cl.pair_s * N * k
    else:
      _gtopk(parts, cl, N, 1, k, G)
      parts["passes"] = 3 * cl.pass_s_per_value * shard + cl.pair_s * 2 * k
    _ring(parts, cl, "intra_allgather", G, False, G - 1, (G - 1) / G * S)
  else:
    raise ValueError(f"unknown algorithm {algorithm!r}; allowed: dense, hierarchical, "
                     "allgather, hitopk, gtopk, higtopk")
  parts["total"] = sum(parts.values())
  return parts


def network_time(algorithm: str, n: int, density: float, cl: Cluster,
                 wire: str = "pairs8") -> float:
  """The seconds of `exchange_time`'s network parts (its collectives, with gTop-k's merges
  between its rounds), without the local selection and passes."""
  parts = exchange_time(algorithm, n, density, cl, wire)
  return sum(v for name, v in parts.items() if name in NETWORK_PARTS)
