"""sparsejax.train.plan: every duration in steps by one rule, and the tables of what each step
runs (form, density level, image size), against step-by-step references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import override

from sparsejax.compress import density_levels, level_index
from sparsejax.train import config as config_lib
from sparsejax.train import make_plan, schedules, steps


def _epoch_reference(epochs: float, steps_per_epoch: int) -> int:
  """The first step whose epoch, step / steps_per_epoch as the loop reads it, reaches `epochs`
  (a scan)."""
  step = 0
  while step / steps_per_epoch < epochs:
    step += 1
  return step


@pytest.mark.parametrize("steps_per_epoch", [1, 7, 235, 457, 1000])
def test_steps_is_the_first_step_whose_epoch_reaches_the_duration(steps_per_epoch):
  rng = np.random.default_rng(steps_per_epoch)
  durations = [0.0, 1 / 8, 2 * 13 / 28, 2 * 25 / 28, 60 / 457, 0.1, 0.3, 1.0, 2.0, 3 / 7,
               *rng.uniform(0, 3, 20)]
  for e in durations:
    assert steps(e, steps_per_epoch) == _epoch_reference(e, steps_per_epoch), e
  with pytest.raises(ValueError, match="steps_per_epoch must be >= 1, got 0"):
    steps(1.0, 0)


def _config(**changes):
  return config_lib.validate(override(config_lib.default_config(), changes))


@pytest.mark.parametrize("steps_per_epoch", [235, 469, 7, 1000])
def test_the_stages_start_where_the_image_size_changes(steps_per_epoch):
  """Each stage's first step is the first whose epoch reaches the stage's start (the CNN task's
  2 x 13/28 falls at step 218.2 of 235 an epoch: its stage starts at step 219)."""
  for schedule, epochs in ((((0, 12), (2 * 13 / 28, 22), (2 * 25 / 28, 28)), 2.0),
                           (((0, 128), (13, 224), (25, 288)), 28.0),
                           (((0, 16), (0.3, 20)), 0.25)):  # (a stage past the end: none)
    plan = make_plan(_config(**{"data.resize_schedule": schedule, "num_epochs": epochs,
                                "eval_at_stage_boundaries": True}), steps_per_epoch)
    want = [None] * plan.total_steps
    for start, size in schedule:  # each step's size from its epoch
      for s in range(plan.total_steps):
        if s / steps_per_epoch >= start:
          want[s] = size
    assert [plan.image_size(s) for s in range(plan.total_steps)] == want
    changes = [s for s in range(1, plan.total_steps) if want[s] != want[s - 1]]
    assert list(plan.stage_ends) == changes
  assert make_plan(_config(), 10).image_size(3) is None


def test_the_density_warmup_on_the_host_is_numpy_and_matches_the_traced_schedule():
  plan = make_plan(_config(**{"compression.warmup_epochs": 0.3, "compression.warmup_density": 0.3,
                              "compression.density": 0.007}), 157)
  assert plan.warmup_steps_density == 48  # 0.3 x 157 = 47.1: the first step at or past it
  schedule = plan.density_schedule()
  at = [0, 1, 23, 46, 47, 48, 301]
  host = [schedule(s) for s in at]
  # numpy on the host: the loop reads each step's level without waiting for the device
  assert all(not isinstance(v, jax.Array) for v in host)
  traced = jax.jit(jax.vmap(schedule))(jnp.asarray(at, jnp.int32))
  np.testing.assert_allclose(np.asarray(host, np.float64), np.asarray(traced), rtol=1e-6)
  expected = 0.3 * (0.007 / 0.3) ** np.minimum(np.asarray(at) / 48, 1.0)
  np.testing.assert_allclose(np.asarray(host, np.float64), expected, rtol=1e-5)
  # the level table is the schedule rounded up to the levels, step by step
  levels = density_levels(0.007, 0.3)
  assert plan.levels == levels
  want = [level_index(levels, float(schedule(s))) for s in range(plan.total_steps)]
  assert [plan.sparse_level(s) for s in range(plan.total_steps)] == want
  assert [plan.level(s) for s in range(plan.total_steps)] == want


def test_without_a_warmup_one_level_and_no_schedule():
  plan = make_plan(_config(**{"compression.density": 0.05}), 13)
  assert plan.levels == (0.05,) and plan.density_schedule() is None
  assert {plan.level(s) for s in range(plan.total_steps)} == {0}
  dense = make_plan(_config(**{"compression.algorithm": "dense"}), 13)
  assert not dense.sparse and dense.level(0) is None and dense.density_schedule() is None


def test_a_dense_start_and_auto_s_schedule_are_forms_by_step():
  """The dense start (compression.dense_epochs) runs the dense form's level; auto's schedule
  (epochs) follows it, each entry at the first step whose epoch reaches it."""
  plan = make_plan(_config(**{"compression.dense_epochs": 0.25, "compression.density": 0.1}),
                   457)
  assert plan.dense_form and plan.dense_level == 1 and plan.dense_steps == 115
  assert plan.forms == ((0, "dense"), (115, "sparse"))
  assert plan.steady_level == 2  # (the dense start from step 0: the state empty, steady)
  assert [plan.level(s) for s in (0, 114, 115, 456)] == [2, 2, 0, 0]
  auto = make_plan(_config(**{"compression.algorithm": "auto", "compression.density": 0.05,
                              "auto.schedule": ((0.0, "sparse"), (300 / 457, "dense"))}), 457)
  assert auto.forms == ((0, "sparse"), (300, "dense"))
  assert auto.algorithm == "hitopk" and auto.level(299) == 0 and auto.level(300) == 1
  assert auto.level(301) == auto.steady_level == 2  # (after the dense form's first step)
  measured = make_plan(_config(**{"compression.algorithm": "auto"}), 10)
  assert measured.forms == ((0, "measured"),)


def test_the_learning_rate_warms_up_over_the_plan_s_steps_then_decays_to_the_end():
  config = _config(**{"optimizer.warmup_epochs": 0.3, "optimizer.schedule": "step",
                      "optimizer.step_epochs": (1.0, 1.5), "optimizer.step_factor": 0.1,
                      "optimizer.learning_rate": 2.0, "num_epochs": 2.0})
  plan = make_plan(config, 31)
  assert (plan.total_steps, plan.warmup_steps, plan.decay_steps) == (62, 10, (21, 37))
  lr = schedules.learning_rate(config.optimizer, plan)
  assert float(lr(5)) == pytest.approx(1.0)  # half-way up the warm-up
  assert float(lr(30)) == pytest.approx(2.0)  # step 30: epoch 0.97
  assert float(lr(31)) == pytest.approx(0.2)  # step 31: epoch 1.0
  assert float(lr(47)) == pytest.approx(0.02)  # step 47: epoch 1.52
  assert plan.total_steps == math.ceil(2.0 * 31)


def test_only_the_plan_turns_epochs_into_steps():
  """Every duration in epochs becomes steps in `plan.steps` alone: no other module of the
  library, the studies or the benchmarks multiplies epochs by steps per epoch."""
  import os
  import re
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  pattern = re.compile(r"epochs?\w*\s*\*\s*[\w.()]*steps_per_epoch"
                       r"|steps_per_epoch\s*\*\s*[\w.]*epoch")
  found = []
  for top in ("sparsejax", "studies", "benchmarks"):
    for folder, _, names in os.walk(os.path.join(root, top)):
      for name in names:
        path = os.path.join(folder, name)
        if name.endswith(".py") and not path.endswith(os.path.join("train", "plan.py")):
          found += [f"{os.path.relpath(path, root)}: {m.group(0)}"
                    for m in pattern.finditer(open(path).read())]
  assert not found, found


@pytest.mark.parametrize("algorithm,nodes,local", [("hitopk", 2, 4), ("hitopk", 16, 1),
                                                   ("allgather", 8, 1), ("allgather", 2, 3),
                                                   ("gtopk", 16, 1), ("higtopk", 4, 2)])
def test_no_level_sends_more_bytes_than_the_dense_form(algorithm, nodes, local):
  """A level whose pairs would cost more bytes than the dense form at the run's workers runs
  the dense form: against the ring formulas in numpy (TopK all-gather: (P - 1) k pairs of 8
  bytes against a ring all-reduce's 2 (P - 1) / P n values of 4; HiTopKComm: the same between
  the nodes on a shard of n / local; gTop-k: log2 P rounds of k pairs, k indices to the
  workers past the power of two, an all-reduce of k values)."""
  config = _config(**{"compression.algorithm": algorithm, "compression.density": 0.01,
                      "compression.warmup_epochs": 1.0, "compression.warmup_density": 1.0,
                      "mesh.nodes": nodes, "mesh.local": local, "num_epochs": 2.0})
  plan = make_plan(config, 1000)
  part = 1 << 20
  p, q = (nodes, nodes) if algorithm in ("hitopk", "higtopk") else (nodes * local, nodes * local)
  dense = 2 * (p - 1) / p * part * 4
  rounds = int(math.log2(1 << (q.bit_length() - 1)))
  for i, d in enumerate(plan.levels):
    k = max(1, round(d * part))
    if algorithm in ("hitopk", "allgather"):
      pairs = (p - 1) * k * 8
    else:
      pairs = rounds * k * 8 + (q > (1 << rounds)) * k * 4 + 2 * (q - 1) / q * k * 4
    assert (i in plan.dense_levels) == (pairs > dense), (d, pairs, dense)
  for s in range(plan.total_steps):  # the steps at those levels run the dense form's level
    dense = plan.sparse_level(s) in plan.dense_levels  # (from the start: the steady step)
    assert plan.level(s) == (plan.steady_level if dense else plan.sparse_level(s))
  assert plan.dense_form and plan.levels[-1] == 1.0 and len(plan.levels) - 1 in plan.dense_levels
  assert all("run the dense form" in n and f"{nodes} x {local}" in n for n in plan.notes())
  assert len(plan.notes()) == len(plan.dense_levels)


def test_levels_are_kept_where_the_workers_are_not_known():
  config = _config(**{"compression.warmup_epochs": 1.0, "compression.warmup_density": 0.8,
                      "mesh.nodes": -1, "mesh.local": 4})
  plan = make_plan(config, 100)
  assert plan.workers is None and plan.dense_levels == () and not plan.dense_form
  assert make_plan(config, 100, (2, 4)).dense_levels == (len(plan.levels) - 2,)  # 0.8 > 1/2
