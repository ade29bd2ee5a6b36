"""`FlatLayout`: a pytree <-> one padded 1-D buffer.

The whole gradient (and later the parameters and optimizer moments) travels as one flat buffer so
that compression, collectives and the optimizer update each compile to a handful of kernels. The
layout is static (hashable): shapes, dtypes, offsets and the treedef, nothing traced. A complex
leaf travels as two real values per element (real and imaginary part interleaved), so the buffer
is always real.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FlatLayout"]


@dataclasses.dataclass(frozen=True)
class FlatLayout:
  """Where each leaf of a pytree lives inside one flat 1-D buffer.

  Attributes:
    treedef: structure of the tree.
    shapes: shape of each leaf, in `jax.tree.leaves` order.
    dtypes: dtype of each leaf.
    offsets: start of each leaf in the buffer, a multiple of `align`.
    size: number of real values (sum of `sizes`: a complex leaf counts twice).
    padded_size: buffer length, a multiple of both `pad_to` and `align`; gaps and tail are zeros.
    pad_to: the multiple the buffer length is padded to.
    align: every leaf starts at a multiple of `align`. With `align > 1` the buffer reshapes to
      `(rows, align)` with every row inside one leaf, so per-leaf reductions are row reductions
      plus a tiny segment sum over rows (what `sparsejax.optim` uses for per-layer norms).
  """

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[np.dtype, ...]
  offsets: tuple[int, ...]
  size: int
  padded_size: int
  pad_to: int
  align: int = 1

  @classmethod
  def from_tree(cls, tree: Any, pad_to: int = 1, align: int = 1) -> FlatLayout:
    """The layout of `tree` (arrays or `ShapeDtypeStruct`s).

    Args:
      tree: the pytree.
      pad_to: the buffer length is a multiple of this (e.g. the number of devices it is split over).
      align: each leaf starts at a multiple of this (the row width of `rows`).
    """
    for name, value in (("pad_to", pad_to), ("align", align)):
      if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
      raise ValueError("FlatLayout.from_tree needs a tree with at least one array leaf, got none")
    shapes = tuple(tuple(int(d) for d in np.shape(leaf)) for leaf in leaves)
    dtypes = tuple(jax.dtypes.canonicalize_dtype(
        leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype) for leaf in leaves)
    for shape, dtype in zip(shapes, dtypes):
      if not any(jnp.issubdtype(dtype, t) for t in (jnp.floating, jnp.integer,
                                                    jnp.complexfloating)):
        raise TypeError(f"FlatLayout leaves must be numeric arrays (real, integer or complex), "
                        f"got a leaf of dtype {dtype} and shape {shape}")
    sizes = [math.prod(s) * (2 if jnp.issubdtype(d, jnp.complexfloating) else 1)
             for s, d in zip(shapes, dtypes)]
    spans = [-(-s // align) * align for s in sizes]
    offsets = tuple(int(o) for o in np.cumsum([0] + spans[:-1]))
    end = offsets[-1] + sizes[-1]
    multiple = math.lcm(int(pad_to), int(align))
    padded = max(-(-end // multiple) * multiple, multiple)
    return cls(treedef, shapes, dtypes, offsets, int(sum(sizes)), padded, int(pad_to), int(align))

  @property
  def num_leaves(self) -> int:
    return len(self.shapes)

  @property
  def is_complex(self) -> tuple[bool, ...]:
    """Whether each leaf is complex (two buffer values per element: real, imaginary)."""
    return tuple(bool(jnp.issubdtype(d, jnp.complexfloating)) for d in self.dtypes)

  @property
  def sizes(self) -> tuple[int, ...]:
    """Number of buffer values of each leaf (twice its element count for a complex leaf)."""
    return tuple(math.prod(s) * (2 if c else 1) for s, c in zip(self.shapes, self.is_complex))

  @property
  def real_dtype(self) -> np.dtype:
    """The default buffer dtype: the result type of the leaves, complex ones by their parts."""
    return jnp.result_type(*(jnp.finfo(d).dtype if c else d
                             for d, c in zip(self.dtypes, self.is_complex)))

  @property
  def rows(self) -> int:
    """Number of rows of width `align` in the buffer."""
    return self.padded_size // self.align

  def _per_element(self, per_leaf: np.ndarray, fill: Any) -> np.ndarray:
    out = np.full(self.padded_size, fill, per_leaf.dtype)
    for value, offset, size in zip(per_leaf, self.offsets, self.sizes):
      out[offset:offset + size] = value
    return out

  @property
  def segment_ids(self) -> np.ndarray:
    """int32[padded_size]: leaf number of each element; padding gets id `num_leaves`."""
    return self._per_element(np.arange(self.num_leaves, dtype=np.int32), self.num_leaves)

  @property
  def row_segment_ids(self) -> np.ndarray:
    """int32[rows]: leaf number of each row of width `align`; all-padding rows get `num_leaves`.

    Only meaningful when every row lies inside one leaf, which `align` guarantees."""
    ids = np.full(self.rows, self.num_leaves, np.int32)
    for i, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
      ids[offset // self.align: -(-(offset + size) // self.align)] = i
    return ids

  @property
  def valid_mask(self) -> np.ndarray:
    """bool[padded_size]: True for real values, False for padding."""
    return self._per_element(np.ones(self.num_leaves, bool), False)

  def shape_tree(self) -> Any:
    """The layout's tree as `jax.ShapeDtypeStruct`s."""
    return self.unflatten_leaves([jax.ShapeDtypeStruct(s, d)
                                  for s, d in zip(self.shapes, self.dtypes)])

  def leaf_flags(self, mask: Any, name: str = "mask") -> np.ndarray:
    """bool[num_leaves] from an optax-style mask.

    Args:
      mask: a bool, a tree of bools with the layout's structure or a prefix of it, or a callable
        taking the tree of shapes (`shape_tree()`) and returning one.
      name: the argument's name, for the error message.
    """
    if callable(mask):
      mask = mask(self.shape_tree())
    try:
      full = jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: flag, sub), mask,
                          self.shape_tree())
      flags = self.treedef.flatten_up_to(full)
    except (ValueError, TypeError) as e:
      def short(x: Any) -> str:
        text = str(x)
        return text if len(text) <= 300 else text[:300] + "..."
      raise ValueError(f"{name} does not match the parameters: it must be a bool, a tree of bools "
                       f"with the parameters' structure (or a prefix of it), or a callable "
                       f"returning one; parameters have structure {short(self.treedef)}, {name} "
                       f"is {short(jax.tree.structure(mask))}") from e
    for flag in flags:
      if not isinstance(flag, bool | np.bool_):
        raise ValueError(f"{name} leaves must be Python bools, got {flag!r}")
    return np.asarray([bool(f) for f in flags], bool)

  def leaf_mask(self, mask: Any) -> np.ndarray:
    """bool[padded_size] from a per-leaf mask (see `leaf_flags`). Padding is False."""
    return self._per_element(self.leaf_flags(mask), False)

  def unflatten_leaves(self, leaves: list[Any]) -> Any:
    return jax.tree.unflatten(self.treedef, leaves)

  def ravel(self, tree: Any, dtype: Any = None) -> jax.Array:
    """The leaves of `tree` as one 1-D buffer of length `padded_size` (zeros in the padding).

    Args:
      tree: a tree with this layout's structure and shapes.
      dtype: buffer dtype (real); default `real_dtype`.
    """
    leaves = self.treedef.flatten_up_to(tree)
    for i, (leaf, shape) in enumerate(zip(leaves, self.shapes)):
      if tuple(np.shape(leaf)) != shape:
        raise ValueError(f"leaf {i} has shape {tuple(np.shape(leaf))}, the layout expects {shape}")
    dtype = self.real_dtype if dtype is None else dtype
    if jnp.issubdtype(dtype, jnp.complexfloating):
      raise ValueError(f"ravel makes a real buffer (a complex leaf travels as two real values); "
                       f"got dtype={dtype}")
    parts, end = [], 0
    for leaf, offset, size, cplx in zip(leaves, self.offsets, self.sizes, self.is_complex):
      if offset > end:
        parts.append(jnp.zeros(offset - end, dtype))
      if cplx:
        leaf = jnp.stack([jnp.real(leaf), jnp.imag(leaf)], axis=-1)
      parts.append(jnp.ravel(leaf).astype(dtype))
      end = offset + size
    if self.padded_size > end:
      parts.append(jnp.zeros(self.padded_size - end, dtype))
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

  def unravel(self, flat: jax.Array) -> Any:
    """The tree back from a buffer of length `padded_size`; each leaf gets its own dtype back."""
    if flat.ndim != 1 or flat.shape[0] != self.padded_size:
      raise ValueError(f"unravel expects a 1-D buffer of length {self.padded_size}, "
                       f"got shape {flat.shape}")
    leaves = []
    for o, n, s, d, c in zip(self.offsets, self.sizes, self.shapes, self.dtypes, self.is_complex):
      part = flat[o:o + n]
      if c:
        pair = part.reshape(*s, 2).astype(jnp.finfo(d).dtype)
        leaves.append(jax.lax.complex(pair[..., 0], pair[..., 1]).astype(d))
      else:
        leaves.append(part.reshape(s).astype(d))
    return jax.tree.unflatten(self.treedef, leaves)
