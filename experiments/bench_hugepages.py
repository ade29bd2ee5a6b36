"""Does madvise(MADV_HUGEPAGE) on the output help the CPU scatter-add kernel? An A/B benchmark.

  python experiments/bench_hugepages.py [--procs 3] [--runs 20] [--mbytes 100] [--density 0.008]
                                        [--out experiments/results/bench_hugepages.json]

`csrc/topk_select.cc`'s scatter-add (`cpu_kernels.scatter_add`: zeros, then out[i] += v) is
compiled twice from the current source: "plain" (any HugePages call taken out) and "madvise" (the
2 MB-aligned middle of the output advised MADV_HUGEPAGE before the zeroing, as the kernel once
did). XLA:CPU hands every call a fresh output buffer (100 MB: glibc maps it anew), so its first
touch pays the page faults. Each process times both variants alternately (`--runs` calls each,
after a warm-up; every output deleted before the next call) and XLA's own scatter
(`jnp.zeros(n).at[i].add(v)`) for reference; ratios are to "plain" within the process; the table
gives min-median-max over `--procs` processes. Also reported: the process's AnonHugePages while
one output is alive (whether the advice took effect) and the THP mode.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

if not __package__:  # run as `python experiments/bench_hugepages.py`: import from this checkout
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.results_io import command_line, json_path, write_results  # noqa: E402
from sparsejax import cpu_kernels  # noqa: E402

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sparsejax",
                    "csrc")
ANCHOR = "  float* o = out->typed_data();\n"  # in ScatterAddImpl
ADVICE = """  {  // the 2 MB pages inside [o, o + n)
    constexpr uintptr_t kHuge = uintptr_t{1} << 21;
    const uintptr_t lo = (reinterpret_cast<uintptr_t>(o) + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t hi = (reinterpret_cast<uintptr_t>(o) + n * sizeof(float)) & ~(kHuge - 1);
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
  }
"""


def variants() -> dict[str, str]:
  """The two sources of topk_select.cc: without and with the advice on the output."""
  with open(os.path.join(CSRC, "topk_select.cc")) as f:
    src = f.read()
  plain = re.sub(r"\n *HugePages\(o, [^;]*\);", "", src)
  if ANCHOR not in plain:
    raise RuntimeError(f"ScatterAddImpl changed: {ANCHOR.strip()!r} not found")
  advised = "#include <sys/mman.h>\n" + plain.replace(ANCHOR, ANCHOR + ADVICE)
  return {"plain": plain, "madvise": advised}


def build(tmp: str) -> dict[str, str]:
  """Compiles each variant (with parallel.h) into tmp; returns name -> library path."""
  cxx = cpu_kernels._compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler")
  paths = {}
  for name, src in variants().items():
    cc, so = os.path.join(tmp, f"{name}.cc"), os.path.join(tmp, f"{name}.so")
    with open(cc, "w") as f:
      f.write(src)
    subprocess.run([cxx, *cpu_kernels._FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{CSRC}", cc,
                    "-o", so], check=True)
    paths[name] = so
  return paths


def anon_huge_kb() -> int:
  with open("/proc/self/smaps_rollup") as f:
    return int(re.search(r"AnonHugePages:\s+(\d+) kB", f.read()).group(1))


def measure(args, libs: dict[str, str]) -> dict:
  """One process: median seconds per variant over interleaved calls, ratios to "plain"."""
  n = args.mbytes * (1 << 20) // 4
  m = max(1, round(args.density * n))
  rng = np.random.default_rng(args.seed)
  v = jnp.asarray(rng.standard_normal(m, dtype=np.float32))
  i = jnp.asarray(rng.integers(0, n, m).astype(np.int32))
  out_type = jax.ShapeDtypeStruct((n,), jnp.float32)
  fns = {}
  for name, path in libs.items():
    lib = ctypes.cdll.LoadLibrary(path)
    target = f"bench_scatter_add_{name}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.SparsejaxScatterAdd),
                                platform="cpu")
    fns[name] = jax.jit(lambda v, i, t=target: jax.ffi.ffi_call(
        t, out_type, vmap_method="sequential")(v, i))
  fns["xla"] = jax.jit(lambda v, i: jnp.zeros(n, jnp.float32).at[i].add(v))
  times: dict[str, list[float]] = {k: [] for k in fns}
  huge = {}
  for name, fn in fns.items():  # warm-up (compilation), and whether the advice took effect
    out = jax.block_until_ready(fn(v, i))
    huge[name] = anon_huge_kb()
    out.delete()
  names = list(fns)
  for r in range(args.runs):
    for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
      t = time.perf_counter()
      out = jax.block_until_ready(fns[name](v, i))
      times[name].append(time.perf_counter() - t)
      out.delete()  # the next call gets a fresh buffer
  med = {k: statistics.median(x) for k, x in times.items()}
  return {"n": n, "m": m, "median_s": med, "times_s": times, "anon_huge_kb": huge,
          "ratio_to_plain": {k: med[k] / med["plain"] for k in med}}


def spread(values: list[float], fmt: str) -> str:
  return "-".join(format(x, fmt) for x in (min(values), statistics.median(values), max(values)))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--procs", type=int, default=3)
  ap.add_argument("--runs", type=int, default=20)
  ap.add_argument("--mbytes", type=int, default=100, help="output size, MiB")
  ap.add_argument("--density", type=float, default=0.008, help="pairs per output value")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", type=json_path, default="experiments/results/bench_hugepages.json")
  ap.add_argument("--worker", help=argparse.SUPPRESS)  # JSON: {"libs": .., "out": ..}
  args = ap.parse_args(argv)
  if args.procs < 1 or args.runs < 1 or args.mbytes < 1 or not 0 < args.density <= 1:
    ap.error(f"need --procs, --runs, --mbytes >= 1 and --density in (0, 1], got {args.procs}, "
             f"{args.runs}, {args.mbytes}, {args.density}")
  if args.worker:
    job = json.loads(args.worker)
    with open(job["out"], "w") as f:
      json.dump(measure(args, job["libs"]), f)
    return 0
  with tempfile.TemporaryDirectory() as tmp:
    libs = build(tmp)
    procs = []
    for p in range(args.procs):
      out = os.path.join(tmp, f"proc{p}.json")
      subprocess.run([sys.executable, os.path.abspath(__file__),
                      *(argv if argv is not None else sys.argv[1:]), "--seed", str(args.seed + p),
                      "--worker", json.dumps({"libs": libs, "out": out})], check=True)
      with open(out) as f:
        procs.append(json.load(f))
  with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
    thp = f.read().strip()
  meta = {"jax": jax.__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
          "thp": thp, "date": time.strftime("%Y-%m-%d %H:%M"), "runs": args.runs,
          "command": command_line("experiments/bench_hugepages.py", sys.argv[1:])}
  first = procs[0]
  lines = [f"`{meta['command']}` ({meta['date']}, {meta['machine']}, {meta['cpus']} CPUs, "
           f"THP: {thp})", "",
           f"scatter-add of {first['m']:,} pairs into a fresh float32[{first['n']:,}] "
           f"({args.mbytes} MiB); min-median-max over {len(procs)} processes of each process's "
           f"median of {args.runs} calls", "",
           "| variant | ms | ratio to plain | AnonHugePages with one output alive (MiB) |",
           "|---|---|---|---|"]
  for name in first["median_s"]:
    lines.append(f"| {name} | {spread([p['median_s'][name] * 1e3 for p in procs], '.1f')} | "
                 f"{spread([p['ratio_to_plain'][name] for p in procs], '.3f')} | "
                 f"{spread([p['anon_huge_kb'][name] / 1024 for p in procs], '.0f')} |")
  text = "\n".join(lines)
  print(text)
  write_results(args.out, {"meta": meta, "processes": procs}, text)
  print(f"\nwrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
