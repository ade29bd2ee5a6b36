"""Algorithm "auto" trained end to end at each link speed, against the fixed systems.

For each bandwidth, `--seeds` process runs of an auto system (`--system`, a name of the
time-to-accuracy study's SYSTEMS) train on the study's emulated cluster with the link at that
bandwidth from the first step to the target (the study's runs phase with `--headline` set to the
bandwidth and `--stop-at-target`): auto measures the link itself and chooses its forms; its
train time to target is measured, probes included. They are set against a reference study of
the same task (`--reference`, a time_to_accuracy.py result with the parity phase, the fixed
systems trained and swept at every bandwidth here): each fixed system's time to target there
(steps to target x its step time measured at that bandwidth), PyTorch DDP's, the dense exchange /
compute ratio R, and the compute parity (JAX step / PyTorch step, compute only).

Judged per bandwidth (the issue's must-shows): auto within 1.1x of the best fixed sparsejax
system (of those trained beside it with `--fixed`, where any were: the reference's other
systems ran on another day); against DDP no later where R >= 1, at least 1.5x sooner where
R >= 2, and where R < 1 no later than DDP's time x the parity; auto's exposed exchange per
step (its mean step to the target minus the JAX compute-only step) no more than DDP's (its
swept step minus PyTorch's).

  python -m studies.auto.end_to_end --config configs/tta_pydocs_lm.py --system auto-0.05 \\
    --fixed dense,hitopk-0.05 \\
    --reference studies/time_to_accuracy/results/time_to_accuracy_pydocs.json \\
    --bandwidths unlimited --seeds 3 --out studies/auto/results/auto_v2_pydocs_unlimited.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from sparsejax.bench import (
  command_line,
  footer,
  git_commit,
  json_path,
  portable_path,
  resolve,
  spread,
  write_results,
)
from studies.time_to_accuracy import analysis as tta_analysis
from studies.time_to_accuracy import systems as tta_systems

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STUDY = "studies.time_to_accuracy.run"  # run as a module, from the checkout's root


def train_at(config: str, systems: list[str], bandwidth: str, seeds: int, sets: list[str],
             log) -> dict[str, Any]:
  """The study's runs phase for `systems` (seed by seed, the systems in turn), the link at
  `bandwidth` throughout, each run stopped at the target: its results (train rows with curves
  and auto's forms)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "run.json")
    cmd = [sys.executable, "-m", STUDY, "--config", config, "--systems", ",".join(systems),
           "--phases", "runs",
           "--seeds", str(seeds), "--bandwidths", bandwidth, "--headline", bandwidth,
           "--stop-at-target", "--out", out] + [a for s in sets for a in ("--set", s)]
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    with open(out) as f:
      return json.load(f)


def runs_of(results: dict[str, Any], system: str) -> list[dict[str, Any]]:
  """Per seed of `system` in a study's results: measured steps and train time to the target,
  the forms auto ran (step, form) where it changed (none for a fixed system), and the clock at
  each evaluation (step, train seconds) to the target."""
  metric, target = tta_analysis.target_metric(results), results["meta"]["target"]
  out = []
  for r in results.get("train", []):
    if r["system"] != system:
      continue
    hit = tta_analysis.steps_to_target(r["curve"], target, metric)
    forms = [(c["step"], c["form"]) for c in r.get("exchange_choices", [])]
    forms = [f for i, f in enumerate(forms) if i == 0 or f[1] != forms[i - 1][1]]
    choices = r.get("exchange_choices", [])
    measured = [c for c in choices if c.get("why") == "measured"
                and (hit is None or c["step"] < hit["step"])]
    out.append({"seed": r["seed"], "steps": hit["step"] if hit else None,
                "time_s": hit["train_time_s"] if hit else None, "forms": forms,
                "predictions": predictions(choices),
                # auto's measurements before the target (the probes' compilations included)
                "measure_s": sum(c["measure_ms"] for c in measured) / 1e3,
                "first_measure_s": measured[0]["measure_ms"] / 1e3 if measured else 0.0,
                "compile_s": switch_compiles_s(r["programs"], hit and hit["step"])
                if "programs" in r else None,
                # (step, train seconds) at each evaluation to the target: each stretch's step
                "clock": [[c["step"], round(c["train_time_s"], 3)] for c in r["curve"]
                          if hit is None or c["step"] <= hit["step"]]})
  return out


def switch_compiles_s(programs: list[dict[str, Any]], before: int | None) -> float:
  """What auto compiled beyond a fixed system: the programs it first ran before step `before`
  (None: all) in a form other than the one it ran first at their input size. A fixed system of
  the form auto started each size in compiles the rest too; a user's run compiles these at the
  switch, on its clock (the study compiles every program before the clock, each timed:
  `Run.programs_run`)."""
  first: dict[Any, str] = {}
  extra = 0.0
  for p in sorted(programs, key=lambda p: p["first_step"]):
    if before is not None and p["first_step"] >= before:
      continue
    if p["form"] != first.setdefault(p["size"], p["form"]):
      extra += p["compile_s"]
  return extra


def predictions(choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Each measured choice's predicted step for the form it ran next against that form's step as
  the next choice observed it in the run: [{"form", "predicted_s", "observed_s", "from"}];
  "from": "observed" where the prediction rests on that form's own steps in the run (observed
  at this choice or an earlier one at this input size), else "modelled" (the other form's steps
  and the modelled exchanges), or, in runs of the controller before 2026-12-06, "timed" (its
  step timed on a copy of the state at the first measurement)."""
  out, seen = [], set()
  unseen = "timed" if any(c.get("how", "").startswith("timed") for c in choices) else "modelled"
  for c, after in zip(choices, [*choices[1:], None]):
    how = c.get("how", "")
    if "input_shape" in c and unseen == "modelled":
      seen = set()
    if how.startswith("observed"):
      seen.add(c["measured"])
    seen -= {f for f in ("dense", "sparse") if f"{f} timed again" in how}
    if how.startswith("timed"):
      seen.discard(c["measured"])
    if (after is not None and c.get("why") == "measured" and after.get("why") == "measured"
        and c.get("measured") is not None  # (a choice before any step read: no rest behind it)
        and after.get("how", "").startswith("observed") and after["measured"] == c["form"]):
      out.append({"form": c["form"], "predicted_s": c[f"{c['form']}_step_ms"] / 1e3,
                  "observed_s": after["measured_step_ms"] / 1e3,
                  "from": "observed" if c["form"] in seen else unseen})
  return out


def step_check(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """Per form and what the prediction rested on (a step "timed" on a copy at the first
  measurement, else "observed" in the run), auto's predicted step against the step the run
  then took (`predictions`), over all runs: {"form, from": {"predicted_s": [...],
  "observed_s": [...], "ratios": [...]}}."""
  out: dict[str, dict[str, Any]] = {}
  for x in runs:
    for p in x.get("predictions", []):
      row = out.setdefault(f"{p['form']}, {p.get('from', 'observed')}",
                           {"predicted_s": [], "observed_s": [], "ratios": []})
      row["predicted_s"].append(p["predicted_s"])
      row["observed_s"].append(p["observed_s"])
      row["ratios"].append(p["predicted_s"] / p["observed_s"])
  return out


def _median(values) -> float | None:
  vals = [v for v in values if v is not None]
  return statistics.median(vals) if vals else None


def judge(reference: dict[str, Any], bandwidth: str, runs: list[dict[str, Any]],
          system: str, trained: dict[str, list[dict[str, Any]]] | None = None,
          target: float | None = None) -> dict[str, Any]:
  """One bandwidth's comparison: auto's measured time to target against the fixed systems
  there (those `trained` end to end beside it, measured the same way; the others the
  reference's steps to target x swept step), its exposed exchange against DDP's, and the
  verdicts. Where the runs' `target` is not the reference's, the reference's times to target
  (DDP's among them) do not apply: auto is judged against the systems trained beside it, and
  DDP on its exposed exchange a step alone, unless DDP was trained beside it (`trained`'s
  "torch-ddp": then its time to target is that, measured the same way)."""
  analysis = reference["analysis"]
  same_target = target is None or target == reference["meta"]["target"]
  times = {s: e["predicted_time_to_target_s"].get(bandwidth) for s, e in analysis.items()
           if s != system and e["predicted_time_to_target_s"].get(bandwidth) and same_target}
  measured = {s: [x["time_s"] for x in r] for s, r in (trained or {}).items()}
  if not measured and not same_target:
    raise ValueError(f"the runs' target {target} is not the reference's "
                     f"{reference['meta']['target']}: train the fixed systems beside auto "
                     "(--fixed) to judge it")
  if any(not s.startswith("torch") for s in measured):  # judged against the systems trained
    # beside it alone (DDP: the reference's, where it was not trained beside it)
    times = {s: v for s, v in times.items() if s.startswith("torch")}
  times.update(measured)
  fixed = {s: m for s, v in times.items()  # (a reference system that missed it: not there)
           if not s.startswith("torch") and (m := _median(v)) is not None}
  best = min(fixed, key=lambda s: fixed[s])
  ddp = _median(times["torch-ddp"]) if "torch-ddp" in times else None
  r = reference["exchange_over_compute"].get(bandwidth)
  parity = statistics.median(x["jax_over_torch"] for x in reference["parity"])
  mine = [x["time_s"] for x in runs]
  med = _median(mine)
  jax_compute = tta_analysis.compute_s(reference, "jax")
  torch_compute = tta_analysis.compute_s(reference, "torch")
  exposed = [x["time_s"] / x["steps"] - jax_compute for x in runs if x["steps"]]
  ddp_steps = [row["step_s"] for row in reference["sweep"]
               if row["system"] == "torch-ddp" and row["bandwidth"] == bandwidth]
  ddp_exposed = [s - torch_compute for s in ddp_steps]
  over_ddp = ddp / med if med and ddp else None
  need = 1.5 if r >= 2 else (1.0 if r >= 1 else 1.0 / parity)
  spent = [x for x in runs if "measure_s" in x]
  return {"bandwidth": bandwidth, "R": r, "parity": parity, "auto_time_s": mine,
          "auto_over_best_by_seed": paired(runs, trained or {}),
          "auto_at_step_over": {s: at_same_step(runs, r) for s, r in (trained or {}).items()
                                if not s.startswith("torch")},
          **({"auto_measure_s": [x["measure_s"] for x in spent],
              "auto_first_measure_s": [x["first_measure_s"] for x in spent],
              "auto_compile_s": [x.get("compile_s") for x in spent],
              "auto_over_best_by_seed_unmeasured": paired(
                  [{**x, "time_s": x["time_s"] and x["time_s"] - x["measure_s"]}
                   for x in spent], trained or {})} if spent else {}),
          "steps_checked": step_check(runs),
          "auto_steps": [x["steps"] for x in runs], "forms": [x["forms"] for x in runs],
          "fixed_time_s": times, "fixed_trained": sorted(measured), "best_fixed": best,
          "auto_over_best": med / fixed[best] if med else None,
          "ddp_over_auto": over_ddp, "ddp_over_auto_needed": need,
          "auto_exposed_s": exposed, "ddp_exposed_s": ddp_exposed,
          "within_1.1_of_best": bool(med and med / fixed[best] <= 1.1),
          "ddp_target_met": (bool(over_ddp and over_ddp >= need)
                             if same_target or "torch-ddp" in measured else None),
          "exposed_met": bool(exposed and max(exposed) <= _median(ddp_exposed))}


def paired(runs: list[dict[str, Any]], trained: dict[str, list[dict[str, Any]]]
           ) -> list[float]:
  """Seed by seed, auto's time over the fastest fixed sparsejax system trained beside it on
  that seed (the same data order and initial parameters: a seed's steps to target move every
  system alike, and on MNIST they spread 168-240 between seeds)."""
  out = []
  for run in runs:
    mates = [x["time_s"] for s, r in trained.items() if not s.startswith("torch") for x in r
             if x["seed"] == run["seed"] and x["time_s"]]
    if run["time_s"] and mates:
      out.append(run["time_s"] / min(mates))
  return out


def at_same_step(runs: list[dict[str, Any]], mates: list[dict[str, Any]]) -> list[float]:
  """Seed by seed, auto's clock over a fixed system's (`mates`: its runs beside auto) at the
  last evaluation both reached: each step's cost alone, whatever steps either took to the
  target (auto's measurements on its clock; seeds whose runs lack a clock left out)."""
  out = []
  for run in runs:
    mate = next((x for x in mates if x["seed"] == run["seed"]), {})
    mine, theirs = (dict(map(tuple, r.get("clock") or [])) for r in (run, mate))
    last = max(set(mine) & set(theirs), default=None)
    if last is not None and theirs[last]:
      out.append(mine[last] / theirs[last])
  return out


def _x(ratio: float | None) -> str:
  return "not reached" if ratio is None else f"{ratio:.2f}"


def _ddp(row: dict[str, Any]) -> str:
  return "n/a" if row.get("ddp_target_met", True) is None else _x(row["ddp_over_auto"])


def _forms(forms: list[list]) -> str:
  return ", then ".join(f"{form} from {step}" for step, form in forms) or "-"


def shares(row: dict[str, Any]) -> list[float]:
  """Per seed, auto's measurements and the compiles of its switches (where recorded) over its
  time to target with those compiles added (a user's run compiles them on its clock; seeds
  that reached the target)."""
  compiles = row.get("auto_compile_s") or [None] * len(row["auto_measure_s"])
  return [(m + (c or 0.0)) / (t + (c or 0.0))
          for m, c, t in zip(row["auto_measure_s"], compiles, row["auto_time_s"]) if t]


def _at_step(row: dict[str, Any]) -> str:
  over = {s: v for s, v in row.get("auto_at_step_over", {}).items() if v}
  return "; ".join(f"{s} {spread(v, 2)}" for s, v in sorted(over.items())) or "-"


def _compiles(row: dict[str, Any]) -> str:
  compiles = row.get("auto_compile_s") or [None]
  return "not recorded" if None in compiles else spread(compiles, 2)


_RESTED_ON = {
    "observed": "the form's own steps observed in the run",
    "modelled": "the other form's steps in the run and the modelled exchanges",
    "timed": "its step timed on a copy of the state at the first measurement (the controller "
             "before 2026-12-06)"}


def table(results: dict[str, Any]) -> str:
  m = results["meta"]
  rows = results["rows"]
  fixed = sorted({s for row in rows for s in row["fixed_time_s"]})
  trained = sorted({s for row in rows for s in row.get("fixed_trained", [])})
  beside = (f"{', '.join(trained)} trained end to end beside it the same way (seed by seed, "
            "the systems' order rotating between seeds)" if trained else "")
  source = (f"; the reference study `{m['reference']}` for R, the parity and DDP's swept step"
            if "torch-ddp" in trained else
            f"{'; PyTorch DDP ' if beside else ''}from the reference study (steps to target x "
            f"step time measured at that link; `{m['reference']}`)")
  lines = [f"`{m['system']}` trained end to end at each link (its measured train time to "
           f"{m['target_metric']} {m['target']}, probes included, {m['seeds']} seeds min / "
           f"median / max) against the fixed systems: {beside}{source}. R: "
           "dense exchange / compute. By seed: auto's time over the fastest fixed system "
           "trained beside it on the same seed (min / median / max over the seeds). Needed over "
           "DDP: 1.5x where R >= 2, 1x where R >= 1, 1 / parity below:", "",
           "| link | R | auto s | " + " | ".join(f"{s} s" for s in fixed)
           + " | auto / best fixed | by seed | DDP / auto (needed) |", "|---|---:|" + "---:|" * (
               len(fixed) + 4)]
  for row in rows:
    cells = [spread(row["fixed_time_s"].get(s, []), 1) for s in fixed]
    lines.append(f"| {row['bandwidth']} | {row['R']:.2g} | {spread(row['auto_time_s'], 1)} | "
                 + " | ".join(cells) + f" | {_x(row['auto_over_best'])} ({row['best_fixed']}) | "
                 f"{spread(row.get('auto_over_best_by_seed', []), 2) or '-'} | "
                 f"{_ddp(row)} ({row['ddp_over_auto_needed']:.2f}) |")
  costs = [row for row in rows if "auto_measure_s" in row]
  if costs:
    lines += ["", "auto's measurements before the target (s: its link and selection probes on "
              f"the clock, their first compilation included; {m['seeds']} seeds min / median / "
              "max), what its switches compiled (the programs of a form other than the one it "
              "started an "
              "input size in: every system's programs are compiled before the clock, each "
              "timed, and a user's run compiles these at the switch), both as a share of its "
              "run with those compiles added, the first measurement alone, and auto's time over "
              "the fastest fixed system by seed with the measurements left out (what auto costs "
              "once measured: its choices), and its clock over each fixed system's at the last "
              "evaluation both reached, by seed (each step's cost, measurements included, "
              "whatever steps either took to the target):", "",
              "| link | measurements s | switch compiles s | share of the run % | the first s "
              "| by seed without them | by seed at the same step |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {row['bandwidth']} | {spread(row['auto_measure_s'], 2)} | {_compiles(row)} | "
              f"{spread(shares(row), 1, 100)} | "
              f"{spread(row['auto_first_measure_s'], 2)} | "
              f"{spread(row['auto_over_best_by_seed_unmeasured'], 2) or '-'} | "
              f"{_at_step(row)} |"
              for row in costs]
  lines += ["", "Exposed exchange per step (ms; auto: its mean step to the target, warm-up "
            "and probes included, minus the JAX compute-only step; DDP: its swept step minus "
            "PyTorch's), auto's steps to target and its forms (seed 0's):", "",
            "| link | auto exposed | DDP exposed | auto steps | auto's forms |",
            "|---|---:|---:|---:|---|"]
  for row in rows:
    lines.append(f"| {row['bandwidth']} | {spread(row['auto_exposed_s'], 1, 1e3)} | "
                 f"{spread(row['ddp_exposed_s'], 1, 1e3)} | {spread(row['auto_steps'], 0)} | "
                 f"{_forms(row['forms'][0] if row['forms'] else [])} |")
  checked = [(row["bandwidth"], f, c) for row in rows
             for f, c in row.get("steps_checked", {}).items()]
  if checked:
    kinds = sorted({f.split(", ")[-1] for _, f, _ in checked})
    lines += ["", "Each form's step (ms) as auto predicted it at a choice against the step the "
              "run then took in that form (the next choice's observation of it; pairs over "
              "all seeds), by what the prediction rested on: "
              + "; ".join(f"{k}, {_RESTED_ON[k]}" for k in kinds) + ":", "",
              "| link | form, from | pairs | predicted | observed | predicted / observed |",
              "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {bw} | {f} | {len(c['ratios'])} | {spread(c['predicted_s'], 1, 1e3)} | "
              f"{spread(c['observed_s'], 1, 1e3)} | {spread(c['ratios'], 2)} |"
              for bw, f, c in checked]
  verdicts = {k: None if any(row[k] is None for row in rows) else all(row[k] for row in rows)
              for k in ("within_1.1_of_best", "ddp_target_met", "exposed_met")}
  if verdicts["ddp_target_met"] is None:
    lines += ["", f"DDP's time to target: n/a (the reference's target is {m['reference_target']}, "
              f"not these runs' {m['target']})."]
  lines += ["", "Met at every link: " + ", ".join(
      f"{k}: {'n/a' if v is None else 'yes' if v else 'no'}" for k, v in verdicts.items()),
      "", footer(m)]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", required=True)
  ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
  ap.add_argument("--system", required=True, help="an auto system of the study's SYSTEMS")
  ap.add_argument("--reference", required=True, help="a time_to_accuracy study's JSON (with "
                  "parity, the fixed systems and torch-ddp swept at every --bandwidths)")
  ap.add_argument("--bandwidths", required=True, help="where to train auto, each swept in "
                  "the reference")
  ap.add_argument("--fixed", default="", help="study systems (comma-separated) trained end to "
                  "end beside auto at each link and judged from those runs, not from the "
                  "reference's predicted times; torch-ddp among them: DDP's time to target "
                  "from its runs beside auto too")
  ap.add_argument("--seeds", type=int, default=3)
  ap.add_argument("--out", type=json_path, required=True)
  ap.add_argument("--from-results", metavar="JSON", help="no runs: auto's runs from this "
                  "file judged again against --reference (a reference moved into the checkout)")
  args = ap.parse_args(argv)
  reference = load_reference(ap, args)
  if args.from_results:
    with open(args.from_results) as f:
      results = json.load(f)
  else:
    fixed = [s.strip() for s in args.fixed.split(",") if s.strip()]
    results = {"runs": {}, "fixed_runs": {}, "meta": {
        "system": args.system, "seeds": args.seeds, "commit": git_commit(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
        "command": command_line("studies/auto/end_to_end.py",
                                list(sys.argv[1:] if argv is None else argv))}}
    for bandwidth in [b.strip() for b in args.bandwidths.split(",")]:
      done = train_at(args.config, [args.system, *fixed], bandwidth, args.seeds, args.sets,
                      sys.stdout)
      results["meta"].update(target=done["meta"]["target"],
                             target_metric=tta_analysis.target_metric(done))
      results["runs"][bandwidth] = runs_of(done, args.system)
      results["fixed_runs"][bandwidth] = {s: runs_of(done, s) for s in fixed}
      print(json.dumps({bandwidth: results["runs"][bandwidth]}), flush=True)
  results["meta"].setdefault("target", reference["meta"]["target"])
  results["meta"].setdefault("target_metric", tta_analysis.target_metric(reference))
  results["meta"].update(reference=portable_path(args.reference),
                         reference_target=reference["meta"]["target"])
  results["rows"] = [judge(reference, bw, runs, results["meta"]["system"],
                           results.get("fixed_runs", {}).get(bw), results["meta"]["target"])
                     for bw, runs in results["runs"].items()]
  text = table(results)
  print(text)
  write_results(args.out, results, text)
  return 0


def load_reference(ap, args) -> dict[str, Any]:
  """The reference study's results, checked to hold what the judgement needs."""
  with open(resolve(args.reference)) as f:
    reference = json.load(f)
  if tta_systems.system_spec(args.system)[1].get("compression.algorithm") != "auto":
    ap.error(f"--system {args.system!r} is not an auto system of the study")
  missing = [k for k in ("parity", "analysis", "sweep") if not reference.get(k)]
  if missing or "torch-ddp" not in reference["analysis"]:
    ap.error(f"--reference {args.reference!r} lacks {missing or ['torch-ddp']}: run the study "
             "with --phases parity,runs and torch-ddp among its systems")
  return reference


if __name__ == "__main__":
  sys.exit(main())
