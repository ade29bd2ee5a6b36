"""Parallel text for the encoder-decoder Transformer: WMT14 en-de via TFDS, or any TSV corpus.

  pairs = tfds_pairs(data_dir=tfds_dir, split="train")   # wmt14_translate/de-en, en -> de
  pairs = tsv_pairs("corpus.tsv")                           # "source<TAB>target" per line
  tok = bpe_tokenizer(tokenizer_corpus(pairs), vocab_size=32000, cache_dir=...)  # joint BPE
  src, tgt = encode_pairs(tok, pairs, seq_len=128)
  # src: [n, L] ids + EOS, padded with 0; tgt: [n, L + 1] BOS + ids + EOS, padded with 0

The model reads `(src, tgt[:, :-1])` and predicts `tgt[:, 1:]`; padding (id 0) is masked out of
the loss and the metrics by the trainer. Longer sentences are cut at `seq_len` tokens.
`sparsejax prepare wmt14 --data-dir D` builds TFDS's `wmt14_translate/de-en` (4.5M training
pairs; newstest2013 as validation, newstest2014 as test) into ArrayRecord files under D.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from sparsejax.data import prepared
from sparsejax.data.batching import EpochOrder, padded_batches, process_share
from sparsejax.data.text import BOS, EOS, Tokenizer

__all__ = ["WMT14", "prepare_wmt14", "tfds_pairs", "tsv_pairs", "tokenizer_corpus",
           "encode_pairs", "TranslationInputs"]

WMT14 = "wmt14_translate/de-en"


def prepare_wmt14(data_dir: str) -> Any:
  """Downloads and builds WMT14 en-de with TFDS into ArrayRecord files (idempotent)."""
  return prepared.build(WMT14, data_dir)


def _text(value: Any) -> str:
  return value.decode("utf-8") if isinstance(value, bytes | np.bytes_) else str(value)


def tfds_pairs(*, data_dir: str, split: str, name: str = WMT14, source: str = "en",
               target: str = "de") -> list[tuple[str, str]]:
  """(source, target) sentence pairs of a prepared TFDS translation dataset's split."""
  builder = prepared.open_split(name, data_dir, split,
                                f"sparsejax prepare wmt14 --data-dir {data_dir}")
  for lang in (source, target):
    if lang not in builder.info.features:
      raise ValueError(f"{name} has no language {lang!r}; it has "
                       f"{sorted(builder.info.features.keys())}")
  ds = builder.as_data_source(split)
  return [(_text(ex[source]), _text(ex[target])) for ex in (ds[i] for i in range(len(ds)))]


def tsv_pairs(path: str) -> list[tuple[str, str]]:
  """(source, target) pairs from a UTF-8 file of `source<TAB>target` lines (blank lines
  skipped)."""
  pairs = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      line = line.rstrip("\n")
      if not line.strip():
        continue
      parts = line.split("\t")
      if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
        raise ValueError(f"{path}:{number}: expected 'source<TAB>target', got {line[:80]!r}")
      pairs.append((parts[0], parts[1]))
  if not pairs:
    raise ValueError(f"{path}: no sentence pairs")
  return pairs


def tokenizer_corpus(pairs: Sequence[tuple[str, str]], max_sentences: int = 2_000_000,
                     seed: int = 0) -> list[str]:
  """The sentences a joint BPE is trained on: both sides of (a seeded sample of) the pairs."""
  idx = np.arange(len(pairs))
  if 2 * len(pairs) > max_sentences:
    idx = np.sort(np.random.default_rng(seed).choice(len(pairs), max_sentences // 2,
                                                     replace=False))
  return [s for i in idx for s in pairs[i]]


def encode_pairs(tok: Tokenizer, pairs: Sequence[tuple[str, str]], seq_len: int
                 ) -> tuple[np.ndarray, np.ndarray]:
  """int32 src [n, seq_len] (ids + EOS) and tgt [n, seq_len + 1] (BOS + ids + EOS), cut at the
  length and padded with 0."""
  if seq_len < 2:
    raise ValueError(f"seq_len must be >= 2, got {seq_len}")
  n = len(pairs)
  src = np.zeros((n, seq_len), np.int32)
  tgt = np.zeros((n, seq_len + 1), np.int32)
  sources = tok.encode([p[0] for p in pairs])
  targets = tok.encode([p[1] for p in pairs])
  for i, (s, t) in enumerate(zip(sources, targets, strict=True)):
    s = [*s[:seq_len - 1], EOS]
    t = [BOS, *t[:seq_len - 1], EOS]
    src[i, :len(s)] = s
    tgt[i, :len(t)] = t
  return src, tgt


class TranslationInputs:
  """Sentence pairs for the loop: batches of ((src[b, L], tgt_in[b, L]), tgt_out[b, L])."""

  def __init__(self, train: tuple[np.ndarray, np.ndarray], val: tuple[np.ndarray, np.ndarray],
               vocab_size: int, batch_size: int, seed: int):
    if batch_size > len(train[0]):
      raise ValueError(f"global batch {batch_size} is larger than the {len(train[0])} training "
                       "sentence pairs; lower batch_size")
    self.seq_len = train[0].shape[1]
    self.train, self.val = train, val
    self.order = EpochOrder(len(train[0]), batch_size, seed)
    self.batch_size, self.num_classes = batch_size, vocab_size
    self.steps_per_epoch = self.order.steps_per_epoch
    self.rows = slice(*process_share(batch_size))

  @staticmethod
  def _split(src: np.ndarray, tgt: np.ndarray):
    return (src, tgt[:, :-1]), tgt[:, 1:]

  def example(self, size):
    z = np.zeros((1, self.seq_len), np.int32)
    return (z, z)

  def train_batch(self, step, size):
    idx = self.order.rows(step)[self.rows]
    return self._split(self.train[0][idx], self.train[1][idx])

  def eval_batches(self, size) -> Iterator[tuple[Any, np.ndarray, np.ndarray]]:
    for src, tgt, weights in padded_batches(self.val, self.batch_size):
      inputs, labels = self._split(src[self.rows], tgt[self.rows])
      yield inputs, labels, weights[self.rows]

  def stats(self):
    return {}
