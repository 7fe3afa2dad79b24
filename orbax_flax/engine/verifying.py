"""Re-reading a whole checkpoint to check every checksum.

Restores check the chunks they read; :func:`verify` reads them all, a few
chunks at a time (so memory stays bounded), and reports every damaged array,
not just the first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from orbax_flax.format import _layout
from orbax_flax.format import _tsio
from orbax_flax.core import _progress
from orbax_flax.engine import _reading
from orbax_flax import errors
from orbax_flax.engine import restoring
from orbax_flax.core._location import Location
from orbax_flax.format._manifest import Array, Manifest
from orbax_flax.differential import hashing

_BATCH_BYTES = 256 << 20


def verify(path: Any) -> int:
  """Reads every chunk of a checkpoint and checks its checksum.

  Args:
    path: the checkpoint.

  Returns:
    The number of array bytes verified.

  Raises:
    CheckpointNotFoundError: no committed checkpoint at ``path``.
    CheckpointCorruptedError: listing every array whose bytes are damaged.

  Example:
    >>> import numpy as np, orbax_flax as ofx, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> ofx.save(path, {"state": {"w": np.ones((4, 4), np.float32)}})
    >>> ofx.verify(path)
    64
  """
  return verify_report(path)[0]


def verify_report(path: Any) -> tuple[int, str]:
  """:func:`verify`, also returning the checkpoint's format (what the check covered).

  Example:
    >>> import numpy as np, orbax_flax as ofx, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> ofx.save(path, {"state": {"w": np.ones((4, 4), np.float32)}})
    >>> verify_report(path)
    (64, 'orbax_flax')
  """
  loc = Location.parse(path)
  loc, manifest = restoring.open_manifest(loc)  # checks the manifest's own hashes
  if manifest.format != "orbax_flax":
    return _verify_foreign(loc, manifest), manifest.format
  progress = _progress.Progress(f"verify {loc}", sum(
      r.nbytes for item in manifest.items.values() for r in item.leaves))
  progress.phase = "reading every chunk"
  reader = _reading.Reader(loc, manifest, _BATCH_BYTES, progress)
  with _progress.Monitor(progress):
    return _verify(loc, manifest, reader), "orbax_flax"


def _verify(loc: Location, manifest: Manifest, reader: _reading.Reader) -> int:
  # Sizes first, from the indexes: an array whose manifest contradicts its stored chunks is
  # reported without allocating for it or reading its chunks one by one.
  arrays = [(item, rec) for item, saved in manifest.items.items()
            for rec in saved.leaves if isinstance(rec, Array)]
  try:
    bad = reader.stored_problems(arrays)
  except errors.CheckpointFormatError:
    raise  # crafted (a link, a manifest lying about sizes): refused as a whole
  except errors.CheckpointCorruptedError:  # a damaged database (identity, index): which ones?
    bad = {}
    for item, rec in arrays:
      try:
        bad.update(reader.stored_problems([(item, rec)]))
      except errors.CheckpointFormatError:
        raise
      except errors.CheckpointCorruptedError as e:
        bad[item, rec.name] = str(e)
  problems: list[str] = list(bad.values())
  verified = 0
  for batch, nbytes in _batches(manifest, set(bad)):
    try:
      reader.read([f for f in batch if isinstance(f, _reading.Fill)],
                  [f for f in batch if isinstance(f, _reading.PackedFill)])
      verified += nbytes
      problems += _content_problems(loc, batch)
    except errors.CheckpointCorruptedError as e:
      if len(batch) > 1:  # find every damaged one
        for f in batch:
          try:
            reader.read(*(([f], []) if isinstance(f, _reading.Fill) else ([], [f])))
            verified += f.out.nbytes if isinstance(f, _reading.Fill) else f.nbytes
          except errors.CheckpointCorruptedError as e1:
            problems.append(str(e1))
      else:
        problems.append(str(e))
  if problems:
    unique = list(dict.fromkeys(problems))
    raise errors.CheckpointCorruptedError(
        f"{len(unique)} damaged chunk group(s) in {loc}:\n  " + "\n  ".join(unique))
  return verified


def _content_problems(loc: Location, batch: list[Any]) -> list[str]:
  """Chunks read intact whose bytes are not those the manifest recorded (``chunk_hash``).

  A differential save records each chunk's content hash (xxh3-128). A chunk's
  CRC-32C covers only its bytes: a chunk, data file or database put in the
  place of another passes it, but not this comparison.
  """
  out = []
  for f in batch:
    if not isinstance(f, _reading.Fill) or not f.rec.chunk_hash:
      continue
    chunking = _layout.Chunking(f.rec.shape, f.rec.chunk_shape)
    (c,) = chunking.chunks_in_box(f.box)
    if hashing.block_hash(f.out) != f.rec.chunk_hash[c]:
      out.append(f"checkpoint data is corrupted: item {f.item!r}, array {f.rec.path_text}, chunk"
                 f" {_tsio.chunk_key(f.rec.name, chunking.chunk_coords(c))} in {loc}: its"
                 " bytes pass their CRC-32C but are not the bytes the manifest recorded (its"
                 " chunk_hash): another chunk's bytes were put in its place.")
  return out


COVERAGE = {
    "orbax_flax": ("every chunk's CRC-32C, the manifest's SHA-256s, each database's identity"
                   " and, for differential saves, every chunk's recorded content hash"),
    "orbax-checkpoint": ("every array's chunks are present and decode (orbax-checkpoint stores no"
                         " checksums of its own; compressed chunks fail to decode when damaged)"),
    "safetensors": ("every tensor's byte range is inside its file and readable (safetensors"
                    " stores no checksums)"),
}


def _verify_foreign(loc: Location, manifest: Manifest) -> int:
  """Reads every array of a foreign checkpoint in slices of bounded size; lists every failure."""
  problems, verified = [], 0
  for item, saved in manifest.items.items():
    for rec in saved.leaves:
      if not isinstance(rec, Array):
        continue
      shape = rec.shape
      dtype = rec.np_dtype
      row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
      step = max(1, _BATCH_BYTES // max(row, 1))
      try:
        for lo in range(0, shape[0] if shape else 1, step):
          box = (((lo, min(shape[0], lo + step)),) + tuple((0, s) for s in shape[1:])) if shape else ()
          out = np.empty(_layout.box_shape(box), dtype)
          _reading.read_requests(None, [(item, rec, box, out)])
          verified += out.nbytes
      except Exception as e:  # pylint: disable=broad-except  # reported, every one
        problems.append(f"{item}/{rec.path_text}: {type(e).__name__}: {e}")
  if problems:
    raise errors.CheckpointCorruptedError(
        f"{len(problems)} unreadable array(s) in {loc}:\n  " + "\n  ".join(problems))
  return verified


def _batches(manifest: Manifest, skip: set[tuple[str, str]] = frozenset()):
  """Fills for every stored chunk, in batches of about ``_BATCH_BYTES`` (buffers included).

  ``skip``: ``(item, array name)`` already reported (a packed one skips its buffer).
  """
  batch: list[Any] = []
  used = 0
  for item, saved in manifest.items.items():
    packed: dict[int, list[Array]] = {}
    skipped = {r.owners[0] for r in saved.leaves if isinstance(r, Array) and r.is_packed
               and (item, r.name) in skip}
    for rec in saved.leaves:
      if not isinstance(rec, Array) or not rec.owners or (item, rec.name) in skip:
        continue
      if rec.is_packed and rec.owners[0] in skipped:
        continue
      if rec.is_packed:
        packed.setdefault(rec.owners[0], []).append(rec)
        continue
      chunking = _layout.Chunking(rec.shape, rec.chunk_shape)
      stored = rec.np_stored_dtype
      for c in range(chunking.num_chunks):
        box = chunking.chunk_box(c)
        out = np.empty(_layout.box_shape(box), stored)
        batch.append(_reading.Fill(item, rec, box, out))
        used += out.nbytes
        if used >= _BATCH_BYTES:
          yield batch, used
          batch, used = [], 0
    for owner, recs in packed.items():
      size = saved.packed[owner]
      chunk = _layout.pack_chunk_bytes(size)
      for lo in range(0, size, chunk):
        hi = min(size, lo + chunk)
        names = [r.path_text for r in recs
                 if r.packed_offset < hi and r.packed_offset + r.nbytes > lo]
        if not names:  # a chunk of another step's buffer that holds none of this step's arrays
          continue
        name = _reading.packed_names(names)
        batch.append(_reading.PackedFill(item, owner, lo, hi, np.dtype(np.uint8), (hi - lo,), [], name))
        used += hi - lo
        if used >= _BATCH_BYTES:
          yield batch, used
          batch, used = [], 0
  if batch:
    yield batch, used
