"""ImageNet end to end on a generated manual download: TFDS's real builder prepares ArrayRecord,
then TFDS's random-access source -> TieredCache -> grain pipeline -> uint8 batches."""

from __future__ import annotations

import numpy as np
import pytest

from sparsejax.data import TieredCache, imagenet, pipeline

PER_CLASS, CLASSES, VAL = 6, 4, 8


@pytest.fixture(scope="module")
def prepared(fake_imagenet):
  return fake_imagenet


def make(data_dir, root, *, batch=6, workers=0, process_index=0, process_count=1, tag="a"):
  raw = TieredCache(imagenet.source(data_dir, "train"), memory_bytes=1 << 24,
                    disk_dir=str(root / f"cache-{tag}"), disk_bytes=1 << 26,
                    key=f"fake-imagenet-train-{data_dir}")
  decoded = lambda src: TieredCache(src, memory_bytes=1 << 24,  # noqa: E731
                                    disk_dir=str(root / f"cache-{tag}"), disk_bytes=1 << 26,
                                    key=f"decoded-{src.short_side}-{data_dir}")
  return raw, pipeline.ImagePipeline(raw, batch_size=batch, seed=3, train=True,
                                     decoded_cache=decoded, decoded_max_size=64,
                                     process_index=process_index, process_count=process_count,
                                     workers=workers, threads=4)


def test_prepared_by_the_real_tfds_builder(prepared):
  data_dir, info, _ = prepared
  train, val = imagenet.source(data_dir, "train"), imagenet.source(data_dir, "validation")
  assert len(train) == CLASSES * PER_CLASS and len(val) == VAL
  names = {train[i]["file_name"].decode() if isinstance(train[i]["file_name"], bytes)
           else train[i]["file_name"] for i in range(len(train))}
  assert set(info["corrupt"]) <= names
  record = train[0]
  assert record["image"][:2] == b"\xff\xd8" and 0 <= record["label"] < CLASSES


def test_batches_at_two_resolutions_skip_and_count_the_corrupt_jpeg(prepared):
  data_dir, info, root = prepared
  raw, pipe = make(data_dir, root)
  assert pipe.steps_per_epoch == CLASSES * PER_CLASS // 6 == 4
  labels_seen = []
  for step in range(8):  # epoch 0 at 64 px (decoded cache), epoch 1 at 96 px (JPEG decode)
    size = 64 if step < 4 else 96
    images, labels = pipe.batch(step, size)
    assert images.shape == (6, size, size, 3) and images.dtype == np.uint8
    assert labels.shape == (6,) and labels.dtype == np.int32
    assert ((0 <= labels) & (labels < CLASSES)).all()
    assert images.std() > 5  # real pictures, not blank
    labels_seen.append(labels)
  # Every record once per epoch, the corrupt one replaced by its successor: counted per epoch.
  assert pipe.stats()["corrupt"] == 2
  counts = np.bincount(np.concatenate(labels_seen[:4]), minlength=CLASSES)
  assert counts.sum() == 24 and sorted(counts)[0] >= PER_CLASS - 1
  s = raw.stats()
  assert s["source"]["reads"] == 24  # each JPEG read from TFDS once; epoch 1 from memory
  assert s["memory"]["hits"] >= 24


def test_a_restored_pipeline_gives_the_same_batches(prepared):
  data_dir, _, root = prepared
  _, first = make(data_dir, root)
  uninterrupted = [first.batch(s, 64 if s < 6 else 80) for s in range(9)]
  _, restored = make(data_dir, root)  # a new process after a checkpoint at step 5
  for s in range(5, 9):
    images, labels = restored.batch(s, 64 if s < 6 else 80)
    np.testing.assert_array_equal(images, uninterrupted[s][0])
    np.testing.assert_array_equal(labels, uninterrupted[s][1])


@pytest.mark.integration  # end to end: grain's worker processes
def test_grain_worker_processes_give_the_same_batches(prepared):
  data_dir, _, root = prepared
  _, serial = make(data_dir, root, tag="serial")
  raw, parallel = make(data_dir, root, workers=2, tag="parallel")
  for s in range(3):
    a, b = serial.batch(s, 64), parallel.batch(s, 64)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
  assert raw.stats()["source"]["reads"] >= 18  # counted in the workers, read here


def test_processes_read_disjoint_shares(prepared):
  data_dir, _, root = prepared
  shares = [make(data_dir, root, batch=4, process_index=p, process_count=2, tag="p")[1]
            for p in range(2)]
  orders = [set(p.order(1).tolist()) for p in shares]
  assert not orders[0] & orders[1] and len(orders[0] | orders[1]) == 24
  assert shares[0].steps_per_epoch == 3


def test_eval_batches_cover_the_validation_split_once(prepared):
  data_dir, _, _ = prepared
  pipe = pipeline.ImagePipeline(imagenet.source(data_dir, "validation"), batch_size=3, train=False,
                                process_index=0, process_count=1)
  batches = list(pipe.eval_batches(72))
  assert [b[0].shape for b in batches] == [(3, 72, 72, 3)] * 3
  assert sum(b[2].sum() for b in batches) == VAL
  with pytest.raises(ValueError, match="eval_batches"):
    pipe.batch(0, 72)


def test_missing_or_empty_manual_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist.*ILSVRC2012_img_train.tar"):
    imagenet.prepare(str(tmp_path / "nowhere"), str(tmp_path / "data"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError,
                     match="holds neither file.*ILSVRC2012_img_train.tar.*ILSVRC2012_img_val.tar"):
    imagenet.prepare(str(tmp_path / "empty"), str(tmp_path / "data"))
  (tmp_path / "empty" / "ILSVRC2012_img_val.tar").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match="ILSVRC2012_img_val.tar is empty"):
    imagenet.prepare(str(tmp_path / "empty"), str(tmp_path / "data"))
  with pytest.raises(FileNotFoundError, match="not prepared under"):
    imagenet.source(str(tmp_path / "data"), "train")


def test_pipeline_bad_arguments(prepared):
  data_dir, _, _ = prepared
  src = imagenet.source(data_dir, "train")
  with pytest.raises(ValueError, match=r"batch_size 25 per process must be in \[1, 24\]"):
    pipeline.ImagePipeline(src, batch_size=25, process_index=0, process_count=1)
  with pytest.raises(ValueError, match="process_index 2 not in"):
    pipeline.ImagePipeline(src, batch_size=2, process_index=2, process_count=2)
  with pytest.raises(ValueError, match="short_side must be a positive int"):
    pipeline.DecodedSource(src, 0)


def test_cli_prepare_imagenet_needs_a_manual_dir(tmp_path, capsys):
  from sparsejax import cli
  assert cli.main(["prepare", "imagenet", "--data-dir", str(tmp_path)]) == 2
  assert "needs --manual-dir" in capsys.readouterr().err
  assert cli.main(["prepare", "imagenet", "--manual-dir", str(tmp_path / "none"),
                   "--data-dir", str(tmp_path)]) == 2
  assert "none" in capsys.readouterr().err
