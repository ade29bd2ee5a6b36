"""The one-step pipelined exchange (sparsejax.train.pipelined): each gradient applied one step
late, the same arithmetic in both placements, a resumed run equal to the uninterrupted one."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from sparsejax import data as data_lib
from sparsejax import models, optim
from sparsejax.train import config as config_lib
from sparsejax.train import pipelined as pipeline_lib
from sparsejax.train import train_and_evaluate
from sparsejax.train.optimizer import compressor, decay_mask, train_chain
from sparsejax.train.plan import make_plan
from sparsejax.train.state import create_train_state, shard_batch
from sparsejax.train.step import cross_entropy
from tests.conftest import make_mesh
from tests.test_train import read_csv, small_config


def _meshes(placement):
  if placement == "program":
    return make_mesh(2, 2), None
  state_devices, compute_devices = pipeline_lib.split_devices(jax.devices())
  return (Mesh(np.asarray(state_devices).reshape(2, 2), ("node", "local")),
          Mesh(np.asarray(compute_devices).reshape(2, 2), ("node", "local")))


def _batches(n, size=60):
  train, _ = data_lib.digits()
  rng = np.random.default_rng(7)
  picks = [rng.choice(len(train.labels), size, replace=False) for _ in range(n)]
  return [(train.images[p], train.labels[p]) for p in picks]


def _pipelined(placement, make_tx, steps, level_of=lambda step: None, start=0, predict="",
               make_optimizer=None):
  """Runs `steps` pipelined steps of a small MLP on digits; returns (setup, state, metrics).
  make_optimizer: layout -> the optimizer behind the exchange, for predict "local"."""
  mesh, compute_mesh = _meshes(placement)
  model = models.build("mlp", num_classes=10, hidden=(37,))
  setup, state = create_train_state(model, mesh, (8, 8, 1), make_tx, seed=3, num_classes=10)
  batches = _batches(steps)
  state = pipeline_lib.with_pending(setup, state, shard_batch(mesh, *batches[0]))
  params0 = np.asarray(state.params)
  run = pipeline_lib.Pipeline(setup, state, level_of, steps, placement, compute_mesh, start,
                              predict, make_optimizer and make_optimizer(setup.layout))
  counts = []
  for step, (images, labels) in enumerate(batches):
    state, metrics = run(step, state, *shard_batch(mesh, images, labels))
    counts.append(len(metrics))
  return setup, params0, state, counts, model, batches


@pytest.mark.parametrize("placement,start,predict", [  # (the rest: the integration tier)
    ("program", 0, ""), pytest.param("device", 0, "", marks=pytest.mark.integration),
    pytest.param("device", 2, "", marks=pytest.mark.integration),
    pytest.param("program", 0, "last", marks=pytest.mark.integration), ("device", 2, "last")])
def test_each_gradient_is_applied_one_step_late(placement, start, predict):
  """Dense SGD, pipelined from step `start` (unpipelined before): the gradient of step t is
  taken at the parameters before the update of step t-1's gradient (with `predict` "last", at
  those parameters plus the last pipelined update); checked against optax.sgd on the whole batch
  (the workers' mean)."""
  lr, steps = 0.3, 6

  def make_tx(layout):
    return train_chain(compressor(_dense(), make_plan(_dense(), 10)),
                       optim.fused_sgd(lr, momentum=None, weight_decay=0.0,
                                       weight_decay_mask=decay_mask, layout=layout))

  setup, params0, state, counts, model, batches = _pipelined(placement, make_tx, steps,
                                                             start=start, predict=predict)
  assert counts == [1] * start + [0] + [1] * (steps - start - 2) + [2]  # each applied once
  assert int(state.step) == steps

  def loss(flat, images, labels):
    logits = model.apply({"params": setup.layout.unravel(flat)}, images, train=False)
    return jnp.mean(cross_entropy(logits, jnp.asarray(labels)))

  grad = jax.jit(jax.grad(loss))
  tx = optax.sgd(lr)
  want = jnp.asarray(params0)
  opt_state, late, last = tx.init(want), None, jnp.zeros_like(want)
  for t, (images, labels) in enumerate(batches):
    g = grad(want, images, labels)  # at the parameters before the late update
    if t < start:  # unpipelined
      update, opt_state = tx.update(g, opt_state)
      want = optax.apply_updates(want, update)
      continue
    if predict:  # extrapolated by the last pipelined update
      g = grad(want + last, images, labels)
    if late is not None:
      last, opt_state = tx.update(late, opt_state)
      want = optax.apply_updates(want, last)
    late = g
  update, opt_state = tx.update(late, opt_state)
  want = optax.apply_updates(want, update)
  np.testing.assert_allclose(np.asarray(state.params), np.asarray(want), rtol=2e-5, atol=2e-6)


def _model_loss(model, setup):
  def loss(flat, images, labels):
    logits = model.apply({"params": setup.layout.unravel(flat)}, images, train=False)
    return jnp.mean(cross_entropy(logits, jnp.asarray(labels)))
  return jax.jit(jax.grad(loss))


@pytest.mark.parametrize("placement,start", [  # (the rest: the integration tier)
    ("program", 0), pytest.param("device", 2, marks=pytest.mark.integration)])
def test_local_prediction_takes_each_gradient_where_its_own_update_would_land(placement, start):
  """Dense Adam, weight prediction "local": each worker's gradient of step t is taken at the
  parameters plus the update Adam (its state before step t-1's gradient is applied) makes of
  that worker's own gradient of step t-1; the workers' mean applied one step late. Checked
  against optax.adam, worker by worker (4 workers, 15 examples each)."""
  lr, steps, workers = 0.01, 6, 4

  def make_optimizer(layout):
    return optim.fused_adamw(lr, weight_decay=0.0, mask=decay_mask, layout=layout)

  def make_tx(layout):
    return train_chain(compressor(_dense(), make_plan(_dense(), 10)), make_optimizer(layout))

  setup, params0, state, counts, model, batches = _pipelined(
      placement, make_tx, steps, start=start, predict="local", make_optimizer=make_optimizer)
  grad, tx = _model_loss(model, setup), optax.adam(lr)
  want = jnp.asarray(params0)
  opt_state, late = tx.init(want), [jnp.zeros_like(want)] * workers
  for t, (images, labels) in enumerate(batches):
    if t < start:  # unpipelined
      update, opt_state = tx.update(grad(want, images, labels), opt_state)
      want = optax.apply_updates(want, update)
      continue
    own = []
    for w, rows in enumerate(np.split(np.arange(len(labels)), workers)):
      shift, _ = tx.update(late[w], opt_state)  # the worker's guess of where g lands
      own.append(grad(want + shift, images[rows], labels[rows]))
    if t > start:
      update, opt_state = tx.update(sum(late) / workers, opt_state)
      want = optax.apply_updates(want, update)
    late = own
  update, opt_state = tx.update(sum(late) / workers, opt_state)
  want = optax.apply_updates(want, update)
  np.testing.assert_allclose(np.asarray(state.params), np.asarray(want), rtol=2e-5, atol=2e-6)
  # and not the run without prediction (the check can fail)
  _, _, plain, _, _, _ = _pipelined(placement, make_tx, steps, start=start)
  assert not np.allclose(np.asarray(plain.params), np.asarray(want), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("placement", ["program", "device"])
def test_a_non_finite_late_gradient_is_not_guessed_from(placement):
  """"local" with a non-finite pending gradient (which the exchange will skip) takes the next
  gradient at the parameters themselves: finite, and equal to the unpredicted one."""
  def make_optimizer(layout):
    return optim.fused_adamw(0.01, weight_decay=0.0, mask=decay_mask, layout=layout)

  def make_tx(layout):
    return train_chain(compressor(_dense(), make_plan(_dense(), 10)), make_optimizer(layout))

  mesh, compute_mesh = _meshes(placement)
  model = models.build("mlp", num_classes=10, hidden=(37,))
  setup, state = create_train_state(model, mesh, (8, 8, 1), make_tx, seed=3, num_classes=10)
  batch = shard_batch(mesh, *_batches(1)[0])
  state = pipeline_lib.with_pending(setup, state, batch)
  bad = state.pending.grads.at[1, 5].set(jnp.nan)  # one worker's gradient
  state = state._replace(pending=state.pending._replace(grads=bad))
  runs = {predict: pipeline_lib.Pipeline(setup, state, lambda step: None, 4, placement,
                                         compute_mesh, 0, predict,
                                         make_optimizer(setup.layout) if predict else None)
          for predict in ("local", "")}
  got = {predict: np.asarray(run.gradient(state, batch).grads) for predict, run in runs.items()}
  assert np.isfinite(got["local"]).all()
  np.testing.assert_allclose(got["local"][1], got[""][1], rtol=1e-6, atol=1e-7)


def _dense():
  config = config_lib.default_config()
  config.compression.algorithm = "dense"
  config.compression.density = 1.0
  return config


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
def test_both_placements_compute_the_same_run():
  """HiTopKComm with error feedback and AdamW through a density warm-up: the two placements
  (one program; two devices per worker) give the same parameters and residuals."""
  steps = 7
  compression = config_lib.default_config()
  compression.compression.density = 0.05
  compression.compression.warmup_epochs = 1.0  # (its levels: 0.05, 0.2, ...)
  plan = make_plan(config_lib.validate(compression), 10)
  levels = {s: (0 if s < 3 else 1) for s in range(steps)}

  def make_tx(layout):
    return train_chain(compressor(compression, plan, layout=layout),
                       optim.fused_adamw(3e-3, weight_decay=0.01, mask=decay_mask,
                                         layout=layout))

  got = {}
  for placement in ("program", "device"):
    _, _, state, counts, _, _ = _pipelined(placement, make_tx, steps, levels.get)
    got[placement] = state
  a, b = got["program"], got["device"]
  np.testing.assert_allclose(np.asarray(a.params), np.asarray(b.params), rtol=1e-6, atol=1e-7)
  for x, y in zip(jax.tree.leaves(a.comm_state), jax.tree.leaves(b.comm_state)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
@pytest.mark.parametrize("predict", ["", "local"])
def test_a_resumed_pipelined_run_equals_the_uninterrupted_run(tmp_path, predict):
  """The pending gradient travels in the checkpoint: killed after step 10, resumed, the run
  logs exactly what the uninterrupted one did (with "local" prediction too: its guess is made
  from the pending gradient and the optimizer's state, both in the checkpoint)."""
  config = small_config(**{"model.name": "mlp", "model.hidden": (48,),
                           "overlap.pipeline": "program",
                           "overlap.predict": predict,
                           "data.resize_schedule": ((0, 8),)})
  whole = str(tmp_path / "whole")
  summary = train_and_evaluate(config, whole, progress=False)
  assert summary["steps"] == 22
  rows = read_csv(os.path.join(whole, "train.csv"))
  assert [int(r["step"]) for r in rows] == list(range(2, 23))  # step 1 only computed
  resumed = str(tmp_path / "resumed")
  shutil.copytree(whole, resumed)
  for step in ("20", "22"):
    shutil.rmtree(os.path.join(resumed, "checkpoints", step))
  os.remove(os.path.join(resumed, "summary.json"))
  train_and_evaluate(config, resumed, progress=False)
  assert read_csv(os.path.join(resumed, "train.csv")) == rows
  assert (read_csv(os.path.join(resumed, "eval.csv"))
          == read_csv(os.path.join(whole, "eval.csv")))


def test_bad_pipeline_settings_are_named():
  config = small_config()
  config.overlap.pipeline = "async"
  with pytest.raises(ValueError, match="overlap.pipeline.*'program' or 'device'"):
    config_lib.validate(config)
  config.overlap.pipeline = "device"
  config.compression.algorithm = "auto"
  with pytest.raises(ValueError, match="overlap.pipeline.*auto"):
    config_lib.validate(config)
  with pytest.raises(ValueError, match="even number of devices per process"):
    pipeline_lib.split_devices(jax.devices()[:3])
  config = small_config(**{"overlap.predict": "last"})
  with pytest.raises(ValueError, match="overlap.predict.*unless overlap.pipeline"):
    config_lib.validate(config)
  config = small_config(**{"overlap.pipeline": "device", "overlap.predict": "next"})
  with pytest.raises(ValueError, match="predict' = 'next'.*'last' or 'local'"):
    config_lib.validate(config)
  config = small_config(**{"overlap.pipeline": "device", "compression.algorithm": "hitopk",
                           "compression.momentum_correction": True,
                           "overlap.predict": "local"})
  with pytest.raises(ValueError, match="overlap.predict.*momentum_correction"):
    config_lib.validate(config)


def test_a_frozen_variance_is_refused_where_it_would_not_run():
  """optimizer.freeze_variance_epochs: >= 0, and only for adamw without Adam correction in the
  exchange (tests/test_optim.py checks the frozen optimizer itself)."""
  config = small_config(**{"optimizer.name": "adamw", "optimizer.freeze_variance_epochs": -1.0})
  with pytest.raises(ValueError, match="freeze_variance_epochs.*>= 0"):
    config_lib.validate(config)
  config.optimizer.freeze_variance_epochs = 0.5
  config.compression.momentum_correction = True
  with pytest.raises(ValueError, match="freeze_variance_epochs.*adamw without"):
    config_lib.validate(config)
  config.compression.momentum_correction = False
  config.optimizer.name = "sgd"
  with pytest.raises(ValueError, match="freeze_variance_epochs.*adamw without"):
    config_lib.validate(config)
