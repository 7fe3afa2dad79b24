"""Where each byte of an array goes: its chunk grid, and packed buffers' chunks.

No I/O and no state. An array is stored as a regular grid of chunks. The
chunk shape divides the shard shape of the array's sharding, so every chunk
lies inside one shard and can be written by any process that holds that
shard (which one writes it is the save's plan:
:mod:`orbax_flax.engine._planning`). Boxes, slices and grouping by size are
the geometry every reader and writer shares.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence

import numpy as np

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension

# Chunks larger than this are split along their leading dimensions so that
# big replicated arrays are spread over processes and resharded reads fetch
# little more than they need.
DEFAULT_MAX_CHUNK_BYTES = 32 * 1024 * 1024

# Small arrays of a process are packed into one uint8 array of its database, chunked by this
# (its checksum granularity).
PACKED = "packed"
PACK_CHUNK_BYTES = 4 << 20


def pack_chunk_bytes(size: int) -> int:
  """The chunk length of a packed buffer of ``size`` bytes.

  Example:
    >>> pack_chunk_bytes(100), pack_chunk_bytes(10 << 20) == PACK_CHUNK_BYTES
    (100, True)
  """
  return min(size, PACK_CHUNK_BYTES)


@dataclasses.dataclass(frozen=True)
class Chunking:
  """A regular chunk grid over an array of ``shape``."""

  shape: tuple[int, ...]
  chunk_shape: tuple[int, ...]

  @property
  def grid(self) -> tuple[int, ...]:
    return tuple(s // c for s, c in zip(self.shape, self.chunk_shape))

  @property
  def num_chunks(self) -> int:
    return math.prod(self.grid)

  def chunk_coords(self, flat: int) -> tuple[int, ...]:
    coords = []
    for g in reversed(self.grid):
      flat, i = divmod(flat, g)
      coords.append(i)
    return tuple(reversed(coords))

  def chunk_box(self, flat: int) -> Box:
    coords = self.chunk_coords(flat)
    return tuple((i * c, (i + 1) * c) for i, c in zip(coords, self.chunk_shape))

  def chunks_in_box(self, box: Box) -> list[int]:
    """Flat indices of the chunks that intersect ``box``, in C order."""
    ranges = [range(lo // c, (hi - 1) // c + 1) for (lo, hi), c in zip(box, self.chunk_shape)]
    out = []
    for idx in itertools.product(*ranges):
      flat = 0
      for i, g in zip(idx, self.grid):
        flat = flat * g + i
      out.append(flat)
    return out

  def split_box(self, box: Box, limit: int) -> list[Box]:
    """``box`` cut at chunk boundaries into boxes of at most ``limit`` chunks each (one at
    least), in C order: slabs along the first axis, finer only where one slab is too many.

    Example:
      >>> Chunking((8, 8), (2, 4)).split_box(((1, 7), (0, 8)), 4)
      [((1, 4), (0, 8)), ((4, 7), (0, 8))]
      >>> Chunking((8, 8), (2, 4)).split_box(((0, 2), (0, 8)), 1)
      [((0, 2), (0, 4)), ((0, 2), (4, 8))]
    """
    if not box:
      return [box]
    (lo, hi), c = box[0], self.chunk_shape[0]
    inner = Chunking(self.shape[1:], self.chunk_shape[1:])
    per_slab = math.prod((h - 1) // k - l // k + 1 for (l, h), k in zip(box[1:], self.chunk_shape[1:]))
    rows = max(1, limit // per_slab)
    out = []
    start = lo
    while start < hi:
      stop = min(hi, (start // c + rows) * c)
      if per_slab <= limit:
        out.append(((start, stop),) + tuple(box[1:]))
      else:
        out += [((start, stop),) + rest for rest in inner.split_box(tuple(box[1:]), limit)]
      start = stop
    return out


def slices_to_box(index: Sequence[slice], shape: Sequence[int]) -> Box:
  """Turns a jax shard index (tuple of slices) into a box."""
  return tuple((s.start or 0, shape[d] if s.stop is None else s.stop) for d, s in enumerate(index))


def box_to_slices(box: Box) -> tuple[slice, ...]:
  return tuple(slice(lo, hi) for lo, hi in box)


def intersect(a: Box, b: Box) -> Box:
  return tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))


def relative(inner: Box, outer: Box) -> tuple[slice, ...]:
  """Slices of ``inner`` within an array that holds ``outer``."""
  return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer))


def box_shape(box: Box) -> tuple[int, ...]:
  return tuple(hi - lo for lo, hi in box)


def box_shapes(groups: Iterable[Iterable[Box]]) -> list[list[tuple[int, ...]]]:
  """The shapes of groups of boxes (each array's boxes), group by group."""
  return [[tuple(hi - lo for lo, hi in box) for box in boxes] for boxes in groups]


def _largest_divisor_at_most(n: int, limit: int) -> int:
  limit = max(1, min(n, limit))
  for d in range(limit, 0, -1):
    if n % d == 0:
      return d
  return 1


def choose_chunk_shape(shard_shape: Sequence[int], itemsize: int,
                       max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> tuple[int, ...]:
  """Splits a shard shape along leading dims until a chunk fits the limit.

  A chunk must divide the shard, so a dimension is only split by one of its
  divisors. A dimension whose divisors are all far below what would fit (a prime
  length) is left whole and the next one is split instead; if none can be, the
  chunk stays larger than the limit rather than becoming tiny (millions of
  4-byte chunks would take hours to write).

  Example:
    >>> choose_chunk_shape((1024, 1024), 4, max_chunk_bytes=1 << 20)
    (256, 1024)
    >>> choose_chunk_shape((32003, 4096), 4, max_chunk_bytes=32 << 20)  # 32003 is prime
    (32003, 256)
    >>> choose_chunk_shape((8388617,), 4, max_chunk_bytes=32 << 20)
    (8388617,)
  """
  chunk = [max(1, int(s)) for s in shard_shape]
  for d in range(len(chunk)):
    nbytes = math.prod(chunk) * itemsize
    if nbytes <= max_chunk_bytes:
      break
    row_bytes = nbytes // chunk[d]
    fits = max_chunk_bytes // max(row_bytes, 1)
    divisor = _largest_divisor_at_most(chunk[d], fits)
    if fits >= 1 and divisor * 16 < fits:
      continue  # only far too small divisors: keep this dimension whole
    chunk[d] = divisor
  return tuple(chunk)


def split_by_size(sizes: Sequence[int], limit: int) -> list[list[int]]:
  """Indices of ``sizes`` in order, in groups of at most ``limit`` (a larger item alone; a
  ``limit`` of 0: one group). The one grouping by size: a save's staging rounds, a
  restore's read rounds, a tier's and an export's windows.

  Example:
    >>> split_by_size([3, 3, 3, 9, 1], 6)
    [[0, 1], [2], [3], [4]]
    >>> split_by_size([3, 3], 0)
    [[0, 1]]
  """
  if not limit:
    return [list(range(len(sizes)))]
  groups: list[list[int]] = [[]]
  used = 0
  for i, n in enumerate(sizes):
    if groups[-1] and used + n > limit:
      groups.append([])
      used = 0
    groups[-1].append(i)
    used += n
  return groups
