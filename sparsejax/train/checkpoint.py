"""Checkpoints with orbax: atomic (written aside, then renamed), the last N kept."""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

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

  def restore(self, step: int, like: Any) -> Any:
    """The state saved at `step`, with the structure, shapes and shardings of `like`."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _drop_empty(like))
    restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    return jax.tree.map(lambda got, want: want if got is None else got, restored, like,
                        is_leaf=lambda x: x is None)

  def close(self) -> None:
    self.manager.close()
