"""The grain image pipeline: records -> (cached) decode -> crop/flip -> uint8 batches, per process.

  raw = TieredCache(imagenet.source(data_dir, "train"), ...)          # cache point 1: JPEG bytes
  pipe = TrainImagePipeline(raw, batch_size=256, seed=0,
                            decoded_cache=lambda src: TieredCache(src, ...))  # cache point 2
  images, labels = pipe.batch(step, size=128)                          # uint8[256,128,128,3]
  val = EvalImagePipeline(imagenet.source(data_dir, "validation"), batch_size=256)
  for images, labels, weights in val.eval_batches(size=128): ...      # last batch padded

Batches are a function of (seed, step, size): epoch e is a seeded permutation of the records,
split between processes (`jax.process_index()` takes every `process_count()`-th), and example j
of it is cropped with a generator seeded by (seed, e, j). So the iterator state a checkpoint needs
is the step, and a restored run reads exactly the batches of an uninterrupted one. Reading ahead
happens in grain (threads, optionally worker processes) within an epoch.

Low-resolution stages read from `DecodedSource`: images decoded once at a fixed shorter side
(1.25x the stage's size) and cached as uint8 arrays, so those epochs decode no JPEG at all.
A record that does not decode is skipped (the next good record of the epoch takes its place, so
batches keep their shape) and counted in `stats()["corrupt"]`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import grain
import numpy as np

from sparsejax.data import images as image_ops
from sparsejax.data.batching import pad_batch
from sparsejax.data.loader import prefetch
from sparsejax.data.shared import SharedSlots

__all__ = ["DecodedSource", "EvalImagePipeline", "ImagePipeline", "TrainImagePipeline",
           "DECODED_SCALE"]

DECODED_SCALE = 1.25  # the decoded cache keeps the shorter side at 1.25x the stage's image size


class DecodedSource:
  """Cache point 2: `{"image": uint8[h, w, 3] with min(h, w) = short_side, "label": int32}` from
  records of encoded images; a record that does not decode gives an empty image [0, 0, 3]."""

  def __init__(self, raw: Any, short_side: int):
    if not isinstance(short_side, int) or short_side < 1:
      raise ValueError(f"short_side must be a positive int, got {short_side!r}")
    self.raw, self.short_side = raw, short_side

  def __len__(self) -> int:
    return len(self.raw)

  def __repr__(self) -> str:
    return f"DecodedSource({self.raw!r}, short_side={self.short_side})"

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    record = self.raw[index]
    try:
      image = image_ops.decode(record["image"], self.short_side)
    except image_ops.CorruptImage:
      image = np.zeros((0, 0, 3), np.uint8)
    return {"image": image, "label": np.int32(record["label"])}


def _stack(examples):
  images, labels = zip(*examples)
  return np.stack(images), np.asarray(labels, np.int32)


class _ImagePipeline:
  """What train and eval pipelines share: the records, this process's share of them, decoding
  (through cache point 2 where the stage allows), grain read-ahead and the counters.

  Args:
    raw: records {"image": encoded bytes, "label": int} (e.g. a TieredCache over TFDS).
    batch_size: examples per batch in this process.
    seed: the shuffling and augmentation seed.
    decoded_cache: wraps each `DecodedSource` (e.g. in a TieredCache); None: no cache point 2.
    decoded_max_size: stages of at most this size read the decoded cache (0: never).
    process_index, process_count: this process's share (default: jax's).
    workers, threads, buffer: grain read-ahead (worker processes, threads, elements).
  """

  train = False

  def __init__(self, raw: Any, *, batch_size: int, seed: int = 0,
               decoded_cache: Callable[[DecodedSource], Any] | None = None,
               decoded_max_size: int = 0, process_index: int | None = None,
               process_count: int | None = None, workers: int = 0, threads: int = 8,
               buffer: int = 16):
    if process_index is None or process_count is None:
      import jax
      process_index, process_count = jax.process_index(), jax.process_count()
    if not 0 <= process_index < process_count:
      raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    per_process = self._share(len(raw), process_count)
    if batch_size < 1 or batch_size > self._max_batch(per_process):
      raise ValueError(f"batch_size {batch_size} per process must be in [1, {per_process}] (the "
                       f"records of one process: {len(raw)} over {process_count} processes)")
    self.raw, self.batch_size, self.seed = raw, batch_size, seed
    self.decoded_cache, self.decoded_max_size = decoded_cache, decoded_max_size
    self.process_index, self.process_count = process_index, process_count
    self.workers, self.threads, self.buffer = workers, threads, buffer
    self.per_process = per_process
    self.steps_per_epoch = self._steps(per_process, batch_size)
    self._decoded: dict[int, Any] = {}
    self._counters = SharedSlots(("corrupt", "examples"))

  @staticmethod
  def _share(n: int, count: int) -> int:
    raise NotImplementedError

  @staticmethod
  def _max_batch(per_process: int) -> float:
    raise NotImplementedError

  @staticmethod
  def _steps(per_process: int, batch_size: int) -> int:
    raise NotImplementedError

  def _decode(self, record: Any, size: int) -> np.ndarray:
    """The record's image, decoded large enough for a stage of `size`."""
    raise NotImplementedError

  def _finish(self, image: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """The example at `size` x `size` from the decoded image."""
    raise NotImplementedError

  # ------------------------------------------------------------------ what one example is

  def source_for(self, size: int) -> tuple[Any, bool]:
    """(source, decoded?) that a stage of image `size` reads."""
    if not size <= self.decoded_max_size:
      return self.raw, False
    short = max(size, int(round(size * DECODED_SCALE)))
    if short not in self._decoded:
      src = DecodedSource(self.raw, short)
      self._decoded[short] = self.decoded_cache(src) if self.decoded_cache else src
    return self._decoded[short], True

  def _example(self, j: int, *, order: np.ndarray, epoch: int, size: int, source: Any,
               decoded: bool) -> tuple[np.ndarray, int]:
    rng = np.random.default_rng([self.seed, epoch, j])
    for t in range(len(order)):
      record = source[int(order[(j + t) % len(order)])]
      try:
        image = record["image"] if decoded else self._decode(record, size)
      except image_ops.CorruptImage:
        image = None
      if image is not None and image.size:
        break
      self._counters.add(corrupt=1)
    else:
      raise ValueError("no record of this process's share decodes")
    self._counters.add(examples=1)
    return self._finish(image, size, rng), int(record["label"])

  def _dataset(self, order: np.ndarray, epoch: int, size: int, n: int) -> grain.MapDataset:
    """Examples 0..n-1 of `order` at image `size`, batched, as a grain MapDataset."""
    source, decoded = self.source_for(size)
    fn = functools.partial(self._example, order=order, epoch=epoch, size=size, source=source,
                           decoded=decoded)
    return grain.MapDataset.range(n).map(fn).batch(self.batch_size, batch_fn=_stack)

  def _read(self, ds: grain.MapDataset) -> Iterator:
    return iter(prefetch(ds, workers=self.workers, threads=self.threads, buffer=self.buffer))

  def stats(self) -> dict[str, int]:
    """{"examples": made so far, "corrupt": records skipped because they did not decode} over
    every process of grain's workers."""
    return {k: int(v) for k, v in self._counters.snapshot().items()}


class TrainImagePipeline(_ImagePipeline):
  """Training batches of this process: each epoch a seeded permutation of the records (this
  process takes every `process_count`-th), random-resized crops and flips. See `_ImagePipeline`
  for the arguments."""

  train = True

  def __init__(self, raw: Any, **kwargs: Any):
    super().__init__(raw, **kwargs)
    self._iter: Iterator | None = None
    self._iter_key: tuple | None = None
    self._next_step = -1

  @staticmethod
  def _share(n, count):  # the remainder of the records is dropped, as batches are
    return n // count

  @staticmethod
  def _max_batch(per_process):
    return per_process

  @staticmethod
  def _steps(per_process, batch_size):
    return per_process // batch_size

  def _decode(self, record, size):
    return image_ops.decode(record["image"])  # full resolution: a crop may take 8% of the area

  def _finish(self, image, size, rng):
    return image_ops.random_resized_crop(image, size, rng)

  def order(self, epoch: int) -> np.ndarray:
    """This process's record indices for `epoch`: a seeded permutation per epoch."""
    idx = np.random.default_rng([self.seed, epoch]).permutation(len(self.raw))
    return idx[self.process_index::self.process_count][:self.per_process]

  def epoch_dataset(self, epoch: int, size: int) -> grain.MapDataset:
    """The batches of `epoch` at image `size`, as a grain MapDataset (random access)."""
    return self._dataset(self.order(epoch), epoch, size, self.steps_per_epoch * self.batch_size)

  def batch(self, step: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Train batch number `step` (counting from 0 over all epochs) at image `size`:
    (uint8[batch, size, size, 3], int32[batch])."""
    epoch, i = divmod(step, self.steps_per_epoch)
    if self._iter is None or self._iter_key != (epoch, size) or self._next_step != step:
      self._iter = self._read(self.epoch_dataset(epoch, size)[i:])
      self._iter_key = (epoch, size)
    self._next_step = step + 1
    return next(self._iter)

  def eval_batches(self, size: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    raise ValueError("eval_batches is for eval pipelines (EvalImagePipeline, or train=False)")

  def __getstate__(self):
    state = dict(self.__dict__)
    state.update(_iter=None, _iter_key=None, _next_step=-1)
    return state


class EvalImagePipeline(_ImagePipeline):
  """Evaluation batches of this process: its share of the records in order (every
  `process_count`-th), resized and centre-cropped, the last batch padded. See `_ImagePipeline`
  for the arguments."""

  @staticmethod
  def _share(n, count):  # every record is evaluated once
    return math.ceil(n / count)

  @staticmethod
  def _max_batch(per_process):
    return math.inf

  @staticmethod
  def _steps(per_process, batch_size):
    return math.ceil(per_process / batch_size)

  def _decode(self, record, size):  # the shorter side at size / 0.875, no larger
    return image_ops.decode(record["image"],
                            min_side=int(round(size / image_ops.EVAL_CROP_FRACTION)))

  def _finish(self, image, size, rng):
    return image_ops.center_crop(image, size)

  def order(self, epoch: int = 0) -> np.ndarray:
    """This process's record indices (the same every epoch)."""
    return np.arange(len(self.raw))[self.process_index::self.process_count][:self.per_process]

  def epoch_dataset(self, epoch: int, size: int) -> grain.MapDataset:
    """This process's records at image `size`, batched (the last batch may be short)."""
    order = self.order(epoch)
    return self._dataset(order, epoch, size, len(order))

  def eval_batches(self, size: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """This process's share of the records in order, centre-cropped: (images, labels, weights);
    the last batch is padded (repeating the last example) with weight 0."""
    for images, labels in self._read(self.epoch_dataset(0, size)):
      yield pad_batch(self.batch_size, images, labels)

  def batch(self, step: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    raise ValueError("batch(step) is for train pipelines; use eval_batches(size)")


def ImagePipeline(raw: Any, *, train: bool = True, **kwargs: Any
                  ) -> TrainImagePipeline | EvalImagePipeline:
  """`TrainImagePipeline(raw, **kwargs)` if `train`, else `EvalImagePipeline(raw, **kwargs)`."""
  return (TrainImagePipeline if train else EvalImagePipeline)(raw, **kwargs)
