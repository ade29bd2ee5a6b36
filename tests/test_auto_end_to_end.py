"""studies/auto/end_to_end.py: auto's measured runs judged against a reference study, on
hand-made results whose verdicts are worked out by hand (the launches themselves are the study's,
tested in tests/test_time_to_accuracy.py)."""

import json

import pytest

from studies.auto import end_to_end as e2e

# end to end (the emulated cluster, the studies, whole recipes): `python -m pytest -m integration`
pytestmark = pytest.mark.integration


def _curve(times: list[float], losses: list[float]) -> list[dict]:
  return [{"step": 25 * (i + 1), "train_time_s": t, "loss": v}
          for i, (t, v) in enumerate(zip(times, losses))]


def reference() -> dict:
  """A study at headline "unlimited": dense, hitopk-0.05 and DDP swept at two links; auto-0.05
  trained at the headline (seeds reach loss 4.55 at 50, 50 and 75 steps)."""
  train = [{"system": "auto-0.05", "seed": s, "curve": _curve(t, v),
            "exchange_choices": [{"step": 0, "form": "dense"}, {"step": 10, "form": "dense"},
                                 {"step": 20, "form": "sparse"}]}
           for s, (t, v) in enumerate([([3.0, 6.1], [4.9, 4.5]), ([3.2, 6.3], [4.8, 4.4]),
                                       ([3.1, 6.0, 9.4], [4.9, 4.6, 4.5])])]
  return {
      "meta": {"headline": "unlimited", "target": 4.55, "target_metric": "loss"},
      "train": train,
      "parity": [{"jax_over_torch": r, "jax": {"step_s": 0.10}, "torch": {"step_s": 0.08}}
                 for r in (1.2, 1.25, 1.3)],
      "exchange_over_compute": {"unlimited": 0.4, "100mbit": 2.5},
      "analysis": {
          "dense": {"predicted_time_to_target_s": {"unlimited": [6.0, 6.2, 6.4],
                                                   "100mbit": [100.0, 101.0, 99.0]}},
          "hitopk-0.05": {"predicted_time_to_target_s": {"unlimited": [7.0, 7.1, 7.2],
                                                         "100mbit": [50.0, 52.0, 54.0]}},
          "torch-ddp": {"predicted_time_to_target_s": {"unlimited": [5.0, 5.0, 5.0],
                                                       "100mbit": [90.0, 90.0, 90.0]}},
          "auto-0.05": {"predicted_time_to_target_s": {}}},
      "sweep": [{"system": "torch-ddp", "bandwidth": bw, "density": 1.0, "step_s": s}
                for bw, s in [("unlimited", 0.11), ("unlimited", 0.12), ("100mbit", 0.30),
                              ("100mbit", 0.32)]]}


def test_runs_of_reads_time_steps_and_changes_of_form():
  runs = e2e.runs_of(reference(), "auto-0.05")
  assert [r["steps"] for r in runs] == [50, 50, 75]
  assert [r["time_s"] for r in runs] == [6.1, 6.3, 9.4]
  assert runs[0]["forms"] == [(0, "dense"), (20, "sparse")]
  assert runs[2]["clock"] == [[25, 3.1], [50, 6.0], [75, 9.4]]  # to the target


def test_judge_slow_link_against_best_fixed_and_ddp():
  runs = [{"seed": i, "steps": 250, "time_s": t, "forms": []} for i, t in enumerate(
      [48.0, 50.0, 60.0])]
  row = e2e.judge(reference(), "100mbit", runs, "auto-0.05")
  assert row["best_fixed"] == "hitopk-0.05"
  assert row["auto_over_best"] == pytest.approx(50.0 / 52.0)
  assert row["ddp_over_auto"] == pytest.approx(90.0 / 50.0)
  assert row["ddp_over_auto_needed"] == 1.5  # R 2.5 >= 2
  # exposed: mean step to target - JAX compute; DDP: its swept step - PyTorch compute
  assert row["auto_exposed_s"] == pytest.approx([48 / 250 - 0.1, 50 / 250 - 0.1, 60 / 250 - 0.1])
  assert row["ddp_exposed_s"] == pytest.approx([0.22, 0.24])
  assert row["within_1.1_of_best"] and row["ddp_target_met"] and row["exposed_met"]


def test_judge_fast_link_allows_the_compute_parity():
  runs = e2e.runs_of(reference(), "auto-0.05")  # median 6.3 s
  row = e2e.judge(reference(), "unlimited", runs, "auto-0.05")
  assert row["best_fixed"] == "dense"
  assert row["auto_over_best"] == pytest.approx(6.3 / 6.2)
  assert row["ddp_over_auto_needed"] == pytest.approx(1 / 1.25)  # R < 1: DDP x parity
  assert not row["ddp_target_met"]  # 5.0 / 6.3 = 0.79 < 0.8
  # auto's worst seed exposes 6.3 / 50 - 0.1 = 26 ms a step, DDP 30 and 40 ms
  assert max(row["auto_exposed_s"]) == pytest.approx(0.026)
  assert row["exposed_met"]


def test_judge_takes_the_fixed_systems_trained_beside_auto_over_the_prediction():
  runs = e2e.runs_of(reference(), "auto-0.05")  # median 6.3 s
  trained = {"dense": [{"seed": s, "steps": 60, "time_s": t, "forms": []}
                       for s, t in enumerate([6.9, 7.0, 7.3])]}
  row = e2e.judge(reference(), "unlimited", runs, "auto-0.05", trained)
  assert row["fixed_time_s"]["dense"] == [6.9, 7.0, 7.3] and row["fixed_trained"] == ["dense"]
  # dense measured 7.0 s, hitopk-0.05 still predicted (7.1 s): dense the best, auto 0.9x it
  assert row["best_fixed"] == "dense"
  assert row["auto_over_best"] == pytest.approx(6.3 / 7.0)


def test_judge_at_another_target_than_the_references_leaves_ddps_time_out():
  """A deeper target on the same model and links: the reference's R and DDP's swept step still
  hold (a step's costs), its times to target do not."""
  runs = e2e.runs_of(reference(), "auto-0.05")  # median 6.3 s
  trained = {"dense": [{"seed": s, "steps": 60, "time_s": t, "forms": []}
                       for s, t in enumerate([6.0, 6.6, 7.3])]}
  row = e2e.judge(reference(), "unlimited", runs, "auto-0.05", trained, target=4.2)
  assert "torch-ddp" not in row["fixed_time_s"] and row["ddp_over_auto"] is None
  assert row["ddp_target_met"] is None and row["exposed_met"]
  assert row["auto_over_best"] == pytest.approx(6.3 / 6.6) and row["R"] == 0.4
  assert e2e._ddp(row) == "n/a"
  with pytest.raises(ValueError, match="target 4.2 is not the reference's 4.55"):
    e2e.judge(reference(), "unlimited", runs, "auto-0.05", target=4.2)
  # the reference's own target: DDP judged as before
  assert e2e.judge(reference(), "unlimited", runs, "auto-0.05", trained,
                   target=4.55)["ddp_target_met"] is False


def test_judge_takes_ddp_trained_beside_auto_over_the_references_and_pairs_only_sparsejax():
  """DDP in `--fixed`: its time to target is its runs beside auto (at any target, the
  reference's other day's steps x swept step out of it), never auto's best fixed system, and not
  a seed's mate in auto's by-seed ratio."""
  runs = e2e.runs_of(reference(), "auto-0.05")  # 6.1, 6.3, 9.4 s
  trained = {"dense": [{"seed": s, "steps": 60, "time_s": t, "forms": []}
                       for s, t in enumerate([6.9, 7.0, 7.3])],
             "torch-ddp": [{"seed": s, "steps": 50, "time_s": t, "forms": []}
                           for s, t in enumerate([4.0, 9.9, 8.0])]}
  for target in (4.55, 4.2):
    row = e2e.judge(reference(), "unlimited", runs, "auto-0.05", trained, target=target)
    assert row["fixed_time_s"]["torch-ddp"] == [4.0, 9.9, 8.0]  # not the reference's 5.0s
    assert row["ddp_over_auto"] == pytest.approx(8.0 / 6.3)
    assert row["ddp_target_met"] is True  # 1.27 >= 1 / 1.25
    assert row["best_fixed"] == "dense" and row["auto_over_best"] == pytest.approx(6.3 / 7.0)
    assert row["auto_over_best_by_seed"] == pytest.approx([6.1 / 6.9, 6.3 / 7.0, 9.4 / 7.3])
  assert "torch-ddp" not in row["auto_at_step_over"]  # (a PyTorch clock: another framework)
  # DDP alone beside auto: the sparsejax systems still the reference's predictions
  alone = e2e.judge(reference(), "unlimited", runs, "auto-0.05", {"torch-ddp": trained[
      "torch-ddp"]})
  assert alone["best_fixed"] == "dense" and alone["auto_over_best"] == pytest.approx(6.3 / 6.2)
  assert alone["ddp_over_auto"] == pytest.approx(8.0 / 6.3)
  text = e2e.table({"meta": {"system": "auto-0.05", "target_metric": "loss", "target": 4.2,
                             "seeds": 3, "reference": "ref.json", "reference_target": 4.55,
                             "command": "c", "commit": "x", "machine": "m", "cpus": 2,
                             "date": "d"}, "rows": [row]})
  assert ("dense, torch-ddp trained end to end beside it the same way (seed by seed, the "
          "systems' order rotating between seeds); the reference study `ref.json` for R, the "
          "parity and DDP's swept step. R:" in text)


def test_from_results_rejudges_against_a_moved_reference(tmp_path, capsys):
  ref = tmp_path / "ref.json"
  ref.write_text(json.dumps(reference()))
  runs = {"unlimited": e2e.runs_of(reference(), "auto-0.05"),
          "100mbit": [{"seed": 0, "steps": 250, "time_s": 95.0, "forms": [[0, "sparse"]]}]}
  stored = tmp_path / "e2e_in.json"
  stored.write_text(json.dumps({"runs": runs, "meta": {
      "system": "auto-0.05", "seeds": 3, "machine": "x", "cpus": 2, "date": "d",
      "command": "python -m studies.auto.end_to_end"}}))
  out = tmp_path / "e2e.json"
  assert e2e.main(["--config", "c", "--system", "auto-0.05", "--reference", str(ref),
                   "--bandwidths", "unlimited,100mbit", "--out", str(out),
                   "--from-results", str(stored)]) == 0
  got = json.loads(out.read_text())
  assert [r["bandwidth"] for r in got["rows"]] == ["unlimited", "100mbit"]
  assert got["rows"][1]["auto_over_best"] == pytest.approx(95.0 / 52.0)
  table = (tmp_path / "e2e.md").read_text()
  assert "| 100mbit | 2.5 | 95.0 |" in table
  assert "within_1.1_of_best: no" in table


def test_bad_system_and_incomplete_reference_are_named(tmp_path, capsys):
  ref = tmp_path / "ref.json"
  ref.write_text(json.dumps(reference()))
  common = ["--config", "c", "--bandwidths", "unlimited", "--out", str(tmp_path / "o.json")]
  with pytest.raises(SystemExit):
    e2e.main(common + ["--system", "hitopk-0.05", "--reference", str(ref)])
  assert "'hitopk-0.05' is not an auto system" in capsys.readouterr().err
  partial = reference()
  del partial["parity"]
  ref.write_text(json.dumps(partial))
  with pytest.raises(SystemExit):
    e2e.main(common + ["--system", "auto-0.05", "--reference", str(ref)])
  assert "lacks ['parity']" in capsys.readouterr().err


def test_step_check_pairs_each_prediction_with_the_step_the_run_then_took():
  def choice(step, form, how, dense, sparse, measured="dense"):
    return {"step": step, "form": form, "why": "measured", "how": how, "measured": measured,
            "measured_step_ms": {"dense": dense, "sparse": sparse}[measured],
            "dense_step_ms": dense, "sparse_step_ms": sparse}
  choices = [choice(0, "sparse", "timed", 25.0, 18.0),
             choice(90, "sparse", "observed over 42 steps", 200.0, 20.0, "sparse"),
             {"step": 100, "form": "dense", "why": "schedule"},
             choice(150, "dense", "observed over 9 steps", 30.0, 21.0)]
  pairs = e2e.predictions(choices)
  # 0 -> 90: sparse predicted 18 ms, run 20; 90 -> schedule: no pair; schedule -> 150: no pair
  assert pairs == [{"form": "sparse", "predicted_s": 0.018, "observed_s": 0.020, "from": "timed"}]
  runs = [{"predictions": pairs}, {"predictions": [
      {"form": "sparse", "predicted_s": 0.022, "observed_s": 0.020},
      {"form": "dense", "predicted_s": 0.030, "observed_s": 0.025}]}]
  got = e2e.step_check(runs)
  assert got["sparse, timed"]["ratios"] == pytest.approx([0.9])
  assert got["sparse, observed"]["ratios"] == pytest.approx([1.1])
  assert got["dense, observed"]["ratios"] == pytest.approx([1.2])


def test_a_prediction_is_observed_only_where_its_own_form_ran_in_the_run():
  """A form's prediction rests on the run's steps once that form was observed (at this choice
  or an earlier one), and on a timing again once it is timed again (the link moved)."""
  def choice(step, form, how, measured, dense, sparse):
    return {"step": step, "form": form, "why": "measured", "how": how, "measured": measured,
            "measured_step_ms": {"dense": dense, "sparse": sparse}[measured],
            "dense_step_ms": dense, "sparse_step_ms": sparse}
  choices = [choice(0, "sparse", "timed", "sparse", 25.0, 18.0),
             choice(90, "dense", "observed over 42 steps", "sparse", 19.0, 20.0),
             choice(100, "dense", "observed over 9 steps", "dense", 22.0, 20.0),
             choice(110, "dense", "observed over 9 steps; sparse timed again (the link moved)",
                    "dense", 23.0, 40.0),
             choice(120, "sparse", "observed over 9 steps", "dense", 24.0, 10.0),
             choice(130, "sparse", "observed over 9 steps", "sparse", 24.0, 12.0)]
  got = [(p["form"], p["from"]) for p in e2e.predictions(choices)]
  # 0: sparse timed; 90: dense from its timing (sparse observed); 100, 110: dense observed;
  # 120: sparse, timed again at 110
  assert got == [("sparse", "timed"), ("dense", "timed"), ("dense", "observed"),
                 ("dense", "observed"), ("sparse", "timed")]


def test_a_prediction_rests_on_the_run_s_own_steps_or_is_modelled():
  """The controller that reads only the run's steps: a form's prediction is "observed" once its
  own steps were read at this input size, else "modelled" (the other form's rest and the
  modelled exchanges); a choice made before any step was read predicts nothing."""
  def choice(step, form, how, measured, dense, sparse, **extra):
    return {"step": step, "form": form, "why": "measured", "how": how, "measured": measured,
            "measured_step_ms": None if measured is None else {"dense": dense,
                                                               "sparse": sparse}[measured],
            "dense_step_ms": dense, "sparse_step_ms": sparse, **extra}
  choices = [choice(0, "sparse", "no step read yet: the rest taken as 0", None, 5.0, 3.0),
             choice(4, "dense", "observed over 3 steps", "sparse", 19.0, 20.0),
             choice(8, "sparse", "observed over 3 steps", "dense", 22.0, 19.0),
             choice(12, "dense", "observed over 3 steps", "sparse", 24.0, 25.0),
             choice(17, "dense", "observed over 3 steps", "dense", 30.0, 28.0, input_shape=[6]),
             choice(21, "dense", "observed over 3 steps", "dense", 31.0, 28.0)]
  got = [(p["form"], p["from"], p["observed_s"]) for p in e2e.predictions(choices)]
  assert got == [("dense", "modelled", 0.022), ("sparse", "observed", 0.025),
                 ("dense", "observed", 0.030), ("dense", "observed", 0.031)]


def test_the_paired_ratio_takes_each_seed_against_its_own_fastest_fixed_system():
  runs = [{"seed": 0, "time_s": 5.0}, {"seed": 1, "time_s": 6.0}, {"seed": 2, "time_s": None}]
  trained = {"dense": [{"seed": 0, "time_s": 5.5}, {"seed": 1, "time_s": 7.5},
                       {"seed": 2, "time_s": 6.0}],
             "hitopk": [{"seed": 0, "time_s": 4.0}, {"seed": 1, "time_s": 6.6},
                        {"seed": 2, "time_s": 5.0}]}
  assert e2e.paired(runs, trained) == pytest.approx([5.0 / 4.0, 6.0 / 6.6])


def test_auto_measurements_before_the_target_are_summed_and_left_out_by_seed():
  ref = reference()
  for run, costs in zip(ref["train"], [(300.0, 40.0, 50.0), (200.0, 30.0, 30.0),
                                       (250.0, 20.0, 10.0)]):
    for choice, ms in zip(run["exchange_choices"], costs):
      choice.update(why="measured", measure_ms=ms)
  ref["train"][0]["exchange_choices"].append(  # after the target (step 50): not counted
      {"step": 60, "form": "sparse", "why": "measured", "measure_ms": 999.0})
  runs = e2e.runs_of(ref, "auto-0.05")
  assert [r["measure_s"] for r in runs] == pytest.approx([0.39, 0.26, 0.28])
  assert [r["first_measure_s"] for r in runs] == pytest.approx([0.3, 0.2, 0.25])
  trained = {"dense": [{"seed": s, "time_s": t} for s, t in enumerate([5.0, 6.0, 9.0])]}
  row = e2e.judge(ref, "unlimited", runs, "auto-0.05", trained)
  assert row["auto_over_best_by_seed"] == pytest.approx([6.1 / 5.0, 6.3 / 6.0, 9.4 / 9.0])
  assert row["auto_over_best_by_seed_unmeasured"] == pytest.approx(
      [(6.1 - 0.39) / 5.0, (6.3 - 0.26) / 6.0, (9.4 - 0.28) / 9.0])
  # judged against the systems trained beside it alone (DDP from the reference)
  assert set(row["fixed_time_s"]) == {"dense", "torch-ddp"} and row["best_fixed"] == "dense"
  # the share of the run: 0.26 / 6.3, 0.28 / 9.4, 0.39 / 6.1
  meta = {"system": "auto-0.05", "target_metric": "loss", "target": 4.55, "seeds": 3,
          "reference": "r.json", "command": "c", "machine": "m", "cpus": 2, "date": "d"}
  assert ("| unlimited | 0.26 / 0.28 / 0.39 | not recorded | 3.0 / 4.1 / 6.4 | 0.20 / 0.25 / 0.30 |"
          in e2e.table({"meta": meta, "rows": [row]}))
  # with the switches' compiles recorded (1, 0, 2 s): in the share, added to the run's time
  row["auto_compile_s"] = [1.0, 0.0, 2.0]
  # (0.39 + 1) / (6.1 + 1), 0.26 / 6.3, (0.28 + 2) / (9.4 + 2)
  assert "| 0.00 / 1.00 / 2.00 | 4.1 / 19.6 / 20.0 |" in e2e.table({"meta": meta, "rows": [row]})


def test_switch_compiles_are_the_programs_of_a_form_auto_did_not_start_a_size_in():
  def program(step, size, form, s):
    return {"first_step": step, "size": size, "form": form, "compile_s": s, "level": 0}
  programs = [program(0, 24, "sparse", 1.0), program(0, 24, "sparse", 1.5),  # warm-up levels
              program(9, 24, "dense", 2.0), program(10, 24, "dense", 2.5),  # a switch at 9
              program(40, 32, "dense", 3.0),  # a new size in the form in force: not a switch's
              program(50, 32, "sparse", 4.0), program(90, 40, "sparse", 5.0)]
  assert e2e.switch_compiles_s(programs, None) == pytest.approx(2.0 + 2.5 + 4.0)
  assert e2e.switch_compiles_s(programs, 50) == pytest.approx(2.0 + 2.5)  # (the target at 50)
  assert e2e.switch_compiles_s(programs[::-1], 10) == pytest.approx(2.0)  # (in any order)


def test_at_same_step_divides_the_clocks_at_the_last_evaluation_both_reached():
  runs = [{"seed": 0, "clock": [[25, 3.0], [50, 6.1]]},
          {"seed": 1, "clock": [[25, 2.9], [50, 5.9], [75, 9.0], [100, 12.4]]},
          {"seed": 2}]  # (a result from before the clock was kept)
  mates = [{"seed": 1, "clock": [[25, 2.0], [50, 4.4], [75, 6.0]]},
           {"seed": 0, "clock": [[25, 2.5], [50, 5.0], [75, 7.5]]},
           {"seed": 2, "clock": [[25, 2.0]]}]
  assert e2e.at_same_step(runs, mates) == pytest.approx([6.1 / 5.0, 9.0 / 6.0])
  assert e2e.at_same_step(runs, []) == []
