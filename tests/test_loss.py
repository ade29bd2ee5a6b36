"""The trainer's loss and accuracy counts (sparsejax/train/step.py) against optax and numpy, on
fresh random logits of odd shapes."""

import jax
import numpy as np
import optax
import pytest

from sparsejax.train import step


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.37])
@pytest.mark.parametrize("shape", [(13, 11), (3, 7, 29)])
def test_cross_entropy_is_optax_smoothed_one_hot(shape, smoothing):
  rng = np.random.default_rng(int(smoothing * 100) + len(shape))
  logits = (rng.standard_normal(shape) * 3).astype(np.float32)
  labels = rng.integers(0, shape[-1], shape[:-1])
  want = optax.softmax_cross_entropy(
      logits, optax.smooth_labels(jax.nn.one_hot(labels, shape[-1]), smoothing))
  np.testing.assert_allclose(step.cross_entropy(logits, labels, smoothing), want, rtol=1e-5,
                             atol=1e-5)


def test_top1_and_top5_counts_match_a_sort():
  rng = np.random.default_rng(5)
  logits = rng.standard_normal((4, 9, 23)).astype(np.float32)  # continuous: no ties
  labels = rng.integers(0, 23, (4, 9))
  weights = rng.integers(0, 2, (4, 9)).astype(np.float32)
  got = step._correct(logits, labels, weights, 23)
  order = np.argsort(-logits, axis=-1)
  top1 = order[..., 0] == labels
  top5 = np.any(order[..., :5] == labels[..., None], axis=-1)
  assert float(got["accuracy"]) == pytest.approx(float(np.sum(weights * top1)))
  assert float(got["top5_accuracy"]) == pytest.approx(float(np.sum(weights * top5)))
  assert 0 < np.sum(weights * top5) < np.sum(weights)  # the case is not trivial
