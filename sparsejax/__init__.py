"""sparsejax: top-k sparsified, hierarchical data-parallel training in JAX."""

from sparsejax import comm, compress, flat, topk
from sparsejax.compress import topk_allreduce
from sparsejax.flat import FlatLayout
from sparsejax.topk import exact_topk, mstopk, sampled_topk

__version__ = "0.1.0"

__all__ = ["comm", "compress", "flat", "topk", "FlatLayout", "topk_allreduce", "mstopk",
           "exact_topk", "sampled_topk"]
