"""Which positions of a global data order shards have read, and what is left: pure arithmetic.

An *order* is a tuple of ``range`` objects: positions of the user's dataset,
read one after another. A run starts with one range, the whole dataset. Shard
``k`` of ``n`` reads the order's ``k``-th, ``k+n``-th, ``k+2n``-th... position
(a stride), so its place in the order is one number: how many of its positions
it has read. Shards that filter records read their strides at different rates,
so their places differ.

When the shard count changes, :func:`resume_order` turns the old shards' places
into the next order: first the *holes* (positions that no shard read below the
furthest place: one strided ``range`` per old shard and old range it crosses),
then everything after that place (the *frontier*). Every position is read
exactly once over any sequence of shard counts, and an order holds O(shards)
ranges however many records were read.

Example:
  >>> order = initial(10)
  >>> shard_ranges(order, 1, 3)          # shard 1 of 3 reads positions 1, 4, 7
  [range(1, 10, 3)]
  >>> nxt = resume_order(order, [2, 1, 2])  # shards 0 and 2 read 2 positions, shard 1 one
  >>> nxt                                   # position 4 was not read: it comes first
  (range(4, 6, 3), range(6, 10))
  >>> [p for r in nxt for p in r]
  [4, 6, 7, 8, 9]
"""

from __future__ import annotations

from collections.abc import Sequence

Order = tuple[range, ...]


def initial(length: int) -> Order:
  """The order of a fresh run: every position of a dataset of ``length`` records."""
  return (range(length),)


def size(order: Order) -> int:
  """How many positions ``order`` holds."""
  return sum(len(r) for r in order)


def shard_ranges(order: Order, index: int, count: int) -> list[range]:
  """The dataset positions shard ``index`` of ``count`` reads, in its order, as ranges."""
  return _part(order, index, size(order), count)


def shard_length(order: Order, index: int, count: int) -> int:
  """How many positions shard ``index`` of ``count`` reads in ``order``."""
  total = size(order)
  return max(0, (total - index + count - 1) // count)


def resume_order(order: Order, places: Sequence[int]) -> Order:
  """The next order after shard ``k`` of ``len(places)`` read ``places[k]`` of its positions.

  The holes (positions of ``order`` that no shard read below the furthest
  place) come first, oldest first, then the rest of ``order``.
  """
  count = len(places)
  total = size(order)
  cut = min(max(places, default=0) * count, total)
  holes = [r for k, place in enumerate(places) for r in _part(order, k + place * count, cut, count)]
  holes.sort(key=lambda r: r.start)
  return tuple(holes + _part(order, cut, total, 1))


def to_lists(order: Order) -> list[list[int]]:
  """``order`` as JSON-able ``[start, stop, step]`` triples."""
  return [[r.start, r.stop, r.step] for r in order]


def from_lists(triples: object) -> Order:
  """The order :func:`to_lists` wrote.

  Raises:
    ValueError: ``triples`` is not a list of ``[start, stop, step]`` integer
      triples with ``0 <= start`` and ``step >= 1``.
  """
  ok = isinstance(triples, (list, tuple)) and all(
      isinstance(t, (list, tuple)) and len(t) == 3 and all(type(x) is int for x in t)
      and t[0] >= 0 and t[2] >= 1 for t in triples)
  if not ok:
    raise ValueError(f"a data order must be a list of [start, stop, step] integer triples with"
                     f" start >= 0 and step >= 1; got {triples!r:.200}")
  return tuple(range(*t) for t in triples)


def _part(order: Order, start: int, stop: int, step: int) -> list[range]:
  """Positions ``range(start, stop, step)`` of ``order`` (counted across its ranges) as ranges."""
  out, offset = [], 0
  for r in order:
    end = offset + len(r)
    lo, hi = max(start, offset), min(stop, end)
    if lo < hi:
      first = lo + (start - lo) % step  # the first position >= lo on the stride
      piece = r[first - offset:hi - offset:step]
      if piece:
        out.append(piece)
    offset = end
  return out
