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
            the finite check's pmin, the psum, the norm, AdamW); the whole train step (+ the
            metrics' pmean)
  torch     (TORCH=1) torch.distributed.all_reduce of N float32 (PyTorch 2.13, gloo), and as 2
            and 4 chunks (DDP's buckets)

Root (a network namespace per node; RATE: "unlimited" or a tc rate):

  python experiments/probe_dense_exchange.py [RATE]
  PARTS=5 python experiments/probe_dense_exchange.py
  TORCH=1 N=931840 python experiments/probe_dense_exchange.py
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


def pin():
  os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % 2]})


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
  if rank == 0:
    print(json.dumps(figures), flush=True)
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


def step_parts(run, batch):
  """Programs that add the step's parts one by one: {name: call, blocking}."""
  import jax
  from jax import lax
  from jax.sharding import PartitionSpec as P

  from sparsejax.train import step as step_lib
  from sparsejax.train.mesh import WORKERS
  from sparsejax.train.state import state_specs
  setup, specs = run.setup, state_specs(run.state)

  def grad(state, inputs, labels):
    return step_lib.gradient(setup, state.step, state.params,
                             step_lib._first(state.batch_stats), inputs, labels)

  bodies = {
      "compute": lambda s, x, y: grad(s, x, y)[0].sum()[None],
      "compute+psum": lambda s, x, y: lax.psum(grad(s, x, y)[0], WORKERS).sum()[None],
      "compute+barrier": lambda s, x, y: lax.psum(grad(s, x, y)[0].sum(), WORKERS)[None],
      "compute+barrier+psum": lambda s, x, y: _after_barrier(grad(s, x, y)[0]),
      "compute+update": lambda s, x, y: step_lib.apply_gradient(
          setup, s, *grad(s, x, y)[:2])[0].params.sum()[None],
      "step": lambda s, x, y: step_lib.train_step(setup, s, x, y)[0].params.sum()[None],
  }
  def _after_barrier(g):
    ready = lax.psum(g[:1], WORKERS)  # every worker's gradient is done
    return lax.psum(g + 0 * ready, WORKERS).sum()[None]

  out = {}
  for name, body in bodies.items():
    fn = jax.jit(jax.shard_map(body, mesh=setup.mesh, in_specs=(specs, P(WORKERS), P(WORKERS)),
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
  if os.environ.get("PARTS"):  # the step in parts, interleaved rounds (every rank the same)
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
  if rank == 0:
    print(json.dumps(figures), flush=True)


if "SPARSEJAX_PROCESS_ID" not in os.environ:  # the launcher: one process per node
  from sparsejax import cluster
  rate = sys.argv[1] if len(sys.argv) > 1 else "unlimited"
  sys.exit(cluster.launch([os.path.abspath(__file__)], nodes=2, procs_per_node=1,
                          devices_per_proc=1, bandwidth=None if rate == "unlimited" else rate,
                          program=[sys.executable], extra_env={"GLOO_SOCKET_IFNAME": "eth0"}))
elif os.environ.get("TORCH") == "1":
  torch_probe(int(os.environ.get("N", "931840")))
else:
  jax_probe()
