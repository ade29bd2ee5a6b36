"""studies/time_to_accuracy/run.py: the study's code paths (in CI: --quick, on the emulated
cluster), its bookkeeping against hand-computed values, and the PyTorch peer's model against the
flax MLP."""

import importlib.util
import json
import os
import re
import statistics

import jax
import numpy as np
import pytest

from sparsejax import bench, cluster, models
from sparsejax.compress import density_levels
from studies.time_to_accuracy import analysis as tta_analysis
from studies.time_to_accuracy import run as tta
from studies.time_to_accuracy import systems as tta_systems
from studies.time_to_accuracy.torch_peer import torch_mlp
from tests.conftest import need_root

# end to end (the emulated cluster, the studies, whole recipes): `python -m pytest -m integration`
pytestmark = pytest.mark.integration

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "tta_fmnist_mlp.py")


HAVE_TORCH = importlib.util.find_spec("torch") is not None


PIPE = "hitopk-0.01-mc-pipe"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  """One --quick study (digits, 2 emulated nodes): the sparsejax systems (--quick's two, and the
  pipelined exchange: one study for both saves CI a driver and a cluster), and PyTorch DDP with
  the parity phase where PyTorch is installed."""
  need_root("study")
  out = tmp_path_factory.mktemp("tta") / "tta.json"
  argv = ["--quick", "--out", str(out), "--systems",
          f"dense,hitopk-0.01,{PIPE}" + (",torch-ddp" if HAVE_TORCH else "")]
  if not HAVE_TORCH:
    argv += ["--phases", "runs"]
  assert tta.main(argv) == 0
  return json.loads(out.read_text()), out


def test_quick_run_trains_the_sparsejax_systems_sweeps_and_tears_down(quick):
  got, out = quick
  jax_systems = ["dense", "hitopk-0.01", PIPE]
  assert [r["system"] for r in got["train"]] == jax_systems + (["torch-ddp"] * HAVE_TORCH)
  assert got["meta"]["config"] == "configs/tta_fmnist_mlp.py"  # relative to the checkout
  assert "data.name=digits" in got["meta"]["sets"]
  assert cluster.EmulatedCluster.leftovers("tta") == []
  assert not os.path.exists(str(out).replace(".json", ".partial.json"))
  for run in got["train"]:
    steps = [p["step"] for p in run["curve"]]
    assert steps == sorted(steps) and steps[-1] == run["total_steps"]
    assert all(0.0 <= p["accuracy"] <= 1.0 for p in run["curve"])
    assert run["curve"][-1]["accuracy"] > 0.3  # learned something from 10 classes
    times = [p["train_time_s"] for p in run["curve"]]
    assert all(0 < a < b for a, b in zip(times, times[1:]))
    if "levels_to_target" in run:
      hit = tta_analysis.steps_to_target(run["curve"], got["meta"]["target"])
      assert sum(n for _, n in run["levels_to_target"]) == hit["step"]
  # every system x bandwidth x density level it visits was timed, with bytes on the link
  sweep = {(r["system"], r["bandwidth"], r["density"]) for r in got["sweep"]}
  levels = density_levels(0.01, 0.25)  # (the task's warm-up from 0.25)
  for bw in ("unlimited", "200mbit"):
    assert ("dense", bw, 1.0) in sweep
    assert {d for s, b, d in sweep if s == "hitopk-0.01" and b == bw} <= set(levels)
    assert ("hitopk-0.01", bw, 0.01) in sweep
  dense_bytes = [r["node0_link_bytes_per_step"] for r in got["sweep"] if r["system"] == "dense"]
  sparse_bytes = [r["node0_link_bytes_per_step"] for r in got["sweep"]
                  if r["system"] == "hitopk-0.01" and r["density"] == 0.01]
  assert min(dense_bytes) > 5 * max(sparse_bytes)  # the sparse exchange sends far less
  # each warm-up level really runs at its density: more bytes the higher it is
  by_level = {r["density"]: r["node0_link_bytes_per_step"] for r in got["sweep"]
              if r["system"] == "hitopk-0.01" and r["bandwidth"] == "200mbit"}
  assert max(by_level) > 0.01 and by_level[max(by_level)] > 3 * by_level[0.01]
  assert set(jax_systems) <= set(got["analysis"])
  md = out.with_suffix(".md").read_text()
  assert "| dense |" in md and "Command: `python -m studies.time_to_accuracy.run --quick" in md


def test_quick_run_trains_the_pytorch_peer_and_measures_parity(quick):
  if not HAVE_TORCH:
    if os.environ.get("CI"):
      pytest.fail("CI installs PyTorch (.ci/run): the peer must run there")
    pytest.skip(f"needs PyTorch: {tta_systems.PEERS_INSTALL}")
  got, _ = quick
  assert {(r["system"], r["bandwidth"]) for r in got["sweep"] if r["system"] == "torch-ddp"} == {
      ("torch-ddp", "unlimited"), ("torch-ddp", "200mbit")}
  assert got["meta"]["nodes"] == 2  # (the committed config's mesh.nodes)
  for runtime in ("jax", "torch"):  # both nodes' processes timed at once, the median kept
    nodes = got["parity"][0][runtime]["nodes_step_s"]
    assert len(nodes) == 2 and min(nodes) > 0
    assert got["parity"][0][runtime]["step_s"] == pytest.approx(float(np.median(nodes)))
  assert "torch-ddp" in got["analysis"]


@pytest.mark.slow  # ~2 minutes on 2 cores, over CI's 15-minute budget (the layout, the node
# count's checks and the 2-node runs stay in CI)
def test_the_study_trains_on_four_nodes_when_the_config_says_so(tmp_path):
  """`--set mesh.nodes=4` on a 2-core machine: four emulated nodes, one process each, pinned
  round-robin (two to a core); the sparsejax system (and PyTorch DDP, a gloo world of four, with
  the parity phase's four processes, where PyTorch is installed) trains the quick recipe, every
  link is swept, the results record the node count, and no namespace is left."""
  need_root("study")
  out = tmp_path / "tta4.json"
  systems = "hitopk-0.01" + (",torch-ddp" if HAVE_TORCH else "")
  phases = "parity,runs" if HAVE_TORCH else "runs"
  assert tta.main(["--quick", "--set", "mesh.nodes=4", "--systems", systems, "--phases", phases,
                   "--out", str(out)]) == 0
  got = json.loads(out.read_text())
  assert got["meta"]["nodes"] == 4 and "mesh.nodes=4" in got["meta"]["sets"]
  assert [r["system"] for r in got["train"]] == systems.split(",")
  for run in got["train"]:
    assert run["curve"][-1]["step"] == run["total_steps"]
    assert run["curve"][-1]["accuracy"] > 0.3
    assert run["curve"][-1]["node0_link_bytes"] > 0
  assert {(r["system"], r["bandwidth"]) for r in got["sweep"]} == {
      (s, b) for s in systems.split(",") for b in ("unlimited", "200mbit")}
  assert cluster.EmulatedCluster.leftovers("tta") == []
  if HAVE_TORCH:
    cores = len(os.sched_getaffinity(0))
    for runtime, each in (("jax", "1 CPU devices each"), ("torch", "1 thread each")):
      parity = got["parity"][0][runtime]
      assert len(parity["nodes_step_s"]) == 4 and min(parity["nodes_step_s"]) > 0
      assert parity["batch_per_process"] == 64 // 4
      assert parity["layout"] == f"4 processes at once, {bench.pinning(4, cores)}, {each}"


def test_a_node_count_the_study_cannot_run_is_refused_before_any_run(tmp_path, capsys):
  """mesh.nodes below 2 or above the cluster's 200, or a global batch that the nodes x local
  workers cannot share evenly, end the command at once naming the values; nothing is written."""
  for sets, says in ((["mesh.nodes=3"], "batch_size = 64 is not divisible by mesh.nodes x "
                      "mesh.local = 3 x 1 = 3"),
                     (["mesh.nodes=1"], "mesh.nodes = 1: the study runs one process on each of "
                      "2 to 200 emulated nodes"),
                     (["mesh.nodes=256", "batch_size=256"], "mesh.nodes = 256"),
                     (["mesh.local=-1"], "mesh.local = -1")):
    with pytest.raises(SystemExit) as exit_:
      tta.main(["--quick", "--systems", "dense", "--phases", "runs", "--out",
                str(tmp_path / "tta.json"), *[f"--set={s}" for s in sets]])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
  # a system's own overrides may not move it off the task's nodes
  with pytest.raises(SystemExit):
    tta.main(["--quick", "--systems", "dense,dense+mesh.nodes=4", "--phases", "runs", "--out",
              str(tmp_path / "tta.json")])
  assert "system 'dense+mesh.nodes=4' sets mesh.nodes = 4: every system runs on the task's 2 " \
      "nodes" in capsys.readouterr().err
  assert list(tmp_path.iterdir()) == []


def test_the_task_config_follows_its_node_count():
  """load_task: mesh.num_devices follows mesh.nodes x mesh.local (each process's devices come
  from the launcher), for the cluster's config and the parity phase's one-node config."""
  assert tta_systems.load_task(CONFIG, []).mesh.num_devices == 2
  eight = tta_systems.load_task(CONFIG, ["mesh.nodes=8", "mesh.local=2"])
  assert (eight.mesh.nodes, eight.mesh.num_devices) == (8, 16)
  tta_systems.check_mesh(eight)  # (batch 256 over 16 workers)
  one = tta_systems.load_task(CONFIG, ["mesh.nodes=1", "mesh.local=2"])
  assert one.mesh.num_devices == 2


def test_the_parity_layout_says_how_the_processes_share_the_cores():
  assert tta.parity_layout("jax", 2, 2, 1) == ("2 processes at once, one pinned to each core, "
                                               "1 CPU devices each")  # (as before)
  assert tta.parity_layout("torch", 8, 2, 1) == ("8 processes at once, 4 pinned to each of 2 "
                                                 "cores, 1 thread each")
  meta = {"nodes": 8, "cpus": 2}
  assert tta_analysis._parity_processes(meta) == ("all 8 nodes' processes at once, sharing the "
                                                  "cores round-robin")
  assert tta_analysis._parity_processes({"cpus": 2}) == (
      "each node's process on its own core at once")  # (results before meta had nodes)


def test_a_failed_parity_process_stops_its_sibling_at_once():
  """A node's compute-only process that fails ends the round now: its sibling, which would
  wait at the start barrier for it, is killed; codes as the processes gave them."""
  import subprocess
  import sys
  import time
  fail = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
  wait = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  t0 = time.monotonic()
  assert bench.wait_all([fail, wait], 120) == [3, -9]
  assert time.monotonic() - t0 < 30
  ok = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
  assert bench.wait_all(ok, 120) == [0, 0]
  slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  assert bench.wait_all([slow], 0.5) == [-9]


def test_pin_to_core_moves_every_thread_of_the_process():
  """Threads started before the pin (as XLA's executor threads are) are moved too, not only
  the calling thread; threads started after inherit the core."""
  import subprocess
  import sys
  if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("needs 2 cores to tell a pinned thread from an unpinned one")
  script = (
      "import os, threading, time\n"
      "from sparsejax.bench import pin_to_core\n"
      "stop = threading.Event()\n"
      "early = threading.Thread(target=stop.wait); early.start()\n"
      "pin_to_core(1)\n"
      "late = threading.Thread(target=stop.wait); late.start()\n"
      "print(sorted({tuple(sorted(os.sched_getaffinity(int(t))))\n"
      "              for t in os.listdir('/proc/self/task')}))\n"
      "stop.set()\n")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                       check=True, env={**os.environ, "PYTHONPATH": root}).stdout
  core = sorted(os.sched_getaffinity(0))[1]
  assert out.strip() == str([(core,)])


def test_density_per_step_follows_the_warm_up_onto_the_transform_levels():
  config = tta_systems.load_task(CONFIG, ["compression.warmup_epochs=0.1"], "hitopk-0.001")
  dens = tta_systems.density_per_step(config, 200, 60)
  levels = density_levels(0.001, 0.25)
  assert set(dens) <= set(levels)
  assert dens[0] == 0.25  # the warm-up's first steps at the density it asks for
  assert np.all(np.diff(dens) <= 0) and dens[20] == 0.001 and dens[-1] == 0.001
  dense = tta_systems.load_task(CONFIG, [], "dense")
  assert np.all(tta_systems.density_per_step(dense, 200, 7) == 1.0)
  assert tta_systems.level_steps(config, 200, 60)[0] == [float(dens[0]), 0]
  # algorithm auto with its forms fixed by step: the dense form's steps at 1.0, the sparse
  # form's on its warm-up (here none: its final density)
  fixed = tta_systems.load_task(CONFIG, ["compression.warmup_epochs=0.0"], "hitopk-0.05-s60")
  dens = tta_systems.density_per_step(fixed, 457, 90)  # (60 of the Transformer task's 457)
  assert np.all(dens[:60] == 1.0) and np.all(dens[60:] == 0.05)
  assert tta_systems.level_steps(fixed, 457, 90) == [[1.0, 0], [0.05, 60]]


def test_with_progressive_resizing_a_level_is_a_density_at_an_image_size():
  """The CNN task's config: the DGC warm-up's densities within the first stage, then the final
  density at each of the three sizes; the steps to a target counted per (density, size); and
  the time to target from the step time swept at each (density, size)."""
  cnn = os.path.join(os.path.dirname(CONFIG), "tta_fmnist_resnet.py")
  config = tta_systems.load_task(cnn, [], "hitopk-0.001")
  spe, total = 235, 470
  sizes = tta_systems.size_per_step(config, spe, total)
  assert [sizes[0], sizes[219], sizes[-1]] == [20, 24, 28]
  levels = tta_systems.level_steps(config, spe, total)
  assert [lv[2] for lv in levels if lv[0] == 0.001] == [20, 24, 28]
  assert all(lv[2] == 20 for lv in levels if lv[0] != 0.001)  # (the warm-up: the first stage)
  assert [sizes[lv[1]] for lv in levels] == [lv[2] for lv in levels]
  dens = tta_systems.density_per_step(config, spe, total)
  for lv in levels:
    assert dens[lv[1]] == lv[0] and (lv[1] == 0 or (dens[lv[1] - 1], sizes[lv[1] - 1]) != (
        lv[0], lv[2]))
  counted = tta_systems.levels_to(config, spe, total, 300)
  assert sum(n for *_, n in counted) == 300
  assert {(d, size) for d, size, _ in counted} == {
      (float(d), s) for d, s in zip(dens[:300], sizes[:300])}
  dense = tta_systems.load_task(cnn, [], "dense")
  first = -(-spe * 2 * 13 // 28)  # the first step of epoch 2 x 13/28 and on: 219
  assert tta_systems.levels_to(dense, spe, total, 300) == [[1.0, 20, first],
                                                           [1.0, 24, 300 - first]]
  results = {
      "systems": ["dense"], "meta": {"headline": "1gbit"},
      "train": [{"system": "dense", "seed": 0, "levels_to_target": [[1.0, 12, 217],
                                                                    [1.0, 22, 83]],
                 "curve": [{"step": 300, "train_time_s": 40.0, "node0_link_bytes": 5,
                            "accuracy": 0.9}]}],
      "sweep": [{"system": "dense", "bandwidth": "1gbit", "density": 1.0, "size": size,
                 "step_s": t} for size, t in ((12, 0.05), (12, 0.07), (22, 0.2), (22, 0.3))]}
  a = tta_analysis.analyse(results, target=0.85)["dense"]
  assert a["predicted_time_to_target_s"]["1gbit"] == [pytest.approx(217 * 0.06 + 83 * 0.25)]
  # a step of the recipe: each size's median weighted by the recipe's steps at it
  results["meta"]["size_steps"] = {"12": 100, "22": 300}
  assert tta_analysis.recipe_step(results, results["sweep"]) == pytest.approx(
      (100 * 0.06 + 300 * 0.25) / 400)
  del results["meta"]["size_steps"]  # (older results: the median of every row)
  assert tta_analysis.recipe_step(results, results["sweep"]) == pytest.approx(0.135)


def test_analysis_sums_steps_per_level_times_median_step_time():
  results = {
      "systems": ["hitopk-0.01"], "meta": {"headline": "1gbit"},
      "train": [{"system": "hitopk-0.01", "seed": 0,
                 "curve": [{"step": 10, "train_time_s": 1.0, "node0_link_bytes": 5,
                            "accuracy": 0.5},
                           {"step": 20, "train_time_s": 2.2, "node0_link_bytes": 9,
                            "accuracy": 0.9}],
                 "levels_to_target": [[0.04, 5], [0.01, 15]]}],
      "sweep": [{"system": "hitopk-0.01", "bandwidth": "1gbit", "density": d, "step_s": t}
                for d, t in ((0.04, 0.3), (0.04, 0.1), (0.04, 0.2), (0.01, 0.05), (0.01, 0.07),
                             (0.01, 0.06))]}
  a = tta_analysis.analyse(results, target=0.8)["hitopk-0.01"]
  assert a["seeds"][0]["steps_to_target"] == 20
  assert a["seeds"][0]["train_time_to_target_s"] == 2.2
  assert a["predicted_time_to_target_s"]["1gbit"] == [pytest.approx(5 * 0.2 + 15 * 0.06)]
  assert a["measured_over_predicted_at_headline"] == [pytest.approx(2.2 / 1.9)]
  missed = tta_analysis.analyse(results, target=0.95)["hitopk-0.01"]
  assert missed["seeds"][0]["steps_to_target"] is None


def test_the_pytorch_peer_is_the_flax_mlp():
  torch = pytest.importorskip("torch", reason=f"needs PyTorch: {tta_systems.PEERS_INSTALL}")
  model = models.build("mlp", num_classes=10, hidden=(24, 17))
  x = np.random.default_rng(0).standard_normal((6, 28, 28, 1)).astype(np.float32)
  params = model.init(jax.random.key(0), x)["params"]
  peer = torch_mlp(784, (24, 17), 10)
  linears = [m for m in peer if isinstance(m, torch.nn.Linear)]
  assert sum(p.numel() for p in peer.parameters()) == sum(
      v.size for v in jax.tree.leaves(params))
  with torch.no_grad():
    for lin, name in zip(linears, ("hidden_0", "hidden_1", "head")):
      lin.weight.copy_(torch.from_numpy(np.asarray(params[name]["kernel"]).T.copy()))
      lin.bias.copy_(torch.from_numpy(np.asarray(params[name]["bias"])))
    got = peer(torch.from_numpy(x.reshape(6, -1))).numpy()
  np.testing.assert_allclose(got, np.asarray(model.apply({"params": params}, x)), rtol=1e-4,
                             atol=1e-5)
  # the same initialisation: zero biases, kernel std 1/sqrt(fan_in) in both
  big = torch_mlp(1000, (500,), 10)[0]
  assert float(big.bias.detach().abs().max()) == 0.0
  assert abs(float(big.weight.detach().std()) * np.sqrt(1000) - 1.0) < 0.02
  flax_kernel = models.build("mlp", num_classes=10, hidden=(500,)).init(
      jax.random.key(1), np.zeros((1, 1000), np.float32))["params"]["hidden_0"]["kernel"]
  assert abs(float(np.std(np.asarray(flax_kernel))) * np.sqrt(1000) - 1.0) < 0.02


def test_results_of_several_commands_are_analysed_together_and_another_task_is_refused():
  """`--from-results A --from-results B`: B's systems, runs, sweep and parity rounds join A's
  (the parity rounds give the header its exchange / compute ratio), both commands in the footer;
  a file of another task is refused naming the key."""
  meta = {"task": "mlp on digits", "target": 0.8, "target_metric": "accuracy", "command": "a",
          "headline": "1gbit"}
  runs = {"systems": ["dense"], "meta": meta,
          "train": [{"system": "dense", "seed": 0, "curve": [{"accuracy": 0.9}]}],
          "sweep": [{"system": "dense", "bandwidth": "1gbit", "step_s": 0.3}]}
  parity = {"systems": ["dense", "torch-ddp"], "meta": {**meta, "command": "b",
                                                         "headline": "5gbit"},  # (no runs)
            "parity": [{"jax": {"step_s": 0.1}}, {"jax": {"step_s": 0.2}}]}
  more = {"systems": ["hitopk-0.01"], "meta": {**meta, "command": "c"},
          "train": [{"system": "hitopk-0.01", "seed": 0, "curve": [{"accuracy": 0.7}]}]}
  merged = tta.merge_results([runs, parity, more], ["r.json", "p.json", "m.json"])
  assert merged["systems"] == ["dense", "torch-ddp", "hitopk-0.01"]
  assert [r["system"] for r in merged["train"]] == ["dense", "hitopk-0.01"]
  assert len(merged["parity"]) == 2 and merged["meta"]["command"] == "a`, then `b`, then `c"
  assert runs["meta"]["command"] == "a"  # (the inputs are not changed)
  assert tta_analysis.exchange_over_compute(merged) == {"1gbit": pytest.approx(1.0)}
  with pytest.raises(ValueError, match="m.json is another task: its meta target is 0.9"):
    tta.merge_results([runs, {**more, "meta": {**meta, "target": 0.9}}], ["r.json", "m.json"])
  with pytest.raises(ValueError, match="m.json's runs were trained otherwise: its meta "
                     "headline is '10mbit'"):
    tta.merge_results([runs, {**more, "meta": {**meta, "headline": "10mbit"}}],
                      ["r.json", "m.json"])
  with pytest.raises(ValueError, match=r"already in an earlier file: \['dense'\]"):
    tta.merge_results([runs, runs], ["r.json", "r2.json"])


def test_runs_trained_to_the_end_are_analysed_again_at_another_target():
  """`--from-results A --target T`: each run's steps per density level are taken again up to
  its first evaluation at T (the warm-up's levels from the run's config); runs stopped at
  their own target are refused."""
  meta = {"target": 0.8, "target_metric": "accuracy", "command": "a", "config": CONFIG,
          "sets": ["compression.warmup_epochs=0.1"], "stop_at_target": False}
  curve = [{"step": s, "accuracy": a, "train_time_s": s / 10, "node0_link_bytes": s}
           for s, a in ((10, 0.5), (30, 0.81), (70, 0.86), (90, 0.87))]
  row = {"system": "hitopk-0.01", "seed": 0, "steps_per_epoch": 200, "total_steps": 90,
         "curve": curve, "levels_to_target": [[0.01, 30]]}
  results = {"systems": ["hitopk-0.01"], "meta": meta, "train": [row]}
  again = tta.at_target(results, 0.86, "b")
  cfg = tta_systems.load_task(CONFIG, meta["sets"], "hitopk-0.01", 0)
  levels = again["train"][0]["levels_to_target"]
  assert levels == tta.levels_to(cfg, 200, 90, 70) != row["levels_to_target"]
  assert sum(n for *_, n in levels) == 70 and len(levels) > 1  # the warm-up's levels too
  assert again["meta"]["target"] == 0.86 and again["meta"]["command"] == "a`, then `b"
  assert "levels_to_target" not in tta.at_target(results, 0.95, "b")["train"][0]  # not reached
  assert results["meta"]["target"] == 0.8 and row["levels_to_target"] == [[0.01, 30]]
  with pytest.raises(ValueError, match="stopped at their target"):
    tta.at_target({**results, "meta": {**meta, "stop_at_target": True}}, 0.86, "b")


def test_a_loss_target_is_reached_from_above():
  curve = [{"step": 25, "loss": 6.1, "accuracy": 0.1}, {"step": 50, "loss": 4.6, "accuracy": 0.2},
           {"step": 75, "loss": 4.4, "accuracy": 0.25}]
  assert tta_analysis.steps_to_target(curve, 4.55, "loss")["step"] == 75
  assert tta_analysis.steps_to_target(curve, 0.2, "accuracy")["step"] == 50
  assert tta_analysis.steps_to_target(curve, 4.0, "loss") is None
  # results written before the metric was stored
  assert tta_analysis.target_metric({"meta": {}}) == "accuracy"


def test_a_changing_link_run_with_auto_stops_at_the_target(tmp_path):
  """--link-change: the link drops from 200 to 20 Mbit/s before step 7 of the quick recipe, and
  auto (measuring every tenth of an epoch, 2 steps: `auto.schedule`) sees it;
  --stop-at-target: each run ends at its first evaluation at or above the target; no sweep (the
  runs are timed end to end). (auto's run alone: a dense run beside it, which only checked the
  stop again, was ~10 s of CI's budget; the driver's link change and stop are the same for every
  system.)"""
  need_root("study")
  out = tmp_path / "tta.json"
  system = "auto-0.01-mc"
  every = tuple((round(0.1 * i, 1), "measured") for i in range(16))
  assert tta.main(["--quick", "--systems", system, "--phases", "runs",
                   "--set", f"auto.schedule={every!r}",
                   "--link-change", "20mbit@0.2", "--stop-at-target",
                   "--out", str(out)]) == 0
  got = json.loads(out.read_text())
  assert got["sweep"] == [] and got["meta"]["link_change"] == "20mbit@0.2"
  assert [r["system"] for r in got["train"]] == [system]
  target = got["meta"]["target"]
  for run in got["train"]:
    reached = [p["accuracy"] >= target for p in run["curve"]]
    assert not any(reached[:-1])  # it stopped at the first evaluation that reached the target
    assert reached[-1] or run["curve"][-1]["step"] == run["total_steps"]
  auto_run = next(r for r in got["train"] if r["system"] == system)
  choices = auto_run["exchange_choices"]
  assert choices[0]["step"] == 0 and choices[1]["step"] <= 5, choices
  assert choices[0]["link_MBps"] > 5  # --quick trains at 200 Mbit/s (25 MB/s) ...
  after = [c for c in choices if c["step"] >= 7]
  # ... then 20 Mbit/s = 2.5 MB/s: the probes' first reading after the drop, and most fitted
  # links (one may read higher: a step faster than the probed link allows raises the fitted
  # link, which a small exchange inside tc's burst does; CI runs read 7.2 and 5.9 MB/s, each
  # at one of three, the latter raised from the probes' 22.3 Mbit/s)
  raised = re.search(r"the probes' link, ([0-9.e+]+) Mbit/s, raised", after[0]["how"])
  probed = float(raised.group(1)) / 8 if raised else after[0]["link_MBps"]
  assert probed < 5 and statistics.median(c["link_MBps"] for c in after) < 5, after
  md = out.with_suffix(".md").read_text()
  assert "Training at 200mbit, then 20mbit from 20% of the recipe on" in md


def test_link_change_is_checked():
  assert tta_systems.parse_link_change("100mbit@0.33") == (("100mbit", 10**8), 0.33)
  for bad in ("100mbit", "100mbit@1.5", "100mbit@x", "fast@0.5"):
    with pytest.raises(ValueError):
      tta_systems.parse_link_change(bad)


@pytest.mark.parametrize("bad", ["folder", "tta.txt"])
def test_a_results_path_that_is_a_folder_or_not_json_is_refused_before_any_run(
    tmp_path, capsys, bad):
  """--out is checked when the arguments are read, not when a long study writes at its end."""
  (tmp_path / "folder").mkdir()
  with pytest.raises(SystemExit) as exit_:
    tta.main(["--systems", "dense", "--out", str(tmp_path / bad)])
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert "--out" in err and bad in err and "ending in .json" in err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]  # nothing written


def test_a_pipelined_system_trains_on_two_devices_per_node_and_reports_its_overlap(quick):
  """The pipelined exchange on the emulated cluster (each node process two CPU devices, the
  gradient on the second, the parameters and gradient moved between them), in the quick
  study: it trains to the quick target, and the sweep times its halves alone and together."""
  got, out = quick
  run, = [r for r in got["train"] if r["system"] == PIPE]
  assert run["curve"][-1]["accuracy"] >= got["meta"]["target"]
  rows = [r for r in got["sweep"] if r["system"] == PIPE]
  assert rows and all(r["compute_s"] > 0 and r["exchange_s"] > 0 and r["step_s"] > 0
                      and 0 < r["compute_end_s"] and 0 < r["exchange_end_s"] for r in rows)
  # (the unpipelined systems' rows have no halves)
  assert all("compute_s" not in r for r in got["sweep"] if r["system"] != PIPE)
  overlap = tta_analysis.pipeline_overlap(got)[PIPE]
  assert set(overlap) == {"unlimited", "200mbit"}
  assert "The pipelined exchange, one rank" in out.with_suffix(".md").read_text()


def test_hidden_fraction_is_what_the_step_saves_over_the_halves():
  rows = [{"system": "s-pipe", "seed": 0, "bandwidth": "b", "density": d, "step_s": 0.30,
           "compute_s": 0.10, "exchange_s": 0.25, "compute_end_s": 0.11,
           "exchange_end_s": 0.29} for d in (0.25, 0.01)]
  rows.append({"system": "s", "seed": 0, "bandwidth": "b", "density": 0.01, "step_s": 0.36})
  got = tta_analysis.pipeline_overlap({"sweep": rows})
  cell = got["s-pipe"]["b"]  # the final density only
  assert cell["hidden"] == [pytest.approx((0.10 + 0.25 - 0.30) / 0.25)]
  assert cell["serial_s"] == [0.36]


def test_a_pipelined_system_is_paired_with_its_unpipelined_twin():
  assert tta_analysis.unpipelined("dense-pipe") == "dense"
  assert tta_analysis.unpipelined("hitopk-0.05-w0.5-pipe-p") == "hitopk-0.05-w0.5"
  assert tta_analysis.unpipelined("dense-pipe-p+optimizer.b1=0.8") == "dense+optimizer.b1=0.8"
  assert tta_analysis.unpipelined("dense-pipe-l+optimizer.b1=0.8") == "dense+optimizer.b1=0.8"
  assert tta_analysis.unpipelined("hitopk-0.05-pipe-l") == "hitopk-0.05"
  assert tta_analysis.unpipelined("dense-pipe-f0.25") == "dense"


def test_both_runners_train_a_resnet_through_its_resize_stages_and_evaluate_at_the_last_size():
  """The CNN task's path on digits (8 x 8): the trainer's `Run` compiles a step per (density
  level, image size) before the clock, and it and the PyTorch peer train each step at its
  epoch's size and evaluate at the size of the last step taken; the sweep's step (`step_at`)
  holds a level's size."""
  pytest.importorskip("torch", reason=f"needs PyTorch: {tta_systems.PEERS_INSTALL}")
  from sparsejax.train import Run
  from sparsejax.train.config import default_config, validate
  from studies.time_to_accuracy.torch_peer import TorchRun
  config = default_config()
  config.model.name, config.model.num_filters = "resnet20", 4
  config.data.name, config.data.resize_schedule = "digits", ((0, 6), (0.1, 8))
  config.batch_size, config.num_epochs, config.label_smoothing = 32, 0.2, 0.1
  config.optimizer.name, config.optimizer.learning_rate = "lars", 2.0
  config.mesh.nodes, config.mesh.local = 1, 8  # (the test process's 8 CPU devices)
  validate(config)
  jax_run, torch_run = Run(config), TorchRun(config, 0, 1, False, distributed=False)
  jax_run.compile()
  sizes = [jax_run.plan.image_size(s) for s in range(jax_run.plan.total_steps)]
  assert jax_run.plan.total_steps == 9 and sizes == [6] * 5 + [8] * 4 == torch_run.sizes
  jax_run.step_at(7, 2)  # (the sweep: batch 7 at step 2's size)
  torch_run.step_at(7, 2)
  assert torch_run.size == 6
  for step in range(9):
    jax_run.step(step)
    jax_run.wait()
    torch_run.step(step)
    assert torch_run.size == sizes[step]
  for metrics in (jax_run.evaluate(), torch_run.evaluate()):
    assert 0.0 <= metrics["accuracy"] <= 1.0 and np.isfinite(metrics["loss"])
  assert jax_run.size == torch_run.size == 8


def test_factors_early_progress_and_beside_auto_by_hand():
  """`factors.early_progress`: F and the steps the sparse run took to reach dense's accuracy at
  half dense's steps to target; `trained_beside`: F from an end-to-end auto result's fixed runs,
  seed by seed; each worked out by hand on made-up curves."""
  from studies.time_to_accuracy import factors
  dense = [{"step": s, "accuracy": a} for s, a in [(10, 0.5), (20, 0.7), (30, 0.8), (40, 0.9)]]
  sparse = [{"step": s, "accuracy": a} for s, a in [(10, 0.4), (20, 0.6), (30, 0.75), (40, 0.8),
                                                    (50, 0.85), (60, 0.91)]]
  results = {"meta": {"target": 0.9, "target_metric": "accuracy"},
             "train": [{"system": "dense", "seed": 0, "curve": dense},
                       {"system": "hitopk-0.01", "seed": 0, "curve": sparse},
                       {"system": "torch-ddp", "seed": 0, "curve": dense}]}
  # dense reaches 0.9 at 40; half of it, 20, reads 0.7; sparse reaches 0.7 at 30 and 0.9 at 60
  assert factors.early_progress(results) == [("hitopk-0.01", 60 / 40, 30 / 20)]
  assert factors.factors(results) == {"hitopk-0.01": [1.5]}
  beside = {"fixed_runs": {"unlimited": {
      "dense": [{"seed": 0, "steps": 200}, {"seed": 1, "steps": 250}],
      "hitopk-0.05": [{"seed": 0, "steps": 250}, {"seed": 1, "steps": 225}]},
      "50mbit": {"hitopk-0.05": [{"seed": 0, "steps": 275}]}}}
  assert factors.trained_beside(beside) == {"hitopk-0.05 @ unlimited": [1.25, 0.9]}
