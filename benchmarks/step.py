"""Training throughput of one real train step (images/s, synthetic data), sparsejax vs plain optax.

  python -m benchmarks.step [--quick] [--model resnet50] [--batch 256] [--size 224]
                                   [--dtype bfloat16] [--steps 20]
                                   [--out benchmarks/results/bench_step.json]

On one device (the first of the default backend), for one model, times a full training step:

  optax         the step a user would write: forward/backward, optax.lars per tensor, apply;
  dense         sparsejax's train step (shard_map on a 1x1 mesh, flat gradient, fused LARS),
                compression off (the "dense" algorithm);
  hitopk-0.001  the same step with HiTopKComm at density 0.001: MSTopK selection and error feedback
                run on the whole 25M-value gradient every step (on one device nothing is sent, so
                this is the selection overhead a worker pays).

Each variant: compile, `--warmup` steps, then `--steps` steps timed one by one (each synchronised);
medians and quartiles of images/s. Synthetic data: a fixed random batch, labels in [0, 1000).
Writes JSON and a markdown table next to it.
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
import optax

from sparsejax import models
from sparsejax.bench import command_line, json_path, write_results
from sparsejax.train import config as config_lib
from sparsejax.train import make_mesh
from sparsejax.train.plan import make_plan
from sparsejax.train.state import from_config, shard_batch
from sparsejax.train.step import jit_train_step


def config_for(args, algorithm: str, density: float):
  c = config_lib.default_config()
  c.model.name, c.model.dtype = args.model, args.dtype
  c.model.num_filters = args.num_filters
  c.mesh.nodes, c.mesh.local, c.mesh.num_devices = 1, 1, 1
  c.batch_size = args.batch
  c.optimizer.name, c.optimizer.learning_rate = "lars", 1.0
  c.optimizer.schedule, c.optimizer.weight_decay = "constant", 5e-5
  c.compression.algorithm, c.compression.density = algorithm, density
  config_lib.validate(c)
  return c


def time_steps(step, state, batch, warmup: int, steps: int):
  """Runs `state, metrics = step(state, *batch)`; seconds per timed step."""
  for _ in range(warmup):
    state, m = step(state, *batch)
  jax.block_until_ready((state, m))
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, m = step(state, *batch)
    jax.block_until_ready((state, m))
    times.append(time.perf_counter() - t0)
  return times, m


def optax_step(args, num_classes: int, images, labels):
  """The plain per-tensor step: flax model, optax.lars with the same hyperparameters."""
  extra = {"num_filters": args.num_filters} if args.num_filters else {}
  model = models.build(args.model, num_classes=num_classes, dtype=args.dtype, **extra)
  variables = jax.jit(lambda r, x: model.init(r, x, train=False))(
      jax.random.key(0, impl="rbg"), images[:1])
  mask = jax.tree.map(lambda x: x.ndim > 1, variables["params"])
  tx = optax.lars(1.0, weight_decay=5e-5, weight_decay_mask=mask, trust_ratio_mask=mask)
  state = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))

  def step(state, images, labels):
    params, stats, opt_state = state

    def loss_fn(p):
      logits, new = model.apply({"params": p, "batch_stats": stats}, images, train=True,
                                mutable=["batch_stats"])
      onehot = jax.nn.one_hot(labels, num_classes)
      return optax.softmax_cross_entropy(logits, onehot).mean(), new["batch_stats"]

    (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), new_stats, opt_state), {"loss": loss}

  return jax.jit(step, donate_argnums=0), state


def parse_args(argv) -> tuple[argparse.Namespace, list[str]]:
  """(args, variants) from the command line."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true",
                  help="CPU smoke: resnet50 at width 8, batch 8, 64 px, 3 steps")
  ap.add_argument("--model", default="resnet50")
  ap.add_argument("--num-filters", type=int, default=0, help="first-stage width (0: the model's)")
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--size", type=int, default=224)
  ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--variants", default="optax,dense,hitopk-0.001")
  ap.add_argument("--out", type=json_path,
                  default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                       "results", "bench_step.json"))
  args = ap.parse_args(argv)
  if args.quick:
    args.num_filters, args.batch, args.size, args.steps, args.warmup = 8, 8, 64, 3, 1
  for name in ("batch", "size", "steps"):
    if getattr(args, name) < 1:
      ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  variants = args.variants.split(",")
  known = {"optax", "dense", "hitopk-0.001", "hitopk-0.01"}
  for v in variants:
    if v not in known:
      ap.error(f"unknown variant {v!r}; allowed: {sorted(known)}")
  return args, variants


def run_variant(args, variant: str, images: np.ndarray, labels: np.ndarray, num_classes: int
                ) -> dict:
  """Builds one variant's step, times it; returns its row."""
  t0 = time.perf_counter()
  if variant == "optax":
    step, state = optax_step(args, num_classes, jnp.asarray(images), labels)
    batch = (jnp.asarray(images), jnp.asarray(labels))
  else:
    algorithm, density = ("dense", 1.0) if variant == "dense" else (
        "hitopk", float(variant.split("-")[1]))
    config = config_for(args, algorithm, density)
    mesh = make_mesh(1, 1, jax.devices()[:1])
    setup, state = from_config(config, make_plan(config, steps_per_epoch=1000), mesh,
                               num_classes, (args.size, args.size, 3))
    step = jit_train_step(setup, state)
    batch = shard_batch(mesh, images, labels)
  compile_s = time.perf_counter() - t0
  times, metrics = time_steps(step, state, batch, args.warmup, args.steps)
  del state
  ips = [args.batch / t for t in times]
  row = {"variant": variant, "images_per_s_median": statistics.median(ips),
         "images_per_s_q1": float(np.percentile(ips, 25)),
         "images_per_s_q3": float(np.percentile(ips, 75)),
         "step_ms_median": 1e3 * statistics.median(times), "setup_s": compile_s,
         "final_loss": float(np.asarray(metrics["loss"]))}
  print(f"{variant:14s} {row['images_per_s_median']:9.1f} img/s  "
        f"{row['step_ms_median']:8.1f} ms/step  (setup+compile {compile_s:.0f} s)", flush=True)
  return row


def table(args, rows: list[dict]) -> str:
  base = {r["variant"]: r for r in rows}.get("optax")
  lines = [f"{args.model} {args.dtype}, batch {args.batch}, {args.size} px, one "
           f"{jax.devices()[0].device_kind} ({jax.default_backend()})", "",
           "| variant | images/s (median) | q1-q3 | ms/step | vs optax |",
           "|---|---:|---:|---:|---:|"]
  for r in rows:
    ratio = f"{r['images_per_s_median'] / base['images_per_s_median']:.2f}x" if base else "-"
    lines.append(f"| {r['variant']} | {r['images_per_s_median']:.1f} | "
                 f"{r['images_per_s_q1']:.1f}-{r['images_per_s_q3']:.1f} | "
                 f"{r['step_ms_median']:.1f} | {ratio} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  args, variants = parse_args(argv)
  num_classes = 1000
  rng = np.random.default_rng(0)
  images = rng.standard_normal((args.batch, args.size, args.size, 3), np.float32)
  labels = rng.integers(0, num_classes, args.batch).astype(np.int32)
  rows = [run_variant(args, v, images, labels, num_classes) for v in variants]
  text = table(args, rows)
  print(text)
  meta = {"jax": jax.__version__, "backend": jax.default_backend(),
          "device": jax.devices()[0].device_kind, "machine": platform.machine(),
          "model": args.model, "dtype": args.dtype, "batch": args.batch, "size": args.size,
          "num_filters": args.num_filters, "steps": args.steps, "warmup": args.warmup,
          "command": command_line("benchmarks/step.py", sys.argv[1:])}
  write_results(args.out, {"meta": meta, "results": rows}, text)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
