"""What auto compiles before the clock starts, against the fixed systems it chooses between.

  python -m benchmarks.compile_ahead [--tasks cnn,lm,mlp] [--procs 3]
      [--out benchmarks/results/bench_compile_ahead.json]

`Run.compile` builds, before a run's first step, every program the run passes through: a fixed
system one train step per density level and image size, auto both forms at every image size,
the dense form's steady step, and its link probes. The time-to-accuracy study and auto's
end-to-end runs start their clock after it, for every system alike, so auto's measurement share
(`studies/auto`) leaves out what it compiles beyond the system it runs (`sparsejax train`
compiles nothing ahead: each program when the run first needs it). This measures that
difference: for each task, its dense system, its sparse system and auto over the two (the
study's systems), `Run.compile` timed in a fresh process on 2 CPU devices (the study's 2 nodes,
one process here: what is compiled, not the link), min / median / max over `--procs` processes
(the systems take turns within each). Reported beside each task's time to target from its
end-to-end auto result, where one is committed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from sparsejax.bench import ROOT, command_line, git_commit, json_path, python_module, write_results

MODULE = "benchmarks.compile_ahead"
# task -> (config, dense system, sparse system, auto system, its end-to-end result at the
# unlimited link)
TASKS: dict[str, tuple[str, str, str, str, str]] = {
    "cnn": ("configs/tta_fmnist_resnet.py", "dense", "hitopk-0.04-mc-mean-w3",
            "auto-0.04-mc-mean-w3", "studies/auto/results/auto_v2_cnn_unlimited.json"),
    "lm": ("configs/tta_kjv_lm.py", "dense", "hitopk-0.05", "auto-0.05",
           "studies/auto/results/auto_v2_kjv_unlimited.json"),
    "mlp": ("configs/tta_fmnist_mlp.py", "dense", "hitopk-0.01-mc", "auto-0.01-mc", ""),
}


def worker(args) -> None:
  from sparsejax.train.run import Run
  from studies.time_to_accuracy.systems import load_task
  config = load_task(os.path.join(ROOT, TASKS[args.task][0]), ["mesh.nodes=2", "mesh.local=1"],
                     args.system, 0)
  run = Run(config)
  t0 = time.perf_counter()
  run.compile()
  seconds = time.perf_counter() - t0
  with open(args.worker_out, "w") as f:
    json.dump({"task": args.task, "system": args.system, "compile_s": seconds,
               "programs": len(run._compiled)}, f)


def _range(values: list[float], digits: int = 1) -> str:
  return " / ".join(f"{v:.{digits}f}" for v in (min(values), statistics.median(values),
                                                 max(values)))


def _dense_time(path: str) -> float | None:
  """The median time to target of the dense run trained beside auto (the end-to-end result)."""
  if not path or not os.path.exists(os.path.join(ROOT, path)):
    return None
  with open(os.path.join(ROOT, path)) as f:
    rows = json.load(f)["rows"]
  times = rows[0]["fixed_time_s"].get("dense")
  return statistics.median(times) if times else None


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tasks", default=",".join(TASKS))
  ap.add_argument("--procs", type=int, default=3, help="separate process runs per system")
  ap.add_argument("--out", type=json_path,
                  default=os.path.join(ROOT, "benchmarks", "results", "bench_compile_ahead.json"))
  ap.add_argument("--task", help=argparse.SUPPRESS)
  ap.add_argument("--system", help=argparse.SUPPRESS)
  ap.add_argument("--worker-out", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.task:
    worker(args)
    return 0
  tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
  bad = [t for t in tasks if t not in TASKS]
  if bad or not tasks:
    ap.error(f"unknown task(s) {bad or tasks}; allowed: {', '.join(TASKS)}")
  if args.procs < 1:
    ap.error(f"--procs must be >= 1, got {args.procs}")
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  rows = []
  for proc in range(args.procs):
    for task in tasks:
      systems = TASKS[task][1:4]
      for system in systems if proc % 2 == 0 else systems[::-1]:
        with tempfile.TemporaryDirectory() as d:
          out = os.path.join(d, "out.json")
          subprocess.run([*python_module(MODULE), "--task", task, "--system", system,
                          "--worker-out", out], env=env, cwd=ROOT, check=True)
          with open(out) as f:
            row = {**json.load(f), "proc": proc}
        print(json.dumps(row), flush=True)
        rows.append(row)
  lines = ["`Run.compile` (every program a run passes through, built before its clock starts) "
           "timed in a fresh process on 2 CPU devices, min / median / max over "
           f"{args.procs} processes; auto's extra: its compile less the slower fixed system's "
           "(median), and that as a share of dense's median time to target trained beside "
           "auto at the unlimited link (its end-to-end result, where committed).", "",
           "| task | dense s | sparse s | auto s | programs (dense / sparse / auto) | auto's "
           "extra s | share of dense's run |", "|---|---:|---:|---:|---|---:|---:|"]
  for task in tasks:
    dense, sparse, auto = (
        [r for r in rows if r["task"] == task and r["system"] == s] for s in TASKS[task][1:4])
    med = {name: statistics.median(r["compile_s"] for r in rs)
           for name, rs in (("dense", dense), ("sparse", sparse), ("auto", auto))}
    extra = med["auto"] - max(med["dense"], med["sparse"])
    run_s = _dense_time(TASKS[task][4])
    share = f"{100 * extra / run_s:.1f}% of {run_s:.0f} s" if run_s else "-"
    lines.append(
        f"| {task} | {_range([r['compile_s'] for r in dense])} | "
        f"{_range([r['compile_s'] for r in sparse])} | {_range([r['compile_s'] for r in auto])} | "
        f"{dense[0]['programs']} / {sparse[0]['programs']} / {auto[0]['programs']} | "
        f"{extra:.1f} | {share} |")
  meta = {"command": command_line(MODULE, sys.argv[1:] if argv is None else argv),
          "commit": git_commit(), "machine": f"{platform.machine()} ({os.cpu_count()} cores)",
          "date": time.strftime("%Y-%m-%d"), "procs": args.procs}
  lines += ["", f"Command: `{meta['command']}`; commit {meta['commit']}; machine: "
            f"{meta['machine']}; date: {meta['date']}."]
  md = write_results(args.out, {"meta": meta, "rows": rows}, "\n".join(lines))
  print(open(md).read())
  return 0


if __name__ == "__main__":
  sys.exit(main())
