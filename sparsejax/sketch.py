"""The norm of the workers' mean, per segment, from a count sketch instead of the whole vectors.

LARS scales each layer's step by `||p|| / ||g||`, where `g` is the gradient all workers agree
on: the mean of theirs. With momentum correction each worker scales its own gradient before the
sparse exchange (`sparsejax.train.optimizer.lars_first`), when only its own norm is at hand; and
one worker's gradient is noisier than the mean, so its norm is larger and its step shorter (by
`||g_i|| / ||mean g||`, about sqrt(P) where the gradients are mostly noise). `mean_norms` gives
every worker the norm of the mean for the price of a small all-reduce:

    ||sum_i x_i||^2 = sum_i ||x_i||^2 + sum_{i != j} <x_i, x_j>

The first sum is exact (each worker's own norm, a scalar a segment). Each cross term is estimated
from count sketches (Charikar et al. 2002): each worker adds its values, with a random sign each,
into `buckets` bins a segment, and `<S x_i, S x_j>` is an unbiased estimate of `<x_i, x_j>`
(relative error about sqrt(2 / buckets) of `||x_i|| ||x_j||`). So one all-reduce of
`buckets + 2` floats a segment: `||sum_i S x_i||^2 - sum_i ||S x_i||^2` is the cross terms'
estimate. The hash (bucket and sign of each position) is drawn from `seed`, the same on every
worker; a seed that changes every step keeps a collision from biasing the same segment step after
step. With one worker the result is its own norm exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["mean_norms"]


def _mix(h: jax.Array) -> jax.Array:
  """murmur3's 32-bit finaliser: every input bit moves about half the output bits."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def mean_norms(x: jax.Array, row_segments: np.ndarray, num_segments: int,
               axes: str | Sequence[str], *, buckets: int = 256,
               seed: jax.Array | int = 0, own_norms: jax.Array | None = None) -> jax.Array:
  """float32[num_segments]: per segment, an estimate of the L2 norm of the mean over the
  workers of `axes` of `x` (float32[rows, width], row r in segment `row_segments[r]`), the same
  on every worker. Run inside `shard_map` / `pmap` over `axes`.

  Args:
    x: this worker's values, one row per line of `row_segments`.
    row_segments: int[rows], each row's segment in [0, num_segments], `num_segments` for a
      row that is left out (neither sketched nor counted: no bytes for a segment whose norm
      nobody reads).
    num_segments: how many segments.
    axes: the workers' mesh axes.
    buckets: a power of two >= 2, the sketch's bins a segment (its error: above).
    seed: uint32 scalar, the same on every worker (traced is fine).
    own_norms: float32[num_segments], this worker's own norm of each segment of `x` where the
      caller has it already (saves a pass over `x`).
  """
  if buckets < 2 or buckets & (buckets - 1):
    raise ValueError(f"buckets={buckets!r}: must be a power of two >= 2")
  row_segments = np.asarray(row_segments)
  if row_segments.shape != (x.shape[0],):
    raise ValueError(f"row_segments has shape {row_segments.shape}, x has {x.shape[0]} rows")
  if row_segments.size and not 0 <= row_segments.min() <= row_segments.max() <= num_segments:
    raise ValueError(f"row_segments must lie in [0, {num_segments}] ({num_segments}: left "
                     f"out), got [{row_segments.min()}, {row_segments.max()}]")
  x = x.astype(jnp.float32)
  rows, width = x.shape
  position = (lax.broadcasted_iota(jnp.uint32, x.shape, 0) * jnp.uint32(width)
              + lax.broadcasted_iota(jnp.uint32, x.shape, 1))
  h = _mix(position * jnp.uint32(0x9E3779B1) + jnp.asarray(seed).astype(jnp.uint32))
  sign = jnp.where((h >> 31) == 0, 1.0, -1.0).astype(jnp.float32)
  bins = (jnp.asarray(row_segments, jnp.int32)[:, None] * buckets
          + (h & jnp.uint32(buckets - 1)).astype(jnp.int32))
  sketch = jnp.zeros(num_segments * buckets, jnp.float32).at[bins.reshape(-1)].add(
      (sign * x).reshape(-1), mode="drop").reshape(num_segments, buckets)  # (left out: dropped)
  own = (jnp.zeros(num_segments, jnp.float32).at[jnp.asarray(row_segments)].add(
      jnp.sum(x * x, axis=1), mode="drop") if own_norms is None else jnp.square(own_norms))
  sketch_own = jnp.sum(sketch * sketch, axis=1)
  names = (axes,) if isinstance(axes, str) else tuple(axes)
  total = lax.psum(jnp.concatenate([own, sketch_own, sketch.reshape(-1)]), names)
  own_sum, sketch_own_sum = total[:num_segments], total[num_segments:2 * num_segments]
  summed = total[2 * num_segments:].reshape(num_segments, buckets)
  p = lax.psum(1, names)
  cross = jnp.sum(summed * summed, axis=1) - sketch_own_sum
  # the cross terms' estimate may come out below what the vectors allow; no less than 1/P of
  # the norm the workers' own terms alone give (workers that cancel each other's values are rare)
  square = jnp.maximum(own_sum + cross, own_sum / p)
  return jnp.sqrt(square) / p
