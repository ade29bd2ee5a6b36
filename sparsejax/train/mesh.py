"""The device mesh: axes ("node", "local") = (slow inter-node network, fast links in a node)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

__all__ = ["AXES", "WORKERS", "make_mesh"]

AXES = ("node", "local")
WORKERS = AXES  # the batch axis is split over both mesh axes


def make_mesh(nodes: int, local: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (nodes, local) mesh over `devices` (default: all); one of the sizes may be -1 (fill)."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if nodes == -1 and local == -1:
    raise ValueError("mesh: at most one of nodes and local may be -1")
  if nodes == -1:
    nodes = n // local if local and n % local == 0 else -1
  elif local == -1:
    local = n // nodes if nodes and n % nodes == 0 else -1
  if nodes < 1 or local < 1 or nodes * local != n:
    raise ValueError(f"mesh nodes x local = {nodes} x {local} does not match the {n} devices "
                     f"available; choose sizes whose product is {n} (or -1 for one of them)")
  return Mesh(np.asarray(devices).reshape(nodes, local), AXES)
