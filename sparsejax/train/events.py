"""TensorBoard scalar event files, written directly (no tensorboardX, TensorFlow or PyTorch).

An event file is a TFRecord file of serialized `tensorflow.Event` protos: each record is

  length (u64 LE) | masked CRC-32C of length (u32 LE) | data | masked CRC-32C of data (u32 LE)

The first event holds `file_version = "brain.Event:2"`; each later one a wall time, a step and a
`Summary` of `(tag, simple_value)` pairs. Only the few proto fields scalars need are encoded here,
so a training process loads nothing beyond the standard library for its TensorBoard logs
(tensorboardX imported PyTorch whenever it was installed: seconds of start-up, and a second copy
of CUDA and LLVM in the process).
"""

from __future__ import annotations

import operator
import os
import socket
import struct
import time
from collections.abc import Mapping

__all__ = ["EventWriter", "crc32c"]


def _crc32c_table() -> tuple[int, ...]:
  table = []
  for i in range(256):
    c = i
    for _ in range(8):
      c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli polynomial, reflected
    table.append(c)
  return tuple(table)


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli) of `data`, as TFRecord framing uses it."""
  crc = 0xFFFFFFFF
  for b in data:
    crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> bytes:
  crc = crc32c(data)
  return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def _varint(n: int) -> bytes:
  out = bytearray()
  while True:
    byte, n = n & 0x7F, n >> 7
    out.append(byte | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _bytes_field(number: int, data: bytes) -> bytes:
  return _varint(number << 3 | 2) + _varint(len(data)) + data


def _event(wall_time: float, step: int, *, file_version: str | None = None,
           scalars: Mapping[str, float] | None = None) -> bytes:
  """A serialized `Event`: wall_time (1, double), step (2, int64), file_version (3, string),
  summary (5, Summary { value (1): Value { tag (1, string), simple_value (2, float) } })."""
  out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3 | 0) + _varint(step)
  if file_version is not None:
    out += _bytes_field(3, file_version.encode())
  if scalars:
    values = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5)
                     + struct.pack("<f", float(value)))
        for tag, value in scalars.items())
    out += _bytes_field(5, values)
  return out


def _record(data: bytes) -> bytes:
  length = struct.pack("<Q", len(data))
  return length + _masked_crc(length) + data + _masked_crc(data)


class EventWriter:
  """Appends scalar summaries to a new event file in `logdir` (`tensorboard --logdir` reads it).

  Each `write(step, {tag: value})` is one event, flushed to the OS at once, so a crash loses at
  most the event being written (TensorBoard skips a torn last record)."""

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    now = time.time()
    name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}"
    self.path = os.path.join(logdir, name)
    self._file = open(self.path, "ab")
    self._put(_event(now, 0, file_version="brain.Event:2"))

  def _put(self, event: bytes) -> None:
    self._file.write(_record(event))
    self._file.flush()

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    """One event at `step` (an int >= 0) holding every `tag: value` of `scalars`."""
    try:
      index = operator.index(step)
    except TypeError:
      index = -1
    if isinstance(step, bool) or index < 0:
      raise ValueError(f"step must be an integer >= 0, got {step!r}")
    self._put(_event(time.time(), index, scalars=scalars))

  def close(self) -> None:
    self._file.close()
