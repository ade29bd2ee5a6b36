"""Text for the language models: the KJV corpus, files and directories, BPE (sentencepiece) cached
on disk, packing, batches, and a few real training steps of a Transformer LM through the loop."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from conftest import override

from sparsejax.data import inputs, text
from sparsejax.train import config as config_lib
from sparsejax.train.loop import train_and_evaluate


@pytest.fixture(scope="module")
def kjv():
  return text.kjv_documents()


def test_kjv_is_the_whole_bible_by_chapter(kjv):
  assert len(kjv) == 1189  # chapters in the Protestant canon
  assert kjv[0].startswith("In the beginning God created the heaven")
  assert kjv[-1].endswith("Amen.")
  assert not any(re.search(r"\d+:\d+", d) for d in kjv[:50])  # verse numbers removed
  assert 4_000_000 < sum(map(len, kjv)) < 4_400_000


def test_text_documents_from_a_file_and_a_directory(tmp_path):
  (tmp_path / "a.txt").write_text("First paragraph,\nstill first.\n\n\nSecond one.\n  \nThird.",
                                  encoding="utf-8")
  assert text.text_documents(str(tmp_path / "a.txt")) == [
      "First paragraph,\nstill first.", "Second one.", "Third."]
  (tmp_path / "d" / "sub").mkdir(parents=True)
  (tmp_path / "d" / "b.txt").write_text("béta", encoding="utf-8")
  (tmp_path / "d" / "sub" / "a.txt").write_text("alpha", encoding="utf-8")
  (tmp_path / "d" / "skip.md").write_text("not text", encoding="utf-8")
  assert text.text_documents(str(tmp_path / "d")) == ["béta", "alpha"]
  with pytest.raises(FileNotFoundError, match="neither a file nor a directory"):
    text.text_documents(str(tmp_path / "missing"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="no .txt files"):
    text.text_documents(str(tmp_path / "empty"))


def test_split_is_disjoint_complete_and_deterministic(kjv):
  train, val = text.split_documents(kjv)
  assert len(train) + len(val) == len(kjv) and len(val) == 59  # chapters 10, 30, ..., 1170
  assert set(val).isdisjoint(train[:5]) and text.split_documents(kjv) == (train, val)
  with pytest.raises(ValueError, match="at least 2 documents"):
    text.split_documents(["only one"])


def test_bpe_tokenizer_is_trained_once_and_cached(kjv, tmp_path):
  train, _ = text.split_documents(kjv)
  tok = text.bpe_tokenizer(train, vocab_size=700, cache_dir=str(tmp_path))
  assert tok.vocab_size == 700
  files = os.listdir(tmp_path)
  assert len(files) == 1 and files[0].startswith("bpe-700-")
  mtime = os.path.getmtime(tmp_path / files[0])
  again = text.bpe_tokenizer(train, vocab_size=700, cache_dir=str(tmp_path))
  assert again.path == tok.path and os.path.getmtime(again.path) == mtime
  sample = kjv[1][:300]
  ids = tok.encode([sample])[0]
  assert min(ids) > text.EOS and tok.decode(ids) == sample
  assert len(ids) < len(sample) / 2  # BPE merges: well under a token per two characters
  other = text.bpe_tokenizer(train[:300], vocab_size=700, cache_dir=str(tmp_path))
  assert other.path != tok.path  # another corpus, another model
  with pytest.raises(ValueError, match="vocab_size must be an int >= 8"):
    text.bpe_tokenizer(train, vocab_size=3, cache_dir=str(tmp_path))


def test_pack_concatenates_with_end_of_document_and_cuts_rows():
  docs = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
  flat = [5, 6, 7, 3, 8, 3, 9, 10, 11, 12, 13, 3]
  out = text.pack(docs, seq_len=3)
  assert out.dtype == np.int32
  np.testing.assert_array_equal(out, np.asarray(flat).reshape(3, 4))
  np.testing.assert_array_equal(text.pack(docs, seq_len=4), np.asarray(flat[:10]).reshape(2, 5))
  with pytest.raises(ValueError, match="fewer than one sequence"):
    text.pack([[5]], seq_len=10)


def lm_config(tmp_path, **changes):
  """A 1-layer Transformer LM on KJV with a 512-piece BPE, 2 x 4 devices, 4 steps."""
  return override(config_lib.default_config(), {
      "data.name": "kjv", "data.seq_len": 24, "data.vocab_size": 512,
      "data.cache_dir": str(tmp_path / "cache"), "model.name": "transformer_lm",
      "model.d_model": 32, "model.num_heads": 2, "model.d_ff": 48, "model.num_layers": 1,
      "mesh.nodes": 2, "mesh.local": 4, "batch_size": 16, "num_epochs": 0.001,
      "log_every_steps": 1, "optimizer.name": "adamw", "optimizer.learning_rate": 3e-3,
      "compression.density": 0.05, **changes})


def test_text_inputs_batches_are_shifted_token_sequences(tmp_path):
  data = inputs.open_inputs(config_lib.validate(lm_config(tmp_path)))
  assert data.num_classes == 512
  tokens, targets = data.train_batch(3, None)
  assert tokens.shape == targets.shape == (16, 24) and tokens.dtype == np.int32
  np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])
  assert data.example(None).shape == (1, 24)
  batches = list(data.eval_batches(None))
  assert sum(w.sum() for _, _, w in batches) == len(data.val_seqs) > 0


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
def test_a_transformer_lm_trains_on_kjv_through_the_loop(tmp_path):
  summary = train_and_evaluate(lm_config(tmp_path), str(tmp_path / "run"), progress=False)
  assert summary["steps"] == summary["total_steps"] >= 3
  final = summary["final_eval"]
  assert np.isfinite(final["loss"]) and final["loss"] < np.log(512) + 0.5
  assert summary["best_eval"]["loss"] == final["loss"]  # language models: best by loss
  assert summary["bytes_sent"] > 0


def test_text_bad_input(tmp_path):
  with pytest.raises(ValueError, match="needs data.path"):
    inputs.open_inputs(config_lib.validate(lm_config(tmp_path, **{"data.name": "text"})))
  with pytest.raises(ValueError, match="unknown dataset 'kvj'.*kjv"):
    inputs.open_inputs(config_lib.validate(lm_config(tmp_path, **{"data.name": "kvj"})))
