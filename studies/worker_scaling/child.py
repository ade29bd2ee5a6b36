"""A study script's measurement at P workers in a process of its own with P CPU devices (a mesh
takes every device there is, so each worker count runs in its own process)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from typing import Any

from sparsejax.bench import python_module


def in_child(script: str, argv: list[str], workers: int, key: str) -> list[Any]:
  """Runs `python -m <script's module> *argv --out <tmp>` with
  `SPARSEJAX_MAX_WORKERS=workers` (the script sets XLA's device count from it; an inherited
  XLA_FLAGS is dropped) and returns `key` of the JSON it wrote."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "out.json")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run([*python_module(script), *argv, "--out", out], check=True,
                   env={**env, "SPARSEJAX_MAX_WORKERS": str(workers)})
    with open(out) as f:
      return json.load(f)[key]
