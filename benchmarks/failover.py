"""How fast a lost node is noticed: during a multi-process job on an emulated cluster, one node's
process is killed (or hung), and the time until every other process has ended is measured.

  python -m benchmarks.failover [--nodes 4] [--runs 3] [--job collectives|train]
      [--victims last,0] [--signal SIGKILL] [--modes launcher,self] [--heartbeat 3]
      [--rate 1gbit] [--lock FILE] [--out benchmarks/results/bench_failover.json]  (needs root)
  python -m benchmarks.failover --quick          (a smoke run: 3 nodes, 1 run)

The job is `sparsejax launch` (`cluster.launch`) on an `EmulatedCluster`, one process per node:
`collectives` (this script as the worker: an all-reduce over every process every 10 ms) or
`train` (`sparsejax train configs/quickstart.py` with the mesh set to the node count). When
every process is running (the workers say so; train: its train.csv has rows), the victim (a
rank: `last` is the last node's, 0 the coordinator's) gets `--signal`; a trial measures from
that moment:

  noticed   until the launcher's "lost node" line (it names the node, rank and time);
  ended     until every other process has ended (none of them runs any more);
and how each of the others ended (its exit code; which needed the launcher's SIGKILL).

Modes: `launcher` uses the launcher's defaults (the others get SIGTERM when it sees the loss,
SIGKILL 2 s later); `self` gives them a 60 s grace instead, so `ended` is what the processes
notice by themselves (gloo's error on the closed connection, JAX's heartbeat timeout). Every
trial is a separate process run on a new cluster; the table gives min / median / max over
`--runs` runs. `measure_failover` is one trial, for other benchmarks to call.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

from sparsejax.bench import (
  RUN_TOKEN,
  TimedLog,
  command_line,
  footer,
  json_path,
  launched_pids,
  python_module,
  running,
  spread,
  write_results,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MODES = {"launcher": 2.0, "self": 60.0}  # the launcher's grace between SIGTERM and SIGKILL
QUICK = {"nodes": 3, "runs": 1}


# ----------------------------------------------------------------------------- the job

def run_worker(seconds: float) -> None:
  """One process of the `collectives` job: an all-reduce over every process every 10 ms, for
  at most `seconds`."""
  from sparsejax import cluster
  cluster.initialize()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((jax.device_count(),), ("all",))
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("all")),
                                             np.ones(jax.local_device_count(), np.float32))
  total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
  jax.block_until_ready(total(x))
  print(f"ready: process {jax.process_index()} of {jax.process_count()}", flush=True)
  end = time.monotonic() + seconds
  while time.monotonic() < end:
    jax.block_until_ready(total(x))
    time.sleep(0.01)


def _job(kind: str, nodes: int, workdir: str) -> tuple[list[str], list[str] | None]:
  """(argv, program) of `cluster.launch` for the job `kind`."""
  if kind == "collectives":
    return ["--mode", "worker", "--seconds", "300"], python_module(__file__)
  return (["train", os.path.join(ROOT, "configs", "quickstart.py"), "--workdir", workdir,
           "--no-progress", "--set", f"mesh.nodes={nodes}", "--set", "mesh.local=1",
           "--set", f"mesh.num_devices={nodes}", "--set", "batch_size=96",
           "--set", "log_every_steps=1", "--set", "checkpoint_every_steps=100000"], None)


def _running_job(kind: str, log: TimedLog, world: int, workdir: str) -> bool:
  if kind == "collectives":
    return log.count("] ready: process") >= world
  path = os.path.join(workdir, "train.csv")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    return sum(1 for _ in f) >= 3  # the header and two steps


# ----------------------------------------------------------------------------- one trial

def measure_failover(nodes: int, victim: int, sig: int = signal.SIGKILL, *,
                     lost_grace_s: float = 2.0, job: str = "collectives", rate: str = "1gbit",
                     heartbeat_timeout_s: int | None = 3, start_timeout_s: float = 300,
                     log=None) -> dict[str, Any]:
  """One trial: launches `job` on `nodes` emulated nodes (one process each), sends `sig` to
  rank `victim` once all run, and returns seconds from then until the launcher named the loss
  (`noticed_s`) and until every other process had ended (`ended_s`), the launcher's lines, and
  each rank's exit code as the launcher reported it. Needs root."""
  from sparsejax import cluster
  out, result, token = TimedLog(), {}, uuid.uuid4().hex
  with tempfile.TemporaryDirectory() as workdir:
    argv, program = _job(job, nodes, workdir)
    launcher = threading.Thread(target=lambda: result.update(rc=cluster.launch(
        argv, nodes=nodes, procs_per_node=1, bandwidth=rate, init_timeout_s=120, out=out,
        program=program, extra_env={RUN_TOKEN: token}, heartbeat_timeout_s=heartbeat_timeout_s,
        lost_grace_s=lost_grace_s)))
    launcher.start()
    deadline = time.monotonic() + start_timeout_s
    while not _running_job(job, out, nodes, workdir):
      if time.monotonic() > deadline or not launcher.is_alive():
        tail = "\n".join(line for _, line in out.lines[-30:])
        raise RuntimeError(f"the {job} job did not start within {start_timeout_s:g} s:\n{tail}")
      time.sleep(0.1)
    pids = launched_pids(token, nodes)
    t0 = time.monotonic()
    os.kill(pids[victim], sig)
    others = [p for r, p in pids.items() if r != victim]
    while any(running(p) for p in others) and time.monotonic() - t0 < 120:
      time.sleep(0.02)
    ended_s = time.monotonic() - t0
    launcher.join(180)
  lost = out.first("sparsejax launch: lost node")
  lines = [line for _, line in out.lines if line.startswith("sparsejax launch:")]
  for line in lines if log is not None else ():
    log.write(line + "\n")
  return {"nodes": nodes, "victim": victim, "signal": signal.Signals(sig).name, "job": job,
          "lost_grace_s": lost_grace_s, "heartbeat_timeout_s": heartbeat_timeout_s,
          "noticed_s": lost[0] - t0 if lost else None, "ended_s": ended_s,
          "named_right": bool(lost) and f"(rank {victim}," in lost[1], "rc": result.get("rc"),
          "launcher_lines": lines}


# ----------------------------------------------------------------------------- driver

def make_table(results: dict) -> str:
  m = results["meta"]
  lines = [f"A lost node on an emulated cluster of {m['nodes']} nodes ({m['rate']} links, one "
           f"process a node, the `{m['job']}` job, JAX heartbeat timeout "
           f"{m['heartbeat_timeout_s']} s): seconds from the signal to the victim until the "
           "launcher named the loss (noticed) and until every other process had ended "
           f"(ended); min / median / max over {m['runs']} process runs.", "",
           "| victim | signal | mode | noticed s | ended s | named right | ended by SIGKILL |",
           "|---|---|---|---:|---:|---:|---:|"]
  trials = results["trials"]
  for key in dict.fromkeys((t["victim_label"], t["signal"], t["mode"]) for t in trials):
    mine = [t for t in trials if (t["victim_label"], t["signal"], t["mode"]) == key]
    killed = sum("grace: none" not in " ".join(t["launcher_lines"]) for t in mine)
    lines.append(f"| {key[0]} (rank {mine[0]['victim']}) | {key[1]} | {key[2]} | "
                 f"{spread([t['noticed_s'] for t in mine])} | "
                 f"{spread([t['ended_s'] for t in mine])} | "
                 f"{sum(t['named_right'] for t in mine)}/{len(mine)} | {killed}/{len(mine)} |")
  lines += ["", "Modes: launcher = SIGTERM to the others when the launcher sees the loss, SIGKILL "
            f"{MODES['launcher']:g} s later; self = a {MODES['self']:g} s grace, so the others "
            "end by what they notice themselves (gloo's error, the heartbeat timeout).", "",
            footer(m)]
  return "\n".join(lines)


def _victims(spec: str, nodes: int) -> list[tuple[str, int]]:
  out = []
  for word in spec.split(","):
    rank = nodes - 1 if word == "last" else int(word)
    if not 0 <= rank < nodes:
      raise ValueError(f"victim {word!r} is not a rank of {nodes} nodes")
    out.append(("coordinator" if rank == 0 else "last node" if rank == nodes - 1 else "a node",
                rank))
  return out


def drive(args, argv: list[str]) -> int:
  from sparsejax.bench import exclusive
  victims = _victims(args.victims, args.nodes)
  meta = {"nodes": args.nodes, "runs": args.runs, "job": args.job, "rate": args.rate,
          "heartbeat_timeout_s": args.heartbeat, "signal": args.signal, "modes": args.modes,
          "machine": platform.machine(), "cpus": os.cpu_count(),
          "date": time.strftime("%Y-%m-%d"),
          "command": command_line("benchmarks/failover.py", argv)}
  results: dict[str, Any] = {"meta": meta, "trials": []}
  for run in range(args.runs):  # every case once per run: a slow spell hits all alike
    for label, rank in victims:
      for mode in args.modes.split(","):
        with exclusive(args.lock):
          trial = measure_failover(args.nodes, rank, signal.Signals[args.signal],
                                   lost_grace_s=MODES[mode], job=args.job, rate=args.rate,
                                   heartbeat_timeout_s=args.heartbeat or None, log=sys.stdout)
        trial.update(run=run, mode=mode, victim_label=label)
        print(f"run {run}, {label} (rank {rank}), {mode}: noticed "
              f"{spread([trial['noticed_s']])} s, ended {trial['ended_s']:.2f} s", flush=True)
        results["trials"].append(trial)
  table = make_table(results)
  print(table)
  write_results(args.out, results, table)
  return 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--nodes", type=int, default=4)
  ap.add_argument("--runs", type=int, default=3, help="separate process runs per case")
  ap.add_argument("--job", default="collectives", choices=("collectives", "train"))
  ap.add_argument("--victims", default="last,0", help="ranks to lose: numbers or `last`")
  ap.add_argument("--signal", default="SIGKILL", choices=("SIGKILL", "SIGSTOP"),
                  help="SIGSTOP: a hung node (it does not exit)")
  ap.add_argument("--modes", default="launcher,self")
  ap.add_argument("--heartbeat", type=int, default=3, help="JAX heartbeat timeout, s (0: JAX's)")
  ap.add_argument("--rate", default="1gbit", help="every node's link, each direction")
  ap.add_argument("--lock", help="a file to flock around each trial")
  ap.add_argument("--quick", action="store_true", help="a smoke run: 3 nodes, 1 run")
  ap.add_argument("--out", type=json_path,
                  default=os.path.join(HERE, "results", "bench_failover.json"))
  ap.add_argument("--mode", default="driver", choices=("driver", "worker"), help=argparse.SUPPRESS)
  ap.add_argument("--seconds", type=float, default=300, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.mode == "worker":
    run_worker(args.seconds)
    return 0
  argv = list(sys.argv[1:] if argv is None else argv)
  if args.quick:
    for key, value in QUICK.items():
      setattr(args, key, value)
  bad = [m for m in args.modes.split(",") if m not in MODES]
  if args.nodes < 2 or args.runs < 1 or bad:
    ap.error(f"--nodes must be >= 2, --runs >= 1 and --modes from {', '.join(MODES)}")
  try:
    _victims(args.victims, args.nodes)
  except ValueError as e:
    ap.error(str(e))
  return drive(args, argv)


if __name__ == "__main__":
  sys.exit(main())
