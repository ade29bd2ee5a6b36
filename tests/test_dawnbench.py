"""The DAWNBench recipe's whole code path on a generated ImageNet: `configs/dawnbench_resnet50.py`
at 1/16 width, 1/8 image size and one step per epoch (28 steps), through TFDS, the tiered cache
and the grain pipeline: every resolution stage, evaluation at each stage's end, time to target,
checkpoints, and a resume that reproduces the uninterrupted run exactly."""

from __future__ import annotations

import csv
import json
import os
import shutil

import pytest

from sparsejax.train import config as config_lib
from sparsejax.train.loop import train_and_evaluate

# end to end (the emulated cluster, the studies, whole recipes): `python -m pytest -m integration`
pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smoke_config(data_dir: str, cache_dir: str):
  config = config_lib.load_config(os.path.join(ROOT, "configs", "dawnbench_resnet50.py"))
  return config_lib.apply_overrides(config, [
      "model.num_filters=4", "batch_size=16", "mesh.nodes=2", "mesh.local=4",
      f"data.path={data_dir}", f"data.cache_dir={cache_dir}",
      "data.memory_cache_bytes=100000000", "data.disk_cache_bytes=100000000",
      # the recipe's stages (epochs 0, 13, 25 of 28) at 1/8 of 128, 224, 288 px
      "data.resize_schedule=((0, 16), (13, 28), (25, 36))", "data.decoded_max_size=20",
      "log_every_steps=1", "checkpoint_every_steps=14", "target_value=0.0"])


def rows(path):
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def run(fake_imagenet, tmp_path_factory):
  data_dir, _, _ = fake_imagenet
  tmp = tmp_path_factory.mktemp("dawnbench")
  workdir = str(tmp / "uninterrupted")
  summary = train_and_evaluate(smoke_config(data_dir, str(tmp / "cache")), workdir,
                               progress=False)
  return data_dir, tmp, workdir, summary


def test_every_stage_trains_and_is_evaluated_at_its_end(run):
  _, _, workdir, summary = run
  assert summary["steps"] == summary["total_steps"] == 28
  assert [int(r["step"]) for r in rows(os.path.join(workdir, "eval.csv"))] == [13, 25, 28]
  train = rows(os.path.join(workdir, "train.csv"))
  assert len(train) == 28 and all(float(r["skipped"]) == 0 for r in train)
  # Past the DGC warm-up (2 epochs) the density is the recipe's 0.001.
  assert float(train[-1]["density"]) == pytest.approx(0.001)
  # The input counters are logged: the corrupt JPEG is skipped once per epoch that reads it,
  # and the remote source (TFDS) is read once per record, later epochs hit the caches.
  last = train[-1]
  assert float(last["input_corrupt"]) >= 1
  assert float(last["cache_raw_source_reads"]) == 24
  assert float(last["cache_decoded_memory_hits"]) > 0  # the low-resolution stage's epochs
  assert summary["final_eval"]["top5_accuracy"] >= 0 and summary["bytes_sent"] > 0
  # Time to accuracy: first reached at the first evaluation (a target of 0 here).
  ttt = summary["time_to_target"]
  assert ttt["metric"] == "top5_accuracy" and ttt["step"] == 13
  assert 0 < ttt["wall_time_s"] <= summary["wall_time_s"]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["14", "28"]


def test_resume_from_the_middle_reproduces_the_uninterrupted_run(run):
  data_dir, tmp, workdir, summary = run
  resumed = str(tmp / "resumed")
  shutil.copytree(workdir, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "28"))  # as if stopped after step 14
  with open(os.path.join(resumed, "summary.json")) as f:
    partial = json.load(f)
  partial.update(steps=14, final_eval=None, time_to_target=None, best_eval=None)
  with open(os.path.join(resumed, "summary.json"), "w") as f:
    json.dump(partial, f)
  again = train_and_evaluate(smoke_config(data_dir, str(tmp / "cache-resumed")), resumed,
                             progress=False)
  a, b = rows(os.path.join(workdir, "train.csv")), rows(os.path.join(resumed, "train.csv"))
  keys = ["loss", "accuracy", "grad_norm", "density", "bytes_sent", "learning_rate"]
  assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
  assert again["final_eval"] == summary["final_eval"]
