"""The Transformer (Vaswani et al. 2017) in flax.linen: encoder-decoder and decoder-only LM.

`TransformerBase(vocab_size=32000)` is the paper's "base" model with a shared source/target/output
embedding (60,522,496 parameters at a 32k vocabulary; pre-LN adds two final LayerNorms:
60,524,544), `TransformerBig` the "big" one (209,125,376). Options:
absolute positions "sinusoidal" (the paper) or "learned"; post-LN (the paper) or pre-LN. Inputs
are int32 token ids, 0 = padding; outputs are float32 logits [batch, length, vocab_size].
The encoder-decoder takes `(source_tokens, target_input_tokens)`; `TransformerLM` takes tokens.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

__all__ = ["Transformer", "TransformerLM", "TransformerBase", "TransformerBig"]


def sinusoidal(length: int, d: int) -> np.ndarray:
  """float32[length, d] sinusoidal position encodings (sin on even, cos on odd channels)."""
  pos = np.arange(length)[:, None]
  inv = np.exp(-np.log(10000.0) * np.arange(0, d, 2) / d)
  out = np.zeros((length, d), np.float32)
  out[:, 0::2] = np.sin(pos * inv)
  out[:, 1::2] = np.cos(pos * inv)
  return out


class Embed(nn.Module):
  """Token embedding (scaled by sqrt(d)) plus absolute positions; `attend` gives output logits."""

  vocab_size: int
  d_model: int
  max_len: int
  positions: str
  dtype: Any

  def setup(self):
    self.table = self.param("embedding", nn.initializers.normal(self.d_model ** -0.5),
                            (self.vocab_size, self.d_model), jnp.float32)
    if self.positions == "learned":
      self.pos = self.param("positions", nn.initializers.normal(0.02),
                            (self.max_len, self.d_model), jnp.float32)
    elif self.positions != "sinusoidal":
      raise ValueError(f"positions must be 'sinusoidal' or 'learned', got {self.positions!r}")

  def __call__(self, tokens):
    length = tokens.shape[-1]
    if length > self.max_len:
      raise ValueError(f"sequence length {length} exceeds max_len {self.max_len}")
    x = jnp.take(self.table, tokens, axis=0) * np.sqrt(self.d_model)
    pos = self.pos[:length] if self.positions == "learned" else sinusoidal(length, self.d_model)
    return (x + pos).astype(self.dtype)

  def attend(self, x):
    return jnp.einsum("...d,vd->...v", x.astype(jnp.float32), self.table)


class Block(nn.Module):
  """One encoder (self-attention) or decoder (self- and cross-attention) layer."""

  d_model: int
  num_heads: int
  d_ff: int
  dropout: float
  pre_ln: bool
  cross: bool
  dtype: Any

  @nn.compact
  def __call__(self, x, mask, memory=None, memory_mask=None, *, train: bool):
    attn = functools.partial(nn.MultiHeadDotProductAttention, num_heads=self.num_heads,
                             dtype=self.dtype, param_dtype=jnp.float32, dropout_rate=self.dropout,
                             deterministic=not train)
    drop = nn.Dropout(self.dropout, deterministic=not train)
    ln = functools.partial(nn.LayerNorm, dtype=self.dtype, param_dtype=jnp.float32)

    def sublayer(x, fn, name):
      if self.pre_ln:
        return x + drop(fn(ln(name=f"ln_{name}")(x)))
      return ln(name=f"ln_{name}")(x + drop(fn(x)))

    x = sublayer(x, lambda h: attn(name="self_attn")(h, h, mask=mask), "self")
    if self.cross:
      x = sublayer(x, lambda h: attn(name="cross_attn")(h, memory, mask=memory_mask), "cross")

    def mlp(h):
      h = nn.Dense(self.d_ff, dtype=self.dtype, param_dtype=jnp.float32, name="wi")(h)
      h = drop(nn.relu(h))
      return nn.Dense(self.d_model, dtype=self.dtype, param_dtype=jnp.float32, name="wo")(h)
    return sublayer(x, mlp, "mlp")


class _Stack(nn.Module):
  num_layers: int
  block: Any
  pre_ln: bool
  dtype: Any

  @nn.compact
  def __call__(self, x, mask, memory=None, memory_mask=None, *, train: bool):
    for i in range(self.num_layers):
      x = self.block(name=f"layer{i}")(x, mask, memory, memory_mask, train=train)
    if self.pre_ln:
      x = nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="ln_final")(x)
    return x


class _Sizes(nn.Module):
  """The fields both Transformers share, and the pieces built from them."""

  vocab_size: int
  d_model: int = 512
  num_heads: int = 8
  d_ff: int = 2048
  num_layers: int = 6
  dropout: float = 0.1
  max_len: int = 256
  positions: str = "sinusoidal"
  pre_ln: bool = False
  dtype: Any = jnp.float32

  def _block(self, cross: bool):
    return functools.partial(Block, self.d_model, self.num_heads, self.d_ff, self.dropout,
                             self.pre_ln, cross, self.dtype)

  def _embed(self) -> Embed:
    """The shared token embedding (its transpose gives the logits); call from `__call__`."""
    return Embed(self.vocab_size, self.d_model, self.max_len, self.positions, self.dtype,
                 name="embed")


class Transformer(_Sizes):
  """Encoder-decoder; `__call__((source, target_in), train)` -> logits [b, t, vocab]."""

  @nn.compact
  def __call__(self, inputs, train: bool = True):
    source, target = inputs
    embed = self._embed()
    drop = nn.Dropout(self.dropout, deterministic=not train)
    src_mask = nn.make_attention_mask(source > 0, source > 0)
    memory = _Stack(self.num_layers, self._block(False), self.pre_ln, self.dtype,
                    name="encoder")(drop(embed(source)), src_mask, train=train)
    self_mask = nn.combine_masks(nn.make_attention_mask(target > 0, target > 0),
                                 nn.make_causal_mask(target))
    cross_mask = nn.make_attention_mask(target > 0, source > 0)
    y = _Stack(self.num_layers, self._block(True), self.pre_ln, self.dtype, name="decoder")(
        drop(embed(target)), self_mask, memory, cross_mask, train=train)
    return embed.attend(y)


class TransformerLM(_Sizes):
  """Decoder-only language model; `__call__(tokens, train)` -> next-token logits [b, t, vocab]."""

  max_len: int = 512
  positions: str = "learned"
  pre_ln: bool = True

  @nn.compact
  def __call__(self, tokens, train: bool = True):
    embed = self._embed()
    mask = nn.combine_masks(nn.make_attention_mask(tokens > 0, tokens > 0),
                            nn.make_causal_mask(tokens))
    x = nn.Dropout(self.dropout, deterministic=not train)(embed(tokens))
    x = _Stack(self.num_layers, self._block(False), self.pre_ln, self.dtype, name="decoder")(
        x, mask, train=train)
    return embed.attend(x)


TransformerBase = functools.partial(Transformer, d_model=512, num_heads=8, d_ff=2048,
                                    num_layers=6, dropout=0.1)
TransformerBig = functools.partial(Transformer, d_model=1024, num_heads=16, d_ff=4096,
                                   num_layers=6, dropout=0.3)
