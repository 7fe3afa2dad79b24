"""Reading boxes of any leaf record: ours, a foreign format's, or a transform's.

A request is ``(item, record, box, out)``: fill ``out`` (the box's shape, the
record's dtype) with that box of the array. A transform's record expands into
requests on the records it was made from (``derived``); a foreign record reads
itself (``source``); our own records become the engine's fills, read together.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import numpy as np

from orbax_flax import _layout
from orbax_flax import _reading
from orbax_flax import _tree

_THREADS = 8


def needs_generic(rec: dict[str, Any]) -> bool:
  """True for records the engine's own fast path cannot read."""
  return "source" in rec or "derived" in rec


def read_requests(reader: _reading.Reader | None, requests: Sequence[tuple]) -> None:
  """Fills every request's buffer."""
  todo = list(requests)
  finals = []
  base = []
  while todo:
    item, rec, box, out = todo.pop()
    derived = rec.get("derived")
    if derived is not None:
      subs, finish = derived.expand(tuple(box), out)
      todo.extend(subs)
      if finish is not None:
        finals.append(finish)
    else:
      base.append((item, rec, tuple(box), out))
  fills, packed, sourced = [], [], []
  for item, rec, box, out in base:
    if "source" in rec:
      sourced.append((rec, box, out))
    elif rec["kind"] == "value":
      out[...] = _tree.decode_value(rec["value"])
    elif "packed_offset" in rec:
      lo = rec["packed_offset"]
      packed.append(_reading.PackedFill(
          item, rec["owners"][0], lo, lo + rec["nbytes"], _tree.dtype_from_name(rec["dtype"]),
          tuple(rec["shape"]), [(_layout.box_to_slices(box), out)], _tree.path_str(tuple(rec["path"]))))
    elif not rec["owners"]:
      out[...] = 0
    else:
      stored = _tree.dtype_from_name(rec["stored_dtype"])
      fills.append(_reading.Fill(item, rec, box, out if out.dtype == stored else out.view(stored)))
  if fills or packed:
    reader.read(fills, packed)
  if len(sourced) == 1:
    rec, box, out = sourced[0]
    rec["source"].read(box, out)
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
        rec["source"].read(box, out)
    with concurrent.futures.ThreadPoolExecutor(len(shares)) as pool:
      for f in [pool.submit(run, share) for share in shares]:
        f.result()
  for finish in reversed(finals):
    finish()


def full_box(rec: dict[str, Any]) -> _layout.Box:
  return tuple((0, int(s)) for s in rec["shape"])


def read_whole(reader: _reading.Reader | None, item: str, rec: dict[str, Any]) -> np.ndarray:
  """One array, whole, as a host numpy array."""
  out = np.empty(tuple(rec["shape"]), _tree.dtype_from_name(rec["dtype"]))
  read_requests(reader, [(item, rec, full_box(rec), out)])
  return out
