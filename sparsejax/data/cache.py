"""`TieredCache`: memory, local disk, then the wrapped source; and `RemoteSource`, a slow source.

Both are random-access sources in grain's protocol (`__len__`, `__getitem__`, a stable `__repr__`,
picklable, thread-safe) and wrap any other one, e.g. a TFDS data source or a decoding stage:

  source = RemoteSource(tfds_source, latency_s=0.01, bandwidth_bytes_per_s=20e6)
  cached = TieredCache(source, memory_bytes=2 << 30, disk_dir=local_disk, disk_bytes=200 << 30)
  cached[7]            # source on the first read, memory or disk afterwards
  cached.stats()       # {"memory": {"hits": ..}, "disk": {..}, "source": {..}}

Keys are the source's identity (a hash of its `repr`, or the `key` argument) plus the index, so
two sources never share entries. The disk tier holds one file per record in the checksummed
format of `sparsejax.data.records` (never pickle), written to a temporary name and linked into
place, so a crash leaves either the whole record or none. A later process finds the disk warm,
and opening costs the same however many records it holds (`sparsejax.data.disk`).
Counters live in shared memory (`sparsejax.data.shared`), so grain's worker processes add to the
numbers the trainer logs.
"""

from __future__ import annotations

import collections
import hashlib
import os
import re
import threading
import time
import weakref
from typing import Any, Protocol

import numpy as np

from sparsejax.data import records
from sparsejax.data.disk import DiskTier
from sparsejax.data.shared import SharedSlots

__all__ = ["RandomAccessSource", "RemoteSource", "TieredCache"]

_COUNTERS = ("memory_hits", "memory_misses", "memory_bytes", "memory_evictions",
             "disk_hits", "disk_misses", "disk_bytes_written", "disk_evictions", "disk_corrupt",
             "disk_write_errors", "source_reads", "source_bytes")


class RandomAccessSource(Protocol):
  def __len__(self) -> int: ...
  def __getitem__(self, index: int) -> Any: ...


def check_index(index: Any, length: int) -> int:
  """`index` as a plain int in [0, length); negative indices count from the end, like a list."""
  if isinstance(index, bool) or not isinstance(index, int | np.integer):
    raise TypeError(f"record index must be an int, got {type(index).__name__} {index!r}")
  i = int(index)
  if i < 0:
    i += length
  if not 0 <= i < length:
    raise IndexError(f"record index {int(index)} out of range for a source of {length} records "
                     f"(allowed: {-length}..{length - 1})")
  return i


def source_identity(source: Any, key: str | None = None) -> str:
  """A short stable hash naming `source` on disk: of `key` if given, else of `repr(source)`."""
  text = key if key is not None else repr(source)
  if key is None and re.search(r" at 0x[0-9a-fA-F]+", text):
    raise ValueError(f"the source's repr is not stable across processes ({text[:80]!r}); give "
                     "it a __repr__ that names its contents, or pass TieredCache(..., key=...)")
  return hashlib.blake2b(text.encode(), digest_size=10).hexdigest()


def _readonly(value: Any) -> Any:
  """Arrays handed out by the memory tier are shared between callers: make them read-only."""
  if isinstance(value, np.ndarray):
    value.flags.writeable = False
  elif isinstance(value, dict):
    for v in value.values():
      _readonly(v)
  elif isinstance(value, list | tuple):
    for v in value:
      _readonly(v)
  return value


class _MemoryTier:
  """LRU by bytes, in this process."""

  def __init__(self, budget: int):
    self.budget = budget
    self.used = 0
    self.items: collections.OrderedDict[int, tuple[Any, int]] = collections.OrderedDict()

  def get(self, index: int) -> tuple[bool, Any]:
    entry = self.items.get(index)
    if entry is None:
      return False, None
    self.items.move_to_end(index)
    return True, entry[0]

  def put(self, index: int, value: Any) -> tuple[int, int]:
    """Stores `value`; returns (bytes added net, evictions)."""
    size = records.nbytes_of(value)
    if size > self.budget or index in self.items:
      return 0, 0
    evicted = freed = 0
    while self.used + size > self.budget:
      _, (_, s) = self.items.popitem(last=False)
      self.used -= s
      freed += s
      evicted += 1
    self.items[index] = (_readonly(value), size)
    self.used += size
    return size - freed, evicted


class TieredCache:
  """A random-access source that remembers what it read from `source`, in memory and on disk.

  Args:
    source: any random-access source (`len(source)`, `source[i]`) whose records are made of
      bytes, str, numbers, numpy arrays, and dicts/lists/tuples of them.
    memory_bytes: budget of the in-process memory tier (per process), > 0.
    disk_dir: directory of the disk tier (shared by processes and runs); None: memory only.
    disk_bytes: budget of the disk tier over the whole `disk_dir`, > 0 (required with disk_dir).
    key: the source's identity on disk; default: a hash of `repr(source)`, which must be stable.

  Records served from memory are shared between callers and read-only.
  """

  def __init__(self, source: RandomAccessSource, *, memory_bytes: int,
               disk_dir: str | os.PathLike | None = None, disk_bytes: int | None = None,
               key: str | None = None):
    if not isinstance(memory_bytes, int | np.integer) or memory_bytes <= 0:
      raise ValueError(f"memory_bytes must be a positive number of bytes, got {memory_bytes!r}")
    if disk_dir is not None and (disk_bytes is None or not isinstance(disk_bytes, int | np.integer)
                                 or disk_bytes <= 0):
      raise ValueError(f"disk_bytes must be a positive number of bytes when disk_dir is given, "
                       f"got {disk_bytes!r}")
    if disk_dir is None and disk_bytes is not None:
      raise ValueError(f"disk_bytes={disk_bytes!r} given without disk_dir")
    self.source = source
    self.memory_bytes = int(memory_bytes)
    self.disk_dir = None if disk_dir is None else os.fspath(disk_dir)
    self.disk_bytes = None if disk_bytes is None else int(disk_bytes)
    self.key = key
    self.identity = source_identity(source, key)
    self._length = len(source)
    self._counters = SharedSlots(_COUNTERS)
    self._setup()

  def _setup(self) -> None:
    self._lock = threading.Lock()
    self._memory = _MemoryTier(self.memory_bytes)
    self._disk = (None if self.disk_dir is None
                  else DiskTier(self.disk_dir, self.identity, self.disk_bytes, self._lock))
    if self._disk is not None:
      self._disk.open()
      weakref.finalize(self, self._disk.close)

  def close(self) -> None:
    """Releases the disk tier's file handle (the object stays usable and reopens it)."""
    if self._disk is not None:
      self._disk.close()

  def __getstate__(self) -> dict[str, Any]:
    return {"source": self.source, "memory_bytes": self.memory_bytes, "disk_dir": self.disk_dir,
            "disk_bytes": self.disk_bytes, "key": self.key, "identity": self.identity,
            "_length": self._length, "_counters": self._counters}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._setup()

  def __len__(self) -> int:
    return self._length

  def __repr__(self) -> str:
    return f"TieredCache({self.source!r})"

  def __getitem__(self, index: int) -> Any:
    i = check_index(index, self._length)
    with self._lock:
      hit, value = self._memory.get(i)
    if hit:
      self._counters.add(memory_hits=1)
      return value
    disk = self._disk if self._disk is not None and self._disk.enabled else None
    if disk is not None:
      status, value = disk.read(i)  # the file read and decode run outside the lock
      if status == "hit":
        self._counters.add(memory_misses=1, disk_hits=1)
        self._remember(i, value)
        return value
      self._counters.add(memory_misses=1, disk_misses=1, disk_corrupt=int(status == "corrupt"))
    else:
      self._counters.add(memory_misses=1)
    value = self.source[i]
    self._counters.add(source_reads=1, source_bytes=records.nbytes_of(value))
    if disk is not None and not disk.full:
      written, evictions, failed = disk.write(i, records.encode(value))
      self._counters.add(disk_bytes_written=written, disk_evictions=evictions,
                         disk_write_errors=int(failed))
    self._remember(i, value)
    return value

  def _remember(self, i: int, value: Any) -> None:
    with self._lock:
      added, evicted = self._memory.put(i, value)
    if added or evicted:
      self._counters.add(memory_bytes=added, memory_evictions=evicted)

  def stats(self) -> dict[str, dict[str, int]]:
    """Counters per tier, summed over every process using this cache (grain workers too):
    memory {hits, misses, bytes (held now), evictions}; disk {hits, misses, bytes (on disk now),
    bytes_written, evictions, corrupt, write_errors}; source {reads, bytes}."""
    c = {k: int(v) for k, v in self._counters.snapshot().items()}
    out = {tier: {k[len(tier) + 1:]: v for k, v in c.items() if k.startswith(tier + "_")}
           for tier in ("memory", "disk", "source")}
    out["disk"]["bytes"] = (self._disk.used_bytes()
                            if self._disk is not None and self._disk.enabled else 0)
    return out


class RemoteSource:
  """`source` as if it sat on a cloud file system: each read waits `latency_s`, and all reads
  share one link of `bandwidth_bytes_per_s` (across threads and grain worker processes).

  The record's size is what `records.nbytes_of` reports (its bytes and arrays).
  """

  def __init__(self, source: RandomAccessSource, *, latency_s: float,
               bandwidth_bytes_per_s: float):
    if not latency_s >= 0:
      raise ValueError(f"latency_s must be >= 0 seconds, got {latency_s!r}")
    if not bandwidth_bytes_per_s > 0:
      raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth_bytes_per_s!r}")
    self.source = source
    self.latency_s = float(latency_s)
    self.bandwidth_bytes_per_s = float(bandwidth_bytes_per_s)
    self._length = len(source)
    self._link = SharedSlots(("busy_until", "reads", "bytes"))

  def __len__(self) -> int:
    return self._length

  def __repr__(self) -> str:
    return (f"RemoteSource({self.source!r}, latency_s={self.latency_s!r}, "
            f"bandwidth_bytes_per_s={self.bandwidth_bytes_per_s!r})")

  def __getitem__(self, index: int) -> Any:
    i = check_index(index, self._length)
    value = self.source[i]
    size = records.nbytes_of(value)
    end = self._link.advance("busy_until", time.monotonic(), size / self.bandwidth_bytes_per_s,
                             self.latency_s)
    self._link.add(reads=1, bytes=size)
    delay = end - time.monotonic()
    if delay > 0:
      time.sleep(delay)
    return value

  def stats(self) -> dict[str, int]:
    s = self._link.snapshot()
    return {"reads": int(s["reads"]), "bytes": int(s["bytes"])}
