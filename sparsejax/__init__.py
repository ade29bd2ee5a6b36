"""sparsejax: top-k sparsified, hierarchical data-parallel training in JAX."""

from sparsejax import accumulate, comm, compress, flat, hlo, optim, topk
from sparsejax.accumulate import multi_steps
from sparsejax.compress import topk_allreduce
from sparsejax.flat import FlatLayout
from sparsejax.optim import fused_adamw, fused_lamb, fused_lars, fused_sgd
from sparsejax.topk import exact_topk, mstopk, sampled_topk

__version__ = "0.1.0"

__all__ = ["accumulate", "comm", "compress", "flat", "hlo", "optim", "topk", "FlatLayout",
           "topk_allreduce", "multi_steps", "mstopk", "exact_topk", "sampled_topk", "fused_sgd",
           "fused_lars", "fused_lamb", "fused_adamw"]
