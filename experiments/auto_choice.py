"""Does `compression.algorithm=auto` choose the faster form at each link speed?

For each bandwidth, `--runs` separate launches of `sparsejax train <config>` under "auto" on 2
emulated nodes (one process each, pinned to its own core, as the time-to-accuracy study runs),
each stopped after its first measurement and a few steps; from each run's summary.json: the
form auto chose and the step times it predicted for both forms. They are compared with the step
times a time-to-accuracy study measured for the same two systems at the same bandwidth
(`--reference`, its median per bandwidth; fixed dense, and the sparse system at its final
density): the choice is right when the chosen form's measured time to the target (its step
times the same step factor auto assumed) is within 1.1x of the better one's.

  python experiments/auto_choice.py --config configs/tta_kjv_lm.py \\
    --sets compression.density=0.05 compression.warmup_epochs=0.5 compression.warmup_density=0.2 \\
           auto.step_factor=1.0 \\
    --reference experiments/results/time_to_accuracy_lm_warmup.json --sparse hitopk-0.05-w0.5 \\
    --bandwidths unlimited,1gbit,200mbit,50mbit --runs 3 \
    --out experiments/results/auto_choice_lm.json
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import statistics
import sys
import tempfile
from collections import defaultdict
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from experiments import results_io  # noqa: E402
from sparsejax import cluster  # noqa: E402

# each launched process keeps to one core (its rank's), as the study's workers do
PINNED_CLI = ("import os, sys\n"
              "rank = int(os.environ['SPARSEJAX_PROCESS_ID'])\n"
              "cores = sorted(os.sched_getaffinity(0))\n"
              "os.sched_setaffinity(0, {cores[rank % len(cores)]})\n"
              "from sparsejax import cli\n"
              "sys.exit(cli.main(sys.argv[1:]))\n")


def reference_steps(path: str, sparse: str) -> dict[str, dict[str, float]]:
  """{bandwidth: {"dense": s, "sparse": s}}: the study's median step times of fixed dense and of
  the `sparse` system at its final (lowest) density."""
  study = json.load(open(path))
  times: dict[tuple[str, str], list[float]] = defaultdict(list)
  final = min(r["density"] for r in study["sweep"] if r["system"] == sparse)
  for r in study["sweep"]:
    if r["system"] == "dense" or (r["system"] == sparse and r["density"] == final):
      times[(r["bandwidth"], "dense" if r["system"] == "dense" else "sparse")].append(r["step_s"])
  out: dict[str, dict[str, float]] = defaultdict(dict)
  for (bw, form), values in times.items():
    out[bw][form] = statistics.median(values)
  return dict(out)


def reference_exposed(path: str, sparse: str) -> dict[str, dict[str, list[float]]]:
  """{bandwidth: {"dense" | "sparse" | "torch-ddp": [seconds per seed]}}: each system's exposed
  exchange in the study, its step (the sparse system's at its final density) minus its
  runtime's compute-only step (the parity phase's median)."""
  study = json.load(open(path))
  compute = {rt: statistics.median(r[rt]["step_s"] for r in study["parity"])
             for rt in ("jax", "torch")}
  final = min(r["density"] for r in study["sweep"] if r["system"] == sparse)
  out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
  for r in study["sweep"]:
    form = {"dense": "dense", sparse: "sparse", "torch-ddp": "torch-ddp"}.get(r["system"])
    if form is None or (form == "sparse" and r["density"] != final):
      continue
    out[r["bandwidth"]][form].append(
        r["step_s"] - compute["torch" if form == "torch-ddp" else "jax"])
  return {bw: dict(v) for bw, v in out.items()}


def exposed_table(results: dict[str, Any], exposed: dict[str, dict[str, list[float]]]) -> str:
  """Auto's chosen form's exposed exchange against PyTorch DDP's, per bandwidth."""
  rows = ["| bandwidth | auto's form (all runs) | its exposed exchange ms | PyTorch DDP's ms |",
          "|---|---|---:|---:|"]
  for bw, runs in results["runs"].items():
    forms = sorted({r["choice"]["form"] for r in runs})
    mine = [v for f in forms for v in exposed[bw][f]]
    rows.append(f"| {bw} | {', '.join(forms)} | {results_io.spread(mine, 1, 1e3)} | "
                f"{results_io.spread(exposed[bw].get('torch-ddp', []), 1, 1e3)} |")
  return "\n".join(rows)


def report(results: dict[str, Any], out: str) -> str:
  """Both tables (written beside `out` with the JSON); returns the text."""
  meta = results["meta"]
  text = ("Auto's first choice per run (2 emulated nodes, one pinned process each) against the "
          "step times the reference study measured for the two forms (its medians; time to "
          "target = step x auto's step factor); min / median / max over the runs:\n\n"
          + table(results))
  if json.load(open(results_io.resolve(meta["reference"]))).get("parity"):
    exposed = reference_exposed(results_io.resolve(meta["reference"]), meta["sparse"])
    text += ("\n\nExposed exchange per step (the step minus the same runtime's compute-only "
             "step, both from the reference study: its sweep, per seed, and its parity phase's "
             "median) of the form auto chose, against PyTorch DDP's; min / median / max over the "
             "study's seeds:\n\n" + exposed_table(results, exposed))
  text += "\n\n" + results_io.footer(meta) + "\n"
  results_io.write_results(out, results, text)
  return text


def run_once(config: str, sets: list[str], bandwidth: str, steps: int, log) -> dict[str, Any]:
  """One launch under "auto" at `bandwidth`; its first choice (with the figures behind it)."""
  rate = None if bandwidth == "unlimited" else cluster.parse_rate(bandwidth)
  with tempfile.TemporaryDirectory() as workdir:
    argv = ["train", config, "--workdir", workdir, "--no-progress",
            "--set", "compression.algorithm=auto", "--set", "auto.probe_budget=0",
            "--set", "eval_every_steps=0", "--set", "checkpoint_every_steps=0",
            "--set", f"num_epochs={steps}", *[a for s in sets for a in ("--set", s)]]
    out = io.StringIO()
    with cluster.EmulatedCluster(2, rate or 10**9) as c:
      if rate is None:
        c.set_rate(None)
      rc = cluster.launch(argv, nodes=2, procs_per_node=1, devices_per_proc=1, cluster=c,
                          out=out, program=[sys.executable, "-c", PINNED_CLI])
    log.write(out.getvalue())
    if rc != 0:
      raise RuntimeError(f"auto run at {bandwidth} failed (exit {rc}):\n{out.getvalue()[-3000:]}")
    summary = json.load(open(os.path.join(workdir, "summary.json")))
  return summary["exchange_choices"][0]


def judge(choice: dict[str, Any], measured: dict[str, float]) -> dict[str, Any]:
  """The choice against the study's measured step times (both forms, the same step factor)."""
  factor = choice["step_factor"]
  to_target = {"dense": measured["dense"], "sparse": measured["sparse"] * factor}
  best = min(to_target, key=to_target.get)
  return {"best": best, "chosen_over_best": to_target[choice["form"]] / to_target[best],
          "predicted_over_measured_dense": choice["dense_step_ms"] / 1e3 / measured["dense"],
          "predicted_over_measured_sparse": choice["sparse_step_ms"] / 1e3 / measured["sparse"]}


def table(results: dict[str, Any]) -> str:
  rows = ["| bandwidth | auto chose (runs) | study: dense / sparse step ms | best | chosen / best "
          "time to target | predicted / measured step: dense | sparse |",
          "|---|---|---:|---|---:|---:|---:|"]
  for bw, runs in results["runs"].items():
    ref = results["reference"][bw]
    forms = ", ".join(r["choice"]["form"] for r in runs)
    judged = {key: results_io.spread([r["judged"][key] for r in runs], digits=2)
              for key in ("chosen_over_best", "predicted_over_measured_dense",
                          "predicted_over_measured_sparse")}
    rows.append(
        f"| {bw} | {forms} | {1e3 * ref['dense']:.1f} / {1e3 * ref['sparse']:.1f} | "
        f"{runs[0]['judged']['best']} | "
        f"{judged['chosen_over_best']} | {judged['predicted_over_measured_dense']} | "
        f"{judged['predicted_over_measured_sparse']} |")
  return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", required=True)
  ap.add_argument("--sets", nargs="*", default=[])
  ap.add_argument("--reference", required=True, help="a time_to_accuracy study's JSON")
  ap.add_argument("--sparse", required=True, help="the study's system auto's sparse form is")
  ap.add_argument("--bandwidths", default="unlimited,1gbit,200mbit,50mbit")
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--epochs", type=float, default=0.05, help="each run's length (num_epochs)")
  ap.add_argument("--out", type=results_io.json_path, required=True)
  ap.add_argument("--from-results", metavar="JSON", help="no runs: the tables again from a "
                  "results file (written to --out's name)")
  args = ap.parse_args(argv)
  if args.from_results:
    print(report(json.load(open(args.from_results)), args.out))
    return 0
  reference = reference_steps(args.reference, args.sparse)
  meta = {"command": results_io.command_line(__file__, sys.argv[1:] if argv is None else argv),
          "machine": platform.machine(), "cpus": os.cpu_count(),
          "date": datetime.date.today().isoformat(), "reference": results_io.portable_path(
              args.reference), "sparse": args.sparse, "sets": args.sets, "epochs": args.epochs}
  results: dict[str, Any] = {"meta": meta, "reference": {}, "runs": {}}
  log = io.StringIO()  # the launches' output, written beside the results if a run fails
  for bw in args.bandwidths.split(","):
    if bw not in reference:
      raise ValueError(f"bandwidth {bw!r} is not in the reference study ({sorted(reference)})")
    results["reference"][bw] = reference[bw]
    results["runs"][bw] = []
    for run in range(args.runs):
      try:
        choice = run_once(args.config, args.sets, bw, args.epochs, log)
      except RuntimeError:
        results_io.write_atomic(os.path.splitext(args.out)[0] + ".log", log.getvalue())
        raise
      judged = judge(choice, reference[bw])
      print(f"{bw} run {run}: chose {choice['form']} ({judged})", flush=True)
      results["runs"][bw].append({"choice": choice, "judged": judged})
  print(report(results, args.out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
