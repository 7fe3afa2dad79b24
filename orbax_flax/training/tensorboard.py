"""TensorBoard scalars without TensorFlow: a small event-file writer.

TensorBoard reads ``events.out.tfevents.*`` files: TFRecord framing (length,
masked CRC-32C, data, masked CRC-32C) around ``Event`` protocol buffers. For
scalars only three messages are needed (``Event``, ``Summary``,
``Summary.Value``), written here by hand, so checkpoint timings and the loss
reach TensorBoard with nothing but this library installed.

:class:`TensorBoardWriter` has the clu ``MetricWriter`` methods the training
plugin and examples use (``write_scalars``, ``flush``, ``close``), so it can be
passed as ``writer=`` to :class:`orbax_flax.CheckpointCallback` and
:class:`orbax_flax.LogProgress`.

Example:
  >>> import tempfile, os, orbax_flax as ofx
  >>> logdir = tempfile.mkdtemp()
  >>> w = ofx.TensorBoardWriter(logdir)
  >>> w.write_scalars(10, {"loss": 0.5, "checkpoint/blocking_s": 0.02})
  >>> w.close()
  >>> [f.startswith("events.out.tfevents.") for f in os.listdir(logdir)]
  [True]
"""

from __future__ import annotations

import math
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping

import numpy as np

from orbax_flax.core import _crc


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1
  out = bytearray()
  while True:
    b = n & 0x7F
    n >>= 7
    if n:
      out.append(b | 0x80)
    else:
      out.append(b)
      return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
  return _varint((number << 3) | wire) + payload


def _bytes_field(number: int, data: bytes) -> bytes:
  return _field(number, 2, _varint(len(data)) + data)


def _event(wall_time: float, step: int, *, file_version: str | None = None,
           scalars: Mapping[str, float] | None = None) -> bytes:
  out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
  if file_version is not None:
    out += _bytes_field(3, file_version.encode())
  if scalars:
    values = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5, _float32(v)))
                      for tag, v in scalars.items())
    out += _bytes_field(5, values)
  return out


def _float32(value: float) -> bytes:
  """``value`` as a little-endian float32 (``Summary.Value.simple_value``): beyond float32's
  range it is +-inf, as TensorFlow's writer records it, never an error."""
  with np.errstate(over="ignore"):
    return np.array(value, "<f4").tobytes()


def _masked_crc(data: bytes) -> int:
  crc = _crc.value(np.frombuffer(data, np.uint8))
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _record(data: bytes) -> bytes:
  length = struct.pack("<Q", len(data))
  return (length + struct.pack("<I", _masked_crc(length)) + data
          + struct.pack("<I", _masked_crc(data)))


def _as_float(value: float) -> float:
  """``float(value)``; an int beyond float64's range is +-inf, as any value beyond float32's."""
  try:
    return float(value)
  except OverflowError:  # an exact number (an int, a Fraction) too large for float64
    return math.inf if value > 0 else -math.inf


class TensorBoardWriter:
  """Writes scalars to a TensorBoard event file in ``logdir`` (no TensorFlow needed).

  Args:
    logdir: the directory TensorBoard is pointed at (created if missing).
  """

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.ofx"
    self.path = os.path.join(logdir, name)
    self._file = open(self.path, "ab")
    self._lock = threading.Lock()
    self._file.write(_record(_event(time.time(), 0, file_version="brain.Event:2")))

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    """One event with every scalar of ``scalars`` at ``step``.

    TensorBoard stores float32: a finite value beyond its range (a diverging loss in
    float64) is recorded as +-inf.
    """
    values = {str(k): _as_float(v) for k, v in scalars.items()}
    with self._lock:
      self._file.write(_record(_event(time.time(), int(step), scalars=values)))

  def flush(self) -> None:
    with self._lock:
      self._file.flush()

  def close(self) -> None:
    with self._lock:
      if not self._file.closed:
        self._file.flush()
        self._file.close()

  def __enter__(self) -> TensorBoardWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
