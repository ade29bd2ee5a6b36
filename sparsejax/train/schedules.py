"""The learning-rate schedule in steps, from the config's `optimizer` group and the run's plan
(`sparsejax.train.plan`: the warm-up and the step schedule's boundaries in steps)."""

from __future__ import annotations

from typing import Any

import optax

__all__ = ["learning_rate"]


def learning_rate(opt: Any, plan: Any) -> optax.Schedule:
  """Linear warm-up from 0 over `plan.warmup_steps`, then cosine / linear / poly / step /
  constant over the rest of `plan.total_steps` (`opt`: the config's `optimizer` group)."""
  peak, end, warmup = opt.learning_rate, opt.end_learning_rate, plan.warmup_steps
  rest = max(plan.total_steps - warmup, 1)
  if opt.schedule == "cosine":
    main = optax.cosine_decay_schedule(peak, rest, alpha=end / peak if peak else 0.0)
  elif opt.schedule == "linear":
    main = optax.linear_schedule(peak, end, rest)
  elif opt.schedule == "poly":
    main = optax.polynomial_schedule(peak, end, opt.poly_power, rest)
  elif opt.schedule == "step":
    main = optax.piecewise_constant_schedule(peak, {b: opt.step_factor
                                                    for b in plan.decay_steps})
  else:
    main = optax.constant_schedule(peak)
  if warmup == 0:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), main], [warmup])
