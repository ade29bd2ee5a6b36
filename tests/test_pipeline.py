"""The grain image pipelines on generated JPEGs (no TFDS needed): train batches by step, process
shares, eval coverage and padding, the corrupt record skipped."""

from __future__ import annotations

import numpy as np
import pytest

from sparsejax.data import images as image_ops
from sparsejax.data import pipeline
from sparsejax.data.imagenet import synthetic_jpeg

CORRUPT = 5


class Jpegs:
  """`n` JPEGs of varied sizes, labelled by index; record CORRUPT does not decode."""

  def __init__(self, n: int = 23, seed: int = 0):
    rng = np.random.default_rng(seed)
    self.records = [{"image": b"\xff\xd8 not a jpeg" if i == CORRUPT else synthetic_jpeg(
        rng, int(rng.integers(40, 120)), int(rng.integers(40, 120))), "label": i}
        for i in range(n)]

  def __len__(self):
    return len(self.records)

  def __getitem__(self, i):
    return self.records[i]

  def __repr__(self):
    return f"Jpegs({len(self)})"


@pytest.fixture(scope="module")
def src():
  return Jpegs()


def test_train_batches_cover_each_share_once_per_epoch_and_restore(src):
  pipes = [pipeline.TrainImagePipeline(src, batch_size=3, seed=4, process_index=p,
                                       process_count=2, decoded_max_size=48, threads=2)
           for p in range(2)]
  assert pipes[0].steps_per_epoch == 11 // 3 == 3
  shares = [set(p.order(1).tolist()) for p in pipes]
  assert not shares[0] & shares[1] and len(shares[0] | shares[1]) == 22
  for p in pipes:
    labels = np.concatenate([p.batch(s, 40 if s < 3 else 56)[1] for s in range(6)])
    for epoch in (0, 1):  # a corrupt record is replaced by the next of the epoch's order
      got = labels[epoch * 9:(epoch + 1) * 9]
      assert len(set(got.tolist()) - set(p.order(epoch).tolist())) == 0
      assert CORRUPT not in got
  restored = pipeline.TrainImagePipeline(src, batch_size=3, seed=4, process_index=1,
                                         process_count=2, decoded_max_size=48, threads=2)
  for s in (4, 5):
    a, b = restored.batch(s, 56), pipes[1].batch(s, 56)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
  with pytest.raises(ValueError, match="eval_batches is for eval pipelines"):
    pipes[0].eval_batches(40)


@pytest.mark.parametrize("count, batch", [(1, 4), (2, 5), (3, 1)])
def test_eval_batches_cover_every_record_once_centre_cropped_and_padded(src, count, batch):
  seen = []
  for p in range(count):
    pipe = pipeline.ImagePipeline(src, train=False, batch_size=batch, process_index=p,
                                  process_count=count)
    assert isinstance(pipe, pipeline.EvalImagePipeline)
    batches = list(pipe.eval_batches(32))
    for images, labels, weights in batches:
      assert images.shape == (batch, 32, 32, 3) and images.dtype == np.uint8
      assert labels.shape == weights.shape == (batch,) and weights.dtype == np.float32
      real = weights > 0
      seen += labels[real].tolist()
      if not real.all():  # the padding repeats the last real example
        np.testing.assert_array_equal(images[~real], np.repeat(images[real][-1:],
                                                               (~real).sum(), 0))
    first = batches[0][0][0]
    want = image_ops.center_crop(image_ops.decode(
        src[int(pipe.order()[0])]["image"], min_side=round(32 / image_ops.EVAL_CROP_FRACTION)),
        32)
    if int(pipe.order()[0]) != CORRUPT:
      np.testing.assert_array_equal(first, want)
    with pytest.raises(ValueError, match="use eval_batches"):
      pipe.batch(0, 32)
  # the corrupt record's place is taken by its successor in the order
  assert sorted(set(seen)) == [i for i in range(23) if i != CORRUPT]
  assert len(seen) == 23
