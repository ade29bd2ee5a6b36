"""One gradient exchange on an emulated cloud cluster: sparsejax's algorithms vs PyTorch's.

  python -m benchmarks.exchange [--quick] [--rates 1gbit,200mbit] [--reps 5]
                                   [--sizes resnet50,transformer_base] [--no-torch]
                                   [--out benchmarks/results/bench_comm.json]     (needs root)
  python -m benchmarks.exchange --local [--sizes ...] [--reps 5]
                                   [--out benchmarks/results/bench_comm_local.json]

The cluster: 2 nodes x 2 processes x 1 CPU device (`sparsejax.cluster.EmulatedCluster`: a network
namespace per node, its link limited with tc tbf to each rate; processes of a node share its
loopback). For a gradient of ResNet-50 size (25,557,032 float32) and of Transformer-base size
(60,524,544), each process times one exchange of its own random buffer:

  dense          one all-reduce over all 4 workers (XLA's psum, gloo);
  hierarchical   reduce-scatter in the node, all-reduce between nodes, all-gather in the node;
  allgather-D    TopK all-gather at density D: MSTopK on the whole buffer, (value, index) pairs
                 all-gathered by all workers, scatter-add;
  hitopk-D       HiTopKComm at density D: dense reduce-scatter in the node, MSTopK on the shard,
                 pairs all-gathered between nodes, all-gather in the node;
  torch-allreduce / torch-powersgd   PyTorch 2.13 (gloo) on the same cluster: the all-reduce DDP
                 issues for that many gradients, and DDP's PowerSGD hook (rank 4) on a model of
                 ResNet-50's parameter shapes (a backward pass whose gradients are all ones).

`--local`: no cluster. The same JAX exchanges in one process on 4 CPU devices (the 2 x 2 mesh),
their collectives copies in memory: what the exchanges cost this machine's 2 cores when 4 workers
share them, without gloo or a link (the split the scaling model's check needs). With `--parts`,
each sparse exchange is also set against its parts timed alone on the same mesh (MSTopK on the
whole buffer for TopK all-gather; MSTopK on a shard plus the two dense intra-node phases for
HiTopKComm); `--procs P` repeats it all in P separate processes (min-median-max of the ratios).

Every call is timed after a barrier: median and quartiles over `--reps` calls after a warm-up.
Bytes on the inter-node link: node 0's egress counted by tc during the timed calls. The bound is
those bytes at the link's rate. Writes JSON, a markdown table and a PNG plot.
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

import numpy as np

from sparsejax.bench import (
  command_line,
  json_path,
  launch_workers,
  python_module,
  time_stats,
  write_results,
)

HERE = os.path.dirname(os.path.abspath(__file__))

SIZES = {"resnet50": 25_557_032, "transformer_base": 60_524_544,
         "tiny": 40_009}  # tiny: for the code path's test
DENSITIES = (0.01, 0.001)
NODES, PROCS = 2, 2


def time_exchange(call, barrier, reps: int, measure_link: bool, **labels) -> dict:
  """Times `call()` `reps` times, each after `barrier()`; with `measure_link`, the bytes this
  node sent over its link during the calls (tc), per call."""
  from sparsejax import cluster
  times, sent = [], 0
  for _ in range(reps):
    barrier()
    before = cluster.qdisc_sent_bytes() if measure_link else 0
    t0 = time.perf_counter()
    call()
    times.append(time.perf_counter() - t0)
    sent += (cluster.qdisc_sent_bytes() - before) if measure_link else 0
  return {**labels, **time_stats(times), "node_egress_bytes": sent / reps if measure_link else None}


def _report(rank: int, row: dict, results: list[dict]) -> None:
  if rank == 0:
    print(json.dumps(row), flush=True)
  results.append(row)


# ----------------------------------------------------------------------------- JAX worker

def exchange_algorithms(n: int, per_node: int) -> dict:
  """name -> the exchange of a length-`n` buffer per worker, to run inside `shard_map` over the
  mesh `(node, local)` with `per_node` workers a node."""
  from sparsejax import comm, topk
  from sparsejax.train.mesh import WORKERS

  algos = {"dense": lambda v: comm.dense_allreduce(v, axes=WORKERS),
           "hierarchical": lambda v: comm.hierarchical_allreduce(v, node_axis="node",
                                                                 local_axis="local")}
  for d in DENSITIES:
    k_all, k_shard = max(1, round(d * n)), max(1, round(d * n / per_node))
    algos[f"allgather-{d}"] = (lambda v, k=k_all: comm.topk_allgather(
        v, k, axes=WORKERS, select=topk.mstopk)[0])
    algos[f"hitopk-{d}"] = (lambda v, k=k_shard: comm.hitopk_allreduce(
        v, k, node_axis="node", local_axis="local", select=topk.mstopk)[0])
  return algos


def reference_parts(n: int, per_node: int) -> dict:
  """name -> (fn, input length): the parts of the sparse exchanges measured alone (--local), on
  the same mesh: MSTopK on the whole per-worker buffer (TopK all-gather's selection), MSTopK on
  a shard of n / per_node (HiTopKComm's), and HiTopKComm's two dense intra-node phases."""
  from jax import lax

  from sparsejax import topk
  parts = {"dense-phases": (lambda v: lax.all_gather(
      lax.psum_scatter(v, "local", scatter_dimension=0, tiled=True), "local", axis=0,
      tiled=True), n)}
  for d in DENSITIES:
    k_all, k_shard = max(1, round(d * n)), max(1, round(d * n / per_node))
    parts[f"select-{d}"] = (lambda v, k=k_all: topk.mstopk(v, k)[0], n)
    parts[f"select-shard-{d}"] = (lambda v, k=k_shard: topk.mstopk(v, k)[0], n // per_node)
  return parts


def run_jax(args, rank: int, measure_link: bool) -> list[dict]:
  """Times every exchange on every size over this process's view of the 2-node mesh."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from sparsejax.train.mesh import WORKERS, make_mesh

  per_node = jax.device_count() // NODES  # workers per node (processes x devices per process)
  mesh = make_mesh(NODES, per_node)
  spec = NamedSharding(mesh, P(WORKERS))
  barrier = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, WORKERS), mesh=mesh,
                                  in_specs=P(WORKERS), out_specs=P()))
  token = jax.make_array_from_process_local_data(
      spec, np.ones(jax.local_device_count(), np.float32))
  results = []
  for size_name in args.sizes.split(","):
    n = SIZES[size_name]
    n -= n % per_node
    mine = np.random.default_rng(rank).standard_normal(jax.local_device_count() * n)
    inputs = {n: jax.make_array_from_process_local_data(spec, mine.astype(np.float32))}
    tests = {name: (fn, n) for name, fn in exchange_algorithms(n, per_node).items()}
    if getattr(args, "parts", False):
      tests.update(reference_parts(n, per_node))
    for name, (fn, length) in tests.items():
      if length not in inputs:  # a shard-sized buffer: the first values of each worker's
        part = mine.reshape(jax.local_device_count(), n)[:, :length].reshape(-1)
        inputs[length] = jax.make_array_from_process_local_data(spec, part.astype(np.float32))
      x = inputs[length]
      f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(WORKERS), out_specs=P(WORKERS),
                                check_vma=False))
      jax.block_until_ready(f(x))  # compile + warm-up
      _report(rank, time_exchange(lambda f=f, x=x: jax.block_until_ready(f(x)),
                                  lambda: jax.block_until_ready(barrier(token)), args.reps,
                                  measure_link, size=size_name, n=n, algorithm=name), results)
  return results


def jax_worker(args) -> None:
  from sparsejax import cluster
  cluster.initialize()
  import jax

  rank, local_rank = jax.process_index(), int(os.environ["SPARSEJAX_LOCAL_RANK"])
  results = run_jax(args, rank, measure_link=local_rank == 0)  # one process a node reads tc
  if rank == 0:
    with open(args.worker_out, "w") as f:
      json.dump(results, f)


def local_worker(args) -> None:
  """The same exchanges in this one process on NODES x PROCS CPU devices (XLA_FLAGS set by the
  driver): the CPU work of an exchange with the same 4 workers on this machine's cores, without
  gloo or a link (collectives are copies in memory)."""
  with open(args.worker_out, "w") as f:
    json.dump(run_jax(args, 0, measure_link=False), f)


# ----------------------------------------------------------------------------- torch worker

def _powersgd_step(shapes):
  """DDP with PowerSGD (rank 4, error feedback, warm start) on parameters of `shapes`: a step is
  one backward pass (every gradient 1) and DDP's compressed exchange of the gradients."""
  import torch
  from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

  class Params(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.p = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])

    def forward(self):
      return sum(p.sum() for p in self.p)

  model = torch.nn.parallel.DistributedDataParallel(Params(), bucket_cap_mb=25)
  state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                 start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
  model.register_comm_hook(state, powersgd.powerSGD_hook)

  def step():
    model.zero_grad(set_to_none=False)
    model().backward()

  return step


def torch_worker(args) -> None:
  import torch
  import torch.distributed as dist

  rank = int(os.environ["SPARSEJAX_PROCESS_ID"])
  world = int(os.environ["SPARSEJAX_NUM_PROCESSES"])
  local_rank = int(os.environ["SPARSEJAX_LOCAL_RANK"])
  coordinator = os.environ["SPARSEJAX_COORDINATOR"]
  torch.set_num_threads(1)
  dist.init_process_group("gloo", init_method=f"tcp://{coordinator}", rank=rank,
                          world_size=world)
  import jax

  from benchmarks import param_trees
  measure_link = local_rank == 0
  results = []
  for size_name in args.sizes.split(","):
    n = SIZES[size_name]
    buf = torch.from_numpy(np.random.default_rng(rank).standard_normal(n).astype(np.float32))
    tests = {"torch-allreduce": lambda b=buf: dist.all_reduce(b)}
    if size_name == "resnet50" and args.powersgd:
      tests["torch-powersgd"] = _powersgd_step(
          [tuple(s.shape) or (1,) for s in jax.tree.leaves(param_trees.TREES["resnet50"]())])
    for name, fn in tests.items():
      for _ in range(3):  # warm-up (PowerSGD starts compressing at its 2nd iteration)
        fn()
      _report(rank, time_exchange(fn, dist.barrier, args.reps, measure_link, size=size_name,
                                  n=n, algorithm=name), results)
  if rank == 0:
    with open(args.worker_out, "w") as f:
      json.dump(results, f)
  dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver

def run_on_cluster(c, mode: str, args, log) -> list[dict]:
  procs = PROCS if mode == "torch" else args.procs_per_node  # torch: one CPU device a process
  argv = ["--reps", str(args.reps), "--sizes", args.sizes] + (
      ["--powersgd"] if args.powersgd else [])
  return launch_workers(c, __file__, argv, mode=mode, procs_per_node=procs,
                        devices_per_proc=PROCS // procs, log=log, what=mode)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true",
                  help="ResNet-50 size at 1gbit only, 3 reps, no torch")
  ap.add_argument("--rates", default="1gbit,200mbit")
  ap.add_argument("--sizes", default="resnet50,transformer_base")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--no-torch", action="store_true")
  ap.add_argument("--powersgd", action="store_true",
                  help="also time DDP's PowerSGD hook (on gloo it hangs or fails with a "
                       "collective size mismatch: PyTorch supports it on NCCL; see the README)")
  ap.add_argument("--procs-per-node", type=int, default=PROCS, choices=(1, PROCS),
                  help="JAX processes per node: 2 (1 device each; intra-node traffic over "
                       "gloo on loopback) or 1 (2 devices; intra-node collectives in-process)")
  ap.add_argument("--local", action="store_true",
                  help="no cluster: the JAX exchanges in one process on 4 CPU devices (their CPU "
                       "work without gloo or a link; no root needed); default --out "
                       "benchmarks/results/bench_comm_local.json")
  ap.add_argument("--procs", type=int, default=1,
                  help="--local: separate processes, each timing everything")
  ap.add_argument("--parts", action="store_true",
                  help="--local: also time each sparse exchange's parts alone (MSTopK on the "
                       "buffer, on a shard, the dense intra-node phases) and report the ratios")
  ap.add_argument("--mode", choices=("driver", "jax", "torch", "local"), default="driver",
                  help=argparse.SUPPRESS)
  ap.add_argument("--worker-out", help=argparse.SUPPRESS)
  ap.add_argument("--out", type=json_path)
  args = ap.parse_args(argv)
  if args.mode == "jax":
    jax_worker(args)
    return 0
  if args.mode == "local":
    local_worker(args)
    return 0
  if args.mode == "torch":
    torch_worker(args)
    return 0
  if args.quick:
    args.rates, args.sizes, args.reps, args.no_torch = "1gbit", "resnet50", 3, True
  for s in args.sizes.split(","):
    if s not in SIZES:
      ap.error(f"unknown size {s!r}; allowed: {sorted(SIZES)}")
  if args.reps < 1 or args.procs < 1:
    ap.error(f"--reps and --procs must be >= 1, got {args.reps} and {args.procs}")
  args.out = args.out or os.path.join(
      HERE, "results", "bench_comm_local.json" if args.local else "bench_comm.json")
  if args.local:
    rows = run_local(args)
    layout = f"1 process, {NODES * PROCS} CPU devices"
  else:
    rows = run_emulated(args)
    layout = None
  table = make_table(rows)
  if args.local and args.parts:
    table += ("\n\nEach exchange against its parts measured alone in the same process "
              f"({args.procs} processes):\n\n" + local_ratio_table(rows))
  print(table)
  meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "nodes": NODES,
          "jax_procs_per_node": None if args.local else args.procs_per_node, "reps": args.reps,
          "local_processes": args.procs if args.local else None,
          "date": time.strftime("%Y-%m-%d %H:%M"),
          "layout": layout,
          "command": command_line("benchmarks/exchange.py", sys.argv[1:])}
  write_results(args.out, {"meta": meta, "results": rows}, table)
  plot(rows, os.path.splitext(args.out)[0] + ".png")
  print(f"wrote {args.out}")
  return 0


def run_local(args) -> list[dict]:
  """`--local`: the JAX exchanges in a child process with NODES x PROCS CPU devices."""
  rows = []
  for proc in range(args.procs):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
      path = f.name
    try:
      env = {**os.environ, "JAX_PLATFORMS": "cpu",
             "XLA_FLAGS": f"--xla_force_host_platform_device_count={NODES * PROCS}"}
      subprocess.run([*python_module(__file__), "--mode", "local", "--reps",
                      str(args.reps), "--sizes", args.sizes, "--worker-out", path,
                      *(["--parts"] if args.parts else [])], env=env, check=True)
      with open(path) as f:
        mine = json.load(f)
    finally:
      os.remove(path)
    for r in mine:
      r.update(rate="in-process", rate_bps=None, layout=f"1x{NODES * PROCS} devices",
               link_bound_s=0.0, proc=proc)
    rows += mine
  return rows


def local_ratio_table(rows: list[dict]) -> str:
  """--local: each sparse exchange against its parts measured alone in the same process;
  min-median-max over the processes."""
  lines = ["| size | exchange | vs its parts alone (min-median-max) | parts |",
           "|---|---|---:|---|"]
  procs = sorted({r["proc"] for r in rows})
  sizes = list(dict.fromkeys(r["size"] for r in rows))
  for size in sizes:
    for d in DENSITIES:
      for algo, parts in ((f"allgather-{d}", [f"select-{d}"]),
                          (f"hitopk-{d}", [f"select-shard-{d}", "dense-phases"])):
        ratios = []
        for p in procs:
          t = {r["algorithm"]: r["median_s"] for r in rows if r["proc"] == p and r["size"] == size}
          if algo in t and all(q in t for q in parts):
            ratios.append(t[algo] / sum(t[q] for q in parts))
        if ratios:
          spread = "-".join(f"{v:.2f}" for v in (min(ratios), statistics.median(ratios),
                                                  max(ratios)))
          lines.append(f"| {size} | {algo} | {spread}x | {' + '.join(parts)} |")
  return "\n".join(lines)


def run_emulated(args) -> list[dict]:
  """The JAX exchanges (and PyTorch's) on the emulated cluster, at every rate."""
  from sparsejax import cluster
  rates = [(r, cluster.parse_rate(r)) for r in args.rates.split(",")]
  log = sys.stdout
  rows = []
  for rate_name, bps in rates:
    with cluster.EmulatedCluster(NODES, bps) as c:
      for mode in ("jax",) + (() if args.no_torch else ("torch",)):
        for r in run_on_cluster(c, mode, args, log):
          r.update(rate=rate_name, rate_bps=bps,
                   layout=f"{NODES}x{args.procs_per_node if mode == 'jax' else PROCS}x"
                          f"{PROCS // args.procs_per_node if mode == 'jax' else 1}")
          egress = r["node_egress_bytes"] or 0
          r["link_bound_s"] = egress * 8 / bps
          rows.append(r)
  return rows


def make_table(rows: list[dict]) -> str:
  lines = ["| rate | size | algorithm | median s | q1-q3 s | node egress MB | link bound s | "
           "vs dense |", "|---|---|---|---:|---:|---:|---:|---:|"]
  dense = {(r["rate"], r["size"]): r["median_s"] for r in rows if r["algorithm"] == "dense"}
  for r in rows:
    base = dense.get((r["rate"], r["size"]))
    ratio = f"{base / r['median_s']:.1f}x" if base else "-"
    egress, bound = "-", "-"  # no link in --local rows
    if r["node_egress_bytes"] is not None:
      egress, bound = f"{r['node_egress_bytes'] / 1e6:.2f}", f"{r['link_bound_s']:.3f}"
    lines.append(f"| {r['rate']} | {r['size']} | {r['algorithm']} | {r['median_s']:.3f} | "
                 f"{r['q1_s']:.3f}-{r['q3_s']:.3f} | {egress} | {bound} | {ratio} |")
  return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ModuleNotFoundError:
    print("matplotlib not installed: no plot")
    return
  groups = sorted({(r["rate"], r["size"]) for r in rows})
  fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
  for ax, (rate, size) in zip(axes[0], groups):
    sel = [r for r in rows if r["rate"] == rate and r["size"] == size]
    ax.barh([r["algorithm"] for r in sel], [r["median_s"] for r in sel], color="tab:blue",
            label="measured (median)")
    ax.barh([r["algorithm"] for r in sel], [r["link_bound_s"] for r in sel], color="tab:orange",
            alpha=0.6, label="inter-node bytes at link rate")
    ax.set_xscale("log")
    ax.set_title(f"{size} at {rate}")
    ax.set_xlabel("seconds per exchange")
  axes[0][0].legend(loc="lower right", fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  sys.exit(main())
