"""ResNet v1.5 (He et al. 2016; stride on the 3x3 convolution, as torchvision) in flax.linen.

`ResNet50(num_classes=1000)` has exactly 25,557,032 parameters. `small_inputs=True` gives the
CIFAR-style stem (one 3x3 convolution, no max-pool) for 8-32 px images; `ResNet20` is the CIFAR
ResNet-20 (three stages of 16/32/64 channels). BatchNorm statistics are those of the batch each
device sees (no cross-device sync), as in the paper; the trainer averages the running statistics
over devices before evaluation and checkpointing. Parameters are float32; `dtype` sets the compute
dtype (float32 or bfloat16); logits are returned in float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

ModuleDef = Any


class _Block(nn.Module):
  """What both blocks share: their fields and the way out (zero-initialised last BatchNorm, a
  projection shortcut where the shape changes, the sum, the activation)."""

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable
  strides: tuple[int, int] = (1, 1)

  def _out(self, x, y, filters: int):
    """`act(shortcut(x) + norm(y))`; called from the block's compact `__call__`."""
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if x.shape != y.shape:
      x = self.conv(filters, (1, 1), self.strides, name="proj_conv")(x)
      x = self.norm(name="proj_bn")(x)
    return self.act(x + y)


class ResNetBlock(_Block):
  """Basic block: two 3x3 convolutions (ResNet-18/34, CIFAR ResNets)."""

  @nn.compact
  def __call__(self, x):
    y = self.conv(self.filters, (3, 3), self.strides)(x)
    y = self.act(self.norm()(y))
    return self._out(x, self.conv(self.filters, (3, 3))(y), self.filters)


class BottleneckResNetBlock(_Block):
  """Bottleneck block: 1x1, 3x3 (strided, v1.5), 1x1 with 4x the filters (ResNet-50 and up)."""

  @nn.compact
  def __call__(self, x):
    y = self.act(self.norm()(self.conv(self.filters, (1, 1))(x)))
    y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
    return self._out(x, self.conv(self.filters * 4, (1, 1))(y), self.filters * 4)


class ResNet(nn.Module):
  """ResNet v1.5 over NHWC images; returns float32 logits [batch, num_classes]."""

  stage_sizes: Sequence[int]
  block_cls: ModuleDef
  num_classes: int
  num_filters: int = 64
  small_inputs: bool = False
  dtype: Any = jnp.float32
  act: Callable = nn.relu

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, dtype=self.dtype, param_dtype=jnp.float32)
    x = jnp.asarray(x, self.dtype)
    if self.small_inputs:
      x = conv(self.num_filters, (3, 3), name="conv_init")(x)
      x = self.act(norm(name="bn_init")(x))
    else:
      x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
      x = self.act(norm(name="bn_init")(x))
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, blocks in enumerate(self.stage_sizes):
      for j in range(blocks):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = self.block_cls(self.num_filters * 2**i, strides=strides, conv=conv, norm=norm,
                           act=self.act)(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=jnp.float32, name="head")(x)
    return jnp.asarray(x, jnp.float32)


ResNet18 = functools.partial(ResNet, stage_sizes=(2, 2, 2, 2), block_cls=ResNetBlock)
ResNet34 = functools.partial(ResNet, stage_sizes=(3, 4, 6, 3), block_cls=ResNetBlock)
ResNet50 = functools.partial(ResNet, stage_sizes=(3, 4, 6, 3), block_cls=BottleneckResNetBlock)
ResNet101 = functools.partial(ResNet, stage_sizes=(3, 4, 23, 3), block_cls=BottleneckResNetBlock)
ResNet152 = functools.partial(ResNet, stage_sizes=(3, 8, 36, 3), block_cls=BottleneckResNetBlock)
# CIFAR-style ResNet-20 for small images (He et al. 2016, section 4.2): 0.27M parameters.
ResNet20 = functools.partial(ResNet, stage_sizes=(3, 3, 3), block_cls=ResNetBlock,
                             num_filters=16, small_inputs=True)
