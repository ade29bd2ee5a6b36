"""What the train loop reads: one protocol over every kind of input (images, token sequences,
sentence pairs), and `open_inputs(config)`, which builds the one `config.data` names.

  data = open_inputs(config)              # config.data names the set; batch sizes from config
  data.train_batch(step, size)            # this process's share of global batch `step`
  data.eval_batches(size)                 # (inputs, targets, weights), padded, this process's
  data.stats()                            # input counters to log (cache tiers, corrupt records)

Batches are a function of the step (see `batching.EpochOrder`, `pipeline.TrainImagePipeline`):
the checkpointed step is the iterator position.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from sparsejax.data import small
from sparsejax.data.batching import process_share
from sparsejax.data.cache import TieredCache

__all__ = ["Inputs", "InMemoryInputs", "ImageNetInputs", "open_inputs"]

# What a model takes: one array (images, tokens) or a tuple of arrays (source and target tokens),
# batch on axis 0.
ModelInputs = Any


@runtime_checkable
class Inputs(Protocol):
  """A dataset as the train loop reads it. A batch is (inputs, targets): `inputs` what the model
  takes (`ModelInputs`), `targets` int32[batch, ...] (class labels, or the next tokens). `size`
  is the image side of the current resolution stage; inputs that are not images ignore it.

  num_classes: classes, or the vocabulary size for token inputs.
  steps_per_epoch: global batches per epoch.
  """

  num_classes: int
  steps_per_epoch: int

  def example(self, size: int | None) -> ModelInputs:
    """Inputs of a batch of one, as the model sees them (for initialisation)."""
    ...

  def train_batch(self, step: int, size: int | None) -> tuple[ModelInputs, np.ndarray]:
    """This process's rows of global batch `step` (counting over all epochs)."""
    ...

  def eval_batches(self, size: int | None
                   ) -> Iterator[tuple[ModelInputs, np.ndarray, np.ndarray]]:
    """This process's rows of the held-out set in order: (inputs, targets, float32 weights), the
    last batch padded with weight 0."""
    ...

  def stats(self) -> dict[str, float]:
    """Input counters to log (may be empty)."""
    ...


class InMemoryInputs:
  """A small dataset held in memory (digits, Fashion-MNIST, any IDX directory). Every process
  holds all of it and builds the same global batches; each returns its own rows."""

  def __init__(self, train: small.ArrayDataset, test: small.ArrayDataset, batch_size: int,
               seed: int, augment: str = ""):
    self.train, self.test, self.batch_size = train, test, batch_size
    self.seed, self.augment = seed, augment
    self.batcher = small.EpochBatcher(train, batch_size, seed)
    self.num_classes = train.num_classes
    self.steps_per_epoch = self.batcher.steps_per_epoch
    self.rows = slice(*process_share(batch_size))

  def example(self, size):
    """A batch of one input, as the model sees it (for initialisation)."""
    shape = self.train.images.shape[1:]
    return np.zeros((1,) + (shape if size is None else (size, size) + shape[2:]), np.float32)

  def train_batch(self, step, size):
    images, labels = self.batcher.batch(step)
    images = small.augment(images, self.augment, self.seed, step)  # (the global batch's draw)
    images, labels = images[self.rows], labels[self.rows]
    return (images if size is None else small.resize(images, size)), labels

  def eval_batches(self, size):
    for images, labels, weights in small.eval_batches(self.test, self.batch_size):
      images, labels, weights = images[self.rows], labels[self.rows], weights[self.rows]
      yield (images if size is None else small.resize(images, size)), labels, weights

  def stats(self):
    return {}


class ImageNetInputs:
  """TFDS `imagenet2012` prepared under config.data.path, through the tiered cache (both cache
  points) and the grain pipeline; `process_count()` processes each read their share."""

  def __init__(self, data_cfg: Any, batch_size: int, seed: int):
    import jax

    from sparsejax.data import imagenet, pipeline
    if not data_cfg.path:
      raise ValueError("dataset 'imagenet2012' needs data.path: the TFDS data directory where "
                       "`sparsejax prepare imagenet` wrote it")
    count = jax.process_count()
    if batch_size % count:
      raise ValueError(f"global batch_size {batch_size} is not divisible by the {count} processes")
    per_process = batch_size // count
    path = os.path.abspath(data_cfg.path)
    cache_dir = data_cfg.cache_dir or None
    disk = data_cfg.disk_cache_bytes if cache_dir else None

    def cached(src, key):
      return TieredCache(src, memory_bytes=data_cfg.memory_cache_bytes, disk_dir=cache_dir,
                         disk_bytes=disk, key=key)

    raw = cached(imagenet.source(path, "train"), f"{imagenet.NAME}:{path}:train")
    self._raw, self._decoded = raw, []

    def decoded(src):
      cache = cached(src, f"{imagenet.NAME}:{path}:train:decoded:{src.short_side}")
      self._decoded.append(cache)
      return cache

    common = dict(process_index=jax.process_index(), process_count=count,
                  workers=data_cfg.workers, threads=data_cfg.threads)
    self.train = pipeline.TrainImagePipeline(raw, batch_size=per_process, seed=seed,
                                             decoded_cache=decoded,
                                             decoded_max_size=data_cfg.decoded_max_size, **common)
    self.eval = pipeline.EvalImagePipeline(imagenet.source(path, data_cfg.eval_split),
                                           batch_size=per_process, **common)
    self.num_classes = imagenet.NUM_CLASSES
    self.steps_per_epoch = self.train.steps_per_epoch

  def example(self, size):
    return np.zeros((1, size or 224, size or 224, 3), np.float32)

  def train_batch(self, step, size):
    return self.train.batch(step, size or 224)

  def eval_batches(self, size):
    return self.eval.eval_batches(size or 224)

  def stats(self):
    """Examples made and corrupt records skipped; the counters of cache point 1 (raw JPEGs) and
    of cache point 2 (decoded images, summed over the resolution stages): the same keys always."""
    out = {f"input_{k}": float(v) for k, v in self.train.stats().items()}
    raw = self._raw.stats()
    decoded = {tier: dict.fromkeys(counters, 0) for tier, counters in raw.items()}
    for cache in self._decoded:
      for tier, counters in cache.stats().items():
        for k, v in counters.items():
          decoded[tier][k] += v
    for name, stats in (("raw", raw), ("decoded", decoded)):
      for tier, counters in stats.items():
        for k, v in counters.items():
          out[f"cache_{name}_{tier}_{k}"] = float(v)
    return out


def text_inputs(data_cfg: Any, batch_size: int, seed: int) -> Any:
  """kjv (the King James Bible), python_docs (the Python 3.11 documentation's sources) or text
  (data.path: a file or directory): split by document,
  BPE-tokenized (cached), packed to data.seq_len."""
  from sparsejax.data import text
  if data_cfg.name == "kjv":
    docs = text.kjv_documents()
  elif data_cfg.name == "python_docs":
    docs = text.python_docs(data_cfg.path)
  elif not data_cfg.path:
    raise ValueError("dataset 'text' needs data.path: a UTF-8 text file or a directory of .txt")
  else:
    docs = text.text_documents(data_cfg.path)
  train_docs, val_docs = text.split_documents(docs)
  tok = text.bpe_tokenizer(train_docs, vocab_size=data_cfg.vocab_size,
                           cache_dir=data_cfg.cache_dir or "~/.cache/sparsejax")
  return text.TextInputs(text.pack(tok.encode(train_docs), data_cfg.seq_len),
                         text.pack(tok.encode(val_docs), data_cfg.seq_len), tok.vocab_size,
                         batch_size, seed)


TEXT_DATASETS = ("kjv", "python_docs", "text")
# wmt14: TFDS wmt14_translate/de-en (en -> de) under data.path; parallel: a TSV file at data.path
TRANSLATION_DATASETS = ("wmt14", "parallel")


def translation_inputs(data_cfg: Any, batch_size: int, seed: int) -> Any:
  """wmt14 (TFDS, data.path = its data directory; eval on data.eval_split) or parallel (a TSV
  file of source<TAB>target lines at data.path; every 20th pair held out): a joint BPE of
  data.vocab_size pieces (cached), pairs cut at data.seq_len tokens."""
  from sparsejax.data import text, translation
  if not data_cfg.path:
    raise ValueError(f"dataset {data_cfg.name!r} needs data.path: "
                     + ("the TFDS data directory of `sparsejax prepare wmt14`"
                        if data_cfg.name == "wmt14" else "a TSV file of source<TAB>target lines"))
  if data_cfg.name == "wmt14":
    train = translation.tfds_pairs(data_dir=data_cfg.path, split="train")
    val = translation.tfds_pairs(data_dir=data_cfg.path, split=data_cfg.eval_split)
  else:
    pairs = translation.tsv_pairs(data_cfg.path)
    train = [p for i, p in enumerate(pairs) if i % 20 != 19]
    val = [p for i, p in enumerate(pairs) if i % 20 == 19]
    if not val:
      raise ValueError(f"{data_cfg.path}: {len(pairs)} pairs leave none for validation "
                       "(every 20th is held out)")
  tok = text.bpe_tokenizer(translation.tokenizer_corpus(train, seed=seed),
                           vocab_size=data_cfg.vocab_size,
                           cache_dir=data_cfg.cache_dir or "~/.cache/sparsejax")
  return translation.TranslationInputs(
      translation.encode_pairs(tok, train, data_cfg.seq_len),
      translation.encode_pairs(tok, val, data_cfg.seq_len), tok.vocab_size, batch_size, seed)


def open_inputs(config: Any) -> Inputs:
  """The inputs `config.data` names, batched by `config.batch_size` (global)."""
  if config.data.name == "imagenet2012":
    return ImageNetInputs(config.data, config.batch_size, config.seed)
  if config.data.name in TEXT_DATASETS:
    return text_inputs(config.data, config.batch_size, config.seed)
  if config.data.name in TRANSLATION_DATASETS:
    return translation_inputs(config.data, config.batch_size, config.seed)
  if config.data.name not in small.DATASETS:
    known = sorted([*small.DATASETS, "imagenet2012", *TEXT_DATASETS, *TRANSLATION_DATASETS])
    raise ValueError(f"unknown dataset {config.data.name!r}; allowed: {known}")
  train, test = small.load(config.data.name, seed=config.seed, path=config.data.path)
  return InMemoryInputs(train, test, config.batch_size, config.seed, config.data.augment)
