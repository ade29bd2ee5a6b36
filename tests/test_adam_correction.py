"""Adam correction (`topk_allreduce(..., correction=AdamCorrection(b1, b2, eps))`): each
worker's Adam moments before the selection. Dense, it is AdamW exactly (optax.adamw, the node's
mean gradient on a hierarchical mesh); sparse, nothing is lost (what was sent plus what is kept
is the sum of the Adam directions); the trainer builds it from `momentum_correction` with
adamw."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from sparsejax.compress import topk_allreduce
from sparsejax.feedback import AdamCorrection
from sparsejax.train import config as config_lib
from tests.conftest import make_mesh

ADAM = AdamCorrection(0.9, 0.98, 1e-8)


def _mask(tree):
  return jax.tree.map(lambda x: x.ndim > 1, tree)


def _params(rng):
  return {"w": rng.standard_normal((7, 5)).astype(np.float32),
          "b": rng.standard_normal(3).astype(np.float32)}


def test_dense_adam_correction_is_optax_adamw_on_the_node_mean():
  """On a 1 x 3 mesh (one node, 3 workers, HiTopKComm at density 1), the step is optax.adamw of
  the mean gradient (the shard of the node's summed gradient is scaled back to a mean)."""
  rng = np.random.default_rng(11)
  params = _params(rng)
  steps = [jax.tree.map(lambda x: rng.standard_normal((3,) + x.shape).astype(np.float32),
                        params) for _ in range(4)]
  tx = optax.chain(topk_allreduce(1.0, correction=ADAM, selector="exact"),
                   optax.add_decayed_weights(0.1, _mask), optax.sgd(0.01))
  ref = optax.adamw(0.01, b1=ADAM.b1, b2=ADAM.b2, eps=ADAM.eps, weight_decay=0.1, mask=_mask)

  def body(p, grads):
    state = tx.init(p)
    for g in grads:
      u, state = tx.update(jax.tree.map(lambda x: x[0], g), state, p)
      p = optax.apply_updates(p, u)
    return p

  workers = P(("node", "local"))
  got = jax.jit(jax.shard_map(body, mesh=make_mesh(1, 3), in_specs=(P(), workers),
                              out_specs=P(), check_vma=False))(params, steps)
  want, state = params, ref.init(params)
  for g in steps:
    u, state = ref.update(jax.tree.map(lambda x: x.mean(0), g), state, want)
    want = optax.apply_updates(want, u)
  for k in params:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_sparse_adam_correction_loses_nothing():
  """One worker, density 0.2: the sum of what was sent plus the residual equals the sum of the
  Adam directions of the gradients (optax.scale_by_adam, an independent reference)."""
  rng = np.random.default_rng(12)
  params = _params(rng)
  grads = [jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), params)
           for _ in range(6)]
  tx = topk_allreduce(0.2, correction=ADAM, selector="exact", algorithm="allgather",
                      axis_name="batch")

  def body(p):
    state, sent = tx.init(p), jax.tree.map(jax.numpy.zeros_like, p)
    for g in grads:
      u, state = tx.update(g, state, p)
      sent = jax.tree.map(lambda a, b: a + b, sent, u)
    return sent, state.feedback.residual

  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("batch",))
  sent, residual = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(),
                                         check_vma=False))(params)
  ref = optax.scale_by_adam(b1=ADAM.b1, b2=ADAM.b2, eps=ADAM.eps)
  state, total = ref.init(params), jax.tree.map(np.zeros_like, params)
  for g in grads:
    d, state = ref.update(g, state)
    total = jax.tree.map(lambda a, b: a + b, total, d)
  flat_sent = np.concatenate([np.ravel(sent[k]) for k in ("b", "w")])
  flat_total = np.concatenate([np.ravel(total[k]) for k in ("b", "w")])
  np.testing.assert_allclose(flat_sent + np.asarray(residual)[:flat_sent.size], flat_total,
                             rtol=1e-5, atol=1e-5)
  assert np.count_nonzero(np.asarray(residual)) > 0  # something was held back


def test_adam_correction_refuses_what_does_not_fit():
  with pytest.raises(ValueError, match="needs a sparse algorithm"):
    topk_allreduce(0.01, algorithm="dense", correction=ADAM)
  with pytest.raises(ValueError, match=r"b1, b2 in \[0, 1\)"):
    topk_allreduce(0.01, correction=AdamCorrection(1.0, 0.98, 1e-8))
  with pytest.raises(ValueError, match="AdamCorrection or None"):
    topk_allreduce(0.01, correction=(0.9, 0.98, 1e-8))


def test_the_config_turns_it_on_with_adamw_and_names_what_is_allowed():
  cfg = config_lib.default_config()
  cfg.optimizer.name = "adamw"
  cfg.compression.momentum_correction = True
  config_lib.validate(cfg)
  cfg.optimizer.name = "lamb"
  with pytest.raises(ValueError, match="or adamw, when compression.momentum_correction"):
    config_lib.validate(cfg)


def test_a_loss_target_is_reached_at_or_below_and_a_bad_metric_is_named():
  assert config_lib.target_reached("loss", 4.5, 4.55)
  assert not config_lib.target_reached("loss", 4.6, 4.55)
  assert config_lib.target_reached("accuracy", 0.9, 0.85)
  cfg = config_lib.default_config()
  cfg.target_metric = "perplexity"
  with pytest.raises(ValueError, match="'perplexity'.*one of '', 'accuracy'"):
    config_lib.validate(cfg)


def test_the_trainer_builds_either_form_from_the_config():
  """`adam_first_moment="before"`: the compressor carries both moments and the optimizer no
  momentum; "after": the compressor only the second moment (its candidates are gradients over
  the worker's RMS) and a momentum b1 after the exchange."""
  from sparsejax.flat import FlatLayout
  from sparsejax.train.optimizer import build_optimizer, chain_parts
  from sparsejax.train.plan import make_plan
  cfg = config_lib.default_config()
  cfg.optimizer.name = "adamw"
  cfg.compression.momentum_correction = True
  layout = FlatLayout.from_tree({"w": np.zeros((7, 5), np.float32)})
  mesh = make_mesh(2, 1)
  for where in ("before", "after"):
    cfg.experimental.adam_first_moment = where
    config = config_lib.validate(cfg)
    tx = build_optimizer(config, make_plan(config, 10), layout)

    def init(p, tx=tx):
      return tx.init(p)
    state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=P(),
                                  check_vma=False))(np.zeros(layout.padded_size, np.float32))
    parts = chain_parts(state)
    exchange, optimizer = parts.exchange, parts.optimizer
    assert exchange.feedback.second is not None and exchange.feedback.velocity is not None
    has_momentum = any(np.shape(x) == (layout.padded_size,)
                       for x in jax.tree.leaves(optimizer))
    assert has_momentum == (where == "after"), where
