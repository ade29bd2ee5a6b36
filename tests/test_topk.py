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


# ------------------------------------------------ the exact radix selects (C++ kernel, XLA radix)

def stable_topk(x, k):
  """Reference: the k largest |x|, ties to the lowest indices (a stable sort), increasing."""
  a = np.abs(np.asarray(x, np.float32))
  return np.sort(np.argsort(-a, kind="stable")[:k]).astype(np.int32)


def awkward(rng, kind, n):
  if kind == "gaussian":
    return gaussian(rng, n)
  if kind == "heavy":
    return heavy_tailed(rng, n)
  if kind == "zeros":
    return np.zeros(n, np.float32)
  if kind == "ties":  # few distinct magnitudes, both signs
    return rng.choice([-3.0, -1.0, 0.0, 1.0, 2.0, 3.0], n).astype(np.float32)
  # narrow: every value in [1, 1 + 2**-12): one top-level bucket, so no sample helps
  return (1.0 + rng.random(n) * 2.0**-12).astype(np.float32)


RADIX = {"kernel": lambda x, k: topk.mstopk(x, k, method="auto"),
         "radix": lambda x, k: topk.mstopk(x, k, method="radix")}


@pytest.mark.parametrize("impl", RADIX)
@pytest.mark.parametrize("kind", ["gaussian", "heavy", "zeros", "ties", "narrow"])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (1013, 1013), (20011, 217), (300_007, 300),
                                 (100_003, 13_000)])
def test_radix_selects_exactly_the_stable_topk(rng, impl, kind, n, k):
  from sparsejax import cpu_kernels
  if impl == "kernel":  # "radix" is the pure-XLA select: it runs without the kernels
    assert cpu_kernels.available(), cpu_kernels.why_unavailable()
  x = awkward(rng, kind, n)
  values, indices = jax.jit(lambda x: RADIX[impl](x, k))(jnp.asarray(x))
  check_selection(x, k, values, indices)
  np.testing.assert_array_equal(np.asarray(indices), stable_topk(x, k))


@pytest.mark.parametrize("impl", RADIX)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_radix_low_precision(rng, impl, dtype):
  x = jnp.asarray(heavy_tailed(rng, 200_003)).astype(dtype)
  values, indices = jax.jit(lambda x: RADIX[impl](x, 211))(x)
  assert values.dtype == dtype
  check_selection(x, 211, values, indices)
  np.testing.assert_array_equal(np.asarray(indices), stable_topk(x.astype(jnp.float32), 211))


def test_kernel_and_search_paths_agree_under_vmap(rng):
  from sparsejax import cpu_kernels
  x = jnp.asarray(rng.standard_normal((3, 70_001)).astype(np.float32))
  _, idx = jax.jit(jax.vmap(lambda r: topk.mstopk(r, 97)))(x)
  with cpu_kernels.disabled():  # the XLA search path (a fresh trace)
    _, idx_xla = jax.jit(jax.vmap(lambda r: topk.mstopk(r, 97)))(x)
  for row in range(3):
    np.testing.assert_array_equal(np.asarray(idx[row]), stable_topk(x[row], 97))
    assert set(np.asarray(idx_xla[row]).tolist()) == set(stable_topk(x[row], 97).tolist())


@pytest.mark.parametrize("n,k", [(5003, 50), (300_007, 301), (300_007, 60_000)])
def test_select_feedback_matches_numpy(rng, n, k):
  from sparsejax import cpu_kernels
  x, r = gaussian(rng, n), 0.5 * heavy_tailed(rng, n)
  acc = x + r
  want_idx = stable_topk(acc, k)
  want_res = acc.copy()
  want_res[want_idx] = 0.0
  fn = jax.jit(lambda x, r: topk.select_feedback("mstopk", x, r, k))
  values, indices, new_res = fn(jnp.asarray(x), jnp.asarray(r))
  np.testing.assert_array_equal(np.asarray(indices), want_idx)
  np.testing.assert_array_equal(np.asarray(values), acc[want_idx])
  np.testing.assert_array_equal(np.asarray(new_res), want_res)
  with cpu_kernels.disabled():  # the XLA path (MSTopK's search: recall >= 0.99, not exact)
    v2, i2, res2 = jax.jit(lambda x, r: topk.select_feedback("mstopk", x, r, k))(x, r)
  i2 = np.asarray(i2)
  assert recall(acc, k, i2) >= 0.99
  np.testing.assert_array_equal(np.asarray(v2), acc[i2])
  kept = acc.copy()
  kept[i2] = 0.0
  np.testing.assert_array_equal(np.asarray(res2), kept)


def test_scatter_add_kernel_matches_numpy(rng):
  from sparsejax import cpu_kernels
  n, m = 300_007, 5000
  v = rng.standard_normal(m).astype(np.float32)
  i = rng.integers(-3, n + 3, m).astype(np.int32)  # repeats, and a few out of range (dropped)
  i[:100] = i[100:200]
  want = np.zeros(n, np.float32)
  ok = (i >= 0) & (i < n)
  np.add.at(want, i[ok], v[ok])
  got = jax.jit(lambda v, i: cpu_kernels.scatter_add(v, i, n))(v, i)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_bad_method():
  with pytest.raises(ValueError, match="method must be one of.*'sort'"):
    topk.mstopk(jnp.ones(10), 3, method="sort")
