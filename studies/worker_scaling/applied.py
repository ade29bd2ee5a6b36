"""What one exchange applies at P workers: the coordinates and the share of the global gradient,
for TopK all-gather and gTop-k, on the task's real per-worker gradients.

  python -m studies.worker_scaling.applied --config configs/tta_fmnist_mlp.py \\
      --workers 2,4,8,16 --density 0.01 --at 0,48,144 \\
      --out studies/worker_scaling/results/applied_fmnist.json

At each step of `--at`, after that many steps of the task's dense recipe at P workers (the
global batch split over them, as in run.py), on the next global batch: each worker's gradient
g_i, the global one g = mean g_i, k = density x n. Without error feedback (one step's selection
from fresh gradients, what each exchange can apply at most):
  allgather   every worker's k largest |g_i|, the sum of the selected values over P: it applies
              the union of the P selections;
  gtopk       the k positions `comm.gtopk_positions` merges from the workers' selections (the
              library's recursive doubling), and g there exactly;
  gtopk-P     the same with k x P / 2.
Reported per P and step: the coordinates applied over k, and the share of the gradient's descent
the update keeps, <u, g> / ||g||^2 (1: the whole gradient). One process per worker count, each
with that many CPU devices (no network, nothing timed).
"""

from __future__ import annotations

import os
import sys

MAX_WORKERS = int(os.environ.get("SPARSEJAX_MAX_WORKERS", "16"))
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={MAX_WORKERS}")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from sparsejax.bench import (  # noqa: E402
  command_line,
  footer,
  json_path,
  portable_path,
  write_results,
)

SYSTEMS = ("allgather", "gtopk", "gtopk-P")


def share(update: np.ndarray, g: np.ndarray) -> float:
  """<update, g> / ||g||^2: the part of the gradient's descent the update makes."""
  return float(np.dot(update.astype(np.float64), g) / np.dot(g.astype(np.float64), g))


def applied(grads: np.ndarray, k: int, positions: dict[str, np.ndarray]) -> dict[str, Any]:
  """The all-gather's union from the workers' gradients (P x n) and gTop-k's `positions` (by
  system), as rows of (system, coordinates applied / k, share)."""
  p, n = grads.shape
  g = grads.mean(0)
  rows = {}
  top = np.argpartition(-np.abs(grads), k - 1, axis=1)[:, :k]
  update = np.zeros(n)
  for i in range(p):
    update[top[i]] += grads[i, top[i]] / p
  rows["allgather"] = {"applied_over_k": len(np.unique(top)) / k, "share": share(update, g)}
  for name, pos in positions.items():
    pos = np.unique(pos[pos < n])
    update = np.zeros(n)
    update[pos] = g[pos]
    rows[name] = {"applied_over_k": len(pos) / k, "share": share(update, g)}
  return rows


def measure(config_path: str, sets: list[str], workers: int, density: float,
            at: list[int]) -> list[dict[str, Any]]:
  """In this process (`workers` CPU devices): the task's dense recipe at `workers` workers,
  measured after each step count of `at`."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  from sparsejax import comm
  from sparsejax.train import Run
  from sparsejax.train import config as config_lib
  from sparsejax.train import step as step_lib
  from sparsejax.train.mesh import WORKERS
  tree = config_lib.apply_overrides(config_lib.load_config(config_path), [
      *sets, f"mesh.nodes={workers}", "mesh.local=1", f"mesh.num_devices={workers}",
      "compression.algorithm=dense", "checkpoint_every_steps=0"])
  run = Run(config_lib.validate(tree))
  setup, mesh = run.setup, run.setup.mesh
  n = setup.layout.padded_size  # (the flat buffer: its gaps between leaves stay 0)
  k = max(1, round(density * setup.layout.size))
  kp = min(setup.layout.size, k * workers // 2)

  def per_worker(params, stats, inputs, labels, step):
    g, _, _ = step_lib.gradient(setup, step, params, stats, inputs, labels)
    out = {}
    for name, kk in (("gtopk", k), ("gtopk-P", kp)):
      _, idx = jax.lax.top_k(jnp.abs(g), kk)
      out[name] = comm.gtopk_positions(g[idx], idx.astype(jnp.int32), n, WORKERS)
    return g[None], out

  spec = P(WORKERS)
  fn = jax.jit(jax.shard_map(
      per_worker, mesh=mesh,
      in_specs=(P(), P(WORKERS), spec, spec, P()),
      out_specs=(spec, {"gtopk": P(), "gtopk-P": P()}), check_vma=False))
  rows, done = [], 0
  for target in sorted(at):
    while done < target:
      run.step(done)
      run.wait()
      done += 1
    inputs, labels = run.batch(done)
    grads, positions = fn(run.state.params, run.state.batch_stats, inputs, labels,
                          jnp.int32(done))
    grads = np.asarray(jax.device_get(grads))
    positions = {name: np.asarray(jax.device_get(v)) for name, v in positions.items()}
    for system, row in applied(grads, k, positions).items():
      rows.append({"workers": workers, "step": done, "system": system, "k": k,
                   "k_used": kp if system == "gtopk-P" else k, **row})
  return rows


def table(results: dict[str, Any]) -> str:
  meta = results["meta"]
  lines = [
      f"What one exchange applies at P workers on `{meta['config']}` (density "
      f"{meta['density']:g}, k = {results['rows'][0]['k']:,} of {meta['parameters']:,}; the "
      "global batch split over P; fresh gradients, no error feedback): the coordinates "
      "applied over k, and the share of the gradient's descent the update keeps, <u, g> / "
      "||g||^2, after each number of dense steps.", "",
      "| P | step | all-gather: applied / k | share | gTop-k: applied / k | share | "
      "gTop-k, k x P/2: applied / k | share |",
      "|---:|---:|---:|---:|---:|---:|---:|---:|"]
  keys = sorted({(r["workers"], r["step"]) for r in results["rows"]})
  for p, step in keys:
    by = {r["system"]: r for r in results["rows"] if r["workers"] == p and r["step"] == step}
    cells = " | ".join(f"{by[s]['applied_over_k']:.2f} | {by[s]['share']:.3f}" for s in SYSTEMS)
    lines.append(f"| {p} | {step} | {cells} |")
  return "\n".join(lines) + "\n\n" + footer(meta)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config")
  ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
  ap.add_argument("--workers", default="2,4,8,16")
  ap.add_argument("--density", type=float, default=0.01)
  ap.add_argument("--at", default="0,48,144", help="dense steps before each measurement")
  ap.add_argument("--out", type=json_path, required=True)
  ap.add_argument("--from-results", metavar="JSON", help="no runs: the table again")
  args = ap.parse_args(argv)
  if args.from_results:
    with open(args.from_results) as f:
      results = json.load(f)
  else:
    if not args.config:
      ap.error("--config is required (or --from-results)")
    try:
      workers = [int(p) for p in args.workers.split(",") if p]
      at = [int(s) for s in args.at.split(",") if s]
    except ValueError as e:
      ap.error(f"--workers and --at take comma-separated integers: {e}")
    if any(p < 2 for p in workers) or any(s < 0 for s in at) or not 0 < args.density < 1:
      ap.error(f"--workers >= 2 (got {workers}), --at >= 0 (got {at}), --density in (0, 1) "
               f"(got {args.density})")
    rows = []
    for p in workers:
      if workers == [MAX_WORKERS]:
        rows += measure(args.config, args.sets, p, args.density, at)
      else:
        rows += _in_child(args, p)
    from studies.time_to_accuracy.systems import load_task, model_size
    results = {"meta": {
        "command": command_line(__file__, list(sys.argv[1:] if argv is None else argv)),
        "config": portable_path(args.config), "sets": args.sets, "density": args.density,
        "workers": workers, "at": at,
        "parameters": model_size(load_task(args.config, args.sets)),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d")}, "rows": rows}
  text = table(results)
  print(text)
  write_results(args.out, results, text)
  return 0


def _in_child(args, workers: int) -> list[dict[str, Any]]:
  """The measurement at `workers` workers, by this script in a process with that many devices."""
  from studies.worker_scaling.child import in_child
  return in_child(__file__, ["--config", args.config, *(f"--set={s}" for s in args.sets),
                             "--workers", str(workers), "--density", str(args.density),
                             "--at", args.at], workers, "rows")


if __name__ == "__main__":
  sys.exit(main())
