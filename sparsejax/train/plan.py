"""The run plan: a validated config resolved once, at start-up, into steps.

A config gives the recipe's durations (warm-ups, phases, schedules, image-size stages) in epochs;
the plan gives each in steps, through one function, `steps`, with one rule: a duration of `e`
epochs ends at the first step whose epoch (`step / steps_per_epoch`, as the loop reads it) is at
or past `e`, so a phase over epochs [a, b) runs steps [steps(a), steps(b)). Logging, evaluation
and checkpoint cadences are in steps already.

Beside the durations the plan holds what each step runs, as tables of (first step, value):
the exchange's form (dense or sparse, or measured by `auto`), the sparse form's density level
(the density warm-up's, rounded up to static levels) and the image size. The loop, the
optimizer chain, `auto`, the pipelined exchange and the studies read the plan, never the raw
config's epochs.

Never more bytes than dense: a density level whose (value, index) pairs would send more bytes
than the exchange's dense form at the run's workers (`comm.wire_bytes`; at P nodes, about a
density over 1/P) runs the dense form instead, every candidate summed and the residual
emptied (in pairs4 the values cross as bfloat16 and the residual keeps their rounding)
(`Plan.dense_levels`, said in `Plan.notes`): a density warm-up then never costs more
than a dense step.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import comm
from sparsejax.compress import density_levels, level_index

__all__ = ["steps", "Plan", "make_plan", "FORMS", "at"]

FORMS = ("dense", "sparse", "measured")  # the exchange's forms by step (`Plan.forms`)


def steps(epochs: float, steps_per_epoch: int) -> int:
  """The first step whose epoch (`step / steps_per_epoch`) is at or past `epochs`: the number of
  steps in the first `epochs` epochs. The one conversion of a duration from epochs to steps."""
  if steps_per_epoch < 1:
    raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch!r}")
  step = max(0, math.ceil(epochs * steps_per_epoch))
  while step > 0 and (step - 1) / steps_per_epoch >= epochs:  # (float rounding either way)
    step -= 1
  while step / steps_per_epoch < epochs:
    step += 1
  return step


def at(table: Sequence[tuple[int, Any]], step: int) -> Any:
  """The value a table of (first step, value), sorted by step, gives `step`."""
  i = bisect.bisect_right([first for first, _ in table], step) - 1
  return table[max(i, 0)][1]


@dataclasses.dataclass(frozen=True)
class Plan:
  """A run's recipe in steps (see the module). Built by `make_plan`; never changed.

  steps_per_epoch, total_steps: the data's global batches per epoch; the run's steps.
  warmup_steps: the learning rate's linear warm-up. decay_steps: the step schedule's
    boundaries (steps from the start). freeze_variance_step: AdamW's second moment frozen from
    this step (0: never).
  algorithm: the sparse exchange the compressor is built for (`auto.sparse` under "auto"), or
    a dense one. density: its final density. levels: the static densities its warm-up is
    rounded up to (one level without a warm-up). warmup_steps_density, warmup_density: the
    density warm-up (geometric from `warmup_density` to `density`; 0 steps: none).
  dense_form: whether the compressor offers its dense form (at level index `len(levels)`, its
    steady step at `len(levels) + 1`).
  forms: ((first step, "dense" | "sparse" | "measured"), ...): the exchange's form by step.
  level_steps: ((first step, level index), ...): the sparse form's density level by step.
  stages: ((first step, image size or None), ...): progressive resizing.
  stage_ends: the steps after which a stage ends (evaluated with `eval_at_stage_boundaries`).
  pipeline_start: the first pipelined step (`overlap.from_epochs`).
  workers: (nodes, local) the exchange's bytes are counted at (None: not known, no level is
    replaced). dense_levels: the sparse levels whose pairs would send more bytes than the dense
    form at `workers`: they run the dense form.
  wire: the pairs' format (`experimental.wire`). corrected: whether a momentum or Adam
    correction runs in the exchange (its dense form's steady steps then send float32:
    `dense_wire`).
  """

  steps_per_epoch: int
  total_steps: int
  warmup_steps: int
  decay_steps: tuple[int, ...]
  freeze_variance_step: int
  algorithm: str
  density: float
  levels: tuple[float, ...]
  warmup_steps_density: int
  warmup_density: float
  dense_form: bool
  forms: tuple[tuple[int, str], ...]
  level_steps: tuple[tuple[int, int], ...]
  stages: tuple[tuple[int, int | None], ...]
  stage_ends: tuple[int, ...]
  pipeline_start: int
  workers: tuple[int, int] | None = None
  dense_levels: tuple[int, ...] = ()
  wire: str = "pairs8"
  corrected: bool = False

  def steps(self, epochs: float) -> int:
    """`steps(epochs, self.steps_per_epoch)`."""
    return steps(epochs, self.steps_per_epoch)

  @property
  def sparse(self) -> bool:
    """Whether the compressor is a sparse exchange (with levels), not a dense baseline."""
    return self.algorithm in comm.SPARSE_ALGORITHMS

  @property
  def dense_wire(self) -> str:
    """The wire the dense form's steady steps send in (`comm.steady_wire`)."""
    return comm.steady_wire(self.wire, self.corrected)

  @property
  def dense_level(self) -> int | None:
    """The level index of the compressor's dense form (None without one): every candidate
    all-reduced, the residual sent and emptied (in pairs4 but for its bfloat16 roundings), the
    correction's state made the mean."""
    return len(self.levels) if self.dense_form else None

  @property
  def steady_level(self) -> int | None:
    """The level index of the dense form's steady step (None without a dense form): the
    gradient all-reduced, then the correction run on the mean, the residual untouched (in
    pairs4 without a correction the last step's bfloat16 roundings sent with it and this
    step's kept); plain dense's work, for a step after a dense-form step (`dense_after`)."""
    return len(self.levels) + 1 if self.dense_form else None

  def dense_after(self, previous: int | None) -> int:
    """The dense form's level for a step after one at level `previous` (None: the run's first
    step): its steady step where the residual is empty (in pairs4, but for roundings) and the
    correction's state the same on every party (after a dense-form step, or at the start),
    else the dense form, which sends the residual and makes the state the mean (the switch's
    extra work, once)."""
    if previous is None or previous in (self.dense_level, self.steady_level):
      return self.steady_level
    return self.dense_level

  @property
  def dense_steps(self) -> int:
    """The steps of the dense start (0 without one): the first entry of `forms` if dense."""
    return self.forms[1][0] if len(self.forms) > 1 and self.forms[0][1] == "dense" else 0

  def form(self, step: int) -> str:
    """The exchange's form at `step`: "dense", "sparse" or "measured" (auto's choice)."""
    return at(self.forms, step)

  def sparse_level(self, step: int) -> int:
    """The sparse form's density level index at `step` (the schedule's)."""
    return at(self.level_steps, step)

  def sparse_form_level(self, step: int) -> int:
    """The level the sparse form runs at `step`: its density level, or the dense form's where
    that level's pairs would send more bytes than a dense exchange (`dense_levels`)."""
    level = self.sparse_level(step)
    return self.dense_level if level in self.dense_levels else level

  def level(self, step: int) -> int | None:
    """The compressor's level at `step` for the forms fixed by step (the dense form's in a
    dense phase; "measured" steps take the sparse form's, for auto to override); None for a
    dense algorithm (nothing to choose)."""
    level = self._fixed_level(step)
    if level is None or level != self.dense_level:
      return level
    return self.dense_after(self._fixed_level(step - 1) if step > 0 else None)

  def _fixed_level(self, step: int) -> int | None:
    """`level` before the dense form's steady step is told apart."""
    if not self.sparse:
      return None
    return self.dense_level if self.form(step) == "dense" else self.sparse_form_level(step)

  def notes(self) -> list[str]:
    """What the plan changed of the config, in words (for the log): the levels that run the
    dense form, with the steps they span."""
    out = []
    ends = [first for first, _ in self.level_steps[1:]] + [self.total_steps]
    for (first, level), end in zip(self.level_steps, ends, strict=True):
      if level in self.dense_levels and first < end:
        nodes, local = self.workers
        out.append(f"density {self.levels[level]:g} (steps {first}-{end - 1}): its pairs would "
                   f"send more bytes than the dense form at {nodes} x {local} workers; those "
                   "steps run the dense form")
    return out

  def image_size(self, step: int) -> int | None:
    """The image size step `step` trains at (None: the data's own)."""
    return at(self.stages, step)

  def density_schedule(self):
    """The density warm-up as an optax schedule `count -> density` (numpy for a host count,
    traced for a traced one), or None without a warm-up."""
    n = self.warmup_steps_density
    if not n or not self.sparse:
      return None
    start, ratio = self.warmup_density, math.log(self.density / self.warmup_density)

    def schedule(count):
      # numpy for a host count: the loop picks each step's level on the host, and a jnp value
      # read back there would wait for the steps in flight (host and device in lockstep)
      xp = jnp if isinstance(count, jax.Array) else np
      frac = xp.minimum(xp.asarray(count, xp.float32) / n, 1.0)
      return start * xp.exp(ratio * frac)
    return schedule


def _level_steps(levels: tuple[float, ...], schedule, last: int) -> tuple[tuple[int, int], ...]:
  """((first step, level), ...) of the warm-up's densities rounded up to `levels`, up to step
  `last` (the warm-up's end, or the run's if sooner)."""
  if schedule is None:
    return ((0, 0),)
  table: list[tuple[int, int]] = []
  for step in range(last + 1):
    level = level_index(levels, float(schedule(step)))
    if not table or table[-1][1] != level:
      table.append((step, level))
  return tuple(table)


def _forms(config: Any, dense_steps: int, spe: int) -> tuple[tuple[int, str], ...]:
  """((first step, form), ...): under "auto" its schedule (epochs) in steps, or measured
  throughout; for the other algorithms "sparse" throughout; the dense start in front."""
  fixed = config.auto.schedule if config.compression.algorithm == "auto" else ((0.0, "sparse"),)
  by_step: dict[int, str] = {}
  for epochs, form in fixed or ((0.0, "measured"),):
    by_step[steps(epochs, spe)] = form  # the last of those falling on one step
  table = tuple(sorted(by_step.items()))
  if not dense_steps:
    return table
  return ((0, "dense"), (dense_steps, at(table, dense_steps)),
          *((s, f) for s, f in table if s > dense_steps))


def _stages(resize_schedule: Any, spe: int, total: int) -> tuple[tuple[int, int | None], ...]:
  """((first step, size), ...) of a progressive-resizing schedule ((first epoch, size), ...);
  ((0, None),) without one. Stages that start after the run are left out."""
  table = [(steps(e, spe), int(size)) for e, size in resize_schedule]
  table = [(s, size) for s, size in table if s < total]
  return tuple(table) or ((0, None),)


def make_plan(config: Any, steps_per_epoch: int,
              workers: tuple[int, int] | None = None) -> Plan:
  """The plan of a validated config for data of `steps_per_epoch` global batches an epoch, on
  `workers` = (nodes, local) (default: the config's mesh where both sizes are set)."""
  if workers is None and config.mesh.nodes >= 1 and config.mesh.local >= 1:
    workers = (config.mesh.nodes, config.mesh.local)
  spe = steps_per_epoch
  total = max(1, steps(config.num_epochs, spe))
  o, c = config.optimizer, config.compression
  warmup = steps(o.warmup_epochs, spe)
  algorithm = config.auto.sparse if c.algorithm == "auto" else c.algorithm
  sparse = algorithm in comm.SPARSE_ALGORITHMS
  dense_form = c.algorithm == "auto" or (c.dense_epochs > 0 and sparse)
  density_warmup = steps(c.warmup_epochs, spe) if c.warmup_density > c.density else 0
  levels = (density_levels(c.density, c.warmup_density) if density_warmup
            else (float(c.density),))
  stages = _stages(config.data.resize_schedule, spe, total)
  plan = Plan(
      steps_per_epoch=spe, total_steps=total, warmup_steps=warmup,
      decay_steps=tuple(steps(e, spe) - warmup for e in o.step_epochs),
      freeze_variance_step=steps(o.freeze_variance_epochs, spe),
      algorithm=algorithm, density=float(c.density), levels=levels,
      warmup_steps_density=density_warmup, warmup_density=float(c.warmup_density),
      dense_form=dense_form,
      forms=_forms(config, steps(c.dense_epochs, spe) if dense_form else 0, spe),
      level_steps=((0, 0),), stages=stages,
      stage_ends=tuple(s for s, _ in stages[1:]) if config.eval_at_stage_boundaries else (),
      pipeline_start=steps(config.overlap.from_epochs, spe))
  level_steps = _level_steps(levels, plan.density_schedule(), min(density_warmup, total - 1))
  wire, corrected = config.experimental.wire, bool(c.momentum_correction)
  dense_levels = () if workers is None else tuple(
      i for i in comm.denser_than_dense(algorithm, levels, *workers, wire, corrected)
      if any(level == i for _, level in level_steps))
  return dataclasses.replace(plan, level_steps=level_steps, workers=workers,
                             dense_levels=dense_levels, wire=wire, corrected=corrected,
                             dense_form=plan.dense_form or bool(dense_levels))
