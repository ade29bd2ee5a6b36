"""`auto`'s controller: `AutoExchange` measures where due (`probes`), asks the decision model
(`model`) and logs each choice (`describe`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from sparsejax import comm
from sparsejax.train.auto.model import (
  FORMS,
  Link,
  Measurement,
  choose,
  exchange_s,
  faster,
  fit_in_steps,
  lag_steps,
  moved,
  moved_window,
  other_form,
  predict,
  probe_interval,
  spread_matters,
  stale,
  step_factor,
  with_run_costs,
)
from sparsejax.train.auto.probes import PROBE_REPS, probe_link, probe_select, slowest

__all__ = ["AutoExchange", "describe"]


def _shape_of(batch: Sequence[Any]) -> tuple:
  """The shape of a batch's inputs (what a compiled step is specialised to)."""
  return tuple(batch[0].shape)


class AutoExchange:
  """Chooses the compressor's form before each step (see the module's docstring).

  `level(step)` is the compressor's density level of the chosen form (the sparse form's from its
  density schedule; `dense_level` for the dense form); `before_step` measures and chooses where
  due, and times the steps between measurements; the loop runs evaluations and checkpoints
  inside `paused()`, which leaves them out. `compiled(level)` is the loop's compiled train step
  at a level (the first measurement times the dense one on a copy of the state). `history` (a
  list it appends to; carried through checkpoints by the caller) holds every choice with the
  figures behind it."""

  MIN_WINDOW = 3  # steps a form must have run since the last measurement for its time to count
  TRIAL_STEPS = 8  # steps of a trial: the other form run where its prediction is close
  TRIAL_WITHIN = 2.0  # close: its predicted time to the target within this factor of the choice's
  FAR_OFF = 2.0  # a form whose modelled exchange alone is this many times a close call is not
  # run to be timed (`_far`): a margin for a link read that many times too slow

  def __init__(self, config: Any, plan: Any, setup: Any, state_like: Any, *,
               history: list[dict[str, Any]], compiled: Callable[[int], Callable]):
    from sparsejax.train import step as step_lib  # (step imports state, which needs no auto)
    c = config.compression
    self.compression, self.options = c, config.auto
    self.plan = plan
    self.setup = setup
    # the sparse form's level by step (the dense form's where its pairs would send more)
    self.sparse_level, self.dense_level = plan.sparse_form_level, plan.dense_level
    self.levels = plan.levels  # the sparse form's, by level
    self.history = history
    self.total_steps = plan.total_steps
    self.compiled = compiled
    mesh = setup.mesh
    self.nodes, self.local = mesh.shape["node"], mesh.shape["local"]
    self.n = setup.layout.padded_size
    hierarchical = config.auto.sparse in comm.HIERARCHICAL_ALGORITHMS
    self.shard = self.n // self.local if hierarchical else self.n
    self.k = max(1, round(c.density * self.shard))
    self._gradient = step_lib.jit_gradient_spread(setup, state_like)
    self._select_s: float | None = None  # the sparse form's local work, measured once
    # what has run here (compiled) at each input shape: (level, shape), ("gradient", shape)
    self._warm: set[tuple] = set()
    self._shape: tuple | None = None  # the input's shape (progressive resizing changes it)
    self._rest: dict[str, float] = {}  # each form's step less its modelled exchange, last seen
    self._timed: dict[str, float] = {}  # each form's rest as timed on a copy
    self._rest_link: dict[str, Link] = {}  # the link each form's rest was taken at
    self._seen: set[str] = set()  # the forms observed in the run
    # each form's timed rest at the input size before a resize, until the measurement there
    self._resized_from: dict[str, float] | None = None
    self._link: Link | None = None  # the last fit with a large probe (sizes the next one)
    self.probe_s = 0.0  # the last measurement's probes, wall seconds (the slowest process's)
    self._start = 0.0  # when the measurement under way started (after the window's steps)
    self._untimed: list[float] = []  # its first calls (compilation) so far, seconds
    self.lead = jax.process_index() == 0
    # the steps timed since the last measurement: (level, first step, its start, paused seconds)
    self._window: tuple[int, int, float, float] | None = None
    self._reread = ""  # the note of a second link read in the measurement under way
    # the density warm-up's end: its first step at the final level (the levels only fall,
    # from the dense start's and the warm-up's to the final one: a search, not a scan of the run)
    self.warmup_end = plan.level_steps[-1][0]
    self._open_at: int | None = None  # the step whose start opens the next window

  @property
  def form(self) -> str | None:
    """The form in force (None before the first choice)."""
    return self.history[-1]["form"] if self.history else None

  def _scheduled(self, step: int) -> str:
    """The schedule's form at `step` ("measured" where it measures)."""
    return self.plan.form(step)

  def level(self, step: int) -> int:
    """The compressor's level at `step` for the form in force."""
    form = self._scheduled(step)
    if form == "measured":
      form = self.form
    return self.dense_level if form == "dense" else self.sparse_level(step)

  def _due(self, step: int) -> bool:
    last = self.history[-1]["step"] if self.history else None
    if any(first == step for first, _ in self.plan.forms) or last is None:
      return last != step
    next_step = self.history[-1].get("next_step")
    return (self._scheduled(step) == "measured" and next_step is not None and last != step
            and step >= next_step)

  def _next(self, step: int, step_s: float) -> int | None:
    """The step of the next measurement after one at `step` (`probe_interval`; None: no more
    unless the schedule asks): at least MIN_WINDOW steps of the chosen form after the one that
    compiles, so that the next measurement observes it (sooner, it would time it on a copy)."""
    interval = probe_interval(self.probe_s, step_s, self.options.probe_budget)
    return None if interval is None else step + max(interval, self.MIN_WINDOW + 1)

  # --- timing the steps the run takes

  @contextlib.contextmanager
  def paused(self, state: Any) -> Any:
    """Leaves what runs inside (an evaluation, a checkpoint) out of the steps' time: the steps
    dispatched before it are waited for first."""
    if self._window is None:
      yield
      return
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    try:
      yield
    finally:
      level, first, start, paused = self._window
      self._window = (level, first, start, paused + time.perf_counter() - t0)

  def _observe(self, step: int, state: Any) -> tuple[int, float, int] | None:
    """Closes the window at the start of `step`: (its level, seconds a step, steps), or None
    if fewer than MIN_WINDOW steps of one level ran in it."""
    if self._window is None:
      return None
    level, first, start, paused = self._window
    self._window = None
    if step - first < self.MIN_WINDOW:
      return None
    jax.block_until_ready(state)
    return level, (time.perf_counter() - start - paused) / (step - first), step - first

  def _track(self, step: int, state: Any) -> None:
    """Opens a window at `_open_at` (the steps after a measurement: the chosen form compiled)
    and restarts it where the level changes (a new level compiles in its first step)."""
    level = self.level(step)
    if self._window is not None and self._window[0] != level:
      self._window, self._open_at = None, step + 1
    if self._open_at is not None and step >= self._open_at:
      jax.block_until_ready(state)
      self._window, self._open_at = (level, step, time.perf_counter(), 0.0), None

  def _level_of(self, form: str, step: int) -> int:
    """The level a form's step is timed at: the dense level, or the sparse form's final one
    (the model's exchange is the final density's)."""
    return self.dense_level if form == "dense" else self.sparse_level(self.total_steps - 1)

  def _time_step(self, level: int, state: Any, batch: Sequence[jax.Array]) -> float:
    """The fewest seconds of the compiled train step at `level` on a copy of `state` over
    PROBE_REPS calls (each takes the last one's output: the step donates its input), after one
    untimed call where this level has not run here yet (`compile`)."""
    fn = self.compiled(level)
    copy = jax.tree.map(jnp.copy, state)
    if (level, _shape_of(batch)) not in self._warm:
      t0 = time.perf_counter()
      copy, _ = fn(copy, *batch)
      jax.block_until_ready(copy)
      self._warm.add((level, _shape_of(batch)))
      self._untimed.append(time.perf_counter() - t0)
    times = []
    for _ in range(PROBE_REPS):
      t0 = time.perf_counter()
      copy, _ = fn(copy, *batch)
      jax.block_until_ready(copy)
      times.append(time.perf_counter() - t0)
    return min(times)

  def compile(self, state: Any, batch: Sequence[jax.Array]) -> None:
    """Runs what a measurement runs once, untimed, so that the first measurement times no
    compilation: the link probes, the gradient pass, each form's step (on a copy of `state`);
    the selection, which does not depend on the link, is measured here. For a caller that keeps
    compilation off its clock (a benchmark); a run that skips it pays it in its first
    measurement."""
    _, self._link, _ = probe_link(self.setup.mesh, self.shard, None)  # (sizes the next one)
    self._select_s, = slowest([probe_select(self.compression.selector, self.shard, self.k,
                                              self.nodes)])
    jax.block_until_ready(self._gradient(state, *batch))
    self._warm.add(("gradient", _shape_of(batch)))
    for form in FORMS:
      level = self._level_of(form, 0)
      copy, _ = self.compiled(level)(jax.tree.map(jnp.copy, state), *batch)
      jax.block_until_ready(copy)
      self._warm.add((level, _shape_of(batch)))

  def _exchange(self, link: Link, density: float | None = None) -> dict[str, float]:
    """Each form's modelled exchange on `link` (the sparse form's at `density`, by default the
    final one)."""
    probed = Measurement(link, "dense", 0.0, self._select_s or 0.0, 1.0)
    return exchange_s(probed, algorithm=self.options.sparse, n=self.n, nodes=self.nodes,
                      local=self.local, density=density or self.compression.density)

  def _fit(self, link: Link, steps: dict[str, float], density: float | None = None) -> Link:
    """`link` at least as fast as each step shows (`fit_in_steps`), after the selection is
    taken as at most the sparse step it is part of (its probe, once at the start, read 25-50 ms
    in some runs beside whole sparse steps of 21-32 ms on Fashion-MNIST)."""
    if "sparse" in steps and self._select_s is not None:
      self._select_s = min(self._select_s, steps["sparse"])
    return fit_in_steps(link, steps, lambda at: self._exchange(at, density))

  def _stale(self, form: str, link: Link) -> bool:
    """Whether `form`'s rest was taken at a link far from `link` (`model.stale`)."""
    if form not in self._rest:
      return False
    then = self._rest_link[form]
    return stale(self._rest[form], self._exchange(then)[form], self._exchange(link)[form],
                  then.bytes_per_s, link.bytes_per_s)

  def _far(self, form: str, link: Link, step_s: float, step: int) -> bool:
    """Whether `form`'s modelled exchange on `link` alone is FAR_OFF times what would make it
    a close call against the other form's step `step_s` (the dense form against the sparse
    step times the largest step factor it can have at `step`, `_factor_bound`; the sparse form
    against the dense step): then no step of it can be chosen, even on a link read FAR_OFF
    times too slow, so it is not run to be timed, and what was kept of its rest (taken at
    another link) is dropped, so that `predict` takes the other form's."""
    bound = self._factor_bound(step) if form == "dense" else 1.0
    if self._exchange(link)[form] < self.FAR_OFF * bound * step_s:
      return False
    self._rest.pop(form, None)
    self._timed.pop(form, None)
    return True

  def _factor_bound(self, step: int) -> float:
    """The largest step factor the sparse form can have from `step` on: the user's
    `auto.step_factor`, else the lag's at its bound (a flat gradient, `spread_matters`), at
    least `auto.min_step_factor`."""
    if self.options.step_factor:
      return self.options.step_factor
    lag = lag_steps(1.0, self.compression.density)
    return max(step_factor(lag, self.total_steps - step), self.options.min_step_factor)

  def _observed_steps(self, step: int, observed: tuple[int, float, int], link: Link,
                      probe_s: float, state: Any, batch: Sequence[jax.Array]
                      ) -> tuple[str, dict[str, float], str, Link] | None:
    """The form in force's step as the run took it (a warm-up level's moved to the final
    density), and the other form's timed again where its rest is stale: (the form, the steps,
    how, the link fitted to them); None where a warm-up level's window says little of the
    final density's step (`moved_window`)."""
    level, step_s, steps = observed
    form = "dense" if level == self.dense_level else "sparse"
    how = f"observed over {steps} steps"
    step_s, self.probe_s = slowest([step_s, probe_s])
    ran = self.levels[level] if form == "sparse" else 1.0
    link = self._fit(link, {form: step_s}, ran)
    if form == "sparse" and ran != self.compression.density:  # a warm-up level: to the final
      step_s = moved_window(step_s, self._exchange(link)["sparse"]
                            - self._exchange(link, ran)["sparse"])
      if step_s is None:
        return None
      how += f" at density {ran:.3g}"
    steps = {form: step_s}
    if self._stale(other := other_form(form), link):  # the other form timed again at this link
      if self._far(other, link, step_s, step):
        how += f"; {other} not timed again (the link moved far off)"
      else:
        steps[other], = slowest([self._time_step(self._level_of(other, step), state, batch)])
        how += f"; {other} timed again (the link moved)"
        link = self._fit(link, {other: steps[other]})
    return form, steps, how, link

  def _spent(self) -> float:
    """Seconds the measurement under way has taken (`measure`), its first calls (compilation)
    left out. Taken after the probes (link, gradient): what every measurement costs, which
    sets the cadence (`probe_interval`); a form's step timed on a copy (the first measurement,
    a link that moved) is a one-off."""
    return time.perf_counter() - self._start - sum(self._untimed)

  def _read_again(self, read: Link) -> Link:
    """The link read a second time, the faster read kept (a misread only ever reads slow: a
    stall, another process on the core); noted for the log."""
    again, self._link, _ = probe_link(self.setup.mesh, self.shard, self._link, self._untimed)
    self._reread = (f"; link read twice ({8e-6 * read.bytes_per_s:.3g} and "
                    f"{8e-6 * again.bytes_per_s:.3g} Mbit/s), the faster kept")
    return faster(read, again, 4 * self.shard)

  def _timed_steps(self, step: int, link: Link, probe_s: float, state: Any,
                   batch: Sequence[jax.Array]) -> tuple[str, dict[str, float], str, Link]:
    """The form in force's compiled step timed here (before the first choice: the cheaper
    exchange's), and the other form's at the first measurement or where its rest is stale,
    unless its modelled exchange alone rules it out (`_far`): it is then not run, and its rest
    is taken as the timed form's (`predict`'s default: both forms run the same
    forward and backward pass and update; the selection is part of the sparse exchange)."""
    now = self._exchange(link)
    form = self.form or min(FORMS, key=now.__getitem__)
    step_s, = slowest([self._time_step(self._level_of(form, step), state, batch)])
    steps, other = {form: step_s}, other_form(form)
    link = self._fit(link, steps)
    # the first measurement: the other form's step too, unless its exchange alone rules it out
    # (running it cost the CNN at 10 Mbit/s its compilation and two 1.2 s steps, the MNIST MLP
    # at 500 Mbit/s about 10% of its run). Before ruling the dense form out on the first read,
    # the link is read again, the faster kept (one CI run's in-process link read 0.8 Mbit/s at
    # step 0 and auto started sparse); where the dense form is timed, its step bounds the link
    # (`_fit`) and no second read (40-65 ms on the MLPs) is taken.
    how = "timed"
    # (at a new input size the other form is moved, not timed, where both were timed before)
    unmovable = self._resized_from is not None and set(self._resized_from) != set(FORMS)
    if other not in self._rest or self._stale(other, link) or unmovable:
      first = not self._rest and not self._timed
      if (first and other == "dense" and not self._reread
          and self._far(other, link, step_s, step)):
        link = self._fit(self._read_again(link), steps)
      if self._far(other, link, step_s, step):
        how = (f"timed; {other} not run (far off: its exchange alone "
               f"{1e3 * self._exchange(link)[other]:.0f} ms, its rest taken as {form}'s)")
      else:
        steps[other] = self._time_step(self._level_of(other, step), state, batch)
    values = slowest([*steps.values(), probe_s])
    steps, self.probe_s = dict(zip(steps, values)), values[-1]
    return form, steps, how, self._fit(link, steps)

  def measure(self, step: int, state: Any, batch: Sequence[jax.Array]) -> Measurement:
    """The link, the gradient and, once, the selection probes; the whole step of the form in
    force as the run took it since the last measurement, or its compiled step timed here where
    no such window exists (at the first measurement both forms'); each figure the slowest
    process's. Each form's step less its modelled exchange is kept for `predict`."""
    observed = self._observe(step, state)
    self._start = time.perf_counter()  # (the window's steps waited for are the run's, not ours)
    self._untimed = []
    # (the guide is the same on every process: fitted from the slowest times)
    read, self._link, _ = probe_link(self.setup.mesh, self.shard, self._link, self._untimed)
    self._reread = ""
    # read again before timing a form where a form's rest was taken at a link far from this
    # read (at the first measurement only where the read would leave the dense form unrun:
    # `_timed_steps`)
    if any(self._stale(form, read) for form in self._rest):
      read = self._read_again(read)
    if self._select_s is None:  # one untimed call of each (compilation), then the fewest
      t0 = time.perf_counter()
      self._select_s, = slowest([probe_select(self.compression.selector, self.shard, self.k,
                                                self.nodes)])
      self._untimed.append(time.perf_counter() - t0)
    spread = None  # (not measured where it cannot change the factor)
    if not self.options.step_factor and spread_matters(
        self.compression.density, self.total_steps - step, self.options.min_step_factor):
      if ("gradient", _shape_of(batch)) not in self._warm:  # (a new input size compiles it)
        t0 = time.perf_counter()
        jax.block_until_ready(self._gradient(state, *batch))
        self._warm.add(("gradient", _shape_of(batch)))
        self._untimed.append(time.perf_counter() - t0)
      spread = float(jax.device_get(self._gradient(state, *batch)))
    probe_s = self._spent()  # (what every measurement costs; a form timed is a one-off)
    got = observed and self._observed_steps(step, observed, read, probe_s, state, batch)
    if got:
      form, steps, how, link = got
    else:  # (no window, or one at a warm-up level far from the final density)
      observed = None
      form, steps, how, link = self._timed_steps(step, read, probe_s, state, batch)
    other = other_form(form)
    now = {f: s - self._exchange(link)[f] for f, s in steps.items()}  # (`rests`)
    self._rest_link.update(dict.fromkeys(now, link))
    if self._resized_from is not None:  # the first measurement at a new input size
      if observed is None and len(now) == 1 and set(self._resized_from) == set(FORMS):
        now[other], change = moved(self._resized_from, form, now[form])
        how += f"; {other} moved by {1e3 * change:+.1f} ms (the new input size)"
      self._resized_from = None
    how += self._reread
    if link != read:
      how += f"; the probes' link, {8e-6 * read.bytes_per_s:.3g} Mbit/s, raised to fit the steps"
    m = Measurement(link, form, steps[form], self._select_s, spread, how)
    if observed is None:
      self._timed.update(now)
    else:
      self._seen.add(form)
      if len(steps) > 1:  # the other form timed again: its observation no longer holds
        self._timed[other_form(form)] = now[other_form(form)]
        self._seen.discard(other_form(form))
      now = with_run_costs(now, form, self._timed, self._seen)
    self._rest.update(now)
    return m

  def _factor(self, step: int, spread: float | None) -> float:
    """The sparse form's steps over the dense form's from `step` on (`auto.step_factor`, else
    from the lag, at least `auto.min_step_factor`; that where the spread was not measured)."""
    if self.options.step_factor:
      return self.options.step_factor
    if spread is None:
      return self.options.min_step_factor
    lag = lag_steps(spread, self.compression.density)
    return max(step_factor(lag, self.total_steps - step), self.options.min_step_factor)

  def _close(self, step: int, chosen: str, step_s: dict[str, float], factor: float
             ) -> str | None:
    """The other form, to be run for TRIAL_STEPS steps, where it has not run in this run yet and
    its predicted time to the target is within TRIAL_WITHIN of the chosen form's: a step timed
    on a copy of the state is not a step of the run (the MNIST MLP's dense step timed 18 ms and
    ran 25, its sparse step 22 and 19), so a close call is settled by the run's own steps. Only
    where measurements go on (`auto.probe_budget` > 0), the run has 4 trials' steps left after
    the density warm-up, and once per form; the trial itself waits for the warm-up's end (the
    sparse form at its final density: `before_step`, `_next_close`)."""
    other = other_form(chosen)
    to_target = {"dense": step_s["dense"], "sparse": step_s["sparse"] * factor}
    if (other in self._seen or any(e.get("trial") == other for e in self.history)
        or not self.options.probe_budget
        or self.total_steps - max(step, self.warmup_end) < 4 * (self.TRIAL_STEPS + 1)
        or to_target[other] > self.TRIAL_WITHIN * to_target[chosen]):
      return None
    return other

  def _next_close(self, step: int, next_step: int | None) -> int | None:
    """The next measurement where a close call kept the dense form during the density warm-up
    (the sparse form's trial waits for its final density): at the warm-up's end, if the
    budget's cadence comes later (on Fashion-MNIST at the unlimited link a close call at step
    0 waited for the budget's step 174, past the target at 108-120, and auto kept dense
    throughout), so that the trial runs as soon as it can. (Not for a close call that chose
    the sparse form: a dense trial at the warm-up's end on the same task cost two seeds of three
    0.2-0.5 s, the dense form's first steps in a run taking 36-45 ms against its 31-35 later.)"""
    at = max(self.warmup_end, step + self.MIN_WINDOW + 1)
    return at if next_step is None else min(next_step, at)

  def _resized(self, batch: Sequence[jax.Array]) -> bool:
    """Whether the input's shape changed since the last step (progressive resizing): the run
    then measures again now, outside the cadence. Only the compute changes with the input, not
    the exchange (the parameters are the same), so the form in force is timed at the new size
    and the other form's rest moved by the same difference (`moved`); what the run added to
    each step at the old size, and the window, are dropped."""
    before, self._shape = self._shape, _shape_of(batch)
    if before is None or before == self._shape:
      return False
    self._resized_from = dict(self._timed)  # each form's rest timed at the old size
    self._seen.clear()
    self._window, self._open_at = None, None
    return True

  def before_step(self, step: int, state: Any, batch: Sequence[jax.Array], writer: Any) -> None:
    """Measures and chooses where due (and where the input's size changed); logs the choice;
    times the steps between."""
    resized = self._resized(batch) and self._scheduled(step) == "measured"
    if not resized and not self._due(step):
      self._track(step, state)
      return
    c = self.compression
    entry: dict[str, Any] = {"step": step}
    if resized:
      entry["input_shape"] = list(self._shape)
    form = self._scheduled(step)
    if form != "measured":
      self._window = None
      entry.update(form=form, why="schedule")
    else:
      t0 = time.perf_counter()
      m = self.measure(step, state, batch)
      a = self.options
      step_s = predict(m, algorithm=a.sparse, n=self.n, density=c.density,
                       nodes=self.nodes, local=self.local, rest=self._rest)
      remaining = self.total_steps - step
      lag = None if m.spread is None else lag_steps(m.spread, c.density)
      factor = self._factor(step, m.spread)
      form = choose(step_s, factor, self.form, a.margin)
      close = self._close(step, form, step_s, factor)
      trial = close if close and step >= self.warmup_end else None
      next_step = self._next(step, step_s[form])
      if close and not trial and form == "dense":  # (during the warm-up)
        next_step = self._next_close(step, next_step)
      entry.update(form=trial or form, why="measured", link_MBps=m.link.bytes_per_s / 1e6,
                   call_ms=1e3 * m.link.fixed_s, select_ms=1e3 * m.select_s, measured=m.form,
                   measured_step_ms=1e3 * m.step_s,
                   how=m.how, dense_step_ms=1e3 * step_s["dense"],
                   sparse_step_ms=1e3 * step_s["sparse"],
                   **{f"{f}_rest_ms": 1e3 * r for f, r in self._rest.items()},
                   spread=m.spread, lag_steps=lag,
                   remaining_steps=remaining, step_factor=factor,
                   factor_from=("auto.step_factor" if a.step_factor else
                                "lag" if factor > a.min_step_factor else "auto.min_step_factor"),
                   probe_ms=1e3 * self.probe_s, next_step=next_step,
                   measure_ms=1e3 * (time.perf_counter() - self._start),
                   waited_ms=1e3 * (self._start - t0))
      if trial:  # measured again once the trial's steps have run
        entry.update(trial=trial, next_step=step + 1 + self.TRIAL_STEPS)
    self.history.append(entry)
    self._open_at = step + 1
    if self.lead:
      print(describe(entry, c, self.options), flush=True)
      writer.write("auto", step, {"dense": float(entry["form"] == "dense"), **{
          k: v for k, v in entry.items()
          if isinstance(v, (int, float)) and k != "step" and v is not None}})


def describe(entry: dict[str, Any], compression: Any, options: Any) -> str:
  """One log line for a choice (`options`: the config's `auto` group)."""
  sparse = f"{options.sparse} {compression.density:g}"
  head = f"sparsejax auto: step {entry['step']}: "
  if entry["why"] != "measured":
    return head + f"{entry['form']} ({entry['why']})"
  if entry.get("factor_from") == "lag":
    factor = (f"(1 + lag {entry['lag_steps']:.1f} / {entry['remaining_steps']} steps left; "
              f"spread {entry['spread']:.3f})")
  elif entry.get("factor_from") == "auto.min_step_factor" and entry.get("lag_steps") is None:
    factor = (f"(auto.min_step_factor; the lag, at most "
              f"{lag_steps(1.0, compression.density):.1f} / "
              f"{entry['remaining_steps']} steps left, says less: not measured)")
  elif entry.get("factor_from") == "auto.min_step_factor":
    factor = (f"(auto.min_step_factor; the lag {entry['lag_steps']:.1f} / "
              f"{entry['remaining_steps']} steps left says less)")
  else:
    factor = "(auto.step_factor)"
  return head + (
      f"link {8 * entry['link_MBps']:.0f} Mbit/s + {entry['call_ms']:.2f} ms a call; "
      f"{entry['measured']} step {entry['measured_step_ms']:.1f} ms ({entry['how']}), "
      f"selection {entry['select_ms']:.1f} ms -> step dense "
      f"{entry['dense_step_ms']:.1f} ms, {sparse} {entry['sparse_step_ms']:.1f} ms x "
      f"{entry['step_factor']:.3g} {factor} = "
      f"{entry['sparse_step_ms'] * entry['step_factor']:.1f} ms; "
      + (f"close: runs {entry['trial']} for {AutoExchange.TRIAL_STEPS} steps to measure it; "
         if entry.get("trial") else f"chose {entry['form']}; ")
      + f"probes {entry['probe_ms']:.0f} ms ({entry['measure_ms']:.0f} ms in all), "
      + ("no more measurements unless scheduled" if entry["next_step"] is None
         else f"next due at step {entry['next_step']}"))
