"""What every dataset shares: example arrays, batches by step, this process's rows, eval padding.

Dataset modules (`small`, `idx`, `text`, `translation`, `pipeline`) import this module; it imports
none of them, so the data layer has no import cycles.

`EpochBatcher.batch(step)` depends only on (seed, step), so the iterator position that a checkpoint
needs is the step itself and a resumed run sees exactly the batches of an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

__all__ = ["ArrayDataset", "EpochBatcher", "EpochOrder", "eval_batches", "pad_batch",
           "padded_batches", "process_share"]


@dataclasses.dataclass(frozen=True)
class ArrayDataset:
  """images: float32[n, h, w, c], normalised; labels: int32[n]."""

  images: np.ndarray
  labels: np.ndarray
  num_classes: int

  def __len__(self) -> int:
    return len(self.labels)


class EpochOrder:
  """Which of `n` rows make global batch `step`: each epoch a fresh seeded permutation, cut into
  batches of `global_batch` (the remainder dropped), each batch's rows in ascending order. For
  rows of any kind: images, token sequences, sentence pairs."""

  def __init__(self, n: int, global_batch: int, seed: int):
    if global_batch > n:
      raise ValueError(f"global batch {global_batch} is larger than the dataset ({n})")
    self.n, self.global_batch, self.seed = n, global_batch, seed
    self.steps_per_epoch = n // global_batch

  def rows(self, step: int) -> np.ndarray:
    """int64[global_batch]: the rows of batch `step` (counting over all epochs)."""
    epoch, i = divmod(step, self.steps_per_epoch)
    perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
    return np.sort(perm[i * self.global_batch:(i + 1) * self.global_batch])


class EpochBatcher:
  """Global training batches of an `ArrayDataset`, in the rows of an `EpochOrder`."""

  def __init__(self, data: ArrayDataset, global_batch: int, seed: int):
    self.data, self.global_batch, self.seed = data, global_batch, seed
    self.order = EpochOrder(len(data), global_batch, seed)
    self.steps_per_epoch = self.order.steps_per_epoch

  def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    idx = self.order.rows(step)
    return self.data.images[idx], self.data.labels[idx]


def pad_batch(batch_size: int, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
  """The eval padding: `arrays` (each of the same 1..batch_size rows) padded to `batch_size` rows
  by repeating their last row, then float32[batch_size] weights (1 on real rows, 0 on padding)."""
  count = len(arrays[0])
  if not 0 < count <= batch_size or any(len(a) != count for a in arrays):
    raise ValueError(f"cannot pad arrays of {[len(a) for a in arrays]} rows to a batch of "
                     f"{batch_size} (allowed: the same 1..{batch_size} rows each)")
  pad = batch_size - count
  padded = tuple(np.concatenate([a, np.repeat(a[-1:], pad, 0)]) if pad else a for a in arrays)
  return (*padded, (np.arange(batch_size) < count).astype(np.float32))


def padded_batches(arrays: tuple[np.ndarray, ...], batch_size: int
                   ) -> Iterator[tuple[np.ndarray, ...]]:
  """All rows of `arrays` in order, in batches of `batch_size` (the last one padded by
  `pad_batch`): (*arrays' rows, weights) per batch."""
  for start in range(0, len(arrays[0]), batch_size):
    yield pad_batch(batch_size, *(a[start:start + batch_size] for a in arrays))


def eval_batches(data: ArrayDataset, global_batch: int
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """All of `data` in order, in batches of `global_batch`; the last is padded, with weights 0."""
  return padded_batches((data.images, data.labels), global_batch)


def process_share(batch_size: int) -> tuple[int, int]:
  """(start, stop) of this process's rows of a global batch: processes own contiguous blocks of
  the mesh's devices, in order."""
  import jax
  count, index = jax.process_count(), jax.process_index()
  if batch_size % count:
    raise ValueError(f"global batch_size {batch_size} is not divisible by the {count} processes")
  per = batch_size // count
  return index * per, (index + 1) * per
