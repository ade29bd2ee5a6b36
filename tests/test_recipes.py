"""The config's groups: a moved key fails with one line naming its new place; the named recipe
"onebit_adam" ties 1-bit Adam's dense start to its frozen variance on a corpus of any length."""

import csv
import math
import os

import pytest
from conftest import override

from sparsejax.data import text
from sparsejax.train import config as config_lib
from sparsejax.train import make_plan
from sparsejax.train.loop import train_and_evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("old", sorted(config_lib.RENAMED))
def test_a_moved_key_fails_with_one_line_naming_its_new_place(old):
  new = config_lib.RENAMED[old].split()[0]
  group, key = old.split(".")
  for attempt in (lambda: config_lib.validate({group: {key: 1}}),
                  lambda: config_lib.apply_overrides(config_lib.default_config(),
                                                     [f"{old}=1"])):
    with pytest.raises(ValueError) as e:
      attempt()
    message = str(e.value)
    assert "\n" not in message and old in message and new in message, message
  new_group, new_key = new.split(".")
  assert new_key in config_lib.default_config()[new_group]  # where it points exists


def test_the_core_compression_group_is_small():
  assert len(config_lib.default_config().compression) <= 8


def onebit(path="configs/tta_kjv_lm.py", **changes):
  config = config_lib.load_config(os.path.join(ROOT, path))
  config.recipe = "onebit_adam"
  config.compression.density = 0.1
  return config_lib.validate(override(config, changes))


def test_onebit_on_kjv_is_the_first_eighth_dense():
  """On the Transformer task (457 steps an epoch, 1 epoch) the recipe runs the dense form over
  the steps of the first eighth of the run (0-57: step 57's epoch is 0.1247) and freezes the
  variance from step 58, with no density warm-up; with 3 epochs it follows the run (172
  steps: 3/8 of an epoch is 171.4 steps)."""
  config = onebit()
  assert config.compression.warmup_epochs == 0.0
  plan = make_plan(config, 457)
  assert plan.dense_steps == plan.freeze_variance_step == 58
  # level 2: the dense form's steady step (from the start: the residual empty)
  assert [plan.level(s) for s in (0, 57, 58, 456)] == [2, 2, 0, 0]
  longer = make_plan(onebit(num_epochs=3.0), 457)
  assert longer.dense_steps == longer.freeze_variance_step == math.ceil(3 * 457 / 8) == 172


def test_onebit_needs_adamw_without_momentum_correction():
  with pytest.raises(ValueError, match="onebit_adam.*adamw"):
    onebit(**{"optimizer.name": "sgd"})
  with pytest.raises(ValueError, match="recipe.*onebit_adam"):
    onebit(recipe="twobit")


def read_densities(workdir):
  with open(os.path.join(workdir, "train.csv"), newline="") as f:
    return [(int(r["step"]) - 1, float(r["density"])) for r in csv.DictReader(f)]


@pytest.mark.parametrize("chapters", [60, 140])
@pytest.mark.integration
def test_onebit_compresses_from_where_the_variance_is_frozen_on_any_corpus(tmp_path, chapters):
  """Two corpora of different lengths (the first 60 and 140 KJV chapters as a text file): in
  each the run sends dense until the step where AdamW's variance freezes, an eighth of its own
  run, and sparse from that step on."""
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n\n".join(text.kjv_documents()[:chapters]), encoding="utf-8")
  config = onebit(**{
      "data.name": "text", "data.path": str(corpus), "data.seq_len": 32,
      "data.vocab_size": 256, "data.cache_dir": str(tmp_path / "cache"),
      "model.d_model": 32, "model.num_heads": 2, "model.d_ff": 64, "model.num_layers": 1,
      "mesh.nodes": 2, "mesh.local": 4, "batch_size": 64, "num_epochs": 2.0,
      "log_every_steps": 1, "eval_every_steps": 0, "target_metric": "",
      "optimizer.warmup_epochs": 0.0})
  summary = train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  total = summary["total_steps"]
  seen = read_densities(str(tmp_path / "run"))
  assert [s for s, _ in seen] == list(range(total))
  frozen = math.ceil(total / 8)  # the first step of the run's second eighth
  assert frozen >= 2
  assert all(d == 1.0 for s, d in seen if s < frozen), seen
  assert all(d == pytest.approx(0.1) for s, d in seen if s >= frozen), seen
