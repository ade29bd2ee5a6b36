"""`exchange(..., balance=tensor_balance())`: each tensor's candidates scaled by a power of two
near 1 / their RMS before the one top-k, so a tensor of small gradients is not starved; what is
sent and what is kept are the candidates' own values (nothing lost, exactly)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sparsejax.comm import sparse_collective
from sparsejax.compress import (
  density_schedule,
  exchange,
  tensor_balance,
  tensor_weights,
  topk_allreduce,
)
from sparsejax.feedback import AdamCorrection, MomentumCorrection, error_feedback
from tests.conftest import make_mesh


def balanced(correction=None, segments=None, feedback=True):
  """HiTopKComm 0.05 (exact top-k) with the per-tensor balance."""
  return exchange(sparse_collective("hitopk", ("node", "local")), density_schedule(0.05),
                  feedback=error_feedback(correction) if feedback else None, selector="exact",
                  balance=tensor_balance(segments))


def _one_step(tx, grads, mesh):
  def body(g):
    state = tx.init(g)
    out, state = tx.update(g, state)
    return out, state.feedback.residual
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(),
                               check_vma=False))(grads)


def test_a_small_tensor_gets_its_share_and_nothing_is_lost():
  rng = np.random.default_rng(3)
  grads = {"big": (rng.standard_normal(1203) * 256).astype(np.float32),
           "small": rng.standard_normal(797).astype(np.float32)}
  mesh = make_mesh(1, 1)
  sent, _ = _one_step(topk_allreduce(0.05, selector="exact"), grads, mesh)
  assert np.count_nonzero(sent["small"]) == 0  # a global top-k starves it
  sent, residual = _one_step(balanced(), grads, mesh)
  k = round(0.05 * 2000)
  small = np.count_nonzero(sent["small"])
  assert np.count_nonzero(sent["big"]) + small == k
  assert 0.25 * k < small < 0.6 * k  # about its share (40%): 256 is a power of two
  flat_sent = np.concatenate([sent["big"], sent["small"]])
  flat_grads = np.concatenate([grads["big"], grads["small"]])
  np.testing.assert_array_equal(flat_sent + np.asarray(residual)[:2000], flat_grads)
  np.testing.assert_array_equal(flat_sent[flat_sent != 0], flat_grads[flat_sent != 0])


def test_a_flat_buffer_is_balanced_by_the_segments_given():
  """The trainer's updates are one flat buffer: its tensors come as `segments`, and the
  selection is the one the same tensors as leaves get."""
  rng = np.random.default_rng(4)
  grads = {"big": (rng.standard_normal(1203) * 300).astype(np.float32),
           "small": rng.standard_normal(797).astype(np.float32)}
  flat = np.concatenate([grads["big"], grads["small"]])
  segments = np.repeat(np.int32([0, 1]), [1203, 797])
  mesh = make_mesh(1, 1)
  as_leaves, _ = _one_step(balanced(), grads, mesh)
  as_flat, _ = _one_step(balanced(segments=segments), flat, mesh)
  np.testing.assert_array_equal(as_flat, np.concatenate([as_leaves["big"], as_leaves["small"]]))
  unbalanced, _ = _one_step(topk_allreduce(0.05, selector="exact"), flat, mesh)
  assert np.count_nonzero(as_flat[1203:]) > 0 == np.count_nonzero(unbalanced[1203:])


def test_tensor_weights_are_powers_of_two_near_the_inverse_rms():
  rng = np.random.default_rng(5)
  x = np.concatenate([rng.standard_normal(501) * 37.0, rng.standard_normal(313) * 0.003,
                      np.zeros(11)]).astype(np.float32)
  ids = np.repeat(np.int32([0, 1, 2]), [501, 313, 11])
  w = np.asarray(tensor_weights(x, ids, 3))
  for seg, scale in ((0, 37.0), (1, 0.003)):
    ws = w[ids == seg]
    assert np.all(ws == ws[0]) and np.log2(ws[0]) == np.round(np.log2(ws[0]))
    assert 0.5 < ws[0] * scale < 2.0
  assert np.all(w[ids == 2] == 1.0)  # an all-zero tensor is left as it is


@pytest.mark.parametrize("nesterov", [False, True])
def test_with_momentum_correction_the_velocity_s_candidates_are_balanced(nesterov):
  """Two steps of DGC's momentum correction (unmasked) with balance="tensor", against numpy:
  the candidates are residual + velocity term, each tensor's scaled by the power of two near
  1 / its RMS for the selection; sent plus kept is the candidates exactly."""
  rng = np.random.default_rng(6)
  sizes = (1031, 389)
  steps = [{"big": (rng.standard_normal(sizes[0]) * 200).astype(np.float32),
            "small": rng.standard_normal(sizes[1]).astype(np.float32)} for _ in range(2)]
  m, k = 0.9, round(0.05 * sum(sizes))
  tx = balanced(MomentumCorrection(m, nesterov=nesterov, masking=False))

  def body(g1, g2):
    state = tx.init(g1)
    out1, state = tx.update(g1, state)
    out2, state = tx.update(g2, state)
    return out1, out2, state.feedback.residual
  mesh = make_mesh(1, 1)
  out1, out2, residual = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()),
                                               out_specs=P(), check_vma=False))(*steps)
  ids = np.repeat([0, 1], sizes)
  u, r = np.zeros(sum(sizes), np.float32), np.zeros(sum(sizes), np.float32)
  small = []
  for g, out in zip(steps, (out1, out2)):
    u = m * u + np.concatenate([g["big"], g["small"]])
    acc = r + (np.concatenate([g["big"], g["small"]]) + m * u if nesterov else u)
    rms = np.array([np.sqrt(np.mean(acc[ids == i] ** 2)) for i in (0, 1)])
    w = np.exp2(-np.round(np.log2(rms)))[ids]
    chosen = np.argsort(-np.abs(acc * w), kind="stable")[:k]
    want = np.zeros_like(acc)
    want[chosen] = acc[chosen]
    got = np.concatenate([out["big"], out["small"]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    small.append(np.count_nonzero(got[sizes[0]:]))
    r = acc - want
  np.testing.assert_allclose(np.asarray(residual)[:sum(sizes)], r, rtol=1e-5, atol=1e-4)
  # it gets a share (without balance none: its values are 200 times smaller); powers of two
  # leave each tensor's RMS within sqrt(2) of 1, so a step's share can still be 0
  assert sum(small) > 0.3 * k


def test_balance_refuses_what_it_does_not_support():
  with pytest.raises(ValueError, match="balance must be a"):
    exchange(sparse_collective("hitopk", ("node", "local")), density_schedule(0.05),
             feedback=error_feedback(), balance="tensor")
  with pytest.raises(ValueError, match="error feedback, plain or with a MomentumCorrection"):
    balanced(AdamCorrection(0.9, 0.99, 1e-8))
  with pytest.raises(ValueError, match="error feedback, plain or with a MomentumCorrection"):
    balanced(feedback=False)
