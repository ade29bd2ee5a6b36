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


def test_tied_logits_rank_as_argmax_and_top_k_break_ties():
  """Ties go to the lower index, as argmax and lax.top_k: all-equal logits (a zero-initialised
  head) make class 0 the prediction, not every class."""
  rng = np.random.default_rng(11)
  logits = rng.integers(-2, 3, (5, 7, 13)).astype(np.float32)  # few values: many ties
  logits[0] = 0.0
  labels = rng.integers(0, 13, (5, 7))
  labels[:, :2] = np.argmax(logits[:, :2], axis=-1)  # some right at top-1
  weights = np.ones((5, 7), np.float32)
  got = step._correct(logits, labels, weights, 13)
  top1 = np.argmax(logits, axis=-1) == labels
  top5 = np.any(np.asarray(jax.lax.top_k(logits, 5)[1]) == labels[..., None], axis=-1)
  assert float(got["accuracy"]) == float(np.sum(top1))
  assert float(got["top5_accuracy"]) == float(np.sum(top5))
  assert 0 < np.sum(top1) < np.sum(top5) < weights.size
