"""gTop-k (flat and as HiTopKComm's inter-node phase) against a numpy reference of the same
recursive-doubling merge, on 1 to 8 workers (odd counts included), and its conservation law."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, run_workers

from sparsejax import comm, compress
from sparsejax.feedback import Feedback, MomentumCorrection

AXES = ("node", "local")


def np_topk_pairs(acc, k):
  idx = np.argsort(-np.abs(acc), kind="stable")[:k]
  return acc[idx], idx


def np_merge(a, b, k, n):
  """The k largest |sums| of two pair sets (float32 sums, as the collective adds them)."""
  sums = {}
  for v, i in list(zip(*a)) + list(zip(*b)):
    if i < n:
      sums[int(i)] = np.float32(sums[int(i)] + v) if int(i) in sums else np.float32(v)
  best = sorted(sums.items(), key=lambda t: -abs(t[1]))[:k]
  vals = np.array([v for _, v in best] + [0.0] * (k - len(best)), np.float32)
  idx = np.array([i for i, _ in best] + [n] * (k - len(best)), np.int64)
  return vals, idx


def np_gtopk_positions(pairs, k, n):
  """The global positions: fold the workers past the largest power of two Q into the first
  ones, recursive doubling among the Q, the same set everywhere."""
  p = len(pairs)
  q = 1 << (p.bit_length() - 1)
  cur = list(pairs)
  for e in range(p - q):
    cur[e] = np_merge(cur[e], cur[q + e], k, n)
  d = 1
  while d < q:
    cur = [np_merge(cur[s], cur[s ^ d], k, n) for s in range(q)]
    d *= 2
  return {int(i) for i in cur[0][1] if i < n}


def np_exchange(accs, k, n):
  """(total, residuals) of gTop-k from each worker's candidates: at the global positions the
  sum of what the workers selected there; each worker keeps all but what it sent."""
  pairs = [np_topk_pairs(a, k) for a in accs]
  pos = sorted(np_gtopk_positions(pairs, k, n))
  total = np.zeros(n, np.float64)
  residuals = []
  for a, (_, idx) in zip(accs, pairs):
    sent = np.intersect1d(idx, pos)
    total[sent] += a[sent]
    r = a.copy()
    r[sent] = 0
    residuals.append(r)
  return total, np.stack(residuals), pos


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("k", [23, 211])  # merges by sort; by a dense buffer (2k >= n / 16)
def test_gtopk_equals_numpy(rng, workers, k):
  n = 1009
  x = rng.standard_normal((workers, n)).astype(np.float32)
  res = rng.standard_normal((workers, n)).astype(np.float32)
  # correlated workers (a shared part), as gradients of one model are: merges find overlaps
  x += 1.5 * rng.standard_normal(n).astype(np.float32)
  mesh = make_mesh(workers, 1)

  def body(v, r):
    total, fb = comm.gtopk_allreduce(v, k, axes=AXES, residual=Feedback(r), select="exact")
    return total, fb.residual

  total, new_res = run_workers(mesh, body, x, res)
  want, want_res, pos = np_exchange([x[w] + res[w] for w in range(workers)], k, n)
  assert len(pos) == k
  for w in range(workers):  # the same total on every worker, bit for bit
    np.testing.assert_array_equal(total[w], total[0])
  np.testing.assert_allclose(total[0], want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(new_res, want_res, rtol=1e-6, atol=1e-6)
  assert set(np.flatnonzero(total[0])) == set(pos)
  # a position a worker did not select keeps its candidate there (it sent nothing)
  if workers > 1:
    unsent = [(w, i) for w in range(workers) for i in pos
              if i not in set(np_topk_pairs(x[w] + res[w], k)[1])]
    assert unsent, "the correlated workers all selected every global position: a weak test"
    for w, i in unsent:
      assert new_res[w, i] == pytest.approx(x[w, i] + res[w, i], rel=1e-6)


@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2), (3, 2), (1, 8), (8, 1), (5, 1)])
def test_higtopk_equals_numpy(rng, nodes, local):
  """HiTopKComm with gTop-k between nodes: reduce-scatter in the node, gTop-k of shard i over
  the nodes (shard i's workers form one gTop-k group), all-gather in the node."""
  p, shard, k = nodes * local, 1031, 19
  n = shard * local
  x = rng.standard_normal((p, n)).astype(np.float32)
  res = rng.standard_normal((p, shard)).astype(np.float32)
  mesh = make_mesh(nodes, local)

  def body(v, r):
    total, fb = comm.higtopk_allreduce(v, k, node_axis="node", local_axis="local",
                                       residual=Feedback(r), select="exact")
    return total, fb.residual

  total, new_res = run_workers(mesh, body, x, res)
  xs = x.reshape(nodes, local, n)
  want = np.zeros(n)
  for i in range(local):
    accs = [xs[node].sum(0)[i * shard:(i + 1) * shard] + res[node * local + i]
            for node in range(nodes)]
    shard_total, shard_res, _ = np_exchange(accs, k, shard)
    want[i * shard:(i + 1) * shard] = shard_total
    for node in range(nodes):
      np.testing.assert_allclose(new_res[node * local + i], shard_res[node], rtol=1e-5,
                                 atol=1e-5)
  np.testing.assert_allclose(total, np.broadcast_to(want, total.shape), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algorithm,nodes,local", [("gtopk", 7, 1), ("gtopk", 2, 4),
                                                   ("higtopk", 2, 4), ("higtopk", 3, 2)])
def test_mstopk_inside_gtopk_sends_what_it_keeps_back(rng, algorithm, nodes, local):
  """The conservation law the other sparse collectives pass, over three steps with MSTopK:
  the totals sent plus every worker's residual equal the sum of all gradients."""
  n, k = local * 3001, 29
  xs = [rng.standard_normal((nodes * local, n)).astype(np.float32) for _ in range(3)]
  mesh = make_mesh(nodes, local)
  r = n // local if algorithm == "higtopk" else n

  def body(*steps):
    fb, totals = Feedback(jnp.zeros(r)), []
    for v in steps:
      if algorithm == "gtopk":
        total, fb = comm.gtopk_allreduce(v, k, axes=AXES, residual=fb)
      else:
        total, fb = comm.higtopk_allreduce(v, k, node_axis="node", local_axis="local",
                                           residual=fb)
      totals.append(total)
    return totals, fb.residual

  totals, res = run_workers(mesh, body, *xs)
  kept = res.sum(0) if algorithm == "gtopk" else res.reshape(nodes, n).sum(0)
  sent = sum(t[0] for t in totals)
  np.testing.assert_allclose(sent + kept, sum(x.sum(0) for x in xs), rtol=1e-4, atol=1e-4)
  for t in totals:  # at most k positions per shard
    assert np.count_nonzero(t[0]) <= k * local


@pytest.mark.parametrize("masking", [False, True])
def test_momentum_correction_through_gtopk(rng, masking):
  """Momentum correction with gTop-k: without masking what is sent plus what is kept equals
  the sum of the velocities (momentum SGD's update); with masking the velocity is zero where
  this worker sent and not where only others did."""
  workers, n, k, m = 5, 1013, 17, 0.9
  xs = [rng.standard_normal((workers, n)).astype(np.float32) for _ in range(3)]
  mesh = make_mesh(workers, 1)

  def body(*steps):
    fb, totals = Feedback(jnp.zeros(n), jnp.zeros(n)), []
    for v in steps:
      total, fb = comm.gtopk_allreduce(v, k, axes=AXES, residual=fb, select="exact",
                                       correction=MomentumCorrection(m, masking=masking))
      totals.append(total)
    return totals, fb

  totals, fb = run_workers(mesh, body, *xs)
  if not masking:
    vel, velocity_sum = np.zeros((workers, n)), np.zeros(n)
    for x in xs:
      vel = m * vel + x
      velocity_sum += vel.sum(0)
    sent = sum(t[0] for t in totals)
    np.testing.assert_allclose(sent + fb.residual.sum(0), velocity_sum, rtol=1e-4, atol=1e-4)
  else:
    last = np.flatnonzero(totals[-1][0])
    sent = fb.residual[:, last] == 0  # what each worker sent in the last step
    assert sent.any() and not sent.all()
    assert np.all(fb.velocity[:, last][sent] == 0)
    assert np.all(fb.velocity[:, last][~sent] != 0)


def test_topk_allreduce_gtopk_is_the_mean_and_conserves(rng):
  """The optax transform with algorithm="gtopk" over one pmap axis and "higtopk" on a 2 x 4
  mesh: the mean of what was sent, and sent + residual = the gradient sum."""
  tx = compress.topk_allreduce(0.05, algorithm="gtopk", axis_name="batch")
  g = {"w": jnp.asarray(rng.standard_normal((6, 7, 13)), jnp.float32),
       "b": jnp.asarray(rng.standard_normal((6, 13)), jnp.float32)}

  def step(g):
    state = tx.init(g)
    mean, state = tx.update(g, state)
    return mean, state.feedback.residual

  mean, res = jax.pmap(step, axis_name="batch", devices=jax.devices()[:6])(g)
  flat = np.concatenate([np.asarray(g["b"]).reshape(6, -1), np.asarray(g["w"]).reshape(6, -1)],
                        axis=1)
  sent = np.concatenate([np.asarray(mean["b"][0]).ravel(), np.asarray(mean["w"][0]).ravel()])
  np.testing.assert_allclose(6 * sent + np.asarray(res).sum(0)[:flat.shape[1]], flat.sum(0),
                             rtol=1e-5, atol=1e-5)
  assert np.count_nonzero(sent) == max(1, round(0.05 * flat.shape[1]))


def test_bad_input_is_named():
  with pytest.raises(ValueError, match="needs two mesh axes"):
    compress.topk_allreduce(0.01, algorithm="higtopk", axis_name="batch")
  with pytest.raises(ValueError, match="unknown algorithm 'gtop'"):
    compress.topk_allreduce(0.01, algorithm="gtop")
  with pytest.raises(ValueError, match="not a sparse algorithm"):
    comm.sparse_collective("dense", AXES)


@pytest.mark.integration
@pytest.mark.parametrize("algorithm", ["higtopk", "gtopk"])
def test_the_trainer_steps_with_gtopk(algorithm):
  """`compression.algorithm` = "higtopk" / "gtopk" in a config: the trainer's own step on a
  2 x 4 mesh trains (the loss falls over a few steps on digits), with momentum correction. (A
  small MLP for the quickstart's ResNet-20: the exchange sees only the flat gradient, and a
  ResNet's compile was most of this test's time on 2 cores.)"""
  import os

  from conftest import override

  from sparsejax import data as data_lib
  from sparsejax.train import config as config_lib
  from sparsejax.train import validate
  from sparsejax.train.plan import make_plan
  from sparsejax.train.state import from_config, shard_batch
  from sparsejax.train.step import jit_train_step
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = config_lib.load_config(os.path.join(root, "configs", "quickstart.py"))
  config = validate(override(config, {"compression.algorithm": algorithm,
                                      "compression.density": 0.02,
                                      "compression.momentum_correction": True,
                                      "model.name": "mlp", "model.hidden": (64,)}))
  mesh = make_mesh(2, 4)
  setup, state = from_config(config, make_plan(config, 10), mesh, 10, (8, 8, 1))
  part = state.comm_state.feedback.residual.shape[1]
  assert part == (setup.layout.padded_size // 4 if algorithm == "higtopk"
                  else setup.layout.padded_size)
  train, _ = data_lib.digits()
  step = jit_train_step(setup, state)
  losses = []
  for i in range(6):
    rows = slice((i % 3) * 128, (i % 3 + 1) * 128)
    state, metrics = step(state, *shard_batch(mesh, train.images[rows], train.labels[rows]))
    losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
