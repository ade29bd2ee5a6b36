"""The sparse exchange against the node count: TopK all-gather, gTop-k and dense all-reduce on an
emulated cluster of 2-16 nodes whose links, not the cores, bound the exchange.

  python -m benchmarks.scale [--nodes 2,3,4,5,6,8,12,16] [--rate 5mbit] [--runs 3]
      [--reps 5] [--size resnet50] [--density 0.001] [--dense-fraction 128] [--compute-ms 37.7]
      [--lock FILE] [--out benchmarks/results/bench_scale.json]                (needs root)
  python -m benchmarks.scale --quick      (CI smoke: 2 and 3 nodes, a small buffer)

Each node is one process on its own network namespace (`EmulatedCluster`: tc tbf on both ends
of its link), one CPU device, pinned to core rank % cores. This machine has 2 cores for up to
16 processes, so a node's own work cannot be timed as a node would do it; the benchmark keeps
that work out of the exchange and makes the exchange wait on the link:

  compute   an idle wait (`--compute-ms`, default the time-to-accuracy study's measured JAX
            compute step, 37.7 ms): the backward pass, which on a GPU node leaves the host idle;
  select    MSTopK with error feedback (`topk.select_feedback`) on the node's buffer: local work;
  exchange  after a barrier, the network part alone: TopK all-gather's all-gather of every
            node's k (value, index) pairs (`comm.gather_pairs`), gTop-k's recursive-doubling
            merge and psum of the k sums (`comm.gtopk_sums`); dense: a psum of the buffer;
  apply     local work again: the scatter into the dense sum, the residual (`scatter_pairs`,
            `gtopk_settle`);
  full      the library's whole exchange in one program (`comm.settle`), which exchange + apply
            should match;
  transform the public transform, `topk_allreduce(density, algorithm=...)`'s update in one
            program: select + full, as a user's step runs it.

After the timed calls every node checks the transform's result once: its update equal on every
node (a checksum against node 0's) and the mass kept (over the nodes, the gradient plus the
residual before minus the residual after equals the sum of what arrived, each projected on one
random vector), recorded as `checks`.

The buffer has the real model's size (ResNet-50, 25,557,032 float32) and a gradient-like
distribution: ResNet-50's 161 tensors (in order), each Gaussian at its own scale 10**U(-3, 0);
the workers share half of the variance (one model, different data), so their top-k sets overlap
as real gradients' do. Dense runs on 1/`--dense-fraction` of the buffer (its ring all-reduce of
the whole buffer would take minutes a call at these rates; ring bytes are linear in the size),
reported as measured and scaled. With one worker per node, HiTopKComm between nodes is TopK
all-gather and HiTopKComm-gTop-k is gTop-k (their intra-node phases are empty).

Measured per node and call: seconds of each phase, bytes its interface sent during the exchange
(`ip -s link`, headers included), its process's CPU seconds; node 0 also the machine's idle
share (/proc/stat) during the exchange: the evidence that the link, not the CPU, was busy.
Every node count runs `--runs` times as separate process runs (new processes, new cluster);
each run gives a median over `--reps` calls after a warm-up, the tables min / median / max over
runs. Writes JSON, a markdown table and a plot (exchange time against nodes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
from typing import Any

import numpy as np

from benchmarks.exchange import SIZES
from sparsejax.bench import (
  command_line,
  footer,
  git_commit,
  json_path,
  launch_workers,
  spread,
  write_results,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

ALGORITHMS = ("allgather", "gtopk", "dense")
# gTop-k's network part in pieces (`--algorithms` names them; not in the default): its merge
# rounds alone (`comm.gtopk_positions`) and the psum of the k sums alone
PARTS = ("gtopk-merge", "psum-k")
PHASES = ("select", "exchange", "apply", "full", "transform")
QUICK = {"nodes": "2,3", "rate": "100mbit", "runs": 1, "reps": 2, "size": "tiny",
         "density": 0.01, "dense_fraction": 1}


# ----------------------------------------------------------------------------- the buffer

def gradient(rank: int, n: int, seed: int = 0) -> np.ndarray:
  """float32[n], worker `rank`'s gradient-like buffer: ResNet-50's tensor sizes (scaled to n),
  each tensor Gaussian at a scale 10**U(-3, 0) shared by all workers, half of each value's
  variance shared by all workers (the same model), half the worker's own (its data)."""
  import jax

  from benchmarks import param_trees
  sizes = np.array([math.prod(s.shape) for s in jax.tree.leaves(param_trees.resnet50())],
                   np.float64)
  cuts = np.round(np.concatenate([[0], np.cumsum(sizes)]) / sizes.sum() * n).astype(np.int64)
  common, own = np.random.default_rng(seed), np.random.default_rng(seed + 1 + rank)
  scale = (10.0 ** common.uniform(-3, 0, len(sizes))).astype(np.float32)
  x = common.standard_normal(n, dtype=np.float32)
  x += own.standard_normal(n, dtype=np.float32)
  x *= np.repeat(scale * np.float32(np.sqrt(0.5)), np.diff(cuts))
  return x


# ----------------------------------------------------------------------------- one node

def _cpu_idle_jiffies() -> tuple[int, int]:
  """(idle, total) jiffies of the whole machine so far (/proc/stat's first line)."""
  with open("/proc/stat") as f:
    fields = [int(v) for v in f.readline().split()[1:]]
  return fields[3] + fields[4], sum(fields)


def _programs(n: int, k: int, n_dense: int, density: float, mesh, spec
              ) -> dict[str, dict[str, Any]]:
  """algorithm -> phase -> jitted program over the (nodes, 1) mesh."""
  import jax
  from jax import lax

  from sparsejax import comm, compress, topk
  from sparsejax.feedback import Feedback
  from sparsejax.train.mesh import WORKERS

  def smap(f):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))

  def select(v, r):
    return topk.select_feedback("mstopk", v, r, k)

  def full(name):  # the sum and the residual, as the training step needs both
    collective = comm.sparse_collective(name, WORKERS)

    def run(v, i, r):
      total, kept = comm.settle(collective, v, i, Feedback(r), n, False)
      return total, kept.residual
    return smap(run)

  def transform(name):  # the public optax transform: select + exchange + settle, one program
    tx = compress.topk_allreduce(density, algorithm=name, axis_name=WORKERS)

    def run(g, r):
      state = tx.init(g)
      state = state._replace(feedback=state.feedback._replace(residual=r))
      updates, state = tx.update(g, state)
      return updates, state.feedback.residual
    return smap(run)

  return {
      "allgather": {
          "select": smap(select),
          "exchange": smap(lambda v, i: comm.gather_pairs(v, i, WORKERS)),
          "apply": smap(lambda av, ai: comm.scatter_pairs(av, ai, n)),
          "full": full("allgather"), "transform": transform("allgather")},
      "gtopk": {
          "select": smap(select),
          "exchange": smap(lambda v, i: comm.gtopk_sums(v, i, n, WORKERS)),
          "apply": smap(lambda v, i, r, pos, sums: (lambda t, f: (t, f.residual))(
              *comm.gtopk_settle(v, i, Feedback(r), pos, sums, n, False))),
          "full": full("gtopk"), "transform": transform("gtopk")},
      "dense": {"exchange": smap(lambda x: lax.psum(x, WORKERS)), "n": n_dense},
      "gtopk-merge": {"select": smap(select),
                      "exchange": smap(lambda v, i: comm.gtopk_positions(v, i, n, WORKERS))},
      "psum-k": {"exchange": smap(lambda x: lax.psum(x, WORKERS)), "n": k},
  }


def _time_call(name: str, progs: dict, x, r, x_dense, barrier, args, x_k=None
               ) -> dict[str, float]:
  """One call of `name` on this node: each phase's seconds, the bytes its link sent and its
  CPU seconds during the exchange, the machine's idle share then."""
  import jax

  from sparsejax import cluster
  rec: dict[str, Any] = {}
  barrier()
  time.sleep(args.compute_ms / 1e3)  # the compute: the host idle, as under a GPU's backward
  inputs: tuple = (x_k,) if name == "psum-k" else (x_dense,)
  if "select" in progs:
    t = time.perf_counter()
    v, i, kept = jax.block_until_ready(progs["select"](x, r))
    rec["select"] = time.perf_counter() - t
    inputs = (v, i)
  sent = cluster.link_sent_bytes()  # before the barrier: it forks `ip`, which must not delay
  barrier()                          # a start (the barrier's own bytes are a few hundred)
  idle, cpu = _cpu_idle_jiffies(), time.process_time()
  t = time.perf_counter()
  out = jax.block_until_ready(progs["exchange"](*inputs))
  rec["exchange"] = time.perf_counter() - t
  rec["cpu_s"] = time.process_time() - cpu
  idle2 = _cpu_idle_jiffies()
  rec["machine_idle"] = (idle2[0] - idle[0]) / max(1, idle2[1] - idle[1])
  rec["link_bytes"] = cluster.link_sent_bytes() - sent
  if "apply" not in progs:
    return rec
  t = time.perf_counter()
  local = (v, i, kept, *out) if name == "gtopk" else out
  jax.block_until_ready(progs["apply"](*local))
  rec["apply"] = time.perf_counter() - t
  barrier()
  t = time.perf_counter()
  jax.block_until_ready(progs["full"](v, i, kept))
  rec["full"] = time.perf_counter() - t
  barrier()
  t = time.perf_counter()
  jax.block_until_ready(progs["transform"](x, r))
  rec["transform"] = time.perf_counter() - t
  return rec


def _checks(progs: dict, x, r, nodes: int, chunk: int = 1 << 20) -> list[float]:
  """This node's part of the transform's checks, from one call (the residual before it: `r`):
  [its update on a random vector w, the same in absolute terms (sum |u w|), what left this node
  (gradient + residual before - residual after) on a random vector z, the same in absolute
  terms, what arrived (nodes x the update, the mean) on z]; `judge_checks` compares them over
  the nodes. Projected a chunk at a time in float64 (a whole buffer of float64 vectors per
  process would not fit 16 processes' memory at ResNet-50's size)."""
  import jax
  updates, residual = jax.block_until_ready(progs["transform"](x, r))
  u, after = (np.asarray(a.addressable_data(0)) for a in (updates, residual))
  g, before = (np.asarray(a.addressable_data(0)) for a in (x, r))
  rng = np.random.default_rng(12345)  # the same vectors on every node
  out = np.zeros(5)
  for lo in range(0, u.shape[0], chunk):
    w, z = rng.standard_normal((2, min(chunk, u.shape[0] - lo)))
    part = slice(lo, lo + w.shape[0])
    uu = u[part].astype(np.float64)
    sent = g[part].astype(np.float64) + before[part] - after[part]
    out += [uu @ w, np.abs(uu * w).sum(), sent @ z, np.abs(sent * z).sum(), nodes * (uu @ z)]
  return out.tolist()


def judge_checks(per_node: list[list[float]]) -> dict[str, float]:
  """The checks over the nodes (rows from `_checks`): the largest difference of a node's update
  projection from node 0's, relative to node 0's absolute sum; the gap between the mass that
  left the nodes and what arrived (node 0's view), relative to the absolute mass that left. A
  NaN anywhere stays NaN."""
  a = np.asarray(per_node, np.float64)
  return {"update_rel_diff": float(np.max(np.abs(a[:, 0] - a[0, 0])) / max(a[0, 1], 1e-30)),
          "mass_rel_gap": float(abs(a[:, 2].sum() - a[0, 4]) / max(a[:, 3].sum(), 1e-30))}


def run_worker(args) -> None:
  """One node: its buffer, every algorithm's calls, every node's records gathered to rank 0."""
  from sparsejax import cluster
  from sparsejax.bench import pin_to_core
  pin_to_core(int(os.environ.get(cluster.ENV["process_id"], "0")))
  cluster.initialize()
  import jax
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from sparsejax.train.mesh import WORKERS, make_mesh
  rank, nodes = jax.process_index(), jax.process_count()
  mesh = make_mesh(nodes, 1)
  spec = P(WORKERS)
  put = lambda a: jax.make_array_from_process_local_data(NamedSharding(mesh, spec), a)  # noqa
  n = SIZES.get(args.size) or int(args.size)
  k, n_dense = max(1, round(args.density * n)), n // args.dense_fraction
  x_np = gradient(rank, n, args.seed)
  x, r, x_dense = put(x_np), put(np.zeros(n, np.float32)), put(x_np[:n_dense].copy())
  x_k = put(x_np[:k].copy())
  del x_np
  token = put(np.ones(1, np.float32))
  sync = jax.jit(jax.shard_map(lambda t: jax.lax.psum(t, WORKERS), mesh=mesh, in_specs=spec,
                               out_specs=P(), check_vma=False))
  barrier = lambda: jax.block_until_ready(sync(token))  # noqa: E731
  programs = _programs(n, k, n_dense, args.density, mesh, spec)
  names = args.algorithms.split(",")
  mine: dict[str, list[dict]] = {name: [] for name in names}
  for call in range(args.warmup + args.reps):  # the algorithms take turns, call by call
    for name in names:
      rec = _time_call(name, programs[name], x, r, x_dense, barrier, args, x_k)
      if call >= args.warmup:
        mine[name].append(rec)
  checks = {name: np.asarray(multihost_utils.process_allgather(np.asarray(
      _checks(programs[name], x, r, nodes), np.float64)))
      for name in names if "transform" in programs[name]}
  # every node's records to rank 0 (one array of numbers per algorithm and field)
  gathered = {}
  for name, rows in mine.items():
    for field in rows[0]:
      values = np.asarray([row[field] for row in rows], np.float64)
      gathered[(name, field)] = np.asarray(multihost_utils.process_allgather(values))
  if rank == 0:
    out = [{"algorithm": name, "field": field, "per_node": vals.tolist()}
           for (name, field), vals in gathered.items()]
    with open(args.worker_out, "w") as f:
      json.dump({"nodes": nodes, "n": n, "k": k, "n_dense": n_dense, "records": out,
                 "checks": {name: judge_checks(v.tolist()) for name, v in checks.items()}}, f)


# ----------------------------------------------------------------------------- driver

class RunTimeout(Exception):
  pass


def _alarm(signum, frame):
  raise RunTimeout


def one_run(nodes: int, run: int, args, log) -> dict | None:
  """One process run of every algorithm on a fresh cluster of `nodes` nodes; None if it failed
  or ran past --run-timeout (recorded by the caller)."""
  from sparsejax import cluster
  from sparsejax.bench import exclusive
  argv = ["--size", args.size, "--density", str(args.density), "--dense-fraction",
          str(args.dense_fraction), "--compute-ms", str(args.compute_ms), "--reps",
          str(args.reps), "--warmup", str(args.warmup), "--algorithms", args.algorithms,
          "--seed", str(args.seed)]
  old = signal.signal(signal.SIGALRM, _alarm)
  signal.alarm(args.run_timeout)
  try:
    with exclusive(args.lock), cluster.EmulatedCluster(nodes, args.rate_bps) as c:
      got = launch_workers(c, __file__, argv, mode="worker", procs_per_node=1,
                           devices_per_proc=1, log=log, what=f"{nodes}-node run")
    return {"nodes": nodes, "run": run, **got}
  except (RuntimeError, RunTimeout) as e:
    print(f"{nodes} nodes, run {run}: {'timed out' if isinstance(e, RunTimeout) else e}",
          flush=True)
    return None
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _median_per_run(run: dict, algorithm: str, field: str, node: int | None = 0,
                    reduce=np.median) -> float | None:
  """A run's median over calls of `field` at `node` (None: `reduce` over nodes per call)."""
  for rec in run["records"]:
    if rec["algorithm"] == algorithm and rec["field"] == field:
      vals = np.asarray(rec["per_node"])  # [nodes, calls]
      per_call = vals[node] if node is not None else reduce(vals, axis=0)
      return float(np.median(per_call))
  return None


def analyse(results: dict) -> list[dict]:
  """One row per (nodes, algorithm): per-run medians of every phase, bytes and CPU figures."""
  from sparsejax import comm
  rows = []
  runs = [r for r in results["runs"] if r]
  for nodes in sorted({r["nodes"] for r in runs}):
    mine = [r for r in runs if r["nodes"] == nodes]
    for algorithm in results["meta"]["algorithms"]:
      row: dict[str, Any] = {"nodes": nodes, "algorithm": algorithm}
      for phase in PHASES:
        row[phase + "_s"] = [_median_per_run(r, algorithm, phase) for r in mine]
      row["link_bytes_mean"] = [_median_per_run(r, algorithm, "link_bytes", None, np.mean)
                                for r in mine]
      row["link_bytes_max"] = [_median_per_run(r, algorithm, "link_bytes", None, np.max)
                               for r in mine]
      row["machine_idle"] = [_median_per_run(r, algorithm, "machine_idle") for r in mine]
      if any(v is None for v in row["link_bytes_mean"]):
        continue  # not measured in every run
      row["node0_link_bytes"] = [_median_per_run(r, algorithm, "link_bytes") for r in mine]
      row["cpu_share"] = [_median_per_run(r, algorithm, "cpu_s", None, np.sum) / (
          results["meta"]["cpus"] * _median_per_run(r, algorithm, "exchange")) for r in mine]
      n, k = mine[0]["n"], mine[0]["k"]
      length = mine[0]["n_dense"] if algorithm == "dense" else n
      row["wire_bytes"] = None if algorithm in PARTS else comm.wire_bytes(
          algorithm, n=length, k=k, nodes=nodes, local=1)["inter"]
      rate = results["meta"]["rate_bps"]
      row["link_busy"] = [b * 8 / rate / t for b, t in
                          zip(row["node0_link_bytes"], row["exchange_s"])] if rate else None
      row["checks"] = [r.get("checks", {}).get(algorithm) for r in mine]
      rows.append(row)
  return rows


def speedups(rows: list[dict], over: str = "allgather", of: str = "gtopk",
             phase: str = "exchange") -> dict[int, list]:
  """nodes -> per-run `phase`-time ratios over/of (run i against run i)."""
  by = {(r["nodes"], r["algorithm"]): r for r in rows}
  out = {}
  for nodes in sorted({r["nodes"] for r in rows}):
    a, b = by.get((nodes, over)), by.get((nodes, of))
    if a and b:
      out[nodes] = [x / y for x, y in zip(a[phase + "_s"], b[phase + "_s"]) if x and y]
  return out


def make_tables(results: dict, rows: list[dict]) -> str:
  m = results["meta"]
  scale = m["n"] / m["n_dense"]
  lines = [f"Exchange of {m['n']:,} float32 per node ({m['size']}), density {m['density']} "
           f"(k = {m['k']:,} pairs a node), {m['rate']} links, one process a node; seconds, "
           f"min / median / max over {m['runs']} process runs (each the median of {m['reps']} "
           f"calls). dense: a psum of 1/{m['dense_fraction']} of the buffer, and scaled to the "
           "whole buffer.",
           "", "| nodes | TopK all-gather | gTop-k | gTop-k speed-up | dense (measured) | "
           f"dense x{m['dense_fraction']} |", "|---:|---:|---:|---:|---:|---:|"]
  by = {(r["nodes"], r["algorithm"]): r for r in rows}
  ups = speedups(rows)
  for nodes in sorted({r["nodes"] for r in rows}):
    ag, gt, de = (by.get((nodes, a)) for a in ("allgather", "gtopk", "dense"))
    lines.append(f"| {nodes} | {spread(ag['exchange_s']) if ag else '-'} | "
                 f"{spread(gt['exchange_s']) if gt else '-'} | {spread(ups.get(nodes, []))}x | "
                 f"{spread(de['exchange_s']) if de else '-'} | "
                 f"{spread(de['exchange_s'], 1, scale) if de else '-'} |")
  parts = [r for r in rows if r["algorithm"] in PARTS]
  if parts:
    lines += ["", "gTop-k's network part in pieces (seconds, min / median / max over runs): its "
              "merge rounds alone (`comm.gtopk_positions`) and the psum of its k sums alone:",
              "", "| nodes | part | exchange s |", "|---:|---|---:|"]
    lines += [f"| {r['nodes']} | {r['algorithm']} | {spread(r['exchange_s'])} |" for r in parts]
  lines += ["", "Bytes each node's link sent per exchange (interface counter, headers included; "
            "mean over nodes, median run) against the model's bytes of the busiest worker "
            "(`comm.wire_bytes`):", "", "| nodes | algorithm | measured KB mean | measured KB "
            "max | wire_bytes KB | measured / model |", "|---:|---|---:|---:|---:|---:|"]
  for r in rows:
    mean = statistics.median(r["link_bytes_mean"])
    model = (f"{r['wire_bytes'] / 1e3:.1f} | {mean / r['wire_bytes']:.2f}"
             if r["wire_bytes"] else "- | -")  # (gTop-k's parts: no model of their own)
    lines.append(f"| {r['nodes']} | {r['algorithm']} | {mean / 1e3:.1f} | "
                 f"{statistics.median(r['link_bytes_max']) / 1e3:.1f} | {model} |")
  lines += ["", "Is the link what the exchange waits on? During the exchange: the machine's idle "
            "share (/proc/stat, all cores), the workers' CPU seconds over cores x wall time, and "
            "node 0's link busy share (its bytes at the link's rate over the wall time):", "",
            "| nodes | algorithm | machine idle | workers' CPU share | link busy |",
            "|---:|---|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['nodes']} | {r['algorithm']} | {spread(r['machine_idle'], 0, 100)}% | "
                 f"{spread(r['cpu_share'], 0, 100)}% | "
                 f"{spread(r['link_busy'], 0, 100) if r['link_busy'] else '-'}% |")
  timed = any(v is not None for r in rows for v in r.get("transform_s", []))
  lines += ["", f"A step on this cluster (seconds, median run): the compute wait "
            f"({m['compute_ms']} ms) + select + exchange + apply; `full` is the library's whole "
            "exchange (exchange + apply) in one program" + (
                "; `transform` the public transform (select + full) in one program" if timed
                else "") + ". select and apply are local work that "
            "every node runs at the same time, on this machine's 2 cores: past 2 nodes they are "
            "timed under nodes/2-fold contention (a real node runs its own; the 2-node rows are "
            "the uncontended figures):", "",
            "| nodes | algorithm | select | exchange | apply | full | " + (
                "transform | " if timed else "") + "step |",
            "|---:|---|---:|---:|---:|---:|" + ("---:|" if timed else "") + "---:|"]
  for r in rows:
    if r["algorithm"] == "dense" or r["algorithm"] in PARTS:
      continue
    med = {p: statistics.median(v for v in r[p + "_s"] if v is not None)
           if any(v is not None for v in r[p + "_s"]) else float("nan") for p in PHASES}
    step = m["compute_ms"] / 1e3 + med["select"] + med["exchange"] + med["apply"]
    lines.append(f"| {r['nodes']} | {r['algorithm']} | {med['select']:.3f} | "
                 f"{med['exchange']:.3f} | {med['apply']:.3f} | {med['full']:.3f} | " + (
                     f"{med['transform']:.3f} | " if timed else "") + f"{step:.3f} |")
  whole = {phase: speedups(rows, phase=phase) for phase in ("full", "transform")}
  if timed and any(whole["transform"].values()):
    lines += ["", "gTop-k over TopK all-gather as the library runs it (per run, min / median / "
              "max): `full`, the whole exchange in one program; `transform`, the public "
              "transform (select included, under the same contention):", "",
              "| nodes | full | transform |", "|---:|---:|---:|"]
    for nodes in sorted(whole["transform"]):
      ups = [whole[p].get(nodes, []) for p in ("full", "transform")]
      lines.append("| " + " | ".join([str(nodes)] + [f"{spread(u)}x" if u else "-"
                                                       for u in ups]) + " |")
  checked = [(r["nodes"], r["algorithm"], c) for r in rows for c in r.get("checks") or [] if c]
  if checked:
    worst = {}
    for nodes, algorithm, c in checked:  # (np.max: a NaN in any run shows)
      worst.setdefault((nodes, algorithm), []).append([c["update_rel_diff"], c["mass_rel_gap"]])
    worst = {key: np.max(np.asarray(v), axis=0) for key, v in worst.items()}
    lines += ["", "The transform's result, checked once a run (worst over runs): its update's "
              "relative difference from node 0's, and the gap between the mass that left the "
              "nodes (gradient + residual before - residual after) and what arrived (the "
              "update x nodes), each on a random projection:", "",
              "| nodes | algorithm | update rel. diff | mass rel. gap |", "|---:|---|---:|---:|"]
    lines += [f"| {n} | {a} | {w[0]:.1e} | {w[1]:.1e} |" for (n, a), w in sorted(worst.items())]
  lines += ["", footer(m)]
  return "\n".join(lines)


def plot(rows: list[dict], meta: dict, png: str) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot")
    return
  fig, ax = plt.subplots(figsize=(7, 4.5))
  labels = {"allgather": "TopK all-gather (= HiTopKComm between nodes)",
            "gtopk": "gTop-k (= HiTopKComm-gTop-k between nodes)", "dense": "dense (measured part)"}
  for algorithm in meta["algorithms"]:
    pts = sorted((r["nodes"], statistics.median(r["exchange_s"])) for r in rows
                 if r["algorithm"] == algorithm)
    if pts:
      ax.plot(*zip(*pts), marker="o", label=labels.get(algorithm, algorithm))
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("nodes (one process each)")
  ax.set_ylabel("exchange, s (median of runs)")
  ax.set_title(f"Exchange against nodes: {meta['size']}, density {meta['density']}, "
               f"{meta['rate']} links", fontsize=10)
  ax.legend(fontsize=8)
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(png, dpi=120)


def report(results: dict, out: str) -> None:
  rows = results["analysis"] = analyse(results)
  table = make_tables(results, rows)
  print(table)
  write_results(out, results, table)
  plot(rows, results["meta"], os.path.splitext(out)[0] + ".png")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--nodes", default="2,3,4,5,6,8,12,16")
  ap.add_argument("--rate", default="5mbit", help="every node's link, each direction")
  ap.add_argument("--runs", type=int, default=3, help="separate process runs per node count")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--size", default="resnet50",
                  help=f"float32 per node: one of {', '.join(sorted(SIZES))} or a count")
  ap.add_argument("--density", type=float, default=0.001)
  ap.add_argument("--dense-fraction", type=int, default=128)
  ap.add_argument("--compute-ms", type=float, default=37.7)
  ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--run-timeout", type=int, default=900)
  ap.add_argument("--lock", help="a file to flock around each process run")
  ap.add_argument("--quick", action="store_true", help="CI smoke: 2 and 3 nodes, tiny buffer")
  ap.add_argument("--out", type=json_path,
                  default=os.path.join(HERE, "results", "bench_scale.json"))
  ap.add_argument("--from-results", metavar="JSON", help="no runs: analyse a results file again")
  ap.add_argument("--mode", default="driver", choices=("driver", "worker"), help=argparse.SUPPRESS)
  ap.add_argument("--worker-out", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.mode == "worker":
    run_worker(args)
    return 0
  if args.from_results:
    with open(args.from_results) as f:
      report(json.load(f), args.out)
    return 0
  argv = list(sys.argv[1:] if argv is None else argv)
  if args.quick:
    for key, value in QUICK.items():
      setattr(args, key, value)
  return drive(ap, args, argv)


def drive(ap, args, argv: list[str]) -> int:
  from sparsejax import cluster
  try:
    nodes = [int(v) for v in args.nodes.split(",")]
    args.rate_bps = cluster.parse_rate(args.rate)
  except ValueError as e:
    ap.error(f"--nodes must be integers >= 2 and --rate a rate such as 10mbit: {e}")
  if min(nodes) < 2 or max(nodes) > 64:
    ap.error(f"--nodes must be in [2, 64], got {args.nodes}")
  bad = [a for a in args.algorithms.split(",") if a not in ALGORITHMS + PARTS]
  if bad:
    ap.error(f"unknown algorithm(s) {bad}; allowed: {', '.join(ALGORITHMS + PARTS)}")
  for name in ("runs", "reps", "dense_fraction"):
    if getattr(args, name) < 1:
      ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if not 0 < args.density <= 1:
    ap.error(f"--density must be in (0, 1], got {args.density}")
  n = SIZES.get(args.size) or (int(args.size) if args.size.isdigit() else 0)
  if n < 2:
    ap.error(f"--size must be one of {', '.join(sorted(SIZES))} or a count >= 2, "
             f"got {args.size!r}")
  meta = {"commit": git_commit(), "size": args.size, "n": n, "k": max(1, round(args.density * n)),
          "n_dense": n // args.dense_fraction, "density": args.density,
          "dense_fraction": args.dense_fraction, "rate": args.rate, "rate_bps": args.rate_bps,
          "runs": args.runs, "reps": args.reps, "compute_ms": args.compute_ms,
          "algorithms": args.algorithms.split(","), "nodes": nodes,
          "machine": platform.machine(), "cpus": os.cpu_count(),
          "date": time.strftime("%Y-%m-%d"),
          "command": command_line("benchmarks/scale.py", argv)}
  results: dict[str, Any] = {"meta": meta, "runs": []}
  for run in range(args.runs):  # node counts interleaved: a slow spell hits every count alike
    for p in nodes:
      got = one_run(p, run, args, sys.stdout)
      if got is None:
        results.setdefault("failed", []).append({"nodes": p, "run": run})
      else:
        results["runs"].append(got)
      write_results(os.path.splitext(args.out)[0] + ".partial.json", results, "partial")
  report(results, args.out)
  for leftover in (".partial.json", ".partial.md"):
    path = os.path.splitext(args.out)[0] + leftover
    if os.path.exists(path):
      os.remove(path)
  return 0 if results["runs"] else 1


if __name__ == "__main__":
  sys.exit(main())
