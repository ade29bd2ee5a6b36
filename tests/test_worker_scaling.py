"""studies/worker_scaling/run.py: its system names and the densities they run at (the runs
themselves are the study's; a two-worker run is in the integration tier)."""

import json
import os

import numpy as np
import pytest

from sparsejax import comm, cost
from studies.worker_scaling import applied, at_nodes, projected, residuals
from studies.worker_scaling import run as ws

N = 1_863_690  # the Fashion-MNIST MLP's parameters


@pytest.mark.parametrize("workers", [2, 4, 8, 16])
def test_gtopk_at_equal_bytes_sends_what_allgather_sends(workers):
  d = ws.density_at("gtopk-0.01-mc-bytes", workers, N)
  k, k_eq = round(0.01 * N), round(d * N)
  allgather = comm.wire_bytes("allgather", n=N, k=k, nodes=workers, local=1)["inter"]
  gtopk = comm.wire_bytes("gtopk", n=N, k=k_eq, nodes=workers, local=1)["inter"]
  assert gtopk == pytest.approx(allgather, rel=1e-3)
  assert (d > 0.01) == (workers > 2)  # log2 P rounds of pairs against P - 1 pieces


def test_the_k_rules_grow_with_the_workers_and_stop_at_density_one():
  assert ws.density_at("gtopk-0.01", 16, N) == 0.01
  assert ws.density_at("gtopk-0.01-sqrtP", 2, N) == pytest.approx(0.01)
  assert ws.density_at("gtopk-0.01-sqrtP", 16, N) == pytest.approx(0.01 * 8 ** 0.5)
  assert ws.density_at("gtopk-0.01-mcm-logP", 2, N) == pytest.approx(0.01)  # never below k
  assert ws.density_at("gtopk-0.01-mcm-logP", 8, N) == pytest.approx(0.015)
  assert ws.density_at("gtopk-0.01-mcm-logP", 16, N) == pytest.approx(0.02)
  assert ws.density_at("gtopk-0.01-P", 16, N) == pytest.approx(0.08)
  assert ws.density_at("gtopk-0.5-P", 16, N) == 1.0
  assert ws.parse_system("allgather-0.01-mc") == ("allgather", 0.01, True, "", False, 1.0,
                                                  False)
  assert ws.parse_system("gtopk-0.01-mc-w2-dw").dense_warmup


@pytest.mark.parametrize("algorithm", ["allgather", "gtopk"])
@pytest.mark.parametrize("workers", [2, 8, 16])
def test_a_dense_warm_up_runs_dense_exactly_where_a_level_sends_more_than_dense(algorithm,
                                                                                  workers):
  from studies.time_to_accuracy.systems import density_per_step
  config = os.path.join(ws.ROOT, "configs", "tta_fmnist_mlp.py")
  per_epoch, total = 234, 468
  plain = density_per_step(ws.run_config(config, [], f"{algorithm}-0.01-mc", workers, 0, N),
                           per_epoch, total)
  dw = density_per_step(ws.run_config(config, [], f"{algorithm}-0.01-mc-dw", workers, 0, N,
                                      per_epoch), per_epoch, total)
  dense = comm.wire_bytes("dense", n=N, nodes=workers, local=1)["inter"]
  costly = np.array([comm.wire_bytes(algorithm, n=N, k=round(d * N), nodes=workers,
                                     local=1)["inter"] >= dense for d in plain])
  # the task's warm-up (from 0.25) has such levels past 2 workers; at 2 its pairs cost less
  assert costly.any() == (workers > 2) and not costly[-1]
  np.testing.assert_array_equal(dw == 1.0, costly)  # the trainer's own levels
  np.testing.assert_array_equal(dw[~costly], plain[~costly])
  with pytest.raises(ValueError, match="steps per epoch"):
    ws.run_config(config, [], f"{algorithm}-0.01-mc-dw", workers, 0, N)


def test_a_dense_warm_up_ends_with_the_warm_up_where_no_level_is_cheaper_than_dense():
  # gTop-k at 0.2 sends more than dense at 16 workers: every warm-up step goes dense, no more
  config = os.path.join(ws.ROOT, "configs", "tta_fmnist_mlp.py")
  c = ws.run_config(config, [], "gtopk-0.2-mc-dw", 16, 0, N, 234)
  assert c.compression.dense_epochs == pytest.approx(round(0.2 * 234) / 234)


def test_masking_and_a_longer_warm_up_reach_the_run_config():
  config = os.path.join(ws.ROOT, "configs", "tta_fmnist_mlp.py")
  masked = ws.run_config(config, [], "gtopk-0.01-mcm-w4", 16, 0, N)
  plain = ws.run_config(config, [], "gtopk-0.01-mc", 16, 0, N)
  assert masked.experimental.momentum_masking and not plain.experimental.momentum_masking
  assert masked.compression.warmup_epochs == pytest.approx(4 * plain.compression.warmup_epochs)
  assert masked.mesh.nodes == 16 and masked.compression.algorithm == "gtopk"


@pytest.mark.parametrize("bad", ["dense-0.1", "allgather", "allgather-0.01-bytes", "gtopk-2",
                                 "topk-0.01", "gtopk-0.01-mc-sqrt",
                                 "gtopk-0.01-dw-w4", "gtopk-0.01-w4-P"])
def test_a_bad_system_name_is_named(bad):
  with pytest.raises(ValueError, match=f"system '{bad}'"):
    ws.parse_system(bad)


def test_the_table_compares_gtopk_with_allgather_at_the_same_workers(tmp_path):
  runs = [{"task": "t", "workers": p, "system": s, "seed": seed, "density": 0.01,
           "steps_to_target": steps, "final": final, "steps": 100, "bytes_sent_per_step": 8e4}
          for p, s, seed, steps, final in [
              (16, "allgather-0.01-mc", 0, 40, 0.90), (16, "allgather-0.01-mc", 1, 50, 0.91),
              (16, "gtopk-0.01-mc", 0, 60, 0.89), (16, "gtopk-0.01-mc", 1, 80, 0.88),
              (16, "gtopk-0.04-mc", 0, None, 0.80), (16, "gtopk-0.04-mc", 1, 44, 0.90)]]
  meta = {"config": "configs/x.py", "metric": "accuracy", "target": 0.85, "seeds": 2,
          "systems": ["allgather-0.01-mc", "gtopk-0.01-mc", "gtopk-0.04-mc"], "workers": [16],
          "command": "python -m studies.worker_scaling.run", "machine": "x", "cpus": 2,
          "date": "today"}
  path = tmp_path / "r.json"
  path.write_text(json.dumps({"meta": meta, "runs": runs}))
  assert ws.main(["--from-results", str(path), "--out", str(tmp_path / "o.json")]) == 0
  rows = {r["system"]: r for r in json.loads((tmp_path / "o.json").read_text())["rows"]}
  assert rows["gtopk-0.01-mc"]["steps_over_allgather"] == pytest.approx(70 / 45)
  assert rows["gtopk-0.01-mc"]["final_minus_allgather"] == pytest.approx(0.885 - 0.905)
  assert rows["gtopk-0.04-mc"]["reached"] == 1 and "steps_over_allgather" not in rows[
      "gtopk-0.04-mc"]  # (no all-gather at 0.04, and a seed that never reached the target)
  assert "| gtopk-0.01-mc | 16 |" in (tmp_path / "o.md").read_text()


def test_the_mean_curve_reaches_the_target_where_the_seeds_mean_first_does():
  # seed 0 crosses at 24, seed 1 at 36; their mean (0.80, 0.84, 0.855) first at 36
  curves = [[[12, 0.80], [24, 0.86], [36, 0.85], [48, 0.85]],
            [[12, 0.80], [24, 0.82], [36, 0.86], [48, 0.86], [60, 0.9]]]
  assert ws.mean_curve_step(curves, "accuracy", 0.85) == 36
  assert ws.mean_curve_step(curves, "accuracy", 0.88) is None  # (60: not every seed's)
  losses = [[[10, 5.0], [20, 4.6], [30, 4.4]], [[10, 5.2], [20, 4.4], [30, 4.5]]]
  assert ws.mean_curve_step(losses, "loss", 4.5) == 20  # a loss reaches it from above


def test_the_table_compares_the_mean_curves_where_every_run_kept_one(tmp_path):
  def run(system, seed, curve):
    return {"task": "t", "workers": 4, "system": system, "seed": seed, "density": 0.01,
            "steps_to_target": 1, "final": 0.9, "steps": 100, "bytes_sent_per_step": 8e4,
            "curve": curve}
  runs = [run("allgather-0.01-mc", 0, [[10, 0.84], [20, 0.86]]),
          run("allgather-0.01-mc", 1, [[10, 0.85], [20, 0.86]]),
          run("gtopk-0.01-mc", 0, [[10, 0.80], [20, 0.84], [30, 0.86]]),
          run("gtopk-0.01-mc", 1, [[10, 0.80], [20, 0.87], [30, 0.86]])]
  rows = {r["system"]: r for r in ws.analyse(runs, ["allgather-0.01-mc", "gtopk-0.01-mc"],
                                              [4], "accuracy", 0.85)}
  assert rows["allgather-0.01-mc"]["mean_curve_step"] == 20
  assert rows["gtopk-0.01-mc"]["mean_curve_step"] == 20
  assert rows["gtopk-0.01-mc"]["curve_steps_over_allgather"] == 1.0
  del runs[0]["curve"]  # a run without its curve: no mean curve for its system
  rows = {r["system"]: r for r in ws.analyse(runs, ["allgather-0.01-mc", "gtopk-0.01-mc"],
                                              [4], "accuracy", 0.85)}
  assert rows["allgather-0.01-mc"]["mean_curve_step"] is None
  assert "curve_steps_over_allgather" not in rows["gtopk-0.01-mc"]


def test_a_run_s_curve_is_read_from_its_eval_csv(tmp_path):
  (tmp_path / "eval.csv").write_text("step,accuracy,loss\n12,0.5,1.2\n24,0.75,0.9\n")
  assert ws.eval_curve(str(tmp_path), "accuracy") == [[12, 0.5], [24, 0.75]]
  assert ws.eval_curve(str(tmp_path), "loss") == [[12, 1.2], [24, 0.9]]


# ----------------------------------------------------------------------------- at_nodes

@pytest.mark.parametrize("text, bits", [("unlimited", float("inf")), ("10gbit", 1e10),
                                        ("100mbit", 1e8), ("2.5Gbit", 2.5e9)])
def test_a_bandwidth_reads_as_bits_per_second(text, bits):
  assert at_nodes.parse_bandwidth(text) == bits


@pytest.mark.parametrize("bad", ["fast", "0mbit", "-1gbit", "10kbit", "mbit"])
def test_a_bad_bandwidth_is_named(bad):
  with pytest.raises(ValueError, match=f"bandwidth '{bad}'"):
    at_nodes.parse_bandwidth(bad)


def _at_nodes_results(links):
  n = 10_007
  systems = [
      {"system": "dense", "algorithm": "dense", "density": 1.0, "steps_to_target": 100,
       "final": 0.88},
      {"system": "allgather-0.01-mc", "algorithm": "allgather", "density": 0.01,
       "steps_to_target": 110, "final": 0.88},
      {"system": "gtopk-0.01-mc", "algorithm": "gtopk", "density": 0.01,
       "steps_to_target": 300, "final": 0.87},
      {"system": "gtopk-0.04-mc", "algorithm": "gtopk", "density": 0.04,
       "steps_to_target": None, "final": 0.80}]
  local = [{"batch": 16, "dense_s": d, "sparse_s": {"allgather:100": 0.001, "gtopk:100": 0.0005,
                                                    "gtopk:400": 0.002}}
           for d in (0.004, 0.005, 0.006)]
  meta = {"nodes": 16, "parameters": n, "bandwidths": links, "config": "configs/x.py",
          "scaling": "s.json", "calibration": at_nodes.CALIBRATION, "alpha_s": 0.001,
          "seeds": 3, "command": "python -m studies.worker_scaling.at_nodes", "machine": "x",
          "cpus": 2, "date": "today"}
  return {"meta": meta, "systems": systems, "local": local}


def test_time_at_nodes_is_steps_times_the_local_and_the_modelled_step():
  calibration = {"params": {"alpha_s": 0.001, "swap_factor": 1.3, "odd_swap_factor": 1.6,
                            "merge_s_per_pair": 2e-7}, "link_overhead": 1.03}
  results = _at_nodes_results(["unlimited", "100mbit"])
  rows = at_nodes.analyse(results, calibration)
  assert len(rows) == 8
  by = {(r["link"], r["system"]): r for r in rows}
  cl = at_nodes.cluster(calibration, 16, 1e8)
  g = by["100mbit", "gtopk-0.01-mc"]
  assert g["network_s"] == pytest.approx(cost.network_time("gtopk", 10_007, 0.01, cl))
  assert g["local_s"] == pytest.approx(0.005 + 0.0005)  # the medians
  assert g["time_s"] == pytest.approx(300 * g["step_s"])
  assert by["100mbit", "gtopk-0.04-mc"]["time_s"] is None  # a seed never reached the target
  dense = by["100mbit", "dense"]
  assert dense["R"] == pytest.approx(cost.network_time("dense", 10_007, 1.0, cl) / 0.005)
  for link in ("unlimited", "100mbit"):  # the rule: the least time to the target
    group = [r for r in rows if r["link"] == link]
    picked = [r for r in group if r["picked"]]
    assert len(picked) == 1 and picked[0]["time_s"] == min(
        r["time_s"] for r in group if r["time_s"] is not None)
    assert group[0]["best_gtopk_over_allgather"] == pytest.approx(
        by[link, "allgather-0.01-mc"]["time_s"] / by[link, "gtopk-0.01-mc"]["time_s"])


def test_time_at_nodes_counts_each_warm_up_level_and_a_dense_form_as_dense():
  calibration = {"params": {"alpha_s": 0.001, "swap_factor": 1.3, "odd_swap_factor": 1.6,
                            "merge_s_per_pair": 2e-7}, "link_overhead": 1.03}
  results = _at_nodes_results(["100mbit"])
  g = results["systems"][2]
  g["levels"] = [[0.01, 290], [0.04, 6], [1.0, 4]]  # 4 dense steps, 6 at the warm-up's 0.04
  row = {r["system"]: r for r in at_nodes.analyse(results, calibration)}["gtopk-0.01-mc"]
  cl = at_nodes.cluster(calibration, 16, 1e8)
  n = 10_007
  want = (290 * (0.005 + 0.0005 + cost.network_time("gtopk", n, 0.01, cl))
          + 6 * (0.005 + 0.002 + cost.network_time("gtopk", n, 0.04, cl))
          + 4 * (0.005 + cost.network_time("dense", n, 1.0, cl)))
  assert row["time_s"] == pytest.approx(want)
  assert row["step_s"] == pytest.approx(want / 300) and row["warmup_steps"] == 10


def test_time_at_nodes_writes_its_table_again(tmp_path):
  results = _at_nodes_results(["unlimited", "1gbit"])
  path = tmp_path / "r.json"
  path.write_text(json.dumps(results))
  assert at_nodes.main(["--from-results", str(path), "--out", str(tmp_path / "o.json")]) == 0
  text = (tmp_path / "o.md").read_text()
  assert "| 1gbit |" in text and "| gtopk-0.04-mc | 0.04 | never |" in text


def test_dense_steps_come_from_the_fewest_workers_where_it_did_not_run_at_p():
  scaling = {"rows": [
      {"system": "dense", "workers": 2, "density": 1.0, "steps_to_target": [140, 144, 150],
       "final": [0.88, 0.88, 0.89]},
      {"system": "dense", "workers": 4, "density": 1.0, "steps_to_target": [1, 1, 1],
       "final": [0.1, 0.1, 0.1]},
      {"system": "allgather-0.01-mc", "workers": 16, "density": 0.01,
       "steps_to_target": [108, None, 120], "final": [0.88, 0.84, 0.88]}]}
  systems = {s["system"]: s for s in at_nodes.systems_at(scaling, 16)}
  assert systems["dense"]["steps_to_target"] == 144 and systems["dense"]["from_workers"] == 2
  assert systems["allgather-0.01-mc"]["steps_to_target"] is None  # a seed never reached it
  with pytest.raises(ValueError, match="no runs at 8 workers"):
    at_nodes.systems_at(scaling, 8)


# ----------------------------------------------------------------------------- applied

def test_what_one_exchange_applies_against_a_direct_count():
  rng = np.random.default_rng(7)
  p, n, k = 5, 1_003, 17
  grads = rng.standard_normal((p, n)).astype(np.float32)
  g = grads.mean(0)
  everything = np.arange(n)
  rows = applied.applied(grads, k, {"gtopk": rng.choice(n, k, replace=False),
                                    "all": np.concatenate([everything, [n, n]])})
  union = set()
  update = np.zeros(n)
  for i in range(p):
    top = sorted(range(n), key=lambda j: -abs(grads[i, j]))[:k]
    union |= set(top)
    update[top] += grads[i, top] / p
  assert rows["allgather"]["applied_over_k"] == pytest.approx(len(union) / k)
  assert rows["allgather"]["share"] == pytest.approx(update @ g / (g @ g), rel=1e-5)
  assert rows["gtopk"]["applied_over_k"] == 1.0
  # every position, the "no pair" marker (n) left out: the whole gradient
  assert rows["all"]["applied_over_k"] == pytest.approx(n / k)
  assert rows["all"]["share"] == pytest.approx(1.0)


# ----------------------------------------------------------------------------- projected.py

def _scaling_rows(steps: dict[tuple[str, int], list]) -> dict:
  return {"meta": {"config": "configs/x.py", "seeds": 3}, "rows": [
      {"system": s, "workers": p, "density": 1.0 if s == "dense" else 0.01,
       "steps_to_target": v, "final": [0.88] * len(v)} for (s, p), v in steps.items()]}


def test_the_convergence_term_is_a_least_squares_line_in_log2_p():
  rng = np.random.default_rng(7)
  workers = [2, 4, 8, 16]
  dense = [150, 144, 138]
  gtopk = {p: list(rng.integers(100, 400, size=3)) for p in workers}
  scaling = _scaling_rows({("dense", 2): dense, **{("gtopk-0.01-mcm", p): v
                                                  for p, v in gtopk.items()},
                           ("allgather-0.01-mc", 2): [100, 110, 120]})
  got = projected.terms(scaling, {"higtopk": "gtopk-0.01-mcm", "hitopk": "allgather-0.01-mc"})
  ys = [np.median(gtopk[p]) / np.median(dense) for p in workers]
  b, a = np.polyfit(np.log2(workers), ys, 1)
  t = got["higtopk"]
  assert t.a == pytest.approx(a) and t.b == pytest.approx(b)
  assert t.fitted(16) == pytest.approx(ys[-1])  # measured where measured
  assert t.fitted(1024) == pytest.approx(a + 10 * b)  # the line past the measured range
  assert t.held(1024) == pytest.approx(ys[-1])  # held at the largest measured P
  assert got["hitopk"].b == 0.0 and got["hitopk"].held(128) == pytest.approx(110 / 144)


def test_time_to_target_over_dense_is_the_term_times_the_step_ratio_and_picks_the_least():
  term = {"hitopk": projected.Term("allgather", {16: 0.8}, 0.8, 0.0),
          "higtopk": projected.Term("gtopk", {2: 1.1, 16: 1.4}, 1.0, 0.1)}
  rows = [{"model": "m", "cluster": "c", "nodes": 1024, "algorithm": a, "step_s": s}
          for a, s in [("dense", 1.0), ("hierarchical", 0.9), ("hitopk", 1.8),
                       ("higtopk", 0.5)]]
  row, = projected.analyse(rows, term)
  assert row["dense"] == "hierarchical" and row["dense_step_s"] == 0.9
  g = row["systems"]["higtopk"]
  assert g["time_over_dense_held"] == pytest.approx(1.4 * 0.5 / 0.9)
  assert g["time_over_dense_fitted"] == pytest.approx((1.0 + 0.1 * 10) * 0.5 / 0.9)
  assert row["picked_held"] == "higtopk" and row["picked_fitted"] == "dense"  # 1.11 > 1


def test_a_projection_without_the_named_system_or_dense_is_refused():
  scaling = _scaling_rows({("dense", 2): [144, 150, 160], ("gtopk-0.01-mc", 16): [300] * 3})
  with pytest.raises(ValueError, match="'gtopk-0.01-mcm' is not in the results"):
    projected.terms(scaling, {"higtopk": "gtopk-0.01-mcm"})
  never = _scaling_rows({("dense", 2): [144, None, 160], ("gtopk-0.01-mc", 16): [300] * 3})
  with pytest.raises(ValueError, match="no dense run"):
    projected.terms(never, {"higtopk": "gtopk-0.01-mc"})


def test_residual_windows_are_means_of_their_steps():
  series = [{"held": h, "aligned": 0.5, "sent": 0.1 * h, "moved": 2.0}
            for h in (1.0, 2.0, 3.0, 4.0, 6.0)]
  rows = residuals.window_means(series, 2)
  assert [r["step"] for r in rows] == [2, 4, 5]
  assert [r["held"] for r in rows] == pytest.approx([1.5, 3.5, 6.0])
  assert [r["sent"] for r in rows] == pytest.approx([0.15, 0.35, 0.6])


@pytest.mark.parametrize("name", residuals.SYSTEMS)
def test_a_shadow_exchange_reports_its_memory_against_numpy(rng, name):
  """Three workers, fresh random gradients and memory, n not a multiple of anything: the
  metrics against numpy from the exchange's own outputs, and sent plus kept = every candidate
  (the conservation law: momentum correction without Nesterov, candidates r + (m u + g))."""
  from conftest import make_mesh, run_workers
  workers, n, k, m = 3, 1013, 17, 0.9
  g = rng.standard_normal((workers, n)).astype(np.float32)
  r = rng.standard_normal((workers, n)).astype(np.float32)
  u = rng.standard_normal((workers, n)).astype(np.float32)
  mesh = make_mesh(workers, 1)

  def body(g, r, u):
    new_r, new_u, metrics = residuals.shadow_step(name, g, r, u, k=k, axes=("node", "local"),
                                                  momentum=m, nesterov=False)
    return new_r, new_u, metrics

  new_r, new_u, metrics = run_workers(mesh, body, g, r, u)
  cand = r + m * u + g
  sent = cand.sum(0) - new_r.sum(0)  # what the exchange applied, by conservation
  nonzero = np.flatnonzero(np.abs(sent) > 1e-4)
  assert len(nonzero) <= (workers * k if name.startswith("allgather") else k)
  s = cand.sum(0).astype(np.float64)
  r2 = float((new_r.astype(np.float64) ** 2).sum())
  want = [r2 / float((g.sum(0).astype(np.float64) ** 2).sum()),
          float((new_r.sum(0).astype(np.float64) ** 2).sum()) / (workers * r2),
          float(sent @ s) / float(s @ s),
          float(sent @ sent) / float((g.sum(0).astype(np.float64) ** 2).sum())]
  for w in range(workers):
    np.testing.assert_allclose(metrics[w], want, rtol=2e-4)
  masked = np.flatnonzero(new_u[0] == 0)
  assert (len(masked) > 0) == (name == "gtopk-mcm")


@pytest.mark.parametrize("name", ["allgather-mc", "gtopk-mc"])
def test_a_shadow_exchange_s_delay_is_the_age_of_what_it_sends_against_numpy(rng, name):
  """Three steps on three workers (n = 1013, k = 17, Nesterov): the delay of each step from
  the exchange's own residuals, against numpy's bookkeeping of the steps each position's
  candidate terms came at since the worker last sent there."""
  import jax.numpy as jnp
  from conftest import make_mesh, run_workers
  workers, n, k, m = 3, 1013, 17, 0.9
  mesh = make_mesh(workers, 1)

  def body(g, r, u, mass, moment, step):
    new_r, new_u, _ = residuals.shadow_step(name, g, r, u, k=k, axes=("node", "local"),
                                            momentum=m, nesterov=True)
    (mass, moment), delay = residuals.delay_step(g, r, u, new_r, (mass, moment), step[0],
                                                 axes=("node", "local"), momentum=m,
                                                 nesterov=True)
    return new_r, new_u, mass, moment, jnp.broadcast_to(delay, (1,))

  zeros = np.zeros((workers, n), np.float32)
  r, u, mass, moment = zeros, zeros, zeros, zeros
  ref_mass, ref_moment = np.zeros((workers, n)), np.zeros((workers, n))
  delays = []
  for t in range(3):
    g = rng.standard_normal((workers, n)).astype(np.float32) * (1 + rng.random(n) * 9)
    new_r, new_u, mass, moment, delay = run_workers(
        mesh, body, g, r, u, mass, moment, np.full((workers, 1), t, np.float32))
    velocity = m * u + g
    term = np.abs(g + m * velocity).astype(np.float64)
    acc = r + g + m * velocity
    sent = (acc != 0) & (new_r == 0)
    ref_mass += term
    ref_moment += term * t
    age = t - ref_moment / np.where(ref_mass > 0, ref_mass, 1)
    weight = np.where(sent, np.abs(acc), 0)
    want = float((weight * age).sum() / weight.sum())
    np.testing.assert_allclose(np.asarray(delay)[:, 0], want, rtol=1e-4, atol=1e-4)
    ref_mass[sent], ref_moment[sent] = 0, 0
    np.testing.assert_allclose(mass, ref_mass, rtol=1e-5, atol=1e-5)
    delays.append(want)
    r, u = new_r, new_u
  assert delays[0] == 0 and delays[2] > 0  # what has waited is sent later


def test_a_bad_shadow_system_is_named():
  with pytest.raises(ValueError, match="'gtopk-x'"):
    residuals.shadow_step("gtopk-x", None, None, None, k=1, axes="node", momentum=0.9,
                          nesterov=False)


def test_time_at_nodes_refuses_results_of_another_task(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(ws.ROOT)
  paths = []
  for i, config in enumerate(["configs/tta_fmnist_mlp.py", "configs/tta_mnist_mlp.py"]):
    path = tmp_path / f"s{i}.json"
    path.write_text(json.dumps({"meta": {"config": config, "parameters": N, "seeds": 3},
                                "runs": [], "rows": []}))
    paths.append(str(path))
  with pytest.raises(SystemExit):
    at_nodes.main(["--results", ",".join(paths), "--out", str(tmp_path / "o.json")])
  assert "tta_mnist_mlp.py" in capsys.readouterr().err
