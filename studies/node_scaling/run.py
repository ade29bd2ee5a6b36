"""The exchange against the node count, from 2 emulated nodes to 1,024 real ones: `sparsejax.cost`
fitted to benchmarks/scale.py's measurements, checked on node counts it did not see,
then projected to GPU clusters.

  python -m studies.node_scaling.run [--scale benchmarks/results/bench_scale.json]
      [--merge benchmarks/results/bench_merge.json] [--fit-nodes 2,3,4,8]
      [--out studies/node_scaling/results/node_scaling.json]

1. Calibration. The emulated cluster of bench_scale (P nodes of one process, links of the
   measured rate) as a `cost.Cluster`: the link's rate over the bytes' overhead (headers; the
   interface counters over the payload of the fitted dense and all-gather rows); a merge's
   seconds as measured alone on one core (benchmarks/merge.py), times P / cores (this
   machine's 2 cores run every node's merge; a real node runs its own); and three fitted
   parameters, least squares on log(predicted / measured) of the exchange medians at
   `--fit-nodes` (default 2, 3, 4, 8: both kinds of swap): a latency per message of the
   store-and-forward collectives (alpha: an all-gather's ring step, a gTop-k round, the fold;
   gloo's ring all-reduce pipelines its chunks, so the dense exchange and gTop-k's sums are
   their bytes at the link's rate),
   gTop-k's pairwise exchange over one direction's time (`swap_factor`: gloo's two-worker
   all-gather need not fully overlap the two directions; `odd_swap_factor`: with an odd node
   count the swap is a ppermute, whose directions gloo runs one after the other). Every other
   node count is held out: predicted, not fitted (target: within 20%).
2. Projection with published figures (each with its source in the table): the paper's cluster
   (8 V100 a node, 25 Gbit/s) and H100 nodes of 8 on 25 and 100 Gbit/s, at 16, 128 and 1,024
   nodes, for ResNet-50 (25,557,032 parameters) and BERT-large (335M), fp32 gradients, density
   0.001: the exchange (dense ring, hierarchical, HiTopKComm with TopK all-gather between nodes,
   HiTopKComm with gTop-k between nodes) and the step (compute + exchange, not overlapped).
   On a GPU the swap is full duplex (NCCL send/recv) and a merge costs what sorting 2k pairs
   costs there (assumptions, stated with the inputs). The projection takes none of section 1's
   fitted values (they describe gloo on this machine): section 1 checks the model's form
   (rounds, messages, bytes, what shares a link) against measurements at node counts it did
   not see; the GPU clusters' constants are published or assumed.

Writes JSON, a markdown table and a plot (exchange time against nodes: the measured points with
the model's lines, and the projection).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any

import numpy as np

from sparsejax import cost
from sparsejax.bench import command_line, json_path, portable_path, spread, write_results
from studies.scaling_model.run import GPU_SOURCES, GPUS, SOURCES, gpu_cluster

HERE = os.path.dirname(os.path.abspath(__file__))

MEASURED = ("allgather", "gtopk", "dense")
PROJECTED = ("dense", "hierarchical", "hitopk", "higtopk")
NODES = (16, 128, 1024)
DENSITY = 0.001
# model -> (parameters, {gpu: (seconds of compute per step, its source)})
MODELS = {
    "resnet50": (25_557_032, {
        "v100": (256 / SOURCES["v100_images_per_s"][0], "256 images / 1,200 img/s (v100 row)"),
        "h100": (256 / GPUS["h100"]["images_per_s"], "256 images / 4,200 img/s (h100 row)")}),
    "bert_large": (335_000_000, {
        "v100": (64 / 224, "64 sequences of 128 / 224 seq/s: DGX-1 V100 32G, micro-batch 64 "
                           "(NVIDIA DeepLearningExamples PyTorch/LanguageModeling/BERT README; "
                           "docs/exchange-compute-ratio.md S7)"),
        "h100": (64 / 1550, "64 sequences / 1,550 seq/s: H100 at 40-50% MFU of 989 TFLOPS "
                            "(derived, range 1,200-1,900; docs/exchange-compute-ratio.md S7, "
                            "S9)")}),
}
CLUSTERS = {"paper: 8 V100, 25 Gbit/s": ("v100", 25.0), "8 H100, 25 Gbit/s": ("h100", 25.0),
            "8 H100, 100 Gbit/s": ("h100", 100.0)}
GPU_MERGE = {
    "merge_s_per_pair": (1e-9, "a merge sorts 2k (index, value) pairs and takes their top k: "
                         "~1 ns a pair on a V100 (radix sort at ~1 G pairs/s; assumption), "
                         "scaled to other GPUs by memory bandwidth"),
    "swap_factor": (1.0, "NCCL's send/recv over TCP sockets: both directions at once "
                         "(assumption: full-duplex NICs)"),
    "odd_swap_factor": (1.0, "the same for a ppermute swap"),
    "allreduce_tree": (True, "NCCL picks a tree all-reduce where it is faster (latency 2 log2 "
                             "G steps instead of the ring's 2(G-1); NCCL_ALGO Tree/Ring, NCCL "
                             "docs)"),
}


# ----------------------------------------------------------------------------- 1. calibration

def measured_rows(scale: dict[str, Any]) -> list[dict[str, Any]]:
  """(nodes, algorithm, per-run exchange medians, bytes) from bench_scale's analysis."""
  return [{"nodes": r["nodes"], "algorithm": r["algorithm"], "runs_s": r["exchange_s"],
           "measured_s": statistics.median(r["exchange_s"]),
           "link_bytes": statistics.median(r["link_bytes_mean"]), "wire_bytes": r["wire_bytes"]}
          for r in scale["analysis"] if r["algorithm"] in MEASURED]


def link_overhead(rows: list[dict[str, Any]]) -> float:
  """Interface bytes over payload bytes (headers), median over the bulk rows."""
  return statistics.median(r["link_bytes"] / r["wire_bytes"] for r in rows
                           if r["algorithm"] in ("dense", "allgather"))


def emulated(params: np.ndarray, nodes: int, meta: dict[str, Any], overhead: float,
             merge: float) -> cost.Cluster:
  """bench_scale's cluster of `nodes` one-process nodes under log-parameters (alpha,
  swap_factor - 1, odd_swap_factor - 1); `merge`: seconds per candidate pair on a core of its
  own."""
  alpha, swap, odd = np.exp(params)
  return cost.Cluster(nodes=nodes, local=1, inter_Bps=meta["rate_bps"] / 8 / overhead,
                      intra_Bps=math.inf, inter_alpha_s=alpha, intra_alpha_s=0.0, call_s=0.0,
                      select_s=lambda n, k: 0.0, pair_s=0.0, pass_s_per_value=0.0,
                      merge_s_per_pair=merge * max(1.0, nodes / meta["cpus"]),
                      swap_factor=1.0 + swap, odd_swap_factor=1.0 + odd,
                      allreduce_pipelined=True)


def predict(params, row, meta, overhead, merge) -> float:
  n = meta["n_dense"] if row["algorithm"] == "dense" else meta["n"]
  density = 1.0 if row["algorithm"] == "dense" else meta["density"]
  return cost.network_time(row["algorithm"], n, density,
                           emulated(params, row["nodes"], meta, overhead, merge))


def calibrate(scale: dict[str, Any], merge: float, fit_nodes: tuple[int, ...]
              ) -> dict[str, Any]:
  """Fits (alpha, swap factors) to the rows at `fit_nodes`, predicts every row."""
  from scipy.optimize import least_squares
  meta = scale["meta"]
  rows = measured_rows(scale)
  fit = [r for r in rows if r["nodes"] in fit_nodes]
  if not fit:
    raise ValueError(f"no measured rows at --fit-nodes {fit_nodes}; measured: "
                     f"{sorted({r['nodes'] for r in rows})}")
  overhead = link_overhead(fit)  # from the fitted rows only: held-out rows stay unseen

  def residuals(p):
    return [math.log(predict(p, r, meta, overhead, merge) / r["measured_s"]) for r in fit]

  sol = least_squares(residuals, np.log([1e-3, 0.3, 0.9]), bounds=(
      np.log([1e-6, 1e-3, 1e-3]), np.log([1.0, 3.0, 3.0])))
  out = []
  for r in rows:
    pred = predict(sol.x, r, meta, overhead, merge)
    out.append({**r, "predicted_s": pred, "error": pred / r["measured_s"] - 1,
                "held_out": r["nodes"] not in fit_nodes})
  alpha, swap, odd = np.exp(sol.x)
  held = [abs(r["error"]) for r in out if r["held_out"]]
  return {"fit_nodes": list(fit_nodes), "link_overhead": overhead, "log_params": sol.x.tolist(),
          "params": {"alpha_s": alpha, "swap_factor": 1 + swap, "odd_swap_factor": 1 + odd,
                     "merge_s_per_pair": merge},
          "rows": out, "held_out_max_abs_error": max(held) if held else None,
          "fit_max_abs_error": max(abs(r["error"]) for r in out if not r["held_out"])}


# ----------------------------------------------------------------------------- 2. projection

def gpu_scale_cluster(nodes: int, gpu: str, link_gbit: float) -> cost.Cluster:
  """scaling_model's GPU cluster with gTop-k's inputs (GPU_MERGE) added."""
  import dataclasses
  mem = 0.9e12 / GPUS[gpu]["memory_Bps"]
  return dataclasses.replace(gpu_cluster(nodes, gpu, link_gbit),
                             merge_s_per_pair=mem * GPU_MERGE["merge_s_per_pair"][0],
                             swap_factor=GPU_MERGE["swap_factor"][0],
                             odd_swap_factor=GPU_MERGE["odd_swap_factor"][0],
                             allreduce_tree=GPU_MERGE["allreduce_tree"][0])


def project() -> list[dict[str, Any]]:
  rows = []
  for model, (n, compute) in MODELS.items():
    for name, (gpu, gbit) in CLUSTERS.items():
      for nodes in NODES:
        cl = gpu_scale_cluster(nodes, gpu, gbit)
        step_compute = compute[gpu][0]
        for algorithm in PROJECTED:
          density = 1.0 if algorithm in ("dense", "hierarchical") else DENSITY
          parts = cost.exchange_time(algorithm, n, density, cl)
          rows.append({"model": model, "cluster": name, "nodes": nodes, "gpus": nodes * 8,
                       "algorithm": algorithm, "exchange_s": parts["total"],
                       "network_s": sum(v for k, v in parts.items() if k in cost.NETWORK_PARTS),
                       "compute_s": step_compute, "step_s": step_compute + parts["total"]})
  return rows


# ----------------------------------------------------------------------------- report

def tables(cal: dict[str, Any], proj: list[dict[str, Any]], scale: dict[str, Any],
           command: str) -> str:
  m, p = scale["meta"], cal["params"]
  lines = [f"### 1. The model on the emulated cluster ({m['rate']} links, {m['size']}, density "
           f"{m['density']}; measured: {m['command']}, {m['date']})", "",
           f"Fitted to the {', '.join(map(str, cal['fit_nodes']))}-node rows: alpha "
           f"{p['alpha_s'] * 1e3:.2f} ms a message, swap_factor {p['swap_factor']:.2f} "
           f"(odd node counts {p['odd_swap_factor']:.2f}); measured: a merge "
           f"{p['merge_s_per_pair'] * 1e9:.0f} ns a candidate pair on a core of its own "
           f"(benchmarks/merge.py; x P / {m['cpus']} cores here), the link's byte "
           f"overhead {cal['link_overhead']:.3f}. "
           "Held-out rows: largest |error| "
           + (f"{cal['held_out_max_abs_error']:.0%}." if cal["held_out_max_abs_error"] is not None
              else "none held out."), "",
           "| nodes | algorithm | measured s (runs min / median / max) | model s | error | "
           "held out |", "|---:|---|---:|---:|---:|---|"]
  for r in sorted(cal["rows"], key=lambda r: (r["algorithm"], r["nodes"])):
    lines.append(f"| {r['nodes']} | {r['algorithm']} | {spread(r['runs_s'], 3)} | "
                 f"{r['predicted_s']:.3f} | {r['error']:+.0%} | "
                 f"{'yes' if r['held_out'] else 'fit'} |")
  lines += ["", f"### 2. Projection: exchange and step, fp32 gradients, density {DENSITY} for "
            "the sparse ones; seconds", "",
            "| model | cluster | nodes | dense | hierarchical | HiTopKComm (all-gather) | "
            "HiTopKComm-gTop-k | HiTopKComm-gTop-k speed-up | step: best dense / HiTopKComm / "
            "HiTopKComm-gTop-k |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
  by = {(r["model"], r["cluster"], r["nodes"], r["algorithm"]): r for r in proj}
  for model in MODELS:
    for cluster in CLUSTERS:
      for nodes in NODES:
        e = {a: by[(model, cluster, nodes, a)] for a in PROJECTED}
        best_dense = min(e["dense"]["step_s"], e["hierarchical"]["step_s"])
        lines.append(
            f"| {model} | {cluster} | {nodes} | " + " | ".join(
                f"{e[a]['exchange_s']:.4f}" for a in PROJECTED)
            + f" | {e['hitopk']['exchange_s'] / e['higtopk']['exchange_s']:.1f}x | "
            f"{best_dense:.3f} / {e['hitopk']['step_s']:.3f} / {e['higtopk']['step_s']:.3f} |")
  lines += ["", "Inputs and their sources:", "", "| input | value | source |", "|---|---|---|"]
  for key, (value, source) in {**SOURCES, **GPU_SOURCES, **GPU_MERGE}.items():
    lines.append(f"| {key} | {value:.4g} | {source} |" if isinstance(value, float)
                 else f"| {key} | {value} | {source} |")
  for model, (_, compute) in MODELS.items():
    for gpu, (seconds, source) in compute.items():
      lines.append(f"| {model} compute a step, {gpu} | {seconds * 1e3:.1f} ms | {source} |")
  lines += ["", f"Command: `{command}`."]
  return "\n".join(lines)


def plot(cal: dict[str, Any], proj: list[dict[str, Any]], scale: dict[str, Any],
         png: str) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot")
    return
  meta, params = scale["meta"], np.asarray(cal["log_params"])
  merge = cal["params"]["merge_s_per_pair"]
  fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))
  names = {"allgather": "TopK all-gather", "gtopk": "gTop-k", "dense": "dense (measured part)"}
  for i, algorithm in enumerate(MEASURED):
    rows = [r for r in cal["rows"] if r["algorithm"] == algorithm]
    if not rows:
      continue
    xs = [r["nodes"] for r in rows]
    lo = [r["measured_s"] - min(r["runs_s"]) for r in rows]
    hi = [max(r["runs_s"]) - r["measured_s"] for r in rows]
    a.errorbar(xs, [r["measured_s"] for r in rows], yerr=[lo, hi], fmt="o", color=f"C{i}",
               label=f"{names[algorithm]}: measured")
    grid = list(range(2, max(xs) + 1))
    a.plot(grid, [predict(params, {"algorithm": algorithm, "nodes": p}, meta,
                          cal["link_overhead"], merge) for p in grid], color=f"C{i}", lw=1,
           label=f"{names[algorithm]}: model")
  a.set_xlabel("nodes (one process each)")
  a.set_ylabel("exchange, s")
  a.set_title(f"Emulated, {meta['rate']} links, {meta['size']} at {meta['density']}", fontsize=10)
  a.legend(fontsize=7)
  labels = {"dense": "dense ring", "hierarchical": "hierarchical", "hitopk": "HiTopKComm",
            "higtopk": "HiTopKComm-gTop-k"}
  grid = [2 ** i for i in range(1, 11)]
  for i, algorithm in enumerate(PROJECTED):
    for cluster, style in (("paper: 8 V100, 25 Gbit/s", "-"), ("8 H100, 100 Gbit/s", "--")):
      gpu, gbit = CLUSTERS[cluster]
      ys = [cost.exchange_time(algorithm, MODELS["resnet50"][0],
                               1.0 if algorithm in ("dense", "hierarchical") else DENSITY,
                               gpu_scale_cluster(p, gpu, gbit))["total"] for p in grid]
      b.plot(grid, ys, style, color=f"C{i}", label=f"{labels[algorithm]}, {cluster}")
  for ax in (a, b):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
  b.set_xlabel("nodes (8 GPUs each)")
  b.set_ylabel("exchange, s (model)")
  b.set_title("Projection: ResNet-50, fp32, density 0.001", fontsize=10)
  b.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(png, dpi=120)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  benchmarks = os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks", "results")
  ap.add_argument("--scale", default=os.path.join(benchmarks, "bench_scale.json"))
  ap.add_argument("--merge", default=os.path.join(benchmarks, "bench_merge.json"))
  ap.add_argument("--fit-nodes", default="2,3,4,8")
  ap.add_argument("--out", type=json_path,
                  default=os.path.join(HERE, "results", "node_scaling.json"))
  args = ap.parse_args(argv)
  for flag, path in (("--scale", args.scale), ("--merge", args.merge)):
    if not os.path.exists(path):
      ap.error(f"{flag} {path!r} does not exist: run benchmarks/{flag[2:]}.py first")
  try:
    fit_nodes = tuple(int(v) for v in args.fit_nodes.split(","))
  except ValueError:
    ap.error(f"--fit-nodes must be node counts such as 2,4,8, got {args.fit_nodes!r}")
  with open(args.scale) as f:
    scale = json.load(f)
  with open(args.merge) as f:
    merge = statistics.median(json.load(f)["s_per_pair"])
  try:
    cal = calibrate(scale, merge, fit_nodes)
  except ValueError as e:
    ap.error(str(e))
  proj = project()
  command = command_line("studies/node_scaling/run.py", sys.argv[1:] if argv is None else argv)
  text = tables(cal, proj, scale, command)
  write_results(args.out, {"command": command, "scale_source": portable_path(args.scale),
                           "merge_source": portable_path(args.merge),
                           "calibration": cal, "projection": proj}, text)
  plot(cal, proj, scale, os.path.splitext(args.out)[0] + ".png")
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
