"""`auto`'s probes: what it reads from the devices and the link (each figure the slowest
process's, so that every process decides alike)."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sparsejax import topk as topk_lib
from sparsejax.train.auto.model import Link, fit_link
from sparsejax.train.mesh import WORKERS

__all__ = ["PROBE_SMALL", "PROBE_REPS", "PROBE_LARGE_S", "timed", "large_probe_size",
           "probe_link", "probe_select", "slowest"]

PROBE_SMALL = 1024  # floats per worker in the small link probe (4 KiB)
PROBE_REPS = 3
PROBE_LARGE_S = 0.02  # the largest link probe takes about this long (where the shard allows)

def timed(fn: Callable, *args: Any, reps: int = PROBE_REPS, warm: bool = True,
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


def probe_link(mesh: Any, shard: int, prior: Link | None = None,
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
    return slowest([timed(fn, jax.make_array_from_process_local_data(sharding, here),
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


def probe_select(selector: str, shard: int, k: int, nodes: int) -> float:
  """Seconds of the sparse form's local work on one device (`_select_work` on a shard)."""
  device = jax.local_devices()[0]
  rng = np.random.default_rng(0)
  x = jax.device_put(rng.standard_normal(shard).astype(np.float32), device)
  r = jax.device_put(rng.standard_normal(shard).astype(np.float32) * 0.1, device)
  return timed(_select_work(selector, k, nodes), x, r)


_GATHERED = 4  # values per `slowest` call, padded: one shape, compiled once (each new length
# compiled its own gather, 20-25 ms on the clock of a measurement)


def slowest(values: Sequence[float]) -> list[float]:
  """Each value's maximum over the processes (the same list on every process)."""
  if jax.process_count() == 1:
    return [float(v) for v in values]
  if len(values) > _GATHERED:
    raise ValueError(f"slowest takes at most {_GATHERED} values, got {len(values)}")
  from jax.experimental import multihost_utils
  padded = np.full(_GATHERED, -np.inf, np.float32)
  padded[:len(values)] = values
  gathered = multihost_utils.process_allgather(padded)
  return [float(v) for v in np.asarray(gathered).reshape(-1, _GATHERED).max(0)[:len(values)]]
