"""A multi-layer perceptron in flax.linen: the matmul-bound model of the time-to-accuracy study.

`MLP(num_classes=10, hidden=(1024, 1024))` on 28x28x1 images has 1,863,690 parameters (float32).
Inputs of any shape [batch, ...] are flattened; ReLU between the dense layers; `dtype` sets the
compute dtype (float32 or bfloat16); logits are returned in float32. `train` is accepted (and
ignored) so the trainer calls every model the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp


class MLP(nn.Module):
  """Dense layers of widths `hidden`, then a linear head of `num_classes` logits."""

  num_classes: int
  hidden: Sequence[int] = (1024, 1024)
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = jnp.reshape(x, (x.shape[0], -1)).astype(self.dtype)
    for i, width in enumerate(self.hidden):
      x = nn.relu(nn.Dense(width, dtype=self.dtype, name=f"hidden_{i}")(x))
    return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x).astype(jnp.float32)
