"""The sparse form's steps factor as measured: where `auto`'s prior comes from.

  python -m studies.time_to_accuracy.factors      # the table, and the pooled factors

F, a sparse system's steps to the target over sparsejax dense's, per seed, paired within one
result file (the same commit, machine and day): for every sparse system of the files in `POOL`
(the study's own three tasks: the Fashion-MNIST MLP, the ResNet-20 and the KJV Transformer)
that reached the target on every seed. A system that misses the target on some seed is left out
whole: auto chooses between dense and a sparse form the user picked because it converges, and
cannot rescue one that does not. `sparsejax.train.auto.model.STEP_FACTORS` is `pooled()`,
sorted; tests/test_committed_results.py holds the two equal, so a rerun that moves a factor
moves auto's prior or fails. The held-out tasks (real MNIST, the Python docs Transformer) are not
in the pool: their factors are printed beside the model's F (`HELD_OUT`, and the fixed systems
trained beside auto in `studies/auto/results/auto_v2_*.json`), a check of the prior on tasks it
was not taken from.
"""

from __future__ import annotations

import argparse
import json
import os

from sparsejax import comm
from studies.time_to_accuracy.analysis import steps_to_target, target_metric

HERE = os.path.dirname(os.path.abspath(__file__))
POOL = ("time_to_accuracy.json",             # MLP, Fashion-MNIST
        "time_to_accuracy_fmnist_auto.json",  # MLP, the same task another day
        "time_to_accuracy_fmnist_auto_087.json",  # MLP, a higher target
        "time_to_accuracy_cnn.json",          # ResNet-20, Fashion-MNIST
        "time_to_accuracy_cnn_best.json",     # ResNet-20, the study's best systems
        "time_to_accuracy_lm.json",           # Transformer LM, KJV
        "time_to_accuracy_lm_1bit.json",      # the same, the 1-bit Adam recipe
        "time_to_accuracy_lm_warmup.json")    # the same, a density warm-up
HELD_OUT = ("time_to_accuracy_mnist.json",   # MLP, real MNIST
            "time_to_accuracy_pydocs.json")  # Transformer LM, the Python docs
AUTO_RESULTS = os.path.join(os.path.dirname(HERE), "auto", "results")
DENSE = ("dense", "hierarchical")


def factors(results: dict) -> dict[str, list[float]]:
  """{system: F per seed} for the fixed sparse systems (named by their algorithm) of one result
  file that reached the target on every seed its dense run did (seeds paired by number)."""
  target, metric = results["meta"]["target"], target_metric(results)
  steps: dict[str, dict[int, int | None]] = {}
  for run in results.get("train", []):
    hit = steps_to_target(run["curve"], target, metric)
    steps.setdefault(run["system"], {})[run["seed"]] = hit["step"] if hit else None
  dense = next((steps[s] for s in DENSE if s in steps), None)
  if dense is None:
    return {}
  out = {}
  for system, by_seed in steps.items():
    if system.split("-")[0] not in comm.SPARSE_ALGORITHMS:  # (dense variants, auto, DDP)
      continue
    pairs = [(by_seed[s], dense[s]) for s in sorted(by_seed) if s in dense and dense[s]]
    if pairs and all(a is not None for a, _ in pairs):
      out[system] = [a / d for a, d in pairs]
  return out


def trained_beside(results: dict) -> dict[str, list[float]]:
  """{system: F per seed} from an end-to-end auto result (`studies/auto/end_to_end.py`): the
  fixed sparse systems trained beside auto at each link, over the dense run of the same seed
  and link, where both reached the target."""
  out: dict[str, list[float]] = {}
  for link, systems in results.get("fixed_runs", {}).items():
    dense = {r["seed"]: r["steps"] for r in systems.get("dense", []) if r["steps"]}
    for system, runs in systems.items():
      if system.split("-")[0] not in comm.SPARSE_ALGORITHMS:
        continue
      pairs = [(r["steps"], dense[r["seed"]]) for r in runs if r["seed"] in dense]
      if pairs and all(a for a, _ in pairs):
        out[f"{system} @ {link}"] = [a / d for a, d in pairs]
  return out


def early_progress(results: dict, fraction: float = 0.5) -> list[tuple[str, float, float]]:
  """The screen of the loss's progress per step as a predictor of F: for each fixed sparse
  system and seed of one result file that reached the target with its dense run, (system, F,
  early F): the steps the sparse run took to reach the metric dense's run had at its first
  evaluation at or after `fraction` of dense's steps to target, over that evaluation's step.
  Read from two whole runs, it is the most a trial of both forms inside one run could see."""
  target, metric = results["meta"]["target"], target_metric(results)
  curves: dict[str, dict[int, list]] = {}
  for run in results.get("train", []):
    curves.setdefault(run["system"], {})[run["seed"]] = run["curve"]
  dense = next((curves[s] for s in DENSE if s in curves), None)
  out = []
  for system, by_seed in curves.items():
    if dense is None or system.split("-")[0] not in comm.SPARSE_ALGORITHMS:
      continue
    for seed, curve in sorted(by_seed.items()):
      d = dense.get(seed)
      hit_d = d and steps_to_target(d, target, metric)
      hit_s = steps_to_target(curve, target, metric)
      if not (hit_d and hit_s):
        continue
      point = next(p for p in d if p["step"] >= fraction * hit_d["step"])
      reach = steps_to_target(curve, point[metric], metric)
      if reach:
        out.append((system, hit_s["step"] / hit_d["step"], reach["step"] / point["step"]))
  return out


def pooled(folder: str = os.path.join(HERE, "results")) -> tuple[float, ...]:
  """Every factor of every file in `POOL`, sorted."""
  values = []
  for name in POOL:
    with open(os.path.join(folder, name)) as f:
      values += [v for vs in factors(json.load(f)).values() for v in vs]
  return tuple(sorted(round(v, 4) for v in values))


def _correlation(rows: list[tuple[str, float, float]]) -> float:
  """Pearson's correlation of F and the early F over `rows` (`early_progress`)."""
  import numpy as np
  return float(np.corrcoef([f for _, f, _ in rows], [e for _, _, e in rows])[0, 1])


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m studies.time_to_accuracy.factors",
      description="The sparse form's steps factor per system and seed, from the committed "
                  "results of the study's own tasks, and the pooled factors auto's prior is.")
  parser.add_argument("--results", default=os.path.join(HERE, "results"),
                      help="the folder of the result files in POOL (default: the study's)")
  parser.add_argument("--auto-results", default=AUTO_RESULTS,
                      help="the folder of the end-to-end auto results (auto_v2_*.json)")
  args = parser.parse_args(argv)
  for name in POOL:
    with open(os.path.join(args.results, name)) as f:
      for system, vs in factors(json.load(f)).items():
        print(f"{name:40s} {system:28s} " + " / ".join(f"{v:.2f}" for v in vs))
  print("pooled:", pooled(args.results))
  from sparsejax.train.auto.model import step_factor
  from sparsejax.train.config import default_config
  quantile = default_config().auto.step_factor_quantile
  print(f"\nthe model's F (auto.step_factor_quantile {quantile}): {step_factor(quantile):.2f}; "
        "measured on the held-out tasks, and beside auto in its end-to-end runs:")
  for name in HELD_OUT:
    with open(os.path.join(args.results, name)) as f:
      for system, vs in factors(json.load(f)).items():
        print(f"{name:40s} {system:28s} " + " / ".join(f"{v:.2f}" for v in vs))
  screened = []
  for name in POOL + HELD_OUT:
    with open(os.path.join(args.results, name)) as f:
      screened += early_progress(json.load(f))
  errors = sorted(abs(early - f) for _, f, early in screened)
  flat = sorted(abs(1 - f) for _, f, _ in screened)
  print(f"\nthe loss's progress at half dense's steps as a predictor of F ({len(screened)} "
        f"runs, the pool's and the held-out files): |early F - F| median "
        f"{errors[len(errors) // 2]:.2f}, against |1 - F| median {flat[len(flat) // 2]:.2f} "
        f"(F = 1 assumed); correlation {_correlation(screened):.2f}\n")
  for name in sorted(os.listdir(args.auto_results)):
    if name.startswith("auto_v2_") and name.endswith(".json"):
      with open(os.path.join(args.auto_results, name)) as f:
        for system, vs in trained_beside(json.load(f)).items():
          print(f"{name:40s} {system:28s} " + " / ".join(f"{v:.2f}" for v in vs))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
