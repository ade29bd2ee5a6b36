"""compression.algorithm = "auto": the model's pieces against hand-written formulas, a run whose
forms follow a schedule (and resumes through a switch), a measured run, and a run on the emulated
cluster whose link changes under it."""

import csv
import io
import json
import math
import os
import shutil
import threading
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import override

from sparsejax import cluster
from sparsejax.train import auto, make_plan, train_and_evaluate
from sparsejax.train import config as config_lib
from sparsejax.train.plan import at
from tests.conftest import need_root

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS_PER_EPOCH = 11  # the quickstart's recipe below
SCHEDULE = ((0, "sparse"), (7, "dense"), (12, "sparse"))  # in steps ...
EPOCHS = tuple((step / STEPS_PER_EPOCH, form) for step, form in SCHEDULE)  # ... and in epochs
# (a warm-up from 0.8: its first level's pairs send more than the dense form at 2 nodes)
SCHEDULED = {"auto.schedule": EPOCHS, "compression.warmup_density": 0.8}


def read_csv(path):
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def auto_config(**changes):
  """The quickstart's recipe (ResNet-20 on digits, 2 nodes x 4), 22 steps, under "auto"."""
  config = config_lib.load_config(os.path.join(ROOT, "configs", "quickstart.py"))
  config.num_epochs = 2.0
  config.log_every_steps = 1
  config.eval_every_steps = 10
  config.checkpoint_every_steps = 10
  config.compression.algorithm = "auto"
  config.compression.warmup_epochs = 0.5
  config.auto.probe_budget = 0.0  # measured at the start and where the schedule says only
  return override(config, changes)


# ----------------------------------------------------------------------------- the model

def test_fit_link_recovers_a_line_and_calls_a_flat_one_infinite():
  rng = np.random.default_rng(5)
  fixed, bps = rng.uniform(1e-4, 1e-3), rng.uniform(1e6, 1e9)
  sizes = rng.uniform(1e3, 1e7, size=3)
  link = auto.fit_link(sizes, fixed + sizes / bps)
  assert link.fixed_s == pytest.approx(fixed, rel=1e-6)
  assert link.bytes_per_s == pytest.approx(bps, rel=1e-6)
  flat = auto.fit_link([4096, 1 << 20], [2e-4, 1.5e-4])
  assert flat.bytes_per_s == math.inf and flat.fixed_s == pytest.approx(1.5e-4)
  with pytest.raises(ValueError, match="two or more probe sizes"):
    auto.fit_link([4096], [1e-3])


@pytest.mark.parametrize("nodes,local,read", [(2, 1, "dense"), (3, 4, "sparse")])
def test_the_model_moves_a_form_s_rest_to_each_form_s_exchange(nodes, local, read):
  """The model's exchanges against hand formulas: dense form (hierarchical) intra reduce-scatter
  and all-gather (a call each, free links) and the node all-reduce of the shard; sparse
  (HiTopKComm) the same intra collectives, the selection and the all-gather of k pairs per
  worker. A step is its rest plus its exchange; a form not read takes the read form's rest."""
  rng = np.random.default_rng(nodes)
  link = auto.Link(rng.uniform(1e-4, 1e-3), rng.uniform(1e6, 1e9))
  n, density = 1_000_003 - 1_000_003 % local, 0.013
  intra = 2 * link.fixed_s if local > 1 else 0.0
  shard = n / local
  k = round(density * shard)
  dense_link = local * 2 * (nodes - 1) / nodes * shard * 4  # `local` rings share the link
  sparse_link = local * (nodes - 1) * k * 8
  select_s = rng.uniform(1e-3, 1e-2)
  want = {"dense": intra + link.fixed_s + dense_link / link.bytes_per_s,
          "sparse": intra + select_s + link.fixed_s + sparse_link / link.bytes_per_s}
  exchange = auto.exchange_s(link, select_s, algorithm="hitopk", n=n, density=density,
                             nodes=nodes, local=local)
  assert exchange == pytest.approx(want, rel=1e-9)
  # in pairs4: 4 bytes a pair and a 4-byte count a 2^16-position block of the shard; the dense
  # form's values bfloat16, or float32 where its steady steps sum float32 (a correction)
  four = local * (nodes - 1) * (4 * k + 4 * math.ceil(shard / 2**16))
  for dense_wire, value_bytes in (("pairs4", 2), ("pairs8", 4)):
    got = auto.exchange_s(link, select_s, algorithm="hitopk", n=n, density=density,
                          nodes=nodes, local=local, wire="pairs4", dense_wire=dense_wire)
    assert got == pytest.approx({
        "dense": want["dense"] - dense_link * (1 - value_bytes / 4) / link.bytes_per_s,
        "sparse": want["sparse"] - (sparse_link - four) / link.bytes_per_s}, rel=1e-9)
  other = "sparse" if read == "dense" else "dense"
  rest = rng.uniform(0.05, 0.1)
  got = auto.predict({read: rest}, exchange, read)
  assert got == pytest.approx({read: rest + want[read], other: rest + want[other]}, rel=1e-9)
  # the other form's own rest, where it has run, stands for it
  got = auto.predict({read: rest, other: 0.021}, exchange, read)
  assert got[other] == pytest.approx(0.021 + want[other], rel=1e-9)
  # a rest below 0 (a step read below its modelled exchange) counts as 0
  assert auto.predict({read: -0.5}, exchange, read) == pytest.approx(want, rel=1e-9)


def test_a_new_input_size_moves_each_form_s_rest_by_the_read_form_s_change():
  """Only the forward and backward pass depends on the input's size: the rest read at the new
  size moves the other form's by the same change; a form not read before takes the read one's."""
  before = {"dense": 0.040, "sparse": 0.047}
  assert auto.moved(before, "sparse", 0.030) == pytest.approx({"dense": 0.023, "sparse": 0.030})
  assert auto.moved({"dense": 0.040}, "dense", 0.050) == {"dense": 0.050, "sparse": 0.050}


@pytest.mark.parametrize("seed", range(5))
def test_a_form_s_rest_is_the_step_weighted_median_of_its_windows(seed):
  """Against numpy: the lower median of every step's rest (each window's repeated its steps)."""
  rng = np.random.default_rng(seed)
  rests = rng.uniform(0.01, 0.9, size=rng.integers(1, 13))
  steps = rng.integers(1, 71, size=rests.size)
  want = np.sort(np.repeat(rests, steps))[(steps.sum() - 1) // 2]
  assert auto.rest_of(list(zip(rests.tolist(), steps.tolist()))) == want
  # one stalled window of 3 steps beside a long one does not move it
  assert auto.rest_of([(0.5, 20), (5.0, 3)]) == 0.5
  with pytest.raises(ValueError, match="at least one window"):
    auto.rest_of([])
  with pytest.raises(ValueError, match="at least 1 step"):
    auto.rest_of([(0.5, 0)])


@pytest.mark.integration
def test_one_stalled_window_does_not_move_the_form_s_rest(tmp_path, monkeypatch):
  """The windows read 20 steps at 0.5 s, then 3 steps at 5 s (the machine stalled): the rest
  stays the first window's and the log says it is a median. (The windows' times replaced by
  fixed ones: a stall cannot be made to happen.)"""
  windows = iter([(0.5, 20)] + [(5.0, 3)] * 9)
  real = auto.AutoExchange._observe

  def observe(self, step, state):
    got = real(self, step, state)
    return None if got is None else (got[0], *next(windows))
  monkeypatch.setattr(auto.AutoExchange, "_observe", observe)
  link = auto.Link(1e-4, math.inf)
  monkeypatch.setattr(auto.controller, "probe_link", lambda *a, **k: (link, link, 0.0))
  summary = train_and_evaluate(auto_config(**{
      "auto.schedule": tuple((s / STEPS_PER_EPOCH, "measured") for s in (0, 4, 8, 12, 16)),
      "compression.warmup_epochs": 0.0, "num_epochs": 2.0}), str(tmp_path), progress=False)
  read = [c for c in summary["exchange_choices"] if c.get("measured_step_ms")]
  assert [round(c["measured_step_ms"]) for c in read][:2] == [500, 5000], read
  rests = [c["dense_rest_ms"] for c in read]
  assert len(rests) >= 3 and rests[1:] == pytest.approx(rests[:1] * (len(rests) - 1)), read
  assert "its rest the median of 2 windows at this level here" in read[1]["how"], read[1]


@pytest.mark.integration
def test_the_rest_is_read_at_the_level_in_force(tmp_path, monkeypatch):
  """The sparse form's windows at the density warm-up's levels read 1 s a step, at the final
  level 0.2 s: from the first window at the final level its rest is that level's (the same at
  every later choice), not the median with the long warm-up windows, whose modelled exchange
  errs otherwise. (Windows' times replaced by fixed ones; F set below 1: sparse throughout.)"""
  final = {}
  real = auto.AutoExchange._observe

  def observe(self, step, state):
    got = real(self, step, state)
    final.setdefault("level", self.sparse_level(self.total_steps - 1))
    if got is None:
      return None
    return got[0], (0.2 if got[0] == final["level"] else 1.0), got[2]
  monkeypatch.setattr(auto.AutoExchange, "_observe", observe)
  link = auto.Link(1e-4, 1e8)
  monkeypatch.setattr(auto.controller, "probe_link", lambda *a, **k: (link, link, 0.0))
  summary = train_and_evaluate(auto_config(**{
      "auto.schedule": tuple((s / STEPS_PER_EPOCH, "measured") for s in range(0, 44, 4)),
      "auto.step_factor": 0.5, "compression.warmup_epochs": 2.0, "num_epochs": 4.0}),
      str(tmp_path), progress=False)
  read = [c for c in summary["exchange_choices"] if c.get("measured") == "sparse"]
  slow = [c for c in read if c["measured_step_ms"] > 500]
  fast = [c for c in read if c["measured_step_ms"] < 500]
  assert slow and len(fast) >= 2, summary["exchange_choices"]
  assert all(c["form"] == "sparse" for c in summary["exchange_choices"][1:])
  rests = [c["sparse_rest_ms"] for c in fast]
  assert rests == pytest.approx(rests[:1] * len(rests)), fast
  assert rests[0] < slow[-1]["sparse_rest_ms"], (fast, slow)


def test_the_step_factor_is_a_quantile_of_the_measured_factors():
  """Against numpy's quantile on fresh factors; the default pool's median, 0.75 and extremes;
  a quantile outside [0, 1] named."""
  factors = np.random.default_rng(7).uniform(0.7, 1.8, size=37)
  for q in (0.0, 0.31, 0.5, 0.75, 1.0):
    assert auto.step_factor(q, factors) == pytest.approx(np.quantile(factors, q))
  pool = auto.STEP_FACTORS
  assert list(pool) == sorted(pool) and auto.step_factor(1.0) == max(pool)
  assert auto.step_factor(0.5) == pytest.approx(float(np.median(pool)))
  assert auto.step_factor(0.0) <= auto.step_factor(0.75) <= auto.step_factor(0.9)
  with pytest.raises(ValueError, match=r"quantile 1.5 is not in \[0, 1\]"):
    auto.step_factor(1.5)


def _feedback_lag(g, k, steps):
  """numpy: error feedback with top-k on a constant gradient `g`: the mean over the last half
  of the steps of the residual's weight in steps of gradient, <e, g> / |g|^2 (the model the
  sparse form keeps behind the dense one)."""
  e, lags = np.zeros_like(g), []
  for t in range(steps):
    acc = e + g
    sent = np.argpartition(np.abs(acc), -k)[-k:]
    e = acc.copy()
    e[sent] = 0.0
    if t >= steps // 2:
      lags.append(e @ g / (g @ g))
  return float(np.mean(lags))


@pytest.mark.parametrize("shape", ["gaussian", "student-t", "lognormal"])
def test_lag_steps_is_what_error_feedback_holds_back(shape):
  """lag_steps from the spread against error feedback run in numpy on fresh gradients: a
  Gaussian one (spread 2/pi, a lag of ~65 steps at k/n ~ 0.5%), a Student-t one of 3 degrees
  and a heavy-tailed lognormal one (most of its mass in fewer values: a lag of ~12 steps)."""
  rng = np.random.default_rng(11)
  n, k = 20_011, 97
  g = {"gaussian": lambda: rng.standard_normal(n), "student-t": lambda: rng.standard_t(3, n),
       "lognormal": lambda: rng.lognormal(0, 1.5, n) * rng.choice([-1, 1], n)}[shape]()
  spread = np.abs(g).sum() ** 2 / (n * (g @ g))
  want = _feedback_lag(g, k, 600)
  assert auto.lag_steps(spread, k / n) == pytest.approx(want, rel=0.15), (spread, want)
  assert auto.lag_steps(spread, 1.0) == 0.0
  with pytest.raises(ValueError, match=r"density 0.0 is not in \(0, 1\]"):
    auto.lag_steps(spread, 0.0)


def test_the_large_link_probe_takes_few_sizes():
  """The large probe's size: the shard over a power of 4, at most the target; over a thousand
  noisy targets only a handful of sizes (each compiles once)."""
  shard = 922_117
  assert auto.large_probe_size(shard, math.inf) == shard
  assert auto.large_probe_size(shard, 2e6) == shard
  assert auto.large_probe_size(shard, 300_000) == shard // 4
  assert auto.large_probe_size(shard, 57_000) == shard // 64
  targets = np.random.default_rng(3).uniform(1e4, 3e6, size=1000)
  sizes = {auto.large_probe_size(shard, t) for t in targets}
  assert sizes == {shard, shard // 4, shard // 16, shard // 64, shard // 256}
  assert all(auto.large_probe_size(shard, t) <= max(t, 1) for t in targets if t < shard)


def test_choose_weighs_steps_and_keeps_the_current_form_within_the_margin():
  step_s = {"dense": 1.0, "sparse": 0.8}
  assert auto.choose(step_s, 1.1, None, 0.05) == "sparse"  # 0.88 < 1
  assert auto.choose(step_s, 1.3, None, 0.05) == "dense"   # 1.04 > 1
  assert auto.choose(step_s, 1.22, "dense", 0.05) == "dense"  # 0.976: not 5% better
  assert auto.choose(step_s, 1.22, "sparse", 0.05) == "sparse"
  assert auto.choose(step_s, 1.1, "dense", 0.05) == "sparse"  # 0.88: 12% better
  # a switch must save more than its compile: 0.07 s a step beyond the margin, over 100 steps
  assert auto.choose(step_s, 1.1, "dense", 0.05, steps_left=100, switch_s=6.9) == "sparse"
  assert auto.choose(step_s, 1.1, "dense", 0.05, steps_left=100, switch_s=7.1) == "dense"
  assert auto.choose(step_s, 1.1, "dense", 0.05, steps_left=10**6, switch_s=7.1) == "sparse"
  # the form in force pays nothing to stay
  assert auto.choose(step_s, 1.1, "sparse", 0.05, steps_left=1, switch_s=100.0) == "sparse"


def test_a_switch_costs_the_other_form_s_programs_at_the_run_s_compile_time():
  assert auto.switch_s(2, [4.0, 5.5, 4.5]) == pytest.approx(9.0)  # 2 x the median
  assert auto.switch_s(1, [3.0]) == 3.0
  assert auto.switch_s(0, [3.0]) == 0.0  # (the other form has run here: compiled)
  assert auto.switch_s(2, []) == 0.0  # (nothing compiled yet: the first choice)


@pytest.mark.parametrize("changes, match", [
    ({"compression.algorithm": "fastest"}, "compression.algorithm.*auto"),
    ({"auto.sparse": "dense"}, "auto.sparse"),
    ({"auto.step_factor": -1.0}, "auto.step_factor"),
    ({"auto.step_factor_quantile": 1.5}, r"auto.step_factor_quantile.*in \[0, 1\]"),
    ({"auto.margin": 1.0}, "auto.margin"),
    ({"auto.probe_budget": 1.0}, "auto.probe_budget"),
    ({"auto.schedule": ((0.5, "dense"),)}, "auto.schedule"),
    ({"auto.schedule": ((0, "dense"), (0.5, "fast"))}, "auto.schedule.*dense, sparse, measured"),
    ({"compression.dense_epochs": -0.1}, "compression.dense_epochs"),
])
def test_bad_auto_keys_are_named(changes, match):
  with pytest.raises(ValueError, match=match):
    config_lib.validate(auto_config(**changes))


# ----------------------------------------------------------------------------- runs

@pytest.fixture(scope="module")
def scheduled_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("scheduled"))
  summary = train_and_evaluate(auto_config(**SCHEDULED), workdir,
                               progress=False)
  return workdir, summary


@pytest.mark.integration
def test_a_scheduled_run_switches_forms_where_told(scheduled_run):
  workdir, summary = scheduled_run
  rows = read_csv(os.path.join(workdir, "train.csv"))
  assert [int(r["step"]) for r in rows] == list(range(1, 23))
  plan = make_plan(config_lib.validate(auto_config(**SCHEDULED)),
                   STEPS_PER_EPOCH)
  assert plan.dense_levels  # the warm-up's first level, 0.8 at 2 nodes: sent dense
  for r in rows:
    step = int(r["step"]) - 1  # the row of step s + 1 is step s's update
    dense = at(SCHEDULE, step) == "dense" or plan.sparse_level(step) in plan.dense_levels
    assert (float(r["density"]) == 1.0) == dense, r
  dense_bytes = {float(r["bytes_sent"]) for r in rows if float(r["density"]) == 1.0}
  sparse_bytes = [float(r["bytes_sent"]) for r in rows
                  if float(r["density"]) == pytest.approx(0.01)]  # (the warm-up's send more)
  assert len(dense_bytes) == 1 and sparse_bytes and max(sparse_bytes) < min(dense_bytes)
  assert [(c["step"], c["form"]) for c in summary["exchange_choices"]] == [
      (0, "sparse"), (7, "dense"), (12, "sparse")]
  assert summary["final_eval"]["accuracy"] > 0.2


@pytest.mark.integration
def test_a_run_resumed_in_the_dense_form_equals_the_uninterrupted_run(scheduled_run, tmp_path):
  workdir, summary = scheduled_run
  resumed = str(tmp_path / "resumed")
  shutil.copytree(workdir, resumed)
  for step in ("20", "22"):  # as if the run had died after the checkpoint at step 10 (dense)
    shutil.rmtree(os.path.join(resumed, "checkpoints", step))
  os.remove(os.path.join(resumed, "summary.json"))
  again = train_and_evaluate(auto_config(**SCHEDULED), resumed,
                             progress=False)
  assert read_csv(os.path.join(resumed, "train.csv")) == read_csv(
      os.path.join(workdir, "train.csv"))
  assert read_csv(os.path.join(resumed, "eval.csv")) == read_csv(
      os.path.join(workdir, "eval.csv"))
  assert again["exchange_choices"] == summary["exchange_choices"]


def test_measuring_is_read_from_the_plan_s_forms():
  c = auto_config()
  assert auto.measuring(make_plan(c, STEPS_PER_EPOCH))
  c.auto.schedule = EPOCHS
  plan = make_plan(c, STEPS_PER_EPOCH)
  assert not auto.measuring(plan) and plan.forms == SCHEDULE
  assert [plan.form(s) for s in (0, 7, 11, 40)] == ["sparse", "dense", "dense", "sparse"]
  c.auto.schedule = ((0, "dense"), (7 / STEPS_PER_EPOCH, "measured"))
  plan = make_plan(c, 11)
  assert auto.measuring(plan) and plan.form(9) == "measured"
  c.compression.algorithm = "hitopk"
  assert not auto.measuring(make_plan(c, 11))


def test_the_dense_start_goes_in_front_of_the_schedule():
  """`compression.dense_epochs` in steps, ahead of whatever the schedule says (entries before
  its end move to it, the last of them in force there)."""
  c = auto_config()
  c.compression.dense_epochs = 0.5  # 44 steps an epoch below: 22
  assert make_plan(c, 44).forms == ((0, "dense"), (22, "measured"))
  c.auto.schedule = ((0.0, "sparse"), (0.25, "measured"), (0.75, "dense"))
  assert make_plan(c, 44).forms == ((0, "dense"), (22, "measured"), (33, "dense"))
  c.compression.algorithm = "hitopk"  # a fixed algorithm: dense, then sparse
  assert make_plan(c, 44).forms == ((0, "dense"), (22, "sparse"))
  c.compression.dense_epochs = 0.0
  assert make_plan(c, 44).forms == ((0, "sparse"),)


def test_probe_interval_stretches_the_cadence_to_the_budget():
  assert auto.probe_interval(0.1, 0.14, 0.0) is None  # no budget: only at the start
  assert auto.probe_interval(0.0001, 0.14, 0.02) == 1  # cheap probes: every step
  # 0.1 s of probes within 2% of the steps between: 0.1 / (0.02 x 0.14 s) = 35.7 steps
  assert auto.probe_interval(0.1, 0.14, 0.02) == 36
  assert auto.probe_interval(0.3, 0.05, 0.01) == math.ceil(0.3 / (0.01 * 0.05))
  # the measurements so far (0.5 s: the first one's compilations) within 2% of the run's time
  # by the next: (0.5 + 0.1) / (0.02 x 0.14) = 214.3 steps of the run, 20 of them run already
  assert auto.probe_interval(0.1, 0.14, 0.02, spent_s=0.5, step=20) == 195
  # ... once paid back, the measurement's own share sets the cadence again
  assert auto.probe_interval(0.1, 0.14, 0.02, spent_s=0.5, step=400) == 36


@pytest.mark.integration
def test_a_measurement_sets_the_next_one_by_its_probes_cost(tmp_path):
  """Under a budget, the first choice (on the link's read alone) is read again as soon as the
  chosen form has run MIN_WINDOW steps at one level (from step 4), without a probe; the next
  measurement then waits for `next_step`, set from the probes' time and the chosen form's step:
  at 0.01% of the run none fits in 11 steps."""
  summary = train_and_evaluate(auto_config(**{
      "auto.probe_budget": 1e-4, "num_epochs": 1.0}), str(tmp_path), progress=False)
  choices = summary["exchange_choices"]
  window = auto.AutoExchange.MIN_WINDOW
  assert len(choices) == 2 and choices[1]["step"] >= window + 1, choices
  first, c = choices
  assert first["measured"] is None and first["next_step"] > 11, first
  assert c["measured"] == first["form"] and c["how"] == f"observed over {window} steps"
  assert c["link_MBps"] == first["link_MBps"] and c["probe_ms"] == first["probe_ms"]  # no probe
  step_s = {"dense": c["dense_step_ms"], "sparse": c["sparse_step_ms"]}[c["form"]] / 1e3
  interval = auto.probe_interval(c["probe_ms"] / 1e3, step_s, 1e-4, spent_s=c["spent_ms"] / 1e3,
                                 step=c["step"])
  assert c["probe_ms"] > 0 and c["next_step"] == c["step"] + max(interval, window + 1) > 11
  assert first["measure_ms"] >= first["probe_ms"]  # the whole measurement holds its probes


@pytest.mark.integration
def test_a_dense_start_then_measured_runs_dense_first_and_measures_from_there(tmp_path):
  """`compression.dense_epochs` (7 steps): dense to step 7 whatever the link (1-bit Adam's
  start), the first measurement at 7, then where the schedule asks (10 and 20)."""
  summary = train_and_evaluate(auto_config(**{
      "compression.dense_epochs": 7 / STEPS_PER_EPOCH,
      "auto.schedule": tuple((s / STEPS_PER_EPOCH, "measured") for s in (0, 10, 20))}),
      str(tmp_path), progress=False)
  choices = summary["exchange_choices"]
  assert [(c["step"], c["why"]) for c in choices] == [
      (0, "schedule"), (7, "measured"), (10, "measured"), (20, "measured")]
  assert choices[0]["form"] == "dense"
  rows = read_csv(os.path.join(str(tmp_path), "train.csv"))
  for r in rows:
    step = int(r["step"]) - 1
    form = [c["form"] for c in choices if c["step"] <= step][-1]
    assert (float(r["density"]) == 1.0) == (form == "dense"), r


@pytest.mark.integration
def test_a_new_image_size_is_read_from_the_form_in_force_s_steps_there(tmp_path):
  """Progressive resizing (8 px, then 6 from step 13): once the form in force has run
  MIN_WINDOW steps at the new size (14-16: the step at 13 compiles), its rest is read there,
  outside the budget's cadence and without a link probe (the link as last read); the entry
  says the input's shape."""
  config = auto_config(**{"data.resize_schedule": ((0, 8), (13 / STEPS_PER_EPOCH, 6)),
                          "auto.probe_budget": 1e-4})
  summary = train_and_evaluate(config, str(tmp_path), progress=False)
  choices = summary["exchange_choices"]
  window = auto.AutoExchange.MIN_WINDOW
  assert len(choices) == 3 and choices[2]["step"] == 14 + window, choices
  _, before, after = choices
  assert "input_shape" not in before and after["input_shape"][1:3] == [6, 6]
  assert after["measured"] == before["form"] and after["how"] == f"observed over {window} steps"
  assert after["link_MBps"] == before["link_MBps"]  # (no probe: the link as last read)
  form = after["measured"]
  assert after[f"{form}_rest_ms"] != before[f"{form}_rest_ms"]


@pytest.mark.integration
def test_a_measured_run_logs_each_choice_with_its_figures(tmp_path):
  summary = train_and_evaluate(auto_config(**{
      "auto.schedule": ((0, "measured"), (10 / STEPS_PER_EPOCH, "measured")),
      "num_epochs": 1.0}), str(tmp_path), progress=False)
  choices = summary["exchange_choices"]
  assert [c["step"] for c in choices] == [0, 10]
  form = None
  for c in choices:
    assert c["why"] == "measured"
    assert c["link_MBps"] > 0
    # the selection probed where the sparse form won without it (or ran), and kept
    if any(x["form"] == "sparse" for x in choices if x["step"] <= c["step"]):
      assert c["select_ms"] > 0, c
    assert c["select_ms"] is None or c["select_ms"] > 0
    # the steps factor: the default quantile of the measured factors, and said so
    assert c["step_factor"] == pytest.approx(auto.step_factor(0.75)), c
    assert c["factor_from"] == "auto.step_factor_quantile 0.75", c
    assert min(c["sparse_step_ms"], c["dense_step_ms"]) > 0
    form = auto.choose({"dense": c["dense_step_ms"], "sparse": c["sparse_step_ms"]},
                       c["step_factor"], form, 0.05, steps_left=c["remaining_steps"],
                       switch_s=c["switch_ms"])
    assert c["form"] == form
  # the first choice on the link's read alone (no step read: the rest taken as 0); the second
  # saw the form in force run (steps 1-9: the step after a measurement opens the window; the
  # evaluation at 10 left out; a sparse form's window restarts where its warm-up changes level)
  assert choices[0]["measured"] is None and choices[0]["how"].startswith("no step read yet")
  assert choices[1]["measured_step_ms"] > 0
  observed = [9] if choices[0]["form"] == "dense" else range(auto.AutoExchange.MIN_WINDOW, 10)
  assert any(choices[1]["how"].startswith(f"observed over {n} steps") for n in observed), choices
  assert choices[1]["measured"] == choices[0]["form"]
  rows = read_csv(tmp_path / "auto.csv")
  assert [int(r["step"]) for r in rows] == [0, 10]
  assert [float(r["dense"]) for r in rows] == [float(c["form"] == "dense") for c in choices]


@pytest.mark.integration
@pytest.mark.slow  # (55 s; CI's budget: the study's changing-link run with auto stays in CI)
def test_auto_follows_a_link_that_changes_under_it(tmp_path):
  """2 emulated nodes of one worker, ResNet-20 on digits: its dense exchange (1.1 MB) takes
  ~0.45 s at 20 Mbit/s against ~16 ms of compute a step, so auto starts sparse; the link is
  lifted once that first choice is logged, and a later measurement switches to the dense form
  (its exchange then takes 0.3-7 ms: the lifted veth measured 160-3,600 Mbit/s unloaded, 305 in
  one CI run beside other tests). The sparse form's steps are taken as 3x dense's, so that the
  choice after the lift is clear of the probes' noise: dense wins above ~30 MB/s, and the
  throttled link (2.5 MB/s) still calls for sparse."""
  need_root("tests")
  workdir = tmp_path / "run"
  argv = ["train", os.path.join(ROOT, "configs", "quickstart.py"), "--workdir", str(workdir),
          "--no-progress", "--set", "mesh.local=1", "--set", "mesh.num_devices=2",
          "--set", "batch_size=64", "--set", "num_epochs=3", "--set", "compression.algorithm=auto",
          "--set", "auto.step_factor=3.0", "--set", "auto.probe_budget=0.2",
          "--set", "eval_every_steps=0",
          "--set", "checkpoint_every_steps=0"]
  out, result = io.StringIO(), {}
  with cluster.EmulatedCluster(2, 20 * 10**6) as c:
    worker = threading.Thread(target=lambda: result.update(rc=cluster.launch(
        argv, nodes=2, procs_per_node=1, devices_per_proc=1, cluster=c, out=out)))
    worker.start()
    deadline = time.monotonic() + 240
    while not (workdir / "auto.csv").exists() and time.monotonic() < deadline:
      time.sleep(0.02)
    c.set_rate(None)
    worker.join(300)
  assert result.get("rc") == 0, out.getvalue()[-3000:]
  choices = json.load(open(workdir / "summary.json"))["exchange_choices"]
  assert choices[0]["form"] == "sparse" and choices[0]["link_MBps"] < 5, choices[0]
  # the first choice leaves dense (before any choice, the form that costs no steps) on two reads
  assert "; link read twice (" in choices[0]["how"], choices[0]
  assert all(c["link_MBps"] > 10 for c in choices[1:]), choices  # every later probe saw the lift
  assert "dense" in [c["form"] for c in choices[1:]], (  # ... and auto switched to dense
      "\n".join(line for line in out.getvalue().splitlines() if "auto:" in line))
  # Each choice is the one its own figures call for, from the form before it (on a loaded
  # machine a later probe can still measure the lifted link slow enough for sparse: one CI run's
  # did at 1.5x, and switching back is then right).
  for before, c in zip(choices, choices[1:]):
    step_s = {"dense": c["dense_step_ms"], "sparse": c["sparse_step_ms"]}
    assert c["form"] == auto.choose(step_s, 3.0, before["form"], 0.05,
                                    steps_left=c["remaining_steps"], switch_s=c["switch_ms"]
                                    ), (before, c)
  assert "sparsejax auto: step 0:" in out.getvalue()


@pytest.mark.integration
@pytest.mark.parametrize("slow_first", [False, True])
def test_a_form_is_switched_only_on_a_second_read_of_the_link(tmp_path, monkeypatch, slow_first):
  """A slow misread of the link at step 0 would start sparse: the link is then read again, the
  faster read kept, and dense stays. A read that keeps the form in force is not taken again.
  (The probes replaced by fixed reads: a misread cannot be made to happen.)"""
  reads = []

  def probe(mesh, shard, prior=None, untimed=None):
    slow = slow_first and not reads
    reads.append(slow)
    link = auto.Link(1e-4, 1e3 if slow else math.inf)  # 8 kbit/s: a 1-s dense exchange
    return link, link, 0.0
  monkeypatch.setattr(auto.controller, "probe_link", probe)
  summary = train_and_evaluate(auto_config(**{"num_epochs": 1.0}), str(tmp_path),
                               progress=False)
  first = summary["exchange_choices"][0]
  assert ("link read twice" in first["how"]) == slow_first, first
  assert first["form"] == "dense" and first["link_MBps"] == math.inf, first
  measured = [c for c in summary["exchange_choices"] if c["why"] == "measured"]
  assert len(reads) == len(measured) + slow_first and reads[0] == slow_first, reads


@pytest.mark.integration
def test_a_switch_must_save_more_than_the_other_form_s_compile(tmp_path, monkeypatch):
  """The link read at 8 kbit/s at step 0 (sparse chosen), too fast to tell at 10 and 20 (dense
  faster a step, by the sparse steps' factor of 1.2): with 12 and 2 steps left, a switch would
  save less than compiling the dense form's two programs at this size costs (the median of what
  the run's programs took), so the sparse form stays; without the compile it would have
  switched."""
  def probe(mesh, shard, prior=None, untimed=None):
    link = auto.Link(1e-4, 1e3 if probe.reads < 2 else math.inf)  # (step 0 reads twice)
    probe.reads += 1
    return link, link, 0.0
  probe.reads = 0
  monkeypatch.setattr(auto.controller, "probe_link", probe)
  summary = train_and_evaluate(auto_config(**{
      "auto.schedule": tuple((s / STEPS_PER_EPOCH, "measured") for s in (0, 10, 20)),
      "auto.step_factor": 1.2, "compression.warmup_epochs": 0.0}), str(tmp_path),
      progress=False)  # (no warm-up: the plain sparse form throughout)
  first, *later = summary["exchange_choices"]
  programs = summary["programs"]
  assert first["form"] == "sparse" and first["switch_ms"] == 0, first  # (nothing to switch from)
  assert {p["form"] for p in programs} == {"sparse"}, programs  # the dense form never compiled
  for c in later:
    compiled = [p["compile_s"] for p in programs if p["first_step"] < c["step"]]
    assert c["switch_ms"] == pytest.approx(2e3 * np.median(compiled), rel=1e-4), (c, compiled)
    step_s = {"dense": c["dense_step_ms"], "sparse": c["sparse_step_ms"]}
    assert c["form"] == "sparse" and c["dense_step_ms"] < c["sparse_step_ms"] * c["step_factor"]
    assert auto.choose(step_s, c["step_factor"], "sparse", 0.05) == "dense", c
  assert all(p["compile_s"] > 0 and p["size"] is None for p in programs), programs


@pytest.mark.integration
def test_the_probes_wait_for_the_steps_the_run_dispatched(monkeypatch):
  """A measurement with no window to close (the step after another one) still lets the run's
  dispatched steps finish before it times the link: a probe queued behind them read their time
  as the link's."""
  from sparsejax.train import Run
  ready = []

  def probe(mesh, shard, prior=None, untimed=None):
    ready.append(all(x.is_ready() for x in jax.tree.leaves(run.state)))
    link = auto.Link(1e-4, math.inf)
    return link, link, 0.0
  monkeypatch.setattr(auto.controller, "probe_link", probe)
  run = Run(auto_config(**{"auto.schedule": tuple(
      (s / STEPS_PER_EPOCH, "measured") for s in (0, 1, 2, 3)), "num_epochs": 0.5}))
  for step in range(4):
    run.step(step)
  run.wait()
  assert len(ready) >= 4 and all(ready), ready


def test_of_two_link_reads_the_faster_is_kept():
  """A stall makes a probe slow, nothing makes it fast: of two reads, the one that moves the
  shard sooner (an unlimited link read 194 Mbit/s once and too fast to tell the next time)."""
  mb = 1e6
  slow, fast = auto.Link(0.0004, 24.25 * mb), auto.Link(0.0009, math.inf)
  assert auto.faster(slow, fast, 1e6) == fast and auto.faster(fast, slow, 1e6) == fast
  # a small transfer is decided by the fixed cost per call
  assert auto.faster(slow, fast, 100) == slow
  assert auto.faster(auto.Link(0.001, 5 * mb), auto.Link(0.001, 6 * mb), 1e6).bytes_per_s == 6 * mb


@pytest.mark.parametrize("algorithm", ["hitopk", "allgather", "higtopk"])
def test_a_link_read_too_slow_for_a_step_is_raised_to_fit_it(algorithm):
  """A step holds its exchange: where the probes' link makes a form's modelled exchange longer
  than its whole step, the bandwidth is raised until it fits (the rest is then 0); a link the
  steps allow is left as read."""
  m = SimpleNamespace(link=auto.Link(1e-4, 0.25e6))
  model = dict(algorithm=algorithm, n=13_337, density=0.01, nodes=3, local=2)

  def exchange(link):
    return auto.exchange_s(link, 2e-4, **model)
  slow = exchange(m.link)
  assert slow["dense"] > 0.1  # 13,337 floats at 2 Mbit/s
  steps = {"dense": 0.0015, "sparse": slow["sparse"] * 2}
  fitted = auto.fit_in_steps(m.link, steps, exchange)
  assert fitted.fixed_s == m.link.fixed_s and fitted.bytes_per_s > 50 * m.link.bytes_per_s
  assert exchange(fitted)["dense"] == pytest.approx(0.0015, rel=1e-6)
  # the fit leaves alone a link the steps allow, and one a step cannot speak for: a step
  # shorter than the part of the exchange no bandwidth changes (a misread selection probe)
  assert auto.fit_in_steps(fitted, steps, exchange) == fitted
  assert auto.fit_in_steps(m.link, {"dense": 2 * slow["dense"]}, exchange) == m.link
  floor = exchange(m.link._replace(bytes_per_s=math.inf))
  assert auto.fit_in_steps(m.link, {"sparse": 0.5 * floor["sparse"]}, exchange) == m.link
  both = {"dense": 0.0015, "sparse": 0.5 * floor["sparse"]}  # the dense step still speaks
  assert auto.fit_in_steps(m.link, both, exchange) == fitted
