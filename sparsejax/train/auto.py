"""`compression.algorithm = "auto"`: the exchange chosen on the host, by measurement.

The compressor is `auto.sparse` built with its dense form (`density_schedule(...,
dense_form=True)`): one state, two forms, so a switch loses nothing (a dense step sends the
residual).
`AutoExchange` picks the form before a step, at the first step and again whenever the last
measurement's cost allows (`auto.probe_budget`: the measurements take at most that share of the
run's time, `probe_interval`). No figure comes from the user or from another task: each
measurement reads, from the run itself (every process the same probes, each figure the slowest
process's, so all processes choose alike):

  the step  the whole train step of a form, as the run takes it: at the first measurement
            both forms' compiled steps timed on a copy of the state; later the form in force,
            observed over the steps since the last measurement (evaluations and checkpoints
            left out; a window restarts where the level changes); at a new input size
            (progressive resizing) the form in force timed there and the other's step moved
            by the same change (only the forward and backward pass depends on the input);
  link      an all-reduce over the "node" axis at 4 KiB, 64 KiB and, on a fast link, at a size
            that takes about 20 ms (at most a worker's shard): a fixed cost per call and a
            bandwidth (`fit_link`);
  gradient  one forward and backward pass for the spread of each node's gradient,
            ||g||_1^2 / (n ||g||_2^2) (1 for a flat gradient, 1/n for a single value),
            averaged over the nodes; only where the lag could raise the sparse form's factor
            above `auto.min_step_factor` (`spread_matters`), else not run;
  select    the sparse form's local work on one shard at its final k: MSTopK with error feedback
            and the scatter-add of every node's pairs.

`predict` moves each form's step to the link measured now with the library's cost model
(`sparsejax.cost.exchange_time`): the form's step when last measured less its modelled exchange
then, plus its modelled exchange now; the form just measured as measured. `choose` then weighs
the forms' time over the rest of the run:
error feedback sends each value late, so the sparse form's model lags the dense one's by about
`lag_steps` = spread / (2 density) steps (a value whose share of the gradient's L1 norm is s
waits about 1 / (2 k s) steps for its turn in the top k); the sparse form costs (remaining steps
+ lag) x its step against remaining x the dense step, and the form in force is kept unless the
other is faster by more than `auto.margin`. Where the user knows the sparse form's steps to the
target over dense's, `auto.step_factor` replaces the lag. Not modelled: the density warm-up's
higher levels (their steps cost more than the final density's) and any overlap of the exchange
with compute (the step runs them in sequence).

`auto.schedule` fixes the forms by epoch instead (no measurement): for reproducible runs, the
tests, and the fixed schedules a study compares auto with. A schedule's "measured" entries hand
the choice back to the measurements from their epoch on. `compression.dense_epochs` runs the
dense form first whatever the link (1-bit Adam's dense start: recipe "onebit_adam"), then the
schedule or the measured form. Each choice, with the figures behind it (`describe`), is printed,
written to `auto.csv` and kept in the checkpoints' and summary.json's "exchange_choices".
"""

from __future__ import annotations

import contextlib
import functools
import math
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

__all__ = ["Link", "Measurement", "fit_link", "exchange_s", "predict", "rests", "with_run_costs",
           "fit_in_steps", "faster", "moved_window",
           "lag_steps", "spread_matters", "step_factor", "choose", "probe_interval",
           "measuring", "AutoExchange", "FORMS"]

FORMS = ("dense", "sparse")
PROBE_SMALL = 1024  # floats per worker in the small link probe (4 KiB)
PROBE_REPS = 3
PROBE_LARGE_S = 0.02  # the largest link probe takes about this long (where the shard allows)
WARMUP_MOVE = 0.1  # a warm-up level's window is moved to the final density only where the
# model's move is at most this share of its step (`moved_window`)


class Link(NamedTuple):
  """The inter-node link as the probes saw it."""

  fixed_s: float       # seconds per collective call, whatever its size
  bytes_per_s: float   # a node's link, each direction (inf: too fast to tell from the probes)


class Measurement(NamedTuple):
  """What one measurement found (seconds)."""

  link: Link
  form: str         # the form whose whole step was measured
  step_s: float     # its step
  select_s: float   # the sparse form's local work on one shard
  spread: float | None  # ||g||_1^2 / (n ||g||_2^2) of a node's gradient (mean over nodes),
  # (0, 1]; None: not measured (it could not change the choice: `spread_matters`)
  how: str = "timed"  # how the step was measured: "timed" here, or "observed over N steps"


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


def exchange_s(m: Measurement, *, algorithm: str, n: int, density: float, nodes: int,
               local: int) -> dict[str, float]:
  """The modelled seconds of each form's exchange (the sparse form's local work included) on
  the measured link: {"dense": ..., "sparse": ...}."""
  cl = _cluster(m, nodes, local)
  return {"dense": cost.exchange_time(comm.dense_form(algorithm), n, 1.0, cl)["total"],
          "sparse": cost.exchange_time(algorithm, n, density, cl)["total"]}


def predict(m: Measurement, *, algorithm: str, n: int, density: float, nodes: int,
            local: int, rest: dict[str, float] | None = None) -> dict[str, float]:
  """Seconds of one step in each form. The measured form's as measured; the other's its `rest`
  (its step less its modelled exchange, from the last time it was measured; by default the
  measured form's, at least 0) plus its modelled exchange on the link measured now. (No compute
  probe as a floor: over processes its scalar all-reduce waits for the slowest, and on 2
  emulated nodes it read 27-52 ms against whole dense steps of 24-25 ms.)"""
  exchange = exchange_s(m, algorithm=algorithm, n=n, density=density, nodes=nodes, local=local)
  rest = {**(rest or {}), m.form: m.step_s - exchange[m.form]}
  return {f: m.step_s if f == m.form else max(rest.get(f, rest[m.form]), 0.0) + exchange[f]
          for f in FORMS}


def rests(m: Measurement, *, algorithm: str, n: int, density: float, nodes: int,
          local: int, steps: dict[str, float]) -> dict[str, float]:
  """Each form's step in `steps` (measured on the link of `m`) less its modelled exchange
  there: the part of the step the link does not change (`predict`'s `rest`)."""
  exchange = exchange_s(m, algorithm=algorithm, n=n, density=density, nodes=nodes, local=local)
  return {f: s - exchange[f] for f, s in steps.items()}


def with_run_costs(observed: dict[str, float], form: str, timed: dict[str, float],
                   seen: set[str]) -> dict[str, float]:
  """`observed` (`form`'s rest as the run took it) with the rest of each form not yet `seen` in
  the run: its rest `timed` on a copy of the state plus what the run added to `form`'s (its
  observed rest less its timed one, at least 0). A step timed alone misses what the run adds to
  each step (the host's batch, the loop): on the MNIST MLP at an unlimited link dense timed 20
  ms and ran 26, sparse 16 and 19."""
  # (never less: with a link misread at the observation, a negative addition carried the
  # error to the other form)
  added = max(observed[form] - timed.get(form, observed[form]), 0.0)
  return {**observed, **{f: r + added for f, r in timed.items() if f not in seen}}


def _moved(before: dict[str, float], form: str, rest_s: float) -> tuple[float, float]:
  """The other form's rest at a new input size (progressive resizing), `form`'s timed there as
  `rest_s`: its rest timed at the old size (`before`, both forms') moved by `form`'s change
  (the forward and backward pass is both forms' and the only part the input's size changes;
  the exchange and the selection work on the parameters). Returns (the rest, the change)."""
  change = rest_s - before[form]
  return before[_other(form)] + change, change


def lag_steps(spread: float, density: float) -> float:
  """Steps the sparse form's model lags the dense one's under error feedback: a gradient of
  constant values g_i, k of n sent a step, sends value i every |g|_1 / (k |g_i|) steps; weighted
  by the values' share of the squared norm, the wait is |g|_1^2 / (2 k |g|_2^2) = spread /
  (2 density) steps (about 1 / (pi density) for a Gaussian gradient, less the more the gradient's
  mass sits in few values)."""
  if not 0 < density <= 1:
    raise ValueError(f"lag_steps: density {density} is not in (0, 1]")
  return 0.0 if density == 1 else spread / (2 * density)


def spread_matters(density: float, remaining: int, min_factor: float) -> bool:
  """Whether the gradient's spread can raise the sparse form's factor over `remaining` steps
  above `min_factor`: the lag is at most 1 / (2 density) steps (a flat gradient, spread 1), so
  where even that lag's `step_factor` is at most `min_factor` the factor is `min_factor`
  whatever the spread, and the gradient pass that measures it (a forward and backward pass,
  compiled again at each new input size) is not run. On the CNN task (density 0.01, 468 steps)
  the bound is 1.11 at the start: never measured there."""
  return step_factor(lag_steps(1.0, density), remaining) > min_factor


def step_factor(lag: float, remaining: int) -> float:
  """The sparse form's steps over the dense form's for the `remaining` steps of a run when it
  lags `lag` steps: (remaining + lag) / remaining."""
  return (max(remaining, 1) + lag) / max(remaining, 1)


def choose(step_s: dict[str, float], step_factor: float, current: str | None,
           margin: float) -> str:
  """The form with the shorter predicted time to the target (the sparse step times
  `step_factor`: `step_factor(lag, remaining)`, or the user's `auto.step_factor`), the `current`
  one (before the first choice: dense) unless the other is faster by more than `margin`."""
  to_target = {"dense": step_s["dense"], "sparse": step_s["sparse"] * step_factor}
  best = min(FORMS, key=lambda f: to_target[f])
  current = current or "dense"  # (a close call at the start: the form that costs no steps)
  if best == current:
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


def measuring(plan: Any) -> bool:
  """Whether algorithm "auto" measures in a run of this plan (at all steps, or from a
  schedule's "measured" entry on); False for fixed forms and the other algorithms."""
  return any(form == "measured" for _, form in plan.forms)


# ----------------------------------------------------------------------------- the probes

def _timed(fn: Callable, *args: Any, reps: int = PROBE_REPS, warm: bool = True,
           untimed: list[float] | None = None) -> float:
  """The fewest seconds of `fn(*args)` over `reps` calls (interference on a shared machine only
  adds time), after one untimed call (compilation, first touches) if `warm`, its seconds
  appended to `untimed` where given."""
  if warm:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    if untimed is not None:
      untimed.append(time.perf_counter() - t0)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return min(times)


def large_probe_size(shard: int, target: float) -> int:
  """The large link probe's floats per worker: the shard divided by the smallest power of 4
  that brings it to `target` floats or below (at least 1). A few sizes a run, each compiled
  once: a size taken straight from a noisy first fit would compile a new all-reduce at nearly
  every measurement (about half a second each, on the clock)."""
  large = shard
  while large > target and large >= 4:
    large //= 4
  return large


def _probe_link(mesh: Any, shard: int, prior: Link | None = None,
                untimed: list[float] | None = None) -> tuple[Link, Link, float]:
  """Times an all-reduce over "node" of each worker's buffer at 4 KiB, 64 KiB and, where the link
  is fast enough that 64 KiB would not tell it from the fixed cost, at about the size that takes
  `PROBE_LARGE_S` (`large_probe_size`, at most the shard: the dense form's own size) by `prior`,
  the last measurement, else by a first fit of the two small probes; fits the link. Each size's
  first use is untimed (compilation). (The small probes alone overrate a shaped link: they fit
  in its token bucket's burst, and a large probe sized by them ran at the whole shard, about
  0.2 s a measurement at 500 Mbit/s.) Returns (the link, the guide for the next measurement:
  this fit where it had a large probe, else `prior`, the seconds its timed calls took: what a
  measurement costs once its sizes are compiled; each size's first call appended to
  `untimed`)."""
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
                            warm=first_use, untimed=untimed)])[0]

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


_GATHERED = 4  # values per `_slowest` call, padded: one shape, compiled once (each new length
# compiled its own gather, 20-25 ms on the clock of a measurement)


def _slowest(values: Sequence[float]) -> list[float]:
  """Each value's maximum over the processes (the same list on every process)."""
  if jax.process_count() == 1:
    return [float(v) for v in values]
  if len(values) > _GATHERED:
    raise ValueError(f"_slowest takes at most {_GATHERED} values, got {len(values)}")
  from jax.experimental import multihost_utils
  padded = np.full(_GATHERED, -np.inf, np.float32)
  padded[:len(values)] = values
  gathered = multihost_utils.process_allgather(padded)
  return [float(v) for v in np.asarray(gathered).reshape(-1, _GATHERED).max(0)[:len(values)]]


def faster(a: Link, b: Link, size_bytes: float) -> Link:
  """Of two reads of the link, the one that moves `size_bytes` sooner: a stall on a loaded
  machine makes a probe slow, nothing makes it fast (an unlimited link read 194 Mbit/s in one
  measurement of the MNIST MLP and too fast to tell in the next)."""
  return min((a, b), key=lambda link: link.fixed_s + size_bytes / link.bytes_per_s)


# ----------------------------------------------------------------------------- the controller

def fit_in_steps(link: Link, steps: dict[str, float],
                 exchange: Callable[[Link], dict[str, float]]) -> Link:
  """`link`, its bandwidth raised where needed so that each form's modelled exchange
  (`exchange(link)`) fits in its whole step in `steps`: a step holds its exchange, so one
  shorter than the exchange on the probes' link shows that the probes read the link slow (a
  stall on a loaded machine: an in-process link read at 2 Mbit/s beside a dense step of 1.5
  ms, which made auto start sparse). The step's rest is then 0, not negative. A step shorter
  than the exchange's part that no bandwidth changes (the calls' fixed cost, the selection) says
  nothing of the link and is left out."""
  fastest = link._replace(bytes_per_s=math.inf)
  for _ in range(4):  # (the exchange is about linear in 1 / bandwidth: a few rounds settle it)
    now, floor = exchange(link), exchange(fastest)
    over = [(now[f] - floor[f]) / (s - floor[f])
            for f, s in steps.items() if now[f] > s * (1 + 1e-9) and s > floor[f]]
    if not over or math.isinf(link.bytes_per_s):
      return link
    link = link._replace(bytes_per_s=link.bytes_per_s * max(over))
  return link


def moved_window(step_s: float, move_s: float) -> float | None:
  """A sparse step observed at a density warm-up level moved to the final density by the
  model's change of its exchange (`move_s`, negative to a lower density), or None where the
  move is over WARMUP_MOVE of the step: the window then rests on the model more than on the
  run, and the sparse form is timed at its final density instead. The model leaves out part
  of what a higher density costs (the selection's and scatter's work at its k, the all-gather's
  two directions not overlapping fully): on the KJV Transformer at 50 Mbit/s windows at density
  0.2 moved to 0.05 read 260-330 ms a step where the run's steps at 0.05 then took 180-190 (a
  move of 160 ms modelled, 240-300 in the run), the step timed at 0.05 on a copy 189."""
  return None if abs(move_s) > WARMUP_MOVE * step_s else step_s + move_s


LINK_MOVED = 2.0  # a rest taken at a link this many times faster or slower than now is stale ...


def _stale(rest_s: float, exchange_then: float, exchange_now: float, bytes_then: float,
           bytes_now: float) -> bool:
  """Whether a form's rest (its step less the modelled exchange at the link it was taken at)
  should be taken again at this link: the link moved by more than LINK_MOVED either way and
  the form's modelled exchange by more than its rest. The model's error at the link the rest
  was taken at stays in the rest: the quickstart ResNet-20's dense step timed at 20 Mbit/s
  (about 0.5 s) left a rest of 130 ms in one CI run, where its step at the lifted link took
  18-22 ms.
  (Not where only the link's read moves: an unlimited link reads inf or 14 Gbit/s, and a
  slow link's reads move by a fifth, where timing the dense form again would cost seconds.)"""
  ratio = (math.inf if math.isinf(bytes_then) != math.isinf(bytes_now)
           else 1.0 if bytes_then == bytes_now
           else max(bytes_then, bytes_now) / min(bytes_then, bytes_now))
  return ratio > LINK_MOVED and abs(exchange_now - exchange_then) > rest_s


def _other(form: str) -> str:
  return "sparse" if form == "dense" else "dense"


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
    _, self._link, _ = _probe_link(self.setup.mesh, self.shard, None)  # (sizes the next one)
    self._select_s, = _slowest([_probe_select(self.compression.selector, self.shard, self.k,
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
    """Whether `form`'s rest was taken at a link far from `link` (`_stale`)."""
    if form not in self._rest:
      return False
    then = self._rest_link[form]
    return _stale(self._rest[form], self._exchange(then)[form], self._exchange(link)[form],
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
    step_s, self.probe_s = _slowest([step_s, probe_s])
    ran = self.levels[level] if form == "sparse" else 1.0
    link = self._fit(link, {form: step_s}, ran)
    if form == "sparse" and ran != self.compression.density:  # a warm-up level: to the final
      step_s = moved_window(step_s, self._exchange(link)["sparse"]
                            - self._exchange(link, ran)["sparse"])
      if step_s is None:
        return None
      how += f" at density {ran:.3g}"
    steps = {form: step_s}
    if self._stale(other := _other(form), link):  # the other form timed again at this link
      if self._far(other, link, step_s, step):
        how += f"; {other} not timed again (the link moved far off)"
      else:
        steps[other], = _slowest([self._time_step(self._level_of(other, step), state, batch)])
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
    again, self._link, _ = _probe_link(self.setup.mesh, self.shard, self._link, self._untimed)
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
    step_s, = _slowest([self._time_step(self._level_of(form, step), state, batch)])
    steps, other = {form: step_s}, _other(form)
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
    values = _slowest([*steps.values(), probe_s])
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
    read, self._link, _ = _probe_link(self.setup.mesh, self.shard, self._link, self._untimed)
    self._reread = ""
    # read again before timing a form where a form's rest was taken at a link far from this
    # read (at the first measurement only where the read would leave the dense form unrun:
    # `_timed_steps`)
    if any(self._stale(form, read) for form in self._rest):
      read = self._read_again(read)
    if self._select_s is None:  # one untimed call of each (compilation), then the fewest
      t0 = time.perf_counter()
      self._select_s, = _slowest([_probe_select(self.compression.selector, self.shard, self.k,
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
    other = _other(form)
    now = {f: s - self._exchange(link)[f] for f, s in steps.items()}  # (`rests`)
    self._rest_link.update(dict.fromkeys(now, link))
    if self._resized_from is not None:  # the first measurement at a new input size
      if observed is None and len(now) == 1 and set(self._resized_from) == set(FORMS):
        now[other], moved = _moved(self._resized_from, form, now[form])
        how += f"; {other} moved by {1e3 * moved:+.1f} ms (the new input size)"
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
        self._timed[_other(form)] = now[_other(form)]
        self._seen.discard(_other(form))
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
    other = _other(chosen)
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
    and the other form's rest moved by the same difference (`_moved`); what the run added to
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
