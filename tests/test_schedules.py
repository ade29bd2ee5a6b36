"""sparsejax.train.schedules: the density warm-up read on the host and traced in the step."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from sparsejax.train import schedules


def test_density_warmup_on_the_host_is_numpy_and_matches_the_traced_schedule():
  comp = ml_collections.ConfigDict({"warmup_epochs": 0.3, "warmup_density": 0.3,
                                    "density": 0.007})
  schedule = schedules.density(comp, 157)  # 47 warm-up steps
  steps = [0, 1, 23, 46, 47, 48, 301]
  host = [schedule(s) for s in steps]
  # numpy on the host: the loop reads each step's level without waiting for the device
  assert all(not isinstance(v, jax.Array) for v in host)
  traced = jax.jit(jax.vmap(schedule))(jnp.asarray(steps, jnp.int32))
  np.testing.assert_allclose(np.asarray(host, np.float64), np.asarray(traced), rtol=1e-6)
  expected = 0.3 * (0.007 / 0.3) ** np.minimum(np.asarray(steps) / 47, 1.0)
  np.testing.assert_allclose(np.asarray(host, np.float64), expected, rtol=1e-5)
