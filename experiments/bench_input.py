"""Input pipeline throughput: the tiered cache in front of a remote source, and pre-decoded images.

  python experiments/bench_input.py [--quick] [--images 256] [--runs 3] [--threads 8]
                                    [--out experiments/results/bench_input.json]

Records: ImageNet-like JPEGs (500x375, quality 95: about 110 KB each) behind a `RemoteSource` that
behaves like a cloud file system (20 MB/s shared, 10 ms per read). One "epoch" reads every record
once, in a shuffled order, with grain (`--threads` reader threads), and reports examples/s:

  no cache         every epoch from the remote source;
  cold (1st epoch) through a `TieredCache` (memory + disk), empty: remote reads + disk writes;
  disk (2nd)       a new process's cache over the same directory: every record from local disk;
  memory (3rd+)    the same cache again: every record from memory.

Per core (one thread, warm memory cache), the work of one training example at 128 px:

  JPEG path        decode the full JPEG, random-resized crop to 128, flip;
  pre-decoded      the record pre-decoded at 160 px shorter side (cache point 2), crop to 128.

Medians of `--runs` runs (each cold run with a fresh cache directory). Writes JSON and a table.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import grain
import numpy as np
from results_io import write_results

from sparsejax.data import RemoteSource, TieredCache
from sparsejax.data import images as image_ops
from sparsejax.data.imagenet import synthetic_jpeg
from sparsejax.data.loader import prefetch
from sparsejax.data.pipeline import DecodedSource

LATENCY_S, BANDWIDTH = 0.010, 20e6


class SyntheticJpegs:
  """`n` ImageNet-like JPEG records held in memory (the "remote" data), labels 0..999."""

  def __init__(self, n: int, seed: int = 0, width: int = 500, height: int = 375):
    rng = np.random.default_rng(seed)
    self.n, self.seed = n, seed
    self.jpegs = [synthetic_jpeg(rng, width, height, quality=95) for _ in range(n)]

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    return {"image": self.jpegs[i], "label": i % 1000}

  def __repr__(self):
    return f"SyntheticJpegs(n={self.n}, seed={self.seed})"


def read_epoch(source, threads: int, seed: int) -> float:
  """Examples/s reading every record of `source` once, shuffled, with grain reader threads."""
  ds = grain.MapDataset.source(source).shuffle(seed=seed).map(lambda r: len(r["image"]))
  t0 = time.perf_counter()
  n = sum(1 for _ in prefetch(ds, threads=threads, buffer=2 * threads))
  return n / (time.perf_counter() - t0)


def per_core(fn, records, repeats: int) -> float:
  """Examples/s of `fn(record, rng)` on one thread."""
  rng = np.random.default_rng(0)
  t0 = time.perf_counter()
  for _ in range(repeats):
    for r in records:
      fn(r, rng)
  return repeats * len(records) / (time.perf_counter() - t0)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="48 images, 1 run (a smoke check)")
  ap.add_argument("--images", type=int, default=256)
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--threads", type=int, default=8)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                "results", "bench_input.json"))
  args = ap.parse_args(argv)
  if args.quick:
    args.images, args.runs = 48, 1
  for name in ("images", "runs", "threads"):
    if getattr(args, name) < 1:
      ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  local = SyntheticJpegs(args.images)
  mean_kb = float(np.mean([len(j) for j in local.jpegs])) / 1e3
  print(f"{args.images} JPEGs 500x375, mean {mean_kb:.0f} KB; remote: {BANDWIDTH / 1e6:.0f} MB/s, "
        f"{LATENCY_S * 1e3:.0f} ms per read", flush=True)
  remote = RemoteSource(local, latency_s=LATENCY_S, bandwidth_bytes_per_s=BANDWIDTH)
  budget = 4 * args.images * int(mean_kb * 1e3 + 4096)
  results: dict[str, list[float]] = {k: [] for k in ("no cache", "cold (1st epoch)",
                                                      "disk (2nd epoch, new process)",
                                                      "memory (3rd+ epoch)")}
  for run in range(args.runs):
    results["no cache"].append(read_epoch(remote, args.threads, run))
    tmp = tempfile.mkdtemp(prefix="bench-input-")
    try:
      cache = TieredCache(remote, memory_bytes=budget, disk_dir=tmp, disk_bytes=budget)
      results["cold (1st epoch)"].append(read_epoch(cache, args.threads, run))
      fresh = TieredCache(remote, memory_bytes=budget, disk_dir=tmp, disk_bytes=budget)
      results["disk (2nd epoch, new process)"].append(read_epoch(fresh, args.threads, run + 1))
      results["memory (3rd+ epoch)"].append(read_epoch(fresh, args.threads, run + 2))
      stats = fresh.stats()
      assert stats["source"]["reads"] == 0, stats  # the warm epochs never touched the remote
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
    print(f"run {run}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in results.items()),
          flush=True)

  records = [local[i] for i in range(min(args.images, 64))]
  decoded = [DecodedSource(local, 160)[i] for i in range(len(records))]
  jpeg_path = lambda r, rng: image_ops.random_resized_crop(  # noqa: E731
      image_ops.decode(r["image"]), 128, rng)
  predecoded = lambda r, rng: image_ops.random_resized_crop(r["image"], 128, rng)  # noqa: E731
  core = {"JPEG decode + crop to 128": [], "pre-decoded 160 px + crop to 128": []}
  for _ in range(args.runs):
    core["JPEG decode + crop to 128"].append(per_core(jpeg_path, records, 1))
    core["pre-decoded 160 px + crop to 128"].append(per_core(predecoded, decoded, 3))

  med = {k: statistics.median(v) for k, v in results.items()}
  cmed = {k: statistics.median(v) for k, v in core.items()}
  cold = med["cold (1st epoch)"]
  jpeg = cmed["JPEG decode + crop to 128"]
  lines = [f"{args.images} JPEGs of 500x375 (mean {mean_kb:.0f} KB) behind a RemoteSource "
           f"({BANDWIDTH / 1e6:.0f} MB/s, {LATENCY_S * 1e3:.0f} ms per read), {args.threads} "
           f"grain reader threads, {os.cpu_count()} CPU cores; medians of {args.runs} runs", "",
           "| epoch | examples/s | vs cold |", "|---|---:|---:|"]
  lines += [f"| {k} | {v:,.0f} | {v / cold:.1f}x |" for k, v in med.items()]
  lines += ["", "| per core (one thread), one training example at 128 px | examples/s | "
            "vs JPEG path |", "|---|---:|---:|"]
  lines += [f"| {k} | {v:,.0f} | {v / jpeg:.1f}x |" for k, v in cmed.items()]
  text = "\n".join(lines)
  print(text)
  meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "images": args.images,
          "mean_jpeg_kb": mean_kb, "latency_s": LATENCY_S, "bandwidth_bytes_per_s": BANDWIDTH,
          "threads": args.threads, "runs": args.runs,
          "command": " ".join(["python", "experiments/bench_input.py"] + sys.argv[1:])}
  payload = {"meta": meta, "epochs": results, "per_core": core,
             "warm_memory_over_cold": med["memory (3rd+ epoch)"] / cold,
             "warm_disk_over_cold": med["disk (2nd epoch, new process)"] / cold,
             "predecoded_over_jpeg_per_core": cmed["pre-decoded 160 px + crop to 128"] / jpeg}
  write_results(args.out, payload, text)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
