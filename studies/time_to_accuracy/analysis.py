"""The time-to-accuracy study's analysis (studies/time_to_accuracy/run.py writes the results):
steps and time to target per system and seed, time to target at each swept bandwidth (steps per
density level x the step time measured there), speed-ups, the dense exchange / compute ratio,
the pipelined exchange's overlap, algorithm auto's forms; the markdown tables and the plot."""

from __future__ import annotations

import math
import os
import re
import statistics
from typing import Any

from sparsejax.bench import footer, write_results
from studies.time_to_accuracy.systems import parse_bandwidths


def steps_to_target(curve: list[dict], target: float, metric: str = "accuracy") -> dict | None:
  """The first evaluation that reaches `target` (accuracy: at or above; loss: at or below),
  None if none does."""
  from sparsejax.train.config import target_reached
  return next((p for p in curve if target_reached(metric, p[metric], target)), None)


def target_metric(results: dict) -> str:
  """The eval metric the study's target is on (results written before it was stored: accuracy)."""
  return results["meta"].get("target_metric", "accuracy")


def analyse(results: dict, target: float) -> dict:
  """Per system: steps/time to target at the headline (measured), final accuracy, and the time
  to target at every swept bandwidth (per seed: steps per level x median step time)."""
  out: dict[str, Any] = {}
  sweep = results.get("sweep", [])
  metric = target_metric(results)
  for system in results["systems"]:
    runs = [r for r in results.get("train", []) if r["system"] == system]
    if not runs:
      continue
    seeds = []
    for r in runs:
      hit = steps_to_target(r["curve"], target, metric)
      seeds.append({"seed": r["seed"], "final": r["curve"][-1][metric],
                    "steps_to_target": hit["step"] if hit else None,
                    "train_time_to_target_s": hit["train_time_s"] if hit else None,
                    "node0_link_bytes_to_target": hit["node0_link_bytes"] if hit else None,
                    "levels_to_target": r.get("levels_to_target")})
    entry = {"seeds": seeds, "final": [s["final"] for s in seeds]}
    by_bw: dict[str, dict] = {}
    for row in (x for x in sweep if x["system"] == system):
      level = (row["density"], row.get("size"))  # (a density at an image size)
      by_bw.setdefault(row["bandwidth"], {}).setdefault(level, []).append(row["step_s"])
    tta = {}
    for bw, per_level in by_bw.items():
      vals = []
      for s in seeds:
        if s["levels_to_target"] is None or s["steps_to_target"] is None:
          vals.append(None)
          continue
        t = 0.0
        for *level, n in s["levels_to_target"]:  # [density, (size,) steps]
          t += n * statistics.median(per_level[level[0], level[1] if len(level) > 1 else None])
        vals.append(t)
      tta[bw] = vals
    entry["predicted_time_to_target_s"] = tta
    compute = compute_s(results, "torch" if system.startswith("torch") else "jax")
    at_unlimited = [row for row in sweep if row["system"] == system
                    and row["bandwidth"] == "unlimited"
                    and row["density"] == min(x["density"] for x in sweep
                                              if x["system"] == system)]
    if compute and at_unlimited:
      step = recipe_step(results, at_unlimited)
      entry["unlimited_step_s"] = step
      entry["exchange_share_unlimited"] = max(0.0, step - compute) / step
    headline = results["meta"]["headline"]
    if headline in tta:
      entry["measured_over_predicted_at_headline"] = [
          s["train_time_to_target_s"] / p if p else None for s, p in zip(seeds, tta[headline])]
    out[system] = entry
  return out


def recipe_step(results: dict, rows: list[dict]) -> float:
  """The median step of sweep `rows` (one system, bandwidth and density); with progressive
  resizing, each size's median weighted by the recipe's steps at that size (meta's
  `size_steps`), as the parity phase's compute-only step is."""
  shares = results["meta"].get("size_steps")
  if not shares or not any("size" in r for r in rows):
    return statistics.median(r["step_s"] for r in rows)
  by_size: dict[str, list[float]] = {}
  for r in rows:
    by_size.setdefault(str(r["size"]), []).append(r["step_s"])
  weight = sum(shares[size] for size in by_size)
  return sum(shares[size] * statistics.median(v) for size, v in by_size.items()) / weight


def compute_s(results: dict, runtime: str = "jax") -> float | None:
  """The compute-only step of `runtime` in the parity phase (median over its rounds)."""
  if not results.get("parity"):
    return None
  return statistics.median(r[runtime]["step_s"] for r in results["parity"])


def speedups(analysis: dict, over: str) -> dict[str, dict[str, list[float]]]:
  """system -> bandwidth -> [time to target of `over` / the system's], per seed."""
  base = analysis.get(over)
  if base is None:
    return {}
  out: dict[str, dict[str, list[float]]] = {}
  for system, e in analysis.items():
    for bw, vals in e["predicted_time_to_target_s"].items():
      ref = base["predicted_time_to_target_s"].get(bw, [])
      out.setdefault(system, {})[bw] = [r / v for r, v in zip(ref, vals) if r and v]
  return out


def _fmt_range(values: list[float | None], scale: float = 1.0, digits: int = 1) -> str:
  vals = sorted(v * scale for v in values if v is not None)
  if not vals:
    return "not reached"
  missing = len(values) - len(vals)
  text = (f"{statistics.median(vals):.{digits}f}" if len(vals) == 1 else
          f"{vals[0]:.{digits}f} / {statistics.median(vals):.{digits}f} / {vals[-1]:.{digits}f}")
  return text + (f" ({missing} not reached)" if missing else "")


def _times(ratios: list[float]) -> str:
  """Speed-ups as `min / median / max` followed by x; "not reached" when there are none."""
  text = _fmt_range(ratios, digits=2)
  return text if text == "not reached" else text + "x"


def make_tables(results: dict, analysis: dict, headline: str) -> str:
  """The markdown tables: parity, the training runs at the headline, the bandwidth sweep."""
  lines = []
  if results.get("parity"):
    ratios = [r["jax_over_torch"] for r in results["parity"]]
    jax_ms = [r["jax"]["step_s"] * 1e3 for r in results["parity"]]
    torch_ms = [r["torch"]["step_s"] * 1e3 for r in results["parity"]]
    p = results["parity"][0]
    lines += [f"Compute-only step, {_parity_processes(results['meta'])}, no communication "
              f"(batch {p['jax']['batch_per_process']} per process), min / median / max over "
              f"{len(ratios)} alternated process runs:", "",
              "| runtime | layout | ms per step | JAX / PyTorch |", "|---|---|---:|---:|",
              f"| sparsejax (XLA:CPU) | {p['jax']['layout']} | {_fmt_range(jax_ms)} | "
              f"{_fmt_range(ratios, digits=2)} |",
              f"| PyTorch | {p['torch']['layout']} | {_fmt_range(torch_ms)} | - |", ""]
  metric = target_metric(results)
  if analysis:
    link = headline
    last = "at the stop (the target)" if results["meta"].get("stop_at_target") else "final"
    if results["meta"].get("link_change"):
      rate, _, frac = results["meta"]["link_change"].partition("@")
      link = f"{headline}, then {rate} from {float(frac):.0%} of the recipe on"
    lines += [f"Training at {link} (seeds: min / median / max; evaluation time "
              "excluded; measured / predicted: the train time to target over the sum of the "
              "swept step times):", "",
              "| system | steps to target | train time to target s | measured / predicted | "
              f"node-0 link MB to target | {metric} {last} |", "|---|---:|---:|---:|---:|---:|"]
    for system, e in analysis.items():
      s = e["seeds"]
      check = e.get("measured_over_predicted_at_headline")
      lines.append(f"| {system} | {_fmt_range([x['steps_to_target'] for x in s], digits=0)} | "
                   f"{_fmt_range([x['train_time_to_target_s'] for x in s])} | "
                   f"{_fmt_range(check, digits=2) if check else '-'} | "
                   f"{_fmt_range([x['node0_link_bytes_to_target'] for x in s], 1e-6)} | "
                   f"{_fmt_range(e['final'], digits=4)} |")
    lines += _choice_lines(results)
    bws = [b for b, _ in parse_bandwidths(results["meta"]["bandwidths"])]
    have = [b for b in bws if any(b in e["predicted_time_to_target_s"] for e in analysis.values())]
    if have:
      ratio_row = results.get("exchange_over_compute", {})
      lines += ["", "Time to target (s, seeds min / median / max) by link bandwidth, each = steps "
                f"to target (trained at {headline}) x the median step time measured at that "
                "bandwidth and density level (not trained end to end, except the "
                f"{headline} column, whose end-to-end train time is in the table above); dense "
                "exchange / compute ratio in the header:", "",
                "| system | " + " | ".join(f"{b} ({ratio_row[b]:.2g})" if b in ratio_row
                                            else b for b in have) + " |",
                "|---|" + "---:|" * len(have)]
      for system, e in analysis.items():
        predicted = e["predicted_time_to_target_s"]  # (none for auto measuring: its forms
        # follow the link, so it is timed end to end only, in the table above)
        cells = [_fmt_range(predicted[b]) if b in predicted else "not swept" for b in have]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
      for over in ("dense", "torch-ddp"):
        ups = speedups(analysis, over)
        if not ups:
          continue
        lines += ["", f"Speed-up in time to target over {over} (its time / the system's, per seed:"
                  " min / median / max):", "",
                  "| system | " + " | ".join(have) + " |", "|---|" + "---:|" * len(have)]
        for system, by in ups.items():
          if system != over:
            lines.append(f"| {system} | " + " | ".join(
                _times(by.get(b, [])) for b in have) + " |")
    shares = {s: e for s, e in analysis.items() if "exchange_share_unlimited" in e}
    if shares:
      lines += ["", "At an unlimited link: step time at the final density, and the share of it "
                "that is not compute (the parity phase's step of the same runtime): selection, "
                "error feedback, scatter-add, the collective's CPU work:", "",
                "| system | step ms | exchange share |", "|---|---:|---:|"]
      for system, e in shares.items():
        lines.append(f"| {system} | {e['unlimited_step_s'] * 1e3:.1f} | "
                     f"{100 * e['exchange_share_unlimited']:.0f}% |")
  lines += _pipeline_lines(results)
  m = results["meta"]
  lines += ["", footer(m)]
  return "\n".join(lines)


def _parity_processes(meta: dict) -> str:
  """Where the parity phase's processes ran: each on its own core, or, with more nodes than the
  machine's cores, sharing them round-robin (the layout column says how many to a core).
  Results written before meta had `nodes` ran on 2."""
  nodes = meta.get("nodes", 2)
  if nodes <= meta.get("cpus", nodes):
    return "each node's process on its own core at once"
  return f"all {nodes} nodes' processes at once, sharing the cores round-robin"


def pipeline_overlap(results: dict) -> dict[str, dict[str, dict[str, list[float]]]]:
  """Per pipelined system and bandwidth, at its final density, per seed: the halves alone
  (compute_s, exchange_s), the pipelined step (step_s), its twin's step without the pipeline
  (serial_s, the system named without "-pipe", same seed), the timeline's ends, and the hidden
  fraction of the exchange: (compute + exchange - step) / exchange."""
  rows = [r for r in results.get("sweep", []) if "compute_s" in r]
  final = {}
  for r in rows:
    final[r["system"]] = min(final.get(r["system"], 1.0), r["density"])
  serial = {(r["system"], r["seed"], r["bandwidth"], r["density"]): r["step_s"]
            for r in results.get("sweep", [])}
  out: dict[str, dict[str, dict[str, list[float]]]] = {}
  for r in rows:
    if r["density"] != final[r["system"]]:
      continue
    twin = serial.get((unpipelined(r["system"]), r["seed"], r["bandwidth"], r["density"]))
    cell = out.setdefault(r["system"], {}).setdefault(r["bandwidth"], {})
    values = {k: r[k] for k in ("compute_s", "exchange_s", "step_s", "compute_end_s",
                                "exchange_end_s")}
    values["hidden"] = (r["compute_s"] + r["exchange_s"] - r["step_s"]) / r["exchange_s"]
    if twin is not None:
      values["serial_s"] = twin
    for k, v in values.items():
      cell.setdefault(k, []).append(v)
  return out


def unpipelined(system: str) -> str:
  """The name of a pipelined system's twin without the pipeline: "-pipe" and what qualifies it
  ("-p", "-l": its weight predictions; "-f0.25": its start) dropped, its `+key=value` overrides
  kept ("dense-pipe-l+x=1" -> "dense+x=1")."""
  name, sep, extra = system.partition("+")
  return re.sub(r"-pipe(-(p|l|f[0-9.]+))?$", "", name) + sep + extra


def _pipeline_lines(results: dict) -> list[str]:
  """The pipelined systems' overlap table."""
  got = pipeline_overlap(results)
  if not got:
    return []
  lines = ["", "The pipelined exchange, one rank, at the final density (ms, seeds min / median /"
           " max): the gradient alone, the exchange and update alone, one pipelined step (both "
           "dispatched together), the same system's step without the pipeline, when each half "
           "of a pipelined step ends (a thread waiting on each), and the hidden fraction of the "
           "exchange, (gradient + exchange - pipelined step) / exchange:", "",
           "| system | link | gradient | exchange | pipelined step | unpipelined step | "
           "gradient ends | exchange ends | hidden |", "|---|---|" + "---:|" * 7]
  for system, by in got.items():
    for bandwidth, v in by.items():
      keys = ("compute_s", "exchange_s", "step_s", "serial_s", "compute_end_s",
              "exchange_end_s")
      ms = [_fmt_range(v[k], 1e3) if v.get(k) else "-" for k in keys]
      lines.append(f"| {system} | {bandwidth} | " + " | ".join(ms) + " | "
                   + _fmt_range(v["hidden"], 100, 0) + "% |")
  return lines


def _choice_lines(results: dict) -> list[str]:
  """Algorithm "auto"'s forms per run: the steps where it switched."""
  runs = [r for r in results.get("train", []) if r.get("exchange_choices")]
  if not runs:
    return []
  lines = ["", "Algorithm auto's forms (measured as often as `auto.probe_budget` allows; "
           "a form runs from the step of its choice):", "", "| system | seed | forms |",
           "|---|---:|---|"]
  for r in runs:
    forms = [(c["step"], c["form"]) for c in r["exchange_choices"]]
    kept = [f for i, f in enumerate(forms) if i == 0 or f[1] != forms[i - 1][1]]
    lines.append(f"| {r['system']} | {r['seed']} | "
                 + ", then ".join(f"{form} from step {step}" for step, form in kept) + " |")
  return lines


def exchange_over_compute(results: dict) -> dict[str, float]:
  """A dense exchange's time over a step's compute time at each bandwidth: (dense step -
  compute-only step) / compute-only step, from the sweep and the parity phase."""
  if not results.get("parity"):
    return {}
  compute = statistics.median(r["jax"]["step_s"] for r in results["parity"])
  out: dict[str, list[dict]] = {}
  for row in results.get("sweep", []):
    if row["system"] == "dense":
      out.setdefault(row["bandwidth"], []).append(row)
  return {b: max(0.0, recipe_step(results, v) - compute) / compute for b, v in out.items()}


def plot(results: dict, analysis: dict, png: str) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot")
    return
  bws = parse_bandwidths(results["meta"]["bandwidths"])
  limited = [(b, bps) for b, bps in bws if bps is not None]
  unlimited_x = max(bps for _, bps in limited) * 3 if limited else 1e10
  xs = {b: (bps if bps is not None else unlimited_x) / 1e9 for b, bps in bws}
  fig, ax = plt.subplots(figsize=(8, 5))
  curves = {}
  for system, e in analysis.items():
    pts = sorted((xs[b], statistics.median([v for v in vals if v is not None]))
                 for b, vals in e["predicted_time_to_target_s"].items()
                 if any(v is not None for v in vals))
    if pts:
      curves[system] = pts
      ax.plot(*zip(*pts), marker="o", label=system)
  dense = dict(curves.get("dense", []))
  for system, pts in curves.items():  # crossover: where the system stops beating dense
    if system == "dense":
      continue
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
      if x0 in dense and x1 in dense and (y0 - dense[x0]) * (y1 - dense[x1]) < 0:
        ax.axvline(math.sqrt(x0 * x1), color="grey", ls=":", lw=0.8)
        ax.annotate(f"{system} = dense", (math.sqrt(x0 * x1), ax.get_ylim()[1]), rotation=90,
                    fontsize=7, va="top")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("inter-node link, Gbit/s (rightmost: unlimited)")
  what = {"accuracy": "test accuracy", "loss": "validation loss"}.get(target_metric(results),
                                                                     target_metric(results))
  ax.set_ylabel(f"time to {what} {results['meta']['target']} (s, median of seeds)")
  ax.set_title(f"Time to target on {results['meta'].get('nodes', 2)} emulated nodes: "
               f"{results['meta']['task']}\n"
               f"(steps to target at {results['meta']['headline']} x step time measured at each "
               "link)", fontsize=10)
  ax.legend(fontsize=8)
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(png, dpi=120)
  print(f"wrote {png}")


def report(results: dict, out: str) -> None:
  """Analysis, table (printed and beside `out`), JSON and plot."""
  target = results["meta"]["target"]
  results["exchange_over_compute"] = exchange_over_compute(results)
  results["analysis"] = analysis = analyse(results, target)
  table = make_tables(results, analysis, results["meta"]["headline"])
  print(table)
  write_results(out, results, table)
  if any(e["predicted_time_to_target_s"] for e in analysis.values()):  # (no sweep: no plot)
    plot(results, analysis, os.path.splitext(out)[0] + ".png")
  print(f"wrote {out}")
