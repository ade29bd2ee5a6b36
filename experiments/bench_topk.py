"""Top-k selection speed and recall on this machine: MSTopK vs lax.top_k and friends.

  python experiments/bench_topk.py [--quick] [--runs 7] [--sizes 1000000,25557032,110000000]
                                   [--out experiments/results/bench_topk.json]

For each size (1M, 25,557,032 = ResNet-50, 110M = BERT-base), density (0.01, 0.001) and input
(Gaussian; heavy-tailed: Student-t(2) with most of the mass in a few hot blocks), times `mstopk`,
`sampled_topk`, `exact_topk` (lax.top_k) and `lax.approx_max_k`, all in one process: the median of
`--runs` runs after one warm-up run (compilation excluded). Recall is measured against
`exact_topk`. The floor is one fused pass over the array, `jnp.sum(jnp.abs(x))`.
A second section compares ways to turn a known threshold pair into exactly k indices ("compaction"):
a cumsum-based `nonzero` over the whole array, row-wise partial top-k, and MSTopK's block filter.
Writes JSON (every measurement) and a markdown table of ratios to lax.top_k next to it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

if not __package__:  # run as `python experiments/bench_topk.py`: import from this checkout
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.results_io import write_results  # noqa: E402
from sparsejax import topk

SIZES = (1_000_000, 25_557_032, 110_000_000)
DENSITIES = (0.01, 0.001)


def heavy_tailed(rng: np.random.Generator, n: int) -> np.ndarray:
  """Student-t(2) values; 2% of 4096-element blocks scaled by 100 (mass in a few layers)."""
  x = rng.standard_t(2, n).astype(np.float32)
  nb = -(-n // 4096)
  scale = np.where(rng.random(nb) < 0.02, 100.0, 1.0).astype(np.float32)
  x *= np.repeat(scale, 4096)[:n]
  return x


def gaussian(rng: np.random.Generator, n: int) -> np.ndarray:
  return rng.standard_normal(n, dtype=np.float32)


def time_fn(fn, x, runs: int) -> tuple[float, float, object]:
  """Median and lower quartile of `runs` timed calls after one warm-up call; seconds."""
  out = jax.block_until_ready(fn(x))
  times = []
  for _ in range(runs):
    t = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - t)
  return statistics.median(times), float(np.percentile(times, 25)), out


def recall(a: np.ndarray, k: int, idx: np.ndarray) -> float:
  kth = np.partition(a, a.size - k)[a.size - k]
  return float(np.mean(a[np.asarray(idx)] >= kth))


def rowwise_topk(x: jax.Array, k: int, per_row: int = 32) -> jax.Array:
  """Row-wise partial top-k on a (rows, cols) view, then top-k of the candidates (FACTS.md)."""
  n = x.shape[0]
  cols = max(per_row, n // max(1, k // per_row * 4))
  rows = -(-n // cols)
  a = jnp.pad(jnp.abs(x), (0, rows * cols - n), constant_values=-1).reshape(rows, cols)
  v, i = lax.top_k(a, min(per_row, cols))
  pos = (i + jnp.arange(rows)[:, None] * cols).reshape(-1)
  _, j = lax.top_k(v.reshape(-1), k)
  return pos[j].astype(jnp.int32)


def nonzero_compaction(x: jax.Array, k: int, lo, hi) -> jax.Array:
  """Everything above hi, then the band (lo, hi], via jnp.nonzero over the whole array."""
  a = jnp.abs(x)
  above = a > hi
  (i_above,) = jnp.nonzero(above, size=k, fill_value=0)
  (i_band,) = jnp.nonzero((a > lo) & ~above, size=k, fill_value=0)
  c_hi = jnp.sum(above)
  j = jnp.arange(k)
  return jnp.where(j < c_hi, i_above, i_band[jnp.clip(j - c_hi, 0, k - 1)]).astype(jnp.int32)


def parse_args(argv) -> tuple[argparse.Namespace, tuple[int, ...], int]:
  """(args, sizes, runs) from the command line."""
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="1M and 2M only, 3 runs (a smoke check)")
  ap.add_argument("--runs", type=int, default=7)
  ap.add_argument("--sizes", default=",".join(map(str, SIZES)),
                  help="comma-separated array sizes; the compaction section uses the second")
  ap.add_argument("--out", default="experiments/results/bench_topk.json")
  args = ap.parse_args(argv)
  try:
    sizes = tuple(int(v) for v in args.sizes.split(","))
  except ValueError:
    ap.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
  if args.quick:
    sizes = (1_000_000, 2_000_003)
  if not sizes or min(sizes) < 1000:
    ap.error(f"--sizes must each be >= 1000, got {args.sizes!r}")
  runs = 3 if args.quick else args.runs
  if runs < 1:
    ap.error(f"--runs must be >= 1, got {runs}")
  return args, sizes, runs


def selection_rows(sizes: tuple[int, ...], runs: int, rng: np.random.Generator) -> list[dict]:
  """Each method at each size, input distribution and density: times, recall, distinctness."""
  methods = {
      "mstopk": lambda x, k: topk.mstopk(x, k),
      "sampled_topk": lambda x, k: topk.sampled_topk(x, k),
      "exact_topk": lambda x, k: topk.exact_topk(x, k),
      "approx_max_k": lambda x, k: lax.approx_max_k(jnp.abs(x), k),
  }
  rows = []
  for n in sizes:
    for dist in (gaussian, heavy_tailed):
      host = dist(rng, n)
      a = np.abs(host)
      x = jnp.asarray(host)
      floor, _, _ = time_fn(jax.jit(lambda x: jnp.sum(jnp.abs(x))), x, runs)
      for density in DENSITIES:
        k = max(1, round(density * n))
        result = {"n": n, "density": density, "k": k, "input": dist.__name__,
                  "floor_s": floor, "methods": {}}
        for name, fn in methods.items():
          med, q1, (_, idx) = time_fn(jax.jit(lambda x, fn=fn, k=k: fn(x, k)), x, runs)
          idx = np.asarray(idx)
          result["methods"][name] = {"median_s": med, "q1_s": q1, "recall": recall(a, k, idx),
                                     "distinct": int(len(np.unique(idx))) == k}
        base = result["methods"]["exact_topk"]["median_s"]
        for m in result["methods"].values():
          m["speedup_vs_lax_top_k"] = base / m["median_s"]
          m["ratio_to_floor"] = m["median_s"] / floor
        rows.append(result)
        ms = result["methods"]["mstopk"]
        print(f"n={n:>11,} {dist.__name__:>12} d={density:<6} mstopk {ms['median_s']*1e3:8.1f} ms"
              f"  x{ms['speedup_vs_lax_top_k']:.2f} vs lax.top_k  {ms['ratio_to_floor']:.1f}x floor"
              f"  recall {ms['recall']:.4f}", flush=True)
      del x
  return rows


def compaction_rows(sizes: tuple[int, ...], runs: int, rng: np.random.Generator
                    ) -> tuple[int, int, dict]:
  """Compaction: a known threshold pair -> exactly k indices, three ways: (n, k, results)."""
  n = sizes[min(1, len(sizes) - 1)]
  k = round(0.001 * n)
  host = gaussian(rng, n)
  a = np.abs(host)
  kth = np.partition(a, n - k)[n - k]
  x = jnp.asarray(host)
  lo, hi = jnp.float32(np.nextafter(kth, -np.inf)), jnp.float32(kth)
  compaction = {}
  for name, fn in {
      "nonzero (cumsum) over the whole array": lambda x: nonzero_compaction(x, k, lo, hi),
      "row-wise partial top-k": lambda x: rowwise_topk(x, k),
      "block filter (mstopk)": lambda x: topk.mstopk(x, k)[1],
  }.items():
    med, q1, idx = time_fn(jax.jit(fn), x, runs)
    idx = np.asarray(idx)
    compaction[name] = {"median_s": med, "q1_s": q1, "exact_count": len(np.unique(idx)) == k,
                        "recall": recall(a, k, idx)}
  return n, k, compaction


def table(rows: list[dict], n: int, k: int, compaction: dict) -> str:
  lines = [f"{jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}", "",
           "| n | input | density | floor ms | mstopk ms | vs lax.top_k | x floor | recall |"
           " sampled vs top_k (recall) | approx_max_k vs top_k (recall) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    m = r["methods"]
    lines.append(
        f"| {r['n']:,} | {r['input']} | {r['density']} | {r['floor_s']*1e3:.2f} | "
        f"{m['mstopk']['median_s']*1e3:.2f} | {m['mstopk']['speedup_vs_lax_top_k']:.2f}x | "
        f"{m['mstopk']['ratio_to_floor']:.1f} | {m['mstopk']['recall']:.4f} | "
        f"{m['sampled_topk']['speedup_vs_lax_top_k']:.2f}x ({m['sampled_topk']['recall']:.3f}) | "
        f"{m['approx_max_k']['speedup_vs_lax_top_k']:.2f}x ({m['approx_max_k']['recall']:.3f}) |")
  lines += ["", f"Compaction at n={n:,}, k={k:,} (threshold known):", "",
            "| method | median ms | exact count | recall |", "|---|---|---|---|"]
  for name, c in compaction.items():
    lines.append(f"| {name} | {c['median_s']*1e3:.2f} | {c['exact_count']} | {c['recall']:.4f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  args, sizes, runs = parse_args(argv)
  rng = np.random.default_rng(0)
  rows = selection_rows(sizes, runs, rng)
  n, k, compaction = compaction_rows(sizes, runs, rng)
  meta = {"jax": jax.__version__, "backend": jax.default_backend(), "cpus": os.cpu_count(),
          "machine": platform.machine(), "python": sys.version.split()[0], "runs": runs,
          "command": " ".join(["python", "experiments/bench_topk.py"] + sys.argv[1:])}
  text = table(rows, n, k, compaction)
  print(text)
  write_results(args.out, {"meta": meta, "results": rows,
                           "compaction": {"n": n, "k": k, **compaction}}, text)
  print(f"\nwrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
