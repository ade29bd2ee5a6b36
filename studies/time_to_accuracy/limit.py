"""Time to the target at each link, every system trained end to end in one command: the
figures' runs, and the limit ratio (a system's time at a slow link over its time at an unlimited
link; 1.0: its exchange costs nothing).

  python -m studies.time_to_accuracy.limit --config configs/tta_fmnist_resnet.py \
      --systems hitopk-0.04-mc-mean-w3,hitopk-0.04-mc-mean-w3+experimental.wire=pairs4 \
      --baselines dense,torch-ddp --links 10mbit --seeds 3 --out $OUT

Each seed trains, on the study's emulated cluster (`studies.time_to_accuracy.run`'s processes,
one a node):
  at the unlimited link, each of `--systems` and sparsejax dense over the whole recipe (their
      final metric: the link does not change a fixed system's trajectory, only its time), and
      the other `--baselines` (PyTorch DDP) to the target;
  at each of `--links`, each of `--systems` and `--baselines` (sparsejax dense, PyTorch DDP) to
      its first evaluation at the target (stopped there).
The links take turns in order between seeds, and the systems rotate, so that the machine's
drift falls on every system alike. Reported per system and link (min / median / max over the
seeds, each a ratio within one seed): the limit ratio; the same over the steps after the
recipe's dense start (from the first evaluation past it), where the recipe has one; each
baseline's time at the link over the system's; the final metric against dense's. No step time
is swept or modelled: every time is a run's own clock from its first step to the evaluation
that reached the target (evaluations not counted). With more than one link the command also
plots each system's and baseline's time to target against the link (`--out`'s .png: every
point trained end to end). Each run's record is written as it ends (`--out`'s .partial.json);
a command stopped part way goes on with `--resume` (the same command at the same commit): the
runs it finished stand, each its own process's clock, and only the others run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid
from typing import Any

from sparsejax.bench import command_line, git_commit, json_path, portable_path, write_results
from studies.time_to_accuracy import run as tta
from studies.time_to_accuracy.analysis import steps_to_target
from studies.time_to_accuracy.systems import (
  QUICK_SETS,
  check_mesh,
  load_task,
  parse_bandwidths,
  system_spec,
)

MODULE = "studies.time_to_accuracy.limit"
HERE = os.path.dirname(os.path.abspath(__file__))
UNLIMITED = "unlimited"


def schedule(systems: list[str], baselines: list[str], links: list[str], seeds: int
             ) -> list[tuple[int, str, str, bool]]:
  """The runs in order: (seed, link, system, whole recipe?). Seed s takes the unlimited link
  and `links` turned by s (the unlimited link first on seed 0), the systems turned by s."""
  at_unlimited = systems + (["dense"] if "dense" not in systems else [])
  at_unlimited += [b for b in baselines if b not in at_unlimited]
  at_link = systems + [b for b in baselines if b not in systems]
  whole = set(systems) | {"dense"}
  order = [(UNLIMITED, at_unlimited)] + [(link, at_link) for link in links]
  runs = []
  for seed in range(seeds):
    turn = seed % len(order)
    for name, names in order[turn:] + order[:turn]:
      t = seed % len(names)
      runs += [(seed, name, system, name == UNLIMITED and system in whole)
               for system in names[t:] + names[:t]]
  return runs


def links_of(meta: dict) -> list[str]:
  """The slow links of a result (one, `link`, in results before --links)."""
  return meta.get("links") or [meta["link"]]


def _range(values: list[float], digits: int = 2, suffix: str = "") -> str:
  if not values:
    return "-"
  v = sorted(values)
  return " / ".join(f"{x:.{digits}f}{suffix}" for x in (v[0], statistics.median(v), v[-1]))


def analyse(results: dict) -> dict[str, dict[str, Any]]:
  """Per system: the final metric's difference from dense's (accuracy: points; loss: per cent
  of dense's), and per slow link the limit ratios, the ratios after the dense start and each
  baseline's time over the system's at the link; each one value a seed."""
  meta, runs = results["meta"], results["runs"]
  by = {(r["system"], r["link"], r["seed"]): r for r in runs}
  out: dict[str, dict[str, Any]] = {}
  for system in meta["systems"]:
    s = out.setdefault(system, {"final_vs_dense": [], "links": {}})
    for link in links_of(meta):
      at = s["links"].setdefault(link, {"limit": [], "limit_after_dense": [],
                                        **{f"{b}_over": [] for b in meta["baselines"]}})
      for seed in range(meta["seeds"]):
        fast, slow = by.get((system, UNLIMITED, seed)), by.get((system, link, seed))
        if fast and slow and fast["reached"] and slow["reached"]:
          at["limit"].append(slow["reached"]["train_time_s"] / fast["reached"]["train_time_s"])
          if fast.get("after_dense") and slow.get("after_dense"):
            at["limit_after_dense"].append(slow["after_dense"] / fast["after_dense"])
        for b in meta["baselines"]:
          other = by.get((b, link, seed))
          if slow and other and slow["reached"] and other["reached"]:
            at[f"{b}_over"].append(other["reached"]["train_time_s"]
                                   / slow["reached"]["train_time_s"])
    for seed in range(meta["seeds"]):
      fast, dense = by.get((system, UNLIMITED, seed)), by.get(("dense", UNLIMITED, seed))
      if fast and dense and fast.get("final") is not None and dense.get("final") is not None:
        diff = fast["final"] - dense["final"]
        s["final_vs_dense"].append(100 * diff if meta["target_metric"] == "accuracy"
                                   else 100 * diff / dense["final"])
  return out


def dense_step_over_unlimited(results: dict) -> dict[str, list[float]]:
  """Per slow link, by seed: dense's mean step to the target at the link over its mean step at
  the unlimited link, as trained in this run (how slow the link makes the dense exchange, read
  end to end rather than from swept step times). Empty lists where the run has no dense
  baseline."""
  by = {(r["link"], r["seed"]): r["reached"] for r in results["runs"]
        if r["system"] == "dense" and r["reached"]}
  out: dict[str, list[float]] = {}
  for link in links_of(results["meta"]):
    out[link] = []
    for seed in range(results["meta"]["seeds"]):
      fast, slow = by.get((UNLIMITED, seed)), by.get((link, seed))
      if fast and slow:
        out[link].append((slow["train_time_s"] / slow["step"])
                         / (fast["train_time_s"] / fast["step"]))
  return out


def times(results: dict, system: str, link: str) -> list[float]:
  """`system`'s times to target at `link` (s), one per seed that reached it, trained end to end."""
  return [r["reached"]["train_time_s"] for r in results["runs"]
          if r["system"] == system and r["link"] == link and r["reached"]]


def make_table(results: dict, analysis: dict) -> str:
  meta = results["meta"]
  links, metric = links_of(meta), meta["target_metric"]
  named = ", ".join(links)
  unit = "points" if metric == "accuracy" else "% of dense's"
  lines = [f"Time to the target ({metric} {meta['target']}) on {meta['task']}, {meta['nodes']} "
           f"emulated nodes, every system trained end to end at each link (seeds: min / median "
           f"/ max; ratios each within one seed; evaluations not counted). Limit ratio: the "
           f"time at {named} over the same system's at the unlimited link.", "",
           "| " + " | ".join([
               "system", "link", "steps to target", "time to target s, unlimited",
               "time to target s, at the link", "limit ratio",
               "limit ratio after the dense start", *(f"{b} / system" for b in meta["baselines"]),
               f"final {metric} - dense's ({unit})"]) + " |",
           "|---|---|" + "---:|" * (6 + len(meta["baselines"]))]
  for system, a in analysis.items():
    steps = [r["reached"]["step"] for r in results["runs"]
             if r["system"] == system and r["link"] == UNLIMITED and r["reached"]]
    for link in links:
      at = a["links"][link]
      lines.append("| " + " | ".join([
          system, link, _range(steps, 0), _range(times(results, system, UNLIMITED), 1),
          _range(times(results, system, link), 1), _range(at["limit"]),
          _range(at["limit_after_dense"]), *(_range(at[f"{b}_over"]) for b in meta["baselines"]),
          _range(a["final_vs_dense"], 2)]) + " |")
  rest = [b for b in meta["baselines"] if b not in analysis]
  if rest:
    lines += ["", "| baseline | " + " | ".join(
        f"time to target s, {link}" for link in [UNLIMITED, *links]) + " |",
              "|---|" + "---:|" * (1 + len(links))]
    lines += [f"| {b} | " + " | ".join(_range(times(results, b, link), 1)
                                       for link in [UNLIMITED, *links]) + " |" for b in rest]
  slowdown = dense_step_over_unlimited(results)
  if any(slowdown.values()):
    lines += ["", "Dense's mean step to the target at each link over its mean step at the "
              "unlimited link (seeds min / median / max): " + "; ".join(
                  f"{link} {_range(slowdown[link])}" for link in links) + "."]
  missed = [f"{r['system']} seed {r['seed']} at {r['link']}" for r in results["runs"]
            if not r["reached"]]
  failed = [f"{f['system']} seed {f['seed']} at {f['link']}" for f in results.get("failed", [])]
  if missed or failed:
    lines += ["", "Not at the target: " + "; ".join(missed + failed) + "."]
  resumed = "".join(f", resumed {r}" for r in meta.get("resumed", []))
  lines += ["", f"Command: `{meta['command']}`; commit {meta['commit']}; machine: "
            f"{meta['machine']} ({meta['cpus']} cores); date: {meta['date']}{resumed}."]
  return "\n".join(lines)


def plot(results: dict, png: str) -> bool:
  """Each system's and baseline's time to target (median, min-max bars) against the link, all
  trained end to end; the unlimited link at the right. False where matplotlib is missing."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  meta = results["meta"]
  bps = dict(parse_bandwidths(",".join(links_of(meta))))
  xs = {link: rate / 1e9 for link, rate in bps.items()}
  xs[UNLIMITED] = max(xs.values()) * 3
  fig, ax = plt.subplots(figsize=(8, 5))
  for system in meta["systems"] + [b for b in meta["baselines"] if b not in meta["systems"]]:
    pts = sorted((xs[link], sorted(t)) for link in [*links_of(meta), UNLIMITED]
                 if (t := times(results, system, link)))  # (by the link: one line)
    if not pts:
      continue
    x = [p[0] for p in pts]
    mid = [statistics.median(t) for _, t in pts]
    err = [[m - t[0] for m, (_, t) in zip(mid, pts)], [t[-1] - m for m, (_, t) in zip(mid, pts)]]
    ax.errorbar(x, mid, yerr=err, marker="o", capsize=3, label=system)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ticks = sorted(xs.items(), key=lambda kv: kv[1])
  ax.set_xticks([x for _, x in ticks], [name for name, _ in ticks])
  ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
  ax.set_xlabel("inter-node link")
  ax.set_ylabel(f"time to {meta['target_metric']} {meta['target']} (s; median, min-max of "
                f"{meta['seeds']} seeds)")
  ax.set_title(f"Time to target on {meta['nodes']} emulated nodes: {meta['task']}\n(every "
               "point trained end to end at its link)", fontsize=10)
  ax.legend(fontsize=8)
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(png, dpi=120)
  plt.close(fig)
  return True


def write(out: str, results: dict) -> str:
  """The analysis into `results`, the JSON, table and plot at `out`; the table's path."""
  results["analysis"] = analyse(results)
  results["dense_step_over_unlimited"] = dense_step_over_unlimited(results)
  md = write_results(out, results, make_table(results, results["analysis"]))
  plot(results, os.path.splitext(out)[0] + ".png")
  return md


RESUMED_META = ("task", "target", "target_metric", "config", "sets", "systems", "baselines",
                "links", "seeds", "nodes", "local", "commit", "machine", "cpus")


def _resumed(partial: str, fresh: dict) -> tuple[dict, set[tuple[int, str, str]]]:
  """A stopped command's results (`partial`, written after each run) to go on from, and the
  (seed, link, system) runs they hold: each run is its own process's clock, so a finished one
  stands; the failed ones run again. Refused where the command (its systems, links, seeds,
  task), the commit or the machine differ from `fresh`'s, or the checkout is not a commit
  (uncommitted changes: two such trees would pass for one)."""
  commit = fresh["meta"]["commit"]
  if commit == "unknown" or commit.endswith("+dirty"):
    raise ValueError(f"--resume needs a committed checkout (commit {commit!r}): a run's code "
                     "must be what its results say")
  if not os.path.exists(partial):
    raise ValueError(f"--resume: there is no {partial} to go on from (a stopped command "
                     "leaves it beside --out)")
  with open(partial) as f:
    old = json.load(f)
  for key in RESUMED_META:
    if old["meta"].get(key) != fresh["meta"][key]:
      raise ValueError(f"--resume: {partial} comes from another command or commit: its {key} "
                       f"is {old['meta'].get(key)!r}, this command's {fresh['meta'][key]!r}")
  old["meta"].setdefault("resumed", []).append(time.strftime("%Y-%m-%d %H:%M"))
  old.pop("failed", None)
  return old, {(r["seed"], r["link"], r["system"]) for r in old["runs"]}


def _row(raw: dict, system: str, seed: int, link: str, whole: bool, config, dense_steps: int
         ) -> dict:
  """A run's record: the evaluation that reached the target, the time from the first
  evaluation past the dense start to it, and the final metric of a whole recipe."""
  metric = config.target_metric
  curve = raw["curve"]
  hit = steps_to_target(curve, config.target_value, metric)
  row: dict[str, Any] = {"system": system, "seed": seed, "link": link, "reached": hit,
                         "final": curve[-1][metric] if whole and curve else None,
                         "curve": curve}
  if hit and dense_steps:
    past = [p for p in curve if dense_steps <= p["step"] <= hit["step"]]
    if past and past[0]["step"] < hit["step"]:
      row["after_dense"] = hit["train_time_s"] - past[0]["train_time_s"]
  return row


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default=os.path.join(tta.ROOT, "configs", "tta_fmnist_mlp.py"))
  ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
  ap.add_argument("--systems", default="hitopk-0.01-mc",
                  help="the systems whose limit is measured (at both links)")
  ap.add_argument("--baselines", default="dense,torch-ddp",
                  help="trained at every link to compare with (dense over the whole recipe at "
                  "the unlimited link; empty: none)")
  ap.add_argument("--links", "--link", default="100mbit",
                  help="the slow links, comma-separated (each a rate such as 10mbit)")
  ap.add_argument("--seeds", type=int, default=3)
  ap.add_argument("--run-timeout", type=int, default=1800,
                  help="seconds one process run may take")
  ap.add_argument("--lock", help="a file to flock around each process run")
  ap.add_argument("--quick", action="store_true",
                  help="CI smoke run: the study's --quick task, hitopk-0.01 against dense at "
                  "200 Mbit/s, 1 seed")
  ap.add_argument("--out", type=json_path, default=os.path.join(HERE, "results", "limit.json"))
  ap.add_argument("--resume", action="store_true",
                  help="go on from the .partial.json beside --out that a stopped run of the "
                  "same command and commit left, running only the runs it lacks")
  ap.add_argument("--from-results", metavar="JSON",
                  help="no runs: analyse a results file again, writing --out's table")
  args = ap.parse_args(argv)
  if args.from_results:
    with open(args.from_results) as f:
      results = json.load(f)
    print(open(write(args.out, results)).read())
    return 0
  argv_used = list(sys.argv[1:] if argv is None else argv)
  args.config = os.path.abspath(args.config)
  if args.quick:
    args.sets = QUICK_SETS + args.sets
    args.systems, args.baselines, args.links, args.seeds = "hitopk-0.01", "dense", "200mbit", 1
  systems = [s.strip() for s in args.systems.split(",") if s.strip()]
  baselines = [s.strip() for s in args.baselines.split(",") if s.strip()]
  if not systems:
    ap.error("--systems is empty: name at least one system")
  if args.seeds < 1:
    ap.error(f"--seeds must be >= 1, got {args.seeds}")
  try:
    for system in systems + baselines:
      system_spec(system)
    if any(system_spec(s)[0] != "jax" for s in systems):
      raise ValueError(f"--systems are sparsejax systems (PyTorch's go in --baselines), got "
                       f"{args.systems!r}")
    links = parse_bandwidths(args.links)
    if not links or any(bps is None for _, bps in links):
      raise ValueError(f"--links are the slow links: rates such as 10mbit, not unlimited (the "
                       f"unlimited link is always run), got {args.links!r}")
    rates = dict(links)
    config = load_task(args.config, args.sets)
    check_mesh(config)
  except ValueError as e:
    ap.error(str(e))
  from sparsejax import cluster
  from sparsejax import data as data_lib
  from sparsejax.train import make_plan
  steps_per_epoch = data_lib.open_inputs(config).steps_per_epoch
  results: dict[str, Any] = {"meta": {
      "task": f"{config.model.name} on {config.data.name}", "target": config.target_value,
      "target_metric": config.target_metric, "config": portable_path(args.config),
      "sets": args.sets, "systems": systems, "baselines": baselines, "links": list(rates),
      "seeds": args.seeds, "nodes": config.mesh.nodes, "local": config.mesh.local,
      "machine": platform.machine(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
      "commit": git_commit(), "command": command_line(MODULE, argv_used)}, "runs": []}
  partial = os.path.splitext(args.out)[0] + ".partial.json"
  done: set[tuple[int, str, str]] = set()
  if args.resume:
    try:
      results, done = _resumed(partial, results)
    except ValueError as e:
      ap.error(str(e))
  elif os.path.exists(partial):
    ap.error(f"{partial} holds the runs of a stopped command: go on with --resume, or remove "
             "it to start again")
  with cluster.EmulatedCluster(config.mesh.nodes, None,
                               prefix=f"lim{uuid.uuid4().hex[:6]}") as c:
    for seed, name, system, whole in schedule(systems, baselines, list(rates), args.seeds):
      if (seed, name, system) in done:
        continue
      cfg = load_task(args.config, args.sets, system, seed)
      rate = None if name == UNLIMITED else rates[name]
      extra = ["--seed", str(seed), "--bandwidths", "[]", "--headline", json.dumps(rate),
               "--levels", "[]", "--cluster-prefix", c.prefix, "--warmup", "0", "--reps", "1"]
      if not whole:
        extra.append("--stop-at-target")
      raw = tta._run_with_retry(c, system, seed, args, extra, sys.stdout, rate)
      if raw is None:
        results.setdefault("failed", []).append({"system": system, "seed": seed, "link": name})
        continue
      dense_steps = (make_plan(cfg, steps_per_epoch).dense_steps
                     if system_spec(system)[0] == "jax" else 0)
      row = {**_row(raw, system, seed, name, whole, cfg, dense_steps),
             "ended": time.strftime("%Y-%m-%d %H:%M")}
      results["runs"].append(row)
      print(json.dumps({k: row[k] for k in ("system", "seed", "link", "reached", "final")}),
            flush=True)
      write_results(partial, results, "partial: not analysed yet")
  md = write(args.out, results)
  for leftover in (partial, os.path.splitext(partial)[0] + ".md"):
    if os.path.exists(leftover):
      os.remove(leftover)
  print(open(md).read())
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
