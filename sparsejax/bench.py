"""What benchmarks on one machine need beside the library: a process pinned to one core, a
machine-wide lock so that benchmarks sharing the machine never time at the same moment, and a
group of processes waited for together (`sparsejax.cluster` launches and emulates the nodes).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["pin_to_core", "exclusive", "running", "wait_all", "TimedLog", "RUN_TOKEN",
           "launched_pids"]

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
