"""`auto`'s controller: `AutoExchange` reads the run's own steps and the link where due
(`probes`), asks the decision model (`model`) and logs each choice (`describe`).

Nothing is timed on a copy of the state and no form is run to be tried: the form in force's
steps, as the run takes them between two measurements, give its rest; the other form's step is
its own rest where it has run at this input size, else the same rest, plus its modelled
exchange. Only the form in force is compiled; a switch pays the other's compile once, in the
run's step that follows it, and is chosen only where it saves more than that (`switch_s`: the
programs the other form would compile at this input size, at what the run's took there; the run
reports each step's program through `ran`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import jax

from sparsejax import comm
from sparsejax.train.auto.model import (
  Link,
  choose,
  exchange_s,
  faster,
  fit_in_steps,
  moved,
  predict,
  probe_interval,
  rest_of,
  step_factor,
  switch_s,
)
from sparsejax.train.auto.probes import probe_link, probe_select, slowest

__all__ = ["AutoExchange", "describe"]


def _shape_of(batch: Sequence[Any]) -> tuple:
  """The shape of a batch's inputs (what a compiled step is specialised to)."""
  return tuple(batch[0].shape)


class AutoExchange:
  """Chooses the compressor's form before each step (see the module's docstring).

  `level(step)` is the compressor's density level of the chosen form (the sparse form's from its
  density schedule; `dense_level` for the dense form); `before_step` measures and chooses where
  due, and times the steps between measurements; the loop runs evaluations and checkpoints
  inside `paused()`, which leaves them out. `history` (a list it appends to; carried through
  checkpoints by the caller) holds every choice with the figures behind it."""

  MIN_WINDOW = 3  # steps a form must have run since the last measurement for its time to count

  def __init__(self, config: Any, plan: Any, setup: Any, *, history: list[dict[str, Any]]):
    c = config.compression
    self.compression, self.options = c, config.auto
    self.plan = plan
    self.setup = setup
    # the sparse form's level by step (the dense form's where its pairs would send more)
    self.sparse_level, self.dense_level = plan.sparse_form_level, plan.dense_level
    self.levels = plan.levels  # the sparse form's, by level
    self.history = history
    self.total_steps = plan.total_steps
    mesh = setup.mesh
    self.nodes, self.local = mesh.shape["node"], mesh.shape["local"]
    self.n = setup.layout.padded_size
    hierarchical = config.auto.sparse in comm.HIERARCHICAL_ALGORITHMS
    self.shard = self.n // self.local if hierarchical else self.n
    self.k = max(1, round(c.density * self.shard))
    a = config.auto
    self.factor = a.step_factor or step_factor(a.step_factor_quantile)
    self.factor_from = ("auto.step_factor" if a.step_factor
                        else f"auto.step_factor_quantile {a.step_factor_quantile:g}")
    self._select_s: float | None = None  # the sparse form's local work, probed once: when first
    # needed (`_probe_select`)
    self._link: Link | None = None  # the last fit with a large probe (sizes the next one)
    self._rest: dict[str, float] = {}  # each form's rest at this input size, read from the run
    # ... each window's (rest, steps) by (form, level): a window at a warm-up level reads its
    # rest through that level's modelled exchange, whose error is not the final level's
    self._reads: dict[tuple[str, int], list[tuple[float, int]]] = {}
    self._before: dict[str, float] | None = None  # the rests at the old size, after a resize
    self._read_forms: set[str] = set()  # the forms whose rest the run gave at this size
    self._shape: tuple | None = None  # the input's shape (progressive resizing changes it)
    self._ran: set[int] = set()  # the levels run at this input size (their programs compiled)
    self._compiled: list[float] = []  # seconds each program run at this size took to compile
    self._compiled_before: list[float] = []  # ... at the last size that had any
    self._last: Link | None = None  # the link the last choice was made on
    self.probe_s = 0.0  # the last measurement's probes, wall seconds (the slowest process's)
    self.spent_s = 0.0  # every measurement's wall seconds so far, compilations included (ditto)
    self.lead = jax.process_index() == 0
    # the steps timed since the last measurement: (level, first step, its start, paused seconds)
    self._window: tuple[int, int, float, float] | None = None
    self._open_at: int | None = None  # the step whose start opens the next window

  @property
  def form(self) -> str | None:
    """The form in force (None before the first choice)."""
    return self.history[-1]["form"] if self.history else None

  def _scheduled(self, step: int) -> str:
    """The schedule's form at `step` ("measured" where it measures)."""
    return self.plan.form(step)

  def form_at(self, step: int) -> str | None:
    """The form the run takes at `step`: the schedule's, or the choice in force there."""
    form = self._scheduled(step)
    if form != "measured":
      return form
    return next((e["form"] for e in reversed(self.history) if e["step"] <= step), None)

  def _base_level(self, step: int) -> int | None:
    form = self.form_at(step)
    return self.dense_level if form == "dense" else self.sparse_level(step)

  def level(self, step: int) -> int:
    """The compressor's level at `step` for the form in force (the dense form's steady step
    after a dense-form step: `Plan.dense_after`)."""
    level = self._base_level(step)
    if level != self.dense_level:
      return level
    return self.plan.dense_after(self._base_level(step - 1) if step > 0 else None)

  def _due(self, step: int) -> str | None:
    """Whether a choice is due at `step`: "probe" (the schedule's boundaries, the first step,
    the budget's cadence: the link is read), "read" (a form's first MIN_WINDOW steps at this input
    size: its rest read, the link as last read), or None."""
    last = self.history[-1]["step"] if self.history else None
    if last == step:
      return None
    if any(first == step for first, _ in self.plan.forms) or last is None:
      return "probe"
    if self._scheduled(step) != "measured":
      return None
    next_step = self.history[-1].get("next_step")
    if next_step is not None and step >= next_step:
      return "probe"
    window = self._window  # (a form's first window at this input size: its rest read)
    if (self.options.probe_budget and self._last is not None and window is not None
        and step - window[1] >= self.MIN_WINDOW
        and self.form_of(window[0]) not in self._read_forms):
      return "read"
    return None

  def form_of(self, level: int) -> str:
    """The form a level belongs to."""
    return "dense" if level in (self.dense_level, self.plan.steady_level) else "sparse"

  def _next(self, step: int, step_s: float) -> int | None:
    """The step of the next measurement after one at `step` (`probe_interval`; None: no more
    unless the schedule asks): at least MIN_WINDOW steps of the chosen form after the one that
    may compile it, so that the next measurement reads it. (A choice made before any step was
    read is read again sooner: as soon as the chosen form has run MIN_WINDOW steps, `_due`.)"""
    interval = probe_interval(self.probe_s, step_s, self.options.probe_budget,
                              spent_s=self.spent_s, step=step)
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
    """Opens a window at `_open_at` (the step after a measurement: the chosen form compiled)
    and restarts it where the level changes (a new level compiles in its first step)."""
    level = self.level(step)
    if self._window is not None and self._window[0] != level:
      self._window, self._open_at = None, step + 1
    if self._open_at is not None and step >= self._open_at:
      jax.block_until_ready(state)
      self._window, self._open_at = (level, step, time.perf_counter(), 0.0), None

  def _resized(self, batch: Sequence[jax.Array], step: int) -> None:
    """At a new input size (progressive resizing) the rests read at the old size are kept
    aside, the window restarts, and a read is due once the form in force has run MIN_WINDOW
    steps at the new size (`_due`; only the compute changes with the input: `moved`)."""
    before, self._shape = self._shape, _shape_of(batch)
    if before is None or before == self._shape:
      return
    self._before = dict(self._rest)  # (`_rest` stands until the first read at the new size)
    self._reads = {}
    self._read_forms = set()
    self._ran = set()
    self._compiled_before = self._compiled or self._compiled_before
    self._compiled = []
    self._window, self._open_at = None, step + 1

  def ran(self, level: int, compile_s: float | None = None) -> None:
    """The run's step ran at `level`; `compile_s`: its program's compile seconds where this is
    the program's first step at this input size (compiled now or before the run's clock)."""
    if level not in self._ran and compile_s is not None:
      self._compiled.append(compile_s)
    self._ran.add(level)

  def _switch_s(self, step: int) -> float:
    """What a switch away from the form in force at `step` would compile (`switch_s`): the
    other form's programs at this input size that have not run here (the dense form's first
    step and its steady step, or the sparse form's level), this process's estimate."""
    if self.form is None:
      return 0.0  # (the first choice: the run compiles its first form either way)
    if self.form == "sparse":
      levels = {self.dense_level, self.plan.steady_level}
    else:
      levels = {self.sparse_level(step)}
    return switch_s(len(levels - self._ran), self._compiled or self._compiled_before)

  # --- the link and the model

  def _exchange(self, link: Link, density: float | None = None) -> dict[str, float]:
    """Each form's modelled exchange on `link` (the sparse form's at `density`, by default the
    final one)."""
    return exchange_s(link, self._select_s or 0.0, algorithm=self.options.sparse, n=self.n,
                      nodes=self.nodes, local=self.local,
                      density=density or self.compression.density, wire=self.plan.wire,
                      dense_wire=self.plan.dense_wire)

  def _read(self, untimed: list[float]) -> Link:
    """The link read by the probes (the slowest process's reads, so every process decides
    alike)."""
    read, self._link, _ = probe_link(self.setup.mesh, self.shard, self._link, untimed)
    return read

  def _probe_select(self) -> None:
    """Probes the sparse form's local work, once (its compilation and calls added to
    `spent_s`): where the sparse form's own steps are read (the rest is their time less an
    exchange that holds it), or where the sparse form wins without it (the selection only adds
    to the sparse step: a choice of dense stands whatever it costs, so at a fast link it is
    never compiled)."""
    if self._select_s is not None:
      return
    t0 = time.perf_counter()
    select = probe_select(self.compression.selector, self.shard, self.k, self.nodes)
    self._select_s, wall = slowest([select, time.perf_counter() - t0])
    self.spent_s += wall

  def _decide(self, link: Link, steps_left: int, switch: float
              ) -> tuple[str, dict[str, float]]:
    """The form chosen on `link` over `steps_left` steps, a switch costing `switch` seconds, and
    each form's predicted step (`predict`; before any step was read, the exchanges alone: the
    rest is at least 0, and the first window reads it)."""
    steps = self._exchange(link)
    if self._rest:
      read = self.form if self.form in self._rest else next(iter(self._rest))
      steps = predict(self._rest, steps, read)
    chosen = choose(steps, self.factor, self.form, self.options.margin, steps_left=steps_left,
                    switch_s=switch)
    if chosen == "sparse" and self._select_s is None:  # (without its selection: probe it)
      self._probe_select()
      return self._decide(link, steps_left, switch)
    return chosen, steps

  def measure(self, step: int, state: Any, probe: bool = True) -> dict[str, Any]:
    """Reads the steps since the last measurement (the form in force's rest) and, with `probe`,
    the link (else the link of the last choice), and chooses; where the choice changes the
    form, the link is read again and the faster read kept (a token bucket lets a small probe
    through at full speed, a stall makes one slow: one read does not switch the form). Returns
    the log entry's figures."""
    observed = self._observe(step, state)
    # the steps dispatched so far finish first, window or not: they are the run's, and a probe
    # queued behind them read their time as the link's (1.3-4.2 s for 2 small all-reduces on
    # the Python docs Transformer at 50 Mbit/s, a measurement right after the warm-up's level
    # changed and restarted the window)
    jax.block_until_ready(state)
    start = time.perf_counter()
    untimed: list[float] = []
    read = self._read(untimed) if probe else self._last
    probe_s = time.perf_counter() - start - sum(untimed) if probe else self.probe_s
    how, form = ("no step read yet: the rest taken as 0" if not self._rest
                 else "no window since the last measurement: the rests read before"), None
    switch = self._switch_s(step)
    wall = time.perf_counter() - start  # (this measurement's so far: its probes' compiles too)
    if observed is not None:
      level, step_s, count = observed
      form = self.form_of(level)
      self._read_forms.add(form)
      density = 1.0 if form == "dense" else self.levels[level]
      step_s, probe_s, switch, wall = slowest([step_s, probe_s, switch, wall])
      if form == "sparse":
        self._probe_select()  # (its steps hold the selection: the rest is what is left)
      read = fit_in_steps(read, {form: step_s}, lambda at: self._exchange(at, density))
      reads = self._reads.setdefault((form, level), [])
      reads.append((step_s - self._exchange(read, density)[form], count))
      rest = rest_of(reads)  # (the windows at this level: one stalled window does not move it)
      if self._before is not None:  # the first read at a new input size
        self._rest = moved(self._before, form, rest)
        self._before = None
      else:
        self._rest[form] = rest
      how = f"observed over {count} steps" + (
          f" at density {density:.3g}" if density not in (1.0, self.compression.density) else ""
      ) + (f", its rest the median of {len(reads)} windows at this level here"
           if len(reads) > 1 else "")
    else:
      probe_s, switch, wall = slowest([probe_s, switch, wall])
    self.spent_s += wall
    link = read
    steps_left = self.total_steps - step
    chosen, steps = self._decide(link, steps_left, switch)
    if chosen != (self.form or "dense"):
      again, self._link, _ = probe_link(self.setup.mesh, self.shard, self._link, untimed)
      link = faster(read, again, 4 * self.shard)
      how += (f"; link read twice ({8e-6 * read.bytes_per_s:.3g} and "
              f"{8e-6 * again.bytes_per_s:.3g} Mbit/s), the faster kept")
      chosen, steps = self._decide(link, steps_left, switch)
    self.probe_s = probe_s
    self._last = link
    return {"form": chosen, "link": link, "measured": form,
            "measured_step_ms": None if observed is None else 1e3 * step_s,
            "how": how, "steps": steps, "switch_s": switch,
            "measure_ms": 1e3 * (time.perf_counter() - start)}

  def before_step(self, step: int, state: Any, batch: Sequence[jax.Array], writer: Any) -> None:
    """Measures and chooses where due; logs the choice; times the steps between."""
    self._resized(batch, step)
    due = self._due(step)
    if due is None:
      self._track(step, state)
      return
    entry: dict[str, Any] = {"step": step}
    resized = self._before is not None
    form = self._scheduled(step)
    if form != "measured":
      self._window = None
      entry.update(form=form, why="schedule")
    else:
      m = self.measure(step, state, probe=due == "probe")
      steps, link = m["steps"], m["link"]
      entry.update(
          form=m["form"], why="measured", link_MBps=link.bytes_per_s / 1e6,
          call_ms=1e3 * link.fixed_s,
          select_ms=None if self._select_s is None else 1e3 * self._select_s,
          measured=m["measured"], measured_step_ms=m["measured_step_ms"], how=m["how"],
          dense_step_ms=1e3 * steps["dense"], sparse_step_ms=1e3 * steps["sparse"],
          **{f"{f}_rest_ms": 1e3 * r for f, r in self._rest.items()},
          remaining_steps=self.total_steps - step, switch_ms=1e3 * m["switch_s"],
          step_factor=self.factor,
          factor_from=self.factor_from, probe_ms=1e3 * self.probe_s,
          spent_ms=1e3 * self.spent_s,
          next_step=self._next(step, steps[m["form"]]), measure_ms=m["measure_ms"])
      if resized and self._before is None:  # the first read at a new input size
        entry["input_shape"] = list(self._shape)
    self.history.append(entry)
    self._open_at = step + 1
    if self.lead:
      print(describe(entry, self.compression, self.options), flush=True)
      writer.write("auto", step, {"dense": float(entry["form"] == "dense"), **{
          k: v for k, v in entry.items()
          if isinstance(v, (int, float)) and k != "step" and v is not None}})


def describe(entry: dict[str, Any], compression: Any, options: Any) -> str:
  """One log line for a choice (`options`: the config's `auto` group)."""
  sparse = f"{options.sparse} {compression.density:g}"
  head = f"sparsejax auto: step {entry['step']}: "
  if entry["why"] != "measured":
    return head + f"{entry['form']} ({entry['why']})"
  measured = (entry["how"] if entry.get("measured") is None else
              f"{entry['measured']} step {entry['measured_step_ms']:.1f} ms ({entry['how']})")
  return head + (
      f"link {8 * entry['link_MBps']:.0f} Mbit/s + {entry['call_ms']:.2f} ms a call; "
      f"{measured}, "
      + ("selection not probed (dense wins without it)" if entry["select_ms"] is None
         else f"selection {entry['select_ms']:.1f} ms")
      + " -> step dense "
      f"{entry['dense_step_ms']:.1f} ms, {sparse} {entry['sparse_step_ms']:.1f} ms x "
      f"{entry['step_factor']:.3g} ({entry['factor_from']}) = "
      f"{entry['sparse_step_ms'] * entry['step_factor']:.1f} ms"
      + (f" over {entry['remaining_steps']} steps, a switch compiling "
         f"{entry['switch_ms'] / 1e3:.1f} s" if entry.get("switch_ms") else "")
      + f"; chose {entry['form']}; "
      f"probes {entry['probe_ms']:.0f} ms ({entry['measure_ms']:.0f} ms in all), "
      + ("no more measurements unless scheduled" if entry["next_step"] is None
         else f"next due at step {entry['next_step']}"))
