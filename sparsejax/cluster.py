"""Multi-process runs: `jax.distributed` start-up, and a local launcher with an emulated cluster.

In each process (the launcher sets the environment; SLURM and Open MPI are detected by JAX):

  cluster.initialize()            # before any other JAX call

`sparsejax launch --nodes N --procs-per-node P [--devices-per-proc D] [--bandwidth RATE] -- train
CONFIG ...` runs N*P processes on this machine (`launch`). With a bandwidth it first builds an
emulated cloud cluster (`EmulatedCluster`): a network namespace per node, joined to a bridge by a
veth whose both ends are limited with `tc tbf` (no netem here: no added delay); processes of one
node share its namespace, so their traffic stays on its loopback (the fast intra-node link).
Everything it creates carries a per-run prefix and is removed again, on success, failure and
Ctrl-C. Processes are started with argument lists (never a shell).

A lost process (killed, failed, or silent: JAX's heartbeat timeout) is named with its node,
rank and time, and the others are stopped within seconds; `--nodes MIN:MAX` starts the job
again on the nodes left while at least MIN remain (`--max-restarts`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

__all__ = ["ENV", "initialize", "bind_gloo", "yield_gloo_threads", "parse_rate", "parse_nodes",
           "EmulatedCluster", "set_link_rate", "link_sent_bytes", "qdisc_sent_bytes", "launch"]

# The launcher's environment for each process.
ENV = {"coordinator": "SPARSEJAX_COORDINATOR", "num_processes": "SPARSEJAX_NUM_PROCESSES",
       "process_id": "SPARSEJAX_PROCESS_ID", "devices": "SPARSEJAX_DEVICES_PER_PROCESS",
       "host": "SPARSEJAX_GLOO_HOST", "timeout": "SPARSEJAX_INIT_TIMEOUT_S",
       "node": "SPARSEJAX_NODE", "local_rank": "SPARSEJAX_LOCAL_RANK",
       "heartbeat": "SPARSEJAX_HEARTBEAT_TIMEOUT_S", "restart": "SPARSEJAX_RESTART"}
# jax versions the gloo binding (private JAX API) was checked with.
GLOO_BINDING_CHECKED = ("0.10.2",)


def bind_gloo(hostname: str) -> None:
  """Makes JAX's CPU backend build its gloo collectives bound to `hostname` (this node's address)
  instead of the machine's hostname, which resolves to 127.0.0.1 and is unreachable from other
  network namespaces. Private JAX API (checked with jax GLOO_BINDING_CHECKED): the one workaround,
  kept here. Call before the CPU backend starts."""
  from jax._src import distributed
  from jax._src import xla_bridge as xb
  from jax._src.lib import _jax

  def factory():
    before = _thread_ids()
    collectives = _jax.make_gloo_tcp_collectives(
        distributed_client=distributed.global_state.client, hostname=hostname)
    _GLOO_THREADS.update(_thread_ids() - before)
    if len(os.sched_getaffinity(0)) == 1:
      _yield_threads(_GLOO_THREADS)
    return xb.make_cpu_client(collectives=collectives)

  xb.register_backend_factory("cpu", factory, priority=0, fail_quietly=False)


_GLOO_THREADS: set[int] = set()  # the threads gloo's TCP collectives started (bind_gloo)


def yield_gloo_threads() -> int:
  """Puts the threads this process's gloo collectives started in SCHED_IDLE, as `bind_gloo`
  does where the process is on one core when XLA starts: for a process pinned after that
  (measured with the Transformer LM's dense step: docs/overlap.md; the study does not call it,
  whether it helps a whole step there is open). Returns how many threads (0 before the
  CPU backend starts, or where `bind_gloo` did not build the collectives)."""
  _yield_threads(_GLOO_THREADS)
  return len(_GLOO_THREADS)


def _thread_ids() -> set[int]:
  """Ids of this process's threads (Linux)."""
  return {int(t) for t in os.listdir("/proc/self/task")}


def _yield_threads(tids: set[int]) -> None:
  """Puts `tids` in SCHED_IDLE: they run only when nothing else of this process wants the core.

  For gloo's TCP loop thread on a process pinned to one core: during a collective it polls
  without sleeping, and the thread that executes the XLA program (woken when the peer's data has
  arrived) then waits for the scheduler's next tick, about 4 ms, before it gets the core back:
  every collective, however small, took 4 ms here instead of 0.35 ms."""
  for tid in tids:
    try:
      os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError:  # the thread has ended
      pass


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, devices_per_process: int | None = None,
               gloo_host: str | None = None, timeout_s: int | None = None,
               heartbeat_timeout_s: int | None = None) -> bool:
  """Starts `jax.distributed` from the arguments, else from the launcher's environment (ENV),
  else from what JAX detects (SLURM, Open MPI). On CPUs: gloo collectives and
  `devices_per_process` virtual devices. `heartbeat_timeout_s`: a process that sends no
  heartbeat for that long is dead to the coordination service, and every other process then
  aborts (JAX's default, 100 s, where neither the argument nor ENV["heartbeat"] gives one).
  Returns False (and does nothing) for a single process. Must run before any other JAX call."""
  import jax
  env = os.environ
  coordinator = coordinator or env.get(ENV["coordinator"])
  if num_processes is None and env.get(ENV["num_processes"]):
    num_processes = int(env[ENV["num_processes"]])
  if process_id is None and env.get(ENV["process_id"]):
    process_id = int(env[ENV["process_id"]])
  if devices_per_process is None and env.get(ENV["devices"]):
    devices_per_process = int(env[ENV["devices"]])
  gloo_host = gloo_host or env.get(ENV["host"])
  if timeout_s is None:
    timeout_s = int(env.get(ENV["timeout"], "300"))
  if heartbeat_timeout_s is None and env.get(ENV["heartbeat"]):
    heartbeat_timeout_s = int(env[ENV["heartbeat"]])
  detected = any(k in env for k in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"))
  if coordinator is None and not detected:
    return False
  if num_processes == 1:
    return False
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if devices_per_process:
    jax.config.update("jax_num_cpu_devices", devices_per_process)
  if gloo_host:
    bind_gloo(gloo_host)
  if coordinator and process_id not in (None, 0):
    _wait_for(coordinator, timeout_s)
  heartbeat = {} if heartbeat_timeout_s is None else {
      "heartbeat_timeout_seconds": heartbeat_timeout_s}
  jax.distributed.initialize(coordinator, num_processes, process_id,
                             initialization_timeout=timeout_s, **heartbeat)
  _connect_all()
  return True


def _connect_all() -> None:
  """One tiny all-reduce over every device, right after start-up while the processes are in step:
  XLA's CPU backend builds its gloo context for a device set at the first collective and gives
  up after 30 s, which a process still compiling a large program can miss; the context is then
  cached for the training step's collectives over the same devices."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((jax.device_count(),), ("all",))
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("all")),
                                             np.ones(jax.local_device_count(), np.float32))
  jax.block_until_ready(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x))


def _wait_for(address: str, timeout_s: float) -> None:
  """Waits until the coordinator accepts TCP connections; a ConnectionError naming it after
  `timeout_s` (JAX itself aborts the process, with no Python error, when it cannot connect)."""
  import socket
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"coordinator address {address!r} must be HOST:PORT")
  deadline = time.monotonic() + timeout_s
  last: Exception | None = None
  while time.monotonic() < deadline:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
        return
    except OSError as e:
      last = e
      time.sleep(0.25)
  raise ConnectionError(f"the coordinator {address} did not answer within {timeout_s:g} s "
                        f"({last}); is process 0 running and reachable from here?")


_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(bit|Bit|bps|B|Bps)?(/s)?\s*$")


def parse_rate(text: str) -> int:
  """A bandwidth -> bits per second: "1gbit", "200Mbit", "25gbit/s", "100MB/s" (bytes), or a
  plain number of bits per second."""
  m = _RATE.match(str(text))
  if not m or (m.group(4) and not m.group(3)):
    raise ValueError(f"bandwidth {text!r} does not parse; use e.g. 1gbit, 200mbit, 25gbit/s, "
                     "100MB/s")
  value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2).lower()]
  if m.group(3) in ("B", "Bps"):
    value *= 8
  if value < 8000:
    raise ValueError(f"bandwidth {text!r} is below 8 kbit/s")
  return int(value)


def _run(*cmd: str) -> None:
  res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
  if res.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip() or res.stdout.strip()}")


def set_link_rate(prefix: str, nodes: int, rate_bps: int | None,
                  burst_bytes: int = 16 * 1024, queue_s: float = 0.4) -> None:
  """Sets the tc limit of both ends of each node's veth in the cluster named `prefix` (see
  `EmulatedCluster`) to `rate_bps` (None: removes the limit), queueing at most `queue_s` of
  traffic at that rate before dropping. Root only."""
  if not 0.001 <= queue_s <= 10:
    raise ValueError(f"queue_s must be in [0.001, 10] seconds, got {queue_s}")
  for i in range(nodes):
    for ns, dev in ((f"{prefix}-n{i}", "eth0"), (f"{prefix}-br", f"p{i}")):  # both directions
      if rate_bps is None:
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True,
                       timeout=30)  # fails harmlessly when there is no limit
      else:
        _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
             f"{int(rate_bps)}bit", "burst", str(burst_bytes), "latency",
             f"{round(queue_s * 1000)}ms")


def link_sent_bytes(dev: str = "eth0") -> int:
  """Bytes sent so far through `dev` of this process's network namespace (headers included)."""
  out = subprocess.run(["ip", "-s", "-j", "link", "show", "dev", dev], capture_output=True,
                       text=True, timeout=30)
  if out.returncode != 0:
    raise RuntimeError(f"ip link show {dev} failed: {out.stderr.strip()}")
  import json
  return int(json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"])


def qdisc_sent_bytes(dev: str = "eth0") -> int:
  """Bytes sent so far through the root qdisc of `dev` in this process's network namespace (the
  tc shaper's own count; `link_sent_bytes` reads the device's)."""
  out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", dev], capture_output=True,
                       text=True, timeout=30).stdout
  for line in out.splitlines():
    if line.strip().startswith("Sent "):
      return int(line.split()[1])
  return 0


def _reap(namespaces: Sequence[str]) -> None:
  """Stops the processes inside `namespaces` and deletes the namespaces."""
  for name in reversed(list(namespaces)):
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                          timeout=30).stdout.split()
    for pid in pids:
      with contextlib.suppress(ProcessLookupError, ValueError):
        os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


# The watchdog's program: waits for EOF on stdin (the cluster's owner is gone), then removes every
# namespace of the cluster's prefix.
_REAPER = """import sys
sys.stdin.buffer.read()
from sparsejax import cluster
prefix = sys.argv[1]
cluster._reap(cluster.EmulatedCluster.leftovers(prefix))
"""


@dataclasses.dataclass
class EmulatedCluster:
  """N node namespaces on a bridge, each node's link limited to `rate_bps` each way (tc tbf).

  Node i has address 10.<a>.<b>.(i+1)/24 on its veth; names start with a per-run prefix.
  Use as a context manager: everything is removed on exit, whatever happened; if the process is
  killed (SIGKILL), a watchdog process removes it within a second.
  """

  nodes: int
  rate_bps: int | None  # None: unlimited (no qdisc)
  burst_bytes: int = 16 * 1024
  queue_s: float = 0.4  # tc tbf's latency: the most traffic a link queues, in seconds at its rate
  prefix: str = dataclasses.field(default_factory=lambda: f"sjx{uuid.uuid4().hex[:6]}")

  def __post_init__(self):
    if not 1 <= self.nodes <= 200:
      raise ValueError(f"nodes must be in [1, 200], got {self.nodes}")
    h = int(self.prefix[-4:], 16)
    self.subnet = ipaddress.ip_network(f"10.{100 + h % 100}.{h // 100 % 250}.0/24")
    self.created: list[tuple[str, str]] = []  # ("netns", name) | ("link", name), in order
    self._reaper: subprocess.Popen | None = None

  @property
  def bridge_ns(self) -> str:
    return f"{self.prefix}-br"

  def ns(self, node: int) -> str:
    return f"{self.prefix}-n{node}"

  def address(self, node: int) -> str:
    return str(self.subnet.network_address + node + 1)

  def exec_prefix(self, node: int) -> list[str]:
    return ["ip", "netns", "exec", self.ns(node)]

  def __enter__(self) -> EmulatedCluster:
    if os.geteuid() != 0:
      raise PermissionError("emulating a cluster (--bandwidth) needs root: network namespaces, "
                            "veths and tc qdiscs; run as root or launch without --bandwidth")
    # A watchdog in its own session: when this process ends in any way (SIGKILL included), its
    # end of the pipe closes and the watchdog removes what is left of the cluster.
    self._reaper = subprocess.Popen([sys.executable, "-c", _REAPER, self.prefix],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
    try:
      self._build()
    except BaseException:
      self.remove()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.remove()

  def _build(self) -> None:
    _run("ip", "netns", "add", self.bridge_ns)
    self.created.append(("netns", self.bridge_ns))
    _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
    for i in range(self.nodes):
      ns = self.ns(i)
      _run("ip", "netns", "add", ns)
      self.created.append(("netns", ns))
      _run("ip", "-n", ns, "link", "set", "lo", "up")
      _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}",
           "netns", self.bridge_ns)
      _run("ip", "-n", self.bridge_ns, "link", "set", f"p{i}", "master", "br0")
      _run("ip", "-n", self.bridge_ns, "link", "set", f"p{i}", "up")
      _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/{self.subnet.prefixlen}",
           "dev", "eth0")
      _run("ip", "-n", ns, "link", "set", "eth0", "up")
    self.set_rate(self.rate_bps)

  def set_rate(self, rate_bps: int | None) -> None:
    """Limits every node's link to `rate_bps` each way from now on (None: unlimited); may be
    called while processes run on the cluster (from any process, as root)."""
    set_link_rate(self.prefix, self.nodes, rate_bps, self.burst_bytes, self.queue_s)
    self.rate_bps = rate_bps

  def remove(self) -> None:
    """Deletes every namespace this cluster created (their veths and qdiscs go with them) and
    stops the processes still running in them."""
    _reap([name for kind, name in self.created if kind == "netns"])
    self.created.clear()
    if self._reaper is not None:  # nothing left for it to do
      self._reaper.stdin.close()
      self._reaper.wait(30)
      self._reaper = None

  @staticmethod
  def leftovers(prefix: str) -> list[str]:
    """Namespaces whose name starts with `prefix` (a test checks none are left)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def parse_nodes(spec: str | int) -> tuple[int, int]:
  """`--nodes` -> (min, max): "4" is (4, 4), "2:4" an elastic launch on 4 nodes that goes on
  while at least 2 are alive. A ValueError names the value and what is allowed."""
  text = str(spec).strip()
  allowed = "give N or MIN:MAX, integers with 1 <= MIN <= MAX (e.g. 4 or 2:4)"
  parts = text.split(":")
  if len(parts) > 2 or not all(re.fullmatch(r"[+-]?\d+", x.strip()) for x in parts):
    raise ValueError(f"--nodes {text!r} does not parse: {allowed}")
  low, high = int(parts[0]), int(parts[-1])
  if len(parts) == 2 and not 1 <= low <= high:
    raise ValueError(f"--nodes {text!r} is not allowed: {allowed}")
  return low, high


@dataclasses.dataclass
class _Proc:
  rank: int
  node: int  # its node in the cluster (namespace, address): the launch's alive[rank // ppn]
  popen: subprocess.Popen
  buffer: bytes = b""


@dataclasses.dataclass
class _Loss:
  """A lost process: its rank and node, how it ended, and when the launcher noticed."""
  rank: int
  node: int
  returncode: int | None  # None: still running, reported dead by the coordination service
  at_s: float  # since the launch started
  wall: float  # time.time() then

  @property
  def node_lost(self) -> bool:
    """Killed by a signal (not JAX's own abort) or silent: a lost node, not a program's error."""
    rc = self.returncode
    return rc is None or (rc < 0 and rc != -signal.SIGABRT)

  def how(self) -> str:
    rc = self.returncode
    if rc is None:
      return "silent: it stopped sending heartbeats (hung or cut off)"
    return f"killed by {_signal_name(-rc)}" if rc < 0 else f"exited with code {rc}"

  def line(self, others: int) -> str:
    clock = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.wall))
    return (f"sparsejax launch: lost node {self.node} (rank {self.rank}, {self.how()}) at "
            f"{self.at_s:.2f} s after launch ({clock}.{int(self.wall % 1 * 1000):03d}); "
            f"stopping the other {others} processes\n")


def _signal_name(number: int) -> str:
  try:
    return signal.Signals(number).name
  except ValueError:
    return f"signal {number}"


def _exit_status(returncode: int | None) -> int:
  """A failed process's code as a shell reports it: 128 + N for a signal N, at least 1."""
  if returncode is None or returncode == 0:
    return 1
  return 128 - returncode if returncode < 0 else returncode


_TASK_TIMEOUT = re.compile(r"Task (\d+) heartbeat timeout")


class _DeadReports:
  """Ranks reported silent (hung: they have not exited; the others abort), read from the
  processes' output as jax 0.10.2 writes it: the coordination service's "Task 1 heartbeat
  timeout", or "...unhealthy (stopped sending heartbeats):" and the ids on the next line; and a
  process's failed heartbeat to the service ("RPC: .../CoordinationService/Heartbeat"), which
  names process 0, where the service runs, unless the service named another."""

  def __init__(self) -> None:
    self.service: list[int] = []
    self.coordinator_silent = False
    self._ids_next: set[int] = set()

  @property
  def ranks(self) -> list[int]:
    return self.service or ([0] if self.coordinator_silent else [])

  def read(self, p: _Proc, line: str) -> None:
    found = [int(m) for m in _TASK_TIMEOUT.findall(line)]
    if p.rank in self._ids_next:
      self._ids_next.discard(p.rank)
      if re.fullmatch(r"[\d,\s]+", line):
        found += [int(t) for t in re.findall(r"\d+", line)]
    if "stopped sending heartbeats):" in line:
      self._ids_next.add(p.rank)
    self.service += [r for r in found if r not in self.service]
    if line.startswith("RPC: ") and line.rstrip().endswith("CoordinationService/Heartbeat"):
      self.coordinator_silent = True


def _stop(procs: Sequence[_Proc], grace_s: float) -> list[int]:
  """SIGTERM to every running process, SIGKILL to those still running after `grace_s`; returns
  the ranks that needed SIGKILL."""
  for p in procs:
    if p.popen.poll() is None:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(p.popen.pid, signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  killed = []
  for p in procs:
    with contextlib.suppress(subprocess.TimeoutExpired):
      p.popen.wait(max(0.0, deadline - time.monotonic()))
    if p.popen.poll() is None:
      killed.append(p.rank)
      with contextlib.suppress(ProcessLookupError):
        os.killpg(p.popen.pid, signal.SIGKILL)
      p.popen.wait()
  return killed


def _pump(procs: Sequence[_Proc], out, on_line=None) -> Iterator[None]:
  """Copies each process's output, line by line and prefixed with its rank, to `out`; calls
  `on_line(proc, line)` for each line."""
  sel = selectors.DefaultSelector()
  for p in procs:
    os.set_blocking(p.popen.stdout.fileno(), False)
    sel.register(p.popen.stdout, selectors.EVENT_READ, p)
  while sel.get_map():
    for key, _ in sel.select(timeout=0.5):
      p: _Proc = key.data
      chunk = p.popen.stdout.read()
      if not chunk:
        sel.unregister(key.fileobj)
        chunk = b"\n" if p.buffer else b""
        with contextlib.suppress(subprocess.TimeoutExpired):
          p.popen.wait(0.5)  # its output ended as it exits: seen in the order they ended
      p.buffer += chunk
      *lines, p.buffer = p.buffer.split(b"\n")
      for line in lines:
        text = line.decode(errors="replace")
        out.write(f"[{p.rank}] {text}\n")
        if on_line is not None:
          on_line(p, text)
      out.flush()
    yield


def _raise_interrupt(signum, frame):
  raise KeyboardInterrupt


def _check_launch(argv: Sequence[str], nodes: int, procs_per_node: int, devices_per_proc: int,
                  min_nodes: int, max_restarts: int, heartbeat_timeout_s: int | None) -> None:
  """Raises ValueError for launch arguments that cannot work."""
  for name, value in (("nodes", nodes), ("procs-per-node", procs_per_node),
                      ("devices-per-proc", devices_per_proc)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"--{name} must be an integer >= 1, got {value!r}")
  if not isinstance(min_nodes, int) or not 1 <= min_nodes <= nodes:
    raise ValueError(f"the minimum node count must be in [1, {nodes}] (--nodes MIN:MAX), got "
                     f"{min_nodes!r}")
  if not isinstance(max_restarts, int) or max_restarts < 0:
    raise ValueError(f"--max-restarts must be an integer >= 0, got {max_restarts!r}")
  if heartbeat_timeout_s is not None and (not isinstance(heartbeat_timeout_s, int)
                                          or heartbeat_timeout_s < 1):
    raise ValueError(f"--heartbeat-timeout must be an integer >= 1 (seconds), got "
                     f"{heartbeat_timeout_s!r}")
  if not argv:
    raise ValueError("nothing to launch: give the command after --, e.g. -- train CONFIG")


def _process_env(rank: int, world: int, node: int, local_rank: int, devices_per_proc: int,
                 coordinator: str, init_timeout_s: int, gloo_host: str | None,
                 extra_env: dict[str, str] | None) -> dict[str, str]:
  """The environment of process `rank` on the launch's `node` (0..nodes-1): where the
  coordinator is, who it is, its devices."""
  # each process gets --devices-per-proc devices, whatever XLA_FLAGS said here
  xla_flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                       if "xla_force_host_platform_device_count" not in f)
  env = dict(os.environ, XLA_FLAGS=xla_flags, **{
      ENV["coordinator"]: coordinator, ENV["num_processes"]: str(world),
      ENV["process_id"]: str(rank), ENV["devices"]: str(devices_per_proc),
      ENV["timeout"]: str(init_timeout_s), ENV["node"]: str(node),
      ENV["local_rank"]: str(local_rank), "PYTHONUNBUFFERED": "1", **(extra_env or {})})
  if gloo_host is not None:
    env[ENV["host"]] = gloo_host
  return env


@dataclasses.dataclass
class _Job:
  """What each start of a launched job runs, and how it is stopped."""
  argv: Sequence[str]
  program: Sequence[str] | None
  procs_per_node: int
  devices_per_proc: int
  init_timeout_s: int
  heartbeat_timeout_s: int | None
  grace_s: float  # after SIGTERM, when the launch is interrupted
  lost_grace_s: float  # after SIGTERM, for the others when a node is lost
  cluster: EmulatedCluster | None
  extra_env: dict[str, str] | None

  def command(self, nodes: int, restart: int) -> list[str]:
    """The command line; a restarted `train` is told the node count (mesh.*) of this start."""
    cmd = [*(self.program or (sys.executable, "-m", "sparsejax.cli")), *self.argv]
    if restart and self.program is None and self.argv[:1] == ["train"]:
      local = self.procs_per_node * self.devices_per_proc
      cmd += ["--set", f"mesh.nodes={nodes}", "--set", f"mesh.local={local}",
              "--set", f"mesh.num_devices={nodes * local}"]
    return cmd

  def start(self, alive: Sequence[int], restart: int) -> list[_Proc]:
    """Starts the processes on the cluster's nodes `alive` (the first one coordinates)."""
    ppn, world = self.procs_per_node, len(alive) * self.procs_per_node
    host = self.cluster.address(alive[0]) if self.cluster is not None else "127.0.0.1"
    coordinator = f"{host}:{_free_port()}"
    extra = dict(self.extra_env or {}, **{ENV["restart"]: str(restart)})
    if self.heartbeat_timeout_s is not None:
      extra[ENV["heartbeat"]] = str(self.heartbeat_timeout_s)
    cmd = self.command(len(alive), restart)
    procs: list[_Proc] = []
    for rank in range(world):
      node = alive[rank // ppn]
      gloo_host = self.cluster.address(node) if self.cluster is not None else None
      env = _process_env(rank, world, rank // ppn, rank % ppn, self.devices_per_proc,
                         coordinator, self.init_timeout_s, gloo_host, extra)
      full = (self.cluster.exec_prefix(node) if self.cluster is not None else []) + cmd
      popen = subprocess.Popen(full, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
      procs.append(_Proc(rank, node, popen))
    return procs


def _find_loss(procs: Sequence[_Proc], reports: _DeadReports, started: float) -> _Loss | None:
  """The lost process, if any: one the coordination service reported dead, else the first that
  failed (one killed by a signal before one that JAX aborted because another died)."""
  by_rank = {p.rank: p for p in procs}
  named = [by_rank[r] for r in reports.ranks if r in by_rank]
  failed = [p for p in procs if p.popen.poll() not in (None, 0)]
  # killed first, then failed with a code, then aborted by JAX (it saw another die)
  failed.sort(key=lambda p: (p.popen.returncode == -signal.SIGABRT, p.popen.returncode > 0))
  lost = (named or failed or [None])[0]
  if lost is None:
    return None
  return _Loss(lost.rank, lost.node, lost.popen.poll(), time.monotonic() - started, time.time())


def _supervise(procs: Sequence[_Proc], lost_grace_s: float, out, started: float
               ) -> tuple[int, _Loss | None]:
  """Pumps the processes' output until all have exited. On the first loss (a process exits
  non-zero, is killed, or is reported dead) says which node and when, and stops the others
  (SIGTERM, SIGKILL after `lost_grace_s`). Returns (0, None) or (exit status, the loss)."""
  reports, loss = _DeadReports(), None
  for _ in _pump(procs, out, reports.read):
    if loss is None and (loss := _find_loss(procs, reports, started)) is not None:
      out.write(loss.line(len(procs) - 1))
      out.flush()
      noticed = time.monotonic()
      if loss.returncode is None:  # silent: SIGTERM would wait on it in vain
        with contextlib.suppress(ProcessLookupError):
          os.killpg(next(p for p in procs if p.rank == loss.rank).popen.pid, signal.SIGKILL)
      killed = _stop(procs, lost_grace_s)
      codes = ", ".join(f"{p.rank}: {p.popen.returncode}" for p in procs if p.rank != loss.rank)
      out.write(f"sparsejax launch: every process ended {time.monotonic() - noticed:.2f} s "
                f"after the loss was noticed (exit codes by rank: {codes}; SIGKILL after the "
                f"{lost_grace_s:g} s grace: {killed or 'none'})\n")
  for p in procs:
    p.popen.wait()
  if loss is None:
    return 0, None
  out.write(f"sparsejax launch: failed: lost rank {loss.rank} (node {loss.node}, {loss.how()})\n")
  out.flush()
  return _exit_status(loss.returncode), loss


def _run_once(job: _Job, alive: Sequence[int], restart: int, started: float, out
              ) -> tuple[int, _Loss | None]:
  """One start of the job on the nodes `alive`, to its end: (exit status, the loss or None)."""
  procs: list[_Proc] = []
  try:
    procs = job.start(alive, restart)
    return _supervise(procs, job.lost_grace_s, out, started)
  except KeyboardInterrupt:
    out.write("sparsejax launch: interrupted; stopping every process\n")
    return 130, None
  finally:
    _stop(procs, min(job.grace_s, 30.0))


def _run_elastic(job: _Job, nodes: int, min_nodes: int, max_restarts: int, out) -> int:
  """Runs the job on `nodes` nodes; while at least `min_nodes` are alive (and at most
  `max_restarts` times), starts it again on the nodes left after one is lost."""
  alive, started = list(range(nodes)), time.monotonic()
  for restart in range(max_restarts + 1):
    rc, loss = _run_once(job, alive, restart, started, out)
    if loss is None or min_nodes == nodes:
      return rc
    if not loss.node_lost:
      out.write(f"sparsejax launch: not restarting: rank {loss.rank} {loss.how()}, a failure of "
                "the program rather than a lost node\n")
      return rc
    alive = [n for n in alive if n != loss.node]
    if len(alive) < min_nodes:
      out.write(f"sparsejax launch: giving up: lost node {loss.node}, {len(alive)} node(s) "
                f"remain, fewer than the minimum of {min_nodes} (--nodes {min_nodes}:{nodes})\n")
      return rc
    if restart == max_restarts:
      out.write(f"sparsejax launch: giving up: lost node {loss.node} after {max_restarts} "
                f"restart(s), the most allowed (--max-restarts {max_restarts})\n")
      return rc
    out.write(f"sparsejax launch: restart {restart + 1} (of at most {max_restarts}): lost node "
              f"{loss.node}; starting again on the {len(alive)} remaining nodes {alive} "
              f"(minimum {min_nodes})\n")
    out.flush()
  return rc


def launch(argv: Sequence[str], *, nodes: int, procs_per_node: int, devices_per_proc: int = 1,
           bandwidth: str | None = None, init_timeout_s: int = 120, grace_s: float = 20.0,
           out=None, program: Sequence[str] | None = None,
           cluster: EmulatedCluster | None = None, extra_env: dict[str, str] | None = None,
           min_nodes: int | None = None, max_restarts: int = 3,
           heartbeat_timeout_s: int | None = 3, lost_grace_s: float = 2.0) -> int:
  """Runs `python -m sparsejax.cli *argv` (or `*program, *argv`) as nodes * procs_per_node
  processes; returns the exit status (0 only if every process exited 0).

  When a process fails or is killed, the launcher names its node and rank and when, and stops
  the others (SIGTERM, SIGKILL after `lost_grace_s`; after `grace_s` on Ctrl-C). Each process
  also aborts by itself within about `heartbeat_timeout_s` of a peer going silent (None: JAX's
  100 s). Elastic (`min_nodes` < `nodes`): after a lost node, the job starts again on the nodes
  left (a restarted `train` gets `--set mesh.nodes=...`), while at least `min_nodes` remain and
  at most `max_restarts` times. `bandwidth` builds an EmulatedCluster for this launch; `cluster`
  reuses one already built."""
  min_nodes = nodes if min_nodes is None else min_nodes
  _check_launch(argv, nodes, procs_per_node, devices_per_proc, min_nodes, max_restarts,
                heartbeat_timeout_s)
  rate = parse_rate(bandwidth) if bandwidth is not None else None
  if cluster is not None and (rate is not None or cluster.nodes != nodes):
    raise ValueError("give either bandwidth or a cluster of `nodes` nodes, not both")
  job = _Job(list(argv), program, procs_per_node, devices_per_proc, init_timeout_s,
             heartbeat_timeout_s, grace_s, lost_grace_s, cluster, extra_env)
  with contextlib.ExitStack() as stack:
    if rate is not None:
      job.cluster = stack.enter_context(EmulatedCluster(nodes, rate))
      print(f"sparsejax launch: emulated cluster {job.cluster.prefix}: {nodes} nodes, links "
            f"{bandwidth} (namespaces {job.cluster.prefix}-*)", file=out or sys.stdout, flush=True)
    if threading.current_thread() is threading.main_thread():
      # a SIGTERM to the launcher stops and cleans up like Ctrl-C
      stack.callback(signal.signal, signal.SIGTERM,
                     signal.signal(signal.SIGTERM, _raise_interrupt))
    return _run_elastic(job, nodes, min_nodes, max_restarts, out or sys.stdout)
