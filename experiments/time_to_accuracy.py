"""Time to accuracy on an emulated, link-bound cloud cluster: sparsejax's exchanges and PyTorch DDP
train the same model on the same data with the same recipe to the same target test accuracy.

  python experiments/time_to_accuracy.py [--config configs/tta_fmnist_mlp.py] [--set key=value ...]
      [--systems dense,hierarchical,allgather-0.01,...] [--bandwidths unlimited,2gbit,...]
      [--headline 1gbit] [--seeds 3] [--phases parity,runs] [--quick]
      [--out experiments/results/time_to_accuracy.json]

The task is a `sparsejax train` config (model, data.name, data.path, recipe, target_metric:
accuracy, or loss reached at or below, and target_value, eval_every_steps) with the same `--set`
keys; each system only changes `compression.*` (a system name may add its own overrides:
"hitopk-0.01+compression.balance=tensor"). Tasks: configs/tta_fmnist_mlp.py (an MLP, SGD) and
configs/tta_kjv_lm.py (a Transformer LM, AdamW). The runners are modules of their own:
sparsejax's (experiments/jax_runner.py) runs the trainer's compiled steps; the PyTorch peer
(experiments/torch_peer.py) builds the same model (`mlp` or `transformer_lm`, the same
initialisation), reads the same batches of the same data (sparsejax's inputs for each step), and
uses the same learning-rate schedule, optimizer and weight decay (kernels only).

The cluster (link-bound by design): 2 nodes (`EmulatedCluster`, a network namespace each, tc tbf
on both ends of each node's link), one process per node pinned to its own core (this machine has
2: no more busy processes than cores), each sparsejax process with `mesh.local` CPU devices (the
fast intra-node axis stays inside the process), each PyTorch process one thread with the node's
share of the batch. Phases:

  parity  compute only, one process on one core, no cluster: the sparsejax trainer's step on a
          (1, local) mesh vs PyTorch's step, same model and per-process batch; alternated
          process runs, the ratio per round.
  runs    one process run per system and seed, in two parts:
          train: the whole recipe on the cluster at `--headline` bandwidth, evaluating every
          `eval_every_steps` with the clock stopped (state synchronised first): steps and train
          time to the target, final accuracy, bytes that crossed node 0's link (its interface
          counter);
          sweep: then, in the same processes, the step time at every `--bandwidths` value (rank 0
          changes the link's limit in place, both processes waiting at a barrier) and, for the
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
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if not __package__:  # run as `python experiments/time_to_accuracy.py`: import from this checkout
  sys.path.insert(0, ROOT)

from experiments.bench_comm import launch_workers  # noqa: E402
from experiments.jax_runner import JaxRun  # noqa: E402 (sparsejax's runner)
from experiments.results_io import command_line, footer, portable_path, write_results  # noqa: E402
from experiments.torch_peer import TorchRun, torch_mlp  # noqa: E402, F401 (the peer's runner)

NODES = 2
# system -> (runtime, config overrides / options). Each sparse system keeps the config's DGC
# density warm-up and error feedback.
SYSTEMS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("jax", {"compression.algorithm": "dense"}),
    "hierarchical": ("jax", {"compression.algorithm": "hierarchical"}),
    "allgather-0.01": ("jax", {"compression.algorithm": "allgather", "compression.density": 0.01}),
    "allgather-0.001": ("jax", {"compression.algorithm": "allgather",
                                "compression.density": 0.001}),
    "hitopk-0.01": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.01}),
    "hitopk-0.001": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.001}),
    "hitopk-0.05": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.05}),
    # a longer density warm-up (half the Transformer's recipe; from 0.2, a level of 0.05's, so
    # no step runs at the 0.8 level that 0.25 rounds up to)
    "hitopk-0.05-w0.5": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.05,
                                 "compression.warmup_epochs": 0.5,
                                 "compression.warmup_density": 0.2}),
    # AdamW's momentum correction: each worker's Adam moments before selection (Adam directions
    # are the candidates), AdamW's decay and learning rate after the exchange
    "hitopk-0.01-ac": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.01,
                               "compression.momentum_correction": True}),
    # with DGC's momentum correction (the velocity accumulated before selection; without
    # masking, sent plus kept is exactly momentum SGD's update): the optimizer runs without
    # momentum of its own
    "hitopk-0.01-mc": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.01,
                               "compression.momentum_correction": True,
                               "compression.momentum_masking": False}),
    "hitopk-0.001-mc": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.001,
                                "compression.momentum_correction": True,
                                "compression.momentum_masking": False}),
    # HiTopKComm with gTop-k between the nodes (experiments/bench_scale.py): k global positions
    # a step, their exact sums, instead of every node's k pairs
    "higtopk-0.01-mc": ("jax", {"compression.algorithm": "higtopk", "compression.density": 0.01,
                                "compression.momentum_correction": True,
                                "compression.momentum_masking": False}),
    "higtopk-0.001-mc": ("jax", {"compression.algorithm": "higtopk",
                                 "compression.density": 0.001,
                                 "compression.momentum_correction": True,
                                 "compression.momentum_masking": False}),
    # a diagnostic: gTop-k keeping as many positions as HiTopKComm 0.01 can send on 2 nodes
    "higtopk-0.02-mc": ("jax", {"compression.algorithm": "higtopk", "compression.density": 0.02,
                                "compression.momentum_correction": True,
                                "compression.momentum_masking": False}),
    # compression.algorithm=auto (sparsejax.train.auto): the form chosen by measurement, every
    # 10 steps, between dense and the sparse system named (its steps to target over dense's as
    # the studies measured them: docs/auto.md)
    "auto-0.01-mc": ("jax", {"compression.algorithm": "auto", "compression.density": 0.01,
                             "compression.momentum_correction": True,
                             "compression.momentum_masking": False,
                             "compression.auto_step_factor": 0.83,
                             "compression.auto_every_steps": 10}),
    "auto-0.05": ("jax", {"compression.algorithm": "auto", "compression.density": 0.05,
                          "compression.auto_step_factor": 1.22,
                          "compression.auto_every_steps": 10}),
    # a dense finish: HiTopKComm (its density warm-up kept) to the step named, then its dense
    # form (every candidate all-reduced, the residual emptied) to the end of the recipe
    **{f"hitopk-{d}{w}-d{at}": ("jax", {
        "compression.algorithm": "auto", "compression.density": d,
        "compression.auto_schedule": ((0, "sparse"), (at, "dense")),
        **({"compression.warmup_epochs": 0.5, "compression.warmup_density": 0.2} if w else {})})
       for d, w, at in [(0.05, "-w0.5", 300), (0.05, "-w0.5", 375), (0.1, "-w0.5", 375),
                        (0.05, "", 300)]},
    # a dense start: the dense form to the step named, then HiTopKComm (no density warm-up)
    **{f"hitopk-{d}-s{at}": ("jax", {
        "compression.algorithm": "auto", "compression.density": d,
        "compression.warmup_epochs": 0.0,
        "compression.auto_schedule": ((0, "dense"), (at, "sparse"))})
       for d, at in [(0.05, 60), (0.05, 114), (0.1, 60), (0.05, 57), (0.1, 57)]},
    # 1-bit Adam's recipe (Tang et al., 2021) on HiTopKComm: dense for the first eighth of the
    # recipe (57 steps of the Transformer's 457), AdamW's second moment frozen from there, then
    # HiTopKComm with error feedback (with the variance frozen Adam is linear in the gradients,
    # so a delayed gradient moves the parameters as far as the gradients it holds)
    "hitopk-0.05-1bit": ("jax", {
        "compression.algorithm": "auto", "compression.density": 0.05,
        "compression.warmup_epochs": 0.0, "optimizer.freeze_variance_epochs": 0.125,
        "compression.auto_schedule": ((0, "dense"), (57, "sparse"))}),
    "hitopk-0.05-1bit-w0.5": ("jax", {
        "compression.algorithm": "auto", "compression.density": 0.05,
        "compression.warmup_epochs": 0.5, "compression.warmup_density": 0.2,
        "optimizer.freeze_variance_epochs": 0.125,
        "compression.auto_schedule": ((0, "dense"), (57, "sparse"))}),
    "hitopk-0.1-1bit": ("jax", {
        "compression.algorithm": "auto", "compression.density": 0.1,
        "compression.warmup_epochs": 0.0, "optimizer.freeze_variance_epochs": 0.125,
        "compression.auto_schedule": ((0, "dense"), (57, "sparse"))}),
    "dense-fv": ("jax", {"compression.algorithm": "dense",
                         "optimizer.freeze_variance_epochs": 0.125}),
    # the one-step pipelined exchange (sparsejax.train.pipelined) on two devices per worker:
    # each gradient computed while the previous one is exchanged and applied
    "dense-pipe": ("jax", {"compression.algorithm": "dense", "compression.pipeline": "device"}),
    "dense-pipe-f0.25": ("jax", {"compression.algorithm": "dense", "compression.pipeline": "device",
                                 "compression.pipeline_from_epochs": 0.25}),
    "hitopk-0.05-w0.5-pipe": ("jax", {"compression.algorithm": "hitopk",
                                      "compression.density": 0.05,
                                      "compression.warmup_epochs": 0.5,
                                      "compression.warmup_density": 0.2,
                                      "compression.pipeline": "device"}),
    "hitopk-0.01-mc-pipe": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.01,
                                    "compression.momentum_correction": True,
                                    "compression.momentum_masking": False,
                                    "compression.pipeline": "device"}),
    "torch-ddp": ("torch", {"powersgd": False}),
    "torch-powersgd": ("torch", {"powersgd": True}),
}
DEFAULT_BANDWIDTHS = "unlimited,5gbit,2gbit,1gbit,500mbit,200mbit"
# --quick: the same code paths on scikit-learn's digits (no download, no system package), 36 steps
QUICK_SETS = ["data.name=digits", "model.hidden=(256,)", "batch_size=64", "num_epochs=1.6",
              "eval_every_steps=12", "target_value=0.5", "optimizer.warmup_epochs=0.0",
              "compression.warmup_epochs=0.4"]
PEERS_INSTALL = "pip install -e '.[peers]' torch==2.13.0"


# ----------------------------------------------------------------------------- shared set-up

def system_spec(name: str) -> tuple[str, dict[str, Any]]:
  """(runtime, options) of a system: a name of SYSTEMS, optionally followed by `+key=value`
  config overrides of its own (a variant: "hitopk-0.01+compression.balance=tensor")."""
  base, *extra = name.split("+")
  if base not in SYSTEMS:
    raise ValueError(f"unknown system {base!r}; allowed: {', '.join(SYSTEMS)} (each optionally "
                     "followed by +key=value overrides)")
  runtime, options = SYSTEMS[base]
  bad = [e for e in extra if "=" not in e]
  if bad or (extra and runtime != "jax"):
    raise ValueError(f"system {name!r}: overrides are +key=value, for sparsejax systems only")
  return runtime, {**options, **dict(e.split("=", 1) for e in extra)}


def load_task(config_path: str, sets: list[str], system: str | None = None,
              seed: int | None = None):
  """The validated config of the task (`--config` + `--set`), with `system`'s overrides."""
  from sparsejax.train import config as config_lib
  overrides = list(sets)
  if system is not None and system_spec(system)[0] == "jax":
    overrides += [f"{k}={v}" for k, v in system_spec(system)[1].items()]
  elif system is not None:  # the PyTorch peer's all-reduce is dense
    overrides.append("compression.algorithm=dense")
  if seed is not None:
    overrides.append(f"seed={seed}")
  tree = config_lib.apply_overrides(config_lib.load_config(config_path), overrides)
  return config_lib.validate(tree)


def model_size(config, inputs=None) -> int:
  """The number of parameters of the task's model (`inputs`: its opened data, else opened)."""
  import jax

  from sparsejax import data as data_lib
  from sparsejax.train.state import build_model
  inputs = inputs or data_lib.open_inputs(config)
  model = build_model(config, inputs.num_classes)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), inputs.example(None),
                                             train=False))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"]))


def density_per_step(config, steps_per_epoch: int, total: int) -> np.ndarray:
  """The density level each step runs at (1.0 for the dense exchanges and for PyTorch)."""
  from sparsejax import comm
  from sparsejax.compress import density_levels, level_index
  from sparsejax.train import schedules
  from sparsejax.train.auto import scheduled
  c = config.compression
  fixed_auto = c.algorithm == "auto" and c.auto_schedule  # the forms fixed by step
  if c.algorithm not in comm.SPARSE_ALGORITHMS and not fixed_auto:
    return np.ones(total)
  schedule = schedules.density(c, steps_per_epoch)
  if schedule is None:
    dens = np.full(total, c.density)
  else:
    levels = density_levels(c.density)  # rounded up as the trainer does (compress.level_index)
    dens = np.asarray([levels[level_index(levels, float(schedule(s)))] for s in range(total)])
  if fixed_auto:  # the dense form's steps send everything
    dens = np.where([scheduled(c.auto_schedule, s) == "dense" for s in range(total)], 1.0, dens)
  return dens


def pin_to_core(index: int) -> None:
  """Keeps this process (and the threads it starts) on one core."""
  cores = sorted(os.sched_getaffinity(0))
  os.sched_setaffinity(0, {cores[index % len(cores)]})


def _barrier_jax(name: str) -> None:
  from jax.experimental import multihost_utils
  multihost_utils.sync_global_devices(name)


# ----------------------------------------------------------------------------- workers

def _worker_setup(args):
  """(config, run, rank, is_lead) in a cluster worker, pinned to its node's core."""
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
    # the other (the gloo collective blocks its thread). Unpipelined steps time the same
    # either way (dense at 200 Mbit/s: 282 vs 284 ms, docs/overlap.md).
    pin_to_core(rank)
    run: Any = JaxRun(config, (config.mesh.nodes, config.mesh.local))
  else:
    pin_to_core(rank)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['SPARSEJAX_COORDINATOR']}",
                            rank=rank, world_size=NODES)
    run = TorchRun(config, rank, NODES, options["powersgd"])
  return config, run, rank, rank == 0


def _barrier(run) -> None:
  if isinstance(run, JaxRun):
    _barrier_jax("tta")
  else:
    run.dist.barrier()


def _link_bytes() -> int:
  from sparsejax import cluster
  return cluster.link_sent_bytes("eth0")


def run_worker(args) -> None:
  """One process run of one system: the train phase, then the sweep, in the same processes."""
  config, run, rank, lead = _worker_setup(args)
  row = {"system": args.system, "seed": args.seed, "total_steps": run.total,
         "steps_per_epoch": run.data.steps_per_epoch,
         "curve": train_phase(config, run, args, lead)}
  auto = getattr(run, "auto", None)
  if auto is not None:  # measuring, its forms follow the link: no step time per level to sweep
    row["exchange_choices"] = auto.history
  measuring = auto is not None and not config.compression.auto_schedule
  row["sweep"] = [] if measuring else sweep_phase(args, run, lead)
  if lead:
    with open(args.worker_out, "w") as f:
      json.dump([row], f)


def train_phase(config, run, args=None, lead: bool = False) -> list[dict]:
  """The whole recipe, evaluating every `eval_every_steps` with the clock stopped; with
  `--link-change RATE@FRACTION` the link changes (lead process, between two barriers, the
  clock stopped) before the step at that fraction of the recipe; with `--stop-at-target` the
  run ends at the first evaluation that reaches the target."""
  from sparsejax.train.config import target_reached
  every = config.eval_every_steps or run.total
  change = json.loads(args.link_change) if args and args.link_change else None
  curve, train_s = [], 0.0
  _barrier(run)
  sent0 = _link_bytes()
  seg = time.perf_counter()
  for step in range(run.total):
    if change is not None and step == change["step"]:
      run.wait()
      train_s += time.perf_counter() - seg
      _set_link(run, args, lead, change["bps"])
      seg = time.perf_counter()
    run.step(step)
    done = step + 1
    if done % every == 0 or done == run.total:
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


def _set_link(run, args, lead: bool, bps: int | None) -> None:
  """The lead sets both nodes' link rate while the others wait (a barrier either side)."""
  from sparsejax import cluster
  _barrier(run)
  if lead:
    cluster.set_link_rate(args.cluster_prefix, NODES, bps)
  _barrier(run)


def sweep_phase(args, run, lead: bool) -> list[dict]:
  """Step times at every bandwidth (rank 0 changes the link between phases, the others wait at
  a barrier) and at every density level; the link is set back to the headline rate after."""
  bandwidths = json.loads(args.bandwidths) + [["headline", json.loads(args.headline)]]
  levels = json.loads(args.levels)  # [[density, a step that runs at it], ...]
  rows = []
  for name, bps in bandwidths:
    _set_link(run, args, lead, bps)
    if name == "headline":
      break
    for density, at_step in levels:
      if isinstance(run, JaxRun):
        run.set_step(at_step)
      times, sent0 = [], _link_bytes()
      for i in range(args.warmup + args.reps):
        if i == args.warmup:
          sent0 = _link_bytes()
        t0 = time.perf_counter()
        run.step(at_step + i, level_step=at_step)  # the level stays the one being timed
        run.wait()
        if i >= args.warmup:
          times.append(time.perf_counter() - t0)
      rows.append({"system": args.system, "seed": args.seed, "bandwidth": name, "rate_bps": bps,
                   "density": density, "step_s": statistics.median(times),
                   "node0_link_bytes_per_step": (_link_bytes() - sent0) / args.reps})
      if getattr(run, "pipe", None) is not None:  # the pipelined step's halves and timeline
        rows[-1].update(run.pipeline_phases(at_step + args.warmup + args.reps, at_step,
                                            args.reps))
  return rows


def parity_worker(args) -> None:
  """Compute only: one process on one core, the node's share of the batch, no communication."""
  pin_to_core(0)
  sets = json.loads(args.sets)
  base = load_task(args.config, sets)
  per_process = [f"batch_size={base.batch_size // NODES}", "mesh.nodes=1",
                 f"mesh.local={base.mesh.local}", "compression.algorithm=dense"]
  config = load_task(args.config, sets + per_process)
  if args.system == "jax":
    import jax
    jax.config.update("jax_num_cpu_devices", config.mesh.local)
    run: Any = JaxRun(config, (1, config.mesh.local))
  else:
    run = TorchRun(config, 0, 1, False, distributed=False)
  times = []
  for i in range(args.warmup + args.reps):
    t0 = time.perf_counter()
    run.step(i)
    run.wait()
    if i >= args.warmup:
      times.append(time.perf_counter() - t0)
  with open(args.worker_out, "w") as f:
    json.dump({"runtime": args.system, "step_s": statistics.median(times),
               "batch_per_process": config.batch_size,
               "layout": (f"1 process, {config.mesh.local} CPU devices" if args.system == "jax"
                          else "1 process, 1 thread")}, f)


# ----------------------------------------------------------------------------- driver

@contextlib.contextmanager
def _exclusive(path: str | None):
  """Holds an flock on `path` (if given) for one process run, so benchmarks that share a
  machine and the lock never time at the same moment."""
  if not path:
    yield
    return
  import fcntl
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _launch(c, mode: str, system: str, args, extra: list[str], log) -> list[dict]:
  argv = ["--system", system, "--config", args.config, "--sets", json.dumps(args.sets),
          *extra]
  runtime = system_spec(system)[0]
  task = load_task(args.config, args.sets, system)
  # a pipelined exchange on two devices per worker ("device") needs twice the devices
  local = task.mesh.local * (2 if task.compression.pipeline == "device" else 1)
  with _exclusive(args.lock):
    return launch_workers(c, __file__, argv, mode=mode, procs_per_node=1,
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


def run_parity(args, log) -> list[dict]:
  """Alternated JAX / PyTorch compute-only process runs; a ratio per round."""
  import tempfile
  rounds = []
  for r in range(args.parity_runs):
    row = {"round": r}
    for runtime in ("jax", "torch"):
      with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", "parity", "--system", runtime,
               "--config", args.config, "--sets", json.dumps(args.sets), "--worker-out", f.name,
               "--warmup", str(args.warmup), "--reps", str(args.reps)]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        with _exclusive(args.lock):
          subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT,
                         timeout=1200)
        with open(f.name) as g:
          row[runtime] = json.load(g)
    row["jax_over_torch"] = row["jax"]["step_s"] / row["torch"]["step_s"]
    print(f"parity round {r}: jax {row['jax']['step_s'] * 1e3:.1f} ms, torch "
          f"{row['torch']['step_s'] * 1e3:.1f} ms, ratio {row['jax_over_torch']:.2f}", flush=True)
    rounds.append(row)
  return rounds


def level_steps(config, steps_per_epoch: int, total: int) -> list[list[float]]:
  """[[density, first step at it], ...] for the levels a run passes through."""
  dens = density_per_step(config, steps_per_epoch, total)
  out = []
  for s, d in enumerate(dens):
    if not out or out[-1][0] != d:
      out.append([float(d), s])
  return out


def parse_link_change(text: str) -> tuple[tuple[str, int | None], float]:
  """`RATE@FRACTION` -> ((name, bits/s or None), fraction of the recipe's steps)."""
  rate, sep, frac = text.partition("@")
  try:
    fraction = float(frac)
  except ValueError:
    fraction = -1.0
  if not sep or not 0 < fraction < 1:
    raise ValueError(f"--link-change {text!r}: give RATE@FRACTION with 0 < FRACTION < 1 "
                     "(e.g. 100mbit@0.33)")
  return parse_bandwidths(rate)[0], fraction


def parse_bandwidths(text: str) -> list[tuple[str, int | None]]:
  from sparsejax import cluster
  out = []
  for name in text.split(","):
    name = name.strip()
    out.append((name, None if name == "unlimited" else cluster.parse_rate(name)))
  return out


# ----------------------------------------------------------------------------- analysis

def steps_to_target(curve: list[dict], target: float, metric: str = "accuracy") -> dict | None:
  """The first evaluation that reaches `target` (accuracy: at or above; loss: at or below),
  None if none does."""
  from sparsejax.train.config import target_reached
  return next((p for p in curve if target_reached(metric, p[metric], target)), None)


def target_metric(results: dict) -> str:
  """The eval metric the study's target is on (results written before it was stored: accuracy)."""
  return results["meta"].get("target_metric", "accuracy")


def analyse(results: dict, target: float) -> dict:
  """Per system: steps/time to target at the headline (measured), final accuracy, and the time
  to target at every swept bandwidth (per seed: steps per level x median step time)."""
  out: dict[str, Any] = {}
  sweep = results.get("sweep", [])
  metric = target_metric(results)
  for system in results["systems"]:
    runs = [r for r in results.get("train", []) if r["system"] == system]
    if not runs:
      continue
    seeds = []
    for r in runs:
      hit = steps_to_target(r["curve"], target, metric)
      seeds.append({"seed": r["seed"], "final": r["curve"][-1][metric],
                    "steps_to_target": hit["step"] if hit else None,
                    "train_time_to_target_s": hit["train_time_s"] if hit else None,
                    "node0_link_bytes_to_target": hit["node0_link_bytes"] if hit else None,
                    "levels_to_target": r.get("levels_to_target")})
    entry = {"seeds": seeds, "final": [s["final"] for s in seeds]}
    by_bw: dict[str, dict] = {}
    for row in (x for x in sweep if x["system"] == system):
      by_bw.setdefault(row["bandwidth"], {}).setdefault(row["density"], []).append(row["step_s"])
    tta = {}
    for bw, per_level in by_bw.items():
      vals = []
      for s in seeds:
        if s["levels_to_target"] is None or s["steps_to_target"] is None:
          vals.append(None)
          continue
        t = 0.0
        for density, n in s["levels_to_target"]:
          t += n * statistics.median(per_level[density])
        vals.append(t)
      tta[bw] = vals
    entry["predicted_time_to_target_s"] = tta
    compute = _compute_s(results, "torch" if system.startswith("torch") else "jax")
    at_unlimited = [row["step_s"] for row in sweep if row["system"] == system
                    and row["bandwidth"] == "unlimited"
                    and row["density"] == min(x["density"] for x in sweep
                                              if x["system"] == system)]
    if compute and at_unlimited:
      step = statistics.median(at_unlimited)
      entry["unlimited_step_s"] = step
      entry["exchange_share_unlimited"] = max(0.0, step - compute) / step
    headline = results["meta"]["headline"]
    if headline in tta:
      entry["measured_over_predicted_at_headline"] = [
          s["train_time_to_target_s"] / p if p else None for s, p in zip(seeds, tta[headline])]
    out[system] = entry
  return out


def _compute_s(results: dict, runtime: str = "jax") -> float | None:
  """The compute-only step of `runtime` in the parity phase (median over its rounds)."""
  if not results.get("parity"):
    return None
  return statistics.median(r[runtime]["step_s"] for r in results["parity"])


def speedups(analysis: dict, over: str) -> dict[str, dict[str, list[float]]]:
  """system -> bandwidth -> [time to target of `over` / the system's], per seed."""
  base = analysis.get(over)
  if base is None:
    return {}
  out: dict[str, dict[str, list[float]]] = {}
  for system, e in analysis.items():
    for bw, vals in e["predicted_time_to_target_s"].items():
      ref = base["predicted_time_to_target_s"].get(bw, [])
      out.setdefault(system, {})[bw] = [r / v for r, v in zip(ref, vals) if r and v]
  return out


def _fmt_range(values: list[float | None], scale: float = 1.0, digits: int = 1) -> str:
  vals = sorted(v * scale for v in values if v is not None)
  if not vals:
    return "not reached"
  missing = len(values) - len(vals)
  text = (f"{statistics.median(vals):.{digits}f}" if len(vals) == 1 else
          f"{vals[0]:.{digits}f} / {statistics.median(vals):.{digits}f} / {vals[-1]:.{digits}f}")
  return text + (f" ({missing} not reached)" if missing else "")


def _times(ratios: list[float]) -> str:
  """Speed-ups as `min / median / max` followed by x; "not reached" when there are none."""
  text = _fmt_range(ratios, digits=2)
  return text if text == "not reached" else text + "x"


def make_tables(results: dict, analysis: dict, headline: str) -> str:
  """The markdown tables: parity, the training runs at the headline, the bandwidth sweep."""
  lines = []
  if results.get("parity"):
    ratios = [r["jax_over_torch"] for r in results["parity"]]
    jax_ms = [r["jax"]["step_s"] * 1e3 for r in results["parity"]]
    torch_ms = [r["torch"]["step_s"] * 1e3 for r in results["parity"]]
    p = results["parity"][0]
    lines += ["Compute-only step, one process on one core, no communication "
              f"(batch {p['jax']['batch_per_process']} per process), min / median / max over "
              f"{len(ratios)} alternated process runs:", "",
              "| runtime | layout | ms per step | JAX / PyTorch |", "|---|---|---:|---:|",
              f"| sparsejax (XLA:CPU) | {p['jax']['layout']} | {_fmt_range(jax_ms)} | "
              f"{_fmt_range(ratios, digits=2)} |",
              f"| PyTorch | {p['torch']['layout']} | {_fmt_range(torch_ms)} | - |", ""]
  metric = target_metric(results)
  if analysis:
    link = headline
    last = "at the stop (the target)" if results["meta"].get("stop_at_target") else "final"
    if results["meta"].get("link_change"):
      rate, _, frac = results["meta"]["link_change"].partition("@")
      link = f"{headline}, then {rate} from {float(frac):.0%} of the recipe on"
    lines += [f"Training at {link} (seeds: min / median / max; evaluation time "
              "excluded; measured / predicted: the train time to target over the sum of the "
              "swept step times):", "",
              "| system | steps to target | train time to target s | measured / predicted | "
              f"node-0 link MB to target | {metric} {last} |", "|---|---:|---:|---:|---:|---:|"]
    for system, e in analysis.items():
      s = e["seeds"]
      check = e.get("measured_over_predicted_at_headline")
      lines.append(f"| {system} | {_fmt_range([x['steps_to_target'] for x in s], digits=0)} | "
                   f"{_fmt_range([x['train_time_to_target_s'] for x in s])} | "
                   f"{_fmt_range(check, digits=2) if check else '-'} | "
                   f"{_fmt_range([x['node0_link_bytes_to_target'] for x in s], 1e-6)} | "
                   f"{_fmt_range(e['final'], digits=4)} |")
    lines += _choice_lines(results)
    bws = [b for b, _ in parse_bandwidths(results["meta"]["bandwidths"])]
    have = [b for b in bws if any(b in e["predicted_time_to_target_s"] for e in analysis.values())]
    if have:
      ratio_row = results.get("exchange_over_compute", {})
      lines += ["", "Time to target (s, seeds min / median / max) by link bandwidth, each = steps "
                f"to target (trained at {headline}) x the median step time measured at that "
                "bandwidth and density level (not trained end to end, except the "
                f"{headline} column, whose end-to-end train time is in the table above); dense "
                "exchange / compute ratio in the header:", "",
                "| system | " + " | ".join(f"{b} ({ratio_row.get(b, float('nan')):.2g})"
                                            for b in have) + " |",
                "|---|" + "---:|" * len(have)]
      for system, e in analysis.items():
        cells = [_fmt_range(e["predicted_time_to_target_s"].get(b, [None])) for b in have]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
      for over in ("dense", "torch-ddp"):
        ups = speedups(analysis, over)
        if not ups:
          continue
        lines += ["", f"Speed-up in time to target over {over} (its time / the system's, per seed:"
                  " min / median / max):", "",
                  "| system | " + " | ".join(have) + " |", "|---|" + "---:|" * len(have)]
        for system, by in ups.items():
          if system != over:
            lines.append(f"| {system} | " + " | ".join(
                _times(by.get(b, [])) for b in have) + " |")
    shares = {s: e for s, e in analysis.items() if "exchange_share_unlimited" in e}
    if shares:
      lines += ["", "At an unlimited link: step time at the final density, and the share of it "
                "that is not compute (the parity phase's step of the same runtime): selection, "
                "error feedback, scatter-add, the collective's CPU work:", "",
                "| system | step ms | exchange share |", "|---|---:|---:|"]
      for system, e in shares.items():
        lines.append(f"| {system} | {e['unlimited_step_s'] * 1e3:.1f} | "
                     f"{100 * e['exchange_share_unlimited']:.0f}% |")
  lines += _pipeline_lines(results)
  m = results["meta"]
  lines += ["", footer(m)]
  return "\n".join(lines)


def pipeline_overlap(results: dict) -> dict[str, dict[str, dict[str, list[float]]]]:
  """Per pipelined system and bandwidth, at its final density, per seed: the halves alone
  (compute_s, exchange_s), the pipelined step (step_s), its twin's step without the pipeline
  (serial_s, the system named without "-pipe", same seed), the timeline's ends, and the hidden
  fraction of the exchange: (compute + exchange - step) / exchange."""
  rows = [r for r in results.get("sweep", []) if "compute_s" in r]
  final = {}
  for r in rows:
    final[r["system"]] = min(final.get(r["system"], 1.0), r["density"])
  serial = {(r["system"], r["seed"], r["bandwidth"], r["density"]): r["step_s"]
            for r in results.get("sweep", [])}
  out: dict[str, dict[str, dict[str, list[float]]]] = {}
  for r in rows:
    if r["density"] != final[r["system"]]:
      continue
    twin = serial.get((r["system"].removesuffix("-pipe"), r["seed"], r["bandwidth"],
                       r["density"]))
    cell = out.setdefault(r["system"], {}).setdefault(r["bandwidth"], {})
    values = {k: r[k] for k in ("compute_s", "exchange_s", "step_s", "compute_end_s",
                                "exchange_end_s")}
    values["hidden"] = (r["compute_s"] + r["exchange_s"] - r["step_s"]) / r["exchange_s"]
    if twin is not None:
      values["serial_s"] = twin
    for k, v in values.items():
      cell.setdefault(k, []).append(v)
  return out


def _pipeline_lines(results: dict) -> list[str]:
  """The pipelined systems' overlap table."""
  got = pipeline_overlap(results)
  if not got:
    return []
  lines = ["", "The pipelined exchange, one rank, at the final density (ms, seeds min / median /"
           " max): the gradient alone, the exchange and update alone, one pipelined step (both "
           "dispatched together), the same system's step without the pipeline, when each half "
           "of a pipelined step ends (a thread waiting on each), and the hidden fraction of the "
           "exchange, (gradient + exchange - pipelined step) / exchange:", "",
           "| system | link | gradient | exchange | pipelined step | unpipelined step | "
           "gradient ends | exchange ends | hidden |", "|---|---|" + "---:|" * 7]
  for system, by in got.items():
    for bandwidth, v in by.items():
      keys = ("compute_s", "exchange_s", "step_s", "serial_s", "compute_end_s",
              "exchange_end_s")
      ms = [_fmt_range(v[k], 1e3) if v.get(k) else "-" for k in keys]
      lines.append(f"| {system} | {bandwidth} | " + " | ".join(ms) + " | "
                   + _fmt_range(v["hidden"], 100, 0) + "% |")
  return lines


def _choice_lines(results: dict) -> list[str]:
  """Algorithm "auto"'s forms per run: the steps where it switched."""
  runs = [r for r in results.get("train", []) if r.get("exchange_choices")]
  if not runs:
    return []
  lines = ["", "Algorithm auto's forms (measured every `compression.auto_every_steps` steps; "
           "a form runs from the step of its choice):", "", "| system | seed | forms |",
           "|---|---:|---|"]
  for r in runs:
    forms = [(c["step"], c["form"]) for c in r["exchange_choices"]]
    kept = [f for i, f in enumerate(forms) if i == 0 or f[1] != forms[i - 1][1]]
    lines.append(f"| {r['system']} | {r['seed']} | "
                 + ", then ".join(f"{form} from step {step}" for step, form in kept) + " |")
  return lines


def exchange_over_compute(results: dict) -> dict[str, float]:
  """A dense exchange's time over a step's compute time at each bandwidth: (dense step -
  compute-only step) / compute-only step, from the sweep and the parity phase."""
  if not results.get("parity"):
    return {}
  compute = statistics.median(r["jax"]["step_s"] for r in results["parity"])
  out = {}
  for row in results.get("sweep", []):
    if row["system"] == "dense":
      out.setdefault(row["bandwidth"], []).append(row["step_s"])
  return {b: max(0.0, statistics.median(v) - compute) / compute for b, v in out.items()}


def plot(results: dict, analysis: dict, png: str) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot")
    return
  bws = parse_bandwidths(results["meta"]["bandwidths"])
  limited = [(b, bps) for b, bps in bws if bps is not None]
  unlimited_x = max(bps for _, bps in limited) * 3 if limited else 1e10
  xs = {b: (bps if bps is not None else unlimited_x) / 1e9 for b, bps in bws}
  fig, ax = plt.subplots(figsize=(8, 5))
  curves = {}
  for system, e in analysis.items():
    pts = sorted((xs[b], statistics.median([v for v in vals if v is not None]))
                 for b, vals in e["predicted_time_to_target_s"].items()
                 if any(v is not None for v in vals))
    if pts:
      curves[system] = pts
      ax.plot(*zip(*pts), marker="o", label=system)
  dense = dict(curves.get("dense", []))
  for system, pts in curves.items():  # crossover: where the system stops beating dense
    if system == "dense":
      continue
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
      if x0 in dense and x1 in dense and (y0 - dense[x0]) * (y1 - dense[x1]) < 0:
        ax.axvline(math.sqrt(x0 * x1), color="grey", ls=":", lw=0.8)
        ax.annotate(f"{system} = dense", (math.sqrt(x0 * x1), ax.get_ylim()[1]), rotation=90,
                    fontsize=7, va="top")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("inter-node link, Gbit/s (rightmost: unlimited)")
  what = {"accuracy": "test accuracy", "loss": "validation loss"}.get(target_metric(results),
                                                                     target_metric(results))
  ax.set_ylabel(f"time to {what} {results['meta']['target']} (s, median of seeds)")
  ax.set_title(f"Time to target on 2 emulated nodes: {results['meta']['task']}\n"
               f"(steps to target at {results['meta']['headline']} x step time measured at each "
               "link)", fontsize=10)
  ax.legend(fontsize=8)
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(png, dpi=120)
  print(f"wrote {png}")


# ----------------------------------------------------------------------------- main

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
  ap.add_argument("--out", default=os.path.join(HERE, "results", "time_to_accuracy.json"))
  ap.add_argument("--from-results", metavar="JSON",
                  help="no runs: analyse a results file again, writing --out's table and plot")
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


def report(results: dict, out: str) -> None:
  """Analysis, table (printed and beside `out`), JSON and plot."""
  target = results["meta"]["target"]
  results["exchange_over_compute"] = exchange_over_compute(results)
  results["analysis"] = analysis = analyse(results, target)
  table = make_tables(results, analysis, results["meta"]["headline"])
  print(table)
  write_results(out, results, table)
  if any(e["predicted_time_to_target_s"] for e in analysis.values()):  # (no sweep: no plot)
    plot(results, analysis, os.path.splitext(out)[0] + ".png")
  print(f"wrote {out}")


def drive(ap, args) -> int:
  if args.from_results:
    with open(args.from_results) as f:
      report(json.load(f), args.out)
    return 0
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
  except ValueError as e:
    ap.error(str(e))
  if config.mesh.nodes != NODES:
    ap.error(f"the study runs on {NODES} emulated nodes; the config says mesh.nodes = "
             f"{config.mesh.nodes}")
  if config.target_metric not in ("accuracy", "loss"):
    ap.error(f"the config must set target_metric = 'accuracy' or 'loss' (and target_value), "
             f"got {config.target_metric!r}")
  from sparsejax import cluster
  from sparsejax import data as data_lib
  inputs = data_lib.open_inputs(config)
  steps_per_epoch = inputs.steps_per_epoch
  total = max(1, math.ceil(config.num_epochs * steps_per_epoch))
  results: dict[str, Any] = {"systems": systems, "meta": {
      "task": f"{config.model.name} on {config.data.name}", "target": config.target_value,
      "target_metric": config.target_metric,
      "config": portable_path(args.config), "sets": args.sets, "bandwidths": args.bandwidths,
      "headline": args.headline, "link_change": args.link_change,
      "stop_at_target": args.stop_at_target,
      "machine": platform.machine(), "cpus": os.cpu_count(),
      "date": time.strftime("%Y-%m-%d"), "nodes": NODES, "local": config.mesh.local,
      "batch_size": config.batch_size, "total_steps": total,
      "parameters": model_size(config, inputs),
      "command": command_line("experiments/time_to_accuracy.py", args.argv)}}
  log = sys.stdout
  partial = os.path.splitext(args.out)[0] + ".partial.json"  # every finished run, as it ends
  if "parity" in phases:
    results["parity"] = run_parity(args, log)
  if "runs" in phases:
    results["train"], results["sweep"] = [], []
    # its own prefix family, so tests of other clusters running beside it never see it
    with cluster.EmulatedCluster(NODES, headline[1], prefix=f"tta{uuid.uuid4().hex[:6]}") as c:
      for seed in range(args.seeds):
        for system in systems:
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
          dens = density_per_step(cfg, steps_per_epoch, total)
          hit = steps_to_target(row["curve"], config.target_value, config.target_metric)
          if hit:
            values, counts = np.unique(dens[:hit["step"]], return_counts=True)
            row["levels_to_target"] = [[float(v), int(n)] for v, n in zip(values, counts)]
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
