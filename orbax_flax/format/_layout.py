"""Where each byte of an array goes: chunk grid and write ownership, and packed buffers' chunks.

No I/O and no state (the owner choosers update the load list they are
given). An array is stored as a regular grid of chunks. The chunk shape
divides the shard shape of the array's sharding, so every chunk lies inside
one shard and can be written by any process that holds that shard. Each chunk is written exactly once, by one owner; owners are chosen
greedily by bytes so that the processes write equal amounts.

Every process computes the same layout from the same sharding, so ownership
needs no communication.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

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


def assign_owners(holders: Sequence[frozenset[int]], chunk_bytes: int,
                  load: list[int]) -> list[int]:
  """Picks one writer per chunk among its holders, balancing bytes written.

  Args:
    holders: per chunk, the processes that hold its data.
    chunk_bytes: bytes per chunk.
    load: bytes assigned so far per process; updated in place.

  Returns:
    The owner process of each chunk.

  Example:
    >>> load = [0, 0]
    >>> assign_owners([frozenset({0, 1})] * 4, 10, load), load
    ([0, 1, 0, 1], [20, 20])
  """
  owners = []
  for procs in holders:
    owner = min(procs, key=lambda p: (load[p], p))
    load[owner] += chunk_bytes
    owners.append(owner)
  return owners


def assign_owners_grid(group: np.ndarray, group_holders: Sequence[frozenset[int]],
                       chunk_bytes: int, load: list[int]) -> np.ndarray:
  """:func:`assign_owners` over a chunk grid, in numpy: the same owners, the same ``load``.

  Chunk ``i`` is held by ``group_holders[group[i]]``. Where the holder sets
  are pairwise disjoint (the usual case: one holder per shard, or the
  processes of a data-parallel replica group), each group is assigned on its
  own in closed form: the greedy choice of the least-loaded holder, with equal
  chunks, hands out the slots ``(load[p] + j * chunk_bytes, p)`` in sorted
  order, so the ``m`` chunks of a group take its ``m`` smallest slots. Holder
  sets that overlap are assigned by :func:`assign_owners`, chunk by chunk.

  Args:
    group: per chunk (in order), the index of its holder set.
    group_holders: the holder sets.
    chunk_bytes: bytes per chunk (> 0).
    load: bytes assigned so far per process; updated in place.

  Returns:
    The owner process of each chunk (int64).

  Example:
    >>> load = [5, 0, 0]
    >>> assign_owners_grid(np.array([0, 0, 1, 0]), [frozenset({0, 1}), frozenset({2})], 10, load)
    array([1, 0, 2, 1])
    >>> load
    [15, 20, 10]
  """
  group = np.asarray(group, dtype=np.int64)
  disjoint, single = _holder_sets(tuple(group_holders))
  if not disjoint:
    owners = assign_owners([group_holders[g] for g in group.tolist()], chunk_bytes, load)
    return np.asarray(owners, dtype=np.int64)
  counts = np.bincount(group, minlength=len(group_holders))
  owners = single[group]
  alone = np.flatnonzero((counts > 0) & (single >= 0))  # groups of one holder: all theirs
  if len(alone):
    added = np.zeros(len(load), dtype=np.int64)
    np.add.at(added, single[alone], counts[alone] * chunk_bytes)
    for p in np.flatnonzero(added).tolist():
      load[p] += int(added[p])
  multi = np.flatnonzero((counts > 0) & (single < 0)).tolist()
  if multi:
    order = np.argsort(group, kind="stable")
    ends = np.cumsum(counts)
    for g in multi:
      where = order[ends[g] - counts[g]:ends[g]]
      procs = np.array(sorted(group_holders[g]), dtype=np.int64)
      got = _smallest_slots(np.array([load[p] for p in procs.tolist()], dtype=np.int64),
                            chunk_bytes, len(where))
      owners[where] = procs[got]
      for i, n in enumerate(np.bincount(got, minlength=len(procs)).tolist()):
        load[int(procs[i])] += n * chunk_bytes
  return owners


@functools.lru_cache(maxsize=256)
def _holder_sets(sets: tuple[frozenset[int], ...]) -> tuple[bool, np.ndarray]:
  """Whether ``sets`` are pairwise disjoint, and each set's only process (-1 if several)."""
  disjoint = sum(len(h) for h in sets) == len(frozenset().union(*sets))
  single = np.array([next(iter(h)) if len(h) == 1 else -1 for h in sets], dtype=np.int64)
  single.flags.writeable = False
  return disjoint, single


def _smallest_slots(loads: np.ndarray, c: int, m: int) -> np.ndarray:
  """Positions in ``loads`` of the ``m`` smallest slots ``(loads[i] + j * c, i)``, in order."""
  def count(v: int) -> int:  # slots of value <= v
    return int(np.maximum(0, (v - loads) // c + 1).sum())
  lo = int(loads.min())
  hi = lo + (m - 1) * c  # the least-loaded holder alone has m slots up to here
  while lo < hi:
    mid = (lo + hi) // 2
    if count(mid) >= m:
      hi = mid
    else:
      lo = mid + 1
  per = np.maximum(0, (lo - loads) // c + 1)  # every slot up to the m-th smallest (ties too)
  who = np.repeat(np.arange(len(loads)), per)
  j = np.arange(len(who)) - np.repeat(np.cumsum(per) - per, per)
  value = loads[who] + j * c
  return who[np.lexsort((who, value))[:m]]


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
