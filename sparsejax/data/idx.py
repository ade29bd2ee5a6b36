"""Image sets in MNIST's IDX format, from a directory (plain or gzipped files).

Fashion-MNIST ships as Debian's `dataset-fashion-mnist` (`apt-get install dataset-fashion-mnist`:
files under /usr/share/datasets/fashion-mnist/); MNIST, KMNIST and EMNIST use the same layout.
"""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np

from sparsejax.data.batching import ArrayDataset

__all__ = ["read_idx", "idx_dataset", "FASHION_MNIST_DIR", "FILES"]

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
           0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: str) -> np.ndarray:
  """The array in one IDX file (`.gz` is decompressed): magic 0x0000 TT NN, NN big-endian
  uint32 dimensions, then the values (big-endian)."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    data = f.read()
  if len(data) < 4 or data[:2] != b"\0\0" or data[2] not in _DTYPES:
    raise ValueError(f"{path}: not an IDX file (magic {data[:4].hex() or 'empty'}; expected "
                     f"00 00, a type in {[hex(t) for t in _DTYPES]}, a dimension count)")
  dtype, ndim = np.dtype(_DTYPES[data[2]]), data[3]
  header = 4 + 4 * ndim
  if len(data) < header:
    raise ValueError(f"{path}: truncated IDX header ({len(data)} bytes, {ndim} dimensions)")
  shape = struct.unpack(f">{ndim}I", data[4:header])
  expected = header + int(np.prod(shape)) * dtype.itemsize
  if len(data) != expected:
    raise ValueError(f"{path}: IDX file of shape {shape} should hold {expected} bytes, "
                     f"has {len(data)} (truncated or corrupt)")
  return np.frombuffer(data, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _find(directory: str, stem: str) -> str:
  for name in (stem, stem + ".gz"):
    if os.path.exists(os.path.join(directory, name)):
      return os.path.join(directory, name)
  wanted = ", ".join(f"{a}[.gz], {b}[.gz]" for a, b in FILES.values())
  hint = (" (install it with: apt-get install dataset-fashion-mnist)"
          if os.path.abspath(directory) == FASHION_MNIST_DIR else "")
  raise FileNotFoundError(f"IDX dataset directory {directory!r} has no {stem}[.gz]; it must hold "
                          f"{wanted}{hint}")


def idx_dataset(directory: str, seed: int = 0) -> tuple[ArrayDataset, ArrayDataset]:
  """(train, test) from an IDX directory: images float32[n, h, w, 1] scaled to mean 0 / std 1
  with the training set's statistics; labels int32. `seed` is unused (the split is given)."""
  del seed
  if not os.path.isdir(directory):
    hint = (" (install it with: apt-get install dataset-fashion-mnist)"
            if os.path.abspath(directory) == FASHION_MNIST_DIR else "")
    raise FileNotFoundError(f"IDX dataset directory {directory!r} does not exist{hint}")
  out = {}
  for split, (images_stem, labels_stem) in FILES.items():
    images = read_idx(_find(directory, images_stem))
    labels = read_idx(_find(directory, labels_stem))
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
      raise ValueError(f"{directory}: {split} images {images.shape} and labels {labels.shape} do "
                       "not match (expected [n, h, w] and [n])")
    out[split] = (images.astype(np.float32)[..., None], labels.astype(np.int32))
  mean, std = out["train"][0].mean(), out["train"][0].std()
  num_classes = int(max(out["train"][1].max(), out["test"][1].max())) + 1
  return tuple(ArrayDataset((x - mean) / std, y, num_classes) for x, y in out.values())
