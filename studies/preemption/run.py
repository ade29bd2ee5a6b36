"""A run that loses a node a third of the way through its recipe, against the same run untouched:
does it reach the same target accuracy, and what does the loss cost?

  python -m studies.preemption.run [--config configs/tta_fmnist_mlp.py] [--set key=value ...]
      [--nodes 4] [--at 0.33] [--runs 3] [--rate 1gbit] [--lock FILE]
      [--out studies/preemption/results/preemption.json]                           (needs root)
  python -m studies.preemption.run --quick     (a smoke run: digits, 3 nodes, 1 run)

Each run is `sparsejax launch --nodes N-1:N` (elastic: `cluster.launch(min_nodes=N-1)`) of
`sparsejax train` on an emulated cluster of N nodes, one process each, with periodic
checkpoints. In the "lost" runs, once train.csv shows `--at` of the recipe's steps, the last
node's process is killed (SIGKILL: a preempted VM). The launcher notices it, stops the others,
and starts the job again on the N - 1 nodes left; the trainer resumes the newest checkpoint,
written by N workers, on N - 1 (`sparsejax.train.resize`: the error-feedback memory keeps the
update it stands for) and trains to the end. The "whole" runs are the same without the kill.
The global batch is the config's (it must divide by N and N - 1). Measured per run, from the
launcher's start: when the target test accuracy first shows in eval.csv, the end, the final
accuracy; for lost runs the time lost split into detection (kill -> the launcher's "lost node"
line), restart (that line -> the first step trained after the resume) and the steps trained
again (those since the checkpoint resumed from, at the run's median step time). Runs alternate
whole / lost; min / median / max over `--runs` pairs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import signal
import statistics
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
  spread,
  write_results,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

DEFAULT_SETS = ["batch_size=240", "checkpoint_every_steps=24", "log_every_steps=6",
                "eval_every_steps=12"]
QUICK_SETS = ["data.name=digits", "model.hidden=(128,)", "batch_size=60", "num_epochs=4",
              "checkpoint_every_steps=12", "log_every_steps=3", "eval_every_steps=6",
              "target_value=0.8", "optimizer.warmup_epochs=0.0",
              "compression.warmup_epochs=0.3"]


def _rows(path: str) -> list[dict[str, str]]:
  try:
    with open(path, newline="") as f:
      return list(csv.DictReader(f))
  except OSError:
    return []


def _train_argv(config: str, sets: list[str], nodes: int, workdir: str) -> list[str]:
  argv = ["train", config, "--workdir", workdir, "--no-progress",
          "--set", f"mesh.nodes={nodes}", "--set", "mesh.local=1",
          "--set", f"mesh.num_devices={nodes}"]
  for s in sets:
    argv += ["--set", s]
  return argv


def _last_step(path: str) -> int:
  rows = _rows(path)
  return int(rows[-1]["step"]) if rows else 0


def _resume_step(line: str) -> int:
  """The step of "checkpoint step S was written by W workers; resized for ...": the newest
  intact checkpoint when the node was lost (an asynchronous save still in flight is not)."""
  return int(line.split("checkpoint step ", 1)[1].split()[0])


def _watch(args, lose: bool, config, token: str, workdir: str, launcher, out: TimedLog,
           t0: float, kill_step: int) -> dict[str, Any]:
  """Polls the run's CSVs until the launcher ends: kills the last node at `kill_step` if
  `lose`; notes when the target shows, (step, time) as training advances, and when the resumed
  run logs its first step past its checkpoint."""
  train_csv, eval_csv = os.path.join(workdir, "train.csv"), os.path.join(workdir, "eval.csv")
  seen: dict[str, Any] = {"killed_at": None, "kill_step": None, "target_s": None,
                          "progress": [], "resumed_at": None}
  while launcher.is_alive():
    step, now = _last_step(train_csv), time.monotonic()
    if not seen["progress"] or step != seen["progress"][-1][0]:
      seen["progress"].append((step, now))
    if lose and seen["killed_at"] is None and step >= kill_step:
      os.kill(launched_pids(token, args.nodes)[args.nodes - 1], signal.SIGKILL)
      seen["killed_at"], seen["kill_step"] = now, step
    resized = out.first("resized for")
    if resized and seen["resumed_at"] is None and now > resized[0]:
      resume_step = _resume_step(resized[1])
      if step <= resume_step:
        seen["rewound"] = True  # the resumed run's train.csv, cut back to its checkpoint
      elif seen.get("rewound"):
        seen["resumed_at"] = now  # its first logged step past the checkpoint
    if seen["target_s"] is None and any(float(r["accuracy"]) >= config.target_value
                                        for r in _rows(eval_csv)):
      seen["target_s"] = now - t0
    time.sleep(0.05)
  return seen


def one_run(args, lose: bool, total_steps: int, log) -> dict[str, Any]:
  """One launch (elastic, N-1:N), with the last node killed at `--at` of the steps if `lose`."""
  from sparsejax import cluster
  from sparsejax.train import config as config_lib
  config = config_lib.validate(config_lib.apply_overrides(
      config_lib.load_config(args.config), args.sets))
  out, result, token = TimedLog(), {}, uuid.uuid4().hex
  kill_step = max(1, round(args.at * total_steps))
  with tempfile.TemporaryDirectory() as workdir:
    argv = _train_argv(args.config, args.sets, args.nodes, workdir)
    t0 = time.monotonic()
    launcher = threading.Thread(target=lambda: result.update(rc=cluster.launch(
        argv, nodes=args.nodes, procs_per_node=1, bandwidth=args.rate, out=out,
        min_nodes=args.nodes - 1, extra_env={RUN_TOKEN: token})))
    launcher.start()
    seen = _watch(args, lose, config, token, workdir, launcher, out, t0, kill_step)
    launcher.join()
    end_s = time.monotonic() - t0
    evals = _rows(os.path.join(workdir, "eval.csv"))
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
  row = {"lose": lose, "rc": result.get("rc"), "target_s": seen["target_s"], "end_s": end_s,
         "final_accuracy": float(evals[-1]["accuracy"]) if evals else None,
         "steps": summary["steps"], "devices_at_end": summary["devices"],
         "launcher": [line for _, line in out.lines if line.startswith("sparsejax launch:")
                      or "resized for" in line]}
  if lose:
    row.update(_lost_time(out, seen))
  for line in row["launcher"]:
    log.write(line + "\n")
  return row


def _step_s(progress: list[tuple[int, float]], until: float) -> float | None:
  """Median seconds per step while training advanced before `until`."""
  rates = [(t2 - t1) / (s2 - s1) for (s1, t1), (s2, t2) in zip(progress, progress[1:])
           if t2 <= until and s2 > s1 > 0]
  return statistics.median(rates) if rates else None


def _lost_time(out: TimedLog, seen: dict[str, Any]) -> dict[str, Any]:
  """What the lost node cost: detection (kill -> the launcher's line), restart (that line ->
  the resumed run's first logged step, less that step's training), the steps trained again
  (kill step - the step resumed from, at the run's step time)."""
  lost, resized = out.first("sparsejax launch: lost node"), out.first("resized for")
  killed_at, kill_step = seen["killed_at"], seen["kill_step"]
  resume_step = _resume_step(resized[1]) if resized else None
  step_s = _step_s(seen["progress"], killed_at) if killed_at else None
  first = None
  if seen["resumed_at"] is not None:
    first = next(s for s, t in seen["progress"] if t >= seen["resumed_at"])
  restart = None
  if lost and seen["resumed_at"] is not None and step_s and first is not None:
    restart = seen["resumed_at"] - lost[0] - (first - resume_step) * step_s
  return {"kill_step": kill_step, "resume_step": resume_step, "step_s": step_s,
          "detect_s": lost[0] - killed_at if lost and killed_at else None,
          "restart_s": restart,
          "steps_again": (kill_step - resume_step if None not in (kill_step, resume_step)
                          else None),
          "steps_again_s": ((kill_step - resume_step) * step_s
                            if None not in (kill_step, resume_step, step_s) else None)}


def make_table(results: dict[str, Any]) -> str:
  m = results["meta"]
  whole = [r for r in results["runs"] if not r["lose"]]
  lost = [r for r in results["runs"] if r["lose"]]
  lines = [f"{m['task']} on {m['nodes']} emulated nodes (one process each, {m['rate']} links), "
           f"elastic launch {m['nodes'] - 1}:{m['nodes']}; the last node killed (SIGKILL) at "
           f"{m['at']:.0%} of the {m['total_steps']} steps in the lost runs; min / median / max "
           f"over {m['runs']} runs each:", "",
           "| runs | time to target s | whole run s | final accuracy | steps |",
           "|---|---:|---:|---:|---:|"]
  for name, rows in (("uninterrupted", whole), ("a node lost", lost)):
    lines.append(f"| {name} | {spread([r['target_s'] for r in rows], 1)} | "
                 f"{spread([r['end_s'] for r in rows], 1)} | "
                 f"{spread([r['final_accuracy'] for r in rows], 4)} | "
                 f"{spread([r['steps'] for r in rows], 0)} |")
  lines += ["", "What the lost node cost (s): detection (kill -> the launcher's line), restart "
            "(-> the resumed run training again, its first steps' time taken out), the steps "
            "trained again since the checkpoint:", "",
            "| detection | restart | steps trained again | their time | all three |",
            "|---:|---:|---:|---:|---:|"]
  total = [None if None in (r["detect_s"], r["restart_s"], r["steps_again_s"]) else
           r["detect_s"] + r["restart_s"] + r["steps_again_s"] for r in lost]
  lines.append(f"| {spread([r['detect_s'] for r in lost], 2)} | "
               f"{spread([r['restart_s'] for r in lost], 1)} | "
               f"{spread([r['steps_again'] for r in lost], 0)} | "
               f"{spread([r['steps_again_s'] for r in lost], 1)} | {spread(total, 1)} |")
  lines += ["", footer(m)]
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tta_fmnist_mlp.py"))
  ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
  ap.add_argument("--nodes", type=int, default=4)
  ap.add_argument("--at", type=float, default=1 / 3, help="fraction of the steps")
  ap.add_argument("--runs", type=int, default=3, help="pairs of runs (whole, lost)")
  ap.add_argument("--rate", default="1gbit")
  ap.add_argument("--quick", action="store_true", help="a smoke run: digits, 3 nodes, 1 pair")
  ap.add_argument("--out", type=json_path, default=os.path.join(HERE, "results", "preemption.json"))
  args = ap.parse_args(argv)
  argv = list(sys.argv[1:] if argv is None else argv)
  args.config = os.path.abspath(args.config)
  args.sets = (QUICK_SETS if args.quick else DEFAULT_SETS) + args.sets
  if args.quick:
    args.nodes, args.runs = 3, 1
  if args.nodes < 2 or args.runs < 1 or not 0 < args.at < 1:
    ap.error(f"--nodes must be >= 2, --runs >= 1 and --at in (0, 1), got {args.nodes}, "
             f"{args.runs}, {args.at}")
  from sparsejax import data as data_lib
  from sparsejax.train import config as config_lib
  from sparsejax.train import make_plan
  config = config_lib.validate(config_lib.apply_overrides(config_lib.load_config(args.config),
                                                          args.sets))
  for workers in (args.nodes, args.nodes - 1):
    if config.batch_size % workers:
      ap.error(f"batch_size {config.batch_size} must divide by {args.nodes} and "
               f"{args.nodes - 1} workers (set it with --set batch_size=...)")
  total = make_plan(config, data_lib.open_inputs(config).steps_per_epoch).total_steps
  results: dict[str, Any] = {"meta": {
      "task": f"{config.model.name} on {config.data.name}", "nodes": args.nodes, "at": args.at,
      "rate": args.rate, "runs": args.runs, "total_steps": total, "target": config.target_value,
      "sets": args.sets, "machine": platform.machine(), "cpus": os.cpu_count(),
      "date": time.strftime("%Y-%m-%d"),
      "command": command_line("studies/preemption/run.py", argv)}, "runs": []}
  for _ in range(args.runs):
    for lose in (False, True):
      results["runs"].append(one_run(args, lose, total, sys.stdout))
  table = make_table(results)
  write_results(args.out, results, table)
  print(table)
  return 0 if all(r["rc"] == 0 for r in results["runs"]) else 1


if __name__ == "__main__":
  sys.exit(main())
