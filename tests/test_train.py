"""The main job end to end: train_and_evaluate, resume, dense equivalence, bad input, skips."""

import csv
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh, override
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparsejax import data as data_lib
from sparsejax import models
from sparsejax.train import TooManySkippedSteps, default_config, train_and_evaluate, validate
from sparsejax.train import config as config_lib
from sparsejax.train import optimizer as optimizer_lib
from sparsejax.train.optimizer import compressor, decay_mask, fused_optimizer, train_chain
from sparsejax.train.plan import make_plan
from sparsejax.train.state import create_train_state, from_config, shard_batch
from sparsejax.train.step import jit_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_config(**changes):
  """The quickstart's recipe, shortened: 22 steps of ResNet-20 on digits, resized from 8 to 12 px
  after the first epoch."""
  config = config_lib.load_config(os.path.join(ROOT, "configs", "quickstart.py"))
  config.num_epochs = 2.0
  config.log_every_steps = 1
  config.eval_every_steps = 10
  config.checkpoint_every_steps = 10
  config.compression.warmup_epochs = 1.0
  config.data.resize_schedule = ((0, 8), (1, 12))  # progressive resizing: 8 px, then 12 px
  return override(config, changes)


def read_csv(path):
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("full"))
  summary = train_and_evaluate(small_config(), workdir, progress=False)
  return workdir, summary


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
def test_run_writes_metrics_events_summary_and_checkpoints(full_run):
  workdir, summary = full_run
  train_rows = read_csv(os.path.join(workdir, "train.csv"))
  assert [int(r["step"]) for r in train_rows] == list(range(1, 23))
  for name in ("loss", "accuracy", "top5_accuracy", "grad_norm", "density", "bytes_sent",
               "skipped", "learning_rate"):
    assert name in train_rows[0]
  assert float(train_rows[-1]["loss"]) < float(train_rows[0]["loss"])
  # DGC warm-up: the density starts high and reaches the target.
  assert float(train_rows[0]["density"]) > 0.01
  assert float(train_rows[-1]["density"]) == pytest.approx(0.01)
  eval_rows = read_csv(os.path.join(workdir, "eval.csv"))
  assert [int(r["step"]) for r in eval_rows] == [10, 20, 22]
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "20", "22"]
  with open(os.path.join(workdir, "summary.json")) as f:
    on_disk = json.load(f)
  for key in ("wall_time_s", "steps", "final_eval", "best_eval", "bytes_sent", "skipped_steps"):
    assert key in on_disk
  assert on_disk["steps"] == 22 and on_disk["skipped_steps"] == 0
  assert set(on_disk["final_eval"]) >= {"accuracy", "loss"}
  assert on_disk["final_eval"]["accuracy"] > 0.2  # 22 steps, resized at step 11; chance is 0.1
  assert summary["best_eval"]["accuracy"] >= summary["final_eval"]["accuracy"]


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
def test_resumed_run_has_exactly_the_metrics_of_the_uninterrupted_run(full_run, tmp_path):
  workdir, _ = full_run
  resumed = str(tmp_path / "resumed")
  shutil.copytree(workdir, resumed)
  for step in ("20", "22"):  # as if the run had died after the checkpoint at step 10
    shutil.rmtree(os.path.join(resumed, "checkpoints", step))
  os.remove(os.path.join(resumed, "summary.json"))
  train_and_evaluate(small_config(), resumed, progress=False)
  want, got = (read_csv(os.path.join(d, "train.csv")) for d in (workdir, resumed))
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for w, g in zip(want, got):
    assert w == g, (w, g)
  assert read_csv(os.path.join(resumed, "eval.csv")) == read_csv(os.path.join(workdir, "eval.csv"))


@pytest.mark.parametrize("decay_in", [
    "optimizer", pytest.param("gradient", marks=pytest.mark.slow)])  # slow: CI's 15-min budget
@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
def test_dense_density_one_equals_plain_optax_with_pmean(rng, decay_in):
  """The trainer with the dense all-reduce and the fused SGD gives the loss curve of a plain
  shard_map step: optax.sgd on the pytree after a pmean of the gradients. The weight decay is
  either the optimizer's or the trainer's (added to the gradient, as with momentum correction):
  the same thing for a dense mean."""
  config = default_config()
  config.compression.algorithm = "dense"
  config.compression.density = 1.0
  config.optimizer.name = "sgd"
  config.optimizer.nesterov = True
  config.optimizer.weight_decay = 1e-3 if decay_in == "optimizer" else 0.0
  model = models.build("resnet20", num_classes=10, num_filters=4)
  mesh = make_mesh(2, 4)

  def make_tx(layout):
    compress = compressor(config, make_plan(config, 10))
    if decay_in == "gradient":  # in front of the compressor, as with momentum correction
      compress = optimizer_lib.weight_decay_first(compress, 1e-3, layout)
    return train_chain(compress, fused_optimizer(config.optimizer, 0.05, layout))

  setup, state = create_train_state(model, mesh, (8, 8, 1), make_tx, seed=1, num_classes=10)
  # no zero-size array anywhere in the state (the dense algorithm has no residual): jax 0.11.2's
  # XLA:CPU compiler segfaults on a sharded zero-size array in the jitted shard_map step
  assert state.comm_state.feedback is None
  assert all(x.size for x in jax.tree.leaves(state))
  train, _ = data_lib.digits()
  batches = [(train.images[i * 64:(i + 1) * 64], train.labels[i * 64:(i + 1) * 64])
             for i in range(5)]
  step = jit_train_step(setup, state)
  got = []
  for images, labels in batches:
    state, metrics = step(state, *shard_batch(mesh, images, labels))
    got.append(float(metrics["loss"]))

  variables = jax.jit(lambda r: model.init(r, jnp.zeros((1, 8, 8, 1)), train=False))(
      jax.random.key(1, impl="rbg"))  # the trainer's initialisation
  params, stats = variables["params"], variables["batch_stats"]
  tx = optax.chain(optax.add_decayed_weights(1e-3, decay_mask),
                   optax.sgd(0.05, momentum=0.9, nesterov=True))
  opt_state = tx.init(params)
  spec = P(("node", "local"))

  def body(params, opt_state, stats, images, labels):
    stats = jax.tree.map(lambda s: s[0], stats)

    def loss_fn(p):
      logits, mut = model.apply({"params": p, "batch_stats": stats}, images, train=True,
                                mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, 10)).mean()
      return loss, mut["batch_stats"]
    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    grads = jax.lax.pmean(grads, ("node", "local"))
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            jax.tree.map(lambda s: s[None], stats), jax.lax.pmean(loss, ("node", "local")))

  ref_step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), spec, spec, spec),
                                   out_specs=(P(), P(), spec, P()), check_vma=False))
  stats = jax.tree.map(lambda s: jax.device_put(np.broadcast_to(s, (8,) + s.shape),
                                                NamedSharding(mesh, spec)), stats)
  want = []
  for images, labels in batches:
    params, opt_state, stats, loss = ref_step(params, opt_state, stats,
                                              *shard_batch(mesh, images, labels))
    want.append(float(loss))
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("changes,match", [
    ({"batch_size": 100}, "100.*8 devices"),
    ({"mesh.nodes": 3, "mesh.local": 2}, "3 x 2.*8 devices"),
    ({"data.path": "no/such/dir"}, "no/such/dir"),
])
def test_bad_input_fails_before_compiling(tmp_path, changes, match):
  with pytest.raises(ValueError, match=match):
    train_and_evaluate(small_config(**changes), str(tmp_path), progress=False)


def test_unknown_keys_and_wrong_types_name_close_matches():
  config = small_config()
  with pytest.raises(ValueError, match="did you mean optimizer"):
    validate(config_lib.apply_overrides(config, ["optimiser.name=sgd"]))
  with pytest.raises(ValueError, match="did you mean learning_rate"):
    validate(config_lib.apply_overrides(config, ["optimizer.learning_rte=0.1"]))
  with pytest.raises(ValueError, match="batch_size.*int.*'big'"):
    validate(config_lib.apply_overrides(config, ["batch_size=big"]))
  raw = config.to_dict()
  raw["compresion"] = {}
  with pytest.raises(ValueError, match="did you mean compression"):
    validate(raw)
  ok = validate(config_lib.apply_overrides(config, ["optimizer.learning_rate=1", "seed=3"]))
  assert ok.optimizer.learning_rate == 1.0 and isinstance(ok.optimizer.learning_rate, float)


def test_workdir_that_is_not_writable(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with pytest.raises(ValueError, match="not writable"):
    train_and_evaluate(small_config(), str(blocker / "run"), progress=False)


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
def test_non_finite_gradients_are_skipped_and_stop_the_run(tmp_path, monkeypatch):
  def poisoned(seed, path):
    train, test = data_lib.digits(seed)
    images = train.images.copy()
    images[:] = np.nan  # every batch: non-finite gradients on every worker
    return data_lib.ArrayDataset(images, train.labels, 10), test

  monkeypatch.setitem(data_lib.small.DATASETS, "poisoned", poisoned)
  config = small_config(**{"data.name": "poisoned", "max_consecutive_skips": 3,
                           "checkpoint_every_steps": 2})
  with pytest.raises(TooManySkippedSteps, match="3 consecutive steps"):
    train_and_evaluate(config, str(tmp_path), progress=False)
  rows = read_csv(os.path.join(tmp_path, "train.csv"))
  assert [float(r["skipped"]) for r in rows] == [1.0, 1.0, 1.0]
  # The checkpoint written before the stop holds the initial parameters, untouched by NaNs.
  assert os.listdir(os.path.join(tmp_path, "checkpoints")) == ["2"]


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
def test_ctrl_c_saves_a_checkpoint_and_the_run_resumes_from_it(tmp_path, monkeypatch):
  real_batch = data_lib.EpochBatcher.batch

  def interrupt_at_step_5(self, step):
    if step == 5:
      raise KeyboardInterrupt
    return real_batch(self, step)

  monkeypatch.setattr(data_lib.EpochBatcher, "batch", interrupt_at_step_5)
  # (a small MLP at one image size for ResNet-20: the interrupt, its checkpoint and the resume
  # are the same for any model, and the two runs' ResNet compiles were most of this test's time
  # on 2 cores, 17 s with a warm compilation cache, 67 s cold; ResNet-20's resume is
  # test_resumed_run_has_exactly_the_metrics_of_the_uninterrupted_run)
  config = small_config(**{"model.name": "mlp", "model.hidden": (64,),
                           "data.resize_schedule": ()})
  summary = train_and_evaluate(config, str(tmp_path), progress=False)
  assert summary["interrupted"] and summary["steps"] == 5
  assert os.listdir(tmp_path / "checkpoints") == ["5"]
  monkeypatch.setattr(data_lib.EpochBatcher, "batch", real_batch)
  summary = train_and_evaluate(config, str(tmp_path), progress=False)
  assert not summary["interrupted"] and summary["steps"] == 22
  assert [int(r["step"]) for r in read_csv(tmp_path / "train.csv")] == list(range(1, 23))


def test_cli_info_shows_devices_versions_and_the_mesh(capsys):
  from sparsejax import cli
  assert cli.main(["info", "--config", os.path.join(ROOT, "configs", "quickstart.py")]) == 0
  out = capsys.readouterr().out
  assert "jax" in out and "devices: 8" in out and "node x local = 2 x 4" in out
  assert cli.main(["info", "--config", os.path.join(ROOT, "configs",
                                                    "dawnbench_resnet50.py")]) == 2
  assert "16 x 8" in capsys.readouterr().out


def test_checkpoints_hold_zero_size_arrays(tmp_path):
  """Orbax refuses to write zero-size arrays (a user's state may hold them; sparsejax's own
  states use None instead): the Checkpointer leaves them out and rebuilds them on restore."""
  from sparsejax.train.checkpoint import Checkpointer
  state = {"residual": jnp.zeros((0,), jnp.float32), "w": jnp.arange(5.0), "step": jnp.int32(3),
           "nested": {"empty": jnp.zeros((2, 0), jnp.bfloat16), "b": jnp.ones((2, 3))}}
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
  ckpt.save(3, state)
  like = jax.tree.map(jnp.zeros_like, state)
  got = ckpt.restore(ckpt.latest_step(), like)
  ckpt.close()
  assert jax.tree.structure(got) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state), strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
def test_momentum_correction_moves_the_momentum_into_the_compressor(tmp_path):
  """compression.momentum_correction: the fused SGD runs without momentum, the compressor keeps
  a velocity beside the residual (Nesterov as configured), training runs, and the state survives
  a checkpoint round trip."""
  from sparsejax.train.checkpoint import Checkpointer
  from sparsejax.train.optimizer import MomentumCorrection, momentum_correction
  config = validate(small_config(**{"compression.momentum_correction": True,
                                    "compression.density": 0.02,
                                    "experimental.momentum_masking": True,
                                    "model.num_filters": 4}))
  assert momentum_correction(config, make_plan(config, 10)) == MomentumCorrection(
      momentum=0.9, nesterov=True, masking=True)
  assert config.optimizer.momentum == 0.9  # the config is not rewritten
  mesh = make_mesh(2, 4)
  setup, state = from_config(config, make_plan(config, 10), mesh, 10, (8, 8, 1))
  optimizer_state = state.chain.optimizer
  assert optimizer_state.momentum is None  # the optimizer has no momentum of its own
  feedback = state.comm_state.feedback
  assert feedback.velocity is not None and feedback.velocity.shape == feedback.residual.shape
  train, _ = data_lib.digits()
  step = jit_train_step(setup, state)
  for i in range(3):
    state, metrics = step(state, *shard_batch(mesh, train.images[i * 128:(i + 1) * 128],
                                              train.labels[i * 128:(i + 1) * 128]))
    assert np.isfinite(float(metrics["loss"]))
  velocity = np.asarray(state.comm_state.feedback.velocity)
  assert np.abs(velocity).sum() > 0  # accumulated ...
  shard = velocity.shape[1]  # ... and masked where sent: at least k zeros on every worker
  assert ((velocity == 0).sum(1) >= round(float(state.comm_state.density[0]) * shard)).all()
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=1)
  ckpt.save(3, state)
  got = ckpt.restore(3, jax.tree.map(jnp.zeros_like, state))
  ckpt.close()
  np.testing.assert_array_equal(np.asarray(got.comm_state.feedback.velocity), velocity)


def test_lars_first_is_optax_lars_decay_and_trust_ratio(rng):
  """`lars_first` hands its inner transform optax.lars's direction before the learning rate:
  the masked weight decay, then each kernel's trust ratio (a zero kernel keeps ratio 1), on
  fresh random leaves of odd sizes, against optax's own transforms on the pytree."""
  from sparsejax import optim
  shapes = {"conv": {"kernel": (3, 3, 5, 7), "bias": (7,)}, "dense": {"kernel": (13, 11)},
            "zero": {"kernel": (4, 6)}, "norm": {"scale": (9,)}}
  params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))
  params["zero"]["kernel"] = jnp.zeros((4, 6), jnp.float32)
  grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32),
                       params)
  layout = optim.flat_layout(params, pad_to=4)
  wd, tc = 3e-3, 0.02
  tx = optimizer_lib.lars_first(optax.identity(), wd, tc, layout)
  flat_p = layout.ravel(params, jnp.float32)
  got, _ = jax.jit(tx.update)(layout.ravel(grads, jnp.float32), tx.init(flat_p), flat_p)
  want_tx = optax.chain(optax.add_decayed_weights(wd, decay_mask),
                        optax.masked(optax.scale_by_trust_ratio(trust_coefficient=tc),
                                     decay_mask))
  want, _ = want_tx.update(grads, want_tx.init(params), params)
  for a, b in zip(jax.tree.leaves(layout.unravel(got)), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)
  zero = layout.unravel(got)["zero"]["kernel"]  # ratio 1 on a zero kernel: the gradient
  np.testing.assert_array_equal(np.asarray(zero), np.asarray(grads["zero"]["kernel"]))


def _lars_moves(batch_of, common=(), **option):
  """The parameters' moves over three steps (`batch_of(i) -> (images, labels)` for all 8
  workers), with the dense trainer's LARS and with LARS's momentum correction at density 1
  (nothing held back, no masking; `option`: its further config), `common` in both."""
  changes = {"optimizer.name": "lars", "optimizer.learning_rate": 2.0,
             "optimizer.trust_coefficient": 0.01, "optimizer.weight_decay": 1e-3,
             "optimizer.warmup_epochs": 0.0, "optimizer.schedule": "constant",
             "model.num_filters": 4, "compression.warmup_epochs": 0.0, **dict(common)}
  mesh = make_mesh(2, 4)
  moves = []
  for more in ({"compression.algorithm": "dense"},
               {"compression.algorithm": "hitopk", "compression.density": 1.0,
                "compression.momentum_correction": True,
                "experimental.momentum_masking": False, **option}):
    config = validate(small_config(**changes, **more))
    setup, state = from_config(config, make_plan(config, 10), mesh, 10, (8, 8, 1))
    if more["compression.algorithm"] == "hitopk":
      assert state.chain.optimizer.momentum is None  # the momentum is in the compressor
    start = np.asarray(state.params, np.float64)
    step = jit_train_step(setup, state)
    for i in range(3):
      state, _ = step(state, *shard_batch(mesh, *batch_of(i)))
    moves.append(np.asarray(state.params, np.float64) - start)
  return moves


@pytest.mark.parametrize("nesterov,feedback_in", [  # (slow: CI's 15-minute budget)
    (False, "gradients"), pytest.param(True, "gradients", marks=pytest.mark.slow),
    pytest.param(False, "steps", marks=pytest.mark.slow)])
@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
def test_lars_with_momentum_correction_is_lars_where_nothing_is_held_back(nesterov, feedback_in):
  """LARS with momentum correction (each worker's decay and trust ratio in front of the
  compressor, its momentum in it, a plain SGD behind it): with every coordinate sent (density 1,
  no masking) and every worker given the same batch (so each worker's trust ratio is the mean
  gradient's), three steps move the parameters as the dense trainer's fused LARS does; with
  the learning rate in front of the exchange too (`experimental.feedback_in="steps"`; the rate
  is constant here, where the two forms agree)."""
  train, _ = data_lib.digits()
  images, labels = train.images[:13], train.labels[:13]

  def batch_of(i):  # the same 13 images on each of the 8 workers
    batch = np.roll(np.arange(13), i)
    return np.tile(images[batch], (8, 1, 1, 1)), np.tile(labels[batch], 8)

  dense, corrected = _lars_moves(batch_of, {"optimizer.nesterov": nesterov}.items(),
                                 **{"experimental.feedback_in": feedback_in})
  assert np.count_nonzero(dense) > dense.size // 2
  np.testing.assert_allclose(corrected, dense, rtol=1e-3, atol=1e-4 * np.abs(dense).max())


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
@pytest.mark.parametrize("trust_ratio", ["worker", "mean"])
def test_lars_with_momentum_correction_takes_the_mean_gradient_s_trust_ratio(trust_ratio):
  """Every worker a different batch (so each worker's gradient is noisier than the mean): with
  every coordinate sent, `experimental.lars_trust_ratio="mean"` (the norm of the workers' mean,
  sketched) moves the parameters as the dense trainer's LARS does, within the sketch's error;
  each worker's own trust ratio ("worker") moves them elsewhere."""
  train, _ = data_lib.digits()

  def batch_of(i):  # 7 images a worker, none shared
    batch = np.arange(i * 8 * 7, (i + 1) * 8 * 7)
    return train.images[batch], train.labels[batch]

  dense, corrected = _lars_moves(batch_of, **{"experimental.lars_trust_ratio": trust_ratio})
  error = np.linalg.norm(corrected - dense) / np.linalg.norm(dense)
  if trust_ratio == "mean":  # measured: 0.055 ("worker": 0.35)
    assert error < 0.12, error
  else:
    assert error > 0.2, error


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
def test_whole_vectors_send_the_one_dimensional_leaves_whole():
  """experimental.whole_vectors: in the trainer's sparse exchange with momentum correction,
  after each step no worker holds anything back on BatchNorm's scales and biases (leaves of
  one dimension), while it holds back most kernel coordinates; the bytes a step count them."""
  base = {"compression.momentum_correction": True, "compression.density": 0.02,
          "experimental.momentum_masking": False, "model.num_filters": 4,
          "compression.warmup_epochs": 0.0}
  mesh = make_mesh(2, 4)
  train, _ = data_lib.digits()
  sent = {}
  for whole in (False, True):
    config = validate(small_config(**base, **{"experimental.whole_vectors": whole}))
    setup, state = from_config(config, make_plan(config, 10), mesh, 10, (8, 8, 1))
    step = jit_train_step(setup, state)
    for i in range(2):
      state, _ = step(state, *shard_batch(mesh, train.images[i * 64:(i + 1) * 64],
                                          train.labels[i * 64:(i + 1) * 64]))
    sent[whole] = float(np.asarray(state.comm_state.bytes_sent).max())
    vectors = setup.layout.leaf_mask(lambda t: jax.tree.map(lambda x: len(x.shape) <= 1, t))
    kernels = setup.layout.leaf_mask(lambda t: jax.tree.map(lambda x: len(x.shape) > 1, t))
    # each node's workers hold its shards in order; a position's memory is over the nodes
    held = np.abs(np.asarray(state.comm_state.feedback.residual)).reshape(2, -1).sum(0)
    assert np.count_nonzero(held[kernels]) > 0.9 * kernels.sum()
    if whole:
      assert np.all(held[vectors] == 0)
    else:
      assert np.count_nonzero(held[vectors]) > 0  # measured: 42 of 402 (their gradients are
      # large: the top-k takes most of them anyway)
  assert sent[True] > sent[False]


@pytest.mark.parametrize("changes,match", [
    ({"experimental.lars_trust_ratio": "global"}, "lars_trust_ratio.*'worker' or 'mean'"),
    ({"experimental.lars_trust_ratio": "mean"}, "lars_trust_ratio.*optimizer.name lars"),
    ({"experimental.whole_vectors": True, "compression.algorithm": "dense"},
     "whole_vectors.*'dense': nothing is held back"),
    ({"experimental.feedback_in": "params"}, "feedback_in.*'gradients' or 'steps'"),
    ({"experimental.whole_vectors": True, "compression.error_feedback": False},
     "error_feedback.*True when experimental.whole_vectors"),
    ({"experimental.feedback_in": "steps"}, "feedback_in.*unless compression.momentum_corr"),
    ({"experimental.feedback_in": "steps", "compression.momentum_correction": True,
      "optimizer.name": "adamw"}, "feedback_in.*optimizer.name sgd or lars"),
    ({"experimental.balance": "tensor", "compression.momentum_correction": True,
      "optimizer.name": "adamw"}, "balance.*with adamw's momentum correction"),
    ({"experimental.balance": "tensor", "compression.error_feedback": False},
     "balance.*'global' without error feedback"),
])
def test_the_correction_s_options_name_what_is_allowed(changes, match):
  with pytest.raises(ValueError, match=match):
    validate(small_config(**changes))


def test_momentum_correction_needs_sgd_or_lars_with_momentum():
  for changes, match in (({"optimizer.name": "lamb"}, "optimizer.name.*sgd or lars with"),
                         ({"optimizer.momentum": 0.0}, "optimizer.momentum = 0.0"),
                         ({"compression.error_feedback": False}, "compression.error_feedback")):
    with pytest.raises(ValueError, match=match):
      validate(small_config(**{"compression.momentum_correction": True, **changes}))


def test_without_momentum_correction_the_optimizer_keeps_the_momentum():
  """What the config says is what runs: without momentum correction the fused SGD holds the
  config's momentum and the compressor keeps a residual only."""
  config = validate(small_config(**{"model.name": "mlp", "model.hidden": (8,)}))
  assert not config.compression.momentum_correction
  _, state = from_config(config, make_plan(config, 10), make_mesh(2, 4), 10,
                         (8, 8, 1))
  optimizer_state = state.chain.optimizer
  assert optimizer_state.momentum is not None
  assert state.comm_state.feedback.velocity is None


def test_the_cli_summary_states_the_time_to_target_or_that_it_was_not_reached(capsys):
  from sparsejax import cli
  summary = {"steps": 40, "total_steps": 40, "wall_time_s": 12.5, "bytes_sent": 2e6,
             "skipped_steps": 0, "final_eval": {"accuracy": 0.9}, "best_eval": None,
             "config": {"target_metric": "accuracy", "target_value": 0.85},
             "time_to_target": {"metric": "accuracy", "value": 0.8612, "target": 0.85,
                                "step": 24, "wall_time_s": 7.25}}
  cli._print_summary(summary, "runs/x")
  assert "time to target      7.2 s (step 24: accuracy 0.8612 >= 0.85)" in capsys.readouterr().out
  summary["time_to_target"] = {"metric": "loss", "value": 4.5, "target": 4.55, "step": 9,
                               "wall_time_s": 3.0}
  cli._print_summary(summary, "runs/x")
  assert "3.0 s (step 9: loss 4.5000 <= 4.55)" in capsys.readouterr().out
  summary["time_to_target"] = None
  cli._print_summary(summary, "runs/x")
  assert "time to target      not reached (accuracy 0.85)" in capsys.readouterr().out
  summary["config"] = {"target_metric": ""}
  cli._print_summary(summary, "runs/x")
  assert "time to target" not in capsys.readouterr().out
