"""auto's dense form against plain dense (or its sparse form against the fixed sparse system):
the same task's train step, the two interleaved.

  python -m benchmarks.dense_form [--variants mlp-mc,mlp-nesterov,cnn-lars-mean,lm-adam]
      [--form dense|sparse] [--procs 3] [--blocks 8] [--block-steps 5]
      [--out benchmarks/results/bench_dense_form.json]

Under `compression.algorithm = "auto"` a dense step runs the sparse exchange's dense form (every
candidate all-reduced, the residual emptied, the correction's state kept for a switch back). A
user who picks auto where the link is fast should pay no more for it than for
`compression.algorithm = "dense"`. Each variant is a task of the time-to-accuracy study with the
correction its sparse systems use (momentum correction, the same with Nesterov, LARS's trust
ratio of the workers' mean, Adam's); one process builds both runs on the same 2 CPU devices (one
process: the link is not what is measured, both forms send the same all-reduce) and compiles
them, then times blocks of `--block-steps` steps of each in turn (the order swapped every block,
so that the machine's drift falls on both), every step at the recipe's last image size. A
process's figure is the median step of auto's dense form over plain dense's; reported min /
median / max over `--procs` separate processes, with each form's step and the largest parameter
difference after the same steps (both forms compute the same update, up to rounding).
`--form sparse` does the same for auto's sparse form against `compression.algorithm = "hitopk"`
(auto's sparse form is HiTopKComm at the same density and corrections): a user who picks auto
where the link is slow should pay no more for its sparse step than for the fixed system's.
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

MODULE = "benchmarks.dense_form"
_MC = ["compression.momentum_correction=True", "experimental.momentum_masking=False"]
# variant -> (task config, overrides both runs share)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    # (the MLP recipe has Nesterov: mlp-mc and mlp-nesterov run the same optimizer; plain
    # momentum is not measured here)
    "mlp-mc": ("configs/tta_fmnist_mlp.py", ["compression.density=0.01", *_MC]),
    "mlp-nesterov": ("configs/tta_fmnist_mlp.py",
                     ["compression.density=0.01", "optimizer.nesterov=True", *_MC]),
    "cnn-lars-mean": ("configs/tta_fmnist_resnet.py",
                      ["compression.density=0.04", "experimental.lars_trust_ratio=mean", *_MC]),
    "lm-adam": ("configs/tta_kjv_lm.py",
                ["compression.density=0.01", "compression.momentum_correction=True"]),
    # the LM tasks' fixed sparse system (the study's hitopk-0.05: Adam, plain error feedback)
    "lm-0.05": ("configs/tta_kjv_lm.py", ["compression.density=0.05"]),
}
# --form -> {run name: overrides}: auto's form first, the fixed system it should cost the same as
FORMS = {
    "dense": {"auto-dense": ["compression.algorithm=auto", "auto.schedule=((0, 'dense'),)"],
              "dense": ["compression.algorithm=dense"]},
    "sparse": {"auto-sparse": ["compression.algorithm=auto", "auto.sparse=hitopk",
                               "auto.schedule=((0, 'sparse'),)"],
               "hitopk": ["compression.algorithm=hitopk"]}}


def worker(args) -> None:
  import jax
  import numpy as np

  from sparsejax.train import config as config_lib
  from sparsejax.train.run import Run
  path, sets = VARIANTS[args.variant]
  forms = FORMS[args.form]
  mine, fixed = forms
  runs = {}
  for form, extra in forms.items():
    config = config_lib.apply_overrides(config_lib.load_config(os.path.join(ROOT, path)),
                                        ["mesh.nodes=2", "mesh.local=1", *sets, *extra])
    runs[form] = Run(config)
    runs[form].compile()
  at = runs[fixed].plan.total_steps - 1  # (the last image size, the final level)
  times: dict[str, list[float]] = {form: [] for form in forms}
  step = 0
  for block in range(args.blocks + 1):  # block 0 warms both up, untimed
    order = list(forms) if block % 2 == 0 else list(forms)[::-1]
    for form in order:
      run = runs[form]
      for i in range(args.block_steps):
        jax.block_until_ready(run.state)
        t0 = time.perf_counter()
        run.step_at(step + i, at)
        jax.block_until_ready(run.state)
        if block:
          times[form].append(time.perf_counter() - t0)
    step += args.block_steps
  diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
             for a, b in zip(jax.tree.leaves(runs[mine].state.params),
                             jax.tree.leaves(runs[fixed].state.params)))
  with open(args.worker_out, "w") as f:
    json.dump({"variant": args.variant, "step_s": {k: statistics.median(v)
                                                   for k, v in times.items()},
               "max_param_diff": diff, "steps_each": len(times[fixed])}, f)


def _range(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
  v = sorted(values)
  return " / ".join(f"{scale * x:.{digits}f}" for x in (v[0], statistics.median(v), v[-1]))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--form", default="dense", choices=tuple(FORMS),
                  help="auto's form to time against its fixed system (default dense)")
  ap.add_argument("--procs", type=int, default=3, help="separate process runs per variant")
  ap.add_argument("--blocks", type=int, default=8)
  ap.add_argument("--block-steps", type=int, default=5)
  ap.add_argument("--out", type=json_path,
                  default=os.path.join(ROOT, "benchmarks", "results", "bench_dense_form.json"))
  ap.add_argument("--variant", help=argparse.SUPPRESS)
  ap.add_argument("--worker-out", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.variant:
    worker(args)
    return 0
  variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  bad = [v for v in variants if v not in VARIANTS]
  if bad or not variants:
    ap.error(f"unknown variant(s) {bad or variants}; allowed: {', '.join(VARIANTS)}")
  for name in ("procs", "blocks", "block_steps"):
    if getattr(args, name) < 1:
      ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  rows = []
  for proc in range(args.procs):  # the variants take turns, process by process
    for variant in variants:
      with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        subprocess.run([*python_module(MODULE), "--variant", variant, "--worker-out", out,
                        "--form", args.form,
                        "--blocks", str(args.blocks), "--block-steps", str(args.block_steps)],
                       env=env, cwd=ROOT, check=True)
        with open(out) as f:
          row = json.load(f)
      row["proc"] = proc
      mine, fixed = FORMS[args.form]
      row["ratio"] = row["step_s"][mine] / row["step_s"][fixed]
      print(json.dumps(row), flush=True)
      rows.append(row)
  mine, fixed = FORMS[args.form]
  lines = [f"auto's {args.form} form against {fixed}: median step of each in one process, the "
           "two interleaved in blocks (2 CPU devices, one process); min / median / max over "
           f"{args.procs} processes.", "",
           f"| variant | auto's {args.form} form ms | {fixed} ms | auto / {fixed} | largest "
           "parameter difference |", "|---|---:|---:|---:|---:|"]
  for variant in variants:
    got = [r for r in rows if r["variant"] == variant]
    lines.append(f"| {variant} | {_range([r['step_s'][mine] for r in got], 1e3, 1)} | "
                 f"{_range([r['step_s'][fixed] for r in got], 1e3, 1)} | "
                 f"{_range([r['ratio'] for r in got])} | "
                 f"{max(r['max_param_diff'] for r in got):.2g} |")
  meta = {"command": command_line(MODULE, sys.argv[1:] if argv is None else argv),
          "commit": git_commit(), "machine": f"{platform.machine()} ({os.cpu_count()} cores)",
          "date": time.strftime("%Y-%m-%d"), "form": args.form, "procs": args.procs,
          "blocks": args.blocks,
          "block_steps": args.block_steps}
  lines += ["", f"Command: `{meta['command']}`; commit {meta['commit']}; machine: "
            f"{meta['machine']}; date: {meta['date']}."]
  md = write_results(args.out, {"meta": meta, "rows": rows}, "\n".join(lines))
  print(open(md).read())
  return 0


if __name__ == "__main__":
  sys.exit(main())
