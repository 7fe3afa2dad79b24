"""Reading boxes of any leaf record: ours, a foreign format's, or a transform's.

A request is ``(item, record, box, out)``: fill ``out`` (the box's shape, the
record's dtype) with that box of the array. A transform's record expands into
requests on the records it was made from (``derived``); a foreign record reads
itself (``source``); our own records become the engine's fills, read together.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

import numpy as np

from orbax_flax.format import _layout
from orbax_flax.engine import _reading
from orbax_flax.format._records import Array

_THREADS = 8


def needs_generic(rec: Array) -> bool:
  """True for records the engine's own fast path cannot read."""
  return rec.reads_itself


def read_requests(reader: _reading.Reader | None, requests: Sequence[tuple]) -> None:
  """Fills every request's buffer."""
  todo = list(requests)
  finals = []
  base = []
  while todo:
    item, rec, box, out = todo.pop()
    derived = rec.derived if isinstance(rec, Array) else None
    if derived is not None:
      subs, finish = derived.expand(tuple(box), out)
      todo.extend(subs)
      if finish is not None:
        finals.append(finish)
    else:
      base.append((item, rec, tuple(box), out))
  fills, packed, sourced = [], [], []
  for item, rec, box, out in base:
    if not isinstance(rec, Array):
      out[...] = rec.decoded()
    elif rec.source is not None:
      sourced.append((rec, box, out))
    elif rec.is_packed:
      lo = rec.packed_offset
      packed.append(_reading.PackedFill(
          item, rec.owners[0], lo, lo + rec.nbytes, rec.np_dtype, rec.shape,
          [(_layout.box_to_slices(box), out)], rec.path_text))
    elif not rec.owners:
      out[...] = 0
    else:
      stored = rec.np_stored_dtype
      fills.append(_reading.Fill(item, rec, box, out if out.dtype == stored else out.view(stored)))
  if fills or packed:
    reader.read(fills, packed)
  if len(sourced) == 1:
    rec, box, out = sourced[0]
    rec.source.read(box, out)
  elif sourced:
    # A few threads, each with an even share of the bytes (reads release the GIL).
    shares: list[list[tuple]] = [[] for _ in range(min(_THREADS, len(sourced)))]
    loads = [0] * len(shares)
    for req in sorted(sourced, key=lambda r: -r[2].nbytes):
      k = loads.index(min(loads))
      shares[k].append(req)
      loads[k] += req[2].nbytes

    def run(share):
      for rec, box, out in share:
        rec.source.read(box, out)
    with concurrent.futures.ThreadPoolExecutor(len(shares)) as pool:
      for f in [pool.submit(run, share) for share in shares]:
        f.result()
  for finish in reversed(finals):
    finish()


def full_box(rec: Array) -> _layout.Box:
  return tuple((0, int(s)) for s in rec.shape)


def read_whole(reader: _reading.Reader | None, item: str, rec: Array) -> np.ndarray:
  """One array, whole, as a host numpy array."""
  out = np.empty(rec.shape, rec.np_dtype)
  read_requests(reader, [(item, rec, full_box(rec), out)])
  return out
