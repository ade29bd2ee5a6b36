"""Metrics to CSV files and TensorBoard event files, one row per logged step."""

from __future__ import annotations

import csv
import os

from sparsejax.train.events import EventWriter

__all__ = ["MetricsWriter"]


class MetricsWriter:
  """`write(split, step, {name: value})` appends to `<workdir>/<split>.csv` and TensorBoard (a
  name not seen before adds a column: the file is rewritten with it, earlier rows empty there).

  On resume (`resume_step`), rows after that step (logged after the last checkpoint by the
  interrupted run) are dropped from the CSV files first, so each step appears once."""

  def __init__(self, workdir: str, resume_step: int = 0):
    self.workdir = workdir
    self.tb = EventWriter(os.path.join(workdir, "tensorboard"))
    self.columns: dict[str, list[str]] = {}
    for split in ("train", "eval", "auto"):
      path = self._path(split)
      if os.path.exists(path):
        with open(path, newline="") as f:
          rows = list(csv.DictReader(f))
        if rows:
          self.columns[split] = list(rows[0].keys())
        keep = [r for r in rows if int(r["step"]) <= resume_step]
        tmp = path + ".tmp"
        with open(tmp, "w", newline="") as f:
          if rows:
            w = csv.DictWriter(f, fieldnames=self.columns[split])
            w.writeheader()
            w.writerows(keep)
        os.replace(tmp, path)

  def _path(self, split: str) -> str:
    return os.path.join(self.workdir, f"{split}.csv")

  def write(self, split: str, step: int, metrics: dict[str, float]) -> None:
    row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
    path = self._path(split)
    new = split not in self.columns or not os.path.exists(path)
    if new:
      self.columns[split] = list(row)
    elif any(k not in self.columns[split] for k in row):  # (auto's rests appear after a read)
      self._widen(split, [k for k in row if k not in self.columns[split]])
    with open(path, "a", newline="") as f:
      w = csv.DictWriter(f, fieldnames=self.columns[split], extrasaction="ignore")
      if new:
        w.writeheader()
      w.writerow(row)
    self.tb.write(step, {f"{split}/{name}": value for name, value in row.items() if name != "step"})

  def _widen(self, split: str, added: list[str]) -> None:
    """Rewrites `split`'s CSV (aside, then renamed) with `added` columns after its own, empty
    in the rows written before them."""
    path = self._path(split)
    with open(path, newline="") as f:
      rows = list(csv.DictReader(f))
    self.columns[split] = [*self.columns[split], *added]
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=self.columns[split])
      w.writeheader()
      w.writerows(rows)
    os.replace(tmp, path)

  def close(self) -> None:
    self.tb.close()


class NullWriter:
  """What processes other than the first use: metrics are written once, by process 0."""

  def write(self, split: str, step: int, metrics: dict[str, float]) -> None:
    del split, step, metrics

  def close(self) -> None:
    pass
