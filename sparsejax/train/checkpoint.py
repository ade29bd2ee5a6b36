"""Checkpoints with orbax: written asynchronously and atomically (aside, then renamed), the last N
kept, each with a manifest so that a damaged one is found and skipped on restore.

A step directory `<directory>/<step>` holds orbax's files, `sparsejax_meta.json` (what the caller
passed as `meta`) and, written last, `sparsejax_manifest.json`: the relative path, size and CRC32
of every other file. The manifest is written once orbax has finalised the step (in a background
thread, so training does not wait). On restore (`restore_latest`) the newest step is used whose
files match its manifest and which orbax restores; a step without a manifest is

  * tried with orbax when it is older than every step with a manifest (or none has one): it was
    written before manifests existed;
  * skipped as half-written when an older step has a manifest: its save did not finish.

Steps newer than the one restored (damaged, half-written) are moved to `<directory>/damaged/`,
since orbax saves no step lower than its latest.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import zlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from sparsejax.train import resize
from sparsejax.train.optimizer import ChainState

__all__ = ["Checkpointer", "CheckpointError", "CheckpointMismatch", "MANIFEST", "META",
           "write_manifest", "check_manifest"]

MANIFEST = "sparsejax_manifest.json"
META = "sparsejax_meta.json"
DAMAGED = "damaged"  # the folder (in the checkpoint directory) damaged steps are moved to
_CHUNK = 1 << 24


class CheckpointError(RuntimeError):
  """No intact checkpoint to resume from; the message (one line) names each damaged step and
  file."""


class CheckpointMismatch(ValueError):
  """A checkpoint of another run (another model or chain): a leaf's shape differs for another
  reason than the number of workers."""


def _drop_empty(tree: Any) -> Any:
  """`tree` with every zero-size array replaced by None."""
  return jax.tree.map(lambda x: None if getattr(x, "size", 1) == 0 else x, tree)


def _is_chain(x: Any) -> bool:
  return isinstance(x, ChainState)


# the compressor's step counter (per worker: its leading size is the number of workers), as a
# checkpoint names it; before the chain's parts had names (a `ChainState`), by position
_COUNT_NAMES = ("opt_state.inner_state.exchange.count", "opt_state.inner_state.0.count")


def _as_written(kept: Any, saved: dict[str, tuple[int, ...]]) -> Any:
  """`kept`, or with every `ChainState` a plain tuple when the checkpoint was written before the
  chain's parts had names (it names them "0", "1", "2"). Same leaves in the same order."""
  by_position = jax.tree.map(lambda x: tuple(x) if _is_chain(x) else x, kept, is_leaf=_is_chain)
  names, old = set(resize.leaf_names(kept)), set(resize.leaf_names(by_position))
  if names != old and not names <= saved.keys() and old <= saved.keys():
    return by_position
  return kept


def _crc32(path: str) -> int:
  """The CRC32 (zlib's) of the file at `path`, read in 16 MiB chunks."""
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      crc = zlib.crc32(chunk, crc)
  return crc


def _write_atomically(path: str, content: dict[str, Any]) -> None:
  """Writes `content` as JSON to `path`: to a temporary file first, then renamed."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(content, f, indent=1, default=str)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def write_manifest(step_dir: str) -> None:
  """Writes `step_dir/MANIFEST`: {relative path: [size in bytes, CRC32]} of every file there."""
  files = {}
  for root, _, names in os.walk(step_dir):
    for name in names:
      path = os.path.join(root, name)
      rel = os.path.relpath(path, step_dir).replace(os.sep, "/")
      if rel != MANIFEST and not rel.endswith(".tmp"):
        files[rel] = [os.path.getsize(path), _crc32(path)]
  _write_atomically(os.path.join(step_dir, MANIFEST), {"format": 1, "files": dict(sorted(
      files.items()))})


def check_manifest(step_dir: str) -> str | None:
  """None when every file of `step_dir`'s manifest is there with its size and CRC32, else what
  differs first (`file: reason`). The manifest must exist."""
  try:
    with open(os.path.join(step_dir, MANIFEST)) as f:
      files = json.load(f)["files"]
  except (OSError, ValueError, KeyError) as e:
    return f"{MANIFEST}: unreadable ({type(e).__name__})"
  for rel, (size, crc) in files.items():
    path = os.path.join(step_dir, *rel.split("/"))
    if not os.path.isfile(path):
      return f"{rel}: missing"
    if os.path.getsize(path) != size:
      return f"{rel}: {os.path.getsize(path)} bytes instead of {size}"
    if _crc32(path) != crc:
      return f"{rel}: contents changed (CRC32 differs)"
  return None


def _one_line(e: BaseException) -> str:
  """`Type: first line of the message` of the error that caused `e` first (tensorstore's, not
  orbax's summary of it), at most 300 characters."""
  while e.__cause__ is not None or e.__context__ is not None:
    e = e.__cause__ or e.__context__
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  text = f"{type(e).__name__}: {lines[0] if lines else ''}"
  return text if len(text) <= 300 else text[:297] + "..."


class Checkpointer:
  """Saves and restores a train state pytree under `directory/<step>`."""

  def __init__(self, directory: str, keep: int):
    self.directory = os.path.abspath(directory)
    # the handler named, so that a new manager reads a step's metadata before any restore
    self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=True),
        item_handlers=ocp.StandardCheckpointHandler())
    self._commit: threading.Thread | None = None
    self._commit_error: BaseException | None = None

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def latest_step(self) -> int | None:
    """The newest step saved or being saved (not checked: see `restore_latest`)."""
    return self.manager.latest_step()

  def save(self, step: int, state: Any, meta: dict[str, Any] | None = None) -> None:
    """Starts writing `state` (and the JSON-able `meta`) as step `step`; returns once the arrays
    are copied off the devices. The files and the manifest are written in the background
    (`wait` waits for them). A step already saved is left as it is."""
    self.wait()
    if step in self.manager.all_steps():
      return
    # orbax cannot write zero-size arrays (sparsejax's own states hold none, a user's model or
    # transform may): they are left out and rebuilt from `like` on restore
    self.manager.save(step, args=ocp.args.StandardSave(_drop_empty(state)))
    self._commit = threading.Thread(target=self._finish_save, args=(step, meta),
                                    name=f"sparsejax-checkpoint-{step}", daemon=True)
    self._commit.start()

  def _finish_save(self, step: int, meta: dict[str, Any] | None) -> None:
    """In the background: waits for orbax to finalise `step`, then writes its meta and manifest
    (the first process only)."""
    try:
      self.manager.wait_until_finished()
      if jax.process_index() == 0 and os.path.isdir(self._step_dir(step)):
        if meta is not None:
          _write_atomically(os.path.join(self._step_dir(step), META), meta)
        write_manifest(self._step_dir(step))
    except BaseException as e:  # noqa: BLE001 - raised again in the main thread by `wait`
      self._commit_error = e

  def wait(self) -> None:
    """Waits until the last save is on disk with its manifest; raises what it raised."""
    if self._commit is not None:
      self._commit.join()
      self._commit = None
    error, self._commit_error = self._commit_error, None
    if error is not None:
      raise error

  def meta(self, step: int) -> dict[str, Any] | None:
    """The `meta` saved with `step`, None if there is none."""
    try:
      with open(os.path.join(self._step_dir(step), META)) as f:
        return json.load(f)
    except (OSError, ValueError):
      return None

  def saved_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
    """{leaf name: shape} of the state saved at `step` (from its metadata, nothing read)."""
    out: dict[str, tuple[int, ...]] = {}

    def walk(t: Any) -> None:
      if hasattr(t, "name") and hasattr(t, "shape"):
        out[t.name] = tuple(t.shape)
      elif isinstance(t, dict):
        for v in t.values():
          walk(v)
      elif isinstance(t, list | tuple):
        for v in t:
          walk(v)
    walk(self.manager.item_metadata(step).tree)
    return out

  def restore(self, step: int, like: Any) -> Any:
    """The state saved at `step`, with the structure, shapes and shardings of `like`. A state
    saved by another number of workers (a `TrainState` whose per-worker parts have another
    leading size) is read as it was saved and resized for `like`'s workers
    (`sparsejax.train.resize`). A save in progress is finished first."""
    self.wait()
    kept = _drop_empty(like)
    saved = self.saved_shapes(step)
    written = _as_written(kept, saved)
    names = resize.leaf_names(written)
    differ = [(n, saved[n], x.shape) for n, x in zip(names, jax.tree.leaves(kept))
              if n in saved and saved[n] != x.shape]
    if differ:
      workers = next((saved[n][0] for n in _COUNT_NAMES if saved.get(n)), None)
      if workers is None or workers == resize.workers_of(like):
        n, got, want = differ[0]
        raise CheckpointMismatch(f"checkpoint step {step} in {self.directory} does not fit "
                                 f"this run: "
                         f"{n} has shape {got}, the run's state {want}")
      restored = self._restore_resized(step, kept, saved, names, written)
    else:
      abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, written)
      restored = jax.tree.structure(kept).unflatten(jax.tree.leaves(
          self.manager.restore(step, args=ocp.args.StandardRestore(abstract))))
    return jax.tree.map(lambda got, want: want if got is None else got, restored, like,
                        is_leaf=lambda x: x is None)

  def _restore_resized(self, step: int, like: Any, saved: dict[str, tuple[int, ...]],
                       names: list[str], written: Any) -> Any:
    """The state of `step` read with its own shapes (replicated), resized, placed as `like`
    (`written`: `like` as the checkpoint names its parts, `_as_written`)."""
    leaves, treedef = jax.tree.flatten(like)
    mesh = next(x.sharding.mesh for x in leaves if hasattr(x.sharding, "mesh"))
    whole = NamedSharding(mesh, PartitionSpec())
    abstract = jax.tree.structure(written).unflatten([
        jax.ShapeDtypeStruct(saved[n], x.dtype, sharding=whole) for n, x in zip(names, leaves)])
    got = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    host = treedef.unflatten([np.asarray(x.addressable_data(0)) for x in jax.tree.leaves(got)])
    print(f"checkpoint step {step} was written by {resize.workers_of(host)} workers; resized "
          f"for {resize.workers_of(like)} (their memory keeps the update not yet sent)",
          flush=True)
    resized = jax.tree.leaves(resize.resize_state(host, like))
    return treedef.unflatten([jax.make_array_from_callback(x.shape, x.sharding,
                                                           lambda i, h=h: h[i])
                              for h, x in zip(resized, leaves)])

  def _problem(self, step: int, oldest_manifest: int | None) -> str | None:
    """What is wrong with `step`'s files (`file: reason`), None when nothing is known to be."""
    if os.path.exists(os.path.join(self._step_dir(step), MANIFEST)):
      return check_manifest(self._step_dir(step))
    if oldest_manifest is not None and step > oldest_manifest:
      return f"{MANIFEST}: missing (a save that did not finish)"
    return None  # written before manifests existed: orbax decides

  def restore_latest(self, like: Any, place: Callable[[Any], Any] = lambda s: s
                     ) -> tuple[int, Any]:
    """(step, `place(state)`) of the newest intact checkpoint, (0, `like`) when there is none.
    Newer damaged steps are moved aside, with one line on stderr naming them; raises
    CheckpointError when every step is damaged."""
    self.wait()
    steps = sorted(self.manager.all_steps(), reverse=True)
    with_manifest = [s for s in steps if os.path.exists(os.path.join(self._step_dir(s), MANIFEST))]
    oldest_manifest = min(with_manifest, default=None)
    damaged: list[tuple[int, str]] = []
    for step in steps:
      problem = self._problem(step, oldest_manifest)
      if problem is None:
        try:
          state = jax.block_until_ready(place(self.restore(step, like)))
        except CheckpointMismatch:
          raise  # another run's checkpoint, not a damaged one
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
          problem = f"orbax cannot restore it: {_one_line(e)}"
      if problem is None:
        if damaged:
          self._set_aside(damaged, step)
        return step, state
      damaged.append((step, problem))
    if damaged:
      raise CheckpointError(
          f"no intact checkpoint in {self.directory}: {_list(damaged)}; move the directory "
          "away to train from scratch")
    return 0, like

  def _set_aside(self, damaged: list[tuple[int, str]], used: int) -> None:
    """Moves the `damaged` steps to `directory/damaged/` and says so in one line."""
    aside = os.path.join(self.directory, DAMAGED)
    if jax.process_index() == 0:
      os.makedirs(aside, exist_ok=True)
      for step, _ in damaged:
        target, n = os.path.join(aside, str(step)), 1
        while os.path.exists(target):
          target, n = os.path.join(aside, f"{step}.{n}"), n + 1
        shutil.move(self._step_dir(step), target)
      print(f"sparsejax: damaged checkpoint{'s' if len(damaged) > 1 else ''} "
            f"{_list(damaged)}, moved to {aside}; resuming from step {used}",
            file=sys.stderr, flush=True)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices("sparsejax: damaged checkpoints set aside")
    self.manager.reload()

  def close(self) -> None:
    """Waits for the last save (and its manifest), then closes orbax's manager."""
    try:
      self.wait()
    finally:
      self.manager.close()


def _list(damaged: list[tuple[int, str]]) -> str:
  """`step 20 (file: reason), step 10 (...)`."""
  return ", ".join(f"step {step} ({problem})" for step, problem in damaged)
