"""`compression.algorithm = "auto"`: the exchange chosen on the host, by measurement.

The compressor is `auto.sparse` built with its dense form (`topk_allreduce(..., dense_level=True)`):
one state, two forms, so a switch loses nothing (a dense step sends the residual).
`AutoExchange` picks the form before a step, at the first step and again whenever the last
measurement's cost allows (`auto.probe_budget`: the measurements take at most that share of the
run's time, `probe_interval`), from what it measures then (every process the same probes, each
figure the slowest process's, so all processes choose alike):

  link     an all-reduce over the "node" axis at 4 KiB, 64 KiB and, on a fast link, at a size
           that takes about 20 ms (at most a worker's shard): a fixed cost per call and a
           bandwidth (`fit_link`);
  compute  the train step's forward and backward pass alone (`step.jit_compute_step`);
  select   the sparse form's local work on one shard at its final k: MSTopK with error feedback
           and the scatter-add of every node's pairs.

`predict` turns them into each form's step time with the library's cost model
(`sparsejax.cost.exchange_time`: the dense form's all-reduce, the sparse form's collectives at
the final density); `choose` compares the dense step with the sparse step times the step factor
(the sparse system's steps to the target over dense's: `auto.step_factor` where the user sets
it) and keeps the current form unless the other is predicted faster by more than `auto.margin`.
Not modelled: the density warm-up's higher levels (their steps cost more than the final
density's) and any overlap of the exchange with compute (the step runs them in sequence).

`auto.schedule` fixes the forms by epoch instead (no measurement): for reproducible runs, the
tests, and the fixed schedules a study compares auto with. A schedule's "measured" entries hand
the choice back to the measurements from their epoch on. `compression.dense_epochs` runs the
dense form first whatever the link (1-bit Adam's dense start: recipe "onebit_adam"), then the
schedule or the measured form. Each choice, with the figures behind it, is printed, written to
`auto.csv` and kept in the checkpoints' and summary.json's "exchange_choices".
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sparsejax import comm, cost
from sparsejax import topk as topk_lib
from sparsejax.train.mesh import WORKERS

__all__ = ["Link", "Measurement", "fit_link", "predict", "choose", "probe_interval", "scheduled",
           "measuring", "AutoExchange", "FORMS"]

FORMS = ("dense", "sparse")
PROBE_SMALL = 1024  # floats per worker in the small link probe (4 KiB)
PROBE_REPS = 3
PROBE_LARGE_S = 0.02  # the largest link probe takes about this long (where the shard allows)


class Link(NamedTuple):
  """The inter-node link as the probes saw it."""

  fixed_s: float       # seconds per collective call, whatever its size
  bytes_per_s: float   # a node's link, each direction (inf: too fast to tell from the probes)


class Measurement(NamedTuple):
  """What one measurement found (seconds)."""

  link: Link
  compute_s: float  # the step's forward and backward pass
  select_s: float   # the sparse form's local work on one shard


def fit_link(link_bytes: Sequence[float], seconds: Sequence[float]) -> Link:
  """The line `seconds = fixed_s + link_bytes / bytes_per_s` through the probes (least squares;
  a bandwidth too high to see, a flat or falling line, is inf)."""
  x, y = np.asarray(link_bytes, np.float64), np.asarray(seconds, np.float64)
  if x.shape != y.shape or x.size < 2 or np.ptp(x) == 0:
    raise ValueError(f"fit_link needs two or more probe sizes, got bytes {list(x)}, "
                     f"seconds {list(y)}")
  slope, intercept = np.polyfit(x, y, 1)
  if slope <= 0:
    return Link(float(max(y.min(), 0.0)), math.inf)
  return Link(float(max(intercept, 0.0)), float(1.0 / slope))


def _cluster(m: Measurement, nodes: int, local: int) -> cost.Cluster:
  """The cost model's cluster of a measurement: the node link as measured (its fixed cost per
  call), the links inside a node free (both forms move the same bytes there), the sparse form's
  local work as measured."""
  return cost.Cluster(nodes=nodes, local=local, inter_Bps=m.link.bytes_per_s, intra_Bps=math.inf,
                      inter_alpha_s=0.0, intra_alpha_s=0.0, call_s=m.link.fixed_s,
                      select_s=lambda n, k: m.select_s, pair_s=0.0, pass_s_per_value=0.0,
                      allreduce_pipelined=True)


def predict(m: Measurement, *, algorithm: str, n: int, density: float, nodes: int,
            local: int) -> dict[str, float]:
  """Seconds of one step in each form: {"dense": ..., "sparse": ...} (compute plus exchange,
  in sequence), for an `n`-value gradient exchanged by `algorithm` at `density`."""
  cl = _cluster(m, nodes, local)
  dense = cost.exchange_time(comm.dense_form(algorithm), n, 1.0, cl)["total"]
  sparse = cost.exchange_time(algorithm, n, density, cl)["total"]
  return {"dense": m.compute_s + dense, "sparse": m.compute_s + sparse}


def choose(step_s: dict[str, float], step_factor: float, current: str | None,
           margin: float) -> str:
  """The form with the shorter predicted time to the target (the sparse step times
  `step_factor`), the `current` one unless the other is faster by more than `margin`."""
  to_target = {"dense": step_s["dense"], "sparse": step_s["sparse"] * step_factor}
  best = min(FORMS, key=lambda f: to_target[f])
  if current is None or best == current:
    return best
  return best if to_target[best] < (1.0 - margin) * to_target[current] else current


def probe_interval(probe_s: float, step_s: float, budget: float) -> int | None:
  """Steps to the next measurement: the fewest over which a measurement's `probe_s` seconds
  stay within `budget` of the steps' time (`step_s` each); None for budget 0 (no more
  measurements). On the Transformer LM at 2 Gbit/s a measurement's timed calls took 41-62 ms:
  with a 0.12 s step and the default budget of 2%, one measurement every 17-26 steps."""
  if not budget:
    return None
  return max(1, math.ceil(probe_s / (budget * step_s)))


def scheduled(schedule: Sequence[Sequence[Any]], step: int) -> str:
  """The form `schedule` ((first_step, form), ...) gives `step` ("measured": the measured one)."""
  form = schedule[0][1]
  for first, f in schedule:
    if first <= step:
      form = f
  return form


def step_schedule(config: Any, steps_per_epoch: int) -> tuple[tuple[int, str], ...]:
  """((first_step, form), ...) of a validated config: under "auto" `auto.schedule` (epochs) in
  steps, or measured throughout; for the other algorithms "sparse" throughout; with the dense
  start (`compression.dense_epochs`) in front."""
  from sparsejax.train.optimizer import dense_steps
  steps: dict[int, str] = {}
  fixed = config.auto.schedule if config.compression.algorithm == "auto" else ((0.0, "sparse"),)
  for epoch, form in fixed or ((0.0, "measured"),):
    steps[round(epoch * steps_per_epoch)] = form  # the last of those rounded to one step
  schedule = sorted(steps.items())
  start = dense_steps(config, steps_per_epoch)
  if not start:
    return tuple(schedule)
  return ((0, "dense"), (start, scheduled(schedule, start)),
          *((s, f) for s, f in schedule if s > start))


def measuring(config: Any) -> bool:
  """Whether algorithm "auto" measures in this validated config (at all steps, or from a
  schedule's "measured" entry on); False for fixed schedules and the other algorithms."""
  return config.compression.algorithm == "auto" and (
      not config.auto.schedule or any(form == "measured" for _, form in config.auto.schedule))


# ----------------------------------------------------------------------------- the probes

def _timed(fn: Callable, *args: Any, reps: int = PROBE_REPS, warm: bool = True) -> float:
  """The median seconds of `fn(*args)` over `reps` calls, after one untimed call (compilation,
  first touches) if `warm`."""
  if warm:
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def large_probe_size(shard: int, target: float) -> int:
  """The large link probe's floats per worker: the shard divided by the smallest power of 4
  that brings it to `target` floats or below (at least 1). A few sizes a run, each compiled
  once: a size taken straight from a noisy first fit would compile a new all-reduce at nearly
  every measurement (about half a second each, on the clock)."""
  large = shard
  while large > target and large >= 4:
    large //= 4
  return large


def _probe_link(mesh: Any, shard: int, prior: Link | None = None
                ) -> tuple[Link, Link, float]:
  """Times an all-reduce over "node" of each worker's buffer at 4 KiB, 64 KiB and, where the link
  is fast enough that 64 KiB would not tell it from the fixed cost, at about the size that takes
  `PROBE_LARGE_S` (`large_probe_size`, at most the shard: the dense form's own size) by `prior`,
  the last measurement, else by a first fit of the two small probes; fits the link. Each size's
  first use is untimed (compilation). (The small probes alone overrate a shaped link: they fit
  in its token bucket's burst, and a large probe sized by them ran at the whole shard, about
  0.2 s a measurement at 500 Mbit/s.) Returns (the link, the guide for the next measurement:
  this fit where it had a large probe, else `prior`, the seconds its timed calls took: what a
  measurement costs once its sizes are compiled)."""
  nodes, local = mesh.shape["node"], mesh.shape["local"]
  if nodes == 1:
    return Link(0.0, math.inf), Link(0.0, math.inf), 0.0
  fn = _node_psum(mesh)
  sharding = jax.sharding.NamedSharding(mesh, P(WORKERS))

  def link_bytes(size: int) -> float:  # what crosses a node's link: `local` rings of 2(N-1)/N
    return local * 2 * (nodes - 1) / nodes * size * 4

  def seconds(size: int) -> float:
    here = np.ones(len(mesh.local_devices) * size, np.float32)
    first_use = (mesh, size) not in _PROBED
    _PROBED.add((mesh, size))
    return _slowest([_timed(fn, jax.make_array_from_process_local_data(sharding, here),
                            warm=first_use)])[0]

  sizes = [PROBE_SMALL, min(16 * PROBE_SMALL, max(shard, PROBE_SMALL + 1))]
  times = [seconds(size) for size in sizes]
  guide = prior if prior is not None else fit_link([link_bytes(s) for s in sizes], times)
  large = large_probe_size(shard, PROBE_LARGE_S * guide.bytes_per_s / link_bytes(1))
  if large <= 2 * sizes[-1]:
    link = fit_link([link_bytes(s) for s in sizes], times)
    return link, prior or link, PROBE_REPS * sum(times)
  sizes.append(large)
  times.append(seconds(large))
  link = fit_link([link_bytes(s) for s in sizes], times)
  return link, link, PROBE_REPS * sum(times)


_PROBED: set[tuple[Any, int]] = set()  # (mesh, floats per worker) the link probe has compiled


@functools.cache
def _node_psum(mesh: Any) -> Callable:
  """The link probe's all-reduce over "node" (compiled once per mesh and size)."""
  return jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "node"), mesh=mesh, in_specs=P(WORKERS),
                               out_specs=P(WORKERS)))


@functools.cache
def _select_work(selector: str, k: int, nodes: int) -> Callable:
  """The sparse form's local work: selection with error feedback and the scatter-add of
  `nodes` sets of k pairs (compiled once per shard size)."""
  def work(x, residual):
    values, indices, kept = topk_lib.select_feedback(selector, x, residual, k)
    total = jnp.zeros_like(x).at[jnp.tile(indices, nodes)].add(jnp.tile(values, nodes))
    return total, kept
  return jax.jit(work)


def _probe_select(selector: str, shard: int, k: int, nodes: int) -> float:
  """Seconds of the sparse form's local work on one device (`_select_work` on a shard)."""
  device = jax.local_devices()[0]
  rng = np.random.default_rng(0)
  x = jax.device_put(rng.standard_normal(shard).astype(np.float32), device)
  r = jax.device_put(rng.standard_normal(shard).astype(np.float32) * 0.1, device)
  return _timed(_select_work(selector, k, nodes), x, r)


def _slowest(values: Sequence[float]) -> list[float]:
  """Each value's maximum over the processes (the same list on every process)."""
  if jax.process_count() == 1:
    return [float(v) for v in values]
  from jax.experimental import multihost_utils
  gathered = multihost_utils.process_allgather(np.asarray(values, np.float64))
  return [float(v) for v in np.asarray(gathered).reshape(-1, len(values)).max(0)]


# ----------------------------------------------------------------------------- the controller

class AutoExchange:
  """Chooses the compressor's form before each step (see the module's docstring).

  `level(step)` is the compressor's density level of the chosen form (the sparse form's from its
  density schedule; `dense_level` for the dense form); `before_step` measures and chooses where
  due. `history` (a list it appends to; carried through checkpoints by the caller) holds every
  choice with the figures behind it."""

  def __init__(self, config: Any, setup: Any, state_like: Any, *, sparse_level: Callable,
               dense_level: int, history: list[dict[str, Any]], steps_per_epoch: int):
    from sparsejax.train import step as step_lib  # (step imports state, which needs no auto)
    c = config.compression
    self.compression, self.options = c, config.auto
    self.schedule = step_schedule(config, steps_per_epoch)
    self.setup = setup
    self.sparse_level, self.dense_level = sparse_level, dense_level
    self.history = history
    mesh = setup.mesh
    self.nodes, self.local = mesh.shape["node"], mesh.shape["local"]
    self.n = setup.layout.padded_size
    hierarchical = config.auto.sparse in comm.HIERARCHICAL_ALGORITHMS
    self.shard = self.n // self.local if hierarchical else self.n
    self.k = max(1, round(c.density * self.shard))
    self._compute = step_lib.jit_compute_step(setup, state_like)
    self._first: Measurement | None = None  # this process's first measurement
    self._link: Link | None = None  # the last fit with a large probe (sizes the next one)
    self.probe_s = 0.0  # the last link probes' timed calls, seconds (the slowest process's)
    self.lead = jax.process_index() == 0

  @property
  def form(self) -> str | None:
    """The form in force (None before the first choice)."""
    return self.history[-1]["form"] if self.history else None

  def _scheduled(self, step: int) -> str:
    """The schedule's form at `step` ("measured" where it measures)."""
    return scheduled(self.schedule, step)

  def level(self, step: int) -> int:
    """The compressor's level at `step` for the form in force."""
    form = self._scheduled(step)
    if form == "measured":
      form = self.form
    return self.dense_level if form == "dense" else self.sparse_level(step)

  def _due(self, step: int) -> bool:
    last = self.history[-1]["step"] if self.history else None
    if any(first == step for first, _ in self.schedule) or last is None:
      return last != step
    next_step = self.history[-1].get("next_step")
    return (self._scheduled(step) == "measured" and next_step is not None and last != step
            and step >= next_step)

  def _next(self, step: int, step_s: float) -> int | None:
    """The step of the next measurement after one at `step` (`probe_interval`; None: no more
    unless the schedule asks)."""
    interval = probe_interval(self.probe_s, step_s, self.options.probe_budget)
    return None if interval is None else step + interval

  def measure(self, state: Any, batch: Sequence[jax.Array]) -> Measurement:
    """The link, compute and local-work probes (each the slowest process's); after this
    process's first measurement the link alone (compute and selection do not change with it,
    and the compute pass is the dearest probe: a step's forward and backward, four times)."""
    # (the guide is the same on every process: fitted from the slowest times)
    link, self._link, self.probe_s = _probe_link(self.setup.mesh, self.shard, self._link)
    if self._first is None:
      compute, select = _slowest([
          _timed(self._compute, state, *batch),
          _probe_select(self.compression.selector, self.shard, self.k, self.nodes)])
      self._first = Measurement(link, compute, select)
    return self._first._replace(link=link)

  def before_step(self, step: int, state: Any, batch: Sequence[jax.Array], writer: Any) -> None:
    """Measures and chooses where due; logs the choice."""
    if not self._due(step):
      return
    c = self.compression
    entry: dict[str, Any] = {"step": step}
    form = self._scheduled(step)
    if form != "measured":
      entry.update(form=form, why="schedule")
    else:
      m = self.measure(state, batch)
      a = self.options
      step_s = predict(m, algorithm=a.sparse, n=self.n, density=c.density,
                       nodes=self.nodes, local=self.local)
      factor = a.step_factor or 1.0
      form = choose(step_s, factor, self.form, a.margin)
      entry.update(form=form, why="measured", link_MBps=m.link.bytes_per_s / 1e6,
                   call_ms=1e3 * m.link.fixed_s, compute_ms=1e3 * m.compute_s,
                   select_ms=1e3 * m.select_s, dense_step_ms=1e3 * step_s["dense"],
                   sparse_step_ms=1e3 * step_s["sparse"], step_factor=factor,
                   probe_ms=1e3 * self.probe_s, next_step=self._next(step, step_s[form]))
    self.history.append(entry)
    if self.lead:
      print(describe(entry, c, self.options), flush=True)
      writer.write("auto", step, {"dense": float(entry["form"] == "dense"), **{
          k: v for k, v in entry.items() if k not in ("step", "why", "form") and v is not None}})


def describe(entry: dict[str, Any], compression: Any, options: Any) -> str:
  """One log line for a choice (`options`: the config's `auto` group)."""
  sparse = f"{options.sparse} {compression.density:g}"
  source = "auto.step_factor" if options.step_factor else "not set: 1"
  head = f"sparsejax auto: step {entry['step']}: "
  if entry["why"] != "measured":
    return head + f"{entry['form']} ({entry['why']})"
  return head + (
      f"link {8 * entry['link_MBps']:.0f} Mbit/s + {entry['call_ms']:.2f} ms a call, compute "
      f"{entry['compute_ms']:.1f} ms, selection {entry['select_ms']:.1f} ms -> step dense "
      f"{entry['dense_step_ms']:.1f} ms, {sparse} {entry['sparse_step_ms']:.1f} ms x "
      f"{entry['step_factor']:g} steps ({source}) = "
      f"{entry['sparse_step_ms'] * entry['step_factor']:.1f} ms; chose {entry['form']}; "
      f"probes {entry['probe_ms']:.0f} ms, "
      + ("no more measurements unless scheduled" if entry["next_step"] is None
         else f"next due at step {entry['next_step']}"))
