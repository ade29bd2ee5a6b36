"""Checkpoints with orbax: atomic (written aside, then renamed), the last N kept."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from sparsejax.train import resize

__all__ = ["Checkpointer"]


def _drop_empty(tree: Any) -> Any:
  """`tree` with every zero-size array replaced by None."""
  return jax.tree.map(lambda x: None if getattr(x, "size", 1) == 0 else x, tree)


class Checkpointer:
  """Saves and restores a train state pytree under `directory/<step>`."""

  def __init__(self, directory: str, keep: int):
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any) -> None:
    """Writes `state` as step `step` and waits until it is on disk."""
    if step in self.manager.all_steps():
      return
    # orbax cannot write zero-size arrays (sparsejax's own states hold none, a user's model or
    # transform may): they are left out and rebuilt from `like` on restore
    self.manager.save(step, args=ocp.args.StandardSave(_drop_empty(state)))
    self.manager.wait_until_finished()

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
    (`sparsejax.train.resize`)."""
    kept = _drop_empty(like)
    saved = self.saved_shapes(step)
    names = resize.leaf_names(kept)
    differ = [(n, saved[n], x.shape) for n, x in zip(names, jax.tree.leaves(kept))
              if n in saved and saved[n] != x.shape]
    if differ:
      workers = saved.get("opt_state.inner_state.0.count", (None,))[0]
      if workers is None or workers == resize.workers_of(like):
        n, got, want = differ[0]
        raise ValueError(f"checkpoint step {step} in {self.directory} does not fit this run: "
                         f"{n} has shape {got}, the run's state {want}")
      restored = self._restore_resized(step, kept, saved, names)
    else:
      abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, kept)
      restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    return jax.tree.map(lambda got, want: want if got is None else got, restored, like,
                        is_leaf=lambda x: x is None)

  def _restore_resized(self, step: int, like: Any, saved: dict[str, tuple[int, ...]],
                       names: list[str]) -> Any:
    """The state of `step` read with its own shapes (replicated), resized, placed as `like`."""
    leaves, treedef = jax.tree.flatten(like)
    mesh = next(x.sharding.mesh for x in leaves if hasattr(x.sharding, "mesh"))
    whole = NamedSharding(mesh, PartitionSpec())
    abstract = treedef.unflatten([jax.ShapeDtypeStruct(saved[n], x.dtype, sharding=whole)
                                  for n, x in zip(names, leaves)])
    got = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    host = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), got)
    print(f"checkpoint step {step} was written by {resize.workers_of(host)} workers; resized "
          f"for {resize.workers_of(like)} (their memory keeps the update not yet sent)",
          flush=True)
    resized = jax.tree.leaves(resize.resize_state(host, like))
    return treedef.unflatten([jax.make_array_from_callback(x.shape, x.sharding,
                                                           lambda i, h=h: h[i])
                              for h, x in zip(resized, leaves)])

  def close(self) -> None:
    self.manager.close()
