"""TieredCache, RemoteSource and the record format: tiers, warm restarts, checksums, budgets."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
import warnings

import grain
import numpy as np
import pytest

from sparsejax.data import RemoteSource, TieredCache, disk, records
from sparsejax.data.loader import prefetch


class Source:
  """A deterministic source of dict records of varied sizes (a stand-in for encoded images)."""

  def __init__(self, n: int, seed: int = 0):
    self.n, self.seed = n, seed
    self.reads = 0

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    self.reads += 1
    rng = np.random.default_rng((self.seed, i))
    size = int(rng.integers(50, 700))
    return {"image": rng.integers(0, 256, size, dtype=np.uint8).tobytes(), "label": int(i),
            "scale": np.float32(rng.standard_normal())}

  def __repr__(self):
    return f"Source(n={self.n}, seed={self.seed})"


def same(a, b) -> bool:
  return (a["image"] == b["image"] and a["label"] == b["label"]
          and np.asarray(a["scale"]) == np.asarray(b["scale"]))


def disk_files(root) -> dict[str, int]:
  out = {}
  for d, _, files in os.walk(root):
    for f in files:
      if f.endswith(".rec"):
        out[os.path.join(d, f)] = os.path.getsize(os.path.join(d, f))
  return out


# ----------------------------------------------------------------------------- the record format

def test_records_round_trip_values_of_every_allowed_kind():
  rng = np.random.default_rng(3)
  value = {
      "bytes": rng.bytes(37), "empty": b"", "text": "héllo\n", "int": -7, "big": 2**62,
      "float": 0.1, "nan": float("nan"), "inf": float("-inf"), "none": None, "flag": True,
      "f16": rng.standard_normal((3, 5, 7)).astype(np.float16),
      "u8": rng.integers(0, 255, (13, 11, 3), dtype=np.uint8), "bools": rng.random(9) > 0.5,
      "c64": (rng.standard_normal(4) + 1j).astype(np.complex64), "scalar": np.int16(-3),
      "zero_d": np.array(2.5), "empty_arr": np.zeros((0, 3), np.int64),
      "nested": [(1, "a"), {"x": np.arange(5, dtype=">i4")}],
  }
  out = records.decode(records.encode(value))
  assert out.keys() == value.keys()
  for k, v in value.items():
    if isinstance(v, np.ndarray | np.generic):
      assert out[k].dtype == np.asarray(v).dtype and out[k].shape == np.shape(v), k
      np.testing.assert_array_equal(out[k], v)
    elif isinstance(v, float) and np.isnan(v):
      assert np.isnan(out[k])
    elif k != "nested":
      assert out[k] == v and type(out[k]) is type(v), k
  assert out["nested"][0] == (1, "a") and isinstance(out["nested"][0], tuple)
  np.testing.assert_array_equal(out["nested"][1]["x"], np.arange(5))


@pytest.mark.parametrize("bad, match", [
    (np.array([object()]), "dtype object"),
    ({1: 2}, "key 1"),
    ({"a": {1, 2}}, "type set"),
])
def test_records_refuse_what_they_cannot_store_safely(bad, match):
  with pytest.raises(TypeError, match=match):
    records.encode(bad)


def test_records_detect_every_truncation_and_any_flipped_byte():
  blob = records.encode({"image": b"\xff\xd8" * 40, "label": 3})
  for cut in range(len(blob)):
    with pytest.raises(records.CorruptRecord):
      records.decode(blob[:cut])
  rng = np.random.default_rng(0)
  for pos in rng.choice(len(blob), 25, replace=False):
    altered = bytearray(blob)
    altered[pos] ^= 1 << int(rng.integers(8))
    with pytest.raises(records.CorruptRecord):
      records.decode(bytes(altered))


def test_records_never_unpickle_even_with_a_valid_checksum():
  """A cache file written by someone else: a header asking for an object array is refused."""
  import json
  import struct
  import zlib
  header = json.dumps({"t": "nd", "dtype": "|O", "shape": [1], "o": 0, "n": 8}).encode()
  body = struct.pack("<I", len(header)) + header + b"\0" * 8
  blob = records.MAGIC + body + struct.pack("<I", zlib.crc32(body))
  with pytest.raises(records.CorruptRecord, match="not allowed"):
    records.decode(blob)


# ----------------------------------------------------------------------------- tiers and counters

def test_hits_and_misses_per_tier(tmp_path):
  src = Source(23)
  cache = TieredCache(src, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20)
  assert len(cache) == 23 and repr(cache) == "TieredCache(Source(n=23, seed=0))"
  for i in range(23):
    assert same(cache[i], Source(23)[i])
  s = cache.stats()
  assert s["memory"]["hits"] == 0 and s["memory"]["misses"] == 23
  assert s["disk"]["hits"] == 0 and s["disk"]["misses"] == 23
  assert s["source"]["reads"] == 23 and src.reads == 23
  assert s["disk"]["bytes"] == s["disk"]["bytes_written"] == sum(disk_files(tmp_path).values())
  for i in reversed(range(23)):
    assert same(cache[i], Source(23)[i])
  s = cache.stats()
  assert s["memory"]["hits"] == 23 and s["source"]["reads"] == 23 and src.reads == 23
  assert s["memory"]["bytes"] == sum(records.nbytes_of(Source(23)[i]) for i in range(23))


def test_a_restart_finds_the_disk_tier_warm(tmp_path):
  first = TieredCache(Source(17), memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20)
  for i in range(17):
    first[i]
  del first
  src = Source(17)
  again = TieredCache(src, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20)
  for i in range(17):
    assert same(again[i], Source(17)[i])
  s = again.stats()
  assert src.reads == 0 and s["disk"]["hits"] == 17 and s["source"]["reads"] == 0
  assert s["disk"]["bytes"] == sum(disk_files(tmp_path).values())


def test_a_damaged_record_replaced_meanwhile_by_a_good_one_is_not_removed(tmp_path):
  """A reader that found a record damaged removes it only if it is still that file: another
  process may have found it too, removed it and written a good record in its place."""
  first = TieredCache(Source(3), memory_bytes=1, disk_dir=tmp_path, disk_bytes=1 << 20)
  first[0]
  path = first._disk.path(0)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 5)
  seen = disk.file_id(os.stat(path))  # what the first reader saw
  other = TieredCache(Source(3), memory_bytes=1, disk_dir=tmp_path, disk_bytes=1 << 20)
  assert same(other[0], Source(3)[0]) and other.stats()["disk"]["corrupt"] == 1
  first._disk._remove(path, seen)  # the first reader's removal, late
  assert os.path.exists(path)
  assert same(first[0], Source(3)[0]) and first.stats()["disk"]["hits"] == 1
  assert first.stats()["disk"]["bytes"] == sum(disk_files(tmp_path).values())
  first._disk._remove(path, disk.file_id(os.stat(path)))  # the same file: removed
  assert not os.path.exists(path)


def test_a_damaged_disk_record_is_detected_fetched_again_and_counted(tmp_path):
  warm = TieredCache(Source(9), memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20)
  for i in range(9):
    warm[i]
  files = sorted(disk_files(tmp_path))
  truncated, altered = files[2], files[5]
  with open(truncated, "r+b") as f:
    f.truncate(os.path.getsize(truncated) - 3)
  with open(altered, "r+b") as f:
    f.seek(40)
    byte = f.read(1)
    f.seek(40)
    f.write(bytes([byte[0] ^ 0x10]))
  src = Source(9)
  cache = TieredCache(src, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20)
  for i in range(9):
    assert same(cache[i], Source(9)[i]), i
  s = cache.stats()
  assert s["disk"]["corrupt"] == 2 and s["source"]["reads"] == 2 and src.reads == 2
  assert s["disk"]["hits"] == 7
  # Fetched again and rewritten whole: a third process reads everything from disk.
  third = TieredCache(Source(9), memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20)
  for i in range(9):
    third[i]
  assert third.stats()["disk"]["hits"] == 9 and third.stats()["disk"]["corrupt"] == 0
  assert third.stats()["disk"]["bytes"] == sum(disk_files(tmp_path).values())


def test_eviction_keeps_each_tier_within_its_budget(tmp_path):
  mem_budget, disk_budget = 3000, 5000
  src = Source(60)
  cache = TieredCache(src, memory_bytes=mem_budget, disk_dir=tmp_path, disk_bytes=disk_budget)
  rng = np.random.default_rng(1)
  for i in rng.integers(0, 60, 400):
    assert same(cache[int(i)], Source(60)[int(i)])
    s = cache.stats()
    assert 0 < s["memory"]["bytes"] <= mem_budget
    assert 0 < s["disk"]["bytes"] <= disk_budget
  assert s["memory"]["evictions"] > 0 and s["disk"]["evictions"] > 0
  assert s["disk"]["bytes"] == sum(disk_files(tmp_path).values())
  assert s["memory"]["hits"] + s["memory"]["misses"] == 400
  assert s["disk"]["hits"] + s["disk"]["misses"] == s["memory"]["misses"]


def test_two_sources_never_share_entries(tmp_path):
  a = TieredCache(Source(10, seed=1), memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20)
  b = TieredCache(Source(10, seed=2), memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20)
  for i in range(10):
    assert same(a[i], Source(10, seed=1)[i]) and same(b[i], Source(10, seed=2)[i])
  b2 = TieredCache(Source(10, seed=2), memory_bytes=1 << 20, disk_dir=tmp_path,
                   disk_bytes=1 << 20)
  for i in range(10):
    assert same(b2[i], Source(10, seed=2)[i])
  assert b2.stats()["disk"]["hits"] == 10 and len(disk_files(tmp_path)) == 20


def test_records_from_memory_are_read_only():
  class Arrays(Source):
    def __getitem__(self, i):
      return {"x": np.arange(4) + i}

  cache = TieredCache(Arrays(3), memory_bytes=1 << 20)
  x = cache[1]["x"]
  with pytest.raises(ValueError, match="read-only"):
    x[0] = 99
  np.testing.assert_array_equal(cache[1]["x"], [1, 2, 3, 4])


def test_thread_safe_under_concurrent_readers(tmp_path):
  cache = TieredCache(Source(50), memory_bytes=8000, disk_dir=tmp_path, disk_bytes=12000)
  ref = [Source(50)[i] for i in range(50)]
  idx = np.random.default_rng(2).integers(0, 50, 600)
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    got = list(pool.map(lambda i: cache[int(i)], idx))
  assert all(same(g, ref[int(i)]) for g, i in zip(got, idx))
  s = cache.stats()
  assert s["memory"]["hits"] + s["memory"]["misses"] == 600
  assert s["memory"]["bytes"] <= 8000 and s["disk"]["bytes"] <= 12000
  assert s["disk"]["bytes"] == sum(disk_files(tmp_path).values())


def test_pickled_copies_share_counters_and_disk(tmp_path):
  cache = TieredCache(Source(8), memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20)
  for i in range(4):
    cache[i]
  copy = pickle.loads(pickle.dumps(cache))
  for i in range(8):
    assert same(copy[i], Source(8)[i])
  s = cache.stats()  # the original sees the copy's reads
  assert s["disk"]["hits"] == 4 and s["source"]["reads"] == 8


@pytest.mark.integration  # end to end: grain's worker processes (about 10 s)
def test_works_with_grain_multiprocess_workers(tmp_path):
  n = 24
  cache = TieredCache(Source(n), memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20)

  def run():
    return sorted(prefetch(grain.MapDataset.source(cache).map(lambda r: r["label"]), workers=2))

  assert run() == list(range(n))
  s = cache.stats()  # summed over the worker processes
  assert s["source"]["reads"] == n and s["disk"]["misses"] == n
  assert run() == list(range(n))  # fresh workers: their memory is empty, the disk is warm
  s = cache.stats()
  assert s["source"]["reads"] == n and s["disk"]["hits"] == n


# ----------------------------------------------------------------------------- the disk ledger

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WRITER = """
import json, os, sys, time
import numpy as np
from sparsejax.data import TieredCache

class Blobs:
  def __len__(self):
    return 160
  def __getitem__(self, i):
    return {"b": bytes([i % 251]) * (20_000 + 3_001 * (i % 29))}
  def __repr__(self):
    return "Blobs(160)"

root, me, budget, sync = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
order = np.random.default_rng(int(me)).permutation(160)
count, reopen = (60, 2) if me == "1" else (160, 10**9)
while not os.path.exists(os.path.join(sync, "go")):
  time.sleep(0.001)
for n, i in enumerate(order[:count]):
  if n % reopen == 0:  # a grain worker starting, or a copy unpickled: the cache is opened again
    cache = TieredCache(Blobs(), memory_bytes=1, disk_dir=root, disk_bytes=budget)
  cache[int(i)]
open(os.path.join(sync, "done" + me), "w").close()
while len([f for f in os.listdir(sync) if f.startswith("done")]) < 2:
  time.sleep(0.001)
print(json.dumps(cache.stats()["disk"]))
"""


def _python(code: str, *args: str, **popen) -> subprocess.Popen:
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  return subprocess.Popen([sys.executable, "-c", code, *args], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


@pytest.mark.integration  # end to end: two processes
def test_two_processes_writing_one_directory_keep_the_byte_count_exact(tmp_path):
  """Both write (and evict); one reopens its cache every other record (a grain worker starting,
  a copy unpickled) while the other writes on. Neither loses the other's bytes: the count each
  reads at the end, without reopening, is the bytes on disk."""
  root, sync, budget = tmp_path / "cache", tmp_path / "sync", 3_000_000
  sync.mkdir()
  procs = [_python(_WRITER, str(root), me, str(budget), str(sync)) for me in ("1", "2")]
  time.sleep(0.5)
  (sync / "go").touch()
  outs = [p.communicate(timeout=120) for p in procs]
  assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
  on_disk = sum(disk_files(root).values())
  for out, _ in outs:
    disk = json.loads(out)
    assert disk["bytes"] == on_disk, (disk, on_disk)
  assert json.loads(outs[1][0])["evictions"] > 0
  assert 0 < on_disk <= budget
  assert not [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]
  fresh = TieredCache(Source(1), memory_bytes=1, disk_dir=root, disk_bytes=budget)
  assert fresh.stats()["disk"]["bytes"] == on_disk


def test_records_deleted_behind_the_ledgers_back_are_recounted_and_writing_goes_on(tmp_path):
  """The ledger overcounts once records vanish without it (a user's rm): a write that finds no
  victim left while still over budget counts the directory again instead of refusing forever."""
  budget = 8000
  first = TieredCache(Source(40), memory_bytes=1, disk_dir=tmp_path, disk_bytes=budget)
  for i in range(40):
    first[i]
  assert first.stats()["disk"]["bytes"] > budget - 1000
  for path in disk_files(tmp_path):
    os.remove(path)
  for cache in (first, TieredCache(Source(40, seed=1), memory_bytes=1, disk_dir=tmp_path,
                                   disk_bytes=budget)):
    before = cache.stats()["disk"]["bytes_written"]
    for i in range(40):  # past the budget (the old code refused every one of these writes)
      cache[i]
    s = cache.stats()["disk"]
    assert s["bytes_written"] > before and s["write_errors"] == 0
    assert 0 < s["bytes"] == sum(disk_files(tmp_path).values()) <= budget
    for path in disk_files(tmp_path):
      os.remove(path)


def test_a_record_is_written_outside_the_lock_and_only_linked_under_it(tmp_path):
  """While another process (here: another open file description) holds the ledger's lock, a
  writer already writes its record's temporary file; it links it once the lock is free."""
  cache = TieredCache(Source(3), memory_bytes=1, disk_dir=tmp_path, disk_bytes=1 << 20)
  tmps = lambda: [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")]  # noqa: E731
  writer = threading.Thread(target=cache.__getitem__, args=(1,))
  with disk.Ledger(str(tmp_path)).locked():
    writer.start()
    deadline = time.monotonic() + 5
    while not tmps() and time.monotonic() < deadline:
      time.sleep(0.002)
    assert len(tmps()) == 1 and tmps()[0].startswith(f"1.rec.{os.getpid()}-")
    assert disk_files(tmp_path) == {}  # not linked while the lock is held elsewhere
  writer.join(10)
  assert not writer.is_alive() and tmps() == []
  assert cache.stats()["disk"]["bytes"] == sum(disk_files(tmp_path).values()) > 0


def test_a_walk_removes_only_the_temporary_files_of_killed_writers(tmp_path):
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  d = tmp_path / "src" / "00"
  d.mkdir(parents=True)
  (d / "0.rec").write_bytes(b"r" * 100)
  names = {"killed": f"1.rec.{int(dead.stdout)}-7.tmp",  # its process is gone
           "old": f"2.rec.{os.getpid()}-7.tmp",           # alive (pid reused?) but an hour old
           "older_version": "3.rec.tmp",                  # written under the lock: orphaned
           "in_flight": f"4.rec.{os.getpid()}-7.tmp",     # a live writer's: kept
           "parent": f"5.rec.{os.getppid()}-7.tmp"}       # another live process's: kept
  for name in names.values():
    (d / name).write_bytes(b"t" * 10)
  hour_ago = time.time() - disk.STALE_TMP_S - 60
  os.utime(d / names["old"], (hour_ago, hour_ago))
  assert disk.count_records(str(tmp_path)) == 100
  assert sorted(os.listdir(d)) == sorted(["0.rec", names["in_flight"], names["parent"]])


def test_opening_trusts_the_ledger_and_recounts_only_when_it_is_missing_or_damaged(tmp_path):
  cache = TieredCache(Source(12), memory_bytes=1, disk_dir=tmp_path, disk_bytes=1 << 20)
  for i in range(12):
    cache[i]
  counted = sum(disk_files(tmp_path).values())
  assert cache.stats()["disk"]["bytes"] == counted
  (tmp_path / "stray.rec").write_bytes(b"x" * 1000)  # behind the ledger's back: not walked for
  reopen = lambda: TieredCache(Source(12), memory_bytes=1, disk_dir=tmp_path,  # noqa: E731
                               disk_bytes=1 << 20).stats()["disk"]["bytes"]
  assert reopen() == counted
  usage = tmp_path / ".usage"
  data = bytearray(usage.read_bytes())
  data[9] ^= 0x01  # a flipped bit in the count: damaged, recounted
  usage.write_bytes(bytes(data))
  assert reopen() == counted + 1000
  usage.unlink()  # missing: recounted
  (tmp_path / "stray.rec").unlink()
  assert reopen() == counted
  usage.write_bytes(struct.pack("<q", 5))  # the ledger of an older version: recounted
  assert reopen() == counted


_FORKED = """
import os, sys, time
from sparsejax.data import TieredCache

cache = TieredCache(list(range(4)), memory_bytes=1, disk_dir=sys.argv[1], disk_bytes=1 << 20,
                    key="ints")  # opening opens the ledger: the child inherits its descriptor
ledger = cache._disk.ledger
go_r, go_w = os.pipe()
log_r, log_w = os.pipe()
pid = os.fork()
if pid == 0:
  os.read(go_r, 1)  # the parent holds the lock now
  with ledger.locked():
    os.write(log_w, b"c")
  os._exit(0)
with ledger.locked():
  os.write(go_w, b"x")
  time.sleep(0.3)
  os.write(log_w, b"p")
os.waitpid(pid, 0)
os.close(log_w)
print(os.read(log_r, 8).decode())
"""


def test_a_forked_child_does_not_share_its_parents_ledger_lock(tmp_path):
  """flock belongs to the open file description, which fork shares: the child reopens the
  ledger, so it waits for its parent to release the lock."""
  proc = _python(_FORKED, str(tmp_path))
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 0, err
  assert out.strip() == "pc"  # the child took the lock only once the parent released it


_KILLED = """
import os, sys
from sparsejax.data import TieredCache

class Blobs:
  def __len__(self):
    return 10
  def __getitem__(self, i):
    return {"b": bytes([i]) * 3000}
  def __repr__(self):
    return "Blobs(10)"

real_link = os.link
def die(src, dst):  # killed just before or just after linking the record into place
  if sys.argv[2] == "after":
    real_link(src, dst)
  os._exit(3)

cache = TieredCache(Blobs(), memory_bytes=1, disk_dir=sys.argv[1], disk_bytes=1 << 20)
cache[0]
os.link = die
cache[1]
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_writer_killed_mid_write_leaves_a_step_the_next_opener_settles(tmp_path, when):
  proc = _python(_KILLED, str(tmp_path), when)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 3, err
  files = disk_files(tmp_path)
  assert len(files) == 1 + (when == "after")
  cache = TieredCache(Source(2), memory_bytes=1, disk_dir=tmp_path, disk_bytes=1 << 20)
  assert cache.stats()["disk"]["bytes"] == sum(files.values())
  leftovers = [f for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")]
  assert leftovers == []


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs, match", [
    ({"memory_bytes": 0}, "memory_bytes must be a positive number of bytes, got 0"),
    ({"memory_bytes": -5}, "got -5"),
    ({"memory_bytes": 100, "disk_dir": "some/dir", "disk_bytes": 0}, "disk_bytes must be"),
    ({"memory_bytes": 100, "disk_dir": "some/dir"}, "disk_bytes must be"),
    ({"memory_bytes": 100, "disk_bytes": 10}, "without disk_dir"),
])
def test_bad_budgets_are_clear_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    TieredCache(Source(3), **kwargs)


def test_index_out_of_range_or_of_the_wrong_type():
  cache = TieredCache(Source(5), memory_bytes=1000)
  with pytest.raises(IndexError, match=r"record index 5 out of range .* 5 records"):
    cache[5]
  with pytest.raises(IndexError, match="-6"):
    cache[-6]
  with pytest.raises(TypeError, match="must be an int, got str"):
    cache["1"]
  assert same(cache[-1], Source(5)[4])
  with pytest.raises(IndexError, match="out of range"):
    RemoteSource(Source(5), latency_s=0, bandwidth_bytes_per_s=1e9)[7]


def test_an_unstable_repr_needs_a_key(tmp_path):
  class NoRepr:
    def __len__(self):
      return 2

    def __getitem__(self, i):
      return b"x"

  with pytest.raises(ValueError, match="repr is not stable.*key="):
    TieredCache(NoRepr(), memory_bytes=100, disk_dir=tmp_path, disk_bytes=100)
  assert TieredCache(NoRepr(), memory_bytes=100, key="noreprs-v1")[1] == b"x"


def test_an_unwritable_disk_directory_warns_once_then_serves_from_memory(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cache = TieredCache(Source(6), memory_bytes=1 << 20, disk_dir=blocker / "cache",
                        disk_bytes=1 << 20)
    for i in list(range(6)) * 2:
      assert same(cache[i], Source(6)[i])
  msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
  assert len(msgs) == 1 and "memory tier only" in msgs[0] and "a_file" in msgs[0]
  assert cache.stats()["memory"]["hits"] == 6


@pytest.fixture
def tiny_filesystem(tmp_path):
  """A real 64 KiB tmpfs (needs root; CI runs as root)."""
  mnt = tmp_path / "tiny"
  mnt.mkdir()
  res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
  if res.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()}): run as root, e.g. "
                "sudo -E python -m pytest -q")
  yield mnt
  subprocess.run(["umount", "--lazy", str(mnt)], check=True)


def test_a_disk_that_fills_up_stops_writing_and_keeps_serving(tiny_filesystem):
  class Big(Source):
    def __getitem__(self, i):
      return {"blob": bytes([i % 256]) * 9000, "label": i}

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cache = TieredCache(Big(20), memory_bytes=20000, disk_dir=tiny_filesystem,
                        disk_bytes=10 << 20)
    for _ in range(2):
      for i in range(20):
        r = cache[i]
        assert r["blob"] == bytes([i % 256]) * 9000 and r["label"] == i
  msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
  assert len(msgs) == 1 and "stops writing" in msgs[0]
  s = cache.stats()
  assert s["disk"]["write_errors"] == 1 and 0 < s["disk"]["bytes"] < 64 * 1024
  assert s["disk"]["hits"] > 0  # what made it to disk is still served
  assert s["disk"]["bytes"] == sum(disk_files(tiny_filesystem).values())
  cache.close()


# ----------------------------------------------------------------------------- RemoteSource

def test_remote_source_waits_latency_and_shares_its_bandwidth():
  src = Source(12)
  nbytes = sum(records.nbytes_of(src[i]) for i in range(12))
  remote = RemoteSource(Source(12), latency_s=0.02, bandwidth_bytes_per_s=nbytes / 0.3)
  assert repr(remote).startswith("RemoteSource(Source(n=12, seed=0), latency_s=0.02")
  t0 = time.perf_counter()
  for i in range(4):
    assert same(remote[i], src[i])
  serial = time.perf_counter() - t0
  assert serial >= 4 * 0.02  # each read waits its latency
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    list(pool.map(remote.__getitem__, range(12)))
  parallel = time.perf_counter() - t0
  assert parallel >= 0.3 * 0.99  # one shared link: all the bytes at the given bandwidth
  assert remote.stats() == {"reads": 16, "bytes": nbytes + sum(
      records.nbytes_of(src[i]) for i in range(4))}
  copy = pickle.loads(pickle.dumps(remote))
  copy[0]
  assert remote.stats()["reads"] == 17


@pytest.mark.parametrize("kwargs, match", [
    ({"latency_s": -1, "bandwidth_bytes_per_s": 1}, "latency_s must be >= 0"),
    ({"latency_s": 0, "bandwidth_bytes_per_s": 0}, "bandwidth_bytes_per_s must be > 0, got 0"),
])
def test_remote_source_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    RemoteSource(Source(2), **kwargs)
