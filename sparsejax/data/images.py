"""JPEG decoding and the ImageNet image transforms, on uint8 HWC numpy arrays (host side).

Decoding uses Pillow; with a target size it asks libjpeg to decode at a reduced scale (1/2, 1/4,
1/8: `Image.draft`), which is most of the cost saved in the low-resolution epochs. Normalisation
(mean/std) happens on the device, in the train step, so batches travel as uint8.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

__all__ = ["decode", "resize_short_side", "random_resized_crop", "center_crop", "MEAN_RGB",
           "STDDEV_RGB", "EVAL_CROP_FRACTION"]

MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)
EVAL_CROP_FRACTION = 0.875  # eval: resize the shorter side to size / 0.875, crop the centre


class CorruptImage(ValueError):
  """Bytes that are not a decodable image."""


def decode(data: bytes, short_side: int | None = None, *, min_side: int | None = None
           ) -> np.ndarray:
  """uint8[h, w, 3] RGB from encoded bytes (JPEG, PNG, ...; grey and CMYK are converted).

  short_side: scale the shorter side to exactly this (antialiased).
  min_side: only let the decoder work at a reduced scale that keeps the shorter side >= this.
  Either way libjpeg decodes at the smallest of 1, 1/2, 1/4, 1/8 scale that is still large
  enough. Raises CorruptImage for bytes that do not decode."""
  target = short_side if short_side is not None else min_side
  try:
    img = Image.open(io.BytesIO(data))
    if target is not None:
      w, h = img.size
      scale = target / min(w, h)
      img.draft("RGB", (max(1, int(w * scale)), max(1, int(h * scale))))
    img = img.convert("RGB")
    img.load()
  except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as e:
    raise CorruptImage(str(e)) from e
  if short_side is not None:
    img = _resize_pil_short(img, short_side)
  return np.asarray(img)


def _resize_pil_short(img: Image.Image, short_side: int) -> Image.Image:
  w, h = img.size
  if min(w, h) == short_side:
    return img
  if w <= h:
    size = (short_side, max(1, round(h * short_side / w)))
  else:
    size = (max(1, round(w * short_side / h)), short_side)
  return img.resize(size, Image.BILINEAR, reducing_gap=None)


def resize_short_side(image: np.ndarray, short_side: int) -> np.ndarray:
  """uint8 HWC resized so its shorter side is `short_side` (bilinear, antialiased)."""
  return np.asarray(_resize_pil_short(Image.fromarray(image), short_side))


def random_resized_crop(image: np.ndarray, size: int, rng: np.random.Generator, *,
                        scale: tuple[float, float] = (0.08, 1.0),
                        ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = True
                        ) -> np.ndarray:
  """Inception-style crop: a random area fraction in `scale` and aspect ratio in `ratio` (10
  tries, then the central crop), resized to size x size; flipped left-right with p = 1/2."""
  h, w = image.shape[:2]
  area = h * w
  for _ in range(10):
    target = area * rng.uniform(*scale)
    aspect = np.exp(rng.uniform(np.log(ratio[0]), np.log(ratio[1])))
    cw, ch = int(round(np.sqrt(target * aspect))), int(round(np.sqrt(target / aspect)))
    if 0 < cw <= w and 0 < ch <= h:
      y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
      break
  else:
    ch = cw = min(h, w)
    y, x = (h - ch) // 2, (w - cw) // 2
  img = Image.fromarray(image).resize((size, size), Image.BILINEAR,
                                      box=(x, y, x + cw, y + ch), reducing_gap=None)
  out = np.asarray(img)
  if flip and rng.random() < 0.5:
    out = out[:, ::-1]
  return out


def center_crop(image: np.ndarray, size: int, crop_fraction: float = EVAL_CROP_FRACTION
                ) -> np.ndarray:
  """Eval transform: shorter side to size / crop_fraction, then the central size x size."""
  short = max(size, int(round(size / crop_fraction)))
  img = _resize_pil_short(Image.fromarray(image), short)
  w, h = img.size
  x, y = (w - size) // 2, (h - size) // 2
  return np.asarray(img.crop((x, y, x + size, y + size)))
