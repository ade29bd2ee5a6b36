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
in the pool.
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


def pooled(folder: str = os.path.join(HERE, "results")) -> tuple[float, ...]:
  """Every factor of every file in `POOL`, sorted."""
  values = []
  for name in POOL:
    with open(os.path.join(folder, name)) as f:
      values += [v for vs in factors(json.load(f)).values() for v in vs]
  return tuple(sorted(round(v, 4) for v in values))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m studies.time_to_accuracy.factors",
      description="The sparse form's steps factor per system and seed, from the committed "
                  "results of the study's own tasks, and the pooled factors auto's prior is.")
  parser.add_argument("--results", default=os.path.join(HERE, "results"),
                      help="the folder of the result files in POOL (default: the study's)")
  args = parser.parse_args(argv)
  for name in POOL:
    with open(os.path.join(args.results, name)) as f:
      for system, vs in factors(json.load(f)).items():
        print(f"{name:40s} {system:28s} " + " / ".join(f"{v:.2f}" for v in vs))
  print("pooled:", pooled(args.results))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
