"""Convergence against the worker count: steps to the target and the final metric of dense, TopK
all-gather and gTop-k at 2, 4, 8 and 16 workers.

  python -m studies.worker_scaling.run --config configs/tta_fmnist_mlp.py --workers 2,4,8,16 \\
      --systems dense,allgather-0.01-mc,gtopk-0.01-mc,gtopk-0.01-mc-bytes --seeds 3 \\
      --out studies/worker_scaling/results/worker_scaling_fmnist.json

Workers are CPU devices of one process (one process per worker count, each with P devices), a mesh
of P nodes of one worker each (no network: convergence does not depend on the link, and no time is
measured here). The task's global batch is split over the P workers, so a dense step is the same
step at every P and only the exchange's compression differs with P: TopK all-gather applies up to P
x k values a step, gTop-k exactly k.

Systems, `<algorithm>-<density>[-mc][-<k rule>]`:
  dense                  the uncompressed all-reduce;
  allgather-D, gtopk-D   the sparse exchange at density D (k = D x n per worker);
  -mc                    with DGC's momentum correction (unmasked, as the study's SGD systems);
  -mcm                   with the correction and DGC's momentum masking;
  -bytes                 gTop-k with k raised so that a worker sends what TopK all-gather at
                         density D sends at this P (`comm.wire_bytes`; capped at density 1);
  -sqrtP, -P             gTop-k's global k grown with the worker count: k x sqrt(P/2), k x P/2
                         (equal to D at 2 workers, where all-gather applies 2k values);
  -w<factor>             the task's density warm-up (DGC's) `factor` times as long.
Each worker count's runs go seed by seed, each in its own folder under `--workdir`
(`<task>/P<p>/<system>/seed<s>`); a finished run is read, not repeated. The table: per system and
P, the steps to the target and the final metric (min / median / max over seeds), the step at
which the seeds' mean curve reaches the target (each run's evaluations are kept), and both over
all-gather's at that P. On a task whose curve is flat at the target one seed's steps vary by
more than 10%: compare medians of 3 seeds with that in mind (the study's README).
"""

from __future__ import annotations

import os
import sys

MAX_WORKERS = int(os.environ.get("SPARSEJAX_MAX_WORKERS", "16"))
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={MAX_WORKERS}")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

from sparsejax import comm  # noqa: E402
from sparsejax.bench import (  # noqa: E402
  command_line,
  footer,
  json_path,
  portable_path,
  spread,
  write_results,
)
from sparsejax.train.config import target_reached  # noqa: E402

SYSTEM = re.compile(r"^(dense|allgather|gtopk)(?:-([0-9.]+))?(-mcm|-mc)?(?:-(bytes|sqrtP|logP|P))?"
                    r"(?:-w([0-9.]+))?(-dw)?$")


class System(NamedTuple):
  """A system's name read: `<algorithm>-<density>[-mc|-mcm][-<k rule>][-w<factor>][-dw]`."""

  algorithm: str
  density: float
  mc: bool  # DGC's momentum correction
  rule: str  # gTop-k's k rule: "", "bytes", "sqrtP", "logP" or "P"
  masking: bool = False  # -mcm: the correction with DGC's momentum masking
  warmup: float = 1.0  # -w<factor>: the task's density warm-up this many times as long (0: none)
  dense_warmup: bool = False  # -dw: the warm-up's levels that send more than dense run dense


def parse_system(name: str) -> System:
  """The parts of a system's name; a clear error for a name that does not follow
  `<algorithm>-<density>[-mc|-mcm][-<k rule>][-w<factor>]`."""
  m = SYSTEM.match(name)
  if not m or (m.group(1) == "dense") != (m.group(2) is None) or (
      m.group(4) and m.group(1) != "gtopk"):
    raise ValueError(f"system {name!r}: expected dense or <allgather|gtopk>-<density>"
                     "[-mc|-mcm][-w<factor>][-dw], gtopk with an optional -bytes, -sqrtP, -logP "
                     "or -P before -w")
  density = float(m.group(2) or 1.0)
  if not 0 < density <= 1:
    raise ValueError(f"system {name!r}: density {density} is not in (0, 1]")
  warmup = float(m.group(5) or 1.0)
  if not warmup >= 0:
    raise ValueError(f"system {name!r}: warm-up factor {warmup} is not >= 0")
  return System(m.group(1), density, bool(m.group(3)), m.group(4) or "",
                m.group(3) == "-mcm", warmup, bool(m.group(6)))


def density_at(name: str, workers: int, n: int) -> float:
  """The density system `name` runs at with `workers` workers and an n-value gradient."""
  algorithm, density, _, rule, *_ = parse_system(name)
  if rule == "bytes":  # gTop-k's k that sends what all-gather's k sends
    k = max(1, round(density * n))
    want = comm.wire_bytes("allgather", n=n, k=k, nodes=workers, local=1)["inter"]
    per_k = comm.wire_bytes("gtopk", n=n, k=k, nodes=workers, local=1)["inter"] / k
    return min(1.0, want / per_k / n)
  if rule == "sqrtP":
    return min(1.0, density * math.sqrt(workers / 2))
  if rule == "logP":
    return min(1.0, density * max(1.0, math.log2(workers) / 2))
  if rule == "P":
    return min(1.0, density * workers / 2)
  return density


def run_config(config_path: str, sets: list[str], name: str, workers: int, seed: int, n: int,
               steps_per_epoch: int = 0):
  """The task's config for one run: `workers` nodes of one worker, the system's exchange
  (`steps_per_epoch`: the task's, needed by `-dw`)."""
  from sparsejax.train import config as config_lib
  system = parse_system(name)
  overrides = [*sets, f"mesh.nodes={workers}", "mesh.local=1", f"mesh.num_devices={workers}",
               f"compression.algorithm={system.algorithm}", f"seed={seed}",
               "checkpoint_every_steps=0"]
  if system.algorithm != "dense":
    overrides.append(f"compression.density={density_at(name, workers, n):.6g}")
    if system.mc:
      overrides += ["compression.momentum_correction=True",
                    f"experimental.momentum_masking={system.masking}"]
  tree = config_lib.apply_overrides(config_lib.load_config(config_path), overrides)
  if system.warmup != 1.0:
    tree["compression"]["warmup_epochs"] *= system.warmup
  config = config_lib.validate(tree)
  if system.dense_warmup:
    if steps_per_epoch < 1:
      raise ValueError(f"system {name!r}: -dw needs the task's steps per epoch, got "
                       f"{steps_per_epoch}")
    steps = dense_warmup_steps(system.algorithm, config, workers, n, steps_per_epoch)
    tree["compression"]["dense_epochs"] = steps / steps_per_epoch
    config = config_lib.validate(tree)
  return config


def dense_warmup_steps(algorithm: str, config, workers: int, n: int, steps_per_epoch: int) -> int:
  """The first steps of the DGC warm-up during which its density level (the run plan's:
  `sparsejax.train.plan`) would make a worker send as much as a dense all-reduce at `workers`
  workers or more (`comm.wire_bytes`): those steps go dense."""
  from sparsejax.train import make_plan
  plan = make_plan(config, steps_per_epoch)
  if not plan.warmup_steps_density:
    return 0
  dense = comm.wire_bytes("dense", n=n, nodes=workers, local=1)["inter"]
  for first, level in plan.level_steps:
    density = plan.levels[level]
    if density < 1.0 and comm.wire_bytes(algorithm, n=n, k=max(1, round(density * n)),
                                         nodes=workers, local=1)["inter"] < dense:
      return first
  return plan.warmup_steps_density  # (a density that sends more than dense: only the warm-up)


def _finished(workdir: str) -> dict[str, Any] | None:
  path = os.path.join(workdir, "summary.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    summary = json.load(f)
  return None if summary.get("interrupted") or not summary.get("final_eval") else summary


def run_one(args, task: str, name: str, workers: int, seed: int, n: int,
            steps_per_epoch: int) -> dict[str, Any] | None:
  """Trains one run, or reads it where it finished; its record (None: not finished and
  `--finished-only`)."""
  from sparsejax.train.loop import train_and_evaluate
  workdir = os.path.join(args.workdir, task, f"P{workers}", name, f"seed{seed}")
  config = run_config(args.config, args.sets, name, workers, seed, n, steps_per_epoch)
  summary = _finished(workdir)
  if summary is None and args.finished_only:
    return None
  if summary is None:
    t0 = time.time()
    summary = train_and_evaluate(config, workdir, progress=False)
    print(f"  {task} P={workers} {name} seed {seed}: steps to target "
          f"{(summary['time_to_target'] or {}).get('step')}, final "
          f"{summary['final_eval'][config.target_metric]:.4f} in {time.time() - t0:.0f} s",
          flush=True)
  reached = summary.get("time_to_target")
  return {"task": task, "workers": workers, "system": name, "seed": seed,
          "curve": eval_curve(workdir, config.target_metric),
          "density": config.compression.density if config.compression.algorithm != "dense"
          else 1.0,
          "steps_to_target": reached["step"] if reached else None,
          "final": summary["final_eval"][config.target_metric], "steps": summary["steps"],
          "bytes_sent_per_step": summary["bytes_sent"] / max(summary["steps"], 1)}


def eval_curve(workdir: str, metric: str) -> list[list[float]]:
  """[[step, metric], ...] of every evaluation of a finished run (its eval.csv)."""
  with open(os.path.join(workdir, "eval.csv")) as f:
    return [[int(r["step"]), float(r[metric])] for r in csv.DictReader(f)]


def mean_curve_step(curves: list[list[list[float]]], metric: str, target: float) -> int | None:
  """The first evaluation step at which the seeds' mean metric reaches `target` (steps every
  seed evaluated at; None if it never does). Less noisy than each seed's own first step at the
  target where the curve is flat there: a seed's metric a step varies by more than the curve
  rises between evaluations."""
  common = sorted(set.intersection(*({int(s) for s, _ in c} for c in curves)))
  at = [dict((int(s), v) for s, v in c) for c in curves]
  for step in common:
    if target_reached(metric, statistics.fmean(a[step] for a in at), target):
      return step
  return None


def _median(values: list[float]) -> float | None:
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def analyse(runs: list[dict[str, Any]], systems: list[str], workers: list[int],
            metric: str = "accuracy", target: float | None = None) -> list[dict[str, Any]]:
  """One row per (system, P): steps to target and final metric over the seeds, the step at
  which the seeds' mean curve reaches the target (where every run has its curve and `target`
  is given), and the median steps and the mean-curve step over all-gather's (at the same
  density, where it ran) at that P."""
  def curve_step(group):
    if target is None or not group or any("curve" not in r for r in group):
      return None
    return mean_curve_step([r["curve"] for r in group], metric, target)

  rows = []
  for p in workers:
    for name in systems:
      group = [r for r in runs if r["workers"] == p and r["system"] == name]
      if not group:
        continue
      steps = [r["steps_to_target"] for r in group]
      row = {"system": name, "workers": p, "seeds": len(group),
             "density": group[0]["density"], "steps_to_target": steps,
             "reached": sum(s is not None for s in steps),
             "final": [r["final"] for r in group],
             "bytes_per_step": statistics.fmean(r["bytes_sent_per_step"] for r in group),
             "mean_curve_step": curve_step(group)}
      algorithm, density, mc, *_ = parse_system(name)
      ref = f"allgather-{density:g}{'-mc' if mc else ''}"
      base = [r for r in runs if r["workers"] == p and r["system"] == ref]
      if algorithm == "gtopk" and base and row["reached"] == len(group):
        row["steps_over_allgather"] = _median(steps) / _median(
            [r["steps_to_target"] for r in base])
        row["final_minus_allgather"] = _median(row["final"]) - _median(
            [r["final"] for r in base])
        mine, theirs = row["mean_curve_step"], curve_step(base)
        if mine and theirs:
          row["curve_steps_over_allgather"] = mine / theirs
      rows.append(row)
  return rows


def table(results: dict[str, Any]) -> str:
  meta = results["meta"]
  lines = [
      f"Convergence against the worker count on `{meta['config']}` (target {meta['metric']} "
      f"{meta['target']}; {meta['seeds']} seeds, min / median / max; workers as CPU devices "
      "of one process, P nodes of one worker, the global batch split over them; no network, "
      "steps only). Steps: to the first evaluation at the target (never: a seed that did not "
      "reach it). Over all-gather: gTop-k's median steps over TopK all-gather's at the same "
      "density and P, and its final metric's median minus all-gather's. Mean curve: the "
      "first evaluation at which the seeds' mean metric reaches the target (its ratio to "
      "all-gather's in brackets; '-' where runs kept no curve).", "",
      "| system | P | density | steps to target | reached | mean curve | final | "
      "MB sent / step | steps / all-gather | final - all-gather |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in results["rows"]:
    ratio = r.get("steps_over_allgather")
    diff = r.get("final_minus_allgather")
    curve = r.get("mean_curve_step")
    curve_ratio = r.get("curve_steps_over_allgather")
    curve_cell = ("-" if curve is None else f"{curve}" + (
        f" ({curve_ratio:.2f}x)" if curve_ratio else ""))
    lines.append(
        f"| {r['system']} | {r['workers']} | {r['density']:.4g} | "
        f"{spread(r['steps_to_target'], 0)} | {r['reached']}/{r['seeds']} | {curve_cell} | "
        f"{spread(r['final'], 4)} | {r['bytes_per_step'] / 1e6:.2f} | "
        f"{'-' if ratio is None else f'{ratio:.2f}'} | "
        f"{'-' if diff is None else f'{diff:+.4f}'} |")
  note = f"{meta['note']}\n\n" if meta.get("note") else ""
  return "\n".join(lines) + "\n\n" + note + footer(meta)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", help="the task's config (required unless --from-results)")
  ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
  ap.add_argument("--workers", default="2,4,8,16")
  ap.add_argument("--systems", default="dense,allgather-0.01-mc,gtopk-0.01-mc")
  ap.add_argument("--seeds", type=int, default=3)
  ap.add_argument("--workdir", default=os.path.join("runs", "worker_scaling"))
  ap.add_argument("--out", type=json_path, required=True)
  ap.add_argument("--from-results", metavar="JSON", help="no runs: the table again")
  ap.add_argument("--finished-only", action="store_true",
                  help="train nothing: the runs already finished under --workdir (a row then "
                       "says how many seeds it has)")
  args = ap.parse_args(argv)
  if not args.config and not args.from_results:
    ap.error("--config is required (or --from-results)")
  if args.from_results:
    with open(args.from_results) as f:
      results = json.load(f)
  else:
    results = collect(ap, args, list(sys.argv[1:] if argv is None else argv))
  meta = results["meta"]
  results["rows"] = analyse(results["runs"], meta["systems"], meta["workers"], meta["metric"],
                            meta["target"])
  text = table(results)
  print(text)
  write_results(args.out, results, text)
  return 0


def collect(ap, args, argv: list[str]) -> dict[str, Any]:
  """Every run (system x P x seed, seed by seed), with the study's metadata."""
  systems = [s for s in args.systems.split(",") if s]
  try:
    workers = [int(p) for p in args.workers.split(",") if p]
    for name in systems:
      parse_system(name)
  except ValueError as e:
    ap.error(str(e))
  if any(p < 2 for p in workers) or args.seeds < 1:
    ap.error(f"--workers must be >= 2, got {workers}; --seeds >= 1, got {args.seeds}")
  from sparsejax import data as data_lib
  from studies.time_to_accuracy.systems import load_task, model_size
  task_config = load_task(args.config, args.sets)
  inputs = data_lib.open_inputs(task_config)
  n, steps_per_epoch = model_size(task_config, inputs), inputs.steps_per_epoch
  task = os.path.splitext(os.path.basename(args.config))[0]
  results = {"meta": {
      "command": command_line(__file__, argv), "config": portable_path(args.config),
      "sets": args.sets, "systems": systems,
      "workers": workers, "seeds": args.seeds, "parameters": n,
      "metric": task_config.target_metric, "target": task_config.target_value,
      "machine": platform.machine(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")},
      "runs": []}
  for p in workers:
    if workers == [MAX_WORKERS]:  # this process has the devices: the runs here, seed by seed
      runs = [run_one(args, task, name, p, seed, n, steps_per_epoch)
              for seed in range(args.seeds) for name in systems]
      results["runs"] += [r for r in runs if r is not None]
    else:  # a process of its own with P CPU devices (a mesh takes every device there is)
      results["runs"] += runs_in_child(args, p)
  return results


def runs_in_child(args, workers: int) -> list[dict[str, Any]]:
  """The runs at `workers` workers, by this script in a process with that many CPU devices."""
  from studies.worker_scaling.child import in_child
  return in_child(__file__, ["--config", args.config, *(f"--set={s}" for s in args.sets),
                             "--workers", str(workers), "--systems", args.systems, "--seeds",
                             str(args.seeds), "--workdir", args.workdir,
                             *(["--finished-only"] if args.finished_only else [])],
                  workers, "runs")


if __name__ == "__main__":
  sys.exit(main())
