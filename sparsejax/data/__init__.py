"""Datasets and batching. This floor holds the small in-memory sets the quickstart needs; the grain
pipeline with the tiered cache and ImageNet follows."""

from sparsejax.data.small import ArrayDataset, EpochBatcher, digits, eval_batches, load, resize

__all__ = ["ArrayDataset", "EpochBatcher", "digits", "eval_batches", "load", "resize"]
