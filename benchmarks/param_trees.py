"""Parameter trees of real models as `jax.ShapeDtypeStruct`s, for optimizer and comm benchmarks.

The shapes follow flax's conventions (conv kernels HWIO, dense kernels (in, out), attention kernels
(d_model, heads, head_dim)); leaf counts and sizes are those of the published models.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _s(*shape: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, np.float32)


def resnet50(num_classes: int = 1000) -> dict[str, Any]:
  """ResNet-50 v1.5 (He et al.; torchvision layout): 161 leaves, 25,557,032 values at 1000 classes.

  Convolutions have no bias; every BatchNorm has a scale and a bias."""
  def bn(c: int) -> dict[str, Any]:
    return {"scale": _s(c), "bias": _s(c)}

  tree: dict[str, Any] = {"conv_init": _s(7, 7, 3, 64), "bn_init": bn(64)}
  cin = 64
  for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
    for b in range(blocks):
      block = {"conv1": _s(1, 1, cin, width), "bn1": bn(width),
               "conv2": _s(3, 3, width, width), "bn2": bn(width),
               "conv3": _s(1, 1, width, 4 * width), "bn3": bn(4 * width)}
      if b == 0:
        block["proj_conv"] = _s(1, 1, cin, 4 * width)
        block["proj_bn"] = bn(4 * width)
      tree[f"stage{stage + 1}_block{b + 1}"] = block
      cin = 4 * width
  tree["head"] = {"kernel": _s(2048, num_classes), "bias": _s(num_classes)}
  return tree


def transformer_base(vocab: int = 32000, d: int = 512, ff: int = 2048, heads: int = 8,
                     layers: int = 6) -> dict[str, Any]:
  """Transformer "base" (Vaswani et al. 2017), encoder-decoder with a shared embedding, pre-LN
  layout: 257 leaves, 60,524,544 values at a 32k vocabulary (the same count as
  `sparsejax.models.TransformerBase(vocab_size=32000, pre_ln=True)`)."""
  hd = d // heads

  def attn() -> dict[str, Any]:
    return {"query": {"kernel": _s(d, heads, hd), "bias": _s(heads, hd)},
            "key": {"kernel": _s(d, heads, hd), "bias": _s(heads, hd)},
            "value": {"kernel": _s(d, heads, hd), "bias": _s(heads, hd)},
            "out": {"kernel": _s(heads, hd, d), "bias": _s(d)}}

  def ln() -> dict[str, Any]:
    return {"scale": _s(d), "bias": _s(d)}

  def mlp() -> dict[str, Any]:
    return {"wi": {"kernel": _s(d, ff), "bias": _s(ff)}, "wo": {"kernel": _s(ff, d), "bias": _s(d)}}

  enc = {f"layer{i}": {"ln1": ln(), "attn": attn(), "ln2": ln(), "mlp": mlp()}
         for i in range(layers)}
  enc["ln_final"] = ln()
  dec = {f"layer{i}": {"ln1": ln(), "self_attn": attn(), "ln2": ln(), "cross_attn": attn(),
                       "ln3": ln(), "mlp": mlp()} for i in range(layers)}
  dec["ln_final"] = ln()
  return {"embed": _s(vocab, d), "encoder": enc, "decoder": dec}


def uniform(leaf: int, total: int = 25_557_032) -> dict[str, Any]:
  """`total` values (ResNet-50's count by default) as 1-D leaves of `leaf` values each (the last
  one shorter): how an optimizer's time depends on tensor size, with the total fixed."""
  sizes = [leaf] * (total // leaf) + ([total % leaf] if total % leaf else [])
  return {f"w{i:04d}": _s(n) for i, n in enumerate(sizes)}


# Leaf sizes of the uniform trees, in values: ~256 KB (fits a core's L2 with a second buffer of its
# size), ~1 MB, ~4 MB and ~10 MB (ResNet-50's largest conv kernel, 3x3x512x512) of float32.
UNIFORM_LEAVES = {"64k": 65_521, "256k": 262_139, "1m": 1_048_573, "2.4m": 2_359_297}

TREES = {"resnet50": resnet50, "transformer_base": transformer_base,
         **{f"uniform_{name}": (lambda n=n: uniform(n)) for name, n in UNIFORM_LEAVES.items()}}
