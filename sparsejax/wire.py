"""The wire formats of a sparse exchange's (value, index) pairs.

  pairs8  a float32 value and an int32 index: 8 bytes a pair (the format the studies ran).
  pairs4  a bfloat16 value and the index's low 16 bits: 4 bytes a pair, one uint32 word
          `(bf16 bits << 16) | (index & 0xFFFF)`, the pairs in index order. The index's high
          bits are the pair's block of 2^16 positions: each worker also sends how many of its
          pairs fall in each block (one int32 per block of its buffer; none for a buffer of one
          block), and the receiver recovers each index from its place in the order. The value
          is rounded to bfloat16; the rounding error stays with the sender, which keeps it in
          its error-feedback residual (`round_values`), so nothing is lost: the sum of what is
          sent and what is kept is the candidates' to the bit.

`pack` and `unpack` are the local halves around one all-gather of uint32 words;
`bytes_per_worker` is what a worker sends of them.

A format is the exchange's, not only its pairs': where an exchange in pairs4 runs its dense
form (a dense level of the plan, a recipe's dense start) the values cross as bfloat16 too, 2
bytes a value, summed exactly in float32 by the worker that owns each chunk, every rounding
error kept in a residual (`sparsejax.comm.dense_sum`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["WIRES", "BLOCK", "blocks", "round_values", "pack", "unpack", "bytes_per_worker",
           "check_wire"]

WIRES = ("pairs8", "pairs4")
BLOCK = 1 << 16  # positions a 16-bit index spans


def check_wire(wire: str) -> str:
  """`wire`, or a ValueError naming it and what is allowed."""
  if wire not in WIRES:
    raise ValueError(f"unknown wire format {wire!r}; allowed: {', '.join(WIRES)}")
  return wire


def blocks(length: int) -> int:
  """The 2^16-position blocks of a buffer of `length`: one count each goes with the pairs
  (none for a buffer of one block)."""
  count = -(-length // BLOCK)
  return 0 if count <= 1 else count


def bytes_per_worker(wire: str, k: int, length: int) -> tuple[int, int]:
  """(bytes of the values, bytes of the indices) one worker sends for k pairs of a buffer of
  `length`; pairs4's block counts are counted with the indices."""
  if check_wire(wire) == "pairs8":
    return 4 * k, 4 * k
  return 2 * k, 2 * k + 4 * blocks(length)


def round_values(values: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(sent, error)`: float32 `values` rounded to bfloat16 (as float32 again) and what the
  rounding took off, `values - sent` (exact: the low bits bfloat16 drops)."""
  # (reduce_precision, not a float32 -> bfloat16 -> float32 round trip, which XLA may fold away
  # where it allows excess precision, as on GPU)
  sent = lax.reduce_precision(values.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)
  return sent, values - sent


def pack(values: jax.Array, indices: jax.Array, length: int) -> jax.Array:
  """uint32[k + blocks(length)]: a worker's k pairs (int32 indices into a buffer of `length`,
  distinct) as pairs4 words in index order, then its pairs' count in each block.

  Selections that give their indices increasing (the CPU kernel's) are packed as they come.
  Otherwise a pair's place in the order comes from whichever costs fewer operations: an
  argsort of the k indices (k log2 k) or a prefix count of the chosen positions over the buffer
  (`length`, a pass like the exchange's others). On CPU at a density of 0.64 of 1.9M positions
  the argsort took 10x the prefix count; at 0.01, half of it."""
  k = indices.shape[0]
  low = (indices & (BLOCK - 1)).astype(jnp.uint32)
  high = lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
  words = (high << 16) | low

  def ordered(words):
    if k * math.log2(max(k, 2)) < length:
      return words[jnp.argsort(indices)]
    chosen = jnp.zeros(length, jnp.int32).at[indices].set(1, unique_indices=True)
    place = lax.associative_scan(jnp.add, chosen)[indices] - 1
    return jnp.zeros(k, jnp.uint32).at[place].set(words, unique_indices=True)

  if k > 1:
    words = lax.cond(jnp.all(indices[1:] > indices[:-1]), lambda w: w, ordered, words)
  count = blocks(length)
  if not count:
    return words
  counts = jnp.zeros(count, jnp.int32).at[indices >> 16].add(1)
  return jnp.concatenate([words, lax.bitcast_convert_type(counts, jnp.uint32)])


def unpack(gathered: jax.Array, k: int, length: int) -> tuple[jax.Array, jax.Array]:
  """float32[P*k] values and int32[P*k] indices from P workers' `pack`ed words, concatenated
  (`gathered`: uint32[P * (k + blocks(length))])."""
  count = blocks(length)
  rows = gathered.reshape(-1, k + count)
  words = rows[:, :k]
  values = lax.bitcast_convert_type((words >> 16).astype(jnp.uint16), jnp.bfloat16)
  low = (words & (BLOCK - 1)).astype(jnp.int32)
  if count:  # each pair's block: how many blocks end at or before its place in the order
    ends = jnp.cumsum(lax.bitcast_convert_type(rows[:, k:-1], jnp.int32), axis=1)
    row = jnp.arange(rows.shape[0], dtype=jnp.int32)[:, None]
    starts = jnp.zeros((rows.shape[0], k), jnp.int32).at[row, ends].add(1, mode="drop")
    low = low + lax.associative_scan(jnp.add, starts, axis=1) * BLOCK
  return values.astype(jnp.float32).reshape(-1), low.reshape(-1)
