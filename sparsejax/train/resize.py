"""A train state saved by one number of workers, continued by another (a node lost or added).

Most of the state is the same on every worker (parameters, the optimizer's moments, counters)
and carries over as it is. What differs per worker is the compressor's memory (the error
feedback residual and, with momentum correction, the velocity) and BatchNorm's statistics. The
memory is gradient mass not sent yet; the exchange applies the MEAN over the workers of what they
send (`topk_allreduce` divides by the worker count), so what a resize must keep is the update
still to come, U = (sum of the residuals) / W, not the raw sum:

  flat algorithms (allgather, gtopk): every worker's residual is a whole buffer;
    U = sum_w r_w / W, and each of the W' new workers gets r'_j = U (sum_j r'_j / W' = U).
  hierarchical ones (hitopk, higtopk): worker i of a node holds shard i of its node's summed
    gradient; U_i = sum over nodes of r_(node, i) / W, and worker i of every new node gets
    r'_(j, i) = L' U_i (L' workers a node; their shards' sum over the N' nodes, over W', is U_i).

(So sum_j r'_j = (W' / W) sum_w r_w: the raw sum scales with the worker count, the update it
stands for does not. Velocities follow the same rule: the applied momentum is their mean.) The
flat parameters are padded to a multiple of the workers a node, so a change of that count
re-pads every buffer of the parameters' length (the padding is zeros). BatchNorm statistics: the
mean over the old workers, on every new one. The global batch stays the config's (every schedule
and the data position are functions of the step): the new worker count must divide it.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from sparsejax.compress import ExchangeState
from sparsejax.feedback import Feedback
from sparsejax.train.optimizer import chain_parts

__all__ = ["leaf_names", "workers_of", "resize_state", "redistribute"]


def leaf_names(tree: Any) -> list[str]:
  """Each leaf's name as orbax writes it in a checkpoint
  ("opt_state.inner_state.exchange.count")."""
  def part(key: Any) -> str:
    for attr in ("name", "key", "idx"):
      if hasattr(key, attr):
        return str(getattr(key, attr))
    return str(key)
  return [".".join(part(k) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def workers_of(state: Any) -> int:
  """The number of workers a train state was made for (its per-worker leading axis)."""
  count = chain_parts(state.opt_state).exchange.count
  return int(np.shape(count)[0])


def _repad(x: np.ndarray, length: int) -> np.ndarray:
  """`x` with its last axis cut or zero-padded to `length`."""
  if x.shape[-1] >= length:
    return x[..., :length]
  return np.concatenate([x, np.zeros(x.shape[:-1] + (length - x.shape[-1],), x.dtype)], -1)


def redistribute(memory: np.ndarray, padded_old: int, shape_new: tuple[int, int],
                 padded_new: int) -> np.ndarray:
  """Per-worker memory `[W, part]` (a whole buffer each if part == padded_old, else shard i of
  the node's sum on worker i of each node) as `[W', part']` on the new workers, keeping the
  update it stands for, sum / W (see the module's docstring). Accumulated in float64."""
  w_old, part_old = memory.shape
  w_new, part_new = shape_new
  if part_old == padded_old:
    update = memory.astype(np.float64).sum(0) / w_old
  else:
    local = padded_old // part_old
    update = (memory.astype(np.float64).reshape(w_old // local, local, part_old).sum(0)
              .reshape(padded_old) / w_old)
  update = _repad(update, padded_new)
  if part_new == padded_new:
    out = np.broadcast_to(update, (w_new, padded_new))
  else:
    local = padded_new // part_new
    out = np.tile(local * update.reshape(local, part_new), (w_new // local, 1))
  return np.ascontiguousarray(out, dtype=memory.dtype)


def _exchange(saved: ExchangeState, like: ExchangeState, padded_old: int,
              padded_new: int) -> ExchangeState:
  w_new = np.shape(like.count)[0]
  feedback = None
  if saved.feedback is not None:
    feedback = Feedback(*[None if m is None else redistribute(
        np.asarray(m), padded_old, np.shape(t), padded_new)
        for m, t in zip(saved.feedback, like.feedback)])
  same = [np.broadcast_to(np.asarray(x)[0], (w_new,) + np.shape(x)[1:])
          for x in (saved.count, saved.density, saved.bytes_sent)]
  return ExchangeState(feedback, *same)


def resize_state(saved: Any, like: Any) -> Any:
  """`saved` (a `TrainState` of host arrays, as a checkpoint of W workers holds it) for the
  workers of `like` (a fresh `TrainState` on the new mesh): per-worker memory redistributed,
  BatchNorm statistics averaged, buffers of the parameters' length re-padded, the rest kept."""
  padded_old, padded_new = np.shape(saved.params)[0], np.shape(like.params)[0]

  def shared(x: Any) -> Any:
    x = np.asarray(x)
    return _repad(x, padded_new) if x.ndim and x.shape[-1] == padded_old else x

  def opt(s: Any, t: Any) -> Any:
    if isinstance(s, ExchangeState):
      return _exchange(s, t, padded_old, padded_new)
    return jax.tree.map(shared, s)

  opt_state = jax.tree.map(opt, saved.opt_state, like.opt_state,
                           is_leaf=lambda x: isinstance(x, ExchangeState))
  w_new = workers_of(like)
  stats = jax.tree.map(lambda s: np.broadcast_to(np.asarray(s).mean(0, dtype=np.float64).astype(
      np.asarray(s).dtype), (w_new,) + np.shape(s)[1:]), saved.batch_stats)
  return type(saved)(np.asarray(saved.step), shared(saved.params), opt_state, stats)
