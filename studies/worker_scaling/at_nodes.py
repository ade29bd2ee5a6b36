"""Time to accuracy at P nodes: each system's steps to the target (this study's runs) times its
step at P nodes (the local work measured here, the network from `sparsejax.cost` as calibrated
on the emulated cluster of up to 16 nodes, studies/node_scaling).

  python -m studies.worker_scaling.at_nodes \\
      --results studies/worker_scaling/results/worker_scaling_fmnist.json --nodes 16 \\
      --bandwidths unlimited,10gbit,1gbit,100mbit --runs 3 \\
      --out studies/worker_scaling/results/at_nodes_fmnist.json

A step at P nodes of one worker each (the task's global batch split over them, as in the runs):
  local    the task's train step on one CPU device pinned to one core at the per-worker batch,
           compression off (forward, backward, the fused update), plus for a sparse system its
           selection with error feedback over the whole gradient at its k and the scatter-add
           of the pairs it applies (TopK all-gather: P x k; gTop-k: 3k: its sums, its own
           values back into the residual, the positions cleared); each timed in `--runs`
           processes (min / median / max of their fewest-of-reps);
  network  `cost.network_time` on the emulated cluster as calibrated in
           `studies/node_scaling/results/node_scaling.json` (latency per message, the swap
           factors, a merge's seconds per pair, the interface's header overhead) at each
           bandwidth, the latency held at its fitted value at every bandwidth (`unlimited`:
           the latency alone).
Time to target: the sum over the median steps to the target of each step's time at the density
it runs at: the DGC warm-up's steps run at its higher density levels (as the trainer rounds them,
`levels_to`), the rest at the system's density; the local work at each level's k is measured.
R: dense's network time over its local step. At each link the rule picks the system with the
least time to the target.
`--from-results JSON` writes the table again.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from sparsejax import cost
from sparsejax.bench import (
  command_line,
  footer,
  json_path,
  portable_path,
  python_module,
  resolve,
  spread,
  write_results,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

CALIBRATION = os.path.join("studies", "node_scaling", "results", "node_scaling.json")
REPS = 20


def parse_bandwidth(text: str) -> float:
  """Bits per second of `unlimited` (inf), `<x>gbit` or `<x>mbit`; a clear error otherwise."""
  t = text.strip().lower()
  if t == "unlimited":
    return math.inf
  for unit, scale in (("gbit", 1e9), ("mbit", 1e6)):
    if t.endswith(unit):
      try:
        value = float(t[:-len(unit)])
      except ValueError:
        break
      if value > 0:
        return value * scale
  raise ValueError(f"bandwidth {text!r}: expected unlimited, <x>gbit or <x>mbit with x > 0")


def cluster(calibration: dict[str, Any], nodes: int, bits_per_s: float,
            alpha_s: float | None = None) -> cost.Cluster:
  """The emulated cluster's model (`node_scaling`'s fit) at `nodes` one-worker nodes and a
  link of `bits_per_s`, its latency per message `alpha_s` where given; the local work is
  measured, not modelled (0 here). A merge costs what it costs on a core of its own (the
  emulation's share of 2 cores taken out)."""
  p = calibration["params"]
  return cost.Cluster(
      nodes=nodes, local=1, inter_Bps=bits_per_s / 8 / calibration["link_overhead"],
      intra_Bps=math.inf, inter_alpha_s=p["alpha_s"] if alpha_s is None else alpha_s,
      intra_alpha_s=0.0, call_s=0.0,
      select_s=lambda n, k: 0.0, pair_s=0.0, pass_s_per_value=0.0,
      merge_s_per_pair=p["merge_s_per_pair"], swap_factor=p["swap_factor"],
      odd_swap_factor=p["odd_swap_factor"], allreduce_pipelined=True)


def applied_pairs(algorithm: str, nodes: int, k: int) -> int:
  """The pairs a worker scatter-adds a step: every node's k (all-gather), 3k (gTop-k)."""
  return nodes * k if algorithm == "allgather" else 3 * k


# ----------------------------------------------------------------------------- measuring


def measure_local(config_path: str, sets: list[str], nodes: int, n: int,
                  sparse: list[tuple[str, int]]) -> dict[str, Any]:
  """In this process (one CPU device, pinned to one core): the dense train step at the
  per-worker batch, and the selection with scatter of each (algorithm, k) in `sparse`; seconds,
  the fewest of REPS after warm-up."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from sparsejax import topk
  from sparsejax.train import Run
  from sparsejax.train import config as config_lib
  base = config_lib.validate(config_lib.apply_overrides(config_lib.load_config(config_path),
                                                        list(sets)))
  batch = max(1, base.batch_size // nodes)
  config = config_lib.validate(config_lib.apply_overrides(base, [
      "mesh.nodes=1", "mesh.local=1", "mesh.num_devices=1", f"batch_size={batch}",
      "compression.algorithm=dense", "checkpoint_every_steps=0"]))
  run = Run(config)

  def fewest(fn) -> float:
    for _ in range(3):
      fn()
    times = []
    for _ in range(REPS):
      t0 = time.perf_counter()
      fn()
      times.append(time.perf_counter() - t0)
    return min(times)

  step = itertools.count()

  def dense_step() -> None:
    run.step(next(step) % run.plan.total_steps)
    run.wait()

  out = {"batch": batch, "dense_s": fewest(dense_step), "sparse_s": {}}
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(n).astype(np.float32))
  r = jnp.asarray(0.1 * rng.standard_normal(n).astype(np.float32))
  for algorithm, k in sparse:
    pairs = applied_pairs(algorithm, nodes, k)

    @jax.jit
    def work(x, r, k=k, pairs=pairs):
      values, indices, kept = topk.select_feedback(base.compression.selector, x, r, k)
      reps = -(-pairs // k)
      total = jnp.zeros_like(x).at[jnp.tile(indices, reps)[:pairs]].add(
          jnp.tile(values, reps)[:pairs])
      return total, kept

    out["sparse_s"][f"{algorithm}:{k}"] = fewest(lambda: jax.block_until_ready(work(x, r)))
  return out


def measure_runs(args, nodes: int, n: int, sparse: list[tuple[str, int]]) -> list[dict]:
  """`measure_local` in `args.runs` processes of their own, one after another."""
  runs = []
  for _ in range(args.runs):
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "local.json")
      cmd = [*python_module(__file__), "--measure-child", out,
             "--config", args.config, "--nodes", str(nodes), "--parameters", str(n),
             "--sparse", ",".join(f"{a}:{k}" for a, k in sparse),
             *(f"--set={s}" for s in args.sets)]
      env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
      subprocess.run(cmd, check=True, env=env)
      with open(out) as f:
        runs.append(json.load(f))
  return runs


# ----------------------------------------------------------------------------- analysis


def analyse(results: dict[str, Any], calibration: dict[str, Any]) -> list[dict[str, Any]]:
  """One row per (link, system): steps, step (local measured + network modelled), time to
  target; and per link which system the rule picks."""
  meta = results["meta"]
  nodes, n = meta["nodes"], meta["parameters"]
  local = results["local"]
  dense_local = statistics.median(r["dense_s"] for r in local)
  rows = []
  for link in meta["bandwidths"]:
    bits = parse_bandwidth(link)
    cl = cluster(calibration, nodes, bits, meta["alpha_s"])
    dense_net = cost.network_time("dense", n, 1.0, cl)
    group = []
    for s in results["systems"]:
      algorithm, density = s["algorithm"], s["density"]
      steps = s["steps_to_target"]
      # [[density, steps at it], ...] up to the target (results before the warm-up was
      # counted: every step at the system's density)
      levels = s.get("levels") or [[density, steps or 0]]
      local_s = net_s = 0.0
      for level, count in levels:
        # level 1: a dense step (dense, or a sparse system's dense form: an all-reduce)
        form = "dense" if level >= 1.0 else algorithm
        k = max(1, round(level * n))
        extra = 0.0 if form == "dense" else statistics.median(
            r["sparse_s"][f"{algorithm}:{k}"] for r in local)
        local_s += count * (dense_local + extra)
        net_s += count * cost.network_time(form, n, level, cl)
      count = sum(c for _, c in levels) or 1
      warmup = sum(c for d, c in levels if d != density)
      group.append({"link": link, "system": s["system"], "density": density,
                    "from_workers": s.get("from_workers", nodes),
                    "seeds": s.get("seeds", meta["seeds"]),
                    "steps": steps, "warmup_steps": warmup, "final": s["final"],
                    "local_s": local_s / count, "network_s": net_s / count,
                    "step_s": (local_s + net_s) / count,
                    "time_s": None if steps is None else local_s + net_s,
                    "R": dense_net / dense_local})
    timed = [g for g in group if g["time_s"] is not None]
    best = min(timed, key=lambda g: g["time_s"]) if timed else None
    allgather = [g for g in timed if g["system"].startswith("allgather")]
    logp = [g for g in timed if g["system"].startswith("gtopk")]
    for g in group:
      g["picked"] = best is not None and g is best
    if allgather and logp:
      fastest = min(logp, key=lambda g: g["time_s"])
      for g in group:
        g["best_gtopk_over_allgather"] = (min(a["time_s"] for a in allgather)
                                          / fastest["time_s"])
    rows += group
  return rows


def levels_of(config_path: str, sets: list[str], system: dict[str, Any], nodes: int, n: int,
              total: int) -> list[list[float]]:
  """[[density, steps at it], ...] over `system`'s median steps to the target at `nodes`
  workers (of a `total`-step run): the density levels its DGC warm-up passes through, as the
  trainer rounds them (`time_to_accuracy.systems.levels_to`), then its own density."""
  from studies.time_to_accuracy.systems import levels_to
  from studies.worker_scaling import run as ws
  steps = system["steps_to_target"]
  if steps is None or system["algorithm"] == "dense":
    return [[system["density"], steps or 0]]
  steps_per_epoch = round(total / ws.run_config(config_path, sets, "dense", nodes, 0, n).num_epochs)
  config = ws.run_config(config_path, sets, system["system"], nodes, 0, n, steps_per_epoch)
  return [[float(d), c] for d, c in levels_to(config, steps_per_epoch, total, math.ceil(steps))]


def systems_at(scaling: dict[str, Any], nodes: int) -> list[dict[str, Any]]:
  """Each system's median steps to the target and final metric at `nodes` workers from the
  worker-scaling results (None steps where a seed did not reach the target). Dense where it
  did not run at `nodes`: from the fewest workers it ran at (the global batch split over P
  workers and averaged back is the same step at every P; `from_workers` says so)."""
  from studies.worker_scaling import run as ws
  out = []
  rows = [r for r in scaling["rows"] if r["workers"] == nodes]
  dense = sorted((r for r in scaling["rows"] if r["system"] == "dense"),
                 key=lambda r: r["workers"])
  if dense and not any(r["system"] == "dense" for r in rows):
    rows.append(dense[0])
  for row in rows:
    steps = row["steps_to_target"]
    algorithm = ws.parse_system(row["system"]).algorithm
    out.append({"system": row["system"], "algorithm": algorithm, "density": row["density"],
                "steps_to_target": (None if any(s is None for s in steps)
                                    else statistics.median(steps)),
                "steps_by_seed": steps, "seeds": len(steps),
                "final": statistics.median(row["final"]),
                "from_workers": row["workers"]})
  if not any(r["from_workers"] == nodes for r in out):
    raise ValueError(f"no runs at {nodes} workers in the results; workers there: "
                     f"{sorted({r['workers'] for r in scaling['rows']})}")
  return out


def table(results: dict[str, Any]) -> str:
  meta = results["meta"]
  local = results["local"]
  lines = [
      f"Time to accuracy at {meta['nodes']} nodes of one worker on `{meta['config']}` "
      f"({meta['parameters']:,} parameters; per-worker batch {local[0]['batch']}): median "
      f"steps to the target from `{meta['scaling']}` ({meta['seeds']} seeds), each step "
      f"at {meta['nodes']} nodes at the density it runs at: local work measured on one "
      f"core ({len(local)} process runs, "
      "median), network modelled (`sparsejax.cost` with the emulated cluster's calibration, "
      f"`{meta['calibration']}`; latency {1e3 * meta['alpha_s']:.3g} ms a message at every "
      f"link{'' if meta.get('alpha_from') is None else ', ' + meta['alpha_from']}). "
      "R: dense's network time over its local step. Picked: the least time to the target. "
      "Steps marked (P=p): dense's from p workers (the same step at every P). Warm-up: of "
      "the steps to the target, those at the DGC warm-up's higher density levels or in the "
      "exchange's dense form (`-dw`); local, "
      "network and step: the mean over the steps to the target.", "",
      "| link | R | system | density | steps | warm-up | final | local ms | network ms | "
      "step ms | time to target s | picked |",
      "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
  for r in results["rows"]:
    time_s = "never" if r["time_s"] is None else f"{r['time_s']:.2f}"
    steps = "never" if r["steps"] is None else f"{r['steps']:g}"
    if r.get("from_workers", meta["nodes"]) != meta["nodes"]:
      steps += f" (P={r['from_workers']})"
    if r.get("seeds", meta["seeds"]) != meta["seeds"]:
      steps += f" ({r['seeds']} seed{'s' if r['seeds'] > 1 else ''})"
    lines.append(
        f"| {r['link']} | {r['R']:.2g} | {r['system']} | {r['density']:.4g} | {steps} | "
        f"{r.get('warmup_steps', '-')} | {r['final']:.4f} | {1e3 * r['local_s']:.2f} | "
        f"{1e3 * r['network_s']:.2f} | "
        f"{1e3 * r['step_s']:.2f} | {time_s} | {'yes' if r['picked'] else ''} |")
  ratios = {r["link"]: r["best_gtopk_over_allgather"] for r in results["rows"]
            if "best_gtopk_over_allgather" in r}
  if ratios:
    lines += ["", "The fastest TopK all-gather system's time to the target over the fastest "
              "gTop-k system's "
              "(above 1: gTop-k sooner): " + ", ".join(
                  f"{link} {v:.2f}" for link, v in ratios.items()) + "."]
  lines += ["", "Local step (ms, min / median / max over the process runs): dense "
            + spread([1e3 * r["dense_s"] for r in local], 2) + "; " + "; ".join(
                f"+ {key} " + spread([1e3 * r["sparse_s"][key] for r in local], 2)
                for key in local[0]["sparse_s"])]
  return "\n".join(lines) + "\n\n" + footer(meta)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--results", help="worker_scaling results JSONs, comma-separated (the "
                  "first's config is the task; a system in two files is taken from the first)")
  ap.add_argument("--config", help="the task's config (default: the results' own)")
  ap.add_argument("--set", dest="sets", action="append", default=None, metavar="KEY=VALUE")
  ap.add_argument("--nodes", type=int, default=16)
  ap.add_argument("--bandwidths", default="unlimited,10gbit,1gbit,100mbit")
  ap.add_argument("--calibration", default=CALIBRATION)
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--alpha-us", type=float,
                  help="latency per message, microseconds (default: the calibration's fit)")
  ap.add_argument("--alpha-from", help="where --alpha-us comes from (said in the table)")
  ap.add_argument("--local-from", metavar="JSON",
                  help="the local work measured by an earlier run of this script (same task "
                       "and --nodes), not measured again")
  ap.add_argument("--out", type=json_path)
  ap.add_argument("--from-results", metavar="JSON", help="no measurement: the table again")
  ap.add_argument("--measure-child", metavar="JSON", help=argparse.SUPPRESS)
  ap.add_argument("--parameters", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--sparse", default="", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.measure_child:  # one process's measurement (pinned to one core: a node's)
    if hasattr(os, "sched_setaffinity"):
      os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    sparse = [(a, int(k)) for a, k in (p.split(":") for p in args.sparse.split(",") if p)]
    out = measure_local(args.config, args.sets or [], args.nodes, args.parameters, sparse)
    with open(args.measure_child, "w") as f:
      json.dump(out, f)
    return 0
  if args.out is None:
    ap.error("--out is required")
  if args.from_results:
    with open(args.from_results) as f:
      results = json.load(f)
    with open(resolve(results["meta"]["calibration"])) as f:
      calibration = json.load(f)["calibration"]
  else:
    if not args.results:
      ap.error("--results is required (or --from-results)")
    try:
      links = [b for b in args.bandwidths.split(",") if b]
      for b in links:
        parse_bandwidth(b)
    except ValueError as e:
      ap.error(str(e))
    if args.nodes < 2 or args.runs < 1:
      ap.error(f"--nodes must be >= 2, got {args.nodes}; --runs >= 1, got {args.runs}")
    files = [f for f in args.results.split(",") if f]
    scalings = []
    for path in files:
      with open(path) as f:
        scalings.append(json.load(f))
    with open(resolve(args.calibration)) as f:
      calibration = json.load(f)["calibration"]
    smeta = scalings[0]["meta"]
    for path, other in zip(files[1:], scalings[1:]):
      if (other["meta"]["config"], other["meta"]["parameters"]) != (smeta["config"],
                                                                    smeta["parameters"]):
        ap.error(f"--results {path}: config {other['meta']['config']} with "
                 f"{other['meta']['parameters']} parameters; the first file's is "
                 f"{smeta['config']} with {smeta['parameters']}")
    args.config = args.config or resolve(smeta["config"])
    args.sets = smeta.get("sets", []) if args.sets is None else args.sets
    systems: list[dict[str, Any]] = []
    try:
      for scaling in scalings:  # the first file's system where two files have one
        systems += [s for s in systems_at(scaling, args.nodes)
                    if s["system"] not in {t["system"] for t in systems}]
    except ValueError as e:
      ap.error(str(e))
    n = smeta["parameters"]
    total = max(r["steps"] for scaling in scalings for r in scaling["runs"]
                if r["workers"] == args.nodes)
    for s in systems:
      s["levels"] = levels_of(args.config, args.sets, s, args.nodes, n, total)
    sparse = sorted({(s["algorithm"], max(1, round(d * n))) for s in systems
                     if s["algorithm"] != "dense" for d, _ in s["levels"] if d < 1.0})
    if args.local_from:
      with open(args.local_from) as f:
        earlier = json.load(f)
      local = earlier["local"]
      missing = [f"{a}:{k}" for a, k in sparse if f"{a}:{k}" not in local[0]["sparse_s"]]
      if earlier["meta"]["nodes"] != args.nodes or missing:
        ap.error(f"--local-from {args.local_from}: measured at {earlier['meta']['nodes']} "
                 f"nodes with {sorted(local[0]['sparse_s'])}; needed {args.nodes} nodes and "
                 f"{missing or 'nothing more'}")
    else:
      local = measure_runs(args, args.nodes, n, sparse)
    results = {"meta": {
        "command": command_line(__file__, list(sys.argv[1:] if argv is None else argv)),
        "config": portable_path(args.config), "sets": args.sets,
        "scaling": ", ".join(portable_path(f) for f in files),
        "calibration": portable_path(args.calibration),
        "alpha_s": (calibration["params"]["alpha_s"] if args.alpha_us is None
                    else 1e-6 * args.alpha_us),
        "alpha_from": None if args.alpha_us is None else (
            args.alpha_from or "--alpha-us"), "nodes": args.nodes,
        "bandwidths": links, "parameters": n, "seeds": smeta["seeds"],
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d")}, "systems": systems, "local": local}
  results["rows"] = analyse(results, calibration)
  text = table(results)
  print(text)
  write_results(args.out, results, text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
