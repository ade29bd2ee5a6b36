"""One gTop-k merge on one core: the local work between two rounds of `comm.gtopk_positions`.

  python -m benchmarks.merge [--k 25557] [--procs 3] [--calls 20]
      [--out benchmarks/results/bench_merge.json]

A merge takes two sets of k (value, index) pairs (distinct indices in each, a realistic overlap:
a quarter of one set's positions in the other), sums the values of a position in both and
keeps the k largest |sums| (`comm.merge_top`: a sort of 2k pairs by index, a top-k of 2k).
Each of `--procs` separate processes, pinned to one core, times `--calls` jitted calls after a
warm-up; the table gives min / median / max over the processes of their medians, and the
seconds per candidate pair (2k a merge) that `studies/node_scaling/run.py` uses for the merges
of its emulated cluster. Default k: ResNet-50's 25,557,032 values at density 0.001.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from sparsejax.bench import command_line, json_path, python_module, write_results

HERE = os.path.dirname(os.path.abspath(__file__))


def time_merges(k: int, calls: int) -> float:
  """Median seconds of one merge of two k-pair sets, in this process."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from sparsejax import comm
  n = 1000 * k
  rng = np.random.default_rng(0)
  ia = rng.choice(n, k, replace=False)
  ib = np.concatenate([ia[: k // 4], rng.choice(n, k - k // 4, replace=False)])
  a = (jnp.asarray(rng.standard_normal(k), jnp.float32), jnp.asarray(ia, jnp.int32))
  b = (jnp.asarray(rng.standard_normal(k), jnp.float32), jnp.asarray(ib, jnp.int32))
  merge = jax.jit(lambda a, b: comm.merge_top(a, b, k, n))
  jax.block_until_ready(merge(a, b))
  times = []
  for _ in range(calls):
    t = time.perf_counter()
    jax.block_until_ready(merge(a, b))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--k", type=int, default=25_557)
  ap.add_argument("--procs", type=int, default=3)
  ap.add_argument("--calls", type=int, default=20)
  ap.add_argument("--out", type=json_path,
                  default=os.path.join(HERE, "results", "bench_merge.json"))
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.k < 1 or args.procs < 1 or args.calls < 1:
    ap.error(f"--k, --procs and --calls must be >= 1, got {args.k}, {args.procs}, {args.calls}")
  if args.worker:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    print(json.dumps({"merge_s": time_merges(args.k, args.calls)}))
    return 0
  runs = []
  for _ in range(args.procs):
    out = subprocess.run([*python_module(__file__), "--worker", "--k",
                          str(args.k), "--calls", str(args.calls)], capture_output=True,
                         text=True, check=True, timeout=600,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    runs.append(json.loads(out.stdout.strip().splitlines()[-1])["merge_s"])
  per_pair = [t / (2 * args.k) for t in runs]
  command = command_line("benchmarks/merge.py", sys.argv[1:] if argv is None else argv)
  meta = {"k": args.k, "procs": args.procs, "calls": args.calls, "machine": platform.machine(),
          "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "command": command}
  s = sorted(runs)
  table = (f"One gTop-k merge of two sets of k = {args.k:,} pairs on one core (ms, min / median / "
           f"max over {args.procs} processes, each the median of {args.calls} calls): "
           f"{s[0] * 1e3:.2f} / {statistics.median(s) * 1e3:.2f} / {s[-1] * 1e3:.2f}; per "
           f"candidate pair {statistics.median(per_pair) * 1e9:.0f} ns.\n\n"
           f"Command: `{command}`; machine: {meta['machine']} ({meta['cpus']} cores); date: "
           f"{meta['date']}.")
  write_results(args.out, {"meta": meta, "merge_s": runs, "s_per_pair": per_pair}, table)
  print(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
