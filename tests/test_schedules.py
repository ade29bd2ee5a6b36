"""sparsejax.train.schedules: the density warm-up read on the host and traced in the step; the
resize stages' first steps."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

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


@pytest.mark.parametrize("steps_per_epoch", [235, 469, 7, 1000])
def test_stage_starts_are_where_the_image_size_changes(steps_per_epoch):
  """Each stage's first step is the first one `image_size` gives its size (a boundary at a
  fraction of an epoch: the CNN task's 2 x 13/28 falls at step 218.2 of 235 a epoch, and its
  evaluation at the stage's end belongs after step 219, not 218)."""
  for schedule, epochs in ((((0, 12), (2 * 13 / 28, 22), (2 * 25 / 28, 28)), 2.0),
                           (((0, 128), (13, 224), (25, 288)), 28.0),
                           (((0, 16), (0.3, 20)), 0.25)):  # (a stage past the end: none)
    total = int(epochs * steps_per_epoch)
    sizes = [schedules.image_size(schedule, s / steps_per_epoch) for s in range(total)]
    changes = [s for s in range(1, total) if sizes[s] != sizes[s - 1]]
    assert schedules.stage_starts(schedule, epochs, steps_per_epoch) == changes
