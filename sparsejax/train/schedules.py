"""Learning-rate and density schedules in steps, built from the config's epochs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

__all__ = ["learning_rate", "density", "image_size", "resize_stages"]


def learning_rate(opt: ml_collections.ConfigDict, steps_per_epoch: int, total_steps: int
                  ) -> optax.Schedule:
  """Linear warm-up from 0 over `warmup_epochs`, then cosine / linear / poly / step / constant."""
  peak, end = opt.learning_rate, opt.end_learning_rate
  warmup = int(round(opt.warmup_epochs * steps_per_epoch))
  rest = max(total_steps - warmup, 1)
  if opt.schedule == "cosine":
    main = optax.cosine_decay_schedule(peak, rest, alpha=end / peak if peak else 0.0)
  elif opt.schedule == "linear":
    main = optax.linear_schedule(peak, end, rest)
  elif opt.schedule == "poly":
    main = optax.polynomial_schedule(peak, end, opt.poly_power, rest)
  elif opt.schedule == "step":
    boundaries = {int(round(e * steps_per_epoch)) - warmup: opt.step_factor
                  for e in opt.step_epochs}
    main = optax.piecewise_constant_schedule(peak, boundaries)
  else:
    main = optax.constant_schedule(peak)
  if warmup == 0:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), main], [warmup])


def density(comp: ml_collections.ConfigDict, steps_per_epoch: int) -> optax.Schedule | None:
  """DGC-style warm-up: density decays geometrically from `warmup_density` to `density` over
  `warmup_epochs` (None when there is no warm-up)."""
  steps = int(round(comp.warmup_epochs * steps_per_epoch))
  if steps == 0 or comp.warmup_density <= comp.density:
    return None
  start, target = comp.warmup_density, comp.density
  ratio = math.log(target / start)

  def schedule(count):
    # numpy for a host count: the loop picks each step's level on the host, and a jnp value
    # read back there would wait for the steps in flight (host and device in lockstep)
    xp = jnp if isinstance(count, jax.Array) else np
    frac = xp.minimum(xp.asarray(count, xp.float32) / steps, 1.0)
    return start * xp.exp(ratio * frac)
  return schedule


def resize_stages(resize_schedule, total_epochs: float) -> list[tuple[float, float, int]]:
  """[(first_epoch, end_epoch, image_size)] of a progressive-resizing schedule."""
  stages = [(float(e), int(size)) for e, size in resize_schedule]
  ends = [e for e, _ in stages[1:]] + [float(total_epochs)]
  return [(start, end, size) for (start, size), end in zip(stages, ends) if start < total_epochs]


def stage_starts(resize_schedule, total_epochs: float, steps_per_epoch: int) -> list[int]:
  """The first step of each resize stage after the first: the first step whose epoch
  (step / steps_per_epoch) reaches the stage's start, as `image_size` reads it."""
  starts = []
  for start, _, _ in resize_stages(resize_schedule, total_epochs)[1:]:
    step = math.ceil(start * steps_per_epoch)
    while step > 0 and (step - 1) / steps_per_epoch >= start:  # (float rounding either way)
      step -= 1
    while step / steps_per_epoch < start:
      step += 1
    starts.append(step)
  return starts


def image_size(resize_schedule, epoch: float) -> int | None:
  """The image size of `epoch` (None without a schedule)."""
  size = None
  for start, s in resize_schedule:
    if epoch >= start:
      size = int(s)
  return size
