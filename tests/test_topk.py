import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import topk

SELECTORS = {"mstopk": topk.mstopk, "exact": topk.exact_topk, "sampled": topk.sampled_topk}


def gaussian(rng, n):
  return rng.standard_normal(n).astype(np.float32)


def heavy_tailed(rng, n):
  """Student-t(2) values with most of the mass in a few hot blocks, like real gradients."""
  x = rng.standard_t(2, n)
  block = 509
  hot = rng.choice(max(1, n // block), max(1, n // block // 40), replace=False)
  for b in hot:
    x[b * block:(b + 1) * block] *= 100.0
  return x.astype(np.float32)


def check_selection(x, k, values, indices):
  values, indices = np.asarray(values), np.asarray(indices)
  assert indices.shape == (k,) and values.shape == (k,)
  assert indices.dtype == np.int32
  assert len(np.unique(indices)) == k, "indices must be distinct"
  assert indices.min() >= 0 and indices.max() < len(x)
  np.testing.assert_array_equal(values, np.asarray(x)[indices])


def recall(x, k, indices):
  a = np.abs(np.asarray(x, np.float32))
  kth = np.partition(a, len(a) - k)[len(a) - k]
  # Ties at the k-th value: any of them is a correct pick.
  return np.mean(a[np.asarray(indices)] >= kth)


@pytest.mark.parametrize("name", SELECTORS)
@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (1013, 1), (1013, 1013), (20011, 217),
                                 (300_007, 300), (300_007, 3001)])
def test_exact_count_distinct_and_values(rng, name, n, k):
  x = jnp.asarray(gaussian(rng, n))
  values, indices = jax.jit(lambda x: SELECTORS[name](x, k))(x)
  check_selection(x, k, values, indices)


@pytest.mark.parametrize("dist", [gaussian, heavy_tailed])
@pytest.mark.parametrize("n,density", [(20011, 0.01), (300_007, 0.001), (1_000_003, 0.001)])
def test_mstopk_recall(rng, dist, n, density):
  x = dist(rng, n)
  k = max(1, round(density * n))
  values, indices = jax.jit(lambda x: topk.mstopk(x, k))(jnp.asarray(x))
  check_selection(x, k, values, indices)
  assert recall(x, k, indices) >= 0.99


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", SELECTORS)
def test_low_precision(rng, dtype, name):
  x = jnp.asarray(heavy_tailed(rng, 200_003)).astype(dtype)
  k = 211
  values, indices = jax.jit(lambda x: SELECTORS[name](x, k))(x)
  assert values.dtype == dtype
  check_selection(x, k, values, indices)
  if name != "sampled":
    assert recall(np.asarray(x.astype(jnp.float32)), k, indices) >= 0.99


def test_ties_and_zeros_fall_back_correctly(rng):
  # 95% zeros and many equal values: the block filter cannot isolate k candidates.
  n, k = 400_009, 30_000
  x = np.zeros(n, np.float32)
  nz = rng.choice(n, n // 20, replace=False)
  x[nz] = rng.choice([-1.0, 2.0, 3.0], len(nz))
  values, indices = jax.jit(lambda x: topk.mstopk(x, k))(jnp.asarray(x))
  check_selection(x, k, values, indices)
  assert recall(x, k, indices) == 1.0


@pytest.mark.parametrize("name", SELECTORS)
def test_vmap(rng, name):
  x = jnp.asarray(rng.standard_normal((3, 5003)).astype(np.float32))
  values, indices = jax.jit(jax.vmap(lambda r: SELECTORS[name](r, 37)))(x)
  assert indices.shape == (3, 37)
  for row in range(3):
    check_selection(x[row], 37, values[row], indices[row])
    ref_v, ref_i = topk.exact_topk(x[row], 37)
    if name != "sampled":
      assert set(np.asarray(indices[row]).tolist()) == set(np.asarray(ref_i).tolist())


@pytest.mark.parametrize("name", SELECTORS)
def test_bad_input(name):
  fn = SELECTORS[name]
  x = jnp.ones(10)
  with pytest.raises(ValueError, match="k=0"):
    fn(x, 0)
  with pytest.raises(ValueError, match="k=11"):
    fn(x, 11)
  with pytest.raises(ValueError, match=r"1-D.*\(2, 5\)"):
    fn(jnp.ones((2, 5)), 3)
  with pytest.raises(TypeError, match="int32"):
    fn(jnp.ones(10, jnp.int32), 3)
  with pytest.raises(ValueError, match="unknown selector 'topk'"):
    topk.get_selector("topk")
