"""An alpha-beta communication model plus a compute model: checked on the emulated cluster, then
projected to the paper's cluster (1..16 nodes x 8 V100, 25 Gbit/s Ethernet).

  python -m studies.scaling_model.run [--comm benchmarks/results/bench_comm.json]
                                      [--out studies/scaling_model/results/scaling_model.json]

The model (one training iteration = compute + the gradient exchange, nothing overlapped unless
said): every collective is a ring over its group. A ring all-reduce of B bytes over G workers
takes 2(G-1) steps of latency alpha and puts 2(G-1)/G * B on every link of the ring; a
reduce-scatter (G-1) steps and (G-1)/G * B; an all-gather of a piece of b bytes per worker
(G-1) steps and (G-1) * b. With G workers per node placed next to each other, a ring over all
workers crosses each node's network link once in each direction; G rings that each span the
nodes (one per local rank: HiTopKComm's and the hierarchical all-reduce's inter-node step) share
that link. Time = latency + bytes / bandwidth of the slowest link the bytes cross. On top:

  dense         ring all-reduce over all workers (what NCCL's flat ring does);
  dense+overlap the same, ideally hidden behind the backward pass (2/3 of compute): a lower
                bound on any dense system's iteration;
  allgather-D   MSTopK over the whole gradient, ring all-gather of k (value, index) pairs per
                worker (8 bytes each), scatter-add and the residual update (memory passes);
  hitopk-D      intra-node reduce-scatter, MSTopK on the 1/G shard, inter-node all-gather of
                the shard's pairs (G rings at once), scatter-add, intra-node all-gather.

1. Calibration on the emulated cluster (2 nodes x 2 processes x 1 CPU device, tc-limited link;
   benchmarks/exchange.py's measurements). CPU processes move bytes through gloo at a limited rate,
   so every transfer runs at min(link rate, `net_Bps`); MSTopK costs `select_s_per_value` per
   value; elementwise passes `pass_s_per_value`; every ring step `alpha_s`. These are fitted (least
   squares on log time) to part of the rows and the rest are predicted, which is the check (target:
   within 25%), twice: (a) fitted to the ResNet-50-size rows, the Transformer-base rows held out
   (extrapolation in size; with one size in the fit, fixed and per-value costs cannot be told
   apart); (b) fitted to the 1 Gbit/s rows of both sizes, the 200 Mbit/s rows held out
   (extrapolation in bandwidth). The link's byte overhead (Ethernet/IP/TCP headers) comes from tc's
   byte counters in the same runs.
2. Projection to 16 x 8 V100 with published figures (each with its source in the table), for
   ResNet-50 (25,557,032 parameters, fp32 gradient) at 256 images per GPU, 224 px: iteration
   time and throughput for 1..16 nodes, and the DAWNBench recipe's 28 epochs
   (`configs/dawnbench_resnet50.py`: 128 px for epochs 0-12, 224 px for 13-24, 288 px for
   25-27; compute scales with pixels) next to the paper's claims (25-40% over dense systems;
   ~151 s for 28 epochs on 128 V100s).

Writes JSON, a markdown table (calibration rows, the projection, every input with its source)
and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from sparsejax import cost
from sparsejax.bench import (
  command_line,
  json_path,
  portable_path,
  resolve,
  write_results,
)

HERE = os.path.dirname(os.path.abspath(__file__))

RESNET50 = 25_557_032
PAIR_BYTES, VALUE_BYTES = cost.PAIR_BYTES, cost.VALUE_BYTES


# The model itself lives in the library (`sparsejax.cost`): one model for every study.
Cluster, exchange_time = cost.Cluster, cost.exchange_time


# --- 1. calibration on the emulated cluster -------------------------------------------------

def _link_overhead(results: list[dict[str, Any]]) -> float:
  """Bytes tc counted on the link / payload bytes of the ring formula (dense rows)."""
  ratios = []
  for r in results:
    if r["algorithm"] == "dense":
      payload = 2 * 3 / 4 * r["n"] * VALUE_BYTES  # 4 workers, one crossing per direction
      ratios.append(r["node_egress_bytes"] / payload)
  return float(np.median(ratios))


def _parse_algorithm(name: str) -> tuple[str, float]:
  """("hitopk", 0.01) from "hitopk-0.01" or "hitopk-0.01-mc" (a recipe suffix: the same
  exchange); ("dense", 1.0) from "dense"."""
  parts = name.split("-")
  if len(parts) >= 2:
    return parts[0], float(parts[1])
  return name, 1.0


def cpu_select(topk_results: list[dict[str, Any]]) -> Callable[[float, int], float]:
  """MSTopK's time on this CPU (one process, bench_topk.json, gaussian input), interpolated
  log-log in n and in density between the measured points."""
  pts = {(r["n"], r["density"]): r["methods"]["mstopk"]["median_s"] for r in topk_results
         if r["input"] == "gaussian"}
  ns = sorted({n for n, _ in pts})
  ds = sorted({d for _, d in pts})

  def interp(x, xs, f):
    lx = np.log(x)
    i = int(np.clip(np.searchsorted(np.log(xs), lx) - 1, 0, len(xs) - 2))
    t = (lx - np.log(xs[i])) / (np.log(xs[i + 1]) - np.log(xs[i]))
    return float(np.exp((1 - t) * np.log(f(xs[i])) + t * np.log(f(xs[i + 1]))))

  def select(n: float, k: int) -> float:
    d = k / n
    return interp(n, ns, lambda nn: interp(d, ds, lambda dd: pts[(nn, dd)]))
  return select


def emulated_cluster(params: np.ndarray, rate_bps: float, overhead: float,
                     select: Callable[[float, int], float]) -> Cluster:
  call, net, share, pair, pas = np.exp(params)
  link = rate_bps / 8 / overhead
  return Cluster(nodes=2, local=2, inter_Bps=min(link, net), intra_Bps=net,
                 inter_alpha_s=0.0, intra_alpha_s=0.0, call_s=call,
                 select_s=lambda n, k: share * select(n, k), pair_s=pair, pass_s_per_value=pas)


SPLITS: dict[str, tuple[str, Callable[[dict[str, Any]], bool]]] = {
    # name -> (what is fitted, which rows are fitted)
    "size": ("the ResNet-50 rows; Transformer-base rows held out",
             lambda r: r["size"] == "resnet50"),
    "rate": ("the 1 Gbit/s rows (both sizes); 200 Mbit/s rows held out",
             lambda r: r["rate"] == "1gbit"),
}


def calibrate(results: list[dict[str, Any]], topk_results: list[dict[str, Any]],
              split: str = "size") -> dict[str, Any]:
  """Fits the five CPU-cluster parameters to the rows `SPLITS[split]` selects; predicts every
  row."""
  fitted = SPLITS[split][1]
  from scipy.optimize import least_squares

  rows = [r for r in results if r["algorithm"] in
          ("dense", "hierarchical", "allgather-0.01", "allgather-0.001", "hitopk-0.01",
           "hitopk-0.001")]
  overhead = _link_overhead(rows)
  select = cpu_select(topk_results)

  def predict(params, r):
    alg, d = _parse_algorithm(r["algorithm"])
    return exchange_time(alg, r["n"], d,
                         emulated_cluster(params, r["rate_bps"], overhead, select))

  fit_rows = [r for r in rows if fitted(r)]

  def residuals(params):
    return [math.log(predict(params, r)["total"] / r["median_s"]) for r in fit_rows]

  # start: 10 ms per collective, 100 MB/s through gloo, MSTopK 2x slower than alone (4 processes on
  # 2 cores), 10 ns per pair, 1 ns per pass value
  x0 = np.log([1e-2, 1e8, 2.0, 1e-8, 1e-9])
  fit = least_squares(residuals, x0)
  call, net, share, pair, pas = np.exp(fit.x)
  out = []
  for r in rows:
    pred = predict(fit.x, r)
    out.append({"rate": r["rate"], "size": r["size"], "algorithm": r["algorithm"],
                "measured_s": r["median_s"], "predicted_s": pred["total"],
                "error": pred["total"] / r["median_s"] - 1,
                "held_out": not fitted(r),
                "parts": {k: v for k, v in pred.items() if k != "total"}})
  held = [abs(o["error"]) for o in out if o["held_out"]]
  return {"split": split, "fitted": SPLITS[split][0],
          "params": {"call_s": call, "net_Bps": net, "select_slowdown": share, "pair_s": pair,
                     "pass_s_per_value": pas, "link_overhead": overhead},
          "rows": out, "held_out_max_abs_error": max(held),
          "held_out_median_abs_error": float(np.median(held)),
          "fit_max_abs_error": max(abs(o["error"]) for o in out if not o["held_out"])}


# --- 2. projection to the paper's cluster ----------------------------------------------------

# Each input with its source. Bandwidths in bytes/s per direction.
SOURCES = {
    "v100_images_per_s": (
        1200.0, "ResNet-50 v1.5 training, 1x V100 16GB, mixed precision, 256 images/GPU: NVIDIA "
        "DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md "
        "(DGX-1 table, NGC 21.03)"),
    "inter_Bps": (
        25e9 / 8 * 0.9, "25 Gbit/s Ethernet (the paper's cloud nodes) at 90% goodput: "
        "Ethernet/IP/TCP headers of 1500-byte frames cost ~5%, the rest for NCCL's socket "
        "transport (assumption)"),
    "inter_alpha_s": (50e-6, "per ring step across nodes over TCP sockets (assumption: "
                             "tens of microseconds in a cloud VPC)"),
    "intra_Bps": (
        100e9, "NVLink between 8 V100s: V100 SXM2's 6 links give 150 GB/s per direction (NVIDIA "
               "V100 datasheet: 300 GB/s total); NCCL rings reach about 2/3 of it (assumption)"),
    "intra_alpha_s": (10e-6, "per ring step over NVLink (assumption)"),
    "call_s": (20e-6, "per collective call: a kernel launch and NCCL's set-up (assumption)"),
    "select_fixed_s": (
        2.22e-3, "MSTopK on one H200 (benchmarks/results/gpu.md, gaussian rows: 2.23/2.62 ms at "
                 "25.6M values, 2.58/3.63 ms at 110M, densities 0.001/0.01): fixed part of a "
                 "least-squares fit t = c + a n + b k (kernel launches: not scaled)"),
    "select_s_per_value": (
        2.04e-12 * 4.8 / 0.9,
        "a of that fit, scaled by memory bandwidth, H200 4.8 TB/s over V100 0.9 TB/s (NVIDIA "
        "datasheets)"),
    "select_s_per_pair": (1.09e-9 * 4.8 / 0.9, "b of that fit, scaled the same way"),
    "pair_s": (8 / 0.9e12 * 4, "a scatter-add of one pair: ~4 random 8-byte accesses at V100's "
                               "900 GB/s (assumption)"),
    "pass_s_per_value": (8 / 0.9e12, "one read and one write of float32 at V100's 900 GB/s "
                                     "(NVIDIA V100 datasheet)"),
    "paper_speedup": ((1.25, 1.40), "Shi et al., MLSys 2021: 25-40% faster than the best dense "
                                    "systems on 16 nodes x 8 V100, 25 Gbit/s"),
    "paper_dawnbench_s": (151.0, "the paper's DAWNBench entry: 28 epochs of ImageNet, 93% top-5, "
                                 "about 151 s of training on 128 V100s (issue 7)"),
}
IMAGENET_TRAIN = 1_281_167
STAGES = ((0, 13, 128), (13, 25, 224), (25, 28, 288))  # (first epoch, end epoch, px)


# The GPUs of the projections: throughput (ResNet-50, 224 px, mixed precision), memory and
# NVLink bandwidth scale the per-value costs of the V100 rows of SOURCES.
GPUS = {
    "v100": {"images_per_s": SOURCES["v100_images_per_s"][0], "memory_Bps": 0.9e12,
             "intra_Bps": SOURCES["intra_Bps"][0]},
    "h100": {"images_per_s": 4200.0, "memory_Bps": 3.35e12, "intra_Bps": 300e9},
}
GPU_SOURCES = {
    "h100_images_per_s": (
        4200.0, "ResNet-50, 1x H100 SXM, mixed precision: 1.8x an A100 (MLPerf Training v3.0, "
        "16 H100 in 7.8 min vs 16 A100 in 14.4 min, silvertonconsulting.com 2023-07-12) times "
        "A100's 2,180-2,470 img/s (DeepLearningExamples MXNet/PyTorch ResNet50v1.5 READMEs); "
        "derived, range 3,000-6,500"),
    "h100_memory_Bps": (3.35e12, "H100 SXM HBM3 (NVIDIA H100 datasheet)"),
    "h100_intra_Bps": (300e9, "NVLink 4 between 8 H100s, 450 GB/s per direction; NCCL rings "
                              "reach about 2/3 of it (assumption, as for V100)"),
    "current_links_gbit": ((25, 100), "general-purpose cloud VM NICs (25-100 Gbit/s); flagship "
                                      "8-GPU instances have 600-3,600 Gbit/s GPU fabrics "
                                      "(cloud.google.com/compute/docs/gpus/gpu-network-bandwidth)"),
}


def gpu_cluster(nodes: int, gpu: str = "v100", link_gbit: float = 25.0) -> Cluster:
  """`nodes` x 8 `gpu`s joined by `link_gbit` Ethernet at 90% goodput."""
  s = {k: v for k, (v, _) in SOURCES.items()}
  g = GPUS[gpu]
  mem = 0.9e12 / g["memory_Bps"]  # SOURCES' per-value costs are V100 figures
  return Cluster(nodes=nodes, local=8, inter_Bps=link_gbit * 1e9 / 8 * 0.9,
                 intra_Bps=g["intra_Bps"],
                 inter_alpha_s=s["inter_alpha_s"], intra_alpha_s=s["intra_alpha_s"],
                 call_s=s["call_s"],
                 select_s=lambda n, k: (s["select_fixed_s"] + mem * (
                     s["select_s_per_value"] * n + s["select_s_per_pair"] * k)),
                 pair_s=mem * s["pair_s"], pass_s_per_value=mem * s["pass_s_per_value"])


def v100_cluster(nodes: int) -> Cluster:
  return gpu_cluster(nodes, "v100", 25.0)


def iteration(algorithm: str, nodes: int, batch_per_gpu: int, px: int, gpu: str = "v100",
              link_gbit: float = 25.0) -> dict[str, float]:
  """Predicted seconds per iteration of ResNet-50 on `nodes` x 8 `gpu`s."""
  compute = batch_per_gpu / GPUS[gpu]["images_per_s"] * (px / 224) ** 2
  cl = gpu_cluster(nodes, gpu, link_gbit)
  if algorithm in ("dense", "dense+overlap"):
    comm = exchange_time("dense", RESNET50, 1.0, cl)["total"]
  else:
    alg, d = _parse_algorithm(algorithm)
    comm = exchange_time(alg, RESNET50, d, cl)["total"]
  if algorithm == "dense+overlap":
    total = compute / 3 + max(2 * compute / 3, comm)
  else:
    total = compute + comm
  return {"compute_s": compute, "comm_s": comm, "iteration_s": total,
          "images_per_s": nodes * 8 * batch_per_gpu / total}


def dawnbench_seconds(algorithm: str, batch_per_gpu: int, gpu: str = "v100",
                      link_gbit: float = 25.0, epochs_scale: float = 1.0) -> float:
  """Training seconds of the DAWNBench recipe's stages on 16 x 8 `gpu`s; `epochs_scale` stretches
  every stage (a method that needs that many times the steps to the same accuracy)."""
  seconds = 0.0
  for first, end, px in STAGES:
    steps = (end - first) * epochs_scale * IMAGENET_TRAIN / (16 * 8 * batch_per_gpu)
    seconds += steps * iteration(algorithm, 16, batch_per_gpu, px, gpu, link_gbit)["iteration_s"]
  return seconds


PROJECTED = ("dense", "dense+overlap", "allgather-0.001", "hitopk-0.01", "hitopk-0.001")


def project(batch_per_gpu: int) -> dict[str, Any]:
  rows = []
  for nodes in (1, 2, 4, 8, 16):
    for alg in PROJECTED:
      rows.append({"nodes": nodes, "gpus": nodes * 8, "algorithm": alg,
                   **iteration(alg, nodes, batch_per_gpu, 224)})
  dawn = {alg: dawnbench_seconds(alg, batch_per_gpu) for alg in PROJECTED}
  return {"rows": rows, "dawnbench_28_epochs_s": dawn}


# --- 3. the link-bound time-to-accuracy runs ----------------------------------------------

# The time-to-accuracy sweep's bandwidths whose rows are fitted; the others are held out (one
# interpolated, one extrapolated below the fitted range).
TTA_FITTED = ("unlimited", "2gbit", "500mbit")


def tta_rows(tta: dict[str, Any]) -> list[dict[str, Any]]:
  """sparsejax's step times in the time-to-accuracy sweep: one row per (system, bandwidth,
  density level), the median over its process runs."""
  groups: dict[tuple, list[dict[str, Any]]] = {}
  for r in tta["sweep"]:
    if not r["system"].startswith("torch"):
      groups.setdefault((r["system"], r["bandwidth"], r["density"]), []).append(r)
  return [{"system": system, "algorithm": _parse_algorithm(system)[0], "bandwidth": bw,
           "rate_bps": rs[0]["rate_bps"], "density": d,
           "measured_s": float(np.median([r["step_s"] for r in rs])),
           "link_bytes": float(np.median([r["node0_link_bytes_per_step"] for r in rs]))}
          for (system, bw, d), rs in groups.items()]


def link_bytes(algorithm: str, n: int, density: float, nodes: int, local: int) -> float:
  """Payload bytes one exchange puts on a node's link (the ring formulas of exchange_time)."""
  cl = Cluster(nodes=nodes, local=local, inter_Bps=1.0, intra_Bps=math.inf, inter_alpha_s=0.0,
               intra_alpha_s=0.0, call_s=0.0, select_s=lambda n, k: 0.0, pair_s=0.0,
               pass_s_per_value=0.0)
  return exchange_time(algorithm, n, density, cl)["total"]


def tta_cluster(params: np.ndarray, rate_bps: float | None, overhead: float,
                local: int) -> Cluster:
  """The emulated cluster of the study: 2 nodes x 1 process x `local` devices."""
  call, net, intra, select, pair, pas = np.exp(params)
  link = net if rate_bps is None else min(rate_bps / 8 / overhead, net)
  return Cluster(nodes=2, local=local, inter_Bps=link, intra_Bps=intra, inter_alpha_s=0.0,
                 intra_alpha_s=0.0, call_s=call, select_s=lambda n, k: select * n, pair_s=pair,
                 pass_s_per_value=pas)


def tta_model_size(tta: dict[str, Any]) -> int:
  """Parameters of the study's model: as the results record it, else built from their config
  and --set values (which opens the task's data)."""
  from studies.time_to_accuracy.systems import load_task, model_size
  meta = tta["meta"]
  if "parameters" in meta:
    return int(meta["parameters"])
  return model_size(load_task(resolve(meta["config"]), meta["sets"]))


def calibrate_tta(tta: dict[str, Any], n: int) -> dict[str, Any]:
  """Fits the step model (compute from the parity phase + exchange_time on the emulated
  cluster) to the TTA_FITTED bandwidths' rows and predicts the others."""
  from scipy.optimize import least_squares
  local = tta["meta"]["local"]
  compute = float(np.median([r["jax"]["step_s"] for r in tta["parity"]]))
  rows = tta_rows(tta)
  dense = [r for r in rows if r["algorithm"] == "dense" and r["rate_bps"] is not None]
  overhead = float(np.median([r["link_bytes"] / link_bytes("dense", n, 1.0, 2, local)
                              for r in dense]))

  def predict(params, r):
    cl = tta_cluster(params, r["rate_bps"], overhead, local)
    return compute + exchange_time(r["algorithm"], n, r["density"], cl)["total"]

  fit_rows = [r for r in rows if r["bandwidth"] in TTA_FITTED]

  def residuals(params):
    return [math.log(predict(params, r) / r["measured_s"]) for r in fit_rows]

  # start: 5 ms per collective, gloo at 300 MB/s, 1 GB/s between the devices of a process,
  # 2 ns per value selected, 10 ns per pair, 1 ns per pass value
  fit = least_squares(residuals, np.log([5e-3, 3e8, 1e9, 2e-9, 1e-8, 1e-9]))
  out = []
  for r in rows:
    pred = predict(fit.x, r)
    model_bytes = link_bytes(r["algorithm"], n, r["density"], 2, local) * overhead
    out.append({**r, "predicted_s": pred, "error": pred / r["measured_s"] - 1,
                "held_out": r["bandwidth"] not in TTA_FITTED,
                "link_bytes_model": model_bytes})
  held = [abs(o["error"]) for o in out if o["held_out"]]
  call, net, intra, select, pair, pas = np.exp(fit.x)
  return {"fitted": ", ".join(TTA_FITTED), "compute_s": compute, "n": n,
          "params": {"call_s": call, "net_Bps": net, "intra_Bps": intra,
                     "select_s_per_value": select, "pair_s": pair, "pass_s_per_value": pas,
                     "link_overhead": overhead},
          "rows": out, "held_out_max_abs_error": max(held) if held else None,
          "held_out_median_abs_error": float(np.median(held)) if held else None,
          "held_out_within_25": int(sum(h <= 0.25 for h in held)), "held_out_rows": len(held)}


PROJECTED_CLUSTERS = (("paper: 16 x 8 V100, 25 Gbit/s", "v100", 25.0),
                      ("current: 16 x 8 H100, 25 Gbit/s", "h100", 25.0),
                      ("current: 16 x 8 H100, 100 Gbit/s", "h100", 100.0))


def steps_ratios(tta: dict[str, Any]) -> dict[str, float]:
  """Steps to the target of each system over dense's (medians over seeds) in the study."""
  med = {}
  for system, e in tta.get("analysis", {}).items():
    steps = [s["steps_to_target"] for s in e["seeds"] if s["steps_to_target"] is not None]
    if steps:
      med[system] = float(np.median(steps))
  return {s: v / med["dense"] for s, v in med.items()} if "dense" in med else {}


def project_tta(tta: dict[str, Any], batch_per_gpu: int) -> dict[str, Any]:
  """Time to accuracy of the DAWNBench recipe on the paper's and a current cluster: the
  recipe's iterations (stretched by the study's steps-to-target ratio of the matching system)
  times the projected iteration time."""
  ratios = steps_ratios(tta)
  rows = []
  for name, gpu, link in PROJECTED_CLUSTERS:
    dense = dawnbench_seconds("dense", batch_per_gpu, gpu, link)
    for alg in PROJECTED:
      scale = ratios.get(alg, 1.0)
      t = dawnbench_seconds(alg, batch_per_gpu, gpu, link, scale)
      rows.append({"cluster": name, "algorithm": alg, "steps_ratio": scale, "seconds": t,
                   "vs_dense": dense / t,
                   "exchange_over_compute": iteration("dense", 16, batch_per_gpu, 128, gpu,
                                                      link)["comm_s"]
                   / iteration("dense", 16, batch_per_gpu, 128, gpu, link)["compute_s"]})
  return {"rows": rows, "steps_ratios": ratios}


def _rate(bytes_per_s: float) -> str:
  """A fitted rate in MB/s; past 1 TB/s the data did not bound it (the fit's value is noise)."""
  if bytes_per_s > 1e12:
    return "unbounded (> 1 TB/s: no row limited by it)"
  return f"{bytes_per_s / 1e6:.0f} MB/s"


def tta_table(cal: dict[str, Any], proj: dict[str, Any]) -> str:
  p = cal["params"]
  lines = ["", "### 3. The link-bound time-to-accuracy runs (time_to_accuracy.json)", "",
           f"Step = compute ({cal['compute_s'] * 1e3:.1f} ms, the parity phase) + the exchange "
           f"of {cal['n']:,} values. Fitted to the {cal['fitted']} rows: "
           f"{p['call_s'] * 1e3:.2f} ms per collective, gloo {_rate(p['net_Bps'])}, "
           f"{p['intra_Bps'] / 1e9:.2f} GB/s between a process's devices, select "
           f"{p['select_s_per_value'] * 1e9:.2f} ns/value, {p['pair_s'] * 1e9:.1f} ns/pair, "
           f"pass {p['pass_s_per_value'] * 1e9:.2f} ns/value; link overhead "
           f"{p['link_overhead']:.3f} (interface bytes / ring payload, dense rows).", "",
           "| system | bandwidth | density | measured ms | predicted ms | error | link MB "
           "measured / model | held out |", "|---|---|---:|---:|---:|---:|---:|---|"]
  for r in sorted(cal["rows"], key=lambda r: (r["system"], r["rate_bps"] or 1e18, r["density"])):
    lines.append(f"| {r['system']} | {r['bandwidth']} | {r['density']:g} | "
                 f"{r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | "
                 f"{100 * r['error']:+.0f}% | {r['link_bytes'] / 1e6:.2f} / "
                 f"{r['link_bytes_model'] / 1e6:.2f} | {'yes' if r['held_out'] else 'fit'} |")
  if cal["held_out_rows"]:
    lines += ["", f"Held-out rows: {cal['held_out_within_25']} of {cal['held_out_rows']} within "
              f"25%, median |error| {100 * cal['held_out_median_abs_error']:.0f}%, max "
              f"{100 * cal['held_out_max_abs_error']:.0f}%."]
  lines += ["", "Projected time to accuracy, DAWNBench recipe (28 epochs of ResNet-50 at 128/224/"
            "288 px, 256 images/GPU), training only; sparse runs stretched by the study's "
            "steps-to-target ratio (" + ", ".join(f"{k} {v:.2f}" for k, v in
                                                  proj["steps_ratios"].items()) + "):", "",
            "| cluster | dense exchange / compute at 128 px | " + " | ".join(PROJECTED) + " |",
            "|---|---:|" + "---:|" * len(PROJECTED)]
  for name, _, _ in PROJECTED_CLUSTERS:
    by = {r["algorithm"]: r for r in proj["rows"] if r["cluster"] == name}
    ratio = by["dense"]["exchange_over_compute"]
    lines.append(f"| {name} | {ratio:.2f} | " + " | ".join(
        f"{by[a]['seconds']:.0f} s ({by[a]['vs_dense']:.2f}x)" for a in PROJECTED) + " |")
  lines += ["", "| input | value | source |", "|---|---|---|"]
  for k, (v, src) in GPU_SOURCES.items():
    lines.append(f"| {k} | {v if isinstance(v, tuple) else f'{v:.4g}'} | {src} |")
  return "\n".join(lines)


# --- output ---------------------------------------------------------------------------------

def table(cal: dict[str, Any], proj: dict[str, Any], batch: int,
          cal_rate: dict[str, Any] | None = None) -> str:
  p = cal["params"]
  lines = [
      "### 1. Calibration on the emulated cluster (2 nodes x 2 processes, bench_comm.json)",
      "",
      f"Fitted to the ResNet-50 rows: {p['call_s'] * 1e3:.0f} ms per collective call, gloo "
      f"throughput {p['net_Bps'] / 1e6:.0f} MB/s per process, MSTopK "
      f"{p['select_slowdown']:.2f}x its time alone (bench_topk.json), "
      f"{p['pair_s'] * 1e9:.0f} ns per pair scatter-added, elementwise pass "
      f"{p['pass_s_per_value'] * 1e9:.2f} ns/value; link overhead {p['link_overhead']:.3f} "
      "(tc bytes / payload). Transformer-base rows are held out (predicted, not fitted).",
      "",
      "| rate | size | algorithm | measured s | predicted s | error | held out |",
      "|---|---|---|---:|---:|---:|---|"]
  for r in cal["rows"]:
    lines.append(f"| {r['rate']} | {r['size']} | {r['algorithm']} | {r['measured_s']:.3f} | "
                 f"{r['predicted_s']:.3f} | {100 * r['error']:+.0f}% | "
                 f"{'yes' if r['held_out'] else 'fit'} |")
  lines += ["", f"Held-out rows: median |error| {100 * cal['held_out_median_abs_error']:.0f}%, "
            f"max {100 * cal['held_out_max_abs_error']:.0f}% (target: within 25%); fitted rows: "
            f"max {100 * cal['fit_max_abs_error']:.0f}%."]
  if cal_rate is not None:
    q = cal_rate["params"]
    misses = [f"{r['rate']} {r['size']} {r['algorithm']} {100 * r['error']:+.0f}%"
              for r in cal_rate["rows"] if r["held_out"] and abs(r["error"]) > 0.25]
    held = sum(r["held_out"] for r in cal_rate["rows"])
    lines += ["", f"Second split, fitted to {cal_rate['fitted']}: {q['call_s'] * 1e3:.0f} ms "
              f"per call, gloo {q['net_Bps'] / 1e6:.0f} MB/s, MSTopK "
              f"{q['select_slowdown']:.2f}x, {q['pair_s'] * 1e9:.0f} ns per pair, pass "
              f"{q['pass_s_per_value'] * 1e9:.2f} ns/value. Held-out rows: median |error| "
              f"{100 * cal_rate['held_out_median_abs_error']:.0f}%, max "
              f"{100 * cal_rate['held_out_max_abs_error']:.0f}%; "
              f"{held - len(misses)} of {held} within 25%"
              + (f" (missed: {'; '.join(misses)})" if misses else "") + "; fitted rows: max "
              f"{100 * cal_rate['fit_max_abs_error']:.0f}%."]
  lines += ["",
            f"### 2. Projection: ResNet-50 on N nodes x 8 V100, 25 Gbit/s, {batch} images/GPU, "
            "224 px", "",
            "| nodes | GPUs | " + " | ".join(PROJECTED) + " | hitopk-0.001 vs dense | "
            "vs dense+overlap |",
            "|---:|---:|" + "---:|" * (len(PROJECTED) + 2)]
  for nodes in (1, 2, 4, 8, 16):
    by = {r["algorithm"]: r for r in proj["rows"] if r["nodes"] == nodes}
    cells = [f"{by[a]['images_per_s']:,.0f} img/s ({by[a]['iteration_s'] * 1e3:.0f} ms)"
             for a in PROJECTED]
    h = by["hitopk-0.001"]["images_per_s"]
    lines.append(f"| {nodes} | {nodes * 8} | " + " | ".join(cells) +
                 f" | {h / by['dense']['images_per_s']:.2f}x | "
                 f"{h / by['dense+overlap']['images_per_s']:.2f}x |")
  d = proj["dawnbench_28_epochs_s"]
  lines += ["", "DAWNBench recipe, 28 epochs on 16 x 8 V100 (training only, no evaluation or "
            "input pipeline): " + ", ".join(f"{a} {s:.0f} s" for a, s in d.items()) +
            f"; the paper: ~{SOURCES['paper_dawnbench_s'][0]:.0f} s.", "",
            "Inputs:", "", "| input | value | source |", "|---|---|---|"]
  for k, (v, src) in SOURCES.items():
    lines.append(f"| {k} | {v if isinstance(v, tuple) else f'{v:.4g}'} | {src} |")
  return "\n".join(lines)


def plot(cal: dict[str, Any], proj: dict[str, Any], png: str) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot")
    return
  fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
  for held, marker in ((False, "o"), (True, "s")):
    rs = [r for r in cal["rows"] if r["held_out"] == held]
    a.scatter([r["measured_s"] for r in rs], [r["predicted_s"] for r in rs], marker=marker,
              label="held out (Transformer-base)" if held else "fitted (ResNet-50)")
  lim = [0.3, 20]
  a.plot(lim, lim, "k-", lw=0.8)
  a.fill_between(lim, [x * 0.75 for x in lim], [x * 1.25 for x in lim], color="grey", alpha=0.2,
                 label="+-25%")
  a.set_xscale("log")
  a.set_yscale("log")
  a.set_xlabel("measured s (emulated cluster)")
  a.set_ylabel("predicted s")
  a.set_title("calibration: one gradient exchange")
  a.legend(fontsize=8)
  for alg in PROJECTED:
    rs = [r for r in proj["rows"] if r["algorithm"] == alg]
    b.plot([r["gpus"] for r in rs], [r["images_per_s"] for r in rs], marker="o", label=alg)
  b.set_xscale("log", base=2)
  b.set_xlabel("V100 GPUs (8 per node, 25 Gbit/s between nodes)")
  b.set_ylabel("images/s (ResNet-50, predicted)")
  b.set_title("projection")
  b.grid(alpha=0.3)
  b.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(png + ".tmp.png", dpi=110)
  os.replace(png + ".tmp.png", png)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  benchmarks = os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks", "results")
  p.add_argument("--comm", default=os.path.join(benchmarks, "bench_comm.json"))
  p.add_argument("--topk", default=os.path.join(benchmarks, "bench_topk.json"))
  p.add_argument("--tta", default=os.path.join(os.path.dirname(HERE), "time_to_accuracy", "results",
                                             "time_to_accuracy.json"),
                 help="the time-to-accuracy study's results (section 3; skipped if absent)")
  p.add_argument("--batch-per-gpu", type=int, default=256)
  p.add_argument("--out", type=json_path,
                 default=os.path.join(HERE, "results", "scaling_model.json"))
  args = p.parse_args(argv)
  if args.batch_per_gpu < 1:
    p.error(f"--batch-per-gpu must be >= 1, got {args.batch_per_gpu}")
  for flag, path in (("--comm", args.comm), ("--topk", args.topk)):
    if not os.path.exists(path):
      script = "exchange" if flag == "--comm" else flag[2:]
      p.error(f"{flag} {path!r} does not exist: run benchmarks/{script}.py first")
  comm = json.load(open(args.comm))
  topk = json.load(open(args.topk))["results"]
  cal = calibrate(comm["results"], topk, "size")
  cal_rate = calibrate(comm["results"], topk, "rate")
  proj = project(args.batch_per_gpu)
  text = table(cal, proj, args.batch_per_gpu, cal_rate)
  tta_cal = tta_proj = None
  if os.path.exists(args.tta):
    tta = json.load(open(args.tta))
    tta_cal = calibrate_tta(tta, tta_model_size(tta))
    tta_proj = project_tta(tta, args.batch_per_gpu)
    text += "\n" + tta_table(tta_cal, tta_proj)
  else:
    print(f"{args.tta} does not exist: no section 3 (run studies/time_to_accuracy/run.py)")
  payload = {"command": command_line("studies/scaling_model/run.py", argv or sys.argv[1:]),
             "comm_source": portable_path(args.comm),
             "calibration": cal, "calibration_rate_split": cal_rate, "projection": proj,
             "time_to_accuracy_calibration": tta_cal, "time_to_accuracy_projection": tta_proj,
             "batch_per_gpu": args.batch_per_gpu,
             "sources": {k: {"value": v, "source": s} for k, (v, s) in SOURCES.items()}}
  md = write_results(args.out, payload, text)
  plot(cal, proj, os.path.splitext(args.out)[0] + ".png")
  print(text)
  print(f"wrote {args.out}, {md}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
