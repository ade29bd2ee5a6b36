"""What error feedback holds back at P workers: each exchange's residuals along a training run,
for TopK all-gather and gTop-k, on the task's real per-worker gradients.

  python -m studies.worker_scaling.residuals --config configs/tta_fmnist_mlp.py \\
      --workers 16 --density 0.01 --steps 144 --every 24 \\
      --out studies/worker_scaling/results/residuals_fmnist_selected.json

The parameters follow the task's dense recipe at P workers (the global batch split over them,
as in run.py). At every step each exchange below takes the same per-worker gradients g_i and
runs with its own memory (residual r_i and velocity u_i, DGC's momentum correction with the
recipe's momentum and Nesterov, the library's `comm.topk_allgather` / `comm.gtopk_allreduce`),
at `--density` from the first step (no density warm-up): a shadow of each exchange on one
trajectory, so that only the exchange differs.

  allgather-mc   each worker's k largest candidates, unmasked velocity (run.py's allgather-mc)
  gtopk-mc       gTop-k at k, unmasked; gtopk-mcm masked; gtopk-mc-logP at k x max(1,
                 log2(P)/2) and gtopk-mc-P at k x P/2, unmasked (`--systems`: some of them)

Reported per P, system and window of `--every` steps (means over the window's steps):
  held      sum_i ||r_i||^2 over ||sum_i g_i||^2: the memory against one step's global gradient
  aligned   ||sum_i r_i||^2 over P sum_i ||r_i||^2: 1 where the workers' residuals agree (signal
            held back), 1/P where they are independent (each worker's own noise, which cancels
            in a sum and which only its own flush removes)
  sent      <total, S> / ||S||^2, S = sum_i of the candidates (what was sent plus what is kept):
            the share of the accumulated direction one exchange sends
  moved     ||total||^2 over ||sum_i g_i||^2: the size of what one exchange applies against
            one step's global gradient (a sum that carries each worker's noise is larger)
  delay     how old what one exchange applies is, in steps: at each position a worker sends,
            the mean step of what its memory gathered there since it last sent (each step's
            candidate term weighted by its magnitude) subtracted from this step, averaged
            over what the workers send weighted by its magnitude; 0 for a value sent the step
            it came
One process per worker count, each with that many CPU devices (no network, nothing timed).
"""

from __future__ import annotations

import os
import sys

MAX_WORKERS = int(os.environ.get("SPARSEJAX_MAX_WORKERS", "16"))
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={MAX_WORKERS}")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from sparsejax.bench import (  # noqa: E402
  command_line,
  footer,
  json_path,
  portable_path,
  write_results,
)

SYSTEMS = ("allgather-mc", "gtopk-mc", "gtopk-mcm", "gtopk-mc-logP", "gtopk-mc-P")
METRICS = ("held", "aligned", "sent", "moved", "delay")


def window_means(series: list[dict[str, float]], every: int) -> list[dict[str, Any]]:
  """Means of each metric over consecutive windows of `every` steps (the last may be short);
  each row names its window by its last step (1-based)."""
  rows = []
  for start in range(0, len(series), every):
    chunk = series[start:start + every]
    rows.append({"step": start + len(chunk),
                 **{m: float(np.mean([s[m] for s in chunk])) for m in chunk[0]}})
  return rows


def delay_step(g, r, u, new_r, age, step, *, axes, momentum: float, nesterov: bool):
  """`delay` (module docstring) of one exchange inside `shard_map`, from this worker's gradient
  `g`, its memory before the exchange (residual `r`, velocity `u`, unmasked), its residual
  after it and `age = (mass, moment)`: per position, the summed magnitude of the candidate
  terms gathered since it last sent and those magnitudes times their steps. Returns `(new
  age, delay)`, the delay the same on every worker."""
  import jax
  import jax.numpy as jnp
  velocity = momentum * u + g
  term = g + momentum * velocity if nesterov else velocity
  acc = r + term
  sent = (acc != 0) & (new_r == 0)
  mass, moment = age
  mass = mass + jnp.abs(term)
  moment = moment + jnp.abs(term) * step
  old = step - moment / jnp.where(mass > 0, mass, 1.0)
  weight = jnp.where(sent, jnp.abs(acc), 0.0)
  delay = jax.lax.psum(jnp.vdot(weight, old), axes) / jax.lax.psum(jnp.sum(weight), axes)
  return (jnp.where(sent, 0.0, mass), jnp.where(sent, 0.0, moment)), delay


def shadow_step(name: str, g, r, u, *, k: int, axes, momentum: float, nesterov: bool):
  """One exchange of system `name` (inside `shard_map` over `axes`) from this worker's
  gradient `g`, residual `r` and velocity `u`: `(new residual, new velocity, metrics)`, the
  metrics (held, aligned, sent, moved) the same on every worker."""
  import jax
  import jax.numpy as jnp

  from sparsejax import comm
  from sparsejax.feedback import Feedback, MomentumCorrection
  if name not in SYSTEMS:
    raise ValueError(f"system {name!r}: expected one of {SYSTEMS}")
  kw = dict(k=k, residual=Feedback(r, u), select="mstopk",
            correction=MomentumCorrection(momentum, nesterov, name == "gtopk-mcm"))
  if name.startswith("allgather"):
    total, fb = comm.topk_allgather(g, axes=axes, **kw)
  else:
    total, fb = comm.gtopk_allreduce(g, axes=axes, **kw)
  workers = comm.axis_size(axes)
  g_sum = jax.lax.psum(g, axes)
  r_sum = jax.lax.psum(fb.residual, axes)
  s = total + r_sum  # every candidate: sent plus kept
  r2 = jax.lax.psum(jnp.vdot(fb.residual, fb.residual), axes)
  metrics = jnp.stack([r2 / jnp.vdot(g_sum, g_sum),
                       jnp.vdot(r_sum, r_sum) / (workers * r2),
                       jnp.vdot(total, s) / jnp.vdot(s, s),
                       jnp.vdot(total, total) / jnp.vdot(g_sum, g_sum)])
  return fb.residual, fb.velocity, metrics


def measure(config_path: str, sets: list[str], workers: int, density: float, steps: int,
            every: int, systems: tuple[str, ...] = SYSTEMS) -> list[dict[str, Any]]:
  """In this process (`workers` CPU devices): `steps` steps of the task's dense recipe, each
  exchange's shadow beside them."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  from sparsejax.train import Run
  from sparsejax.train import config as config_lib
  from sparsejax.train import step as step_lib
  from sparsejax.train.mesh import WORKERS
  tree = config_lib.apply_overrides(config_lib.load_config(config_path), [
      *sets, f"mesh.nodes={workers}", "mesh.local=1", f"mesh.num_devices={workers}",
      "compression.algorithm=dense", "checkpoint_every_steps=0"])
  config = config_lib.validate(tree)
  run = Run(config)
  setup, mesh = run.setup, run.setup.mesh
  n = setup.layout.padded_size
  k = max(1, round(density * setup.layout.size))
  momentum, nesterov = float(config.optimizer.momentum), bool(config.optimizer.nesterov)
  ks = {"allgather-mc": k, "gtopk-mc": k, "gtopk-mcm": k,
        "gtopk-mc-logP": min(setup.layout.size, round(k * max(1.0, math.log2(workers) / 2))),
        "gtopk-mc-P": min(setup.layout.size, k * workers // 2)}

  def per_worker(params, stats, inputs, labels, step, memory):
    g, _, _ = step_lib.gradient(setup, step, params, stats, inputs, labels)
    new, out = {}, {}
    for name in systems:
      r, u, mass, moment = (m[0] for m in memory[name])
      new_r, new_u, metrics = shadow_step(name, g, r, u, k=ks[name], axes=WORKERS,
                                          momentum=momentum, nesterov=nesterov)
      age = (mass, moment)
      if name != "gtopk-mcm":  # (masked: the candidate terms are not the unmasked velocity's)
        age, delay = delay_step(g, r, u, new_r, age, step.astype(jnp.float32), axes=WORKERS,
                                momentum=momentum, nesterov=nesterov)
        metrics = jnp.concatenate([metrics, delay[None]])
      out[name] = metrics
      new[name] = tuple(m[None] for m in (new_r, new_u, *age))
    return new, out

  spec = P(WORKERS)
  mem_spec = {name: (spec,) * 4 for name in systems}
  fn = jax.jit(jax.shard_map(
      per_worker, mesh=mesh, in_specs=(P(), P(WORKERS), spec, spec, P(), mem_spec),
      out_specs=(mem_spec, {name: P() for name in systems}), check_vma=False))
  zeros = jnp.zeros((workers, n), jnp.float32)
  memory = {name: (zeros,) * 4 for name in systems}
  series: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
  for done in range(steps):
    inputs, labels = run.batch(done)
    memory, out = fn(run.state.params, run.state.batch_stats, inputs, labels,
                     jnp.int32(done), memory)
    for name, values in jax.device_get(out).items():
      series[name].append(dict(zip(METRICS, (float(v) for v in values))))
    run.step(done)
    run.wait()
  return [{"workers": workers, "system": name, "k": ks[name], **row}
          for name in systems for row in window_means(series[name], every)]


def table(results: dict[str, Any]) -> str:
  meta = results["meta"]
  shown = [s for s in SYSTEMS if any(r["system"] == s for r in results["rows"])]
  lines = [
      f"What error feedback holds back at P workers on `{meta['config']}` (density "
      f"{meta['density']:g}; each exchange's shadow along the dense recipe's trajectory, the "
      "global batch split over P, DGC's momentum correction, no density warm-up). Means over "
      f"windows of {meta['every']} steps, named by their last step. held: the workers' "
      "residuals sum_i ||r_i||^2 over one step's ||sum_i g_i||^2; aligned: ||sum_i r_i||^2 / "
      "(P sum_i ||r_i||^2), 1 where the residuals agree, 1/P where they are each worker's own "
      "noise; sent: the share <total, S> / ||S||^2 of the summed candidates S one exchange "
      "sends; moved: what one exchange applies, ||total||^2 / ||sum_i g_i||^2.", "",
      "| P | steps | " + " | ".join(f"{s}: held | aligned | sent | moved" for s in shown) + " |",
      "|---:|---:|" + "---:|---:|---:|---:|" * len(shown)]
  keys = sorted({(r["workers"], r["step"]) for r in results["rows"]})
  for p, step in keys:
    by = {r["system"]: r for r in results["rows"] if r["workers"] == p and r["step"] == step}
    cells = " | ".join(f"{by[s]['held']:.3g} | {by[s]['aligned']:.3f} | {by[s]['sent']:.3f} | "
                       f"{by[s]['moved']:.3g}"
                       for s in shown)
    lines.append(f"| {p} | {step} | {cells} |")
  timed = [s for s in shown if any("delay" in r for r in results["rows"] if r["system"] == s)]
  if timed:
    lines += ["", "delay: the mean age in steps of what one exchange applies (module docstring)",
              "", "| P | steps | " + " | ".join(timed) + " |", "|---:|---:|" + "---:|" * len(timed)]
    for p, step in keys:
      by = {r["system"]: r for r in results["rows"] if r["workers"] == p and r["step"] == step}
      lines.append(f"| {p} | {step} | " + " | ".join(f"{by[s]['delay']:.2f}" for s in timed)
                   + " |")
  return "\n".join(lines) + "\n\n" + footer(meta)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config")
  ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
  ap.add_argument("--workers", default="2,4,8,16")
  ap.add_argument("--density", type=float, default=0.01)
  ap.add_argument("--steps", type=int, default=144)
  ap.add_argument("--every", type=int, default=12, help="steps a row averages")
  ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of "
                  + ", ".join(SYSTEMS))
  ap.add_argument("--out", type=json_path, required=True)
  ap.add_argument("--from-results", metavar="JSON", help="no runs: the table again")
  args = ap.parse_args(argv)
  if args.from_results:
    with open(args.from_results) as f:
      results = json.load(f)
  else:
    if not args.config:
      ap.error("--config is required (or --from-results)")
    try:
      workers = [int(p) for p in args.workers.split(",") if p]
    except ValueError as e:
      ap.error(f"--workers takes comma-separated integers: {e}")
    systems = tuple(x for x in args.systems.split(",") if x)
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or not systems:
      ap.error(f"--systems: {unknown or 'none'} not among {', '.join(SYSTEMS)}")
    if (any(p < 2 for p in workers) or args.steps < 1 or args.every < 1
        or not 0 < args.density < 1):
      ap.error(f"--workers >= 2 (got {workers}), --steps and --every >= 1 (got {args.steps}, "
               f"{args.every}), --density in (0, 1) (got {args.density})")
    rows = []
    for p in workers:
      if workers == [MAX_WORKERS]:
        rows += measure(args.config, args.sets, p, args.density, args.steps, args.every,
                        systems)
      else:
        rows += _in_child(args, p)
    from studies.time_to_accuracy.systems import load_task, model_size
    results = {"meta": {
        "command": command_line(__file__, list(sys.argv[1:] if argv is None else argv)),
        "config": portable_path(args.config), "sets": args.sets, "density": args.density,
        "workers": workers, "systems": list(systems), "steps": args.steps,
        "every": args.every,
        "parameters": model_size(load_task(args.config, args.sets)),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d")}, "rows": rows}
  text = table(results)
  print(text)
  write_results(args.out, results, text)
  return 0


def _in_child(args, workers: int) -> list[dict[str, Any]]:
  """The measurement at `workers` workers, by this script in a process with that many devices."""
  from studies.worker_scaling.child import in_child
  return in_child(__file__, ["--config", args.config, *(f"--set={s}" for s in args.sets),
                             "--workers", str(workers), "--density", str(args.density),
                             "--steps", str(args.steps), "--every", str(args.every),
                             "--systems", args.systems],
                  workers, "rows")


if __name__ == "__main__":
  sys.exit(main())
