"""Small real image sets held in memory, and deterministic batching by step number.

`EpochBatcher.batch(step)` depends only on (seed, step), so the iterator position that a checkpoint
needs is the step itself and a resumed run sees exactly the batches of an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

__all__ = ["ArrayDataset", "EpochBatcher", "digits", "eval_batches", "load", "resize"]


@dataclasses.dataclass(frozen=True)
class ArrayDataset:
  """images: float32[n, h, w, c], normalised; labels: int32[n]."""

  images: np.ndarray
  labels: np.ndarray
  num_classes: int

  def __len__(self) -> int:
    return len(self.labels)


def digits(seed: int = 0, test_fraction: float = 0.2) -> tuple[ArrayDataset, ArrayDataset]:
  """scikit-learn's handwritten digits (1,797 8x8 grey images, 10 classes; UCI, ships with
  scikit-learn, no download), split train/test with a fixed seed, scaled to mean 0 / std 1."""
  from sklearn.datasets import load_digits

  raw = load_digits()
  images = (raw.images.astype(np.float32) / 16.0)[..., None]
  labels = raw.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(labels))
  n_test = int(round(test_fraction * len(labels)))
  test, train = order[:n_test], order[n_test:]
  mean, std = images[train].mean(), images[train].std()
  images = (images - mean) / std
  return (ArrayDataset(images[train], labels[train], 10),
          ArrayDataset(images[test], labels[test], 10))


def _fashion_mnist(seed: int, path: str) -> tuple[ArrayDataset, ArrayDataset]:
  from sparsejax.data import idx
  return idx.idx_dataset(path or idx.FASHION_MNIST_DIR, seed)


def _idx(seed: int, path: str) -> tuple[ArrayDataset, ArrayDataset]:
  from sparsejax.data import idx
  if not path:
    raise ValueError("dataset 'idx' needs data.path: a directory of MNIST-format IDX files")
  return idx.idx_dataset(path, seed)


# name -> loader(seed, path) -> (train, test); `path` is the config's data.path ("" = default).
DATASETS = {"digits": lambda seed, path: digits(seed), "fashion_mnist": _fashion_mnist,
            "idx": _idx}


def load(name: str, seed: int = 0, path: str = "") -> tuple[ArrayDataset, ArrayDataset]:
  """(train, test) of a named in-memory dataset (see DATASETS); `path` where it needs one."""
  if name not in DATASETS:
    raise ValueError(f"unknown dataset {name!r}; allowed: {sorted(DATASETS)}")
  return DATASETS[name](seed, path)


class EpochBatcher:
  """Global training batches: each epoch a fresh permutation (seeded), remainder dropped."""

  def __init__(self, data: ArrayDataset, global_batch: int, seed: int):
    if global_batch > len(data):
      raise ValueError(f"global batch {global_batch} is larger than the dataset ({len(data)})")
    self.data, self.global_batch, self.seed = data, global_batch, seed
    self.steps_per_epoch = len(data) // global_batch

  def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    epoch, i = divmod(step, self.steps_per_epoch)
    perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.data))
    idx = np.sort(perm[i * self.global_batch:(i + 1) * self.global_batch])
    return self.data.images[idx], self.data.labels[idx]


def eval_batches(data: ArrayDataset, global_batch: int
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """All of `data` in order, in batches of `global_batch`; the last is padded, with weights 0."""
  n = len(data)
  for start in range(0, n, global_batch):
    idx = np.arange(start, start + global_batch)
    weight = (idx < n).astype(np.float32)
    idx = np.minimum(idx, n - 1)
    yield data.images[idx], data.labels[idx], weight


def resize(images: np.ndarray, size: int) -> np.ndarray:
  """float32 NHWC images resized (bilinear, antialiased) to size x size."""
  import jax
  if images.shape[1:3] == (size, size):
    return images
  out = jax.image.resize(images, images.shape[:1] + (size, size) + images.shape[3:], "bilinear")
  return np.asarray(out, np.float32)
