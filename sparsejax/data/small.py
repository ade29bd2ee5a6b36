"""Small real image sets held in memory (digits, Fashion-MNIST, any IDX directory).

`ArrayDataset`, `EpochBatcher` and `eval_batches` live in `sparsejax.data.batching` (shared by
every dataset) and are re-exported here.
"""

from __future__ import annotations

import numpy as np

from sparsejax.data import idx
from sparsejax.data.batching import ArrayDataset, EpochBatcher, eval_batches

__all__ = ["ArrayDataset", "EpochBatcher", "digits", "eval_batches", "load", "resize"]


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
  return idx.idx_dataset(path or idx.FASHION_MNIST_DIR, seed)


def _idx(seed: int, path: str) -> tuple[ArrayDataset, ArrayDataset]:
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


def resize(images: np.ndarray, size: int) -> np.ndarray:
  """float32 NHWC images resized (bilinear, antialiased) to size x size."""
  import jax
  if images.shape[1:3] == (size, size):
    return images
  out = jax.image.resize(images, images.shape[:1] + (size, size) + images.shape[3:], "bilinear")
  return np.asarray(out, np.float32)
