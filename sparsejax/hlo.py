"""Reading compiled XLA programs: how many kernels a jitted function launches, and what its
collectives move."""

from __future__ import annotations

import collections
import re
from typing import Any

__all__ = ["kernel_counts", "num_kernels", "collectives", "DTYPE_BYTES"]

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


DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_COLLECTIVE = re.compile(
    r"=\s*(\([^()]*\)|\w+\[[\d,]*\][^\s]*)\s+(all-gather|all-reduce|reduce-scatter|"
    r"all-to-all|collective-permute)(?:-start)?\(.*?"
    r"replica_groups=(\{\{[\d,{} ]*\}\}|\[[^\]]*\]<=\[\d+\])")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def collectives(compiled: Any) -> list[dict[str, Any]]:
  """The collectives of a compiled program (all-gather, all-reduce, reduce-scatter,
  all-to-all, collective-permute), each as `{"op", "dtype", "elements", "bytes", "group"}`:
  its result's element type, element count and bytes (a tuple result's, as XLA:CPU gives an
  all-to-all, summed over its arrays; its dtype where they share one), and the size of its
  replica groups (0 where the text gives none)."""
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  out = []
  for m in _COLLECTIVE.finditer(text):
    shape, op, groups = m.groups()
    arrays = _ARRAY.findall(shape)
    dtypes = {dtype for dtype, _ in arrays}
    elements, nbytes = 0, 0
    for dtype, dims in arrays:
      count = 1
      for d in filter(None, dims.split(",")):
        count *= int(d)
      elements += count
      nbytes += count * DTYPE_BYTES.get(dtype, 0)
    first = re.match(r"\{\{([\d,]*)\}", groups)
    group = len(first.group(1).split(",")) if first else 0
    out.append({"op": op, "dtype": dtypes.pop() if len(dtypes) == 1 else "tuple",
                "elements": elements, "bytes": nbytes, "group": group})
  return out
