"""studies/preemption/run.py --quick: an elastic run on 3 emulated nodes loses one a third of the
way through, goes on with 2 (the checkpoint of 3 workers resized for 2) and ends like the run
that lost nothing."""

import json

import pytest

from studies.preemption import run as preemption
from tests.conftest import need_root

# end to end (the emulated cluster, the studies, whole recipes): `python -m pytest -m integration`
pytestmark = pytest.mark.integration


def test_a_run_that_loses_a_node_goes_on_and_reaches_the_target(tmp_path):
  need_root("test")
  out = tmp_path / "preemption.json"
  # (--quick's recipe without its DGC warm-up: each process that starts at step 0, six of the
  # eight, compiled a step per warm-up level, ~25 of the test's ~100 CPU-seconds, and the node is
  # lost long after the warm-up; the warm-up on the emulated cluster is the time-to-accuracy
  # study's quick run, a resume through it test_train's
  # test_resumed_run_has_exactly_the_metrics_of_the_uninterrupted_run)
  assert preemption.main(["--quick", "--set", "compression.warmup_epochs=0.0",
                          "--out", str(out)]) == 0
  got = json.loads(out.read_text())
  whole, lost = got["runs"]
  assert not whole["lose"] and lost["lose"]
  assert whole["rc"] == lost["rc"] == 0 and lost["steps"] == whole["steps"] == got["meta"][
      "total_steps"]
  assert lost["devices_at_end"] == 2 and whole["devices_at_end"] == 3
  assert any("restart 1" in line for line in lost["launcher"])
  assert any("written by 3 workers; resized for 2" in line for line in lost["launcher"])
  assert lost["target_s"] is not None and whole["target_s"] is not None
  assert abs(lost["final_accuracy"] - whole["final_accuracy"]) < 0.03
  assert 0 <= lost["detect_s"] < 5 and lost["restart_s"] > 0 and lost["steps_again"] >= 0
  assert lost["kill_step"] >= round(got["meta"]["at"] * got["meta"]["total_steps"])
  assert "| a node lost |" in out.with_suffix(".md").read_text()
