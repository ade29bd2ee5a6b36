"""Fused optimizer updates vs optax on real parameter trees, with the memory-traffic floor.

  python -m benchmarks.optim [--quick] [--runs 7] [--trees resnet50,transformer_base]
                                    [--out benchmarks/results/bench_optim.json]

For the ResNet-50 tree (161 leaves, 25,557,032 values) and the Transformer-base tree (257 leaves,
60,524,544 values) (or `--trees uniform_64k,...,uniform_2.4m`: ResNet-50's count of values in
leaves of one size, to see how the time depends on tensor size; `param_trees.UNIFORM_LEAVES`),
and for SGD with momentum (+ weight decay), LARS, LAMB and AdamW, times one
`update(grads, state, params)` call of

  optax   the optax optimizer on the pytree;
  pytree  the fused optimizer's pytree face (drop-in for optax: pytrees in and out, flat state);
  flat    the fused optimizer's flat face (1-D buffers, as the trainer calls it); on CPU this is
          the C++ kernel of `sparsejax.cpu_kernels` when it could be built;
  flat_xla  the flat face's pure-XLA path (what runs without a compiler, and on GPU);
  floor   one elementwise pass that reads each buffer the update reads (grads, params, moments)
          once and writes each buffer it writes (updates, moments) once.

Every variant is jitted with the gradient and the optimizer state donated, as in a training step
(no fresh allocations for outputs), and timed in the same process, interleaved: each round calls
every variant once, so slow spells of this shared machine hit all of them. Reported: median and
quartiles of `--runs` rounds after two warm-up rounds, and the median over rounds of the per-round
ratios flat / floor and optax / flat. Kernels are the work-launching instructions of the
optimized HLO (`sparsejax.hlo.num_kernels`: fusions, custom calls and unfused ops). Writes JSON and
a markdown table next to it.
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

from benchmarks import param_trees
from sparsejax import cpu_kernels, hlo, optim
from sparsejax.bench import command_line, json_path, write_results

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


def compile_update(fn: Callable, g, state, p):
  """`fn(g, state, p) -> (u, state)` jitted with g and state donated, and its kernel count."""
  jitted = jax.jit(fn, donate_argnums=(0, 1))
  return jitted, hlo.num_kernels(jitted.lower(g, state, p).compile())


def time_interleaved(variants: dict[str, tuple], runs: int) -> dict[str, list[float]]:
  """variants: name -> [jitted, g, state, p]. Each round calls each variant once (fresh copy of
  g, the state carried over); returns each variant's times in seconds, round by round."""
  times: dict[str, list[float]] = {k: [] for k in variants}
  for i in range(runs + 2):
    for name, v in variants.items():
      jitted, g, state, p = v
      g_in = jax.tree.map(jnp.copy, g)
      jax.block_until_ready(g_in)
      t0 = time.perf_counter()
      u, v[2] = jitted(g_in, state, p)
      jax.block_until_ready((u, v[2]))
      if i >= 2:
        times[name].append(time.perf_counter() - t0)
      del u
  return times


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
    variants, kernels = {}, {}
    for impl, (tx, g, p) in cases.items():
      state = tx.init(p)
      jitted, kernels[impl] = compile_update(tx.update, g, state, p)
      variants[impl] = [jitted, g, state, p]
    with cpu_kernels.disabled():
      tx = make_fused(layout=layout)
      state = tx.init(flat_p)
      jitted, kernels["flat_xla"] = compile_update(tx.update, flat_g, state, flat_p)
      variants["flat_xla"] = [jitted, flat_g, state, flat_p]
    moments = tuple(jnp.copy(x) for x in jax.tree.leaves(state) if x.ndim == 1 and x.size)
    jitted, kernels["floor"] = compile_update(floor, flat_g, moments, flat_p)
    variants["floor"] = [jitted, flat_g, moments, flat_p]
    times = time_interleaved(variants, runs)
    ratios = {"flat_over_floor": [a / b for a, b in zip(times["flat"], times["floor"])],
              "optax_over_flat": [a / b for a, b in zip(times["optax"], times["flat"])]}
    for impl, ts in times.items():
      row = {"tree": name, "optimizer": opt, "impl": impl, "values": n,
             "median_ms": 1e3 * statistics.median(ts),
             "q1_ms": 1e3 * float(np.percentile(ts, 25)),
             "q3_ms": 1e3 * float(np.percentile(ts, 75)), "kernels": kernels[impl]}
      if impl == "flat":
        row.update({k: statistics.median(v) for k, v in ratios.items()})
      rows.append(row)
      print(f"{name:17s} {opt:6s} {impl:8s} {row['median_ms']:8.1f} ms  kernels={row['kernels']}",
            flush=True)
    del variants
  return rows


def table(rows: list[dict]) -> str:
  get = {(r["tree"], r["optimizer"], r["impl"]): r for r in rows}
  lines = ["| tree | optimizer | optax ms | fused pytree ms | fused flat ms | flat, XLA path ms | "
           "floor ms | flat speed-up over optax | flat / floor | "
           "kernels optax / pytree / flat / flat XLA |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for tree, opt in dict.fromkeys((r["tree"], r["optimizer"]) for r in rows):
    o, t, f, x, fl = (get[(tree, opt, k)]
                      for k in ("optax", "pytree", "flat", "flat_xla", "floor"))
    lines.append(
        f"| {tree} | {opt} | {o['median_ms']:.1f} | {t['median_ms']:.1f} | {f['median_ms']:.1f} | "
        f"{x['median_ms']:.1f} | {fl['median_ms']:.1f} | {f['optax_over_flat']:.2f}x | "
        f"{f['flat_over_floor']:.2f}x | "
        f"{o['kernels']} / {t['kernels']} / {f['kernels']} / {x['kernels']} |")
  return "\n".join(lines)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="ResNet-50 tree only, 3 runs")
  ap.add_argument("--runs", type=int, default=7)
  ap.add_argument("--trees", default="resnet50,transformer_base")
  ap.add_argument("--optimizers", default="sgd,lars,lamb,adamw")
  ap.add_argument("--out", type=json_path,
                  default=os.path.join(os.path.dirname(__file__), "results",
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
          "cpu_kernels": cpu_kernels.library_path() is not None,
          "cpu_count": os.cpu_count(), "machine": platform.machine(), "runs": runs,
          "command": command_line("benchmarks/optim.py", sys.argv[1:])}
  write_results(args.out, {"meta": meta, "results": rows}, text)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
