"""Reading compiled XLA programs: how many kernels a jitted function launches."""

from __future__ import annotations

import collections
import re
from typing import Any

__all__ = ["kernel_counts", "num_kernels"]

# Entry-computation instructions that launch no work of their own.
_FREE = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                   "opt-barrier", "after-all", "partition-id", "replica-id"})
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\([^=]*?\)|[\w\[\]{},:\s]+?)\s+"
                    r"([a-z][\w\-]*)\(", re.M)


def _entry(hlo_text: str) -> str:
  start = hlo_text.find("\nENTRY ")
  if start < 0:
    raise ValueError("no ENTRY computation in the HLO text")
  end = hlo_text.find("\n}", start)
  return hlo_text[start:end]


def kernel_counts(compiled: Any) -> dict[str, int]:
  """Opcode -> count of the work-launching instructions of the entry computation.

  Args:
    compiled: a `jax.stages.Compiled` (`jax.jit(f).lower(*args).compile()`) or its HLO text.
  """
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  ops = (m.group(1) for m in _INSTR.finditer(_entry(text)))
  return dict(collections.Counter(op for op in ops if op not in _FREE))


def num_kernels(compiled: Any) -> int:
  """Number of kernels (fusions, custom calls and unfused ops) the compiled program launches."""
  return sum(kernel_counts(compiled).values())
