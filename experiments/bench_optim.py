"""Fused optimizer updates vs optax on real parameter trees, with the memory-traffic floor.

  python experiments/bench_optim.py [--quick] [--runs 7] [--trees resnet50,transformer_base]
                                    [--out experiments/results/bench_optim.json]

For the ResNet-50 tree (161 leaves, 25,557,032 values) and the Transformer-base tree (257 leaves,
60,524,544 values), and for SGD with momentum (+ weight decay), LARS, LAMB and AdamW, times one
`update(grads, state, params)` call of

  optax   the optax optimizer on the pytree;
  pytree  the fused optimizer's pytree face (drop-in for optax: pytrees in and out, flat state);
  flat    the fused optimizer's flat face (1-D buffers, as the trainer calls it);
  floor   one elementwise pass that reads each buffer the update reads (grads, params, moments)
          once and writes each buffer it writes (updates, moments) once.

Every variant is jitted with the gradient and the optimizer state donated, as in a training step
(no fresh allocations for outputs), and timed in the same process: median and quartiles of `--runs`
calls after two warm-up calls. Kernels are the work-launching instructions of the optimized HLO
(`sparsejax.hlo.num_kernels`: fusions, custom calls and unfused ops). Writes JSON and a markdown
table next to it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import param_trees  # noqa: E402
from results_io import write_results  # noqa: E402

from sparsejax import hlo, optim  # noqa: E402

LR, WD = 0.1, 1e-4


def optimizers() -> dict[str, tuple[Callable, optax.GradientTransformation]]:
  """name -> (fused factory taking `layout=`, optax original)."""
  return {
      "sgd": (lambda **kw: optim.fused_sgd(LR, momentum=0.9, weight_decay=WD, **kw),
              optax.chain(optax.add_decayed_weights(WD), optax.sgd(LR, momentum=0.9))),
      "lars": (lambda **kw: optim.fused_lars(LR, weight_decay=WD, **kw),
               optax.lars(LR, weight_decay=WD)),
      "lamb": (lambda **kw: optim.fused_lamb(LR, weight_decay=WD, **kw),
               optax.lamb(LR, weight_decay=WD)),
      "adamw": (lambda **kw: optim.fused_adamw(LR, weight_decay=WD, **kw),
                optax.adamw(LR, weight_decay=WD)),
  }


def floor(g, moments, p):
  """One pass: reads grads, params and each moment once; writes updates and each moment once."""
  return g * 0.5 + p * 0.25, tuple(m * 0.75 for m in moments)


def time_update(fn: Callable, g, state, p, runs: int) -> dict[str, float]:
  """Times `fn(g, state, p) -> (u, state)` jitted with g and state donated; milliseconds."""
  jitted = jax.jit(fn, donate_argnums=(0, 1))
  kernels = hlo.num_kernels(jitted.lower(g, state, p).compile())
  times = []
  for i in range(runs + 2):
    g_in = jax.tree.map(jnp.copy, g)
    jax.block_until_ready(g_in)
    t0 = time.perf_counter()
    u, state = jitted(g_in, state, p)
    jax.block_until_ready((u, state))
    if i >= 2:
      times.append(time.perf_counter() - t0)
    del u
  return {"median_ms": 1e3 * statistics.median(times),
          "q1_ms": 1e3 * float(np.percentile(times, 25)),
          "q3_ms": 1e3 * float(np.percentile(times, 75)), "kernels": kernels}


def random_tree(shapes, seed: int):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape, np.float32)), shapes)


def bench_tree(name: str, shapes, names: list[str], runs: int) -> list[dict]:
  params, grads = random_tree(shapes, 0), random_tree(shapes, 1)
  layout = optim.flat_layout(shapes)
  flat_p, flat_g = layout.ravel(params, jnp.float32), layout.ravel(grads, jnp.float32)
  n = layout.size
  rows = []
  for opt in names:
    make_fused, reference = optimizers()[opt]
    cases = {"optax": (reference, grads, params), "pytree": (make_fused(), grads, params),
             "flat": (make_fused(layout=layout), flat_g, flat_p)}
    for impl, (tx, g, p) in cases.items():
      state = tx.init(p)
      res = time_update(tx.update, g, state, p, runs)
      rows.append({"tree": name, "optimizer": opt, "impl": impl, "values": n, **res})
      print(f"{name:17s} {opt:6s} {impl:7s} {res['median_ms']:8.1f} ms  kernels={res['kernels']}",
            flush=True)
      del state
    fused_state = cases["flat"][0].init(flat_p)
    moments = tuple(x for x in jax.tree.leaves(fused_state) if x.ndim == 1 and x.size)
    res = time_update(floor, flat_g, moments, flat_p, runs)
    rows.append({"tree": name, "optimizer": opt, "impl": "floor", "values": n, **res})
    print(f"{name:17s} {opt:6s} {'floor':7s} {res['median_ms']:8.1f} ms  kernels={res['kernels']}",
          flush=True)
  return rows


def table(rows: list[dict]) -> str:
  get = {(r["tree"], r["optimizer"], r["impl"]): r for r in rows}
  lines = ["| tree | optimizer | optax ms | fused pytree ms | fused flat ms | floor ms | "
           "flat speed-up over optax | flat / floor | kernels optax / pytree / flat |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for tree, opt in dict.fromkeys((r["tree"], r["optimizer"]) for r in rows):
    o, t, f, fl = (get[(tree, opt, k)] for k in ("optax", "pytree", "flat", "floor"))
    lines.append(
        f"| {tree} | {opt} | {o['median_ms']:.1f} | {t['median_ms']:.1f} | {f['median_ms']:.1f} | "
        f"{fl['median_ms']:.1f} | {o['median_ms'] / f['median_ms']:.2f}x | "
        f"{f['median_ms'] / fl['median_ms']:.2f}x | "
        f"{o['kernels']} / {t['kernels']} / {f['kernels']} |")
  return "\n".join(lines)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="ResNet-50 tree only, 3 runs")
  ap.add_argument("--runs", type=int, default=7)
  ap.add_argument("--trees", default="resnet50,transformer_base")
  ap.add_argument("--optimizers", default="sgd,lars,lamb,adamw")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                "bench_optim.json"))
  args = ap.parse_args()
  trees = ["resnet50"] if args.quick else args.trees.split(",")
  runs = 3 if args.quick else args.runs
  names = args.optimizers.split(",")
  for t in trees:
    if t not in param_trees.TREES:
      ap.error(f"unknown tree {t!r}; allowed: {sorted(param_trees.TREES)}")
  for o in names:
    if o not in optimizers():
      ap.error(f"unknown optimizer {o!r}; allowed: {sorted(optimizers())}")
  rows = []
  for t in trees:
    rows += bench_tree(t, param_trees.TREES[t](), names, runs)
  text = table(rows)
  print(text)
  meta = {"jax": jax.__version__, "optax": optax.__version__, "backend": jax.default_backend(),
          "cpu_count": os.cpu_count(), "machine": platform.machine(), "runs": runs,
          "command": " ".join(["python", "experiments/bench_optim.py"] + sys.argv[1:])}
  write_results(args.out, {"meta": meta, "results": rows}, text)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
