"""A checkpoint written by 4 workers resumed on 2 and on 8 (sparsejax.train.resize): the update
the workers' memory still holds (residuals and velocities over the worker count) is kept to
float32 rounding, the shared state as it was, and the resized state trains."""

import os

import jax
import numpy as np
import pytest
from conftest import override

from sparsejax import data as data_lib
from sparsejax.train import config as config_lib
from sparsejax.train import resize, validate
from sparsejax.train.checkpoint import Checkpointer
from sparsejax.train.mesh import make_mesh
from sparsejax.train.plan import make_plan
from sparsejax.train.state import from_config, shard_batch
from sparsejax.train.step import jit_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pending(memory, padded):
  """The update a per-worker memory [W, part] stands for: float64[padded], sum over workers of
  each position's values, over W (shard i of worker i of every node for part < padded)."""
  memory = np.asarray(memory, np.float64)
  w, part = memory.shape
  if part == padded:
    return memory.sum(0) / w
  local = padded // part
  return memory.reshape(w // local, local, part).sum(0).reshape(padded) / w


@pytest.mark.parametrize("old,new", [((4, 12), (2, 12)), ((4, 12), (8, 12)), ((4, 12), (3, 12)),
                                     ((4, 6), (2, 6)), ((4, 6), (8, 3)), ((6, 4), (4, 6))])
def test_redistribute_keeps_the_pending_update(rng, old, new):
  """Flat (part = padded) and hierarchical (part = padded / local) layouts, worker counts up
  and down, and a change of workers a node (shards of 6 -> 3, 4 -> 6)."""
  padded_old, padded_new = 12, 12
  memory = rng.standard_normal(old).astype(np.float32)
  got = resize.redistribute(memory, padded_old, new, padded_new)
  assert got.shape == new and got.dtype == np.float32
  np.testing.assert_allclose(pending(got, padded_new), pending(memory, padded_old), rtol=1e-6,
                             atol=1e-7)
  # the raw sum scales with the worker count (the exchange divides by it)
  np.testing.assert_allclose(got.astype(np.float64).sum(), memory.astype(np.float64).sum()
                             * new[0] / old[0], rtol=1e-5)


def test_redistribute_repads():
  memory = np.arange(2 * 10, dtype=np.float32).reshape(2, 10)
  got = resize.redistribute(memory, 10, (4, 12), 12)
  np.testing.assert_array_equal(got[:, 10:], 0)
  np.testing.assert_allclose(pending(got, 12)[:10], pending(memory, 10))


def small_config(algorithm):
  config = config_lib.load_config(os.path.join(ROOT, "configs", "quickstart.py"))
  return validate(override(config, {"compression.algorithm": algorithm,
                                    "compression.density": 0.05,
                                    "compression.momentum_correction": True,
                                    "model.num_filters": 4, "batch_size": 64}))


def build(config, nodes, local):
  mesh = make_mesh(nodes, local, jax.devices()[:nodes * local])
  return mesh, *from_config(config, make_plan(config, 10), mesh, 10, (8, 8, 1))


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
@pytest.mark.parametrize("algorithm", [  # (slow: CI's 15-minute budget)
    "hitopk", pytest.param("allgather", marks=pytest.mark.slow)])
def test_a_checkpoint_of_4_workers_resumes_on_2_and_on_8(tmp_path, algorithm):
  config = small_config(algorithm)
  mesh, setup, state = build(config, 2, 2)
  train, _ = data_lib.digits()
  step = jit_train_step(setup, state)
  for i in range(3):  # some memory: residuals and velocities
    state, _ = step(state, *shard_batch(mesh, train.images[i * 64:(i + 1) * 64],
                                        train.labels[i * 64:(i + 1) * 64]))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=1)
  ckpt.save(3, state)
  fb = state.comm_state.feedback
  padded = state.params.shape[0]
  for nodes, local in ((1, 2), (2, 4)):
    new_mesh, new_setup, like = build(config, nodes, local)
    got = ckpt.restore(3, like)
    assert got.comm_state.feedback.residual.shape == like.comm_state.feedback.residual.shape
    new_padded = like.params.shape[0]
    for old_m, new_m in zip(fb, got.comm_state.feedback):
      if old_m is None:  # no Adam moments in this chain
        assert new_m is None
        continue
      np.testing.assert_allclose(pending(np.asarray(new_m), new_padded)[:padded],
                                 pending(np.asarray(old_m), padded)[:new_padded],
                                 rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(got.params)[:padded], np.asarray(state.params)[
        :new_padded])
    assert int(got.step) == 3 and (np.asarray(got.comm_state.count) == 3).all()
    stats_old = jax.tree.leaves(state.batch_stats)[0]
    stats_new = jax.tree.leaves(got.batch_stats)[0]
    np.testing.assert_allclose(np.asarray(stats_new)[0], np.asarray(stats_old).mean(0), rtol=1e-6)
    new_step = jit_train_step(new_setup, got)  # and it trains on
    got, metrics = new_step(got, *shard_batch(new_mesh, train.images[:64], train.labels[:64]))
    assert np.isfinite(float(metrics["loss"]))
  ckpt.close()


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
def test_a_checkpoint_of_another_model_is_refused(tmp_path):
  config = small_config("hitopk")
  _, _, state = build(config, 2, 2)
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=1)
  ckpt.save(1, state)
  _, _, other = build(validate(override(config, {"model.num_filters": 8})), 2, 2)
  with pytest.raises(ValueError, match="does not fit this run: params has shape"):
    ckpt.restore(1, other)
  ckpt.close()


@pytest.mark.parametrize("local", [2, 4])
def test_a_checkpoint_with_the_chain_by_position_restores(tmp_path, local):
  """A state written before the chain's parts had names (its `inner_state` a plain tuple,
  "inner_state.0.count") restores into the named `ChainState`, resized (4 -> 8 workers) too."""
  config = small_config("allgather")
  _, _, state = build(config, 2, 2)
  opt = state.opt_state
  old = state._replace(opt_state=opt._replace(inner_state=tuple(opt.inner_state)))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=1)
  ckpt.save(1, old)
  ckpt.wait()
  assert "opt_state.inner_state.0.count" in ckpt.saved_shapes(1)
  _, _, like = build(config, 2, local)
  got = ckpt.restore(1, like)
  assert jax.tree.structure(got) == jax.tree.structure(like)
  assert got.chain.exchange.count.shape == (2 * local,)
  for a, b in zip(jax.tree.leaves(got.chain.optimizer), jax.tree.leaves(state.chain.optimizer),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ckpt.close()
