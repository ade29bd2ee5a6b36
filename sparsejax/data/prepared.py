"""TFDS datasets prepared once into ArrayRecord files, then read with random access (no
TensorFlow at training time): the shared steps of the ImageNet and WMT14 paths."""

from __future__ import annotations

from typing import Any

__all__ = ["build", "open_split"]


def build(name: str, data_dir: str, **download_and_prepare_kwargs: Any) -> Any:
  """Runs TFDS's builder `name` into ArrayRecord files under `data_dir` (idempotent: a prepared
  dataset is left alone). Returns the builder. Writing needs TensorFlow (the `prepare` extra)."""
  import tensorflow_datasets as tfds
  try:
    import tensorflow  # noqa: F401  - TFDS's builders need it to write
  except ModuleNotFoundError as e:
    raise ModuleNotFoundError(f"preparing {name} with TFDS needs TensorFlow: "
                              "pip install 'sparsejax[prepare]' (tensorflow-cpu)") from e
  builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
  builder.download_and_prepare(**download_and_prepare_kwargs)
  return builder


def open_split(name: str, data_dir: str, split: str, how_to_prepare: str) -> Any:
  """The builder of a prepared dataset, checked: it opens, is prepared, and has `split`.
  `how_to_prepare` is the command the error names when it is not prepared."""
  import tensorflow_datasets as tfds
  try:
    builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
  except Exception as e:  # noqa: BLE001
    raise FileNotFoundError(f"cannot open {name} under {data_dir!r}: {e}") from e
  if not builder.is_prepared():
    raise FileNotFoundError(f"{name} is not prepared under {data_dir!r}: run `{how_to_prepare}` "
                            "first")
  if split not in builder.info.splits:
    raise ValueError(f"{name} under {data_dir!r} has no split {split!r}; it has "
                     f"{sorted(builder.info.splits)}")
  return builder
