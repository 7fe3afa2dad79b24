"""Byte runs of a box inside a C-ordered array stored contiguously in a file.

A box ``((lo0, hi0), (lo1, hi1), ...)`` of an array laid out in C order is a
set of contiguous runs: the trailing dimensions the box covers fully merge
into one run with the first dimension it only covers in part. Reading or
writing the box is one ``pread``/``pwrite`` per run, straight between the file
and the box's own buffer.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator

import numpy as np

from orbax_flax.core import _location

Box = tuple[tuple[int, int], ...]


def runs(shape: tuple[int, ...], box: Box, itemsize: int) -> Iterator[tuple[int, int, int]]:
  """Yields ``(file byte offset, buffer byte offset, length)`` for each run of ``box``.

  Offsets are relative to the array's first byte; the buffer is the box in C
  order.

  Example:
    >>> list(runs((4, 6), ((1, 3), (0, 6)), 4))   # two full rows: one run
    [(24, 0, 48)]
    >>> list(runs((4, 6), ((0, 2), (2, 4)), 4))   # a column block: one run per row
    [(8, 0, 8), (32, 8, 8)]
  """
  n = len(shape)
  if n == 0:
    yield 0, 0, itemsize
    return
  if any(hi <= lo for lo, hi in box):
    return
  # k: the last dimension not covered fully (everything after it merges into the run).
  k = n - 1
  while k > 0 and box[k] == (0, shape[k]):
    k -= 1
  inner = math.prod(shape[k + 1:]) * itemsize
  run = (box[k][1] - box[k][0]) * inner
  strides = [math.prod(shape[d + 1:]) * itemsize for d in range(n)]
  buf = 0
  for idx in itertools.product(*(range(lo, hi) for lo, hi in box[:k])):
    off = sum(i * s for i, s in zip(idx, strides)) + box[k][0] * strides[k]
    yield off, buf, run
    buf += run


_DIRECT_RUN = 64 << 10   # runs at least this long are read straight into the buffer
_SLAB = 16 << 20         # otherwise whole rows are read in slabs of about this size, then copied


def pread_exact(fd: int, view: memoryview, offset: int) -> None:
  """Fills ``view`` from ``fd`` at ``offset`` (as many preads as it takes); EOFError past the end."""
  if _location.pread_into(fd, [view], offset) < len(view):
    raise EOFError(f"file ends before byte {offset + len(view)}")


def pread_box(fd: int, base: int, shape: tuple[int, ...], box: Box, out: np.ndarray) -> int:
  """Reads ``box`` of the array starting at file offset ``base`` into ``out``; returns bytes read.

  Long runs go straight into ``out``. Runs shorter than a few pages (a column
  block of a matrix) would cost a system call each for less than a page: then
  whole rows of the leading dimension are read in slabs and the box copied out
  of them, which reads at most the rows the box spans.
  """
  itemsize = out.dtype.itemsize
  flat = out.reshape(-1).view(np.uint8)
  first = next(iter(runs(shape, box, itemsize)), None)
  if first is None:
    return 0
  row = math.prod(shape[1:]) * itemsize if shape else itemsize
  if first[2] >= _DIRECT_RUN or len(shape) < 2 or row > _SLAB:
    total = 0
    for off, at, n in runs(shape, box, itemsize):
      pread_exact(fd, memoryview(flat[at:at + n]), base + off)
      total += n
    return total
  (lo0, hi0), inner = box[0], tuple(slice(lo, hi) for lo, hi in box[1:])
  per = max(1, _SLAB // row)
  temp = np.empty(min(per, hi0 - lo0) * row, np.uint8)
  total = 0
  for a in range(lo0, hi0, per):
    b = min(hi0, a + per)
    chunk = temp[:(b - a) * row]
    pread_exact(fd, memoryview(chunk), base + a * row)
    rows = chunk.view(out.dtype).reshape((b - a,) + tuple(shape[1:]))
    out[a - lo0:b - lo0] = rows[(slice(None),) + inner]
    total += chunk.nbytes
  return total


def pwrite_box(fd: int, base: int, shape: tuple[int, ...], box: Box, data: np.ndarray) -> int:
  """Writes ``data`` (the box, C order) into the array starting at file offset ``base``."""
  flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
  total = 0
  for off, at, n in runs(shape, box, data.dtype.itemsize):
    view = memoryview(flat[at:at + n])
    done = 0
    while done < n:
      done += os.pwritev(fd, [view[done:]], base + off + done)
    total += n
  return total
