"""Every shipped config validates; the ImageNet and DAWNBench recipes build their train step and run
a few steps at every resolution stage on tiny fake inputs."""

import glob
import os

import jax
import numpy as np
import pytest
from conftest import make_mesh

from sparsejax.train import config as config_lib
from sparsejax.train import make_plan
from sparsejax.train.state import build_model, from_config, shard_batch
from sparsejax.train.step import jit_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


def test_there_are_configs():
  names = {os.path.basename(p) for p in CONFIGS}
  assert {"quickstart.py", "resnet50_imagenet.py", "dawnbench_resnet50.py", "kjv_lm.py",
          "transformer_wmt.py"} <= names


def test_transformer_wmt_builds_the_base_model():
  """The WMT config's model is Transformer-base: 60.52M parameters at 32,000 pieces (shapes
  only; tests/test_translation.py trains the same code path at toy size)."""
  config = config_lib.validate(config_lib.load_config(os.path.join(ROOT, "configs",
                                                                   "transformer_wmt.py")))
  assert config.data.name == "wmt14" and config.model.name == "transformer_base"
  model = build_model(config, config.data.vocab_size)
  tokens = np.zeros((1, config.data.seq_len), np.int32)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), (tokens, tokens), train=False))
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"]))
  # benchmarks/param_trees.py's Transformer-base (60,524,544) has final LayerNorms after the
  # encoder and decoder (2 x 1,024); post-LN, as here and in Vaswani et al., has none
  assert params == 60_524_544 - 2 * 1024


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_validates_and_documents_itself(path):
  raw = config_lib.load_config(path)
  config = config_lib.validate(raw)
  assert config.batch_size > 0
  with open(path) as f:
    text = f.read()
  assert "sparsejax train" in text or "sparsejax launch" in text  # the command
  assert "Expected" in text  # time / result


def _smoke(name, num_filters, scale):
  config = config_lib.validate(config_lib.load_config(os.path.join(ROOT, "configs", name)))
  config.model.num_filters = num_filters
  config.seed = 0
  plan = make_plan(config, steps_per_epoch=2)
  assert len(plan.stages) > 1, "a recipe with images needs a resize schedule"
  mesh = make_mesh(2, 4)
  first = plan.stages[0][1] // scale
  setup, state = from_config(config, plan, mesh, 1000, (first, first, 3))
  rng = np.random.default_rng(0)
  step_fn = jit_train_step(setup, state)
  seen = []
  for start, size in plan.stages:
    size = size // scale
    state = state._replace(step=jax.device_put(np.int32(start), state.step.sharding))
    for _ in range(2):  # the second step of a stage reuses its compiled program
      images = rng.standard_normal((16, size, size, 3)).astype(np.float32)
      labels = rng.integers(0, 1000, 16).astype(np.int32)
      state, metrics = step_fn(state, *shard_batch(mesh, images, labels))
      assert np.isfinite(float(metrics["loss"])) and float(metrics["skipped"]) == 0
    seen.append((size, float(metrics["learning_rate"]), float(metrics["density"])))
  return config, seen


@pytest.mark.slow  # ~50 s and ~110 s; tests/test_dawnbench.py runs the DAWNBench recipe in CI
@pytest.mark.parametrize("name", ["resnet50_imagenet.py", "dawnbench_resnet50.py"])
def test_recipe_runs_every_resolution_stage_on_tiny_fake_inputs(name):
  """ResNet-50 of the recipe at 1/16 width, images at 1/8 size: the recipe's optimizer, label
  smoothing, compression and schedules, two steps per stage, on random inputs."""
  config, seen = _smoke(name, num_filters=4, scale=8)
  sizes = [s for s, _, _ in seen]
  assert sizes == [s // 8 for _, s in config.data.resize_schedule]
  assert all(lr > 0 for _, lr, _ in seen)
  if name == "dawnbench_resnet50.py":
    # Past the DGC warm-up the density is the target.
    assert seen[-1][2] == pytest.approx(config.compression.density)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50_imagenet.py", "dawnbench_resnet50.py"])
def test_recipe_full_width_resnet50_every_stage(name):
  _smoke(name, num_filters=0, scale=4)


def test_image_size_schedule():
  config = config_lib.validate(config_lib.apply_overrides(config_lib.default_config(), [
      "data.resize_schedule=((0, 128), (13, 224), (25, 288))", "num_epochs=28.0"]))
  plan = make_plan(config, steps_per_epoch=10)
  assert [plan.image_size(s) for s in (0, 129, 130, 249, 250, 275)] == [
      128, 128, 224, 224, 288, 288]
  assert plan.stages == ((0, 128), (130, 224), (250, 288))
  bad = config_lib.apply_overrides(config_lib.default_config(),
                                   ["data.resize_schedule=((5, 128), (1, 224))"])
  with pytest.raises(ValueError, match="resize_schedule"):
    config_lib.validate(bad)


def test_an_unknown_augmentation_is_refused_naming_what_is_allowed():
  bad = config_lib.apply_overrides(config_lib.default_config(), ["data.augment=crop"])
  with pytest.raises(ValueError, match=r"'data.augment' = 'crop': must be one of '', 'crop_flip'"):
    config_lib.validate(bad)
