"""`auto`'s decision model: pure functions of what the run and the probes read (no devices,
no clock).

A step of form f takes c_f + x_f: x_f its exchange on the link read now (the library's cost
model, `sparsejax.cost.exchange_time`, in the run's wire format, `Plan.wire` and the dense
form's `Plan.dense_wire`, with the sparse form's selection as probed), c_f the rest
(the forward and backward pass, the update, the host's part), read from the run's own steps of
that form as their time less their modelled exchange, or, for a form not yet run, the other
form's rest (both run the same pass and update). The sparse form needs F times dense's steps
to the target; F is not readable from the run before both forms have reached it, so auto takes
it at a quantile of the factors measured on the study's tasks (`STEP_FACTORS`, `step_factor`).
Over the steps left, dense costs s_dense a step and sparse F s_sparse; the form in force is kept
unless the other saves more than a margin of its time and, beyond it, what the switch costs: the
other form's compilation where it has not run at this input size, taken at what the run's own
programs took to compile there (`choose`). Before any step is read, c is
unknown but at least 0, and sparse's F (c + x_sparse) beats dense's c + x_dense for some c >= 0
only where x_dense > F x_sparse: the first choice weighs the exchanges alone, and the first
window (a few steps later) reads c and corrects it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from sparsejax import comm, cost

__all__ = ["FORMS", "STEP_FACTORS", "Link", "fit_link", "exchange_s", "predict",
           "moved", "rest_of", "step_factor", "lag_steps", "choose", "switch_s",
           "probe_interval", "measuring", "faster", "fit_in_steps", "other_form"]

FORMS = ("dense", "sparse")


class Link(NamedTuple):
  """The inter-node link as the probes saw it."""

  fixed_s: float       # seconds per collective call, whatever its size
  bytes_per_s: float   # a node's link, each direction (inf: too fast to tell from the probes)


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


def _cluster(link: Link, select_s: float, nodes: int, local: int) -> cost.Cluster:
  """The cost model's cluster of a link read: the node link as read (its fixed cost per call),
  the links inside a node free (both forms move the same bytes there), the sparse form's local
  work as probed."""
  return cost.Cluster(nodes=nodes, local=local, inter_Bps=link.bytes_per_s, intra_Bps=math.inf,
                      inter_alpha_s=0.0, intra_alpha_s=0.0, call_s=link.fixed_s,
                      select_s=lambda n, k: select_s, pair_s=0.0, pass_s_per_value=0.0,
                      allreduce_pipelined=True)


def exchange_s(link: Link, select_s: float, *, algorithm: str, n: int, density: float,
               nodes: int, local: int, wire: str = "pairs8",
               dense_wire: str | None = None) -> dict[str, float]:
  """The modelled seconds of each form's exchange on `link` (the sparse form's at `density`
  in `wire`, its local work `select_s` included; the dense form's in `dense_wire`, by default
  `wire`: what its steady steps send, `Plan.dense_wire`): {"dense": ..., "sparse": ...}."""
  cl = _cluster(link, select_s, nodes, local)
  dense = comm.dense_form(algorithm)
  return {"dense": cost.exchange_time(dense, n, 1.0, cl, dense_wire or wire)["total"],
          "sparse": cost.exchange_time(algorithm, n, density, cl, wire)["total"]}


def predict(rest: dict[str, float], exchange: dict[str, float], observed: str
            ) -> dict[str, float]:
  """Seconds of one step in each form: its rest (`rest[f]`, the step less its modelled
  exchange, read from the run; for a form not yet read, the `observed` form's; at least 0)
  plus its modelled exchange on the link read now."""
  return {f: max(rest.get(f, rest[observed]), 0.0) + exchange[f] for f in FORMS}


def moved(before: dict[str, float], form: str, rest_s: float) -> dict[str, float]:
  """Each form's rest at a new input size (progressive resizing), `form`'s read there as
  `rest_s`: the other's rest at the old size (`before`) moved by `form`'s change (the forward
  and backward pass is both forms' and the only part the input's size changes; the exchange and
  the selection work on the parameters); a form not read at the old size gets `form`'s."""
  change = rest_s - before.get(form, rest_s)
  return {f: rest_s if f == form or f not in before else before[f] + change for f in FORMS}


def rest_of(reads: Sequence[tuple[float, int]]) -> float:
  """A form's rest at this input size from every window of its steps read there, each (its
  rest in seconds, its steps): their median weighted by steps (the lower one), so that one
  window the machine stalled in (3 steps read 2x their neighbours on this shared machine) does
  not move the prediction, and a long window counts for its steps."""
  if not reads:
    raise ValueError("rest_of needs at least one window (rest seconds, steps), got none")
  if any(n < 1 for _, n in reads):
    raise ValueError(f"each window holds at least 1 step, got {list(reads)}")
  total, acc = sum(n for _, n in reads), 0
  for rest, n in sorted(reads):
    acc += n
    if 2 * acc >= total:
      return rest
  raise AssertionError("unreachable")


# The sparse form's steps to the target over sparsejax dense's (F), per seed, as measured: every
# fixed sparse system of the time-to-accuracy study's own three tasks (the Fashion-MNIST MLP,
# the ResNet-20, the KJV Transformer) that reached the target on every seed, against the dense
# run of the same result file (studies/time_to_accuracy/factors.py computes it from the committed
# results; tests/test_committed_results.py holds the two equal). The held-out tasks are not in it.
STEP_FACTORS = (0.75, 0.75, 0.8, 0.8, 0.8333, 0.9, 0.9167, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
                1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0909, 1.0909,
                1.0909, 1.0909, 1.1667, 1.1667, 1.2222, 1.2222, 1.2222, 1.25, 1.4545, 1.5413,
                1.6514)


def step_factor(quantile: float, factors: Sequence[float] = STEP_FACTORS) -> float:
  """The sparse form's steps factor auto assumes: the `quantile` of the measured `factors`
  (linear between them; 0.5: their median, 1: the largest). The run cannot read its own factor
  before both forms have reached the target; the lag model (a value's wait for its turn in the
  top k, `lag_steps`) sets no useful bound on it: it allows at most 1.02-1.11 on the study's
  systems at densities of 0.01-0.05, where they measured 0.75-1.65 (docs/auto.md)."""
  if not 0 <= quantile <= 1:
    raise ValueError(f"step_factor: quantile {quantile} is not in [0, 1]")
  return float(np.quantile(np.asarray(factors, np.float64), quantile))


def lag_steps(spread: float, density: float) -> float:
  """Steps the sparse form's model lags the dense one's under error feedback: a gradient of
  constant values g_i, k of n sent a step, sends value i every |g|_1 / (k |g_i|) steps; weighted
  by the values' share of the squared norm, the wait is |g|_1^2 / (2 k |g|_2^2) = spread /
  (2 density) steps (at most 1 / (2 density), a flat gradient). Kept as the screen's reference
  (docs/auto.md): its factor (remaining + lag) / remaining does not follow the measured one."""
  if not 0 < density <= 1:
    raise ValueError(f"lag_steps: density {density} is not in (0, 1]")
  return 0.0 if density == 1 else spread / (2 * density)


def choose(step_s: dict[str, float], step_factor: float, current: str | None,
           margin: float, *, steps_left: int = 1, switch_s: float = 0.0) -> str:
  """The form with the shorter predicted time to the target (the sparse step times
  `step_factor`: `step_factor(quantile)`, or the user's `auto.step_factor`), the `current` one
  (before the first choice: dense) unless the other saves more than `margin` of the current
  form's time over the `steps_left` steps and, beyond that, the `switch_s` seconds a switch
  costs (the other form's compilation where it has not run at this input size)."""
  to_target = {"dense": step_s["dense"], "sparse": step_s["sparse"] * step_factor}
  best = min(FORMS, key=lambda f: to_target[f])
  current = current or "dense"  # (a close call at the start: the form that costs no steps)
  if best == current:
    return best
  saved = ((1.0 - margin) * to_target[current] - to_target[best]) * steps_left
  return best if saved > switch_s else current


def switch_s(programs: int, compiled_s: Sequence[float]) -> float:
  """Seconds a switch costs in compilation: `programs` the other form would compile at this
  input size, each taken at the median of what the run's programs took to compile there
  (`compiled_s`; the two forms run the same pass and update, and their exchanges differ little
  in what they compile: each run's `programs` in studies/auto/results)."""
  if programs <= 0 or not len(compiled_s):
    return 0.0
  return programs * float(np.median(np.asarray(compiled_s, np.float64)))


def probe_interval(probe_s: float, step_s: float, budget: float, *, spent_s: float = 0.0,
                   step: int = 0) -> int | None:
  """Steps to the next measurement: the fewest over which a measurement's `probe_s` seconds
  stay within `budget` of the steps' time (`step_s` each), and no fewer than keep every
  measurement so far (`spent_s`, wall seconds, their compilations included) and the next one
  within `budget` of the run's time by then (`step` steps of `step_s` so far). None for budget
  0 (no more measurements). On the Transformer LM at 2 Gbit/s a measurement's timed calls took
  41-62 ms: with a 0.12 s step and the default budget of 2%, one measurement every 17-26 steps;
  the first measurement's compilations (0.4-0.6 s there) put off the next ones until the run
  has paid them back."""
  if not budget:
    return None
  each = math.ceil(probe_s / (budget * step_s))
  ledger = math.ceil((spent_s + probe_s) / (budget * step_s) - step)
  return max(1, each, ledger)


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


def other_form(form: str) -> str:
  """The form that is not `form`."""
  return "sparse" if form == "dense" else "dense"
