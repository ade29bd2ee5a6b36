"""Writing a benchmark's results: JSON (every measurement) and a markdown table beside it,
each written to a temporary name and renamed, so an interrupted run never leaves half a file."""

from __future__ import annotations

import json
import os
from typing import Any


def write_atomic(path: str, text: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def write_results(json_path: str, payload: dict[str, Any], table: str) -> str:
  """Writes `payload` to `json_path` and `table` to the same name with .md; returns the .md path."""
  write_atomic(json_path, json.dumps(payload, indent=1))
  md = os.path.splitext(json_path)[0] + ".md"
  write_atomic(md, table + "\n")
  return md
