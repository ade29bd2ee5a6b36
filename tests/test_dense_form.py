"""benchmarks/dense_form.py: auto's dense form and plain dense, built as the benchmark builds
them, compute the same update (up to rounding) and are both timed."""

import json

import pytest

from benchmarks import dense_form


@pytest.mark.integration
@pytest.mark.slow  # (two task runs compiled: minutes)
def test_auto_s_dense_form_makes_plain_dense_s_update(tmp_path):
  out = tmp_path / "dense_form.json"
  assert dense_form.main(["--variants", "mlp-mc", "--procs", "1", "--blocks", "1",
                          "--block-steps", "2", "--out", str(out)]) == 0
  row, = json.loads(out.read_text())["rows"]
  assert row["steps_each"] == 2 and row["ratio"] > 0
  assert row["max_param_diff"] < 1e-5  # the same SGD with momentum, summed another way


def test_an_unknown_variant_is_refused(capsys):
  with pytest.raises(SystemExit):
    dense_form.main(["--variants", "mlp-mc,resnet9000"])
  assert "resnet9000" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.slow  # (two task runs compiled: minutes)
def test_auto_s_sparse_form_makes_the_fixed_sparse_system_s_update(tmp_path):
  out = tmp_path / "sparse_form.json"
  assert dense_form.main(["--variants", "mlp-mc", "--form", "sparse", "--procs", "1",
                          "--blocks", "1", "--block-steps", "2", "--out", str(out)]) == 0
  got = json.loads(out.read_text())
  row, = got["rows"]
  assert set(row["step_s"]) == {"auto-sparse", "hitopk"} and got["meta"]["form"] == "sparse"
  assert row["max_param_diff"] < 1e-5  # the same HiTopKComm selection and update
  assert "auto's sparse form against hitopk" in out.with_suffix(".md").read_text()
