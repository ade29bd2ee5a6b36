"""Turning a grain `MapDataset` of batches into a prefetching iterator (threads and processes)."""

from __future__ import annotations

import grain
from absl import flags

__all__ = ["prefetch"]


def _parse_absl_flags() -> None:
  """grain's worker processes read absl flags; a library must not demand that main() parsed
  them, so mark them parsed (with their defaults) when nobody did."""
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def prefetch(ds: grain.MapDataset, *, workers: int = 0, threads: int = 8,
             buffer: int = 16) -> grain.IterDataset:
  """`ds` as an iterator that reads ahead: `threads` reader threads (in each worker) with a
  `buffer` of elements, and `workers` > 0 worker processes (grain's mp_prefetch)."""
  for name, value, low in (("workers", workers, 0), ("threads", threads, 1), ("buffer", buffer, 1)):
    if not isinstance(value, int) or value < low:
      raise ValueError(f"prefetch {name} must be an int >= {low}, got {value!r}")
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=buffer))
  if workers:
    _parse_absl_flags()
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  return it
