"""`FlatLayout`: a pytree <-> one padded 1-D buffer.

The whole gradient (and later the parameters and optimizer moments) travels as one flat buffer so
that compression, collectives and the optimizer update each compile to a handful of kernels. The
layout is static (hashable): shapes, dtypes, offsets and the treedef, nothing traced.
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
    offsets: start of each leaf in the buffer.
    size: number of real values (sum of leaf sizes).
    padded_size: buffer length, `size` rounded up to a multiple of `pad_to`; the tail is zeros.
    pad_to: the multiple the buffer is padded to.
  """

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[np.dtype, ...]
  offsets: tuple[int, ...]
  size: int
  padded_size: int
  pad_to: int

  @classmethod
  def from_tree(cls, tree: Any, pad_to: int = 1) -> FlatLayout:
    """The layout of `tree` (arrays or `ShapeDtypeStruct`s), padded to a multiple of `pad_to`."""
    if not isinstance(pad_to, int | np.integer) or isinstance(pad_to, bool) or pad_to < 1:
      raise ValueError(f"pad_to must be an integer >= 1, got {pad_to!r}")
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
      raise ValueError("FlatLayout.from_tree needs a tree with at least one array leaf, got none")
    shapes = tuple(tuple(int(d) for d in np.shape(leaf)) for leaf in leaves)
    dtypes = tuple(jax.dtypes.canonicalize_dtype(
        leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype) for leaf in leaves)
    for shape, dtype in zip(shapes, dtypes):
      if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"FlatLayout leaves must be numeric arrays, got a leaf of dtype {dtype}"
                        f" and shape {shape}")
    sizes = [math.prod(s) for s in shapes]
    offsets = tuple(int(o) for o in np.cumsum([0] + sizes[:-1]))
    size = int(sum(sizes))
    padded = -(-size // pad_to) * pad_to
    return cls(treedef, shapes, dtypes, offsets, size, max(padded, pad_to), int(pad_to))

  @property
  def num_leaves(self) -> int:
    return len(self.shapes)

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(math.prod(s) for s in self.shapes)

  @property
  def segment_ids(self) -> np.ndarray:
    """int32[padded_size]: leaf number of each element; padding gets id `num_leaves`."""
    ids = np.repeat(np.arange(self.num_leaves, dtype=np.int32), self.sizes)
    return np.concatenate([ids, np.full(self.padded_size - self.size, self.num_leaves, np.int32)])

  @property
  def valid_mask(self) -> np.ndarray:
    """bool[padded_size]: True for real values, False for padding."""
    return np.arange(self.padded_size) < self.size

  def leaf_mask(self, mask: Any) -> np.ndarray:
    """bool[padded_size] from a per-leaf mask: a tree of bools shaped like the layout's tree, or a
    callable taking the tree of shapes and returning one (as optax masks). Padding is False."""
    if callable(mask):
      mask = mask(self.unflatten_leaves([jax.ShapeDtypeStruct(s, d)
                                         for s, d in zip(self.shapes, self.dtypes)]))
    flags = self.treedef.flatten_up_to(mask)
    out = np.repeat(np.asarray([bool(f) for f in flags]), self.sizes)
    return np.concatenate([out, np.zeros(self.padded_size - self.size, bool)])

  def unflatten_leaves(self, leaves: list[Any]) -> Any:
    return jax.tree.unflatten(self.treedef, leaves)

  def ravel(self, tree: Any, dtype: Any = None) -> jax.Array:
    """The leaves of `tree` as one 1-D buffer of length `padded_size` (zeros in the padding).

    Args:
      tree: a tree with this layout's structure and shapes.
      dtype: buffer dtype; default the result type of all leaves.
    """
    leaves = self.treedef.flatten_up_to(tree)
    for i, (leaf, shape) in enumerate(zip(leaves, self.shapes)):
      if tuple(np.shape(leaf)) != shape:
        raise ValueError(f"leaf {i} has shape {tuple(np.shape(leaf))}, the layout expects {shape}")
    dtype = jnp.result_type(*self.dtypes) if dtype is None else dtype
    parts = [jnp.ravel(leaf).astype(dtype) for leaf in leaves]
    if self.padded_size > self.size:
      parts.append(jnp.zeros(self.padded_size - self.size, dtype))
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

  def unravel(self, flat: jax.Array) -> Any:
    """The tree back from a buffer of length `padded_size`; each leaf gets its own dtype back."""
    if flat.ndim != 1 or flat.shape[0] != self.padded_size:
      raise ValueError(f"unravel expects a 1-D buffer of length {self.padded_size}, "
                       f"got shape {flat.shape}")
    leaves = [flat[o:o + math.prod(s)].reshape(s).astype(d)
              for o, s, d in zip(self.offsets, self.shapes, self.dtypes)]
    return jax.tree.unflatten(self.treedef, leaves)
