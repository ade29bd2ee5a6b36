"""Can XLA:CPU's flags close the compute gap with PyTorch? The time-to-accuracy study's parity
step (one process pinned to one core, the node's share of the batch, forward + backward +
update, no communication) under each `XLA_FLAGS` set, alternated with PyTorch's step in rounds
of separate processes; the ratio to PyTorch per round.

  python experiments/probe_parity_flags.py --config configs/tta_kjv_lm.py --rounds 3 \\
    --out experiments/results/probe_parity_flags_lm.json

`--checkout NAME=DIR` (repeatable) adds the default-flags step of another checkout of the
repository (a `git worktree` at another commit) to each round: a before / after of a change in
the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from experiments.results_io import command_line, footer, json_path, spread, write_results  # noqa: E402

# name -> XLA_FLAGS (the flags this jaxlib's XLA:CPU has, `strings` on its library)
FLAG_SETS = {
    "default": "",
    "onednn": "--xla_cpu_use_onednn=true",
    "onednn custom call": "--xla_cpu_experimental_onednn_custom_call=true",
    "xnnpack": "--xla_cpu_use_xnnpack=true",
    "vector width 512": "--xla_cpu_prefer_vector_width=512",
    "fast math": "--xla_cpu_enable_fast_math=true",
}


def step_ms(config: str, runtime: str, flags: str, warmup: int, reps: int,
            root: str = ROOT) -> float:
  """One process run of the study's parity worker (of the checkout at `root`): its median
  step, ms."""
  with tempfile.NamedTemporaryFile(suffix=".json") as f:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = root
    if flags:
      env["XLA_FLAGS"] = flags
    study = os.path.join(root, "experiments", "time_to_accuracy.py")
    subprocess.run([sys.executable, study, "--mode", "parity", "--system", runtime, "--config",
                    config, "--sets", "[]", "--worker-out", f.name, "--warmup", str(warmup),
                    "--reps", str(reps)], check=True, env=env, timeout=1200,
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    with open(f.name) as g:
      return 1e3 * json.load(g)["step_s"]


def _portable(argv: list[str]) -> list[str]:
  """`argv` with each --checkout's directory a placeholder ($NAME): the commit is recorded."""
  out = list(argv)
  for i, arg in enumerate(out):
    value = arg.split("=", 1)[1] if arg.startswith("--checkout=") else (
        out[i + 1] if arg == "--checkout" and i + 1 < len(out) else None)
    if value and "=" in value:
      name = value.split("=", 1)[0]
      placeholder = f"{name}=${name.upper()}"
      if arg == "--checkout":
        out[i + 1] = placeholder
      else:
        out[i] = f"--checkout={placeholder}"
  return out


def _commit(where: str) -> str:
  """The commit checked out at `where`."""
  return subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True,
                        text=True, check=True).stdout.strip()


def table(results: dict) -> str:
  rows = results["rounds"]
  lines = ["Compute-only step (one process on one core, the node's batch), ms and JAX / PyTorch "
           f"per round (min / median / max of {len(rows)} rounds of separate processes):", "",
           "| runtime | XLA_FLAGS | ms | JAX / PyTorch |", "|---|---|---:|---:|",
           f"| PyTorch | - | {spread([r['torch'] for r in rows], 1)} | - |"]
  for name, flags in results["meta"]["flag_sets"].items():
    ms = [r["jax"].get(name) for r in rows]
    ratio = [m / r["torch"] if m else None for m, r in zip(ms, rows)]
    lines.append(f"| sparsejax | {name}: `{flags or '(none)'}` | {spread(ms, 1)} | "
                 f"{spread(ratio)} |")
  for name, commit in results["meta"].get("checkouts", {}).items():
    ms = [r["jax"].get(f"checkout {name}") for r in rows]
    ratio = [m / r["torch"] if m else None for m, r in zip(ms, rows)]
    lines.append(f"| sparsejax at {name} ({commit[:7]}) | (none) | {spread(ms, 1)} | "
                 f"{spread(ratio)} |")
  return "\n".join(lines + ["", footer(results["meta"])])


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tta_kjv_lm.py"))
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--sets", default=",".join(FLAG_SETS), help="names of FLAG_SETS")
  ap.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR",
                  help="also time another checkout's step (default flags) in each round")
  ap.add_argument("--out", type=json_path, required=True)
  args = ap.parse_args(argv)
  checkouts = dict(c.split("=", 1) for c in args.checkout if "=" in c)
  missing = [d for d in checkouts.values()
             if not os.path.exists(os.path.join(d, "experiments", "time_to_accuracy.py"))]
  if len(checkouts) != len(args.checkout) or missing:
    ap.error(f"--checkout takes NAME=DIR, DIR a checkout of this repository; got "
             f"{args.checkout}")
  names = [n.strip() for n in args.sets.split(",")]
  bad = [n for n in names if n not in FLAG_SETS]
  if bad or args.rounds < 1:
    ap.error(f"--sets: unknown {bad} (allowed: {', '.join(FLAG_SETS)}); --rounds >= 1, got "
             f"{args.rounds}")
  results = {"rounds": [], "meta": {
      "flag_sets": {n: FLAG_SETS[n] for n in names}, "machine": platform.machine(),
      "checkouts": {n: _commit(d) for n, d in checkouts.items()},
      "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
      "command": command_line("experiments/probe_parity_flags.py", _portable(
          list(sys.argv[1:] if argv is None else argv)))}}
  for r in range(args.rounds):
    row = {"torch": step_ms(args.config, "torch", "", args.warmup, args.reps), "jax": {}}
    for name in names:
      try:
        row["jax"][name] = step_ms(args.config, "jax", FLAG_SETS[name], args.warmup, args.reps)
      except subprocess.CalledProcessError:  # a flag this build refuses: recorded, not fatal
        row["jax"][name] = None
    for name, where in checkouts.items():
      row["jax"][f"checkout {name}"] = step_ms(args.config, "jax", "", args.warmup, args.reps,
                                               root=os.path.abspath(where))
    print(json.dumps({"round": r, **row}), flush=True)
    results["rounds"].append(row)
  text = table(results)
  print(text)
  write_results(args.out, results, text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
