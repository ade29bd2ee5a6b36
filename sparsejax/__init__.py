"""sparsejax: top-k sparsified, hierarchical data-parallel training in JAX.

`sparsejax.data`, `sparsejax.models` and `sparsejax.train` load on first use (so `import
sparsejax` does not import grain, TFDS or flax).
"""

import importlib

from sparsejax import accumulate, comm, compress, cost, feedback, finite, flat, hlo, optim, topk
from sparsejax.accumulate import multi_steps
from sparsejax.compress import dense_mean, hierarchical_mean, topk_allreduce
from sparsejax.feedback import AdamCorrection, MomentumCorrection
from sparsejax.finite import apply_if_finite_across
from sparsejax.flat import FlatLayout
from sparsejax.optim import fused_adamw, fused_lamb, fused_lars, fused_sgd
from sparsejax.topk import exact_topk, mstopk, sampled_topk

__version__ = "0.1.0"

__all__ = ["accumulate", "comm", "compress", "cost", "feedback", "finite", "flat", "hlo", "optim",
           "topk",
           "FlatLayout", "topk_allreduce", "MomentumCorrection", "AdamCorrection", "dense_mean",
           "hierarchical_mean",
           "apply_if_finite_across", "multi_steps", "mstopk",
           "exact_topk", "sampled_topk", "fused_sgd", "fused_lars", "fused_lamb", "fused_adamw"]

_LAZY = ("data", "models", "train")


def __getattr__(name: str):
  """`sparsejax.data` (and models, train) imported on first access."""
  if name in _LAZY:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted([*globals(), *_LAZY])
