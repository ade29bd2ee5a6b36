"""`auto`'s decision model: pure functions of what the probes read (no devices, no clock).

A form's step is its rest (what the link does not change) plus its modelled exchange on the
link read now (`sparsejax.cost.exchange_time`); the sparse form's steps to the target are the
dense form's times a factor (`lag_steps`, `step_factor`, or the user's); `choose` keeps the form
in force unless the other's time to the target is shorter by more than a margin.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from sparsejax import comm, cost

__all__ = ["FORMS", "Link", "Measurement", "fit_link", "exchange_s", "predict", "rests",
           "with_run_costs", "moved", "lag_steps", "spread_matters", "step_factor", "choose",
           "probe_interval", "measuring", "faster", "fit_in_steps", "moved_window", "stale",
           "WARMUP_MOVE", "LINK_MOVED", "other_form"]

FORMS = ("dense", "sparse")
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


def moved(before: dict[str, float], form: str, rest_s: float) -> tuple[float, float]:
  """The other form's rest at a new input size (progressive resizing), `form`'s timed there as
  `rest_s`: its rest timed at the old size (`before`, both forms') moved by `form`'s change
  (the forward and backward pass is both forms' and the only part the input's size changes;
  the exchange and the selection work on the parameters). Returns (the rest, the change)."""
  change = rest_s - before[form]
  return before[other_form(form)] + change, change


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


def faster(a: Link, b: Link, size_bytes: float) -> Link:
  """Of two reads of the link, the one that moves `size_bytes` sooner: a stall on a loaded
  machine makes a probe slow, nothing makes it fast (an unlimited link read 194 Mbit/s in one
  measurement of the MNIST MLP and too fast to tell in the next)."""
  return min((a, b), key=lambda link: link.fixed_s + size_bytes / link.bytes_per_s)


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


def stale(rest_s: float, exchange_then: float, exchange_now: float, bytes_then: float,
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


def other_form(form: str) -> str:
  """The form that is not `form`."""
  return "sparse" if form == "dense" else "dense"
