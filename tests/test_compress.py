"""topk_allreduce as an optax transform inside shard_map, against numpy references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh, run_workers

from sparsejax.comm import sparse_collective
from sparsejax.compress import (
  ExchangeState,
  dense_mean,
  density_levels,
  density_schedule,
  exchange,
  hierarchical_mean,
  level_index,
  send_whole,
  tensor_balance,
  topk_allreduce,
)
from sparsejax.feedback import AdamCorrection, Feedback, MomentumCorrection, error_feedback
from sparsejax.finite import apply_if_finite_across

MESHES = [(2, 4), (4, 2), (1, 8), (8, 1)]
AXES = ("node", "local")


def grads_like(rng, p, dtype=np.float32):
  """A stacked (worker-major) gradient tree with odd shapes and mixed dtypes."""
  return {"w": rng.standard_normal((p, 7, 13)).astype(dtype),
          "b": rng.standard_normal((p, 13)).astype(np.float32),
          "s": rng.standard_normal((p,)).astype(np.float32),
          "e": rng.standard_normal((p, 3, 1, 5)).astype(dtype)}


def run_steps(mesh, tx, grads_seq):
  """Applies tx.update to each stacked gradient tree in turn; returns outputs and last state."""
  def body(*gs):
    state = tx.init(gs[0])
    outs = []
    for g in gs:
      out, state = tx.update(g, state)
      outs.append(out)
    return outs, state
  return run_workers(mesh, body, *grads_seq)


@pytest.mark.parametrize("nodes,local", MESHES)
@pytest.mark.parametrize("algorithm", ["hitopk", "allgather", "hierarchical", "dense"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_density_one_is_dense_mean(rng, nodes, local, algorithm, dtype):
  g = grads_like(rng, nodes * local, dtype)
  (outs,), state = run_steps(make_mesh(nodes, local), topk_allreduce(1.0, algorithm=algorithm),
                             [g])
  tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
  for name, leaf in g.items():
    assert outs[name].dtype == leaf.dtype
    want = np.asarray(leaf, np.float32).mean(0)
    for w in range(nodes * local):
      np.testing.assert_allclose(np.asarray(outs[name][w], np.float32), want, rtol=tol, atol=tol)
  assert (state.count == 1).all()


@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2)])
@pytest.mark.parametrize("algorithm", ["hitopk", "allgather"])
def test_error_feedback_loses_nothing(rng, nodes, local, algorithm):
  """Sum of all outputs (times workers) plus all final residuals equals the sum of all inputs."""
  p, steps = nodes * local, 12
  seq = [grads_like(rng, p) for _ in range(steps)]
  tx = topk_allreduce(0.02, algorithm=algorithm)
  outs, state = run_steps(make_mesh(nodes, local), tx, seq)
  leaves = lambda t: np.concatenate([np.asarray(x, np.float32).reshape(p, -1)  # noqa: E731
                                     for x in jax.tree.leaves(t)], axis=1)
  n = leaves(seq[0]).shape[1]
  sent = sum(leaves(o)[0] for o in outs) * p
  residual = state.feedback.residual  # (p, r): per worker
  if algorithm == "hitopk":
    kept = residual.reshape(nodes, -1).sum(0)[:n]  # each node's workers hold its shards in order
  else:
    kept = residual.sum(0)[:n]
  np.testing.assert_allclose(sent + kept, sum(leaves(g).sum(0) for g in seq), rtol=1e-4, atol=1e-4)
  # And each step really was sparse: far fewer non-zeros than the dense mean would have.
  assert np.count_nonzero(leaves(outs[0])[0]) < n // 2


@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2)])
@pytest.mark.parametrize("algorithm", ["hitopk", "allgather", "gtopk", "higtopk"])
def test_whole_positions_are_sent_whole_every_step(rng, nodes, local, algorithm):
  """`whole=`: at the flagged positions (here the vectors "b" and "s" of the tree, 14 of 120
  values, split unevenly over the hierarchical shards) every step's output is the workers'
  exact mean of that step's gradients and the memory stays empty; elsewhere the exchange is
  sparse; nothing is lost."""
  p, steps = nodes * local, 5
  seq = [grads_like(rng, p) for _ in range(steps)]
  leaves = lambda t: np.concatenate([np.asarray(x, np.float32).reshape(p, -1)  # noqa: E731
                                     for x in jax.tree.leaves(t)], axis=1)
  n = leaves(seq[0]).shape[1]
  whole = np.zeros(n, bool)
  whole[:13] = True  # "b" (13 values), then "e" (15), "s" (1), "w" (91)
  whole[28] = True
  tx = exchange(sparse_collective(algorithm, AXES), density_schedule(0.02),
                feedback=error_feedback(), whole=send_whole(whole))
  outs, state = run_steps(make_mesh(nodes, local), tx, seq)
  for g, out in zip(seq, outs, strict=True):
    np.testing.assert_allclose(leaves(out)[0][whole], leaves(g).mean(0)[whole], rtol=1e-5,
                               atol=1e-6)
    assert np.count_nonzero(leaves(out)[0][~whole]) < n // 2
  residual = np.asarray(state.feedback.residual)
  kept = (residual.reshape(nodes, -1).sum(0) if algorithm in ("hitopk", "higtopk")
          else residual.sum(0))[:n]
  assert np.all(kept[whole] == 0)
  sent = sum(leaves(o)[0] for o in outs) * p
  np.testing.assert_allclose(sent + kept, sum(leaves(g).sum(0) for g in seq), rtol=1e-4,
                             atol=1e-4)


def test_whole_positions_need_error_feedback():
  with pytest.raises(ValueError, match="send_whole needs error feedback"):
    exchange(sparse_collective("hitopk", AXES), density_schedule(0.1),
             whole=send_whole(np.ones(3, bool)))


@pytest.mark.parametrize("algorithm,bad", [("hitopk", np.nan), ("dense", -np.inf)])
def test_non_finite_gradient_skips_step(rng, algorithm, bad):
  nodes, local = 2, 4
  g1, g2 = grads_like(rng, 8), grads_like(rng, 8)
  g2["w"][5, 1, 2] = bad  # one worker, one value
  tx = apply_if_finite_across(topk_allreduce(0.05, algorithm=algorithm), ("node", "local"))
  outs, state = run_steps(make_mesh(nodes, local), tx, [g1, g2])
  for leaf in jax.tree.leaves(outs[1]):
    assert np.all(leaf == 0)
  # The residual after the skipped step equals the residual after step one.
  _, state1 = run_steps(make_mesh(nodes, local), tx, [g1])
  for a, b in zip(jax.tree.leaves(state.inner_state.feedback),
                  jax.tree.leaves(state1.inner_state.feedback), strict=True):
    np.testing.assert_array_equal(a, b)
  # skipped on every worker, counted once; the transform's own count did not move
  assert (~state.last_finite).all() and (state.total_notfinite == 1).all()
  assert (state.inner_state.count == 1).all()


@pytest.mark.parametrize("density,start", [(0.04, 0.25), (0.001, 0.25), (0.007, 0.3),
                                           (0.01, 1.0), (0.2, 0.5), (0.013, 0.052),
                                           (0.013, 0.0521), (0.3, 0.31),
                                           (0.1, float(np.float32(0.4)))])
def test_the_levels_run_a_warm_up_at_the_densities_it_asks_for(density, start):
  """With the schedule's start, the levels are the geometric grid from the density to the
  start in the fewest steps of at most 4x, then start x 4^j below 1 and 1: the warm-up's first
  steps run at its own density, not up to 4x above it; without one, density x 4^j. A start
  rounded to float32 (the plan's schedule) makes the grid no longer."""
  levels = density_levels(density, start)
  grid, above = levels[:levels.index(start) + 1], levels[levels.index(start) + 1:]
  assert grid[0] == density and levels[-1] == 1.0
  assert above == tuple(start * 4**j for j in range(1, 5) if start * 4**j < 1) + (1.0,) * (
      start < 1)
  assert len(density_levels(density, float(np.float32(start)))) == len(levels)
  steps = np.diff(np.log(np.asarray(grid)))
  np.testing.assert_allclose(steps, steps[0], rtol=1e-9)
  assert steps[0] <= math.log(4) + 1e-6  # no level more than 4x above the schedule
  stages = len(grid) - 1  # ... in the fewest levels: one fewer would need more than 4x
  assert stages == 1 or (start / density) ** (1 / (stages - 1)) > 4
  np.testing.assert_allclose(density_levels(0.04, 0.25), (0.04, 0.1, 0.25, 1.0))
  assert density_levels(0.04) == density_levels(0.04, 0.04) == (0.04, 0.16, 0.64, 1.0)


def test_density_schedule_switches_levels(rng):
  levels = density_levels(0.01)
  assert levels[0] == 0.01 and levels[-1] == 1.0
  sched = optax.piecewise_constant_schedule(1.0, {1: 0.01})  # dense first, then 1%
  tx = topk_allreduce(0.01, algorithm="allgather", schedule=sched)
  g = [grads_like(rng, 8) for _ in range(2)]
  outs, state = run_steps(make_mesh(2, 4), tx, g)
  for name, leaf in g[0].items():  # step 0 ran at density 1: the exact mean
    np.testing.assert_allclose(outs[0][name][0], leaf.mean(0), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(state.density, 0.01)
  n = sum(np.size(x[0]) for x in g[0].values())
  nz = sum(np.count_nonzero(x[0]) for x in outs[1].values())
  assert 0 < nz <= 8 * max(1, round(0.01 * n))


def test_density_level_chosen_by_the_caller_matches_the_switch(rng):
  """`update(..., density_level=i)` (a Python int: no lax.switch) gives bit for bit what the
  in-step switch gives at the step where the schedule asks for level i; `level_index` agrees on
  the host and in the step."""
  def sched(count):  # densities 0.3, 0.05, then 0.01
    return jnp.asarray([0.3, 0.05, 0.01], jnp.float32)[jnp.minimum(count, 2)]

  levels = density_levels(0.01, float(sched(0)))  # (0.01, 0.031, 0.097, 0.3, 1)
  host = [level_index(levels, float(sched(s))) for s in range(3)]
  assert host == [3, 2, 0]  # 0.3 -> 0.3, 0.05 -> 0.097, 0.01 -> 0.01
  assert [int(level_index(levels, jnp.float32(sched(s)))) for s in range(3)] == host
  tx = topk_allreduce(0.01, algorithm="hitopk", schedule=sched)
  g = [grads_like(rng, 8) for _ in range(3)]

  def body_fixed(*gs):
    state = tx.init(gs[0])
    outs = []
    for step, grad in enumerate(gs):
      out, state = tx.update(grad, state, density_level=host[step])
      outs.append(out)
    return outs, state

  switched, s1 = run_steps(make_mesh(2, 4), tx, g)
  fixed, s2 = run_workers(make_mesh(2, 4), body_fixed, *g)
  for a, b in zip(jax.tree.leaves((switched, s1)), jax.tree.leaves((fixed, s2)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="density_level must be a Python int in \\[0, 5\\)"):
    run_workers(make_mesh(2, 4), lambda x: tx.update(x, tx.init(x), density_level=5), g[0])


@pytest.mark.parametrize("algorithm", ["dense", "hierarchical"])
def test_dense_algorithms_ignore_density_and_its_schedule(rng, algorithm):
  """The uncompressed baselines send everything: density 1 whatever the config says."""
  sched = optax.piecewise_constant_schedule(0.25, {1: 0.01})
  tx = topk_allreduce(0.01, algorithm=algorithm, schedule=sched)
  g = [grads_like(rng, 8) for _ in range(2)]
  outs, state = run_steps(make_mesh(2, 4), tx, g)
  for step in range(2):
    for name, leaf in g[step].items():
      np.testing.assert_allclose(outs[step][name][0], leaf.mean(0), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(state.density, 1.0)


def test_state_is_a_named_tuple_and_jits(rng):
  tx = topk_allreduce(0.1)
  (out,), state = run_steps(make_mesh(2, 4), tx, [grads_like(rng, 8)])
  assert isinstance(state, ExchangeState)
  assert state.feedback.residual.dtype == np.float32 and state.feedback.velocity is None
  assert (state.bytes_sent > 0).all()


@pytest.mark.parametrize("masking", [True, False])
def test_momentum_correction_loses_nothing(rng, masking):
  """With momentum correction what is sent plus what is kept equals the sum of the velocities
  (the momentum of the summed gradient, restarted where sent if masking), and a skipped step
  keeps both. HiTopKComm on one node of 8: every coordinate has one owner, so the outputs say
  what was sent. Without masking the velocity is plain momentum: sent + kept is momentum SGD's."""
  algorithm, nodes, local, m = "hitopk", 1, 8, 0.9
  p, steps = nodes * local, 6
  seq = [grads_like(rng, p) for _ in range(steps)]
  bad = grads_like(rng, p)
  bad["b"][3, 2] = np.inf
  tx = apply_if_finite_across(
      topk_allreduce(0.03, algorithm=algorithm,
                     correction=MomentumCorrection(m, masking=masking)),
      ("node", "local"))
  outs, wrapped = run_steps(make_mesh(nodes, local), tx, seq + [bad])
  state = wrapped.inner_state
  assert state.feedback.velocity is not None  # momentum correction: a velocity beside it
  assert (~wrapped.last_finite).all()
  assert all((leaf == 0).all() for leaf in jax.tree.leaves(outs[-1]))
  leaves = lambda t: np.concatenate([np.asarray(x, np.float64).reshape(p, -1)  # noqa: E731
                                     for x in jax.tree.leaves(t)], axis=1)
  n = leaves(seq[0]).shape[1]

  def merged(buf):  # per-worker shards -> the whole buffer
    return buf.reshape(-1)[:n]

  # Rebuild the state from the inputs and outputs alone: the residual accumulates the velocity
  # and loses what was sent (the non-zero outputs); the velocity restarts where sent.
  velocity, total_u, sent = np.zeros(n), np.zeros(n), np.zeros(n)
  for g, out in zip(seq, outs[:-1], strict=True):
    velocity = m * velocity + leaves(g).sum(0)
    total_u += velocity
    o = leaves(out)[0] * p
    sent += o
    total_u[o != 0] -= o[o != 0]  # what was sent leaves the residual ...
    if masking:
      velocity[o != 0] = 0  # ... and the velocity restarts (momentum factor masking)
  np.testing.assert_allclose(merged(state.feedback.velocity), velocity, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(merged(state.feedback.residual), total_u, rtol=1e-4, atol=1e-4)
  assert sent.any()
  assert np.count_nonzero(leaves(outs[0])[0]) < n // 2


def test_feedback_in_steps_moves_each_gradient_at_its_own_step_s_rate(rng):
  """`learning_rate_first` (experimental.feedback_in="steps") in front of the compressor with
  momentum correction: the residual and velocity hold each step's gradient times that step's
  learning rate, so what was sent plus what is kept is momentum SGD's steps at a changing
  rate, whenever a value is sent."""
  from sparsejax.train.optimizer import learning_rate_first
  nodes, local, m = 1, 8, 0.9
  p, steps = nodes * local, 7
  rate = lambda count: 0.7 + 0.45 * count  # noqa: E731 (a rate that changes every step)
  seq = [grads_like(rng, p) for _ in range(steps)]
  tx = learning_rate_first(
      topk_allreduce(0.03, algorithm="hitopk",
                     correction=MomentumCorrection(m, masking=False)), rate)
  outs, state = run_steps(make_mesh(nodes, local), tx, seq)
  leaves = lambda t: np.concatenate([np.asarray(x, np.float64).reshape(p, -1)  # noqa: E731
                                     for x in jax.tree.leaves(t)], axis=1)
  n = leaves(seq[0]).shape[1]
  velocity, kept = np.zeros(n), np.zeros(n)
  for t, (g, out) in enumerate(zip(seq, outs, strict=True)):
    velocity = m * velocity + rate(t) * leaves(g).sum(0)
    kept += velocity - leaves(out)[0] * p
  np.testing.assert_allclose(np.asarray(state.feedback.velocity).reshape(-1)[:n], velocity,
                             rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(state.feedback.residual).reshape(-1)[:n], kept,
                             rtol=1e-4, atol=1e-4)
  assert 0 < np.count_nonzero(leaves(outs[-1])[0]) < n // 2


def test_bad_input():
  for d in (0, 1.5, -0.1, True, "0.1"):
    with pytest.raises(ValueError, match="density must be a number in \\(0, 1\\]"):
      topk_allreduce(d)
  with pytest.raises(ValueError, match="unknown algorithm 'ring'"):
    topk_allreduce(0.1, algorithm="ring")
  with pytest.raises(ValueError, match="unknown selector 'fast'"):
    topk_allreduce(0.1, selector="fast")
  for m in (-0.1, 0, 1.0, "0.9", True):
    with pytest.raises(ValueError, match="momentum must be a number in \\(0, 1\\), got"):
      topk_allreduce(0.1, correction=MomentumCorrection(m))
  with pytest.raises(ValueError, match="algorithm='dense'"):
    topk_allreduce(0.1, algorithm="dense", correction=MomentumCorrection(0.9))
  with pytest.raises(ValueError, match="nesterov and .masking must be True or False"):
    topk_allreduce(0.1, correction=MomentumCorrection(0.9, masking="no"))
  with pytest.raises(ValueError, match="correction must be a sparsejax.feedback"):
    topk_allreduce(0.1, correction=0.9)
  with pytest.raises(TypeError, match="unexpected keyword argument 'momentum'"):
    topk_allreduce(0.1, momentum=0.9)  # (the spelling before `correction=`)
  with pytest.raises(ValueError, match="tensor_balance works with error feedback"):
    exchange(sparse_collective("hitopk", AXES), density_schedule(0.1), balance=tensor_balance())
  with pytest.raises(ValueError, match="levels must be a"):
    exchange(sparse_collective("hitopk", AXES), 0.1)
  tx = topk_allreduce(0.1)
  with pytest.raises(ValueError, match="'node' is not bound"):
    tx.init({"w": jnp.ones(4)})


def test_dense_baselines_are_transforms_of_their_own(rng):
  """`dense_mean` and `hierarchical_mean` are what topk_allreduce(algorithm="dense" /
  "hierarchical") returns: the exact mean, no feedback, density 1, their bytes counted."""
  g = grads_like(rng, 8)
  mesh = make_mesh(2, 4)
  for named, algorithm in ((dense_mean(), "dense"), (hierarchical_mean(), "hierarchical")):
    (got,), state = run_steps(mesh, named, [g])
    (via,), via_state = run_steps(mesh, topk_allreduce(0.01, algorithm=algorithm), [g])
    for name, leaf in g.items():
      np.testing.assert_array_equal(got[name], via[name])
      np.testing.assert_allclose(got[name][3], leaf.mean(0), rtol=1e-5, atol=1e-5)
    assert state.feedback is None and (state.density == 1).all() and (state.count == 1).all()
    np.testing.assert_array_equal(state.bytes_sent, via_state.bytes_sent)
    assert (state.bytes_sent > 0).all()


def run_levels(mesh, tx, grads_seq, levels):
  """`run_steps` with `density_level=levels[t]` at step t."""
  def body(*gs):
    state = tx.init(gs[0])
    outs = []
    for g, level in zip(gs, levels, strict=True):
      out, state = tx.update(g, state, density_level=level)
      outs.append(out)
    return outs, state
  return run_workers(mesh, body, *grads_seq)


@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("algorithm,wire", [("hitopk", "pairs8"), ("allgather", "pairs8"),
                                            ("higtopk", "pairs8"), ("hitopk", "pairs4"),
                                            ("allgather", "pairs4")])
def test_dense_level_switch_loses_nothing(rng, nodes, local, algorithm, wire):
  """Sparse, dense form, its steady step, sparse, sparse, dense form, steady: a dense step sends
  every candidate (its output is the mean of the gradients plus everything kept so far) and
  empties the residual (in pairs4 it keeps only its bfloat16 roundings), the steady step after
  it sends the gradients' mean; sent plus kept equals the sum of the inputs after every step."""
  p = nodes * local
  levels = [0, 1, 2, 0, 0, 1, 2]  # one density level (no schedule): 1 the dense form, 2 steady
  seq = [grads_like(rng, p) for _ in levels]
  tx = exchange(sparse_collective(algorithm, AXES, wire),
                density_schedule(0.03, dense_form=True), feedback=error_feedback())
  mesh = make_mesh(nodes, local)
  leaves = lambda t: np.concatenate([np.asarray(x, np.float64).reshape(p, -1)  # noqa: E731
                                     for x in jax.tree.leaves(t)], axis=1)
  n = leaves(seq[0]).shape[1]
  sent, fed = np.zeros(n), np.zeros(n)
  for t in range(1, len(levels) + 1):
    outs, state = run_levels(mesh, tx, seq[:t], levels[:t])
    out = leaves(outs[-1])
    np.testing.assert_allclose(out, np.broadcast_to(out[0], out.shape))  # same on every worker
    sent += out[0] * p
    fed += leaves(seq[t - 1]).sum(0)
    residual = np.asarray(state.feedback.residual, np.float64)
    kept = (residual.reshape(nodes, -1).sum(0) if algorithm in ("hitopk", "higtopk")
            else residual.sum(0))[:n]
    np.testing.assert_allclose(sent + kept, fed, rtol=1e-4, atol=1e-4)
    if levels[t - 1] in (1, 2):
      if wire == "pairs8":
        assert not residual.any()  # the dense form keeps nothing back ...
        np.testing.assert_allclose(sent, fed, rtol=1e-4, atol=1e-4)  # ... and has sent it all
      else:  # ... but its values' roundings to bfloat16 (and their sums'), each < 2^-8 of it
        assert np.abs(kept).max() <= 2.0 ** -5 * np.abs(fed).max()
      assert np.allclose(np.asarray(state.density), 1.0)
    else:
      assert np.count_nonzero(out[0]) < n // 2
  value_bytes = 4 if wire == "pairs8" else 2
  want_bytes = 2 * (nodes - 1) / nodes * (np.ceil(n / local) * local / local) * value_bytes
  if algorithm != "allgather":  # the hierarchical dense form: the node all-reduce of a shard
    assert np.asarray(state.bytes_sent).max() >= want_bytes


def test_dense_level_with_momentum_correction_is_momentum_sgd(rng):
  """Dense steps with momentum correction and masking (the dense form, then its steady step,
  which runs the momentum on the summed gradient): the velocity runs on (nothing is masked), so
  a run of dense steps sends exactly momentum SGD's velocity of the summed gradient; a sparse
  step after it starts from that velocity."""
  nodes, local, m = 2, 4, 0.9
  p = nodes * local
  seq = [grads_like(rng, p) for _ in range(4)]
  tx = exchange(sparse_collective("hitopk", AXES), density_schedule(0.02, dense_form=True),
                feedback=error_feedback(MomentumCorrection(m, masking=True)))
  outs, state = run_levels(make_mesh(nodes, local), tx, seq, [1, 2, 2, 0])  # (steady after)
  leaves = lambda t: np.concatenate([np.asarray(x, np.float64).reshape(p, -1)  # noqa: E731
                                     for x in jax.tree.leaves(t)], axis=1)
  velocity = np.zeros(leaves(seq[0]).shape[1])
  for g, out in zip(seq[:3], outs[:3], strict=True):
    velocity = m * velocity + leaves(g).sum(0)
    np.testing.assert_allclose(leaves(out)[0] * p, velocity, rtol=1e-4, atol=1e-4)
  assert np.count_nonzero(leaves(outs[3])[0]) < velocity.size // 2


@pytest.mark.parametrize("algorithm", ["hitopk", "allgather"])
def test_the_dense_form_makes_the_correction_s_state_the_parties_mean(rng, algorithm):
  """A sparse step leaves each party (a node's shard under HiTopKComm, a worker under TopK
  all-gather) its own velocity; the dense form after it makes every party's the mean (their
  sum, what was sent, unchanged), so that its steady step can run one velocity on the mean."""
  nodes, local, m = 2, 4, 0.9
  p = nodes * local
  seq = [grads_like(rng, p) for _ in range(2)]
  tx = exchange(sparse_collective(algorithm, AXES), density_schedule(0.02, dense_form=True),
                feedback=error_feedback(MomentumCorrection(m, masking=False)))
  mesh = make_mesh(nodes, local)
  _, before = run_levels(mesh, tx, seq[:1], [0])
  _, after = run_levels(mesh, tx, seq, [0, 1])
  u0 = np.asarray(before.feedback.velocity, np.float64).reshape(p, -1)  # (worker, its part)
  u1 = np.asarray(after.feedback.velocity, np.float64).reshape(p, -1)
  part = u0.shape[1]
  grads = np.concatenate([np.asarray(x, np.float64).reshape(p, -1)
                          for x in jax.tree.leaves(seq[1])], axis=1)
  grads = np.pad(grads, ((0, 0), (0, part * (local if algorithm == "hitopk" else 1)
                                  - grads.shape[1])))
  if algorithm == "hitopk":  # worker (j, i): shard i of node j's sum; parties: the nodes
    sums = grads.reshape(nodes, local, -1).sum(1)
    term = np.stack([sums[w // local, (w % local) * part:(w % local + 1) * part]
                     for w in range(p)])
    want = (m * u0 + term).reshape(nodes, local, part).mean(0, keepdims=True)
    want = np.broadcast_to(want, (nodes, local, part)).reshape(p, part)
  else:  # every worker its own gradient; parties: all workers
    want = np.broadcast_to((m * u0 + grads).mean(0), (p, part))
  assert not np.allclose(u0, u0[:1])  # the parties' own, after the sparse step
  np.testing.assert_allclose(u1, want, rtol=1e-4, atol=1e-5)


def test_the_steady_dense_step_runs_adam_on_the_mean_gradient(rng):
  """Adam correction, steady dense steps from the start (the state empty): each output is the
  Adam direction of the workers' mean gradient (numpy), every worker the same: plain dense's
  Adam, not a mean of the workers' directions."""
  nodes, local = 2, 4
  p = nodes * local
  b1, b2, eps = 0.9, 0.98, 1e-8
  seq = [grads_like(rng, p) for _ in range(3)]
  tx = exchange(sparse_collective("hitopk", AXES), density_schedule(0.02, dense_form=True),
                feedback=error_feedback(AdamCorrection(b1, b2, eps)))
  outs, _ = run_levels(make_mesh(nodes, local), tx, seq, [2, 2, 2])
  leaves = lambda t: np.concatenate([np.asarray(x, np.float64).reshape(p, -1)  # noqa: E731
                                     for x in jax.tree.leaves(t)], axis=1)
  mo = np.zeros(leaves(seq[0]).shape[1])
  vo = np.zeros_like(mo)
  for t, (g, out) in enumerate(zip(seq, outs, strict=True)):
    mean = leaves(g).mean(0)
    mo, vo = b1 * mo + (1 - b1) * mean, b2 * vo + (1 - b2) * mean * mean
    want = (mo / (1 - b1 ** (t + 1))) / (np.sqrt(vo / (1 - b2 ** (t + 1))) + eps)
    got = leaves(out)
    np.testing.assert_allclose(got, np.broadcast_to(got[0], got.shape), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got[0], want, rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize("correction", [None, MomentumCorrection(0.9),
                                        MomentumCorrection(0.8, nesterov=True, masking=True),
                                        AdamCorrection(0.9, 0.98, 1e-8)])
def test_the_candidates_are_each_correction_s_term_beside_the_residual(rng, correction):
  """The error-feedback piece's candidates against numpy: x + residual, the (Nesterov) velocity
  plus the residual, or the Adam direction of the mean plus the residual (what the dense form
  sends); the velocity and moments run on unmasked, the residual as it was."""
  n, scale, count = 1237, 3.0, 4
  x, r, u, w = (rng.standard_normal(n).astype(np.float32) for _ in range(4))
  w = np.abs(w)
  feedback = Feedback(jnp.asarray(r), *((jnp.asarray(u),) if isinstance(
      correction, MomentumCorrection) else (jnp.asarray(u), jnp.asarray(w)) if correction
      else ()))
  term, kept = error_feedback(correction).candidates(jnp.asarray(x), feedback,
                                                     jnp.int32(count), scale)
  values = term + kept.residual
  if correction is None:
    want, moments = x + r, ()
  elif isinstance(correction, MomentumCorrection):
    v = correction.momentum * u + x
    want = (x + correction.momentum * v if correction.nesterov else v) + r
    moments = (v,)
  else:
    g = x / scale
    m = correction.b1 * u + (1 - correction.b1) * g
    v = correction.b2 * w + (1 - correction.b2) * g * g
    m_hat, v_hat = m / (1 - correction.b1 ** (count + 1)), v / (1 - correction.b2 ** (count + 1))
    want, moments = scale * m_hat / (np.sqrt(v_hat) + correction.eps) + r, (m, v)
  np.testing.assert_allclose(values, want, rtol=2e-5, atol=2e-6)
  np.testing.assert_array_equal(kept.residual, r)
  for got, ref in zip([kept.velocity, kept.second][:len(moments)], moments, strict=True):
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)


def test_the_dense_form_is_a_level_of_its_own_and_levels_are_checked(rng):
  for dense, bad in ((False, 1), (True, 3)):  # (with it: the dense form and its steady step)
    tx = exchange(sparse_collective("hitopk", AXES), density_schedule(0.1, dense_form=dense),
                  feedback=error_feedback())
    with pytest.raises(ValueError, match=f"density_level must be a Python int in \\[0, {bad}\\)"):
      run_levels(make_mesh(2, 4), tx, [grads_like(rng, 8)], [bad])
