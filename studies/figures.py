"""The numbers the README's "Does it pay?", docs/headline-results.md and the LM study's pages
quote, each tied to the result file it comes from.

  python -m studies.figures          # every quote, its file, its value now, and how it was made

A `Quote` is a piece of a document's text with its numbers as format fields, the committed
result file they come from, and the function that computes them from that file.
tests/test_figures.py formats each quote from its file and finds it in the document (whitespace
collapsed), so a rerun that changes a number changes the text, or the test fails. `how` says
what the number is: trained end to end and timed, modelled (steps trained at one link x the
step time swept at another), steps only (no time), or a benchmark (an exchange or a compute
step alone, timed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.scale import speedups
from sparsejax.bench import spread
from studies.auto import end_to_end
from studies.time_to_accuracy import analysis, limit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TTA = "studies/time_to_accuracy/results/"
WS = "studies/worker_scaling/results/"
LM = TTA + "time_to_target_lm.json"  # the KJV Transformer's figure (`limit.py`)
LM_LINKS = ("100mbit", "50mbit")
LM_SLOW = TTA + "time_to_accuracy_lm_pinned_slow.json"  # the LM's modelled table at 50 Mbit/s
MLP_LIMIT = TTA + "limit_mlp_500mbit.json"  # the MLP's limit at 500 Mbit/s (`limit.py`)
MLP_PAIRS = ("hitopk-0.01-mc", "hitopk-0.01-mc+experimental.wire=pairs4")  # 8, 4 bytes
LM_LIMIT = TTA + "limit_lm_100mbit.json"  # the 1-bit recipe's limit at 100 Mbit/s (`limit.py`)
LM_HELD_OUT = TTA + "limit_pydocs_100mbit.json"  # the same on the held-out Python docs corpus
LM_PIPE4 = "hitopk-0.1-1bit+experimental.wire=pairs4+overlap.pipeline=device+overlap.predict=local"
CNN = TTA + "time_to_target_cnn.json"  # the ResNet-20 task's figure (`limit.py`)
CNN_SYSTEM = "hitopk-0.04-mc-mean-w3"  # the study's best CNN system, in 8- and 4-byte pairs
CNN_PAIRS4 = CNN_SYSTEM + "+experimental.wire=pairs4"
HOW = ("trained end to end", "modelled", "steps only", "benchmark")


@dataclasses.dataclass(frozen=True)
class Quote:
  """`text` (its numbers as `str.format` fields) in `doc`, the values from `source`: a result
  file; a results folder (ending in "/") for a quote over every result in it, read as {file
  name: its results}; or several files (paths joined by " + ", a quote that sets one result
  against another), read as {path: its results}."""

  doc: str
  text: str
  source: str
  values: Callable[[dict[str, Any]], Sequence[Any]]
  how: str

  def __post_init__(self):
    if self.how not in HOW:
      raise ValueError(f"Quote.how must be one of {HOW}, got {self.how!r}")

  @property
  def sources(self) -> list[str]:
    """The result files (or the folder) `source` names."""
    return self.source.split(" + ")

  def load(self, root: str = ROOT) -> dict[str, Any]:
    path = os.path.join(root, self.source)
    if self.source.endswith("/"):
      return {name: _read(os.path.join(path, name))
              for name in sorted(os.listdir(path)) if name.endswith(".json")}
    if len(self.sources) > 1:
      return {p: _read(os.path.join(root, p)) for p in self.sources}
    return _read(path)

  def expected(self, root: str = ROOT) -> str:
    """The quote as its file says it should read now."""
    return self.text.format(*self.values(self.load(root)))


def _read(path: str) -> dict[str, Any]:
  with open(path) as f:
    return json.load(f)


def normalized(text: str) -> str:
  """`text` with every run of whitespace one space (a quote may break across lines)."""
  return re.sub(r"\s+", " ", text)


# --- the expressions, over one loaded result file

def _min_max(values: Sequence[float]) -> tuple[float, float]:
  return min(values), max(values)


def _speedups(slower: str, faster: str, links: Sequence[str]) -> Callable:
  """A time-to-accuracy file's time to target of `slower` over `faster`'s, seed by seed at
  each of `links` (modelled: steps x the step swept there): (min, max)."""
  return lambda j: _min_max([r for link in links
                             for r in analysis.speedups(j["analysis"], slower)[faster][link]])


def _trained_over(baseline: str, system: str) -> Callable:
  """A limit file's (`studies.time_to_accuracy.limit`) time to target of `baseline` over
  `system`'s, seed by seed at each of its slow links, both trained end to end there: (min,
  max)."""
  return lambda j: _min_max([r for at in j["analysis"][system]["links"].values()
                             for r in at[f"{baseline}_over"]])


def _below(worst: float) -> tuple[()]:
  """Nothing to format: the quote's words say that every seed ended below dense, so a rerun
  where one does not must change them."""
  if worst >= 0:
    raise ValueError(f"a seed ended {worst:+.2f}% from dense's final metric, not below it")
  return ()


def _trained_medians(baseline: str, system: str, links: Sequence[str]) -> Callable:
  """A limit file's median over seeds of `baseline`'s time to target over `system`'s at each of
  `links` in turn, both trained end to end there."""
  return lambda j: tuple(statistics.median(j["analysis"][system]["links"][link][f"{baseline}_over"])
                         for link in links)


def _speedup_median(slower: str, faster: str, link: str) -> Callable:
  """The median over seeds of `_speedups` at one link."""
  return lambda j: (statistics.median(analysis.speedups(j["analysis"], slower)[faster][link]),)


def _gtopk_over_allgather(phase: str = "exchange") -> Callable:
  """A scale benchmark's TopK all-gather time of `phase` over gTop-k's, run by run: (min, max)."""
  def values(j):
    (ratios,) = speedups(j["analysis"], phase=phase).values()  # (one node count a file)
    return min(ratios), max(ratios)
  return values


def _dense_slowdown(*links: str) -> Callable:
  """A limit file's dense step at each of `links` over its unlimited step (median of seeds)."""
  return lambda j: tuple(statistics.median(j["dense_step_over_unlimited"][link])
                         for link in links)


def _at_link(link: str) -> Callable:
  return lambda j: (next(r["best_gtopk_over_allgather"] for r in j["rows"]
                         if r["link"] == link),)


def _measured_over_predicted(j):
  ratios = [v for s in j["analysis"].values() for v in s["measured_over_predicted_at_headline"]]
  return (max(abs(1 - v) for v in ratios) * 100,)


def _median_times(link: str, systems: Sequence[str]) -> Callable:
  """A time-to-accuracy file's median time to target of each of `systems` at `link` (modelled:
  steps x the step swept there), after the link's R."""
  def values(j):
    a = j["analysis"]
    return (j["exchange_over_compute"][link], *(
        statistics.median(a[s]["predicted_time_to_target_s"][link]) for s in systems))
  return values


def _trained_times(systems: Sequence[str]) -> Callable:
  """Each of `systems`' median measured train time to target (trained end to end)."""
  return lambda j: tuple(statistics.median(x["train_time_to_target_s"]
                                           for x in j["analysis"][s]["seeds"]) for s in systems)


def _finals(*systems: str, key: str = "final") -> Callable:
  """Each of `systems`' final metrics, sorted (min / median / max of the seeds), in turn."""
  return lambda j: tuple(v for s in systems for v in sorted(j["analysis"][s][key]))


def _whole_finals(*systems: str) -> Callable:
  """A `limit.py` file's median final metric of each of `systems` over the whole recipe (its
  runs at the unlimited link), in turn."""
  return lambda j: tuple(statistics.median(r["final"] for r in j["runs"] if r["system"] == s
                                           and r["link"] == "unlimited") for s in systems)


def _run_medians(system: str, links: Sequence[str]) -> Callable:
  """A `limit.py` file's median time to target of `system` at each of `links` in turn."""
  return lambda j: tuple(statistics.median(limit.times(j, system, link)) for link in links)


def _seed_times(*systems: str) -> Callable:
  """Each of `systems`' measured train times to target, sorted, in turn."""
  return lambda j: tuple(v for s in systems for v in sorted(
      x["train_time_to_target_s"] for x in j["analysis"][s]["seeds"]))


def _steps(*systems: str) -> Callable:
  """A time-to-accuracy file's steps to target of each of `systems`, seed by seed, in turn."""
  return lambda j: tuple(x["steps_to_target"] for s in systems for x in j["analysis"][s]["seeds"])


def _speedups_sorted(slower: str, faster: str, link: str) -> Callable:
  """A time-to-accuracy file's modelled time to target of `slower` over `faster`'s at `link`,
  seed by seed, sorted (min / median / max of the seeds)."""
  return lambda j: tuple(sorted(analysis.speedups(j["analysis"], slower)[faster][link]))


def _limit(system: str, link: str, key: str = "limit") -> Callable:
  """A `limit.py` file's limit ratios of `system` at `link` (`key` "limit_after_dense": over
  the steps after the recipe's dense start), one a seed."""
  return lambda j: j["analysis"][system]["links"][link][key]


def _sweep_exchange(link: str, size: int) -> Callable:
  """A time-to-accuracy file without a parity phase: dense's swept step at `link` less its
  unlimited one, over the unlimited one, at image size `size`."""
  def values(j):
    def step(at):
      return analysis.recipe_step(j, [r for r in j["sweep"] if r["system"] == "dense"
                                      and r["bandwidth"] == at and r["size"] == size])
    return (step(link) / step("unlimited") - 1,)
  return values


def _link_values(key: str, link: str, *systems: str) -> Callable:
  """A `limit.py` file's `key` ("limit", "dense_over", ...) at `link` for each of `systems`,
  sorted (min / median / max of the seeds), in turn: as `_finals` for the final metrics."""
  return lambda j: tuple(v for s in systems
                         for v in sorted(j["analysis"][s]["links"][link][key]))


def _held_out_pipelined(j):
  """The held-out limit file's pipelined 4-byte system: its median time to target over dense's
  and DDP's, then its limit ratio after the dense start (min, max); every seed below dense."""
  return (*_trained_medians("dense", LM_PIPE4, ("100mbit",))(j),
          *_trained_medians("torch-ddp", LM_PIPE4, ("100mbit",))(j),
          *_min_max(_limit(LM_PIPE4, "100mbit", "limit_after_dense")(j)),
          *_below(max(j["analysis"][LM_PIPE4]["final_vs_dense"])))


def _lm_gap(j):
  """The LM figure's HiTopKComm 0.05: its median final loss over dense's (%), then both losses."""
  return (statistics.median(j["analysis"]["hitopk-0.05"]["final_vs_dense"]),
          *_whole_finals("hitopk-0.05", "dense")(j))


def _parity(j):
  return tuple(sorted(p["jax_over_torch"] for p in j["parity"]))


def _auto_by_seed(j):
  row = j["rows"][0]
  return (row["auto_over_best"], min(row["auto_over_best_by_seed"]),
          max(row["auto_over_best_by_seed"]))


def _auto_first_share(j):
  """An auto file's median over seeds of its first measurement's share of its run, in %."""
  row = j["rows"][0]
  return (100 * statistics.median(f / t for f, t in zip(row["auto_first_measure_s"],
                                                         row["auto_time_s"]) if t),)


def _at_step_over(system: str) -> Callable:
  """An auto file's clock over `system`'s at the same step, by seed: (min, max)."""
  def values(j):
    v = j["rows"][0]["auto_at_step_over"][system]
    return min(v), max(v)
  return values


def _auto_over_best(j):
  return (j["rows"][0]["auto_over_best"],)


AUTO = "studies/auto/results/auto_v2_"
HEADLINE = "docs/headline-results.md"
LM_DOC = "docs/time-to-accuracy-lm.md"
TTA_README = "studies/time_to_accuracy/README.md"


LONG_RUN_S = 20.0  # auto's runs that pay back its first measurement (all but MNIST's 6-10 s)


def _auto_measuring(at_least_s: float, shortest: bool) -> Callable:
  """Over every auto result, per seed: auto's measurements and its switches' compiles over its
  run with them (`end_to_end.shares`) on the runs of at least `at_least_s` s, or (`shortest`)
  its first measurement over its run on those shorter: (min, max) in %."""
  def values(files):
    got = []
    for j in files.values():
      for row in j["rows"]:
        times = [t for t in row["auto_time_s"] if t]
        firsts = [f for f, t in zip(row["auto_first_measure_s"], row["auto_time_s"]) if t]
        for share, first, t in zip(end_to_end.shares(row), firsts, times):
          if (t < at_least_s) == shortest:
            got.append(first / t if shortest else share)
    return 100 * min(got), 100 * max(got)
  return values


AUTO_README = "studies/auto/README.md"
AUTO_STEMS = ("cnn_unlimited", "cnn_10mbit", "kjv_unlimited", "kjv_50mbit", "pydocs_unlimited",
              "pydocs_50mbit", "mnist_unlimited", "mnist_500mbit", "pydocs_long_unlimited",
              "pydocs_long_50mbit", "mnist_resnet_unlimited", "mnist_resnet_10mbit")
_SYSTEM_NAMES = (("dense", "dense"), ("hitopk-", "HiTopKComm "), ("torch-ddp", "PyTorch DDP"))


def _system_name(system: str) -> str:
  """A system's name in the auto table: HiTopKComm and its density, dense, PyTorch DDP."""
  for prefix, name in _SYSTEM_NAMES:
    if system.startswith(prefix):
      return name + (system[len(prefix):].split("-")[0] if prefix.endswith("-") else "")
  raise ValueError(f"no table name for system {system!r}")


def _link_name(link: str) -> str:
  return "unlimited" if link == "unlimited" else f"{link[:-4]} {link[-4].upper()}bit/s"


def _auto_row(j):
  """An auto file's row of the auto README's table, from the link to the commit: times (s,
  min / median / max), auto over the best fixed system (by seed), its measurements and
  switch compiles (their share of the run), its steps and each seed's forms."""
  row, meta = j["rows"][0], j["meta"]
  trained = [s for prefix, _ in _SYSTEM_NAMES for s in sorted(row["fixed_trained"])
             if s.startswith(prefix)]
  fixed = "; ".join(f"{_system_name(s)} {spread(row['fixed_time_s'][s], 1)}" for s in trained)
  compiles = [c or 0.0 for c in row.get("auto_compile_s") or [0.0]]
  share = [100 * s for s in end_to_end.shares(row)]
  steps = sorted({*row["auto_steps"]})
  forms = [", then ".join(f for _, f in seed) for seed in row["forms"]]
  return (_link_name(row["bandwidth"]), f"{row['R']:.2g}", spread(row["auto_time_s"], 1), fixed,
          row["auto_over_best"], spread(row["auto_over_best_by_seed"], 2),
          spread(row["auto_measure_s"], 2),
          "0" if not any(compiles) else spread(compiles, 2), min(share), max(share),
          str(steps[0]) if len(steps) == 1 else spread(row["auto_steps"], 0),
          forms[0] if len(set(forms)) == 1 else ", ".join(forms), meta["commit"])


def _one_form(at_least_s: float) -> Callable:
  """Nothing to format: the quote's words say that on every run of at least `at_least_s` s
  auto ran one form from step 0, dense at the unlimited link and sparse at the slow ones."""
  def values(files):
    for name, j in files.items():
      for row in j["rows"]:
        want = "dense" if row["bandwidth"] == "unlimited" else "sparse"
        for t, forms in zip(row["auto_time_s"], row["forms"]):
          if t and t >= at_least_s and forms != [[0, want]]:
            raise ValueError(f"{name} at {row['bandwidth']}: a {t:.0f} s run's forms {forms}, "
                             f"not {want} from step 0")
    return ()
  return values


def _ddp_over_auto(files):
  """Over the auto results with PyTorch DDP trained beside auto: DDP's median time over
  auto's, (min, max) at the slow links, then (min, max) at the unlimited link."""
  got = {True: [], False: []}
  for j in files.values():
    for row in j["rows"]:
      if "torch-ddp" in row["fixed_trained"]:
        got[row["bandwidth"] != "unlimited"].append(row["ddp_over_auto"])
  return (*_min_max(got[True]), *_min_max(got[False]))


def _auto(text: str, name: str) -> Quote:
  """A README quote of auto's median time to target over the best fixed system's (its result
  `studies/auto/results/auto_v2_<name>.json`, trained end to end)."""
  return Quote("README.md", text, AUTO + name + ".json", _auto_over_best, "trained end to end")

MLP = ("dense", "hitopk-0.01-mc", "hitopk-0.001-mc", "hitopk-0.01", "torch-ddp")
MLP_SLOW = ("2gbit", "1gbit", "500mbit", "200mbit")  # the MLP's links where R >= 2 (1.98 at 2)

QUOTES: tuple[Quote, ...] = (
    Quote("README.md", "HiTopKComm 0.001 with momentum correction reaches the target "
          "{0:.2f}-{1:.1f}x sooner than sparsejax dense",
          TTA + "time_to_target_mlp.json", _trained_over("dense", "hitopk-0.001-mc"),
          "trained end to end"),
    Quote("README.md", "and {0:.2f}-{1:.1f}x sooner than PyTorch DDP, each trained end to end at "
          "the link (every seed)", TTA + "time_to_target_mlp.json",
          _trained_over("torch-ddp", "hitopk-0.001-mc"), "trained end to end"),
    Quote("README.md", "(2 Gbit/s to 200 Mbit/s, where dense's step is {0:.1f}-{1:.0f}x its "
          "unlimited one)", TTA + "time_to_target_mlp.json",
          _dense_slowdown("2gbit", "200mbit"), "trained end to end"),
    Quote("README.md", "Transformer LM (KJV; 100 and 50 Mbit/s, where dense's step is {0:.1f}x "
          "and {1:.1f}x its unlimited one)", LM,
          _dense_slowdown(*LM_LINKS), "trained end to end"),
    Quote("README.md", "HiTopKComm 0.05 reaches the target {0:.2f}x and {1:.2f}x sooner than "
          "dense and {2:.2f}x and {3:.2f}x sooner than DDP", LM,
          lambda j: (*_trained_medians("dense", "hitopk-0.05", LM_LINKS)(j),
                     *_trained_medians("torch-ddp", "hitopk-0.05", LM_LINKS)(j)),
          "trained end to end"),
    Quote("README.md", "but ends {0:.1f}% higher", LM,
          lambda j: (statistics.median(j["analysis"]["hitopk-0.05"]["final_vs_dense"]),),
          "trained end to end"),
    Quote(HEADLINE, "but ends at a {0:.1f}% higher loss ({1:.2f} against {2:.2f})", LM, _lm_gap,
          "trained end to end"),
    Quote("README.md", "HiTopKComm 0.1 reaches it at dense's step, {0:.2f}x and {1:.2f}x sooner "
          "than dense, and ends {2:.1f}% below dense's loss", LM,
          lambda j: (*_trained_medians("dense", "hitopk-0.1-1bit", LM_LINKS)(j),
                     -statistics.median(j["analysis"]["hitopk-0.1-1bit"]["final_vs_dense"])),
          "trained end to end"),
    Quote("README.md", "JAX's step {0:.2f}x PyTorch's",
          TTA + "time_to_accuracy_cnn_parity.json",
          lambda j: (statistics.median(p["jax_over_torch"] for p in j["parity"]),),
          "benchmark"),
    Quote("README.md", "(LARS, resizing; 10 Mbit/s, where dense's step is {0:.1f}x its unlimited "
          "one;", CNN, _dense_slowdown("10mbit"), "trained end to end"),
    Quote("README.md", "reaches the target {0:.2f}-{1:.2f}x sooner than dense and {2:.2f}-{3:.2f}x "
          "sooner than DDP", CNN,
          lambda j: (*_trained_over("dense", CNN_SYSTEM)(j),
                     *_trained_over("torch-ddp", CNN_SYSTEM)(j)), "trained end to end"),
    Quote("README.md", "with 4-byte pairs {0:.2f}-{1:.2f}x and {2:.2f}-{3:.2f}x", CNN,
          lambda j: (*_trained_over("dense", CNN_PAIRS4)(j),
                     *_trained_over("torch-ddp", CNN_PAIRS4)(j)), "trained end to end"),
    Quote("README.md", "final accuracy {0:+.2f} and {1:+.2f} points from dense's", CNN,
          lambda j: tuple(statistics.median(j["analysis"][s]["final_vs_dense"])
                          for s in (CNN_SYSTEM, CNN_PAIRS4)), "trained end to end"),
    _auto("at the unlimited link {0:.2f}x (ResNet-20)", "cnn_unlimited"),
    Quote("README.md", "{0:.2f}x (KJV Transformer; by seed {1:.2f}-{2:.2f}, the same form and "
          "steps as dense)", AUTO + "kjv_unlimited.json", _auto_by_seed, "trained end to end"),
    _auto("{0:.2f}x (held-out Python docs)", "pydocs_unlimited"),
    _auto("{0:.2f}x (held-out MNIST: 8 s runs", "mnist_unlimited"),
    Quote("README.md", "8 s runs, its first measurement {0:.0f}% of them",
          AUTO + "mnist_unlimited.json", _auto_first_share, "trained end to end"),
    _auto("{0:.2f}x (held out, a minute or more: Python docs to a deeper target)",
          "pydocs_long_unlimited"),
    _auto("{0:.2f}x (held out, a minute or more: ResNet-20 on MNIST)", "mnist_resnet_unlimited"),
    _auto("at the slow links {0:.2f}x (ResNet-20, 10 Mbit/s)", "cnn_10mbit"),
    _auto("{0:.2f}x (KJV Transformer, 50 Mbit/s)", "kjv_50mbit"),
    _auto("{0:.2f}x (Python docs, 50 Mbit/s)", "pydocs_50mbit"),
    _auto("{0:.2f}x (Python docs to the deeper target, 50 Mbit/s, 5 seeds)", "pydocs_long_50mbit"),
    _auto("{0:.2f}x (ResNet-20 on MNIST, 10 Mbit/s)", "mnist_resnet_10mbit"),
    _auto("{0:.2f}x (MNIST, 500 Mbit/s).", "mnist_500mbit"),
    Quote("README.md", "Measuring takes {0:.1f}-{1:.1f}% of a run of {2:.0f} s or more",
          "studies/auto/results/",
          lambda j: (*_auto_measuring(LONG_RUN_S, False)(j), LONG_RUN_S), "trained end to end"),
    Quote(HEADLINE, "the runs of {2:.0f} s or more auto ran dense at the unlimited links and "
          "sparse at the slow ones from step 0. Its measurements, the probes' compilation "
          "included, took {0:.1f}-{1:.1f}% of those runs", "studies/auto/results/",
          lambda j: (*_auto_measuring(LONG_RUN_S, False)(j), LONG_RUN_S,
                     *_one_form(LONG_RUN_S)(j)), "trained end to end"),
    Quote(HEADLINE, "PyTorch DDP, trained beside auto in the same runs, took {0:.2f}-{1:.2f}x "
          "auto's time at the slow links and {2:.2f}-{3:.2f}x at the unlimited link",
          "studies/auto/results/", _ddp_over_auto, "trained end to end"),
    Quote(HEADLINE, "the first measurement alone is {0:.0f}-{1:.0f}%", "studies/auto/results/",
          _auto_measuring(LONG_RUN_S, True), "trained end to end"),
    Quote(HEADLINE, "{0:.2f}x HiTopKComm's at 50 Mbit/s (5 seeds, by seed {1:.2f}-{2:.2f})",
          AUTO + "pydocs_long_50mbit.json", _auto_by_seed, "trained end to end"),
    Quote(HEADLINE, "unlimited link {0:.2f}x the faster of dense and HiTopKComm on the ResNet-20 "
          "task (by seed {1:.2f}-{2:.2f}", AUTO + "cnn_unlimited.json", _auto_by_seed,
          "trained end to end"),
    Quote(HEADLINE, "{0:.2f}x on the KJV Transformer (by seed {1:.2f}-{2:.2f},",
          AUTO + "kjv_unlimited.json", _auto_by_seed, "trained end to end"),
    Quote(HEADLINE, "{0:.2f}x ({1:.2f}-{2:.2f}) on held-out Python docs",
          AUTO + "pydocs_unlimited.json", _auto_by_seed, "trained end to end"),
    Quote(HEADLINE, "and {0:.2f}x on held-out MNIST;", AUTO + "mnist_unlimited.json",
          _auto_over_best, "trained end to end"),
    Quote(HEADLINE, "{0:.2f}x HiTopKComm's on the ResNet-20 at 10 Mbit/s (by seed {1:.2f}-{2:.2f},",
          AUTO + "cnn_10mbit.json", _auto_by_seed, "trained end to end"),
    Quote(HEADLINE, "{0:.2f}x on Python docs at 50 Mbit/s", AUTO + "pydocs_50mbit.json",
          _auto_over_best, "trained end to end"),
    Quote(HEADLINE, "and {0:.2f}x on MNIST at 500 Mbit/s.", AUTO + "mnist_500mbit.json",
          _auto_over_best, "trained end to end"),
    Quote(HEADLINE, "{0:.2f}x dense on the Python docs to a deeper target",
          AUTO + "pydocs_long_unlimited.json", _auto_over_best, "trained end to end"),
    Quote(HEADLINE, "{0:.2f}x on the KJV Transformer at 50 Mbit/s (by seed {1:.2f}-{2:.2f}",
          AUTO + "kjv_50mbit.json", _auto_by_seed, "trained end to end"),
    Quote(HEADLINE, "and {0:.2f}x HiTopKComm's at 10 Mbit/s (by seed {1:.2f}-{2:.2f})",
          AUTO + "mnist_resnet_10mbit.json", _auto_by_seed, "trained end to end"),
    Quote(HEADLINE, "{0:.2f}x on ResNet-20 on real MNIST at the unlimited link",
          AUTO + "mnist_resnet_unlimited.json", _auto_over_best, "trained end to end"),
    Quote(HEADLINE, "its dense-form steps {0:.2f}-{1:.2f}x plain dense's, its clock at the same "
          "step over dense's", AUTO + "mnist_resnet_unlimited.json", _at_step_over("dense"),
          "trained end to end"),
    Quote("README.md", "at 16 nodes: {0:.2f}-{1:.2f}x faster",
          "benchmarks/results/bench_scale_16.json", _gtopk_over_allgather(),
          "benchmark"),
    Quote("README.md", "the public transform, selection included, {0:.2f}-{1:.2f}x",
          "benchmarks/results/bench_scale_16.json",
          _gtopk_over_allgather("transform"), "benchmark"),
    Quote(HEADLINE, "(`full`) is {0:.2f}-{1:.2f}x faster and the public transform "
          "`topk_allreduce` in one program (selection included) {2:.2f}-{3:.2f}x",
          "benchmarks/results/bench_scale_16.json",
          lambda j: (*_gtopk_over_allgather("full")(j), *_gtopk_over_allgather("transform")(j)),
          "benchmark"),
    Quote("README.md", "gTop-k without warm-up {0:.2f}x sooner than the fastest all-gather at "
          "5 Mbit/s", WS + "at_nodes_fmnist_emulated.json", _at_link("5mbit"), "modelled"),
    Quote("README.md", "{0:.2f}x at 100 Mbit/s", WS + "at_nodes_fmnist_emulated.json",
          _at_link("100mbit"), "modelled"),
    Quote("README.md", "gTop-k needs {0:.1f}x all-gather's steps at 16 workers (5 seeds; "
          "{1:.2f}x by the seeds' mean curves) and ends {2:.1f} point lower",
          WS + "worker_scaling_fmnist_p16_5seeds.json",
          lambda j: (j["rows"][1]["steps_over_allgather"],
                     j["rows"][1]["curve_steps_over_allgather"],
                     -100 * j["rows"][1]["final_minus_allgather"]), "steps only"),
    Quote("README.md", "on the LM {0:.2f}x the steps, {1:.1f}% higher loss",
          WS + "worker_scaling_kjv.json",
          lambda j: (j["rows"][8]["steps_over_allgather"],
                     100 * j["rows"][8]["final_minus_allgather"]
                     / statistics.median(j["rows"][7]["final"])), "steps only"),
    Quote("README.md", "end to end on 8 emulated nodes within {0:.0f}%",
          TTA + "time_to_accuracy_fmnist_8nodes.json", _measured_over_predicted,
          "trained end to end"),
    # docs/headline-results.md: the MLP on Fashion-MNIST
    Quote(HEADLINE, "reaches the target {0:.2f}-{1:.1f}x sooner than dense and {2:.2f}-{3:.1f}x "
          "sooner than DDP at 2 Gbit/s to 200 Mbit/s", TTA + "time_to_target_mlp.json",
          lambda j: (*_trained_over("dense", "hitopk-0.001-mc")(j),
                     *_trained_over("torch-ddp", "hitopk-0.001-mc")(j)), "trained end to end"),
    *(Quote(HEADLINE, f"| {label} | {{0:.1f}} | {{1:.1f}} | {{2:.1f}} | {{3:.1f}} | {{4:.1f}} |",
            TTA + "time_to_target_mlp.json", _run_medians(system, ("unlimited",) + MLP_SLOW),
            "trained end to end")
      for label, system in (("sparsejax dense", "dense"),
                            ("HiTopKComm 0.001 mc", "hitopk-0.001-mc"),
                            ("PyTorch DDP", "torch-ddp"))),
    Quote(HEADLINE, "Its time at 200 Mbit/s is {0:.2f}-{1:.2f}x its time at the unlimited link",
          TTA + "time_to_target_mlp.json",
          lambda j: _min_max(_limit("hitopk-0.001-mc", "200mbit")(j)), "trained end to end"),
    *(Quote(HEADLINE, f"| {label} ({{0:{r}}}): steps x measured step time | {{1:.1f}} | "
            "{2:.1f} | {3:.1f} | {4:.1f} | {5:.1f} |", TTA + "time_to_accuracy.json",
            _median_times(link, MLP), "modelled")
      for label, link, r in (("unlimited", "unlimited", ".1f"), ("2 Gbit/s", "2gbit", ".1f"),
                             ("1 Gbit/s", "1gbit", ".1f"), ("500 Mbit/s", "500mbit", ".1f"),
                             ("200 Mbit/s", "200mbit", ".0f"))),
    Quote(HEADLINE, "| **1 Gbit/s ({0:.1f}): trained end to end, measured** | {1:.1f} | "
          "{2:.1f} | {3:.1f} | {4:.1f} | {5:.1f} |", TTA + "time_to_accuracy.json",
          lambda j: (j["exchange_over_compute"]["1gbit"], *_trained_times(MLP)(j)),
          "trained end to end"),
    Quote(HEADLINE, "(checked at 1 Gbit/s: measured over computed {0:.2f}-{1:.2f})",
          TTA + "time_to_accuracy.json",
          lambda j: (min(v for s in j["analysis"].values()
                         for v in s["measured_over_predicted_at_headline"]),
                     max(v for s in j["analysis"].values()
                         for v in s["measured_over_predicted_at_headline"])),
          "trained end to end"),
    Quote(HEADLINE, "reaches the target {0:.2f}-{1:.1f}x sooner than sparsejax dense (every "
          "seed) and {2:.2f}-{3:.1f}x sooner than PyTorch DDP", TTA + "time_to_accuracy.json",
          lambda j: (*_speedups("dense", "hitopk-0.001-mc", MLP_SLOW)(j),
                     *_speedups("torch-ddp", "hitopk-0.001-mc", MLP_SLOW)(j)), "modelled"),
    Quote(HEADLINE, "at 0.01 it ends at dense's accuracy ({0:.4f} vs {1:.4f}), at 0.001 half a "
          "point below ({2:.4f})", TTA + "time_to_accuracy.json",
          lambda j: tuple(statistics.median(j["analysis"][s]["final_accuracy"])
                          for s in ("hitopk-0.01-mc", "dense", "hitopk-0.001-mc")),
          "trained end to end"),
    Quote(HEADLINE, "the sparse runs are {0:.2f}-{1:.2f}x (0.001) and {2:.2f}-{3:.2f}x (0.01) "
          "dense's speed", TTA + "time_to_accuracy.json",
          lambda j: (*_speedups("dense", "hitopk-0.001-mc", ("unlimited",))(j),
                     *_speedups("dense", "hitopk-0.01-mc", ("unlimited",))(j)), "modelled"),
    Quote(HEADLINE, "is the fastest at an unlimited link ({0:.1f} s)",
          TTA + "time_to_accuracy.json", lambda j: (statistics.median(
              j["analysis"]["torch-ddp"]["predicted_time_to_target_s"]["unlimited"]),),
          "modelled"),
    Quote(HEADLINE, "needs {0:.0f}% more steps", TTA + "time_to_accuracy.json",
          lambda j: (100 * (statistics.median(x["steps_to_target"] for x in j["analysis"][
              "hitopk-0.01"]["seeds"]) / statistics.median(
                  x["steps_to_target"] for x in j["analysis"]["dense"]["seeds"]) - 1),),
          "trained end to end"),
    Quote(HEADLINE, "(JAX / PyTorch {0:.2f}-{2:.2f}x)", TTA + "time_to_accuracy.json", _parity,
          "benchmark"),
    # ... the Transformer LM
    Quote(HEADLINE, "compute parity JAX / PyTorch {0:.2f} / {1:.2f} / {2:.2f}",
          TTA + "time_to_accuracy_lm_pinned.json", _parity, "benchmark"),
    Quote(HEADLINE, "(4.2842 / 4.2848 / 4.2991 against 4.3046 / 4.3094 / 4.3095"
          .replace("4.2842 / 4.2848 / 4.2991", "{0:.4f} / {1:.4f} / {2:.4f}")
          .replace("4.3046 / 4.3094 / 4.3095", "{3:.4f} / {4:.4f} / {5:.4f}"),
          TTA + "time_to_accuracy_lm_1bit.json", _finals("hitopk-0.1-1bit", "dense"),
          "trained end to end"),
    Quote(HEADLINE, "100 and 50 Mbit/s, {0:.2f}x and {1:.2f}x sooner than dense", LM,
          _trained_medians("dense", "hitopk-0.1-1bit", LM_LINKS), "trained end to end"),
    Quote(HEADLINE, "Mbit/s, where dense's step is {0:.1f}x and {1:.1f}x its unlimited one, "
          "HiTopKComm at density 0.05 reaches the target {2:.2f}x and {3:.2f}x sooner than "
          "sparsejax dense and {4:.2f}x and {5:.2f}x sooner than PyTorch DDP (medians; by seed "
          "{6:.2f}-{7:.2f}x and {8:.2f}-{9:.2f}x)", LM,
          lambda j: (*_dense_slowdown(*LM_LINKS)(j),
                     *_trained_medians("dense", "hitopk-0.05", LM_LINKS)(j),
                     *_trained_medians("torch-ddp", "hitopk-0.05", LM_LINKS)(j),
                     *_trained_over("dense", "hitopk-0.05")(j),
                     *_trained_over("torch-ddp", "hitopk-0.05")(j)), "trained end to end"),
    Quote(HEADLINE, "In 4-byte pairs with its exchange pipelined (each gradient computed while "
          "the last one is exchanged) it is {0:.2f}x sooner than dense and {1:.2f}x sooner than "
          "PyTorch DDP at 100 Mbit/s, its time there {2:.2f}x its own at the unlimited link",
          LM_LIMIT, lambda j: (*_trained_medians("dense", LM_PIPE4, ("100mbit",))(j),
                               *_trained_medians("torch-ddp", LM_PIPE4, ("100mbit",))(j),
                               statistics.median(_limit(LM_PIPE4, "100mbit")(j))),
          "trained end to end"),
    Quote(HEADLINE, "it is {0:.2f}x sooner than dense and {1:.2f}x sooner than PyTorch DDP at 100 "
          "Mbit/s (medians), its steps after the dense start {2:.2f}-{3:.2f}x their time at the "
          "unlimited link, and every seed ends below dense's loss", LM_HELD_OUT,
          _held_out_pipelined, "trained end to end"),
    Quote(LM_DOC, "the pipelined 4-byte system's steps after the dense start take "
          "{2:.2f}-{3:.2f}x their unlimited time, and it reaches the target {0:.2f}x sooner than "
          "dense and {1:.2f}x sooner than DDP (medians), every seed ending below dense's loss",
          LM_HELD_OUT, _held_out_pipelined, "trained end to end"),
    Quote(HEADLINE, "so its time over the run is {0:.2f}x its unlimited one", LM_HELD_OUT,
          lambda j: (statistics.median(_limit(LM_PIPE4, "100mbit")(j)),),
          "trained end to end"),
    Quote(HEADLINE, "dense with the same frozen variance ends lower still ({0:.3f})",
          TTA + "time_to_accuracy_lm_1bit.json",
          lambda j: (statistics.median(j["analysis"]["dense-fv"]["final"]),),
          "trained end to end"),
    *(Quote(LM_DOC, f"| {label} | {{0:.1f}} | {{1:.1f}} | {{2:.1f}} | - | - | - |",
            LM, _run_medians(system, ("unlimited", *LM_LINKS)), "trained end to end")
      for label, system in (("sparsejax dense", "dense"), ("PyTorch DDP", "torch-ddp"))),
    *(Quote(LM_DOC, f"| {label} | {{0:.1f}} | {{1:.1f}} | {{2:.1f}} | "
            "{3:.2f}x, {4:.2f}x | {5:.2f}x, {6:.2f}x | {7:+.1f}% |", LM,
            lambda j, s=system: (*_run_medians(s, ("unlimited", *LM_LINKS))(j),
                                 *_trained_medians("dense", s, LM_LINKS)(j),
                                 *_trained_medians("torch-ddp", s, LM_LINKS)(j),
                                 statistics.median(j["analysis"][s]["final_vs_dense"])),
            "trained end to end")
      for label, system in (("HiTopKComm 0.05", "hitopk-0.05"),
                            ("HiTopKComm 0.1, 1-bit Adam recipe", "hitopk-0.1-1bit"))),
    Quote(LM_DOC, "the end-to-end times are {0:.2f}x (dense), {1:.2f}x (HiTopKComm 0.05) and "
          "{2:.2f}x (DDP) of their predictions", LM + " + " + LM_SLOW,
          lambda js: tuple(
              statistics.median(limit.times(js[LM], s, "50mbit"))
              / statistics.median(
                  js[LM_SLOW]["analysis"][s]["predicted_time_to_target_s"]["50mbit"])
              for s in ("dense", "hitopk-0.05", "torch-ddp")), "modelled"),
    Quote(LM_DOC, "(HiTopKComm 0.05 {0:.1f} s modelled in `time_to_accuracy_lm_pinned.md`, "
          "{1:.1f} s here)", LM + " + " + TTA + "time_to_accuracy_lm_pinned.json",
          lambda js: (statistics.median(js[TTA + "time_to_accuracy_lm_pinned.json"]["analysis"][
              "hitopk-0.05"]["predicted_time_to_target_s"]["unlimited"]),
                      statistics.median(limit.times(js[LM], "hitopk-0.05", "unlimited"))),
          "modelled"),
    Quote(LM_DOC, "over the steps after it its time is {0:.2f}x its unlimited one at 100 Mbit/s, "
          "{1:.2f}x at 50", LM,
          lambda j: tuple(statistics.median(_limit("hitopk-0.1-1bit", link, "limit_after_dense")(j))
                          for link in LM_LINKS), "trained end to end"),
    Quote(LM_DOC, "trained end to end (below) it is {0:.2f}x and {1:.2f}x sooner than dense at "
          "100 and 50 Mbit/s", LM, _trained_medians("dense", "hitopk-0.05", LM_LINKS),
          "trained end to end"),
    Quote(LM_DOC, "Dense's step to the target is {0:.1f}x its unlimited one at 100 Mbit/s and "
          "{1:.1f}x at 50", LM, _dense_slowdown(*LM_LINKS), "trained end to end"),
    Quote(LM_DOC, "**Its final loss is not dense's**: {1:.2f} against {2:.2f} ({0:+.1f}%", LM,
          _lm_gap, "trained end to end"),
    Quote(TTA_README, "seeds, medians): {0:.2f}x and {1:.2f}x sooner "
          "than dense and {2:.2f}x and {3:.2f}x sooner than DDP at 100 and 50 Mbit/s; the 1-bit "
          "recipe {4:.2f}x and {5:.2f}x sooner than dense. At an unlimited link DDP leads by its "
          "compute ({6:.1f} s against dense's {7:.1f} s and HiTopKComm's {8:.1f} s)", LM,
          lambda j: (*_trained_medians("dense", "hitopk-0.05", LM_LINKS)(j),
                     *_trained_medians("torch-ddp", "hitopk-0.05", LM_LINKS)(j),
                     *_trained_medians("dense", "hitopk-0.1-1bit", LM_LINKS)(j),
                     *(_run_medians(s, ("unlimited",))(j)[0]
                       for s in ("torch-ddp", "dense", "hitopk-0.05"))), "trained end to end"),
    # ... overlap
    Quote(HEADLINE, "(final loss {0:.4f} / {1:.4f} / {2:.4f} against {3:.4f} / {4:.4f} / "
          "{5:.4f}, min / median / max of 3 seeds",
          TTA + "time_to_accuracy_lm_pipe_local_pinned.json", _finals("dense-pipe-l", "dense"),
          "trained end to end"),
    Quote(HEADLINE, "({0:.1f} / {1:.1f} / {2:.1f} s against {3:.1f} / {4:.1f} / {5:.1f} s",
          TTA + "time_to_accuracy_lm_pipe_local_e2e_200mbit_pinned.json",
          _seed_times("dense-pipe-l", "dense"), "trained end to end"),
    Quote(HEADLINE, "its step is {0:.2f}x shorter at 50 Mbit/s",
          TTA + "time_to_accuracy_lm_pipe_local_pinned.json",
          _speedup_median("dense", "dense-pipe-l", "50mbit"), "modelled"),
    # ... the CNN task's best sparse system
    Quote(HEADLINE, "{0:.2f}-{1:.2f}x sooner than sparsejax dense and {2:.2f}-{3:.2f}x sooner than "
          "PyTorch DDP with 8-byte pairs, {4:.2f}-{5:.2f}x and {6:.2f}-{7:.2f}x with 4-byte pairs "
          "(every seed); its time at 10 Mbit/s over its own at the unlimited link (the limit "
          "ratio) {8:.2f} / {9:.2f} / {10:.2f} and {11:.2f} / {12:.2f} / {13:.2f}", CNN,
          lambda j: (*_trained_over("dense", CNN_SYSTEM)(j),
                     *_trained_over("torch-ddp", CNN_SYSTEM)(j),
                     *_trained_over("dense", CNN_PAIRS4)(j),
                     *_trained_over("torch-ddp", CNN_PAIRS4)(j),
                     *_link_values("limit", "10mbit", CNN_SYSTEM, CNN_PAIRS4)(j)),
          "trained end to end"),
    Quote(HEADLINE, "dense reaches 0.84 in {0} / {1} / {2} steps (min / median / max of the seeds, "
          "as every triple in this paragraph; final {3:.4f}, median)",
          TTA + "time_to_accuracy_cnn.json", lambda j: (*sorted(_steps("dense")(j)),
                             statistics.median(j["analysis"]["dense"]["final"])), "steps only"),
    Quote(HEADLINE, "HiTopKComm 0.01 reaches it on every seed ({0} / {1} / {2} steps), at 10 "
          "Mbit/s (R {3:.1f}) {4:.2f} / {5:.2f} / {6:.2f}x sooner than dense and {7:.2f} / "
          "{8:.2f} / {9:.2f}x sooner than PyTorch DDP, at 50 Mbit/s (R {10:.2f}) {11:.2f}x "
          "dense and level with DDP ({12:.2f}x)", TTA + "time_to_accuracy_cnn.json",
          lambda j: (*sorted(_steps("hitopk-0.01-mc")(j)), j["exchange_over_compute"]["10mbit"],
                     *_speedups_sorted("dense", "hitopk-0.01-mc", "10mbit")(j),
                     *_speedups_sorted("torch-ddp", "hitopk-0.01-mc", "10mbit")(j),
                     j["exchange_over_compute"]["50mbit"],
                     *_speedup_median("dense", "hitopk-0.01-mc", "50mbit")(j),
                     *_speedup_median("torch-ddp", "hitopk-0.01-mc", "50mbit")(j)), "modelled"),
    Quote(HEADLINE, "trained end to end at 10 Mbit/s in {0:.1f} / {1:.1f} / {2:.1f} s "
          "({3:.2f}-{4:.2f}x the product of steps and swept step times",
          TTA + "time_to_accuracy_cnn_10mbit.json",
          lambda j: (*_seed_times("hitopk-0.01-mc")(j), *_min_max(
              j["analysis"]["hitopk-0.01-mc"]["measured_over_predicted_at_headline"])),
          "trained end to end"),
    Quote(HEADLINE, "it ends {0:.1f} points below dense ({1:.3f})",
          TTA + "time_to_accuracy_cnn.json",
          lambda j: (100 * (statistics.median(j["analysis"]["dense"]["final"])
                            - statistics.median(j["analysis"]["hitopk-0.01-mc"]["final"])),
                     statistics.median(j["analysis"]["hitopk-0.01-mc"]["final"])),
          "trained end to end"),
    Quote(HEADLINE, "and reaches 0.84 in {0} / {1} / {2} steps; at 10 Mbit/s (dense exchange "
          "{3:.2f}x the compute at 20 px; min / median / max of the seeds) {4:.2f} / {5:.2f} / "
          "{6:.2f}x sooner than dense and "
          "{7:.2f} / {8:.2f} / {9:.2f}x sooner than DDP; at 50 Mbit/s (R {10:.2f}) {11:.2f} / "
          "{12:.2f} / {13:.2f}x dense, {14:.2f} / {15:.2f} / {16:.2f}x DDP.",
          TTA + "time_to_accuracy_cnn_best.json",
          lambda j: (*_steps(CNN_SYSTEM)(j), *_sweep_exchange("10mbit", 20)(j),
                     *_speedups_sorted("dense", CNN_SYSTEM, "10mbit")(j),
                     *_speedups_sorted("torch-ddp", CNN_SYSTEM, "10mbit")(j),
                     *_sweep_exchange("50mbit", 20)(j),
                     *_speedups_sorted("dense", CNN_SYSTEM, "50mbit")(j),
                     *_speedups_sorted("torch-ddp", CNN_SYSTEM, "50mbit")(j)), "modelled"),
    Quote(HEADLINE, "ends at {0:.4f} / {1:.4f} / {2:.4f} against dense's {3:.4f} / {4:.4f} / "
          "{5:.4f} (seeds 0-2)", TTA + "time_to_accuracy_cnn_best.json",
          lambda j: (*j["analysis"]["hitopk-0.04-mc-mean-w3"]["final"],
                     *j["analysis"]["dense"]["final"]), "trained end to end"),
    Quote(HEADLINE, "Compute parity JAX / PyTorch {0:.2f} / {1:.2f} / {2:.2f}",
          TTA + "time_to_accuracy_cnn_parity.json", _parity, "benchmark"),
    Quote(TTA_README, "limit ratio {0:.2f} / {1:.2f} / {2:.2f} with 8-byte pairs, {3:.2f} / "
          "{4:.2f} / {5:.2f} with 4-byte pairs", MLP_LIMIT,
          _link_values("limit", "500mbit", *MLP_PAIRS), "trained end to end"),
    Quote(TTA_README, "against sparsejax dense at that link {0:.2f} / {1:.2f} / {2:.2f}x and "
          "{3:.2f} / {4:.2f} / {5:.2f}x sooner, against PyTorch DDP {6:.2f} / {7:.2f} / {8:.2f}x "
          "and {9:.2f} / {10:.2f} / {11:.2f}x. Final accuracy against dense's {12:+.2f} / "
          "{13:+.2f} / {14:+.2f} and {15:+.2f} / {16:+.2f} / {17:+.2f} points", MLP_LIMIT,
          lambda j: (*_link_values("dense_over", "500mbit", *MLP_PAIRS)(j),
                     *_link_values("torch-ddp_over", "500mbit", *MLP_PAIRS)(j),
                     *_finals(*MLP_PAIRS, key="final_vs_dense")(j)), "trained end to end"),
    # studies/auto/README.md: the table, a row per result file
    *(Quote(AUTO_README, "| {0} ({1}) | {2} | {3} | {4:.2f} ({5}) | {6}; {7} ({8:.1f}-{9:.1f}%) "
            "| {10}; {11} | {12}", AUTO + stem + ".json", _auto_row, "trained end to end")
      for stem in AUTO_STEMS),
)


def main(argv: list[str] | None = None) -> int:
  import argparse
  argparse.ArgumentParser(prog="python -m studies.figures",
                          description=__doc__.split("\n")[0]).parse_args(argv)
  for q in QUOTES:
    print(f"{q.doc}: {q.expected()!r}\n    from {q.source} ({q.how})")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
