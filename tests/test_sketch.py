"""sparsejax.sketch.mean_norms against numpy's norm of the workers' mean, on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import PartitionSpec as P

from sparsejax import sketch

AXES = ("node", "local")


def _estimates(x, row_segments, num_segments, seeds, buckets, nodes=4, local=2):
  """Every worker's estimates, float[seeds, workers, num_segments]."""
  mesh = make_mesh(nodes, local)

  def one(xs, seed):
    return sketch.mean_norms(xs[0], row_segments, num_segments, AXES, buckets=buckets,
                             seed=seed)[None]

  run = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(P(AXES), P()), out_specs=P(AXES)))
  return np.stack([np.asarray(run(jnp.asarray(x), jnp.uint32(s))) for s in seeds])


def _workers_data(rng, workers, rows, width, noise):
  """A shared signal plus each worker's own noise, as workers' gradients are."""
  common = rng.standard_normal((rows, width))
  return (common[None] + noise * rng.standard_normal((workers, rows, width))).astype(np.float32)


def test_the_square_of_the_estimate_is_the_mean_s_square_on_average(rng):
  """Unbiased over the hash's seeds, the same on every worker, and near the exact norm of the
  mean at each seed (the sketch's error, about sqrt(2 / buckets) of the workers' own norms);
  each worker's own norm, what the trust ratio used before, is far off."""
  rows, width, segments = 37, 23, 6
  x = _workers_data(rng, 8, rows, width, noise=1.5)
  row_segments = np.sort(rng.integers(0, segments - 1, rows)).astype(np.int32)  # the last: none
  exact = np.array([np.linalg.norm(x.mean(0)[row_segments == s]) for s in range(segments)])
  own = np.array([[np.linalg.norm(w[row_segments == s]) for s in range(segments)] for w in x])
  got = _estimates(x, row_segments, segments, range(300), buckets=64)
  assert np.all(got == got[:, :1])  # every worker has the same numbers
  got = got[:, 0]
  real = exact > 0
  assert not real[-1] and np.all(got[:, -1] == 0)  # an empty segment: 0
  np.testing.assert_allclose((got[:, real] ** 2).mean(0), exact[real] ** 2, rtol=0.03)
  assert np.all(np.abs(got[:, real] / exact[real] - 1) < 0.35)
  assert np.all(own[:, real] > 1.3 * exact[real])


def test_one_worker_gets_its_own_norm_exactly(rng):
  x = rng.standard_normal((1, 11, 7)).astype(np.float32)
  row_segments = np.array([0] * 4 + [2] * 7, np.int32)
  got = _estimates(x, row_segments, 3, [5], buckets=8, nodes=1, local=1)[0, 0]
  want = [np.linalg.norm(x[0, :4]), 0.0, np.linalg.norm(x[0, 4:])]
  np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("buckets", [0, 1, 3, 100])
def test_buckets_must_be_a_power_of_two(buckets):
  with pytest.raises(ValueError, match=f"buckets={buckets}: must be a power of two >= 2"):
    sketch.mean_norms(jnp.zeros((2, 3)), np.zeros(2, np.int32), 1, "w", buckets=buckets)


def test_segments_must_match_the_rows():
  with pytest.raises(ValueError, match=r"row_segments has shape \(3,\), x has 2 rows"):
    sketch.mean_norms(jnp.zeros((2, 3)), np.zeros(3, np.int32), 1, "w")
  with pytest.raises(ValueError, match=r"must lie in \[0, 2\] \(2: left out\), got \[0, 3\]"):
    sketch.mean_norms(jnp.zeros((2, 3)), np.array([0, 3], np.int32), 2, "w")


def test_rows_left_out_change_nothing_of_the_others_but_the_bytes(rng):
  """Segments renumbered with the others' rows left out (segment `num_segments`): the kept
  segments' estimates those of the whole sketch (the hash follows the position, the bucket
  within a segment too: the same sums, to float32's reduction order), and the all-reduce
  carries only the kept segments."""
  from sparsejax import hlo
  rows, width, segments = 41, 19, 7
  x = _workers_data(rng, 8, rows, width, noise=1.0)
  row_segments = np.sort(rng.integers(0, segments, rows)).astype(np.int32)
  kept = np.array([1, 4, 5])
  renumber = np.full(segments, kept.size, np.int32)
  renumber[kept] = np.arange(kept.size)
  whole = _estimates(x, row_segments, segments, range(3), buckets=32)
  part = _estimates(x, renumber[row_segments], kept.size, range(3), buckets=32)
  np.testing.assert_allclose(part, whole[..., kept], rtol=1e-6)
  mesh = make_mesh(4, 2)
  run = jax.jit(jax.shard_map(
      lambda xs: sketch.mean_norms(xs[0], renumber[row_segments], kept.size, AXES,
                                   buckets=32)[None],
      mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)))
  sums = [c for c in hlo.collectives(run.lower(jnp.asarray(x)).compile())
          if c["op"] == "all-reduce" and c["dtype"] == "f32"]
  assert [c["elements"] for c in sums] == [kept.size * (32 + 2)]
