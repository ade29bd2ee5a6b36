"""Numbers shared by every process that holds a copy of an object: counters and clocks.

grain runs sources in worker processes, each with its own unpickled copy of the source. A
`SharedSlots` block lives in POSIX shared memory and is pickled by name, so the counters a worker
adds to are the ones the trainer reads, and a `RemoteSource`'s link is one link for all workers.
Updates take a thread lock and an `flock` on the block, so they are atomic across processes.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from multiprocessing import shared_memory

import numpy as np

__all__ = ["SharedSlots"]


def _close(shm: shared_memory.SharedMemory | None, mm: mmap.mmap | None, fd: int) -> None:
  try:
    os.close(fd)
  except OSError:
    pass
  try:
    if mm is not None:
      mm.close()
    if shm is not None:
      shm.unlink()
      shm.close()
  except (BufferError, FileNotFoundError):
    pass


class SharedSlots:
  """Named float64 slots in shared memory (exact for integers below 2**53).

  The creating process owns the block and unlinks it when the object is garbage collected;
  unpickled copies attach to it by name.
  """

  def __init__(self, names: Sequence[str], *, _attach: str | None = None):
    self.names = tuple(names)
    self._index = {n: i for i, n in enumerate(self.names)}
    size = 8 * max(1, len(self.names))
    if _attach is None:  # the owner: created (and registered for clean-up) by the stdlib
      shm, mm = shared_memory.SharedMemory(create=True, size=size), None
      self.name, buf = shm.name.lstrip("/"), shm.buf
    else:  # a copy in another process (or this one): map the block by name, untracked, so
      # that no resource tracker unlinks it when a worker process exits
      shm, self.name = None, _attach
    self._fd = os.open(f"/dev/shm/{self.name}", os.O_RDWR)
    if shm is None:
      mm = mmap.mmap(self._fd, size)
      buf = mm
    self._values = np.ndarray((len(self.names),), np.float64, buffer=buf)
    if shm is not None:
      self._values[:] = 0.0
    self._lock = threading.Lock()
    self._finalizer = weakref.finalize(self, _close, shm, mm, self._fd)

  def __reduce__(self):
    return (_attach_slots, (self.names, self.name))

  def __repr__(self) -> str:
    return f"SharedSlots({dict(self.snapshot())})"

  def _locked(self):
    slots = self

    class _Ctx:
      def __enter__(self):
        slots._lock.acquire()
        fcntl.flock(slots._fd, fcntl.LOCK_EX)

      def __exit__(self, *exc):
        fcntl.flock(slots._fd, fcntl.LOCK_UN)
        slots._lock.release()

    return _Ctx()

  def add(self, **amounts: float) -> None:
    """Atomically adds each amount to its slot."""
    with self._locked():
      for name, v in amounts.items():
        self._values[self._index[name]] += v

  def advance(self, name: str, now: float, duration: float, latency: float) -> float:
    """A shared link: a transfer of `duration` seconds asked for at `now` that first waits
    `latency` seconds starts when the link is free; returns when it ends (and books the link)."""
    with self._locked():
      i = self._index[name]
      end = max(now + latency, float(self._values[i])) + duration
      self._values[i] = end
      return end

  def snapshot(self) -> dict[str, float]:
    with self._locked():
      return {n: float(v) for n, v in zip(self.names, self._values)}

  def close(self) -> None:
    del self._values
    self._finalizer()


def _attach_slots(names, name):
  return SharedSlots(names, _attach=name)
