"""Which tensors a global top-k sends: per tensor, the share of its coordinates sent at least once
in each window of steps, and its share of the coordinates sent per step against its share of the
model.

  python -m studies.coverage.run [--config configs/tta_kjv_lm.py] [--set key=value ...]
      [--window 100] [--steps N] [--out studies/coverage/results/coverage.json]

Runs the task's trainer (`sparsejax train`'s step, every density level compiled) in one process
on `mesh.nodes x mesh.local` CPU devices, and after each step reads worker 0's error-feedback
residual: a coordinate was sent by worker 0 at a step when its residual is exactly zero after
it (the exchange zeroes what it sends; a coordinate whose candidate is exactly zero, such as an
MLP's weights from always-blank input pixels, counts as sent too: the Transformer's attention key
biases, whose gradient is zero up to rounding, show as never sent). Needs a sparse algorithm with
error feedback and mesh.local = 1. Writes JSON and a markdown table (the coverage of every
tensor over its windows, min / median / max, and the per-step share), with the command, machine
and date.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

from sparsejax.bench import (
  command_line,
  footer,
  json_path,
  portable_path,
  spread,
  write_results,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def leaf_names(layout, tree_like) -> list[str]:
  """'/'-joined key paths of the layout's leaves, in its order."""
  import jax
  paths = jax.tree_util.tree_flatten_with_path(tree_like)[0]
  return ["/".join(str(getattr(k, "key", k)) for k in path) for path, _ in paths]


def trace(config, steps: int | None, window: int
          ) -> tuple[list[str], list[int], np.ndarray, np.ndarray]:
  """(tensor names, sizes, int[steps, tensors] coordinates worker 0 sent at each step,
  float[windows, tensors] share of each tensor's coordinates sent at least once in each whole
  window of `window` steps) over the first `steps` steps of the recipe (default all)."""
  import jax

  from sparsejax.train import Run
  run = Run(config)
  layout = run.setup.layout
  names = leaf_names(layout, layout.shape_tree())
  total = run.plan.total_steps if steps is None else min(steps, run.plan.total_steps)
  per_step, windows = [], []
  ever = np.zeros(layout.padded_size, bool)
  for step in range(total):
    run.step(step)
    residual = run.state.comm_state.feedback
    if residual is None:
      raise ValueError("coverage needs a sparse compression.algorithm with error_feedback")
    r0 = np.asarray(jax.device_get(residual.residual.addressable_shards[0].data)).reshape(-1)
    if r0.shape[0] != layout.padded_size:
      raise ValueError(f"worker 0 keeps {r0.shape[0]} of {layout.padded_size} coordinates: "
                       "coverage needs mesh.local = 1")
    sent = r0 == 0.0
    ever |= sent
    per_step.append([int(np.count_nonzero(sent[o:o + n]))
                     for o, n in zip(layout.offsets, layout.sizes)])
    if (step + 1) % window == 0:
      windows.append([float(np.mean(ever[o:o + n])) for o, n in zip(layout.offsets,
                                                                     layout.sizes)])
      ever[:] = False
  return names, list(layout.sizes), np.asarray(per_step, np.int64), np.asarray(windows)


def summarize(names: list[str], sizes: list[int], per_step: np.ndarray, windows: np.ndarray,
              first_step: int) -> list[dict]:
  """Per tensor: its share of the model, its mean share of what is sent per step (steps from
  `first_step`, after the density warm-up), and its window coverage."""
  total = float(sum(sizes))
  sent = per_step[first_step:].astype(np.float64)
  per_step_total = np.maximum(sent.sum(axis=1, keepdims=True), 1.0)
  share_sent = (sent / per_step_total).mean(axis=0)
  return [{"tensor": n, "size": s, "model_share": s / total, "sent_share": float(share_sent[i]),
           "sent_per_step": float(sent[:, i].mean()),
           "window_coverage": [float(w) for w in windows[:, i]]}
          for i, (n, s) in enumerate(zip(names, sizes))]


def make_table(results: dict) -> str:
  m = results["meta"]
  lines = [f"Coverage of a global top-k on {m['task']} ({m['system']}, {m['steps']} steps, worker "
           f"0, {m['window']}-step windows; shares per step from step {m['after_step']} on, after "
           "the density warm-up). coverage: the share of the tensor's coordinates sent at least "
           "once in a window (min / median / max over windows); sent / model: its share of the "
           "coordinates sent per step over its share of the model (1 = sent in proportion).", "",
           "| tensor | size | coverage per window | sent per step | sent / model |",
           "|---|---:|---:|---:|---:|"]
  for row in results["tensors"]:
    ratio = row["sent_share"] / row["model_share"]
    lines.append(f"| {row['tensor']} | {row['size']:,} | {spread(row['window_coverage'], 3)} | "
                 f"{row['sent_per_step']:.1f} | {ratio:.2f} |")
  lines += ["", footer(m)]
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tta_kjv_lm.py"))
  ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
  ap.add_argument("--window", type=int, default=100)
  ap.add_argument("--steps", type=int, help="default: the whole recipe")
  ap.add_argument("--out", type=json_path, default=os.path.join(HERE, "results", "coverage.json"))
  args = ap.parse_args(argv)
  argv_list = list(sys.argv[1:] if argv is None else argv)
  if args.window < 1:
    ap.error(f"--window must be >= 1, got {args.window}")
  from studies.time_to_accuracy.systems import load_task
  config = load_task(os.path.abspath(args.config), args.sets)
  if config.mesh.local != 1:
    ap.error(f"coverage reads one worker's whole residual: mesh.local must be 1, got "
             f"{config.mesh.local}")
  import jax
  jax.config.update("jax_num_cpu_devices", config.mesh.nodes * config.mesh.local)
  from sparsejax import data as data_lib
  from sparsejax.train import make_plan
  names, sizes, per_step, windows = trace(config, args.steps, args.window)
  plan = make_plan(config, data_lib.open_inputs(config).steps_per_epoch)
  after = min(plan.warmup_steps_density, per_step.shape[0] - 1)  # the density warm-up's end
  results = {"meta": {
      "task": f"{config.model.name} on {config.data.name}", "config": portable_path(args.config),
      "sets": args.sets, "system": f"{config.compression.algorithm} "
      f"{config.compression.density:g}", "steps": int(per_step.shape[0]), "window": args.window,
      "after_step": after, "machine": platform.machine(), "cpus": os.cpu_count(),
      "date": time.strftime("%Y-%m-%d"),
      "command": command_line("studies/coverage/run.py", argv_list)}}
  results["tensors"] = summarize(names, sizes, per_step, windows, after)
  table = make_table(results)
  print(table)
  write_results(args.out, results, table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
