"""Time to accuracy on an emulated, link-bound cloud cluster: sparsejax's exchanges and PyTorch DDP
train the same model on the same data with the same recipe to the same target test accuracy.

  python -m studies.time_to_accuracy.run [--config configs/tta_fmnist_mlp.py] [--set key=value ...]
      [--systems dense,hierarchical,allgather-0.01,...] [--bandwidths unlimited,2gbit,...]
      [--headline 1gbit] [--seeds 3] [--phases parity,runs] [--quick]
      [--out studies/time_to_accuracy/results/time_to_accuracy.json]

The task is a `sparsejax train` config (model, data.name, data.path, recipe, target_metric:
accuracy, or loss reached at or below, and target_value, eval_every_steps) with the same `--set`
keys; each system only changes `compression.*` (a system name may add its own overrides:
"hitopk-0.01+experimental.balance=tensor"). Tasks: configs/tta_fmnist_mlp.py (an MLP, SGD) and
configs/tta_kjv_lm.py (a Transformer LM, AdamW). This file is the driver and the cluster's
workers; the systems and the task are systems.py beside it, the analysis, tables and plot
analysis.py (also `--from-results`). sparsejax's side is the trainer itself
(`sparsejax.train.Run`, every step compiled before the clock); the PyTorch peer
(torch_peer.py) builds the same model (`mlp` or `transformer_lm`, the same initialisation),
reads the same batches of the same data (sparsejax's inputs for each step), and uses the same
learning-rate schedule, optimizer and weight decay (kernels only).

The cluster (link-bound by design): the task's `mesh.nodes` nodes (2 in the committed configs;
`--set mesh.nodes=8` for 8, up to 200, the global batch divisible by nodes x `mesh.local`)
(`EmulatedCluster`, a network namespace each, tc tbf on both ends of each node's link), one
process per node, pinned to a core: node i's to core i modulo the cores (this machine has 2: with
2 nodes no more busy processes than cores; with more, the processes share the cores round-robin,
as the parity table's layout says), each sparsejax process with `mesh.local` CPU devices (the fast
intra-node axis stays inside the process), each PyTorch process one thread with the node's share
of the batch. Phases:

  parity  compute only, no cluster: every node's process at once (pinned as the runs pin them),
          the sparsejax trainer's step on a (1, local) mesh vs PyTorch's step, same model and
          per-process batch; alternated rounds, the ratio per round.
  runs    one process run per system and seed, in two parts:
          train: the whole recipe on the cluster at `--headline` bandwidth, evaluating every
          `eval_every_steps` with the clock stopped (state synchronised first): steps and train
          time to the target, final accuracy, bytes that crossed node 0's link (its interface
          counter);
          sweep: then, in the same processes, the step time at every `--bandwidths` value (rank 0
          changes every link's limit in place, the others waiting at a barrier) and, for the
          sparse exchanges, at every density level its warm-up passes through.

Time to target at bandwidth b = sum over the density levels of (steps to target at that level) x
(median step time at b and that level): the trajectory (steps to target) does not depend on the
link, the step time does; the seeds give the separate process runs of each step time. Where
--headline is among the swept bandwidths, the measured train time to target checks the sum.
Writes JSON, a markdown table and a plot (time to target against bandwidth, one line per system,
crossovers against sparsejax dense marked).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

from sparsejax.bench import (
  ROOT,
  command_line,
  exclusive,
  json_path,
  launch_workers,
  pin_to_core,
  pinning,
  portable_path,
  wait_all,
  write_results,
)
from sparsejax.train import Run
from studies.time_to_accuracy.analysis import report, steps_to_target
from studies.time_to_accuracy.systems import (
  DEFAULT_BANDWIDTHS,
  PEERS_INSTALL,
  QUICK_SETS,
  SYSTEMS,
  check_mesh,
  level_steps,
  levels_to,
  load_task,
  model_size,
  parse_bandwidths,
  parse_link_change,
  size_per_step,
  system_spec,
)
from studies.time_to_accuracy.torch_peer import TorchRun  # the peer's runner

HERE = os.path.dirname(os.path.abspath(__file__))
MODULE = "studies.time_to_accuracy.run"

# the parity phase's steps: warm-up, then at least this many timed (each process)
PARITY_WARMUP, PARITY_REPS = 3, 10


def _barrier_jax(name: str) -> None:
  from jax.experimental import multihost_utils
  multihost_utils.sync_global_devices(name)


# ----------------------------------------------------------------------------- workers

def _worker_setup(args):
  """(config, run, rank, is_lead) in a cluster worker, pinned to its node's core (node i on core
  i modulo the cores: round-robin where the nodes outnumber them)."""
  rank = int(os.environ["SPARSEJAX_PROCESS_ID"])
  runtime, options = system_spec(args.system)
  config = load_task(args.config, json.loads(args.sets), args.system, args.seed)
  if runtime == "jax":
    from sparsejax import cluster
    cluster.initialize()
    import jax
    jax.devices()
    # pinned once XLA has started: its executor pool is sized by the cores the process may use
    # when it starts, and one thread would run the pipelined exchange's two programs one after
    # the other (the gloo collective blocks its thread). Every thread is pinned: the pool's
    # threads share the node's one core.
    pin_to_core(rank)
    run: Any = Run(config)
    run.compile()  # before the clock (PyTorch has nothing to compile)
  else:
    pin_to_core(rank)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['SPARSEJAX_COORDINATOR']}",
                            rank=rank, world_size=config.mesh.nodes)
    run = TorchRun(config, rank, config.mesh.nodes, options["powersgd"])
  return config, run, rank, rank == 0


def _barrier(run) -> None:
  if isinstance(run, Run):
    _barrier_jax("tta")
  else:
    run.dist.barrier()


def _link_bytes() -> int:
  from sparsejax import cluster
  return cluster.link_sent_bytes("eth0")


def run_worker(args) -> None:
  """One process run of one system: the train phase, then the sweep, in the same processes."""
  config, run, rank, lead = _worker_setup(args)
  row = {"system": args.system, "seed": args.seed, "total_steps": run.plan.total_steps,
         "steps_per_epoch": run.plan.steps_per_epoch,
         "curve": train_phase(config, run, args, lead)}
  if isinstance(run, Run):  # each program the run took, its compile (before the clock) timed
    row["programs"] = run.programs_run()
  auto = getattr(run, "auto", None)
  if auto is not None:  # measuring, its forms follow the link: no step time per level to sweep
    row["exchange_choices"] = auto.history
  from sparsejax.train.auto import measuring
  measuring = auto is not None and measuring(run.plan)
  row["sweep"] = [] if measuring else sweep_phase(args, run, lead, config.mesh.nodes)
  if lead:
    with open(args.worker_out, "w") as f:
      json.dump([row], f)


def train_phase(config, run, args=None, lead: bool = False) -> list[dict]:
  """The whole recipe, evaluating every `eval_every_steps` with the clock stopped; with
  `--link-change RATE@FRACTION` the link changes (lead process, between two barriers, the
  clock stopped) before the step at that fraction of the recipe; with `--stop-at-target` the
  run ends at the first evaluation that reaches the target."""
  from sparsejax.train.config import target_reached
  total = run.plan.total_steps
  every = config.eval_every_steps or total
  stage_ends = set(run.plan.stage_ends)
  change = json.loads(args.link_change) if args and args.link_change else None
  curve, train_s = [], 0.0
  aside = getattr(run, "aside", contextlib.nullcontext)  # what auto leaves out of its steps
  _barrier(run)
  sent0 = _link_bytes()
  seg = time.perf_counter()
  for step in range(total):
    if change is not None and step == change["step"]:
      with aside():
        run.wait()
        train_s += time.perf_counter() - seg
        _set_link(run, args, lead, change["bps"], config.mesh.nodes)
      seg = time.perf_counter()
    run.step(step)
    done = step + 1
    if done % every == 0 or done == total or done in stage_ends:
      with aside():  # (off auto's clock too)
        run.wait()
        train_s += time.perf_counter() - seg
        sent = _link_bytes() - sent0
        metrics = run.evaluate()
        curve.append({"step": done, "train_time_s": train_s, "node0_link_bytes": sent,
                      **{k: metrics[k] for k in ("accuracy", "loss") if k in metrics}})
        _barrier(run)
      if (args is not None and args.stop_at_target and target_reached(
          config.target_metric, metrics[config.target_metric], config.target_value)):
        break
      seg = time.perf_counter()
  return curve


def _set_link(run, args, lead: bool, bps: int | None, nodes: int) -> None:
  """The lead sets the link rate of all `nodes` nodes while the others wait (a barrier either
  side)."""
  from sparsejax import cluster
  _barrier(run)
  if lead:
    cluster.set_link_rate(args.cluster_prefix, nodes, bps)
  _barrier(run)


def sweep_phase(args, run, lead: bool, nodes: int) -> list[dict]:
  """Step times at every bandwidth (rank 0 changes the link between phases, the others wait at
  a barrier) and at every density level; the link is set back to the headline rate after."""
  bandwidths = json.loads(args.bandwidths) + [["headline", json.loads(args.headline)]]
  levels = json.loads(args.levels)  # [[density, a step that runs at it(, image size)], ...]
  rows = []
  for name, bps in bandwidths:
    _set_link(run, args, lead, bps, nodes)
    if name == "headline":
      break
    for density, at_step, *size in levels:
      if isinstance(run, Run):
        run.set_step(at_step)
      times, sent0 = [], _link_bytes()
      for i in range(args.warmup + args.reps):
        if i == args.warmup:
          sent0 = _link_bytes()
        t0 = time.perf_counter()
        run.step_at(at_step + i, at_step)  # the level stays the one being timed
        run.wait()
        if i >= args.warmup:
          times.append(time.perf_counter() - t0)
      rows.append({"system": args.system, "seed": args.seed, "bandwidth": name, "rate_bps": bps,
                   "density": density, **({"size": size[0]} if size else {}),
                   "step_s": statistics.median(times),
                   "node0_link_bytes_per_step": (_link_bytes() - sent0) / args.reps})
      if getattr(run, "pipeline", None) is not None:  # the pipelined step's halves, timeline
        rows[-1].update(pipeline_phases(run, at_step + args.warmup + args.reps, at_step,
                                        args.reps))
  return rows


def pipeline_phases(run, step: int, level_step: int, reps: int) -> dict[str, float]:
  """The pipelined step's halves at the level of `level_step`, each alone (the gradient, then
  the exchange and update: medians of `reps`, seconds), and a timeline of `reps` steady steps
  with both dispatched together: when each half ends, seen by a thread waiting on it (medians,
  seconds from the dispatch). `run`: a `sparsejax.train.Run` with a pipeline."""
  import threading

  import jax
  pipe, level = run.pipeline, run.plan.level(min(level_step, run.plan.total_steps - 1))
  alone: dict[str, list[float]] = {"compute_s": [], "exchange_s": []}
  ends: dict[str, list[float]] = {"compute_end_s": [], "exchange_end_s": []}
  for i in range(reps):
    batch = run.batch(step + i)
    t0 = time.perf_counter()
    pending = jax.block_until_ready(pipe.gradient(run.state, batch))
    alone["compute_s"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    run.state = jax.block_until_ready(pipe.apply(run.state, level)[0])._replace(pending=pending)
    alone["exchange_s"].append(time.perf_counter() - t0)
  for i in range(reps):
    batch = run.batch(step + reps + i)
    t0 = time.perf_counter()
    pending = pipe.gradient(run.state, batch)
    state, _ = pipe.apply(run.state, level)
    waiters = [threading.Thread(target=lambda k=k, x=x, t0=t0: (
        jax.block_until_ready(x), ends[k].append(time.perf_counter() - t0)))
        for k, x in (("compute_end_s", pending), ("exchange_end_s", state))]
    for w in waiters:
      w.start()
    for w in waiters:
      w.join()
    run.state = state._replace(pending=pending)
  return {k: statistics.median(v) for k, v in {**alone, **ends}.items()}


def parity_worker(args) -> None:
  """Compute only: the node's share of the batch, no communication, pinned to its core as the
  cluster's workers are (JAX after XLA starts; round-robin where the nodes outnumber the
  cores), while the other nodes' processes do the same (a start barrier in `--parity-dir`): the
  machine loaded as in the runs."""
  node = args.parity_node
  sets = json.loads(args.sets)
  base = load_task(args.config, sets)
  nodes, cores = base.mesh.nodes, len(os.sched_getaffinity(0))  # (the cores before pinning)
  per_process = [f"batch_size={base.batch_size // nodes}", "mesh.nodes=1",
                 f"mesh.local={base.mesh.local}", "compression.algorithm=dense"]
  config = load_task(args.config, sets + per_process)  # (mesh.num_devices: mesh.local)
  if args.system == "jax":
    import jax
    jax.config.update("jax_num_cpu_devices", config.mesh.local)
    jax.devices()
    pin_to_core(node)
    run: Any = Run(config)
    run.compile()
    sizes = [run.plan.image_size(s) for s in range(run.plan.total_steps)]
  else:
    pin_to_core(node)
    run = TorchRun(config, 0, 1, False, distributed=False)
    sizes = run.sizes
  # each image size of the recipe (progressive resizing) from its first step: the step's
  # median there, and over the recipe the mean weighted by the steps each size trains
  starts = {size: sizes.index(size) for size in dict.fromkeys(sizes)}
  by_size = {}
  for n, (size, start) in enumerate(starts.items()):
    for i in range(start, start + PARITY_WARMUP):
      run.step(i)
      run.wait()
    # every node starts each size's timed steps together (the machine loaded as in the runs)
    _file_barrier(os.path.join(args.parity_dir, f"size{n}"), node, nodes)
    times = []
    for i in range(start + PARITY_WARMUP, start + PARITY_WARMUP + max(args.reps, PARITY_REPS)):
      t0 = time.perf_counter()
      run.step(i)
      run.wait()
      times.append(time.perf_counter() - t0)
    by_size[size] = statistics.median(times)
  step_s = sum(by_size[size] for size in sizes) / len(sizes)
  with open(args.worker_out, "w") as f:
    json.dump({"runtime": args.system, "node": node, "step_s": step_s,
               **({"step_s_by_size": {str(k): v for k, v in by_size.items()}}
                  if len(by_size) > 1 else {}),
               "batch_per_process": config.batch_size,
               "layout": parity_layout(args.system, nodes, cores, config.mesh.local)}, f)


def parity_layout(runtime: str, nodes: int, cores: int, local: int) -> str:
  """The parity phase's layout in words: "8 processes at once, 4 pinned to each of 2 cores, 1
  CPU devices each" (PyTorch: "1 thread each")."""
  each = f"{local} CPU devices each" if runtime == "jax" else "1 thread each"
  return f"{nodes} processes at once, {pinning(nodes, cores)}, {each}"


def _file_barrier(directory: str, index: int, count: int, timeout_s: float = 600) -> None:
  """Waits until `count` processes have each created their file in `directory`."""
  os.makedirs(directory, exist_ok=True)
  open(os.path.join(directory, f"ready{index}"), "w").close()
  deadline = time.monotonic() + timeout_s
  while sum(n.startswith("ready") for n in os.listdir(directory)) < count:
    if time.monotonic() > deadline:
      raise RuntimeError(f"parity barrier: fewer than {count} processes ready in {timeout_s} s")
    time.sleep(0.01)


# ----------------------------------------------------------------------------- driver

def _launch(c, mode: str, system: str, args, extra: list[str], log) -> list[dict]:
  argv = ["--system", system, "--config", args.config, "--sets", json.dumps(args.sets),
          *extra]
  runtime = system_spec(system)[0]
  task = load_task(args.config, args.sets, system)
  # a pipelined exchange on two devices per worker ("device") needs twice the devices
  local = task.mesh.local * (2 if task.overlap.pipeline == "device" else 1)
  with exclusive(args.lock):
    return launch_workers(c, MODULE, argv, mode=mode, procs_per_node=1,
                          devices_per_proc=local if runtime == "jax" else 1, log=log,
                          what=f"{mode} {system}", torch=runtime == "torch")


class RunTimeout(Exception):
  """A process run outlived --run-timeout."""


def _alarm(signum, frame):
  raise RunTimeout


def _run_with_retry(c, system: str, seed: int, args, extra: list[str], log,
                    headline_bps: int | None) -> dict | None:
  """One process run (train + sweep) of `system`, at most `--run-timeout` s; a crashed or hung
  run is run once more (and marked), a second failure is recorded by the caller, not raised."""
  for attempt in range(2):
    c.set_rate(headline_bps)  # whatever a failed sweep left behind
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(args.run_timeout)
    try:
      row = _launch(c, "run", system, args, extra, log)[0]
      if attempt:
        row["retried"] = True
      return row
    except (RuntimeError, RunTimeout) as e:
      why = "timed out" if isinstance(e, RunTimeout) else f"failed ({e})"
      print(f"{system} seed {seed} {why}" + ("; running it again" if not attempt else ""),
            flush=True)
    finally:
      signal.alarm(0)
      signal.signal(signal.SIGALRM, old)
  return None


def run_parity(args, log, nodes: int) -> list[dict]:
  """Alternated JAX / PyTorch compute-only rounds, each round one process per node (`nodes`) at
  once; a runtime's step: the median of its nodes' medians; a ratio per round."""
  import tempfile
  rounds = []
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  for r in range(args.parity_runs):
    row = {"round": r}
    for runtime in ("jax", "torch"):
      with tempfile.TemporaryDirectory() as d, exclusive(args.lock):
        procs = [subprocess.Popen(
            [sys.executable, "-m", MODULE, "--mode", "parity", "--system", runtime,
             "--config", args.config, "--sets", json.dumps(args.sets),
             "--worker-out", os.path.join(d, f"node{node}.json"), "--parity-dir", d,
             "--parity-node", str(node), "--reps", str(args.reps)],
            env=env, stdout=log, stderr=subprocess.STDOUT) for node in range(nodes)]
        codes = wait_all(procs, 1200)
        if any(codes):
          raise RuntimeError(f"parity round {r}: {runtime} processes exited {codes}")
        got = []
        for node in range(nodes):
          with open(os.path.join(d, f"node{node}.json")) as g:
            got.append(json.load(g))
      row[runtime] = {**got[0], "step_s": statistics.median(n["step_s"] for n in got),
                      "nodes_step_s": [n["step_s"] for n in got]}
    row["jax_over_torch"] = row["jax"]["step_s"] / row["torch"]["step_s"]
    print(f"parity round {r}: jax {row['jax']['step_s'] * 1e3:.1f} ms, torch "
          f"{row['torch']['step_s'] * 1e3:.1f} ms, ratio {row['jax_over_torch']:.2f}", flush=True)
    rounds.append(row)
  return rounds


# ----------------------------------------------------------------------------- main

SAME_TASK = ("task", "target", "target_metric", "config", "sets", "nodes", "local", "batch_size",
             "total_steps")


def merge_results(parts: list[dict], names: list[str]) -> dict:
  """One results dict from the results of several study commands on the same task: the first's
  meta (its bandwidths and headline), every file's systems, runs, sweeps and parity rounds, and
  each command in the footer. A ValueError names a file whose task differs (a `SAME_TASK` key),
  whose runs were trained at another headline link (or stopped at the target where the first's
  were not), or whose system is already in an earlier file."""
  merged = {k: v for k, v in parts[0].items() if k not in ("analysis", "exchange_over_compute")}
  merged["meta"] = dict(parts[0]["meta"])
  for part, name in zip(parts[1:], names[1:]):
    for key in SAME_TASK:
      if part["meta"].get(key) != merged["meta"].get(key):
        raise ValueError(f"{name} is another task: its meta {key} is "
                         f"{part['meta'].get(key)!r}, {names[0]}'s {merged['meta'].get(key)!r}")
    if part.get("train"):  # runs trained at another link, or stopped at the target
      for key in ("headline", "link_change", "stop_at_target"):
        if part["meta"].get(key) != merged["meta"].get(key):
          raise ValueError(f"{name}'s runs were trained otherwise: its meta {key} is "
                           f"{part['meta'].get(key)!r}, {names[0]}'s "
                           f"{merged['meta'].get(key)!r}")
    twice = set(part.get("systems", [])) & set(merged.get("systems", []))
    if twice and part.get("train"):
      raise ValueError(f"{name} runs systems already in an earlier file: {sorted(twice)}")
    merged["systems"] = merged.get("systems", []) + [
        s for s in part.get("systems", []) if s not in merged.get("systems", [])]
    for key in ("train", "sweep", "parity"):
      if part.get(key):
        merged[key] = merged.get(key, []) + part[key]
    merged["meta"]["command"] += f"`, then `{part['meta']['command']}"
  return merged


def at_target(results: dict, target: float, command: str) -> dict:
  """`results` to be analysed at `target`: each run's steps per density level up to its first
  evaluation that reaches it (`levels_to`, from the run's config). A ValueError where the runs
  stopped at their own target (their curves end there)."""
  meta = results["meta"]
  if meta.get("stop_at_target"):
    raise ValueError(f"--target {target}: the runs stopped at their target ({meta['target']}); "
                     "only runs trained to the end can be analysed at another")
  train = []
  for row in results.get("train", []):
    row = {k: v for k, v in row.items() if k != "levels_to_target"}
    hit = steps_to_target(row["curve"], target, meta["target_metric"])
    if hit:
      cfg = load_task(meta["config"], meta["sets"], row["system"], row["seed"])
      row["levels_to_target"] = levels_to(cfg, row["steps_per_epoch"], row["total_steps"],
                                          hit["step"])
    train.append(row)
  return {**results, "train": train,
          "meta": {**meta, "target": target, "command": f"{meta['command']}`, then `{command}"}}


def check_system_mesh(system: str, task, nodes: int) -> None:
  """Raises ValueError where `system`'s config (`task`) cannot run on the task's `nodes` nodes:
  its own overrides change mesh.nodes, or its mesh or batch fails `check_mesh`."""
  if task.mesh.nodes != nodes:
    raise ValueError(f"system {system!r} sets mesh.nodes = {task.mesh.nodes}: every system runs "
                     f"on the task's {nodes} nodes")
  try:
    check_mesh(task)
  except ValueError as e:
    raise ValueError(f"system {system!r}: {e}") from None


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tta_fmnist_mlp.py"))
  ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
  ap.add_argument("--systems", help=f"default: all ({','.join(SYSTEMS)}); --quick: "
                  "dense,hitopk-0.01,torch-ddp")
  ap.add_argument("--bandwidths", default=DEFAULT_BANDWIDTHS)
  ap.add_argument("--headline", default="1gbit", help="the link's bandwidth while training")
  ap.add_argument("--seeds", type=int, default=3, help="each seed is one process run per system")
  ap.add_argument("--parity-runs", type=int, default=3)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--phases", default="parity,runs")
  ap.add_argument("--link-change", metavar="RATE@FRACTION",
                  help="a changing link: the headline rate, then RATE from that fraction of the "
                  "recipe's steps on (e.g. 100mbit@0.33); the runs are timed end to end, no sweep")
  ap.add_argument("--stop-at-target", action="store_true",
                  help="end each run at its first evaluation that reaches the target (time to "
                  "target only; no final accuracy)")
  ap.add_argument("--run-timeout", type=int, default=900,
                  help="seconds one process run (train + sweep) may take")
  ap.add_argument("--lock", help="a file to flock around each process run (benchmarks that "
                  "share the machine and the file take turns)")
  ap.add_argument("--quick", action="store_true",
                  help="CI smoke run: small MLP on digits, 36 steps, dense/hitopk-0.01/torch-ddp, "
                  "1 seed")
  ap.add_argument("--out", type=json_path,
                  default=os.path.join(HERE, "results", "time_to_accuracy.json"))
  ap.add_argument("--from-results", metavar="JSON", action="append",
                  help="no runs: analyse a results file again, writing --out's table and plot; "
                  "given again, the files' runs of the same task are analysed together (e.g. "
                  "a parity phase and systems run later beside the runs)")
  ap.add_argument("--target", type=float, help="with --from-results: analyse at this target "
                  "instead of the runs' own (runs trained to the end, not stopped at a target)")
  # worker-only arguments
  ap.add_argument("--mode", choices=("driver", "run", "parity"), default="driver",
                  help=argparse.SUPPRESS)
  ap.add_argument("--system", help=argparse.SUPPRESS)
  ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--sets", dest="sets_json", help=argparse.SUPPRESS)
  ap.add_argument("--levels", help=argparse.SUPPRESS)
  ap.add_argument("--cluster-prefix", help=argparse.SUPPRESS)
  ap.add_argument("--link-change-at", dest="link_change_json", help=argparse.SUPPRESS)
  ap.add_argument("--worker-out", help=argparse.SUPPRESS)
  ap.add_argument("--parity-dir", help=argparse.SUPPRESS)
  ap.add_argument("--parity-node", type=int, default=0, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)
  args.config = os.path.abspath(args.config)  # results store it relative to the checkout
  if args.mode != "driver":
    args.sets = args.sets_json
    args.link_change = args.link_change_json
    if args.mode == "run":
      run_worker(args)
    else:
      parity_worker(args)
    return 0
  return drive(ap, args)


def drive(ap, args) -> int:
  if args.from_results:
    parts = []
    for name in args.from_results:
      with open(name) as f:
        parts.append(json.load(f))
    try:
      merged = merge_results(parts, args.from_results)
      if args.target is not None:
        merged = at_target(merged, args.target, command_line(
            MODULE, sys.argv[1:]))
      report(merged, args.out)
    except ValueError as e:
      ap.error(str(e))
    return 0
  if args.target is not None:
    ap.error("--target re-analyses runs: give it with --from-results (a run's target is the "
             "config's target_value: --set target_value=...)")
  if args.quick:
    args.sets = QUICK_SETS + args.sets
    args.systems = args.systems or "dense,hitopk-0.01,torch-ddp"
    args.bandwidths, args.headline = "unlimited,200mbit", "200mbit"
    args.seeds, args.parity_runs, args.reps, args.warmup = 1, 1, 3, 1
  systems = [s.strip() for s in (args.systems or ",".join(SYSTEMS)).split(",") if s.strip()]
  for system in systems:
    try:
      system_spec(system)
    except ValueError as e:
      ap.error(str(e))
  phases = [p.strip() for p in args.phases.split(",")]
  if not set(phases) <= {"parity", "runs"}:
    ap.error(f"--phases must be a subset of parity,runs, got {args.phases!r}")
  torch_needed = [s for s in systems if system_spec(s)[0] == "torch"] + (
      ["the parity phase"] if "parity" in phases else [])
  if torch_needed and importlib.util.find_spec("torch") is None:
    ap.error(f"{', '.join(torch_needed)} need PyTorch, which is not installed: {PEERS_INSTALL} "
             f"(or --phases runs --systems with sparsejax systems only)")
  for name in ("seeds", "parity_runs", "reps"):
    if getattr(args, name) < 1:
      ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  try:
    bandwidths = parse_bandwidths(args.bandwidths)
    headline = parse_bandwidths(args.headline)[0]
    config = load_task(args.config, args.sets)
    change = parse_link_change(args.link_change) if args.link_change else None
    check_mesh(config)
    for system in systems:  # (a system's +key=value overrides may change the mesh or batch)
      check_system_mesh(system, load_task(args.config, args.sets, system), config.mesh.nodes)
  except ValueError as e:
    ap.error(str(e))
  nodes = config.mesh.nodes
  if config.target_metric not in ("accuracy", "loss"):
    ap.error(f"the config must set target_metric = 'accuracy' or 'loss' (and target_value), "
             f"got {config.target_metric!r}")
  from sparsejax import cluster
  from sparsejax import data as data_lib
  from sparsejax.train import make_plan
  inputs = data_lib.open_inputs(config)
  steps_per_epoch = inputs.steps_per_epoch
  total = make_plan(config, steps_per_epoch).total_steps
  results: dict[str, Any] = {"systems": systems, "meta": {
      "task": f"{config.model.name} on {config.data.name}", "target": config.target_value,
      "target_metric": config.target_metric,
      "config": portable_path(args.config), "sets": args.sets, "bandwidths": args.bandwidths,
      "headline": args.headline, "link_change": args.link_change,
      "stop_at_target": args.stop_at_target,
      "machine": platform.machine(), "cpus": os.cpu_count(),
      "date": time.strftime("%Y-%m-%d"), "nodes": nodes, "local": config.mesh.local,
      "batch_size": config.batch_size, "total_steps": total,
      "parameters": model_size(config, inputs),
      "command": command_line(MODULE, args.argv)}}
  sizes = size_per_step(config, steps_per_epoch, total)
  if any(sizes):  # progressive resizing: the recipe's steps at each size (weights the sweep)
    results["meta"]["size_steps"] = {str(s): sizes.count(s) for s in dict.fromkeys(sizes)}
  log = sys.stdout
  partial = os.path.splitext(args.out)[0] + ".partial.json"  # every finished run, as it ends
  if "parity" in phases:
    results["parity"] = run_parity(args, log, nodes)
  if "runs" in phases:
    results["train"], results["sweep"] = [], []
    # its own prefix family, so tests of other clusters running beside it never see it
    with cluster.EmulatedCluster(nodes, headline[1], prefix=f"tta{uuid.uuid4().hex[:6]}") as c:
      for seed in range(args.seeds):
        turn = seed % len(systems)  # (the systems' order rotates between seeds: the machine's
        for system in systems[turn:] + systems[:turn]:  # drift falls on each in turn)
          cfg = load_task(args.config, args.sets, system, seed)
          extra = ["--seed", str(seed), "--bandwidths",
                   json.dumps([] if change else bandwidths), "--headline",
                   json.dumps(headline[1]), "--levels",
                   json.dumps(level_steps(cfg, steps_per_epoch, total)), "--cluster-prefix",
                   c.prefix, "--warmup", str(args.warmup), "--reps", str(args.reps)]
          if change:
            extra += ["--link-change-at", json.dumps(
                {"step": round(change[1] * total), "bps": change[0][1]})]
          if args.stop_at_target:
            extra.append("--stop-at-target")
          row = _run_with_retry(c, system, seed, args, extra, log, headline[1])
          if row is None:
            results.setdefault("failed", []).append({"system": system, "seed": seed})
            continue
          results["sweep"] += row.pop("sweep")
          hit = steps_to_target(row["curve"], config.target_value, config.target_metric)
          if hit:
            row["levels_to_target"] = levels_to(cfg, steps_per_epoch, total, hit["step"])
          results["train"].append(row)
          print(json.dumps({"system": system, "seed": seed, "reached": hit}), flush=True)
          write_results(partial, results, "partial: not analysed yet")
  report(results, args.out)
  for leftover in (partial, os.path.splitext(partial)[0] + ".md"):
    with contextlib.suppress(FileNotFoundError):
      os.remove(leftover)
  return 0


if __name__ == "__main__":
  sys.exit(main())
