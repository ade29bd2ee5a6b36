"""IDX (MNIST-format) reading, and Fashion-MNIST from Debian's dataset-fashion-mnist package."""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np
import pytest

from sparsejax.data import idx, small


def write_idx(path, array: np.ndarray, code: int) -> None:
  """An IDX file written by hand from the format's definition (independent of the reader)."""
  big = array.astype(array.dtype.newbyteorder(">"))
  data = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
  data += big.tobytes()
  opener = gzip.open if str(path).endswith(".gz") else open
  with opener(path, "wb") as f:
    f.write(data)


@pytest.mark.parametrize("dtype, code", [(np.uint8, 0x08), (np.int8, 0x09), (np.int16, 0x0B),
                                         (np.int32, 0x0C), (np.float32, 0x0D),
                                         (np.float64, 0x0E)])
@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_round_trips_every_type(tmp_path, dtype, code, gz):
  rng = np.random.default_rng(code)
  a = (rng.standard_normal((7, 5, 3)) * 50).astype(dtype)
  path = str(tmp_path / ("a.idx" + (".gz" if gz else "")))
  write_idx(path, a, code)
  out = idx.read_idx(path)
  assert out.dtype == np.dtype(dtype) and out.shape == (7, 5, 3)
  np.testing.assert_array_equal(out, a)


def make_idx_dir(root, n_train=37, n_test=11, h=9, w=7, classes=4, gz=True):
  rng = np.random.default_rng(0)
  root.mkdir(exist_ok=True)
  ext = ".gz" if gz else ""
  data = {}
  for split, n in (("train", n_train), ("test", n_test)):
    images = rng.integers(0, 256, (n, h, w), dtype=np.uint8)
    labels = rng.integers(0, classes, n).astype(np.uint8)
    labels[0] = classes - 1
    write_idx(root / (idx.FILES[split][0] + ext), images, 0x08)
    write_idx(root / (idx.FILES[split][1] + ext), labels, 0x08)
    data[split] = (images, labels)
  return data


@pytest.mark.parametrize("gz", [False, True])
def test_idx_dataset_from_a_directory(tmp_path, gz):
  raw = make_idx_dir(tmp_path / "d", gz=gz)
  train, test = small.load("idx", path=str(tmp_path / "d"))
  assert train.images.shape == (37, 9, 7, 1) and test.images.shape == (11, 9, 7, 1)
  assert train.images.dtype == np.float32 and train.labels.dtype == np.int32
  assert train.num_classes == 4
  np.testing.assert_array_equal(train.labels, raw["train"][1])
  x = raw["train"][0].astype(np.float32)
  expected = (raw["test"][0].astype(np.float32) - x.mean()) / x.std()
  np.testing.assert_allclose(test.images[..., 0], expected, rtol=1e-5, atol=1e-5)
  assert abs(train.images.mean()) < 1e-5 and abs(train.images.std() - 1) < 1e-4


def test_idx_bad_input(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    small.load("idx", path=str(tmp_path / "missing"))
  with pytest.raises(ValueError, match="needs data.path"):
    small.load("idx")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match=r"no train-images-idx3-ubyte\[.gz\]; it must hold"):
    small.load("idx", path=str(tmp_path / "empty"))
  make_idx_dir(tmp_path / "d", gz=False)
  path = tmp_path / "d" / idx.FILES["train"][0]
  path.write_bytes(path.read_bytes()[:-5])
  with pytest.raises(ValueError, match="should hold .* bytes, has"):
    small.load("idx", path=str(tmp_path / "d"))
  path.write_bytes(b"PK\x03\x04 not idx")
  with pytest.raises(ValueError, match="not an IDX file"):
    idx.read_idx(str(path))


def test_fashion_mnist_from_the_debian_package():
  if not os.path.isdir(idx.FASHION_MNIST_DIR):
    if os.environ.get("CI"):
      pytest.fail(f"{idx.FASHION_MNIST_DIR} missing: .ci/run must apt-get install "
                  "dataset-fashion-mnist")
    pytest.skip("needs Debian's Fashion-MNIST: apt-get install dataset-fashion-mnist")
  train, test = small.load("fashion_mnist")
  assert train.images.shape == (60000, 28, 28, 1) and test.images.shape == (10000, 28, 28, 1)
  assert train.num_classes == 10
  assert np.bincount(train.labels).tolist() == [6000] * 10
  assert np.bincount(test.labels).tolist() == [1000] * 10
