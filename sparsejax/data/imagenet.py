"""ImageNet (ILSVRC 2012) through TFDS: preparation into ArrayRecord, and random-access reading.

  prepare(manual_dir, data_dir)        # once: TFDS's own imagenet2012 builder (needs TensorFlow:
                                       #   pip install 'sparsejax[prepare]')
  source(data_dir, "train")            # grain-compatible random access: {"image": JPEG bytes,
                                       #   "label": int, "file_name": str}

`manual_dir` is the official layout: ILSVRC2012_img_train.tar (one tar per synset inside) and
ILSVRC2012_img_val.tar. `fake_manual_dir` writes a small one with real JPEGs, for tests, the
benchmarks and the DAWNBench smoke run.
"""

from __future__ import annotations

import io
import os
import tarfile
from typing import Any

import numpy as np

from sparsejax.data import prepared

__all__ = ["NAME", "NUM_CLASSES", "MANUAL_FILES", "check_manual_dir", "prepare", "source",
           "fake_manual_dir", "synthetic_jpeg"]

NAME = "imagenet2012"
NUM_CLASSES = 1000
MANUAL_FILES = ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar")


def check_manual_dir(manual_dir: str) -> None:
  """Raises FileNotFoundError naming what TFDS expects where, unless `manual_dir` holds it."""
  expect = (f"TFDS expects the ImageNet manual download in {manual_dir!r}: "
            f"{MANUAL_FILES[0]} (one tar per synset, e.g. n01440764.tar, inside) and "
            f"{MANUAL_FILES[1]} (ILSVRC2012_val_00000001.JPEG, ...), from "
            "https://image-net.org/download-images")
  if not os.path.isdir(manual_dir):
    raise FileNotFoundError(f"the manual directory does not exist. {expect}")
  present = [f for f in MANUAL_FILES if os.path.isfile(os.path.join(manual_dir, f))]
  if not present:
    listing = sorted(os.listdir(manual_dir))[:5] or "nothing"
    raise FileNotFoundError(f"the manual directory holds neither file (it has {listing}). "
                            f"{expect}")
  for f in present:
    if os.path.getsize(os.path.join(manual_dir, f)) == 0:
      raise FileNotFoundError(f"{os.path.join(manual_dir, f)} is empty. {expect}")


def prepare(manual_dir: str, data_dir: str) -> Any:
  """Builds `imagenet2012` from `manual_dir` into ArrayRecord files under `data_dir` with TFDS's
  builder (idempotent: a prepared dataset is left alone). Returns the builder."""
  check_manual_dir(manual_dir)
  import tensorflow_datasets as tfds
  return prepared.build(NAME, data_dir, download_config=tfds.download.DownloadConfig(
      manual_dir=manual_dir))


def source(data_dir: str, split: str) -> Any:
  """TFDS's random-access source of a prepared split, images left encoded (JPEG bytes)."""
  import tensorflow_datasets as tfds
  builder = prepared.open_split(NAME, data_dir, split, "sparsejax prepare imagenet --manual-dir "
                                f"DIR --data-dir {data_dir}")
  return builder.as_data_source(split, decoders={"image": tfds.decode.SkipDecoding()})


def synthetic_jpeg(rng: np.random.Generator, width: int, height: int, *, grey: bool = False,
                   quality: int = 90) -> bytes:
  """A real JPEG of a smooth random pattern (compresses like a photograph, not like noise)."""
  from PIL import Image
  yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
  channels = []
  for _ in range(1 if grey else 3):
    fx, fy, phase = rng.uniform(0.005, 0.08), rng.uniform(0.005, 0.08), rng.uniform(0, 6.3)
    wave = np.sin(fx * xx + phase) * np.cos(fy * yy - phase)
    channels.append(127.5 + 100 * wave + rng.normal(0, 12, wave.shape))
  arr = np.clip(np.stack(channels, -1), 0, 255).astype(np.uint8)
  img = Image.fromarray(arr[..., 0] if grey else arr, "L" if grey else "RGB")
  buf = io.BytesIO()
  img.save(buf, "JPEG", quality=quality)
  return buf.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
  info = tarfile.TarInfo(name)
  info.size = len(data)
  tar.addfile(info, io.BytesIO(data))


def fake_manual_dir(path: str, *, classes: int = 4, per_class: int = 6, val: int = 8,
                    corrupt: int = 1, min_side: int = 48, max_side: int = 160, seed: int = 0
                    ) -> dict[str, Any]:
  """Writes a small ImageNet manual download in the official layout: real JPEGs of varied sizes
  (one grey), `classes` synsets (the first ones of ImageNet's label list) of `per_class` training
  images, `val` validation images, and `corrupt` training files that are not valid JPEGs.
  Returns {"train": n, "val": n, "corrupt": [file names], "synsets": [...]}."""
  from tensorflow_datasets.datasets.imagenet2012 import imagenet_common
  with open(imagenet_common.label_names_file()) as f:
    synsets = [line.strip() for line in f if line.strip()][:classes]
  rng = np.random.default_rng(seed)
  os.makedirs(path, exist_ok=True)
  corrupt_names = []

  def jpeg(i: int) -> bytes:
    w, h = (int(v) for v in rng.integers(min_side, max_side + 1, 2))
    return synthetic_jpeg(rng, w, h, grey=(i == 1))

  train_tar = os.path.join(path, MANUAL_FILES[0])
  with tarfile.open(train_tar + ".tmp", "w") as outer:
    count = 0
    for synset in synsets:
      buf = io.BytesIO()
      with tarfile.open(fileobj=buf, mode="w") as inner:
        for j in range(per_class):
          name = f"{synset}_{1000 + j}.JPEG"
          data = jpeg(count)
          if len(corrupt_names) < corrupt and j == per_class - 1:
            data = data[:40] + b"\x00garbage" * 8  # JPEG header, then nonsense: not decodable
            corrupt_names.append(name)
          _add(inner, name, data)
          count += 1
      _add(outer, f"{synset}.tar", buf.getvalue())
  os.replace(train_tar + ".tmp", train_tar)
  val_tar = os.path.join(path, MANUAL_FILES[1])
  with tarfile.open(val_tar + ".tmp", "w") as tar:
    for i in range(val):
      _add(tar, f"ILSVRC2012_val_{i + 1:08d}.JPEG", jpeg(i + 7))
  os.replace(val_tar + ".tmp", val_tar)
  return {"train": classes * per_class, "val": val, "corrupt": corrupt_names, "synsets": synsets}
