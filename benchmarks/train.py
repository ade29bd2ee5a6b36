"""End-to-end training throughput on an emulated cloud cluster: sparsejax dense vs HiTopKComm,
and PyTorch DDP (the peer a user would pick instead) training the same model.

  sudo python -m benchmarks.train [--rate 1gbit] [--width 64] [--batch-per-worker 32]
                                         [--steps 30] [--powersgd] [--quick]
                                         [--no-torch | --no-sparsejax]
                                         [--out benchmarks/results/bench_train.json]

The cluster: 2 nodes (`sparsejax.cluster.EmulatedCluster`: a network namespace per node, its link
limited with tc to `--rate`), 2 workers per node. The model: the small-image ResNet-20 of the
quickstart, `--width` filters in its first stage (64: 4.3M parameters, a 17 MB float32 gradient),
on scikit-learn's digits, `--batch-per-worker` images per worker per step, SGD with Nesterov
momentum. Each system runs its real training step on real batches:

  sparsejax     one process per node with 2 CPU devices (`sparsejax launch` layout), the trainer
                of `sparsejax train` (`sparsejax.train.Run`: shard_map step, flat gradient,
                fused SGD),
                compression "dense" (one all-reduce) or "hitopk" at density 0.001 (MSTopK, error
                feedback; no density warm-up), the batch for each step fetched and sharded by
                the same `Inputs` the loop uses;
  torch-ddp     PyTorch 2.13 DistributedDataParallel over gloo, one process per worker
                (1 thread each), the same architecture and parameter count, torch.optim.SGD;
  torch-powersgd  the same with DDP's PowerSGD hook (rank 4), only with --powersgd: on gloo it
                fails here with a collective size mismatch (gloo::EnforceNotMet "Received data
                size doesn't match expected size"); PyTorch tests the hook on NCCL only
                (pytorch/pytorch#58467).

Every iteration (batch, step, wait for the result) is timed after `--warmup` iterations; samples/s
= global batch / median iteration time. Bytes on the link: node 0's egress per step counted by
tc. Writes JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from sparsejax.bench import (
  command_line,
  json_path,
  launch_workers,
  write_results,
)

HERE = os.path.dirname(os.path.abspath(__file__))

NODES, WORKERS_PER_NODE = 2, 2
DENSITY = 0.001


def _stats(times: list[float], global_batch: int) -> dict[str, float]:
  med = statistics.median(times)
  return {"median_s": med, "q1_s": float(np.percentile(times, 25)),
          "q3_s": float(np.percentile(times, 75)), "steps": len(times),
          "samples_per_s": global_batch / med}


def bench_config(algorithm: str, width: int, batch_per_worker: int):
  from sparsejax.train.config import default_config
  c = default_config()
  c.model.name, c.model.num_filters = "resnet20", width
  c.data.name = "digits"
  c.mesh.nodes, c.mesh.local = NODES, WORKERS_PER_NODE
  c.batch_size = batch_per_worker * NODES * WORKERS_PER_NODE
  c.num_epochs = 1000.0
  c.optimizer.name = "sgd"
  c.optimizer.learning_rate, c.optimizer.momentum, c.optimizer.nesterov = 0.05, 0.9, True
  c.optimizer.weight_decay = 5e-4
  c.compression.algorithm = algorithm
  c.compression.density = DENSITY
  c.compression.selector = "mstopk"
  c.compression.warmup_epochs = 0.0
  return c


# ----------------------------------------------------------------------------- JAX worker

def jax_worker(args) -> None:
  from sparsejax import cluster
  cluster.initialize()
  import jax

  from sparsejax.train import Run

  run = Run(bench_config(args.algorithm, args.width, args.batch_per_worker))
  config, total = run.config, args.warmup + args.steps
  params = run.setup.layout.size
  measure_link = int(os.environ["SPARSEJAX_LOCAL_RANK"]) == 0
  times, sent, losses = [], 0, []
  for step in range(total):
    if step == args.warmup:
      before = cluster.qdisc_sent_bytes() if measure_link else 0
    t0 = time.perf_counter()
    metrics, = run.step(step)  # (its batch read and sharded on the clock)
    losses.append(float(jax.device_get(metrics["loss"])))  # waits for the step
    if step >= args.warmup:
      times.append(time.perf_counter() - t0)
  sent = (cluster.qdisc_sent_bytes() - before) / args.steps if measure_link else None
  if jax.process_index() == 0:
    row = {"system": "sparsejax", "algorithm": args.algorithm if args.algorithm == "dense"
           else f"{args.algorithm}-{DENSITY}", "params": params,
           "layout": f"{NODES} nodes x 1 process x {WORKERS_PER_NODE} devices",
           **_stats(times, config.batch_size), "node_egress_bytes_per_step": sent,
           "first_loss": losses[0], "last_loss": losses[-1]}
    with open(args.worker_out, "w") as f:
      json.dump([row], f)


# ----------------------------------------------------------------------------- torch worker

def torch_resnet20(width: int, num_classes: int, in_channels: int = 1):
  """ResNet-20 (small-image stem), the architecture of sparsejax.models.ResNet20 in PyTorch."""
  import torch
  from torch import nn

  class Block(nn.Module):
    def __init__(self, cin, cout, stride):
      super().__init__()
      self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
      self.b1 = nn.BatchNorm2d(cout)
      self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
      self.b2 = nn.BatchNorm2d(cout)
      nn.init.zeros_(self.b2.weight)
      self.proj = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                 nn.BatchNorm2d(cout)) if (cin != cout or stride != 1) else None)

    def forward(self, x):
      y = torch.relu(self.b1(self.c1(x)))
      y = self.b2(self.c2(y))
      return torch.relu((self.proj(x) if self.proj is not None else x) + y)

  layers = [nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
  cin = width
  for i in range(3):
    for j in range(3):
      cout = width * 2**i
      layers.append(Block(cin, cout, 2 if i > 0 and j == 0 else 1))
      cin = cout
  layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
  return nn.Sequential(*layers)


def torch_worker(args) -> None:
  import torch
  import torch.distributed as dist
  from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

  from sparsejax import cluster
  from sparsejax.data import small

  rank = int(os.environ["SPARSEJAX_PROCESS_ID"])
  world = int(os.environ["SPARSEJAX_NUM_PROCESSES"])
  local_rank = int(os.environ["SPARSEJAX_LOCAL_RANK"])
  torch.set_num_threads(1)
  torch.manual_seed(0)
  dist.init_process_group("gloo", init_method=f"tcp://{os.environ['SPARSEJAX_COORDINATOR']}",
                          rank=rank, world_size=world)
  train, _ = small.digits(0)
  images = torch.from_numpy(np.ascontiguousarray(train.images.transpose(0, 3, 1, 2)))
  labels = torch.from_numpy(train.labels.astype(np.int64))
  model = torch.nn.parallel.DistributedDataParallel(torch_resnet20(args.width, 10))
  if args.algorithm == "powersgd":
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                   start_powerSGD_iter=2, use_error_feedback=True,
                                   warm_start=True)
    model.register_comm_hook(state, powersgd.powerSGD_hook)
  opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                        weight_decay=5e-4)
  params = sum(p.numel() for p in model.parameters())
  b, gb = args.batch_per_worker, args.batch_per_worker * world
  measure_link = local_rank == 0
  times, losses = [], []
  total = args.warmup + args.steps
  for step in range(total):
    if step == args.warmup:
      dist.barrier()
      before = cluster.qdisc_sent_bytes() if measure_link else 0
    t0 = time.perf_counter()
    per_epoch = len(labels) // gb
    order = np.random.default_rng(step // per_epoch).permutation(len(labels))
    rows = order[(step % per_epoch) * gb:][rank * b:(rank + 1) * b]
    x, y = images[rows], labels[rows]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())
    if step >= args.warmup:
      times.append(time.perf_counter() - t0)
  sent = (cluster.qdisc_sent_bytes() - before) / args.steps if measure_link else None
  if rank == 0:
    row = {"system": "pytorch-2.13", "algorithm": "ddp-allreduce" if args.algorithm == "ddp"
           else "ddp-powersgd-rank4", "params": params,
           "layout": f"{NODES} nodes x {WORKERS_PER_NODE} processes x 1 thread",
           **_stats(times, gb), "node_egress_bytes_per_step": sent,
           "first_loss": losses[0], "last_loss": losses[-1]}
    with open(args.worker_out, "w") as f:
      json.dump([row], f)
  dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver

def run(c, mode: str, algorithm: str, args, log) -> dict:
  argv = ["--algorithm", algorithm, "--width", str(args.width), "--batch-per-worker",
          str(args.batch_per_worker), "--steps", str(args.steps), "--warmup", str(args.warmup)]
  procs = 1 if mode == "jax" else WORKERS_PER_NODE
  return launch_workers(c, __file__, argv, mode=mode, procs_per_node=procs,
                        devices_per_proc=WORKERS_PER_NODE // procs, log=log,
                        what=f"{mode} {algorithm}")[0]


def make_table(rows: list[dict], rate: str) -> str:
  dense = next((r for r in rows if r["algorithm"] == "dense"), None)
  lines = [f"| system | exchange | params | median s/step | q1-q3 s | samples/s | vs sparsejax "
           f"dense | link MB/step ({rate}) | loss first -> last |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|"]
  for r in rows:
    ratio = f"{r['samples_per_s'] / dense['samples_per_s']:.2f}x" if dense else "-"
    mb = (r["node_egress_bytes_per_step"] or 0) / 1e6
    lines.append(f"| {r['system']} | {r['algorithm']} | {r['params']:,} | {r['median_s']:.3f} | "
                 f"{r['q1_s']:.3f}-{r['q3_s']:.3f} | {r['samples_per_s']:.0f} | {ratio} | "
                 f"{mb:.2f} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rate", default="1gbit")
  ap.add_argument("--width", type=int, default=64)
  ap.add_argument("--batch-per-worker", type=int, default=32)
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--warmup", type=int, default=5)
  ap.add_argument("--quick", action="store_true", help="width 16, 8 steps, no torch")
  ap.add_argument("--no-torch", action="store_true")
  ap.add_argument("--no-sparsejax", action="store_true", help="only the PyTorch runs")
  ap.add_argument("--powersgd", action="store_true", help="also DDP with the PowerSGD hook")
  ap.add_argument("--mode", choices=("driver", "jax", "torch"), default="driver",
                  help=argparse.SUPPRESS)
  ap.add_argument("--algorithm", default="dense", help=argparse.SUPPRESS)
  ap.add_argument("--worker-out", help=argparse.SUPPRESS)
  ap.add_argument("--out", type=json_path,
                  default=os.path.join(HERE, "results", "bench_train.json"))
  args = ap.parse_args(argv)
  if args.mode == "jax":
    jax_worker(args)
    return 0
  if args.mode == "torch":
    torch_worker(args)
    return 0
  if args.quick:
    args.width, args.steps, args.warmup, args.no_torch = 16, 8, 2, True
  for name in ("width", "batch_per_worker", "steps"):
    if getattr(args, name) < 1:
      ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  from sparsejax import cluster
  bps = cluster.parse_rate(args.rate)
  runs = [] if args.no_sparsejax else [("jax", "dense"), ("jax", "hitopk")]
  if not args.no_torch:
    runs.append(("torch", "ddp"))
    if args.powersgd:
      runs.append(("torch", "powersgd"))
  rows = []
  with cluster.EmulatedCluster(NODES, bps) as c:
    for mode, algorithm in runs:
      row = run(c, mode, algorithm, args, sys.stdout)
      row.update(rate=args.rate, rate_bps=bps)
      print(json.dumps(row), flush=True)
      rows.append(row)
  table = make_table(rows, args.rate)
  print(table)
  meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "nodes": NODES,
          "workers_per_node": WORKERS_PER_NODE, "width": args.width,
          "batch_per_worker": args.batch_per_worker, "steps": args.steps,
          "warmup": args.warmup, "density": DENSITY,
          "command": command_line("benchmarks/train.py", sys.argv[1:])}
  write_results(args.out, {"meta": meta, "results": rows}, table)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
