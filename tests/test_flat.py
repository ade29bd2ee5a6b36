import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax.flat import FlatLayout


def _tree(rng):
  return {
      "conv": {"kernel": rng.standard_normal((3, 3, 5, 7)).astype(np.float32),
               "bias": rng.standard_normal(7).astype(np.float32)},
      "scale": np.float32(rng.standard_normal()),
      "emb": rng.standard_normal((13, 11)).astype(jnp.bfloat16),
      "odd": [rng.standard_normal(1).astype(np.float16),
              rng.standard_normal((2, 1, 3)).astype(np.float32)],
  }


@pytest.mark.parametrize("pad_to", [1, 4, 7, 64])
def test_roundtrip_against_numpy(rng, pad_to):
  tree = _tree(rng)
  layout = FlatLayout.from_tree(tree, pad_to=pad_to)
  leaves = jax.tree.leaves(tree)
  n = sum(np.size(x) for x in leaves)
  assert layout.size == n
  assert layout.padded_size % pad_to == 0 and 0 <= layout.padded_size - n < pad_to
  flat = jax.jit(lambda t: layout.ravel(t, jnp.float32))(tree)
  ref = np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in leaves])
  np.testing.assert_array_equal(np.asarray(flat)[:n], ref)
  np.testing.assert_array_equal(np.asarray(flat)[n:], 0)
  back = jax.jit(layout.unravel)(flat)
  for a, b in zip(jax.tree.leaves(back), leaves):
    assert a.dtype == np.asarray(b).dtype and a.shape == np.shape(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_segment_ids_offsets_and_masks(rng):
  tree = _tree(rng)
  layout = FlatLayout.from_tree(tree, pad_to=16)
  ids = layout.segment_ids
  assert ids.shape == (layout.padded_size,) and ids.dtype == np.int32
  for i, (o, s) in enumerate(zip(layout.offsets, layout.sizes)):
    assert np.all(ids[o:o + s] == i)
  assert np.all(ids[layout.size:] == layout.num_leaves)
  # A per-leaf mask (a tree, or a callable as optax takes) expands onto the buffer.
  mask = layout.leaf_mask(lambda t: jax.tree.map(lambda x: len(x.shape) > 1, t))
  want = np.concatenate([np.full(s, len(sh) > 1) for s, sh in zip(layout.sizes, layout.shapes)])
  np.testing.assert_array_equal(mask[: layout.size], want)
  assert not mask[layout.size:].any()
  assert hash(layout) == hash(FlatLayout.from_tree(tree, pad_to=16))


def test_bad_input():
  with pytest.raises(ValueError, match="pad_to"):
    FlatLayout.from_tree({"a": np.zeros(3)}, pad_to=0)
  with pytest.raises(ValueError, match="at least one"):
    FlatLayout.from_tree({})
  layout = FlatLayout.from_tree({"a": np.zeros(3)}, pad_to=4)
  with pytest.raises(ValueError, match="length 4"):
    layout.unravel(jnp.zeros(3))
  with pytest.raises(ValueError, match="shape"):
    layout.ravel({"a": np.zeros(5)})
  with pytest.raises(ValueError, match="align"):
    FlatLayout.from_tree({"a": np.zeros(3)}, align=0)


@pytest.mark.parametrize("pad_to,align", [(1, 16), (8, 16), (6, 10), (3, 256)])
def test_aligned_layout_rows_lie_inside_one_leaf(rng, pad_to, align):
  tree = _tree(rng)
  layout = FlatLayout.from_tree(tree, pad_to=pad_to, align=align)
  leaves = jax.tree.leaves(tree)
  assert all(o % align == 0 for o in layout.offsets)
  assert layout.padded_size % pad_to == 0 and layout.padded_size % align == 0
  assert layout.rows * align == layout.padded_size
  flat = np.asarray(jax.jit(lambda t: layout.ravel(t, jnp.float32))(tree))
  ids = layout.segment_ids
  for i, (leaf, o, s) in enumerate(zip(leaves, layout.offsets, layout.sizes)):
    np.testing.assert_array_equal(flat[o:o + s], np.ravel(np.asarray(leaf, np.float32)))
    assert np.all(ids[o:o + s] == i)
  assert np.all(flat[ids == layout.num_leaves] == 0)  # gaps and tail are zeros
  assert layout.valid_mask.sum() == layout.size
  # Each row holds values of one leaf only, and row_segment_ids names it.
  row_ids = layout.row_segment_ids
  per_row = ids.reshape(layout.rows, align)
  for r in range(layout.rows):
    real = per_row[r][per_row[r] < layout.num_leaves]
    assert np.all(real == row_ids[r]) if real.size else row_ids[r] == layout.num_leaves
  back = layout.unravel(jnp.asarray(flat))
  for a, b in zip(jax.tree.leaves(back), leaves):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_leaf_flags_take_optax_masks(rng):
  tree = _tree(rng)
  layout = FlatLayout.from_tree(tree)
  assert layout.leaf_flags(True).all() and not layout.leaf_flags(False).any()
  prefix = {"conv": False, "scale": True, "emb": True, "odd": [False, True]}
  want = [False, False, True, False, True, True]  # leaves in jax.tree.leaves order
  got = layout.leaf_flags(prefix)
  order = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  assert dict(zip(order, got)) == dict(zip(
      ["['conv']['bias']", "['conv']['kernel']", "['emb']", "['odd'][0]", "['odd'][1]",
       "['scale']"], want))
  with pytest.raises(ValueError, match="weight_decay_mask"):
    layout.leaf_flags({"conv": True}, "weight_decay_mask")
  with pytest.raises(ValueError, match="bools"):
    layout.leaf_flags(jax.tree.map(lambda x: 1, tree))
