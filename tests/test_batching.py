"""The shared eval padding (`sparsejax.data.batching`) against a plain numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from sparsejax.data import batching


def reference(arrays, batch_size):
  """Every row once in order, then the last row repeated to fill the last batch."""
  n = len(arrays[0])
  total = -(-n // batch_size) * batch_size
  rows = [min(i, n - 1) for i in range(total)]
  weights = np.array([1.0 if i < n else 0.0 for i in range(total)], np.float32)
  for b in range(total // batch_size):
    sl = slice(b * batch_size, (b + 1) * batch_size)
    yield (*(np.stack([a[i] for i in rows[sl]]) for a in arrays), weights[sl])


@pytest.mark.parametrize("n, batch_size", [(1, 1), (1, 5), (7, 7), (13, 4), (10, 3), (5, 16)])
def test_padded_batches_match_the_reference(n, batch_size):
  rng = np.random.default_rng(n * 100 + batch_size)
  arrays = (rng.standard_normal((n, 3, 2)).astype(np.float16),
            rng.integers(-9, 9, n, dtype=np.int64), rng.random((n, 1)) > 0.5)
  got = list(batching.padded_batches(arrays, batch_size))
  want = list(reference(arrays, batch_size))
  assert len(got) == len(want) == -(-n // batch_size)
  for g, w in zip(got, want):
    assert len(g) == 4
    for a, b in zip(g, w):
      assert a.dtype == b.dtype and a.shape == b.shape
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("rows, batch_size, match", [
    ((0,), 4, r"\[0\] rows to a batch of 4"), ((5,), 4, r"\[5\] rows"),
    ((3, 2), 4, r"\[3, 2\] rows .* the same 1..4 rows each")])
def test_pad_batch_refuses_what_it_cannot_pad(rows, batch_size, match):
  with pytest.raises(ValueError, match=match):
    batching.pad_batch(batch_size, *(np.zeros(r) for r in rows))


def test_every_kind_of_input_fits_the_one_protocol():
  """Images, token sequences and sentence pairs: (inputs, targets) batches, padded eval batches."""
  from sparsejax.data import Inputs
  from sparsejax.data.inputs import InMemoryInputs
  from sparsejax.data.text import TextInputs
  from sparsejax.data.translation import TranslationInputs

  rng = np.random.default_rng(0)
  images = batching.ArrayDataset(rng.standard_normal((13, 4, 4, 1)).astype(np.float32),
                                 rng.integers(0, 3, 13).astype(np.int32), 3)
  tokens = rng.integers(0, 20, (13, 6)).astype(np.int32)
  kinds = [InMemoryInputs(images, images, 4, 0), TextInputs(tokens, tokens[:5], 20, 4, 0),
           TranslationInputs((tokens, tokens[:, :6]), (tokens[:5], tokens[:5]), 20, 4, 0)]
  for data in kinds:
    assert isinstance(data, Inputs) and data.steps_per_epoch == 3
    inputs, targets = data.train_batch(4, None)
    leaves = [*(inputs if isinstance(inputs, tuple) else (inputs,)), targets]
    assert [x.shape[0] for x in leaves] == [4] * len(leaves) and targets.dtype == np.int32
    weights = [w for _, _, w in data.eval_batches(None)]
    assert sum(w.sum() for w in weights) == (13 if data is kinds[0] else 5)
  assert not isinstance(object(), Inputs)


def test_crop_flip_is_a_padded_crop_of_each_image_drawn_the_same_for_a_seed_and_step():
  """Each augmented image is one of the (2p+1)^2 crops of its reflected image, flipped or not
  (found by search, not by the draw); about half are flipped; a (seed, step) draws the same."""
  from sparsejax.data import small
  x = np.random.default_rng(5).normal(size=(203, 13, 11, 2)).astype(np.float32)
  out = small.augment(x, "crop_flip", seed=3, step=17)
  assert out.shape == x.shape and out.dtype == x.dtype
  padded = np.pad(x, ((0, 0), (2, 2), (2, 2), (0, 0)), mode="reflect")
  flipped, moved = 0, 0
  for i in range(len(x)):
    found = [(dy, dx, f) for dy in range(5) for dx in range(5) for f in (False, True)
             if np.array_equal(out[i], (lambda c: c[:, ::-1] if f else c)(
                 padded[i, dy:dy + 13, dx:dx + 11]))]
    assert found, i
    flipped += found[0][2]
    moved += (found[0][0], found[0][1]) != (2, 2)
  assert 70 < flipped < 133 and moved > 150, (flipped, moved)
  np.testing.assert_array_equal(out, small.augment(x, "crop_flip", seed=3, step=17))
  assert not np.array_equal(out, small.augment(x, "crop_flip", seed=3, step=18))
  assert small.augment(x, "", seed=3, step=17) is x
  with pytest.raises(ValueError, match="unknown augmentation 'flip'.*crop_flip"):
    small.augment(x, "flip", seed=3, step=17)
