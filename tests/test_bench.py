"""sparsejax.bench: how `pin_to_core` spreads processes over the cores, in words."""

import pytest

from sparsejax.bench import pinning


def test_processes_share_the_cores_round_robin():
  assert pinning(2, 2) == "one pinned to each core"
  assert pinning(2, 16) == "each pinned to a core of its own (2 of 16)"
  assert pinning(8, 2) == "4 pinned to each of 2 cores"
  assert pinning(5, 2) == "2 or 3 pinned to each of 2 cores"  # (cores 0 and 1: 3 and 2)
  assert pinning(200, 16) == "12 or 13 pinned to each of 16 cores"


@pytest.mark.parametrize("processes, cores", [(0, 2), (2, 0), (2.0, 2)])
def test_a_count_below_one_is_refused_by_name(processes, cores):
  with pytest.raises(ValueError, match=r"must be an integer >= 1"):
    pinning(processes, cores)
