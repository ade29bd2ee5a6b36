"""sparsejax.cost: the exchange model against the library's own byte accounting
(`comm.wire_bytes`) and hand-counted gTop-k rounds."""

import math

import pytest

from sparsejax import comm, cost


def link_only(nodes, local, **kw):
  """A cluster where only the network link costs time (1 byte/s: time = bytes)."""
  args = dict(nodes=nodes, local=local, inter_Bps=1.0, intra_Bps=math.inf, inter_alpha_s=0.0,
              intra_alpha_s=0.0, call_s=0.0, select_s=lambda n, k: 0.0, pair_s=0.0,
              pass_s_per_value=0.0)
  return cost.Cluster(**{**args, **kw})


@pytest.mark.parametrize("nodes,local", [(2, 2), (4, 1), (16, 8), (8, 4)])
@pytest.mark.parametrize("algorithm,density,wire", [
    ("dense", 1.0, "pairs8"), ("hierarchical", 1.0, "pairs8"), ("allgather", 0.003, "pairs8"),
    ("hitopk", 0.0017, "pairs8"), ("gtopk", 0.002, "pairs8"), ("higtopk", 0.0013, "pairs8"),
    ("dense", 1.0, "pairs4"), ("hierarchical", 1.0, "pairs4"), ("allgather", 0.003, "pairs4"),
    ("hitopk", 0.0017, "pairs4"), ("hitopk", 0.21, "pairs4")])
def test_inter_node_time_is_the_librarys_bytes(nodes, local, algorithm, density, wire):
  """With only the link costing time, time = the bytes a node's link carries: comm.wire_bytes'
  per-worker inter-node bytes (in each wire format: pairs4's pairs and block counts, its dense
  forms' bfloat16) times the collectives sharing the link (power-of-two groups: gTop-k's worker
  0 is then as busy as any)."""
  n = 1_234_567 * local
  got = cost.exchange_time(algorithm, n, density, link_only(nodes, local), wire)["total"]
  shard = n / local if algorithm in comm.HIERARCHICAL_ALGORITHMS else n
  k = max(1, round(density * shard))
  want = comm.wire_bytes(algorithm, n=n, k=k, nodes=nodes, local=local, wire=wire)["inter"]
  sharing = local if algorithm in ("hitopk", "hierarchical", "higtopk") else 1
  if algorithm == "gtopk":  # the inter-node rounds: every worker of a node at once; one ring
    p = nodes * local
    sums = 2 * (p - 1) / p * k * 4
    want, sharing = local * (want - sums) + sums, 1
  assert got == pytest.approx(want * sharing, rel=1e-9)


def test_gtopk_rounds_fold_and_sums_by_hand():
  """Seven workers: Q = 4, two rounds of k pairs (each 1.5x one direction's time: an odd group
  swaps by ppermute, odd_swap_factor), a fold of k pairs and an unfold of k indices, a ring
  all-reduce of k sums; latency per message, merges of 2k pairs per round and in the fold."""
  k, alpha, merge = 1000, 0.01, 1e-6
  cl = link_only(7, 1, inter_alpha_s=alpha, merge_s_per_pair=merge, swap_factor=9.0,
                 odd_swap_factor=1.5)
  parts = cost.exchange_time("gtopk", 1000 * k, 0.001, cl)
  assert parts["rounds"] == pytest.approx(2 * (alpha + 1.5 * 8 * k + 2 * k * merge))
  even = cost.exchange_time("gtopk", 1000 * k, 0.001, link_only(6, 1, swap_factor=1.25))
  assert even["rounds"] == pytest.approx(2 * 1.25 * 8 * k)  # six workers: Q = 4, all-gather
  # two workers a node: the first round stays in the node (free here), the second crosses
  two = cost.exchange_time("gtopk", 1000 * k, 0.001, link_only(2, 2))
  assert two["rounds"] == pytest.approx(2 * 8 * k)  # both workers of a node on its link
  assert parts["fold"] == pytest.approx(alpha + 8 * k + 2 * k * merge)
  assert parts["unfold"] == pytest.approx(alpha + 4 * k)
  assert parts["sums"] == pytest.approx(12 * alpha + 2 * 6 / 7 * 4 * k)
  assert "fold" not in cost.exchange_time("gtopk", 1000 * k, 0.001, link_only(8, 1))
  # the network part leaves the selection and the passes out
  cl = link_only(8, 1, select_s=lambda n, k: 5.0, pass_s_per_value=1e-6)
  parts = cost.exchange_time("gtopk", 1000 * k, 0.001, cl)
  assert cost.network_time("gtopk", 1000 * k, 0.001, cl) == pytest.approx(
      parts["total"] - parts["select"] - parts["passes"])


def test_gtopk_grows_with_log_p_allgather_with_p():
  cl = {p: link_only(p, 1) for p in (16, 1024)}
  ag = {p: cost.network_time("allgather", 25_557_032, 0.001, cl[p]) for p in cl}
  gt = {p: cost.network_time("gtopk", 25_557_032, 0.001, cl[p]) for p in cl}
  assert ag[1024] / ag[16] == pytest.approx(1023 / 15, rel=1e-6)
  assert gt[1024] / gt[16] < 10 / 4 * 1.2  # log2 rounds, plus the sums' near-constant ring


def test_unknown_algorithm_is_named():
  with pytest.raises(ValueError, match="unknown algorithm 'gtop'.*gtopk"):
    cost.exchange_time("gtop", 10, 0.1, link_only(2, 1))
