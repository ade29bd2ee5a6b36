"""Probe: where the sparsejax dense step's exposed exchange goes on the Transformer LM (2 emulated
nodes, one process and one core each, pinned after XLA starts as the study pins). Rank 0 prints
one JSON line of medians (ms per call):

  step      the study's dense train step (`JaxRun.step`, a new batch each step)
  compute   its forward and backward pass alone on one batch (`jit_compute_step`)
  batch     making a batch (`JaxRun.batch`)
  step_fn   the compiled train step alone on one batch
  psum      one all-reduce over "node" of a buffer of the gradient's size (XLA's psum, gloo),
            back to back; psum_N: the same as N all-reduces of N chunks; rs_ag: reduce-scatter
            then all-gather
  parts     (PARTS=R) the step built up part by part, R interleaved rounds of 8 calls each:
            compute; + a one-value psum (a barrier: the ranks' skew); + the barrier and the
            gradient's psum; compute + psum; compute + exchange and update (`apply_gradient`:
            the psum, the norm, AdamW), without and with the finite check's pmin; the whole
            train step (+ the metrics' rank pass and pmean)
  torch     (TORCH=1) torch.distributed.all_reduce of N float32, the JAX run's gradient size
            (PyTorch, gloo), and as 2 and 4 chunks (DDP's buckets)

Root (a network namespace per node). The driver alternates JAX and PyTorch process runs and
writes JSON and a table; `--pin` says how each process keeps to its core once XLA has started
(every thread, as the study pins; the calling thread only, as the study did before 2026-12-02;
every thread with gloo's poller in SCHED_IDLE):

  python experiments/probe_dense_exchange.py --runs 3 --parts 5 [--pin every-thread] \\
    --out experiments/results/probe_dense_exchange_lm.json
"""

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
rank = int(os.environ.get("SPARSEJAX_PROCESS_ID", "-1"))
REPS = int(os.environ.get("REPS", "20"))
CONFIG = os.path.join(ROOT, "configs", "tta_kjv_lm.py")


def timed(fn, reps=REPS, warm=3):
  out = []
  for i in range(warm + reps):
    t0 = time.perf_counter()
    fn()
    if i >= warm:
      out.append(time.perf_counter() - t0)
  return round(1e3 * statistics.median(out), 2)


PINS = ("every-thread", "main-thread", "gloo-idle")


def pin():
  """This node's core, after XLA starts, as $PIN says: every thread (as the study pins), the
  calling thread only (the study before 2026-12-02: XLA's executor threads kept every core),
  or every thread with gloo's poller in SCHED_IDLE."""
  how = os.environ.get("PIN", PINS[0])
  if how == "main-thread":
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % 2]})
    return
  from sparsejax.bench import pin_to_core
  pin_to_core(rank)
  if how == "gloo-idle":
    from sparsejax import cluster
    cluster.yield_gloo_threads()


def report(figures):
  """Rank 0's figures: one JSON line on stdout, and to $PROBE_OUT where the driver set it."""
  if rank != 0:
    return
  print(json.dumps(figures), flush=True)
  if os.environ.get("PROBE_OUT"):
    with open(os.environ["PROBE_OUT"], "w") as f:
      json.dump(figures, f)


def torch_probe(n):
  import numpy as np
  import torch
  import torch.distributed as dist
  pin()
  torch.set_num_threads(1)
  dist.init_process_group("gloo", init_method=f"tcp://{os.environ['SPARSEJAX_COORDINATOR']}",
                          rank=rank, world_size=int(os.environ["SPARSEJAX_NUM_PROCESSES"]))
  buf = torch.from_numpy(np.random.default_rng(rank).standard_normal(n).astype(np.float32))
  figures = {"n": n, "torch": timed(lambda: dist.all_reduce(buf))}
  for parts in (2, 4):  # DDP's buckets: several all-reduces a step
    chunks = list(buf.chunk(parts))
    figures[f"torch_{parts}"] = timed(lambda c=chunks: [dist.all_reduce(x) for x in c])
  report(figures)
  dist.destroy_process_group()


def profile(fn, steps=5, top=25):
  """{thunk: ms per step} of the `top` longest in `steps` calls of `fn` (jax.profiler)."""
  import collections
  import glob
  import gzip
  import tempfile

  import jax
  where = tempfile.mkdtemp()
  jax.profiler.start_trace(where)
  for _ in range(steps):
    fn()
  jax.profiler.stop_trace()
  with gzip.open(glob.glob(f"{where}/**/*.trace.json.gz", recursive=True)[0]) as f:
    events = json.load(f)["traceEvents"]
  total = collections.Counter()
  for e in events:
    if e.get("ph") == "X":
      total[e["name"]] += e["dur"] / 1e3 / steps
  return {k: round(v, 2) for k, v in total.most_common(top)}


def _no_pmin(run):
  """The run's setup with its chain's finite check decided by each worker alone (no pmin): the
  same state, one collective fewer."""
  import dataclasses

  from sparsejax.finite import apply_if_finite_across
  from sparsejax.train import optimizer as opt_lib
  from sparsejax.train import schedules
  c, setup, per_epoch = run.config, run.setup, run.data.steps_per_epoch
  lr = schedules.learning_rate(c.optimizer, per_epoch, run.total)
  chain = opt_lib.named_chain(
      opt_lib.compressor(c, schedules.density(c.compression, per_epoch),
                         layout=setup.layout),
      opt_lib.fused_optimizer(c.optimizer, lr, setup.layout, per_epoch))
  return dataclasses.replace(setup, tx=apply_if_finite_across(chain, ()))


def step_parts(run, batch):
  """Programs that add the step's parts one by one: {name: call, blocking}. Each returns one
  value that depends on all it computes (nothing for XLA to drop)."""
  import jax
  from jax import lax
  from jax.sharding import PartitionSpec as P

  from sparsejax.train import step as step_lib
  from sparsejax.train.mesh import WORKERS
  from sparsejax.train.state import state_specs
  setup, specs, local = run.setup, state_specs(run.state), _no_pmin(run)

  def grad(state, inputs, labels):
    return step_lib.gradient(setup, state.step, state.params,
                             step_lib._first(state.batch_stats), inputs, labels)

  def after_barrier(g):
    ready = lax.psum(g[:1], WORKERS)  # every worker's gradient is done
    return lax.psum(g + 0 * ready, WORKERS).sum()

  def update(chain_setup, s, x, y):
    return step_lib.apply_gradient(chain_setup, s, *grad(s, x, y)[:2])[0].params.sum()

  def whole(s, x, y):
    state, metrics = step_lib.train_step(setup, s, x, y)
    return state.params.sum() + sum(jax.tree.leaves(metrics))

  bodies = {
      "compute": lambda s, x, y: grad(s, x, y)[0].sum(),
      "compute+psum": lambda s, x, y: lax.psum(grad(s, x, y)[0], WORKERS).sum(),
      "compute+barrier": lambda s, x, y: lax.psum(grad(s, x, y)[0].sum(), WORKERS),
      "compute+barrier+psum": lambda s, x, y: after_barrier(grad(s, x, y)[0]),
      "compute+update, no pmin": lambda s, x, y: update(local, s, x, y),
      "compute+update": lambda s, x, y: update(setup, s, x, y),
      "step": whole,
  }
  out = {}
  for name, body in bodies.items():
    fn = jax.jit(jax.shard_map(lambda s, x, y, b=body: b(s, x, y)[None], mesh=setup.mesh,
                               in_specs=(specs, P(WORKERS), P(WORKERS)),
                               out_specs=P(WORKERS), check_vma=False))
    out[name] = lambda f=fn: jax.block_until_ready(f(run.state, *batch))
  return out


def jax_probe():
  from sparsejax import cluster
  cluster.initialize()
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  jax.devices()
  pin()  # after XLA starts, as the study
  from experiments.jax_runner import JaxRun
  from experiments.tta_systems import load_task
  from sparsejax.train.step import jit_compute_step
  run = JaxRun(load_task(CONFIG, ["compression.algorithm=dense"]), (2, 1))
  mesh, n = run.setup.mesh, int(run.state.params.shape[0])
  step = iter(range(10**6))
  figures = {"n": n, "step": timed(lambda: run.step(next(step) % 50, wait=True))}
  compute = jit_compute_step(run.setup, run.state)
  batch = run.batch(0)
  figures["compute"] = timed(lambda: jax.block_until_ready(compute(run.state, *batch)))
  figures["batch"] = timed(lambda: jax.block_until_ready(run.batch(next(step) % 50)))
  fn = run.step_fns[run.levels[0]]

  def bare_step():
    run.state, metrics = fn(run.state, *batch)
    jax.block_until_ready(run.state)
  figures["step_fn"] = timed(bare_step)
  if int(os.environ.get("PARTS", "0")):  # the step in parts, interleaved rounds (all ranks)
    parts = step_parts(run, batch)
    rounds = {k: [] for k in parts}
    for _ in range(int(os.environ["PARTS"])):
      for k, f in parts.items():
        rounds[k].append(timed(f, reps=8, warm=1))
    figures["parts"] = {k: sorted(v) for k, v in rounds.items()}
  if os.environ.get("PROFILE"):  # the step's thunks, ms per step (every rank steps)
    thunks = profile(bare_step) if rank == 0 else [bare_step() for _ in range(5)]
    if rank == 0:
      print(json.dumps(thunks), flush=True)

  def program(body):  # each node's buffer differs (nothing for XLA to fold)
    return jax.jit(jax.shard_map(lambda v: body(v + lax.axis_index("node")), mesh=mesh,
                                 in_specs=P(), out_specs=P(), check_vma=False))

  def chunked(parts):
    def body(x):
      return jnp.concatenate([lax.psum(c, "node") for c in jnp.array_split(x, parts)])
    return body

  x = jax.device_put(jnp.ones((n,), jnp.float32), NamedSharding(mesh, P()))
  tests = {"psum": lambda v: lax.psum(v, "node"), "psum_4": chunked(4), "psum_16": chunked(16),
           "rs_ag": lambda v: lax.all_gather(
               lax.psum_scatter(v, "node", scatter_dimension=0, tiled=True), "node", tiled=True)}
  for name, body in tests.items():
    fn = program(body)
    figures[name] = timed(lambda f=fn: jax.block_until_ready(f(x)))
  report(figures)


# ----------------------------------------------------------------------------- driver

PARTS = (  # (row, later program, earlier program): what the later one adds, per round
    ("the ranks' skew (a one-value psum after the gradient)", "compute+barrier", "compute"),
    ("the gradient's psum after that barrier", "compute+barrier+psum", "compute+barrier"),
    ("the gradient's psum (skew included)", "compute+psum", "compute"),
    ("the update without the finite check's pmin (norm, AdamW)", "compute+update, no pmin",
     "compute+psum"),
    ("the finite check's pmin", "compute+update", "compute+update, no pmin"),
    ("the metrics (rank pass, pmean)", "step", "compute+update"))


def table(results: dict) -> str:
  """The runs' figures, min / median / max over the process runs (each a median of its
  calls; a part: the median over its rounds of the later program minus the earlier)."""
  from experiments.results_io import footer, spread
  jax_runs, torch_runs = results["jax"], results["torch"]

  def row(name, values):
    return f"| {name} | {spread(values, 1)} |"
  lines = ["Where the sparsejax dense step's time goes beyond the forward and backward pass: the "
           "Transformer LM on 2 emulated nodes (one process pinned to one core each, "
           f"{results['meta'].get('pin', 'main-thread')} once XLA started, unlimited link), "
           f"ms, min / median / max over {len(jax_runs)} process runs (and "
           f"{len(torch_runs)} of PyTorch's):", "", "| part | ms |", "|---|---:|",
           row("forward and backward alone", [r["compute"] for r in jax_runs]),
           row("the compiled train step", [r["step_fn"] for r in jax_runs]),
           row("step - forward and backward", [r["step_fn"] - r["compute"] for r in jax_runs])]
  for name, later, earlier in PARTS:
    lines.append(row(name, [statistics.median(a - b for a, b in zip(
        r["parts"][later], r["parts"][earlier])) for r in jax_runs if "parts" in r]))
  lines += [row("XLA psum of the gradient's size alone (gloo)", [r["psum"] for r in jax_runs]),
            row("... as 4 psums of a quarter", [r["psum_4"] for r in jax_runs]),
            row("PyTorch all_reduce of the same size alone (gloo)",
                [r["torch"] for r in torch_runs]),
            row("... as 2 all_reduces of half (DDP's buckets)",
                [r["torch_2"] for r in torch_runs]),
            "", f"Gradient: {jax_runs[0]['n']:,} float32.", "", footer(results["meta"])]
  return "\n".join(lines)


def main(argv) -> int:
  import argparse
  import platform
  import tempfile

  from experiments.results_io import command_line, json_path, write_results
  from sparsejax import cluster
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rate", default="unlimited", help='"unlimited" or a tc rate (200mbit)')
  ap.add_argument("--runs", type=int, default=3, help="process runs of each runtime")
  ap.add_argument("--parts", type=int, default=5, help="interleaved rounds of the parts")
  ap.add_argument("--pin", default=PINS[0], choices=PINS,
                  help="how each node's process keeps to its core once XLA has started")
  ap.add_argument("--out", type=json_path, required=True,
                  help="results JSON (a markdown table beside it)")
  args = ap.parse_args(argv)
  if args.runs < 1 or args.parts < 1:
    ap.error(f"--runs and --parts must be >= 1, got {args.runs} and {args.parts}")
  results = {"jax": [], "torch": [], "meta": {
      "rate": args.rate, "pin": args.pin, "machine": platform.machine(), "cpus": os.cpu_count(),
      "date": time.strftime("%Y-%m-%d"),
      "command": command_line("experiments/probe_dense_exchange.py", argv)}}
  for _ in range(args.runs):  # the runtimes alternated
    for runtime in ("jax", "torch"):
      with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = {"PIN": args.pin, "GLOO_SOCKET_IFNAME": "eth0", "PROBE_OUT": f.name,
               "PARTS": str(args.parts),
               "TORCH": str(int(runtime == "torch")),
               "N": str(results["jax"][-1]["n"] if results["jax"] else 0)}
        # a namespace per node at every rate (launch builds none for an unlimited link: the
        # processes would talk over loopback, gloo unbound to a node's address)
        rate = None if args.rate == "unlimited" else cluster.parse_rate(args.rate)
        with cluster.EmulatedCluster(2, rate) as c:
          rc = cluster.launch([os.path.abspath(__file__)], nodes=2, procs_per_node=1,
                              devices_per_proc=1, program=[sys.executable], extra_env=env,
                              cluster=c)
        if rc:
          raise SystemExit(f"the {runtime} probe failed (exit {rc})")
        results[runtime].append(json.load(f))
  text = table(results)
  print(text)
  write_results(args.out, results, text)
  return 0


if __name__ == "__main__":
  if "SPARSEJAX_PROCESS_ID" not in os.environ:  # the driver
    sys.exit(main(sys.argv[1:]))
  elif os.environ.get("TORCH") == "1":  # a worker (one per node)
    torch_probe(int(os.environ["N"]))  # the JAX run's gradient size
  else:
    jax_probe()
