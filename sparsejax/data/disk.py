"""The disk tier of `TieredCache`: one checksummed file per record, one byte budget per directory.

Layout: `root/<identity>/<index % 256, 2 hex digits>/<index>.rec`, and `root/.usage`, the ledger:
the bytes of every record under `root`, shared by every process and source using the directory.
Opening reads the ledger, so it costs the same for ten records or ten million; the directory is
walked only when the ledger is missing or damaged (or written by an older version), or when a
damaged record shows that something outside changed the directory.

Every change to the directory happens under an `flock` of the ledger, as one logged step: the
ledger first records the pending step (add or remove one record: its path and size), then the
file operation runs, then the ledger records the new total. A process killed in between leaves
the pending step, which the next process to take the lock settles by looking at that one file.
So writers in any number of processes keep an exact count, and a crash costs no walk. A record
is written to a temporary file first, outside the lock (`<index>.rec.<pid>-<thread>.tmp`, so
that writers in many processes write in parallel); the step under the lock only links it into
place. A temporary file left by a killed writer is removed by the next walk once its process is
gone (or it is an hour old).

Eviction is least-recently-used, approximately: first the records found on disk (looked for
lazily, one sub-directory at a time, oldest first, only when space is needed), then those this
process wrote or read, oldest first.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import re
import struct
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Iterator
from typing import Any

from sparsejax.data import records

__all__ = ["DiskTier", "Ledger"]

FANOUT = 256  # sub-directories per source, so no directory holds millions of files

_MAGIC = b"SJLEDG02"  # 02: an add's pending step names the temporary file, not the record
_BODY = struct.Struct("<8sqBqH256s")  # magic, bytes used, pending step, its size, path length, path
_CRC = struct.Struct("<I")
_NONE, _ADD, _REMOVE = 0, 1, 2
_TMP = re.compile(r"\.rec(?:\.(\d+)-\d+)?\.tmp$")  # pid, thread; none: an older version's
STALE_TMP_S = 3600.0  # a temporary file this old is a leftover even if its pid is alive (reused)


def tmp_path(path: str) -> str:
  """The temporary file this process and thread write the record `path` to."""
  return f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"


def _record_of(tmp: str) -> str:
  return tmp[:_TMP.search(tmp).start()] + ".rec"


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's
    return True
  return True


def _stale(path: str, pid: str | None) -> bool:
  """Whether the temporary file `path` of process `pid` is a killed writer's leftover."""
  if pid is None:  # an older version's, written under the lock: orphaned
    return True
  if int(pid) != os.getpid() and not _alive(int(pid)):
    return True
  return time.time() - os.stat(path).st_mtime > STALE_TMP_S


def count_records(root: str) -> int:
  """Bytes of every `*.rec` under `root` (a walk); removes the temporary files of writers that
  were killed (their process is gone, or the file is `STALE_TMP_S` old), not those in flight."""
  total = 0
  for dirpath, _, files in os.walk(root):
    for name in files:
      path = os.path.join(dirpath, name)
      try:
        if name.endswith(".rec"):
          total += os.stat(path).st_size
        elif (m := _TMP.search(name)) and _stale(path, m.group(1)):
          os.remove(path)
      except FileNotFoundError:
        continue
  return total


def file_id(st: os.stat_result) -> tuple[int, int, int, int]:
  """What tells one file at a path from a later one: device, inode, size, mtime (ns). (An inode
  number freed by a removal can come back at once; the size and mtime then differ.)"""
  return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _same_file(a: str, b: str) -> bool:
  try:
    sa, sb = os.stat(a), os.stat(b)
  except FileNotFoundError:
    return False
  return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


_LEDGERS: weakref.WeakSet[Ledger] = weakref.WeakSet()


def _after_fork() -> None:
  """In a forked child: a thread of the parent may have held a ledger's mutex at the fork, and
  no thread of the child will ever release that copy."""
  for ledger in list(_LEDGERS):
    ledger._mutex = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


class Ledger:
  """`root/.usage`: the bytes of the records under `root` and at most one pending step.

  Use it under `locked()` (a thread lock, then an flock of the file): `used` is then exact, and
  `add` / `remove` change the directory and the count together.
  """

  def __init__(self, root: str):
    self.root = root
    self.used = 0
    self._fd: int | None = None
    self._pid = os.getpid()  # the process that opened `_fd`
    self._mutex = threading.Lock()  # flock does not exclude threads sharing one descriptor
    _LEDGERS.add(self)

  @contextlib.contextmanager
  def locked(self) -> Iterator[Ledger]:
    with self._mutex:
      if self._fd is not None and self._pid != os.getpid():
        # Forked: an flock belongs to the open file description, which the child shares with
        # its parent, so the two would not exclude each other. Open the file anew.
        os.close(self._fd)
        self._fd = None
      if self._fd is None:
        self._fd = os.open(os.path.join(self.root, ".usage"), os.O_RDWR | os.O_CREAT, 0o644)
        self._pid = os.getpid()
      fcntl.flock(self._fd, fcntl.LOCK_EX)
      try:
        self._load()
        yield self
      finally:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

  def close(self) -> None:
    with self._mutex:
      if self._fd is not None:
        os.close(self._fd)
        self._fd = None

  def _store(self, used: int, step: int = _NONE, size: int = 0, path: str = "") -> None:
    rel = os.path.relpath(path, self.root).encode() if path else b""
    if len(rel) > 256:
      raise ValueError(f"record path {path!r} is too long for the ledger (256 bytes allowed)")
    body = _BODY.pack(_MAGIC, max(0, used), step, size, len(rel), rel)
    os.pwrite(self._fd, body + _CRC.pack(zlib.crc32(body)), 0)

  def _parse(self) -> tuple[int, int, int, str] | None:
    data = os.pread(self._fd, _BODY.size + _CRC.size, 0)
    if len(data) != _BODY.size + _CRC.size:
      return None
    body = data[:_BODY.size]
    if _CRC.unpack(data[_BODY.size:])[0] != zlib.crc32(body):
      return None
    magic, used, step, size, n, rel = _BODY.unpack(body)
    if magic != _MAGIC or step not in (_NONE, _ADD, _REMOVE):
      return None
    return used, step, size, os.path.join(self.root, rel[:n].decode())

  def _load(self) -> None:
    """Reads the count; settles a step a killed process left pending; recounts if damaged."""
    parsed = self._parse()
    if parsed is None:
      self.recount()
      return
    self.used, step, size, path = parsed
    if step == _NONE:
      return
    if step == _ADD:  # `path` is the temporary file: counted if it was linked into place
      if _TMP.search(path) is None:
        self.recount()
        return
      self.used += size if _same_file(path, _record_of(path)) else 0
      with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    elif not os.path.exists(path):  # _REMOVE, done
      self.used -= size
    self._store(self.used)

  def recount(self) -> None:
    """Counts the records on disk again (a walk): after the directory changed behind our back."""
    self.used = count_records(self.root)
    self._store(self.used)

  def add(self, path: str, tmp: str, size: int) -> bool:
    """Links the written temporary file `tmp` (`tmp_path(path)`, `size` bytes) into place at
    `path` (absent); the caller removes `tmp` afterwards. False if another writer's file is
    already there, or `tmp` is gone. Another OSError leaves the count exact and propagates."""
    self._store(self.used, _ADD, size, tmp)
    try:
      os.link(tmp, path)  # atomic: a reader sees the whole record or none
    except (FileExistsError, FileNotFoundError):  # a writer that does not take the lock (an
      self._store(self.used)                      # older version); tmp removed as stale
      return False
    except OSError:
      self._store(self.used)
      raise
    self.used += size
    self._store(self.used)
    return True

  def remove(self, path: str, expect: tuple[int, int, int, int] | None = None) -> bool:
    """Removes the record at `path`; False if it is not there (another process removed it) or,
    given `expect` (its `file_id`), if the file there now is another one."""
    try:
      st = os.stat(path)
    except FileNotFoundError:
      return False
    if expect is not None and file_id(st) != expect:
      return False
    size = st.st_size
    self._store(self.used, _REMOVE, size, path)
    try:
      os.remove(path)
    except FileNotFoundError:
      self._store(self.used)
      return False
    self.used -= size
    self._store(self.used)
    return True


def _subdirs(path: str) -> list[str]:
  try:
    return sorted(e.path for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
  except OSError:
    return []


def _records_by_directory(root: str) -> Iterator[list[tuple[float, str]]]:
  """[(mtime, path)] of the records under `root`, one sub-directory at a time (lazily)."""
  for identity in _subdirs(root):
    for sub in _subdirs(identity):
      batch = []
      with contextlib.suppress(OSError):
        for entry in os.scandir(sub):
          if entry.name.endswith(".rec"):
            with contextlib.suppress(FileNotFoundError):
              batch.append((entry.stat().st_mtime, entry.path))
      yield batch


class DiskTier:
  """Record files of one source under `root/<identity>/`, within a byte budget over `root`.

  `lock` guards the in-process LRU lists (`known`: records this process wrote or read; `found`:
  records found on disk); file reads and decoding happen outside it. Lock order: the ledger,
  then `lock`.
  """

  def __init__(self, root: str, identity: str, budget: int, lock: threading.Lock):
    self.root, self.budget, self.lock = root, budget, lock
    self.dir = os.path.join(root, identity)
    self.enabled = True
    self.full = False
    self.ledger = Ledger(root)
    self.known: collections.OrderedDict[str, None] = collections.OrderedDict()
    self.found: collections.OrderedDict[str, None] = collections.OrderedDict()
    self._scan = _records_by_directory(root)

  def path(self, index: int) -> str:
    return os.path.join(self.dir, f"{index % FANOUT:02x}", f"{index}.rec")

  def open(self) -> None:
    """Makes the directory and reads the ledger (a walk only if it is missing or damaged)."""
    try:
      os.makedirs(self.dir, exist_ok=True)
      with self.ledger.locked():
        pass
    except OSError as e:
      self.enabled = False
      warnings.warn(f"TieredCache: disk directory {self.root!r} is not usable ({e}); "
                    "continuing with the memory tier only", RuntimeWarning, stacklevel=4)

  def close(self) -> None:
    self.ledger.close()

  def read(self, index: int) -> tuple[str, Any]:
    """("hit", value) | ("miss", None) | ("corrupt", None) (the bad file is removed)."""
    path = self.path(index)
    try:
      with open(path, "rb") as f:
        blob = f.read()
        seen = file_id(os.fstat(f.fileno()))
    except OSError:
      return "miss", None
    try:
      value = records.decode(blob)
    except records.CorruptRecord:
      self._remove(path, seen)
      return "corrupt", None
    with self.lock:
      self.found.pop(path, None)
      self.known[path] = None
      self.known.move_to_end(path)
    return "hit", value

  def _remove(self, path: str, seen: tuple[int, int, int, int]) -> None:
    """Removes the damaged record read from `path` (`seen`: its `file_id`), unless another
    process has replaced it since (with a good record). Something outside changed the directory
    (a truncated file no longer has the size the ledger counted): the records are counted again
    (rare)."""
    with contextlib.suppress(OSError), self.ledger.locked() as ledger:
      if ledger.remove(path, expect=seen):
        ledger.recount()
    with self.lock:
      self.known.pop(path, None)
      self.found.pop(path, None)

  def _victim(self) -> str | None:
    """The next record to evict (called under the ledger's lock); None when there is none."""
    restarted = False
    while True:
      with self.lock:
        if self.found:
          return self.found.popitem(last=False)[0]
      batch = next(self._scan, None)
      with self.lock:
        if batch is not None:
          for _, path in sorted(batch):
            if path not in self.known:
              self.found[path] = None
          continue
        if self.known:
          return self.known.popitem(last=False)[0]
      if restarted:
        return None
      self._scan, restarted = _records_by_directory(self.root), True

  def write(self, index: int, blob: bytes) -> tuple[int, int, bool]:
    """Stores a record if the budget allows; returns (bytes written, evictions, write failed)."""
    size = len(blob)
    if self.full or size > self.budget:
      return 0, 0, False
    path = self.path(index)
    if os.path.exists(path):  # another process wrote it first
      return 0, 0, False
    tmp, evictions = tmp_path(path), 0
    try:
      try:
        self._write_tmp(tmp, blob)  # outside the lock: the writers of all processes in parallel
        with self.ledger.locked() as ledger:
          if os.path.exists(path):
            return 0, 0, False
          evictions = self._make_room(ledger, size)
          if ledger.used + size > self.budget or not ledger.add(path, tmp, size):
            return 0, evictions, False
      finally:
        with contextlib.suppress(FileNotFoundError):
          os.remove(tmp)
    except OSError as e:
      self._stop_writing(e)
      return 0, evictions, True
    with self.lock:
      self.known[path] = None
    return size, evictions, False

  @staticmethod
  def _write_tmp(tmp: str, blob: bytes) -> None:
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    with open(tmp, "wb") as f:
      f.write(blob)

  def _make_room(self, ledger: Ledger, size: int) -> int:
    """Evicts the oldest records until `size` more bytes fit (under the ledger's lock); returns
    the number evicted. It may not reach that (the budget is then still exceeded)."""
    evictions, recounted = 0, False
    while ledger.used + size > self.budget:
      victim = self._victim()
      if victim is None:  # none left, yet over budget: the ledger overcounts (records deleted
        if recounted:     # behind its back); count them once, then try again
          break
        ledger.recount()
        recounted = True
        continue
      evictions += ledger.remove(victim)
    return evictions

  def _stop_writing(self, error: OSError) -> None:
    """Any write error (a full disk, a read-only or vanished directory): stop writing, warn once,
    keep serving the records already on disk."""
    if not self.full:
      self.full = True
      warnings.warn(f"TieredCache: cannot write to {self.root!r} ({error}); the disk tier stops "
                    "writing and keeps serving what it holds", RuntimeWarning, stacklevel=4)

  def used_bytes(self) -> int:
    with self.ledger.locked() as ledger:
      return ledger.used
