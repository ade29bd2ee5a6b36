"""Writing a benchmark's results: JSON (every measurement) and a markdown table beside it,
each written to a temporary name and renamed, so an interrupted run never leaves half a file.

A committed result must be rerunnable on any machine: `command_line` records the command with
paths inside the checkout relative to its root and other absolute paths as placeholders
(`--lock $LOCK`), and `portable_path` / `resolve` store and read paths relative to the root."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def portable_path(path: str) -> str:
  """`path` relative to the checkout's root where it lies inside it, else as given."""
  full = os.path.abspath(path)
  if full == ROOT or full.startswith(ROOT + os.sep):
    return os.path.relpath(full, ROOT)
  return path


def resolve(path: str) -> str:
  """A stored path as a file of this checkout: a relative path is relative to its root."""
  return path if os.path.isabs(path) else os.path.join(ROOT, path)


def _portable_arg(arg: str, option: str | None) -> str:
  if "=" in arg and arg.startswith("--"):
    key, value = arg.split("=", 1)
    return f"{key}={_portable_arg(value, key)}"
  if not os.path.isabs(arg):
    return arg
  inside = portable_path(arg)
  if inside != arg:
    return inside
  name = (option or "--path").lstrip("-").replace("-", "_").upper()
  return f"${name}"


def command_line(script: str, argv: Sequence[str]) -> str:
  """`python <script> <argv>` as a user reruns it from the checkout's root: paths inside the
  checkout relative to it, any other absolute path a placeholder named after its option
  (an --out outside the checkout is written `--out $OUT`)."""
  words, option = ["python", portable_path(script)], None
  for arg in argv:
    words.append(_portable_arg(arg, option))
    option = arg if arg.startswith("--") and "=" not in arg else None
  return " ".join(words)


def spread(values, digits: int = 2, scale: float = 1.0) -> str:
  """`min / median / max` of the values that are not None (times `scale`), one value alone,
  "-" for none: how every table here gives figures over separate runs."""
  import statistics
  vals = sorted(v * scale for v in values if v is not None)
  if not vals:
    return "-"
  if len(vals) == 1:
    return f"{vals[0]:.{digits}f}"
  return f"{vals[0]:.{digits}f} / {statistics.median(vals):.{digits}f} / {vals[-1]:.{digits}f}"


def footer(meta: dict) -> str:
  """The line every result table ends with: its command, machine and date (from `meta`)."""
  return (f"Command: `{meta['command']}`; machine: {meta['machine']} ({meta['cpus']} cores); "
          f"date: {meta['date']}.")


def json_path(value: str) -> str:
  """argparse type of a results file (`--out`): a path ending in .json that is not a folder,
  checked before a long run rather than when it writes at the end."""
  if os.path.isdir(value) or not value.endswith(".json"):
    raise argparse.ArgumentTypeError(
        f"{value!r}: must be a results file ending in .json (its table written beside it "
        "as .md), not a folder")
  return value


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
