"""The model zoo: parameter counts of the published models and one real train step per family."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh

from sparsejax import models
from sparsejax.train import default_config
from sparsejax.train.optimizer import compressor, fused_optimizer, train_chain
from sparsejax.train.plan import make_plan
from sparsejax.train.state import create_train_state, shard_batch
from sparsejax.train.step import jit_eval_step, jit_train_step

# torchvision's counts for the same architectures (ResNet v1.5, 1000 classes).
COUNTS = {"resnet18": 11_689_512, "resnet34": 21_797_672, "resnet50": 25_557_032,
          "resnet101": 44_549_160, "resnet152": 60_192_808}


def _count(model, shape, inputs=None):
  x = jnp.zeros(shape) if inputs is None else inputs
  if inputs is not None and type(model).__name__ == "TransformerLM":
    x = inputs[0]
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(variables["params"])), variables


@pytest.mark.parametrize("name", list(COUNTS))
def test_resnet_parameter_counts(name):
  n, variables = _count(models.build(name, num_classes=1000), (1, 224, 224, 3))
  assert n == COUNTS[name]
  if name == "resnet50":
    assert len(jax.tree.leaves(variables["params"])) == 161


def test_resnet20_is_the_cifar_resnet():
  n, _ = _count(models.build("resnet20", num_classes=10), (1, 32, 32, 3))
  assert n == 272_474  # He et al. 2016, section 4.2: "0.27M" (the usual exact count)


def test_bad_model_names():
  with pytest.raises(ValueError, match="resnet50"):
    models.build("resnet5O", num_classes=10)
  with pytest.raises(ValueError, match="dtype"):
    models.build("resnet18", num_classes=10, dtype="float16")


# The bottleneck ResNet-50 with the ImageNet stem runs in tests/test_configs.py (the recipes).
@pytest.mark.parametrize("name,filters,size,dtype", [("resnet20", 4, 8, "bfloat16")])
def test_one_sharded_train_step_per_family(rng, name, filters, size, dtype):
  """A real step on 8 devices (2 nodes x 4) with HiTopKComm and fused LARS, bfloat16 compute.
  The loss is finite, the parameters move (float32), BN statistics stay per worker and the step
  count advances."""
  config = default_config()
  config.compression.density = 0.05
  config.optimizer.name = "lars"
  model = models.build(name, num_classes=7, dtype=dtype, num_filters=filters)
  mesh = make_mesh(2, 4)
  setup, state = create_train_state(
      model, mesh, (size, size, 3),
      lambda layout: train_chain(compressor(config, make_plan(config, 10)),
                                 fused_optimizer(config.optimizer, 0.1, layout)),
      num_classes=7)
  before = np.asarray(state.params)
  step = jit_train_step(setup, state)
  images = rng.standard_normal((16, size, size, 3)).astype(np.float32)
  labels = rng.integers(0, 7, 16).astype(np.int32)
  state, metrics = step(state, *shard_batch(mesh, images, labels))
  assert np.isfinite(float(metrics["loss"])) and float(metrics["skipped"]) == 0
  assert int(state.step) == 1
  assert np.any(np.asarray(state.params) != before)
  stats = jax.tree.leaves(state.batch_stats)
  assert stats and all(s.shape[0] == 8 for s in stats)
  assert any(not np.allclose(np.asarray(s)[0], np.asarray(s)[1]) for s in stats)
  assert state.params.dtype == jnp.float32


@pytest.mark.parametrize("name,pre_ln,count,leaves", [
    ("transformer_base", False, 60_522_496, 253), ("transformer_base", True, 60_524_544, 257),
    ("transformer_big", False, 209_125_376, 253)])
def test_transformer_parameter_counts(name, pre_ln, count, leaves):
  tokens = jnp.ones((1, 16), jnp.int32)
  n, variables = _count(models.build(name, num_classes=32000, pre_ln=pre_ln), None,
                        inputs=(tokens, tokens))
  assert n == count and len(jax.tree.leaves(variables["params"])) == leaves


@pytest.mark.parametrize("name,positions,pre_ln", [
    pytest.param("transformer_base", "sinusoidal", False,
                 marks=pytest.mark.integration),  # (about 20 s to compile on 2 cores)
    pytest.param("transformer_lm", "learned", True, marks=pytest.mark.integration)])
def test_one_sharded_train_step_for_the_transformers(rng, name, positions, pre_ln):
  """Tiny encoder-decoder and decoder-only models: one step on 8 devices with HiTopKComm and
  fused AdamW; padding tokens (0) are not counted; dropout keys differ per worker."""
  config = default_config()
  config.compression.density = 0.05
  config.optimizer.name = "adamw"
  vocab, length = 53, 11
  model = models.build(name, num_classes=vocab, d_model=16, num_heads=2, d_ff=24, num_layers=2,
                       max_len=16, positions=positions, pre_ln=pre_ln)
  mesh = make_mesh(2, 4)

  def make_tx(layout):
    return train_chain(compressor(config, make_plan(config, 10)),
                       fused_optimizer(config.optimizer, 1e-3, layout))
  tokens = rng.integers(1, vocab, (16, length + 1)).astype(np.int32)
  tokens[:, -3:] = 0  # padding
  inputs, labels = tokens[:, :-1], tokens[:, 1:]
  if name == "transformer_base":
    inputs = (rng.integers(1, vocab, (16, length)).astype(np.int32), inputs)
  example = jax.tree.map(lambda x: jnp.zeros((1,) + x.shape[1:], jnp.int32), inputs)
  setup, state = create_train_state(model, mesh, example, make_tx, num_classes=vocab)
  before = np.asarray(state.params)
  step = jit_train_step(setup, state)
  state, metrics = step(state, *shard_batch(mesh, inputs, labels))
  assert np.isfinite(float(metrics["loss"])) and 0 <= float(metrics["accuracy"]) <= 1
  assert np.any(np.asarray(state.params) != before) and int(state.step) == 1
  sums = jit_eval_step(setup, state)(state, *shard_batch(mesh, inputs, labels,
                                                         np.ones(16, np.float32)))
  assert float(sums["count"]) == float(np.sum(labels != 0))


def test_mlp_counts_and_matches_a_numpy_forward(rng):
  n, _ = _count(models.build("mlp", num_classes=10), (1, 28, 28, 1))
  assert n == 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10 == 1_863_690
  model = models.build("mlp", num_classes=7, hidden=(13, 11))
  x = rng.standard_normal((5, 3, 4, 2)).astype(np.float32)
  params = model.init(jax.random.key(1), x)["params"]
  h = x.reshape(5, -1)
  for name in ("hidden_0", "hidden_1"):
    h = np.maximum(h @ np.asarray(params[name]["kernel"]) + np.asarray(params[name]["bias"]), 0)
  want = h @ np.asarray(params["head"]["kernel"]) + np.asarray(params["head"]["bias"])
  got = model.apply({"params": params}, x, train=True)
  assert got.dtype == jnp.float32 and got.shape == (5, 7)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
