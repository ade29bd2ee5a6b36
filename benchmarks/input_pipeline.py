"""Input pipeline throughput: the tiered cache in front of a remote source, and pre-decoded images.

  python -m benchmarks.input_pipeline [--quick] [--images 256] [--runs 3] [--threads 8]
                                    [--out benchmarks/results/bench_input.json]
  python -m benchmarks.input_pipeline --open [--records 1000,100000] [--runs 5] [--repeats 20]
                                    [--out benchmarks/results/bench_input_open.json]

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

--open: the time to open a `TieredCache` (and to unpickle one, as each grain worker does) over
a disk directory holding 1,000 or 100,000 records, each run in a fresh process; min / median /
max over the runs of the ratio of the two, beside a walk with a stat of every file (what opening
cost before the ledger of `sparsejax.data.disk`).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import grain
import numpy as np

from sparsejax.bench import command_line, json_path, python_module, write_results
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


def bench_epochs(args) -> tuple[dict[str, Any], str]:
  """Epochs through the cache, and the per-core work of one example: (payload, table)."""
  local = SyntheticJpegs(args.images)
  mean_kb = float(np.mean([len(j) for j in local.jpegs])) / 1e3
  print(f"{args.images} JPEGs 500x375, mean {mean_kb:.0f} KB; remote: {BANDWIDTH / 1e6:.0f} MB/s, "
        f"{LATENCY_S * 1e3:.0f} ms per read", flush=True)
  results = epoch_rates(local, mean_kb, args)
  core = per_core_rates(local, args)
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
  meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "images": args.images,
          "mean_jpeg_kb": mean_kb, "latency_s": LATENCY_S, "bandwidth_bytes_per_s": BANDWIDTH,
          "threads": args.threads, "runs": args.runs,
          "command": command_line("benchmarks/input_pipeline.py", sys.argv[1:])}
  payload = {"meta": meta, "epochs": results, "per_core": core,
             "warm_memory_over_cold": med["memory (3rd+ epoch)"] / cold,
             "warm_disk_over_cold": med["disk (2nd epoch, new process)"] / cold,
             "predecoded_over_jpeg_per_core": cmed["pre-decoded 160 px + crop to 128"] / jpeg}
  return payload, "\n".join(lines)


def epoch_rates(local: SyntheticJpegs, mean_kb: float, args) -> dict[str, list[float]]:
  """Examples/s of each kind of epoch, one value per run."""
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
  return results


def per_core_rates(local: SyntheticJpegs, args) -> dict[str, list[float]]:
  """Examples/s of one thread: the JPEG path and the pre-decoded path, one value per run."""
  records = [local[i] for i in range(min(args.images, 64))]
  decoded = [DecodedSource(local, 160)[i] for i in range(len(records))]
  jpeg_path = lambda r, rng: image_ops.random_resized_crop(  # noqa: E731
      image_ops.decode(r["image"]), 128, rng)
  predecoded = lambda r, rng: image_ops.random_resized_crop(r["image"], 128, rng)  # noqa: E731
  core = {"JPEG decode + crop to 128": [], "pre-decoded 160 px + crop to 128": []}
  for _ in range(args.runs):
    core["JPEG decode + crop to 128"].append(per_core(jpeg_path, records, 1))
    core["pre-decoded 160 px + crop to 128"].append(per_core(predecoded, decoded, 3))
  return core


# ----------------------------------------------------------------------------- opening a cache

class TinyRecords:
  """`n` records of 100 bytes each: many files, little disk."""

  def __init__(self, n: int):
    self.n = n

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    return {"x": bytes([i % 256]) * 100}

  def __repr__(self):
    return f"TinyRecords(n={self.n})"


def fill(disk_dir: str, n: int) -> float:
  """Writes `n` records through a TieredCache into `disk_dir`; returns records/s."""
  cache = TieredCache(TinyRecords(n), memory_bytes=1, disk_dir=disk_dir, disk_bytes=1 << 40)
  t0 = time.perf_counter()
  for i in range(n):
    cache[i]
  rate = n / (time.perf_counter() - t0)
  assert cache.stats()["disk"]["bytes_written"] > 0
  return rate


def open_probe(dirs: dict[str, str], repeats: int) -> dict[str, dict[str, float]]:
  """In this (fresh) process, seconds to open a TieredCache over each directory: the first open,
  the median of `repeats` more, an unpickled copy (what each grain worker does), and a walk with
  a stat of every file (what opening cost before the ledger)."""
  out: dict[str, dict[str, float]] = {name: {} for name in dirs}
  with tempfile.TemporaryDirectory() as empty:  # the process's one-time costs, before timing
    TieredCache(TinyRecords(1), memory_bytes=1, disk_dir=empty, disk_bytes=1 << 40).close()
  for name, d in dirs.items():
    src = TinyRecords(int(name))
    def open_cache(d=d, src=src):
      return TieredCache(src, memory_bytes=1, disk_dir=d, disk_bytes=1 << 40)
    t0 = time.perf_counter()
    cache = open_cache()
    out[name]["first_open_s"] = time.perf_counter() - t0
    assert cache[0]["x"] == src[0]["x"] and cache.stats()["disk"]["hits"] == 1
    times, unpickle = [], []
    blob = pickle.dumps(cache)
    for _ in range(repeats):
      t0 = time.perf_counter()
      open_cache().close()
      times.append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      pickle.loads(blob).close()
      unpickle.append(time.perf_counter() - t0)
    out[name]["open_s"] = statistics.median(times)
    out[name]["unpickle_s"] = statistics.median(unpickle)
    t0 = time.perf_counter()
    files = sum(os.stat(os.path.join(p, f)).st_size > 0 for p, _, fs in os.walk(d) for f in fs)
    out[name]["walk_s"] = time.perf_counter() - t0
    out[name]["files"] = files
  return out


def bench_open(args) -> tuple[dict[str, Any], str]:
  """Opening a TieredCache over directories of `args.records` records, in fresh processes."""
  root = tempfile.mkdtemp(prefix="bench-open-")
  try:
    dirs = {str(n): os.path.join(root, str(n)) for n in args.records}
    fill_rate = {name: fill(d, int(name)) for name, d in dirs.items()}
    print("filled: " + ", ".join(f"{k} records at {v:,.0f}/s" for k, v in fill_rate.items()),
          flush=True)
    runs = []
    for run in range(args.runs):
      order = dict(reversed(dirs.items())) if run % 2 else dirs  # neither always goes first
      cmd = [*python_module(__file__), "--open-probe", json.dumps(order),
             "--repeats", str(args.repeats)]
      runs.append(json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                            text=True).stdout.splitlines()[-1]))
      print(f"run {run}: " + ", ".join(f"{k}: open {v['open_s'] * 1e6:.0f} us, walk "
                                       f"{v['walk_s'] * 1e3:.0f} ms" for k, v in runs[-1].items()),
            flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return open_results(args, runs, fill_rate)


def mmm(values: list[float]) -> tuple[float, float, float]:
  return min(values), statistics.median(values), max(values)


def open_results(args, runs: list[dict], fill_rate: dict[str, float]) -> tuple[dict, str]:
  small, large = (str(n) for n in (min(args.records), max(args.records)))
  ratio = {k: [r[large][k] / r[small][k] for r in runs]
           for k in ("first_open_s", "open_s", "unpickle_s", "walk_s")}
  meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "records": args.records,
          "runs": args.runs, "repeats": args.repeats,
          "command": command_line("benchmarks/input_pipeline.py", sys.argv[1:]),
          "date": time.strftime("%Y-%m-%d", time.gmtime())}
  lines = [f"`{meta['command']}` ({meta['machine']}, {meta['cpus']} CPU cores, {meta['date']})",
           "",
           f"Opening a TieredCache over a disk directory of {int(small):,} or {int(large):,} "
           f"records (100-byte records, 256 sub-directories a source), each run a fresh process "
           f"(min / median / max of {args.runs} runs; open and unpickle: median of "
           f"{args.repeats} in the run)", "",
           f"| per open | {int(small):,} records | {int(large):,} records | ratio |",
           "|---|---:|---:|---:|"]
  names = {"first_open_s": "first open in the process", "open_s": "open again",
           "unpickle_s": "unpickle (a grain worker's copy)",
           "walk_s": "walk + stat of every file (what opening cost before)"}
  for key, label in names.items():
    cells = [" / ".join(f"{x * 1e3:.3f}" for x in mmm([r[n][key] for r in runs]))
             for n in (small, large)]
    lines.append(f"| {label} (ms) | {cells[0]} | {cells[1]} | "
                 f"{' / '.join(f'{x:.2f}x' for x in mmm(ratio[key]))} |")
  return {"meta": meta, "runs": runs, "ratio_large_over_small": ratio,
          "fill_records_per_s": fill_rate}, "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="a smoke check: few images/records, 1 run")
  ap.add_argument("--images", type=int, default=256)
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--threads", type=int, default=8)
  ap.add_argument("--open", action="store_true",
                  help="time opening a TieredCache over directories of --records records")
  ap.add_argument("--records", type=lambda s: [int(x) for x in s.split(",")],
                  default=[1000, 100_000])
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--open-probe", help=argparse.SUPPRESS)  # the child process of --open
  ap.add_argument("--out", type=json_path)
  args = ap.parse_args(argv)
  if args.open_probe:
    print(json.dumps(open_probe(json.loads(args.open_probe), args.repeats)))
    return 0
  if args.quick:
    args.images, args.runs, args.records, args.repeats = 48, 1, [100, 1000], 3
  for name in ("images", "runs", "threads", "repeats"):
    if getattr(args, name) < 1:
      ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  if args.open and (len(args.records) != 2 or min(args.records) < 1):
    ap.error(f"--records must be two positive counts, got {args.records}")
  name = "bench_input_open.json" if args.open else "bench_input.json"
  out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
  payload, text = bench_open(args) if args.open else bench_epochs(args)
  print(text)
  write_results(out, payload, text)
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
