"""Time to accuracy at 16, 128 and 1,024 GPU nodes: the node-scaling projection's step (the
exchange modelled on published GPU-cluster figures, `studies/node_scaling`) times a convergence
term, each system's steps to the target over dense's as a function of the node count, fitted to
this study's runs.

  python -m studies.worker_scaling.projected \\
      --scaling studies/worker_scaling/results/worker_scaling_fmnist.json \\
      --out studies/worker_scaling/results/projected_fmnist.json

The convergence term of a system X at P nodes is f_X(P) = median steps of X at P workers over
dense's median steps (dense's step is the same at every P: the global batch split and averaged
back), measured at the worker counts the runs cover and fitted there as a + b log2 P (least
squares on the medians). Beyond the largest measured P two readings bracket it: the term held
at its value there ("held") and the fitted line extended ("log-linear"). In HiTopKComm the
exchange between nodes runs on each node's summed shard, so its workers for convergence are the
nodes; the node-scaling projection's sparse exchange is TopK all-gather (HiTopKComm) and gTop-k
(HiTopKComm-gTop-k) at its density between N nodes of 8 GPUs.

Time to the target over the best dense system's (the lesser step of a flat and a hierarchical
all-reduce, whose term is 1): f_X(P) x step_X / step_dense. Picked: the least of them.
`--from-results JSON` writes the table again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, NamedTuple

from sparsejax.bench import (
  command_line,
  footer,
  json_path,
  portable_path,
  resolve,
  write_results,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

PROJECTION = os.path.join("studies", "node_scaling", "results", "node_scaling.json")
# the projection's algorithm -> the convergence runs' kind of system that stands for it
SPARSE = {"hitopk": "allgather", "higtopk": "gtopk"}
DENSE = ("dense", "hierarchical")
NAMES = {"hitopk": "HiTopKComm (all-gather)", "higtopk": "HiTopKComm-gTop-k"}


class Term(NamedTuple):
  """A system's steps over dense's against the worker count: the measured medians
  ({P: factor}) and the line a + b log2 P fitted to them."""
  system: str
  measured: dict[int, float]
  a: float
  b: float

  @property
  def largest(self) -> int:
    return max(self.measured)

  def held(self, p: int) -> float:
    """The measured factor at `p`, else the line inside the measured range, else the factor
    at the largest measured P."""
    if p in self.measured:
      return self.measured[p]
    return self.fitted(min(p, self.largest))

  def fitted(self, p: int) -> float:
    """The measured factor at `p`, else the line at `p` (extended past the measured range)."""
    if p in self.measured:
      return self.measured[p]
    return self.a + self.b * math.log2(p)


def fit_term(system: str, measured: dict[int, float]) -> Term:
  """`Term` with a + b log2 P by least squares (one point: the line flat through it)."""
  if not measured:
    raise ValueError(f"system {system!r}: no worker count reached the target on every seed")
  xs = [math.log2(p) for p in measured]
  ys = list(measured.values())
  if len(xs) == 1:
    return Term(system, dict(measured), ys[0], 0.0)
  mx, my = statistics.fmean(xs), statistics.fmean(ys)
  b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
  return Term(system, dict(measured), my - b * mx, b)


def terms(scaling: dict[str, Any], systems: dict[str, str]) -> dict[str, Term]:
  """Each projected algorithm's `Term` from the worker-scaling results: `systems` maps the
  projection's algorithm to a system name of the runs (its median steps at each P where every
  seed reached the target, over dense's median steps at the fewest workers it ran at)."""
  rows = scaling["rows"]
  dense = sorted((r for r in rows if r["system"] == "dense"), key=lambda r: r["workers"])
  if not dense or any(s is None for s in dense[0]["steps_to_target"]):
    raise ValueError("the results have no dense run that reached the target on every seed")
  dense_steps = statistics.median(dense[0]["steps_to_target"])
  out = {}
  for algorithm, system in systems.items():
    mine = [r for r in rows if r["system"] == system]
    if not mine:
      raise ValueError(f"system {system!r} is not in the results; there: "
                       f"{sorted({r['system'] for r in rows})}")
    measured = {r["workers"]: statistics.median(r["steps_to_target"]) / dense_steps
                for r in sorted(mine, key=lambda r: r["workers"])
                if all(s is not None for s in r["steps_to_target"])}
    out[algorithm] = fit_term(system, measured)
  return out


def analyse(projection: list[dict[str, Any]], fitted: dict[str, Term]) -> list[dict[str, Any]]:
  """One row per (model, cluster, nodes): each system's step, term and time to the target over
  the best dense system's, and the pick (by the log-linear term; by the held one too)."""
  groups: dict[tuple, dict[str, dict]] = {}
  for r in projection:
    groups.setdefault((r["model"], r["cluster"], r["nodes"]), {})[r["algorithm"]] = r
  rows = []
  for (model, cluster, nodes), by in groups.items():
    dense = min((by[a] for a in DENSE if a in by), key=lambda r: r["step_s"])
    row = {"model": model, "cluster": cluster, "nodes": nodes, "dense": dense["algorithm"],
           "dense_step_s": dense["step_s"], "systems": {}}
    for algorithm, term in fitted.items():
      step_s = by[algorithm]["step_s"]
      ratio = step_s / dense["step_s"]
      row["systems"][algorithm] = {
          "system": term.system, "step_s": step_s, "step_over_dense": ratio,
          "term_held": term.held(nodes), "term_fitted": term.fitted(nodes),
          "measured": nodes in term.measured,
          "time_over_dense_held": term.held(nodes) * ratio,
          "time_over_dense_fitted": term.fitted(nodes) * ratio}
    for reading in ("held", "fitted"):
      times = {"dense": 1.0, **{a: s[f"time_over_dense_{reading}"]
                                for a, s in row["systems"].items()}}
      row[f"picked_{reading}"] = min(times, key=times.get)
    rows.append(row)
  return rows


def _name(algorithm: str) -> str:
  return NAMES.get(algorithm, algorithm)


def table(results: dict[str, Any]) -> str:
  meta = results["meta"]
  lines = [
      f"Time to the target at N nodes of 8 GPUs over the best dense system's (below 1: sooner), "
      f"by the convergence term of `{meta['scaling']}` (`{meta['config']}`, {meta['seeds']} "
      f"seeds, density {meta['density']:g}) times the step of `{meta['projection']}` "
      f"(its section 2: fp32 gradients, density {meta['projection_density']:g}).", "",
      "Convergence term (steps to the target over dense's; measured medians, and the line "
      "a + b log2 P fitted to them):", "",
      "| projected as | runs' system | measured (P: factor) | a | b |",
      "|---|---|---|---:|---:|"]
  for algorithm, t in results["terms"].items():
    measured = ", ".join(f"{p}: {v:.2f}" for p, v in sorted(
        (int(p), v) for p, v in t["measured"].items()))
    lines.append(f"| {_name(algorithm)} | {t['system']} | {measured} | {t['a']:.3f} | "
                 f"{t['b']:+.3f} |")
  algorithms = list(results["terms"])
  lines += ["", "Term at N (held at the largest measured P / the line extended; one value where "
            "measured), step over the best dense step, and time to the target over dense's "
            "(held / line):", "",
            "| model | cluster | nodes | best dense step s | "
            + " | ".join(f"{_name(a)}: term, step ratio, time" for a in algorithms)
            + " | picked (held / line) |",
            "|---|---|---:|---:|" + "---|" * len(algorithms) + "---|"]
  for r in results["rows"]:
    cells = []
    for a in algorithms:
      s = r["systems"][a]
      term = (f"{s['term_held']:.2f}" if s["measured"] or s["term_held"] == s["term_fitted"]
              else f"{s['term_held']:.2f} / {s['term_fitted']:.2f}")
      when = (f"{s['time_over_dense_held']:.2f}" if s["measured"]
              or s["term_held"] == s["term_fitted"]
              else f"{s['time_over_dense_held']:.2f} / {s['time_over_dense_fitted']:.2f}")
      cells.append(f"{term}, {s['step_over_dense']:.2f}, **{when}**")
    picked = (_name(r["picked_held"]) if r["picked_held"] == r["picked_fitted"]
              else f"{_name(r['picked_held'])} / {_name(r['picked_fitted'])}")
    lines.append(f"| {r['model']} | {r['cluster']} | {r['nodes']:,} | {r['dense_step_s']:.3f} | "
                 + " | ".join(cells) + f" | {picked} |")
  lines += ["", "Sources: the steps to the target from the runs above (workers as CPU devices of "
            "one process; the Fashion-MNIST MLP, not the projected models: the only "
            "convergence term measured); each step from the node-scaling projection, whose "
            "inputs and their sources are listed in its table. The term is measured at the "
            "runs' density, the steps at the projection's.", "", footer(meta)]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--scaling", help="a worker_scaling results JSON (the convergence runs)")
  ap.add_argument("--projection", default=PROJECTION,
                  help="node_scaling's results JSON (its `projection` rows)")
  ap.add_argument("--allgather", default="allgather-0.01-mc",
                  help="the runs' system standing for HiTopKComm's all-gather")
  ap.add_argument("--gtopk", default="gtopk-0.01-mc",
                  help="the runs' system standing for HiTopKComm-gTop-k")
  ap.add_argument("--out", type=json_path, required=True)
  ap.add_argument("--from-results", metavar="JSON",
                  help="the terms and steps stored there: the rows and table again")
  args = ap.parse_args(argv)
  if args.from_results:
    with open(args.from_results) as f:
      results = json.load(f)
    fitted = {a: Term(t["system"], {int(p): v for p, v in t["measured"].items()}, t["a"], t["b"])
              for a, t in results["terms"].items()}
  else:
    if not args.scaling:
      ap.error("--scaling is required (or --from-results)")
    with open(args.scaling) as f:
      scaling = json.load(f)
    with open(resolve(args.projection)) as f:
      projection = json.load(f)["projection"]
    try:
      fitted = terms(scaling, {"hitopk": args.allgather, "higtopk": args.gtopk})
    except ValueError as e:
      ap.error(str(e))
    densities = {r["density"] for r in scaling["rows"]
                 if r["system"] in (args.allgather, args.gtopk)}
    from studies.node_scaling import run as node_scaling
    smeta = scaling["meta"]
    results = {
        "meta": {"command": command_line(__file__, list(sys.argv[1:] if argv is None
                                                        else argv)),
                 "scaling": portable_path(args.scaling),
                 "projection": portable_path(resolve(args.projection)),
                 "config": smeta["config"], "seeds": smeta["seeds"],
                 "density": min(densities), "projection_density": node_scaling.DENSITY,
                 "machine": platform.machine(), "cpus": os.cpu_count(),
                 "date": time.strftime("%Y-%m-%d")},
        "terms": {a: {"system": t.system, "measured": {str(p): v for p, v in t.measured.items()},
                      "a": t.a, "b": t.b} for a, t in fitted.items()},
        "projection": projection}
  results["rows"] = analyse(results["projection"], fitted)
  text = table(results)
  print(text)
  write_results(args.out, results, text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
