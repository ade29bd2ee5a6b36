"""The held-out tasks' data: MNIST from its pickle and the Python documentation's sources, read
from small files written here in the same formats."""

import gzip
import pickle

import numpy as np
import pytest

from sparsejax.data import small, text


def _mnist_pickle(path, rng, sizes=(37, 11, 13)):
  """A pickle in the deeplearning.net layout: ((x, y) train, valid, test), x in [0, 1)."""
  parts = [(rng.random((n, 784), dtype=np.float32), rng.integers(0, 10, n).astype(np.int64))
           for n in sizes]
  with gzip.open(path, "wb") as f:
    pickle.dump(tuple(parts), f, protocol=4)
  return parts


def test_mnist_reads_the_pickle_as_train_plus_valid_and_test_standardized(tmp_path):
  parts = _mnist_pickle(tmp_path / "mnist.pkl.gz", np.random.default_rng(5))
  train, test = small.mnist(path=str(tmp_path / "mnist.pkl.gz"))
  assert train.images.shape == (48, 28, 28, 1) and test.images.shape == (13, 28, 28, 1)
  np.testing.assert_array_equal(train.labels, np.concatenate([parts[0][1], parts[1][1]]))
  # pixels as the IDX files hold them (0-255), standardized with the training set's statistics
  pixels = np.clip(np.round(np.concatenate([parts[0][0], parts[1][0]]) * 256), 0, 255)
  expected = (pixels - pixels.mean()) / pixels.std()
  np.testing.assert_allclose(train.images.reshape(48, -1), expected, rtol=1e-4, atol=1e-4)
  assert abs(float(train.images.mean())) < 1e-4


def test_mnist_refuses_a_pickle_that_holds_more_than_arrays(tmp_path):
  path = tmp_path / "evil.pkl.gz"
  with gzip.open(path, "wb") as f:
    pickle.dump((np.zeros(3), print), f, protocol=4)
  with pytest.raises(pickle.UnpicklingError, match="numpy arrays only, not builtins.print"):
    small.mnist(path=str(path))


def test_python_docs_reads_each_rst_source_as_a_document(tmp_path):
  (tmp_path / "library").mkdir()
  (tmp_path / "library" / "os.rst.txt").write_text(":mod:`os` --- Miscellaneous\n\nText.\n")
  (tmp_path / "tutorial.rst.txt").write_text("An Informal Introduction\n")
  (tmp_path / "image.png").write_bytes(b"\x89PNG")
  docs = text.python_docs(str(tmp_path))
  assert docs == [":mod:`os` --- Miscellaneous\n\nText.", "An Informal Introduction"]


def test_python_docs_names_the_missing_directory_and_the_package(tmp_path):
  with pytest.raises(FileNotFoundError, match="apt-get install python3.11-doc"):
    text.python_docs(str(tmp_path / "absent"))
