"""What benchmarks and studies on one machine need beside the library: a process pinned to one
core, a machine-wide lock so that benchmarks sharing the machine never time at the same moment,
a group of processes waited for together, workers launched on an emulated cluster
(`sparsejax.cluster` launches and emulates the nodes), and their results written.

Results: JSON (every measurement) and a markdown table beside it, each written to a temporary
name and renamed, so an interrupted run never leaves half a file. A committed result must be
rerunnable on any machine: `command_line` records the command with paths inside the checkout
relative to its root and other absolute paths as placeholders (`--lock $LOCK`), and
`portable_path` / `resolve` store and read paths relative to the root.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["pin_to_core", "pinning", "exclusive", "running", "wait_all", "TimedLog", "RUN_TOKEN",
           "launched_pids", "launch_workers", "ROOT", "portable_path", "git_commit", "resolve",
           "command_line",
           "spread", "footer", "json_path", "write_atomic", "write_results"]

RUN_TOKEN = "SPARSEJAX_RUN_TOKEN"  # in the environment of one run's launched processes


def pin_to_core(index: int) -> None:
  """Keeps this process on one core (`index` modulo the cores it may use): every thread it has
  now and, by inheritance, those it starts. (`os.sched_setaffinity(0, ...)` alone moves only
  the calling thread: a process pinned that way after XLA started kept XLA's executor threads
  on every core.)"""
  cores = sorted(os.sched_getaffinity(0))
  core = {cores[index % len(cores)]}
  for tid in os.listdir("/proc/self/task"):
    try:
      os.sched_setaffinity(int(tid), core)
    except OSError:  # the thread has ended
      pass


def pinning(processes: int, cores: int) -> str:
  """How `processes` processes pinned by `pin_to_core(0)` ... `pin_to_core(processes - 1)` share
  `cores` cores (round-robin: process i on core i modulo `cores`), in words for a table: "one
  pinned to each core", "each pinned to a core of its own (2 of 16)", "4 pinned to each of 2
  cores", "2 or 3 pinned to each of 2 cores"."""
  for name, value in (("processes", processes), ("cores", cores)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
  if processes == cores:
    return "one pinned to each core"
  if processes < cores:
    return f"each pinned to a core of its own ({processes} of {cores})"
  fewest, more = divmod(processes, cores)
  if not more:
    return f"{fewest} pinned to each of {cores} cores"
  return f"{fewest} or {fewest + 1} pinned to each of {cores} cores"


@contextlib.contextmanager
def exclusive(path: str | None) -> Iterator[None]:
  """Holds an flock on `path` (if given) while inside, so benchmarks that share a machine and
  the lock never time at the same moment."""
  if not path:
    yield
    return
  import fcntl
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def running(pid: int) -> bool:
  """Whether `pid` runs (a zombie, ended but not yet waited for, does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def wait_all(procs: Sequence[Any], timeout_s: float) -> list[int]:
  """The exit codes of `procs` (`subprocess.Popen`s) once all have ended; where one fails, or
  `timeout_s` passes, the others are killed at once (-9) rather than left waiting at a barrier
  for it."""
  deadline = time.monotonic() + timeout_s
  while True:
    codes = [p.poll() for p in procs]
    if all(c is not None for c in codes):
      return codes
    if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
      for p in procs:
        if p.poll() is None:
          p.kill()
      return [p.wait() for p in procs]
    time.sleep(0.05)


class TimedLog:
  """A text sink for the launcher's output that keeps when each line arrived."""

  def __init__(self) -> None:
    self.lines: list[tuple[float, str]] = []
    self._part = ""
    self._lock = threading.Lock()

  def write(self, text: str) -> None:
    with self._lock:
      *done, self._part = (self._part + text).split("\n")
      now = time.monotonic()
      self.lines += [(now, line) for line in done]

  def flush(self) -> None:
    pass

  def count(self, needle: str) -> int:
    with self._lock:
      return sum(needle in line for _, line in self.lines)

  def first(self, needle: str) -> tuple[float, str] | None:
    with self._lock:
      return next(((t, line) for t, line in self.lines if needle in line), None)


def launched_pids(token: str, world: int, var: str = RUN_TOKEN) -> dict[int, int]:
  """rank -> pid of the `world` processes `sparsejax.cluster.launch` started with `token` in
  their environment's `var` (`extra_env={var: token}`; their children, which inherit it, left
  out)."""
  from sparsejax import cluster
  ranks, parents = {}, {}
  for pid in filter(str.isdigit, os.listdir("/proc")):
    with contextlib.suppress(OSError):
      with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
      if env.get(var.encode()) == token.encode() and int(pid) != os.getpid():
        with open(f"/proc/{pid}/stat") as f:
          parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        ranks[int(pid)] = int(env[cluster.ENV["process_id"].encode()])
  found = {rank: pid for pid, rank in ranks.items() if parents[pid] not in ranks}
  if len(found) != world:
    raise RuntimeError(f"found {len(found)} of the {world} launched processes")
  return found


def launch_workers(c: Any, script: str, argv: list[str], *, mode: str, procs_per_node: int,
                   devices_per_proc: int, log: Any, what: str, torch: bool = False
                   ) -> list[dict]:
  """Runs `python -m <script's module> --mode MODE ... --worker-out F` (from the checkout's
  root) as `c.nodes` x `procs_per_node` processes on the emulated cluster `c` (torch workers,
  mode "torch" or `torch=True`, talk gloo over the node's link, eth0); returns the rows the
  rank-0 worker wrote to F."""
  from sparsejax import cluster
  with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
    path = f.name
  try:
    rc = cluster.launch(["--mode", mode, *argv, "--worker-out", path], nodes=c.nodes,
                        procs_per_node=procs_per_node, devices_per_proc=devices_per_proc,
                        cluster=c, program=python_module(script),
                        init_timeout_s=120, out=log,
                        extra_env=({"GLOO_SOCKET_IFNAME": "eth0"} if torch or mode == "torch"
                                   else None))
    if rc != 0:
      raise RuntimeError(f"{what} workers failed (exit {rc}); see the log above")
    with open(path) as f:
      return json.load(f)
  finally:
    os.remove(path)


def _root() -> str:
  """The checkout this sparsejax runs from (its folder holds pyproject.toml), else the current
  folder: what a result's paths are relative to."""
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return here if os.path.isfile(os.path.join(here, "pyproject.toml")) else os.getcwd()


ROOT = _root()


def portable_path(path: str) -> str:
  """`path` relative to the checkout's root where it lies inside it, else as given."""
  full = os.path.abspath(path)
  if full == ROOT or full.startswith(ROOT + os.sep):
    return os.path.relpath(full, ROOT)
  return path


def git_commit() -> str:
  """The checkout's commit (short hash, "+dirty" where tracked files differ from it), or
  "unknown" outside a git checkout: what a result was measured with."""
  import subprocess
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True, timeout=30).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           check=True, capture_output=True, text=True, timeout=30).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return head + ("+dirty" if dirty else "")


def resolve(path: str) -> str:
  """A stored path as a file of this checkout: a relative path is relative to its root."""
  return path if os.path.isabs(path) else os.path.join(ROOT, path)


def _portable_arg(arg: str, option: str | None) -> str:
  if "=" in arg and arg.startswith("--"):
    key, value = arg.split("=", 1)
    return f"{key}={_portable_arg(value, key)}"
  if not os.path.isabs(arg):
    return arg
  inside = portable_path(arg)
  if inside != arg:
    return inside
  name = (option or "--path").lstrip("-").replace("-", "_").upper()
  return f"${name}"


def module_name(script: str) -> str:
  """The module a study's or benchmark's file runs as (`python -m`) from the folder above its
  packages (`.../studies/auto/end_to_end.py` -> `studies.auto.end_to_end`); a module name as
  it is."""
  if not script.endswith(".py"):
    return script
  folder, name = os.path.split(os.path.abspath(script))
  parts = [os.path.splitext(name)[0]]
  while os.path.isfile(os.path.join(folder, "__init__.py")):
    folder, package = os.path.split(folder)
    parts.insert(0, package)
  return ".".join(parts)


def python_module(script: str) -> list[str]:
  """`[python, "-m", module]`: the command that runs a study's or benchmark's file (or
  module) again, in a child process started from the same folder."""
  return [sys.executable, "-m", module_name(script)]


def command_line(script: str, argv: Sequence[str]) -> str:
  """`python -m <module> <argv>` as a user reruns it from the checkout's root (`script`: the
  module, or its file): paths inside the checkout relative to it, any other absolute path a
  placeholder named after its option (an --out outside the checkout is written `--out
  $OUT`)."""
  words, option = ["python", "-m", module_name(script)], None
  for arg in argv:
    words.append(_portable_arg(arg, option))
    option = arg if arg.startswith("--") and "=" not in arg else None
  return " ".join(words)


def spread(values: Sequence[float | None], digits: int = 2, scale: float = 1.0) -> str:
  """`min / median / max` of the values that are not None (times `scale`), one value alone,
  "-" for none: how every table here gives figures over separate runs."""
  vals = sorted(v * scale for v in values if v is not None)
  if not vals:
    return "-"
  if len(vals) == 1:
    return f"{vals[0]:.{digits}f}"
  return f"{vals[0]:.{digits}f} / {statistics.median(vals):.{digits}f} / {vals[-1]:.{digits}f}"


def time_stats(times: Sequence[float]) -> dict[str, float]:
  """The median, quartiles and minimum of timed calls (seconds) and their count: a benchmark
  row's timing."""
  import numpy as np
  return {"median_s": statistics.median(times), "q1_s": float(np.percentile(times, 25)),
          "q3_s": float(np.percentile(times, 75)), "min_s": min(times), "reps": len(times)}


def footer(meta: dict) -> str:
  """The line every result table ends with: its command, commit (where `meta` has one),
  machine and date (from `meta`)."""
  commit = f"commit {meta['commit']}; " if meta.get("commit") else ""
  return (f"Command: `{meta['command']}`; {commit}machine: {meta['machine']} "
          f"({meta['cpus']} cores); date: {meta['date']}.")


def json_path(value: str) -> str:
  """argparse type of a results file (`--out`): a path ending in .json that is not a folder,
  checked before a long run rather than when it writes at the end."""
  if os.path.isdir(value) or not value.endswith(".json"):
    raise argparse.ArgumentTypeError(
        f"{value!r}: must be a results file ending in .json (its table written beside it "
        "as .md), not a folder")
  return value


def write_atomic(path: str, text: str) -> None:
  """Writes `text` to `path` through a temporary name (an interrupted write leaves no half
  file)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def write_results(json_path: str, payload: dict[str, Any], table: str) -> str:
  """Writes `payload` to `json_path` and `table` to the same name with .md; returns the .md
  path."""
  write_atomic(json_path, json.dumps(payload, indent=1))
  md = os.path.splitext(json_path)[0] + ".md"
  write_atomic(md, table + "\n")
  return md
