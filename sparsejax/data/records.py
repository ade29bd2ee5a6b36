"""A safe, checksummed byte format for cached records (no pickle: reading runs no code).

A record is a value made of bytes, str, bool, int, float, None, numpy arrays and scalars of plain
numeric dtypes, and dicts (str keys), lists and tuples of those. Layout:

  MAGIC (8 bytes) | header length (u32 LE) | header (JSON, utf-8) | payload | CRC-32 (u32 LE)

The header describes the structure and where each array or byte string lies in the payload; the
CRC covers header and payload, so a truncated, torn or altered file is detected on read (every
error burst up to 32 bits, anything else with probability 1 - 2**-32). It is a checksum against
accidents, not a signature: safety against a hostile cache directory comes from the format,
which can only describe plain data.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np

__all__ = ["CorruptRecord", "encode", "decode", "nbytes_of"]

MAGIC = b"SJXREC1\n"
_DIGEST = 4
_KINDS = "?biufc"  # numpy dtype kinds allowed: bool, ints, uints, floats, complex


class CorruptRecord(ValueError):
  """A record whose bytes do not match its checksum or layout."""


def nbytes_of(value: Any) -> int:
  """Approximate in-memory size of a record value, in bytes."""
  if isinstance(value, np.ndarray | np.generic):
    return int(value.nbytes)
  if isinstance(value, bytes | bytearray | memoryview):
    return len(value)
  if isinstance(value, str):
    return len(value.encode())
  if isinstance(value, dict):
    return sum(nbytes_of(v) + len(str(k)) for k, v in value.items())
  if isinstance(value, list | tuple):
    return sum(nbytes_of(v) for v in value)
  return 8


def _describe(value: Any, chunks: list[bytes], offset: list[int]) -> Any:
  def put(data: bytes) -> tuple[int, int]:
    start = offset[0]
    chunks.append(data)
    offset[0] += len(data)
    return start, len(data)

  if isinstance(value, np.ndarray | np.generic):
    arr = np.asarray(value)
    if arr.dtype.kind not in _KINDS:
      raise TypeError(f"cannot cache an array of dtype {arr.dtype}; allowed: bool, int, uint, "
                      "float and complex dtypes")
    o, n = put(np.ascontiguousarray(arr).tobytes())
    return {"t": "nd", "dtype": arr.dtype.str, "shape": list(arr.shape), "o": o, "n": n}
  if isinstance(value, bytes | bytearray | memoryview):
    o, n = put(bytes(value))
    return {"t": "bytes", "o": o, "n": n}
  if isinstance(value, str):
    o, n = put(value.encode())
    return {"t": "str", "o": o, "n": n}
  if value is None or isinstance(value, bool | int | float):
    if isinstance(value, float) and not np.isfinite(value):
      return {"t": "float", "v": repr(value)}
    return {"t": type(value).__name__, "v": value}
  if isinstance(value, dict):
    for k in value:
      if not isinstance(k, str):
        raise TypeError(f"cannot cache a dict with key {k!r} of type {type(k).__name__}; "
                        "keys must be str")
    return {"t": "dict", "items": [[k, _describe(v, chunks, offset)] for k, v in value.items()]}
  if isinstance(value, list | tuple):
    return {"t": type(value).__name__, "items": [_describe(v, chunks, offset) for v in value]}
  raise TypeError(f"cannot cache a value of type {type(value).__name__}; allowed: bytes, str, "
                  "bool, int, float, None, numpy arrays, and dicts, lists and tuples of them")


def encode(value: Any) -> bytes:
  """The record bytes of `value` (see the module docstring for what is allowed)."""
  chunks: list[bytes] = []
  tree = _describe(value, chunks, [0])
  header = json.dumps(tree, separators=(",", ":")).encode()
  body = struct.pack("<I", len(header)) + header + b"".join(chunks)
  return MAGIC + body + struct.pack("<I", zlib.crc32(body))


def _build(node: Any, payload: memoryview) -> Any:
  t = node["t"]
  if t == "nd":
    dtype = np.dtype(node["dtype"])
    if dtype.kind not in _KINDS:
      raise CorruptRecord(f"array dtype {dtype} not allowed")
    o, n = node["o"], node["n"]
    arr = np.frombuffer(payload[o:o + n], dtype=dtype).reshape(node["shape"])
    return arr.copy()
  if t in ("bytes", "str"):
    data = bytes(payload[node["o"]:node["o"] + node["n"]])
    return data if t == "bytes" else data.decode()
  if t == "float":
    return float(node["v"])
  if t in ("int", "bool", "NoneType"):
    return node["v"]
  if t == "dict":
    return {k: _build(v, payload) for k, v in node["items"]}
  if t in ("list", "tuple"):
    items = [_build(v, payload) for v in node["items"]]
    return items if t == "list" else tuple(items)
  raise CorruptRecord(f"unknown node type {t!r}")


def decode(blob: bytes) -> Any:
  """The value stored in `blob`; raises CorruptRecord if it was truncated or altered."""
  if len(blob) < len(MAGIC) + 4 + _DIGEST or not blob.startswith(MAGIC):
    raise CorruptRecord("not a sparsejax record (bad magic or too short)")
  body = memoryview(blob)[len(MAGIC):-_DIGEST]
  if struct.pack("<I", zlib.crc32(body)) != blob[-_DIGEST:]:
    raise CorruptRecord("checksum mismatch")
  (hlen,) = struct.unpack("<I", body[:4])
  try:
    tree = json.loads(bytes(body[4:4 + hlen]))
    return _build(tree, body[4 + hlen:])
  except (KeyError, TypeError, ValueError) as e:  # a valid checksum over a malformed header
    raise CorruptRecord(f"malformed record: {e}") from e
