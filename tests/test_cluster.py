"""Multi-process runs on jax.distributed: the launcher, the emulated cluster (network namespaces,
veths, tc), faults, and equality with a single process. The emulation needs root (CI is root)."""

from __future__ import annotations

import csv
import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from sparsejax import cli, cluster
from sparsejax.bench import running
from tests.conftest import need_root

# end to end (the emulated cluster, the studies, whole recipes): `python -m pytest -m integration`
pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
TOKEN = "SPARSEJAX_TEST_TOKEN"  # in the environment of one test's launched processes


def _env():
  """The test process's environment without its 8-device XLA flag (the CLI and the launcher
  choose the device count themselves)."""
  return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _namespaces_left(launch_output: str) -> list[str]:
  """The namespaces still there of the cluster a launch built (its prefix is in its output;
  other tests' clusters, running beside this one under xdist, are not this test's concern)."""
  found = re.search(r"sparsejax launch: emulated cluster (\w+): ", launch_output)
  assert found, launch_output[-3000:]
  return cluster.EmulatedCluster.leftovers(found.group(1) + "-")


def read_losses(path):
  with open(path, newline="") as f:
    return np.asarray([float(r["loss"]) for r in csv.DictReader(f)])


# ----------------------------------------------------------------------------- arguments

@pytest.mark.parametrize("text, bps", [("1gbit", 10**9), ("200mbit", 2 * 10**8),
                                       ("25Gbit/s", 25 * 10**9), ("100MB/s", 8 * 10**8),
                                       ("500000", 500000)])
def test_parse_rate(text, bps):
  assert cluster.parse_rate(text) == bps


@pytest.mark.parametrize("argv, match", [
    (["--nodes", "0", "--", "info"], "--nodes must be an integer >= 1, got 0"),
    (["--nodes", "2", "--procs-per-node", "-1", "--", "info"], "--procs-per-node must be"),
    (["--nodes", "2", "--bandwidth", "fast", "--", "info"], "bandwidth 'fast' does not parse"),
    (["--nodes", "2"], "nothing to launch"),
    (["--nodes", "3:2", "--", "info"], "--nodes '3:2' is not allowed: give N or MIN:MAX, "
                                       "integers with 1 <= MIN <= MAX (e.g. 4 or 2:4)"),
    (["--nodes", "0:2", "--", "info"], "--nodes '0:2' is not allowed: give N or MIN:MAX"),
    (["--nodes", "a:b", "--", "info"], "--nodes 'a:b' does not parse: give N or MIN:MAX"),
    (["--nodes", "2", "--max-restarts", "-1", "--", "info"], "--max-restarts must be"),
    (["--nodes", "2", "--heartbeat-timeout", "-2", "--", "info"], "--heartbeat-timeout must"),
])
def test_launch_refuses_bad_arguments(argv, match, capsys):
  assert cli.main(["launch", *argv]) == 2
  assert match in capsys.readouterr().err


@pytest.mark.parametrize("spec, nodes", [("4", (4, 4)), ("2:4", (2, 4)), ("3:3", (3, 3))])
def test_parse_nodes(spec, nodes):
  assert cluster.parse_nodes(spec) == nodes


def test_unreachable_coordinator_is_an_error_within_the_timeout():
  with socket.socket() as s:  # a port on loopback where nobody listens
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(_env(), **{cluster.ENV["coordinator"]: f"127.0.0.1:{port}",
                        cluster.ENV["num_processes"]: "2", cluster.ENV["process_id"]: "1",
                        cluster.ENV["timeout"]: "5"})
  t0 = time.monotonic()
  out = subprocess.run([sys.executable, "-m", "sparsejax.cli", "info", "--distributed"], env=env,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 4 and "cannot start jax.distributed" in out.stderr
  assert time.monotonic() - t0 < 90


# ----------------------------------------------------------------------------- emulated cluster

def test_emulated_cluster_limits_links_and_leaves_nothing_behind():
  need_root("tests")
  with cluster.EmulatedCluster(2, cluster.parse_rate("200mbit")) as c:
    prefix = c.prefix
    assert sorted(cluster.EmulatedCluster.leftovers(prefix + "-")) == sorted(
        [c.bridge_ns, c.ns(0), c.ns(1)])
    qdisc = subprocess.run(c.exec_prefix(1) + ["tc", "qdisc", "show", "dev", "eth0"],
                           capture_output=True, text=True).stdout
    assert "tbf" in qdisc and "200Mbit" in qdisc
    # node 0 reaches node 1 over the emulated link (a TCP connection between the namespaces)
    addr = c.address(1)
    server = subprocess.Popen(c.exec_prefix(1) + [sys.executable, "-c", (
        f"import socket; s = socket.create_server(('{addr}', 29500)); s.settimeout(20); "
        "c, _ = s.accept(); c.sendall(b'hello from node 1')")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    client = subprocess.run(c.exec_prefix(0) + [sys.executable, "-c", (
        "import socket, time\nfor _ in range(100):\n  try:\n"
        f"    s = socket.create_connection(('{addr}', 29500), timeout=2); break\n"
        "  except OSError: time.sleep(0.1)\nprint(s.recv(100).decode())")],
        capture_output=True, text=True, timeout=60)
    server.wait(30)
    assert client.stdout.strip() == "hello from node 1", client.stderr
  assert cluster.EmulatedCluster.leftovers(prefix) == []


def test_rate_changes_in_place_and_a_killed_owner_leaves_nothing_behind():
  need_root("tests")
  program = ("import sys, time\nfrom sparsejax import cluster\n"
             "with cluster.EmulatedCluster(2, 10**9) as c:\n"
             "  c.set_rate(None)\n  print(c.prefix, flush=True)\n"
             "  c.set_rate(300 * 10**6)\n  print('limited', flush=True)\n  time.sleep(600)\n")
  owner = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
  prefix = owner.stdout.readline().strip()
  assert prefix.startswith("sjx"), prefix
  assert owner.stdout.readline().strip() == "limited"
  for ns, dev in ((f"{prefix}-n1", "eth0"), (f"{prefix}-br", "p0")):
    qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True,
                           text=True).stdout
    assert "tbf" in qdisc and "300Mbit" in qdisc, qdisc
  # a process started inside a node's namespace goes with it
  sleeper = subprocess.Popen(["ip", "netns", "exec", f"{prefix}-n0", "sleep", "600"])
  owner.kill()  # SIGKILL: no Python clean-up runs; the watchdog removes the cluster
  owner.wait()
  deadline = time.monotonic() + 20
  while cluster.EmulatedCluster.leftovers(prefix) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert cluster.EmulatedCluster.leftovers(prefix) == []
  assert sleeper.wait(20) != 0


def test_launch_in_an_emulated_cluster_all_reduces_across_nodes():
  need_root("tests")
  out = io.StringIO()
  rc = cluster.launch(["info", "--distributed"], nodes=2, procs_per_node=2, devices_per_proc=2,
                      bandwidth="1gbit", init_timeout_s=60, out=out)
  text = out.getvalue()
  assert rc == 0, text[-3000:]
  for rank in range(4):  # every process saw all 8 devices of the 4 processes: 2*(1+2+3+4)
    assert f"[{rank}] all-reduce over 8 devices of 4 processes: 20 (expected 20)" in text
  assert _namespaces_left(text) == []


GLOO_IDLE_WORKER = """
import os, sys
rank = int(os.environ["SPARSEJAX_PROCESS_ID"])
if rank == 0:  # pinned to one core; rank 1 keeps every core it was given
  os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
from sparsejax import cluster
cluster.initialize()
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((jax.device_count(),), ("all",))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("all")),
                                           jnp.full(jax.local_device_count(), rank + 1.0))
total = float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x))
idle = sum(os.sched_getscheduler(int(t)) == os.SCHED_IDLE for t in os.listdir("/proc/self/task"))
print(f"rank {rank} cores {len(os.sched_getaffinity(0))} sum {total:g} idle threads {idle}")
if rank == 1:  # a process pinned (or not) after XLA started yields them on request
  n = cluster.yield_gloo_threads()
  idle = sum(os.sched_getscheduler(int(t)) == os.SCHED_IDLE
             for t in os.listdir("/proc/self/task"))
  print(f"rank 1 yielded {n} idle threads {idle}")
"""


def test_gloo_poller_yields_on_a_process_pinned_to_one_core(tmp_path):
  """On a process pinned to one core, gloo's TCP loop thread (it polls through a collective and
  held the core for a scheduler tick, ~4 ms, per collective) runs in SCHED_IDLE; a process with
  more than one core is left as it is, until it asks (`yield_gloo_threads`). The all-reduce
  still adds up."""
  need_root("tests")
  if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("needs 2 cores (one process pinned, one not): run on 2 or more, e.g. "
                "taskset -c 0,1 python -m pytest -q")
  script = tmp_path / "worker.py"
  script.write_text(GLOO_IDLE_WORKER)
  out = io.StringIO()
  rc = cluster.launch(["--unused"], nodes=2, procs_per_node=1, devices_per_proc=1,
                      bandwidth="10gbit", init_timeout_s=60, out=out,
                      program=[sys.executable, str(script)])
  text = out.getvalue()
  assert rc == 0, text[-3000:]
  pinned = re.search(r"rank 0 cores 1 sum 3 idle threads (\d+)", text)
  free = re.search(r"rank 1 cores \d+ sum 3 idle threads (\d+)", text)
  assert pinned and free, text[-3000:]
  assert int(pinned.group(1)) >= 1
  assert int(free.group(1)) == 0
  asked = re.search(r"rank 1 yielded (\d+) idle threads (\d+)", text)
  assert asked and int(asked.group(1)) >= 1 and int(asked.group(2)) == int(asked.group(1))
  assert _namespaces_left(text) == []


@pytest.mark.parametrize("procs_per_node, victim, how, lost_grace_s", [
    # rank 3 of node 1: the others abort by themselves (JAX's heartbeat, 3 s)
    (2, 3, signal.SIGKILL, 10.0),
    # the coordinator: the others abort at once (its socket closes), else the launcher stops them
    (1, 0, signal.SIGKILL, 2.0),
    # a hung coordinator (it does not exit): the others' heartbeats fail within 3 s
    (1, 0, signal.SIGSTOP, 2.0),
], ids=["node1-rank3-killed", "coordinator-killed", "coordinator-hung"])
def test_a_lost_process_stops_the_others_and_the_cluster_is_removed(procs_per_node, victim, how,
                                                                    lost_grace_s):
  """A killed (or hung) rank is reported with its node, and every process is gone within 5 s."""
  need_root("tests")
  out, result, token = io.StringIO(), {}, uuid.uuid4().hex
  world = 2 * procs_per_node
  argv = ["info", "--distributed", "--repeat", "100000"]
  worker = threading.Thread(target=lambda: result.update(rc=cluster.launch(
      argv, nodes=2, procs_per_node=procs_per_node, devices_per_proc=1, bandwidth="1gbit",
      init_timeout_s=60, lost_grace_s=lost_grace_s, out=out, extra_env={TOKEN: token})))
  worker.start()
  deadline = time.monotonic() + 120
  while (sum(f"[{r}] all-reduce over" in out.getvalue() for r in range(world)) < world
         and time.monotonic() < deadline):
    time.sleep(0.2)
  assert f"[{world - 1}] all-reduce over" in out.getvalue(), out.getvalue()[-3000:]
  pids = {rank: _launched_pid(rank, token) for rank in range(world)}
  t0 = time.monotonic()
  os.kill(pids[victim], how)
  while any(running(pid) for pid in pids.values()) and time.monotonic() - t0 < 30:
    time.sleep(0.05)
  gone_s = time.monotonic() - t0
  worker.join(60)
  text = out.getvalue()
  assert not worker.is_alive()
  assert gone_s < 5 + 2, (gone_s, text[-3000:])  # 5 s, and a margin for 2 busy cores
  node = victim // procs_per_node
  what = "killed by SIGKILL" if how == signal.SIGKILL else "silent: it stopped sending heartbeats"
  assert re.search(rf"lost node {node} \(rank {victim}, {what}.*\) at [\d.]+ s after "
                   r"launch \(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\)", text), text[-3000:]
  assert result["rc"] == (128 + signal.SIGKILL if how == signal.SIGKILL else 1)
  assert f"lost rank {victim}" in text
  if lost_grace_s > 5:  # nobody needed the launcher's SIGKILL: they noticed by themselves
    assert "SIGKILL after the 10 s grace: none" in text, text[-3000:]
  assert _namespaces_left(text) == []


def _launched_pid(rank: int, token: str) -> int:
  """The pid of this test's launched process of `rank` (its environment names the rank and
  `token`, which the test passed to `launch`: in CI's two workers another test's processes run
  beside it, and a lookup by command alone once killed another test's rank)."""
  me = os.getpid()
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        env = f.read().split(b"\0")
    except OSError:
      continue
    mine = f"{TOKEN}={token}".encode() in env
    if f"{cluster.ENV['process_id']}={rank}".encode() in env and mine and int(pid) != me:
      return int(pid)
  raise AssertionError(f"no launched process of rank {rank}")


# ----------------------------------------------------------------------------- elastic launch

ELASTIC_WORKER = """
import os, time
from sparsejax import cluster
cluster.initialize()
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((jax.device_count(),), ("all",))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("all")),
                                           np.ones(jax.local_device_count(), np.float32))
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
restart = int(os.environ[cluster.ENV["restart"]])
print(f"world {jax.process_count()} sum {float(total(x)):g} restart {restart}", flush=True)
for _ in range(3000 if restart == 0 else 3):  # the first start runs until a node is killed
  jax.block_until_ready(total(x))
  time.sleep(0.01)
"""


def test_an_elastic_launch_goes_on_without_a_lost_node(tmp_path):
  """--nodes 2:3: the coordinator's node is killed; the job starts again on the 2 nodes left
  (the coordinator on one of them) and ends 0."""
  need_root("tests")
  script = tmp_path / "worker.py"
  script.write_text(ELASTIC_WORKER)
  out, result, token = io.StringIO(), {}, uuid.uuid4().hex
  worker = threading.Thread(target=lambda: result.update(rc=cluster.launch(
      ["--unused"], nodes=3, min_nodes=2, procs_per_node=1, bandwidth="1gbit",
      init_timeout_s=60, out=out, program=[sys.executable, str(script)],
      extra_env={TOKEN: token})))
  worker.start()
  deadline = time.monotonic() + 120
  while out.getvalue().count("world 3 sum 3 restart 0") < 3 and time.monotonic() < deadline:
    time.sleep(0.2)
  os.kill(_launched_pid(0, token), signal.SIGKILL)
  worker.join(120)
  text = out.getvalue()
  assert not worker.is_alive() and result["rc"] == 0, text[-3000:]
  assert ("restart 1 (of at most 3): lost node 0; starting again on the 2 remaining nodes "
          "[1, 2]") in text
  after = text.split("restart 1 (of at most 3)")[1]
  assert "[0] world 2 sum 2 restart 1" in after and "[1] world 2 sum 2 restart 1" in after
  assert "[2] " not in after
  assert _namespaces_left(text) == []


def test_a_restarted_train_is_told_the_node_count():
  job = cluster._Job(["train", "c.py", "--set", "seed=1"], None, procs_per_node=2,
                     devices_per_proc=4, init_timeout_s=60, heartbeat_timeout_s=3, grace_s=20,
                     lost_grace_s=2, cluster=None, extra_env=None)
  assert job.command(3, restart=0)[-4:] == ["train", "c.py", "--set", "seed=1"]
  assert job.command(3, restart=1)[-10:] == [
      "train", "c.py", "--set", "seed=1", "--set", "mesh.nodes=3", "--set", "mesh.local=8",
      "--set", "mesh.num_devices=24"]


LOSING_WORKER = """
import os, signal, sys, time
node, restart = int(os.environ["SPARSEJAX_NODE"]), int(os.environ["SPARSEJAX_RESTART"])
print(f"world {os.environ['SPARSEJAX_NUM_PROCESSES']} restart {restart}", flush=True)
if node == 1:  # the job's node 1 is lost at every start
  os.kill(os.getpid(), signal.SIGKILL)
time.sleep(30)
"""


@pytest.mark.parametrize("nodes, min_nodes, max_restarts, message", [
    (3, 2, 3, "giving up: lost node 2, 1 node(s) remain, fewer than the minimum of 2 "
              "(--nodes 2:3)"),
    (4, 1, 1, "giving up: lost node 2 after 1 restart(s), the most allowed (--max-restarts 1)"),
])
def test_an_elastic_launch_gives_up_clearly(tmp_path, nodes, min_nodes, max_restarts, message):
  """Fewer than MIN nodes left, or too many restarts: a non-zero exit and a message saying why
  (plain processes: a node here is a label, no JAX, no root)."""
  script = tmp_path / "worker.py"
  script.write_text(LOSING_WORKER)
  out = io.StringIO()
  rc = cluster.launch(["--unused"], nodes=nodes, min_nodes=min_nodes, procs_per_node=1,
                      max_restarts=max_restarts, out=out, program=[sys.executable, str(script)])
  text = out.getvalue()
  assert rc == 128 + signal.SIGKILL, text
  assert "restart 1 (of at most" in text and "lost node 1 (rank 1, killed by SIGKILL)" in text
  assert message in text, text


# ----------------------------------------------------------------------------- training

def test_more_processes_than_the_mesh_allows_fails_clearly(tmp_path):
  out = io.StringIO()
  rc = cluster.launch(["train", QUICKSTART, "--workdir", str(tmp_path / "unused-run"),
                       "--no-progress"], nodes=3, procs_per_node=1, devices_per_proc=4,
                      init_timeout_s=60, out=out)
  assert rc != 0
  assert "does not match the 12 devices" in out.getvalue()


def test_quickstart_as_two_nodes_of_four_devices_equals_one_process_of_eight(tmp_path):
  """2 processes x 4 devices (jax.distributed, gloo) vs the CLI in one process that creates its
  own 8 CPU devices: the same loss trajectory to rtol 1e-5. (The quickstart's recipe, HiTopKComm
  over the node axis, with a small MLP for its ResNet-20: compiling ResNet-20 in three processes
  took ~60 s of this test's ~70 on CI's 2 cores; the processes' data split, the mesh and the
  exchange are the same for any model. ResNet-20 trains on the 2 x 4 mesh in test_train's full
  run and its resume, ResNet-50's stages in test_dawnbench.)"""
  overrides = ["--set", "num_epochs=0.5", "--set", "log_every_steps=1", "--no-progress",
               "--set", "model.name=mlp", "--set", "model.hidden=(128,)"]
  out = io.StringIO()
  rc = cluster.launch(["train", QUICKSTART, "--workdir", str(tmp_path / "multi"), *overrides],
                      nodes=2, procs_per_node=1, devices_per_proc=4, init_timeout_s=120, out=out)
  assert rc == 0, out.getvalue()[-3000:]
  single = subprocess.run([sys.executable, "-m", "sparsejax.cli", "train", QUICKSTART,
                           "--workdir", str(tmp_path / "single"), *overrides], env=_env(),
                          capture_output=True, text=True, timeout=600)
  assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
  assert "[0] final accuracy" in out.getvalue() and "[1] final accuracy" not in out.getvalue()
  a = read_losses(tmp_path / "single" / "train.csv")
  b = read_losses(tmp_path / "multi" / "train.csv")
  assert len(a) == len(b) == 6
  np.testing.assert_allclose(b, a, rtol=1e-5)
  assert not os.path.exists(tmp_path / "multi" / "train.csv.tmp")
  bad = subprocess.run([sys.executable, "-m", "sparsejax.cli", "train", QUICKSTART, "--set",
                        "optimizer.learning_rte=1"], env=_env(), capture_output=True, text=True,
                       timeout=120)
  assert bad.returncode == 2 and "did you mean" in bad.stderr


@pytest.mark.slow  # ~3 minutes on 2 cores: three launches of the quickstart
def test_killed_run_resumes_from_its_last_checkpoint_in_an_emulated_cluster(tmp_path):
  need_root("tests")
  overrides = ["--set", "num_epochs=2", "--set", "log_every_steps=1", "--set",
               "checkpoint_every_steps=5", "--no-progress"]
  out = io.StringIO()
  assert cluster.launch(["train", QUICKSTART, "--workdir", str(tmp_path / "full"), *overrides],
                        nodes=2, procs_per_node=1, devices_per_proc=4, bandwidth="1gbit",
                        out=out) == 0, out.getvalue()[-3000:]
  out = io.StringIO()
  result, token = {}, uuid.uuid4().hex  # (the victim is this run's: another test's CLI runs too)
  worker = threading.Thread(target=lambda: result.update(rc=cluster.launch(
      ["train", QUICKSTART, "--workdir", str(tmp_path / "killed"), *overrides], nodes=2,
      procs_per_node=1, devices_per_proc=4, bandwidth="1gbit", grace_s=10, out=out,
      extra_env={TOKEN: token})))
  worker.start()
  ckpt = tmp_path / "killed" / "checkpoints" / "10"
  deadline = time.monotonic() + 300
  while not ckpt.exists() and time.monotonic() < deadline:
    time.sleep(0.2)
  time.sleep(1.0)
  os.kill(_launched_pid(rank=1, token=token), signal.SIGKILL)
  worker.join(120)
  assert result["rc"] != 0 and "lost rank 1" in out.getvalue()
  killed_run, out = out.getvalue(), io.StringIO()
  assert cluster.launch(["train", QUICKSTART, "--workdir", str(tmp_path / "killed"), *overrides],
                        nodes=2, procs_per_node=1, devices_per_proc=4, bandwidth="1gbit",
                        out=out) == 0, out.getvalue()[-3000:]
  np.testing.assert_allclose(read_losses(tmp_path / "killed" / "train.csv"),
                             read_losses(tmp_path / "full" / "train.csv"), rtol=1e-5)
  assert _namespaces_left(killed_run) == [] and _namespaces_left(out.getvalue()) == []
