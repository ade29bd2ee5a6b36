"""Flax models: the ResNet family, the Transformer and an MLP. No training logic here."""

from __future__ import annotations

import difflib
from typing import Any

import jax.numpy as jnp

from sparsejax.models.mlp import MLP
from sparsejax.models.resnet import (
  ResNet,
  ResNet18,
  ResNet20,
  ResNet34,
  ResNet50,
  ResNet101,
  ResNet152,
)
from sparsejax.models.transformer import (
  Transformer,
  TransformerBase,
  TransformerBig,
  TransformerLM,
)

__all__ = ["MLP", "ResNet", "ResNet18", "ResNet20", "ResNet34", "ResNet50", "ResNet101",
           "ResNet152", "Transformer", "TransformerBase", "TransformerBig", "TransformerLM",
           "MODELS", "build"]

MODELS = {"resnet18": ResNet18, "resnet34": ResNet34, "resnet50": ResNet50,
          "resnet101": ResNet101, "resnet152": ResNet152, "resnet20": ResNet20,
          "transformer_base": TransformerBase, "transformer_big": TransformerBig,
          "transformer_lm": TransformerLM, "mlp": MLP}
SEQUENCE_MODELS = ("transformer_base", "transformer_big", "transformer_lm")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def build(name: str, *, num_classes: int, dtype: str = "float32", **kwargs: Any):
  """The flax module called `name` (see MODELS) with compute dtype "float32" or "bfloat16".

  For the Transformers `num_classes` is the vocabulary size."""
  if name not in MODELS:
    close = difflib.get_close_matches(name, MODELS, n=3)
    raise ValueError(f"unknown model {name!r}; allowed: {sorted(MODELS)}"
                     + (f" (did you mean {', '.join(close)}?)" if close else ""))
  if dtype not in DTYPES:
    raise ValueError(f"model dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
  if name in SEQUENCE_MODELS:
    return MODELS[name](vocab_size=num_classes, dtype=DTYPES[dtype], **kwargs)
  return MODELS[name](num_classes=num_classes, dtype=DTYPES[dtype], **kwargs)
