"""Datasets and input pipelines: small in-memory sets, grain sources, and the tiered cache.

`TieredCache` (memory, local disk, remote) and `RemoteSource` wrap any random-access source in
grain's protocol; see `sparsejax.data.cache`.
"""

from sparsejax.data import records
from sparsejax.data.cache import RemoteSource, TieredCache
from sparsejax.data.inputs import Inputs, open_inputs
from sparsejax.data.small import ArrayDataset, EpochBatcher, digits, eval_batches, load, resize

__all__ = ["ArrayDataset", "EpochBatcher", "Inputs", "RemoteSource", "TieredCache", "digits",
           "open_inputs", "records",
           "eval_batches", "load", "resize"]
