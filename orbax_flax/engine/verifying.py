"""Re-reading a whole checkpoint to check every checksum.

Restores check the chunks they read; :func:`verify` reads them all, a few
chunks at a time (so memory stays bounded), and reports every damaged array,
not just the first.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from orbax_flax.core import _location
from orbax_flax.format import _layout
from orbax_flax.format import _manifest
from orbax_flax.format import _tsio
from orbax_flax.core import _progress
from orbax_flax.engine import _reading
from orbax_flax import errors
from orbax_flax.engine import restoring
from orbax_flax.core._location import Location
from orbax_flax.format._manifest import Array, Manifest
from orbax_flax.differential import hashing
from orbax_flax.differential import refs

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
  """:func:`verify`, also returning what the check covered, in words.

  Example:
    >>> import numpy as np, orbax_flax as ofx, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> ofx.save(path, {"state": {"w": np.ones((4, 4), np.float32)}})
    >>> verify_report(path)
    (64, 'every checksum matches')
  """
  loc = Location.parse(path)
  loc, manifest = restoring.open_manifest(loc)  # checks the manifest's own hashes
  if manifest.format != "orbax_flax":
    return _verify_foreign(loc, manifest), f"{manifest.format}: checked {_coverage(manifest)}"
  progress = _progress.Progress(f"verify {loc}", sum(
      r.nbytes for item in manifest.items.values() for r in item.leaves))
  progress.phase = "reading every chunk"
  reader = _reading.Reader(loc, manifest, _BATCH_BYTES, progress)
  with _progress.Monitor(progress):
    return _verify(loc, manifest, reader), "every checksum matches"


def check_manifest(loc: Location) -> _manifest.Summary:
  """The summary of the manifest at ``loc``, once both of the manifest's SHA-256s match.

  What ``python -m orbax_flax list`` reads of each step: the whole manifest, hashed
  but not decoded into records (about a millisecond per MB, where decoding takes
  hundreds), so a manifest cut short or damaged after its summary line is found,
  which the summary alone (:func:`orbax_flax.engine.restoring.read_summary`) does
  not show. The arrays are not read: :func:`verify` does that. The digests are
  those ``docs/format.md`` specifies: the header's ``summary_sha256`` covers the
  summary line, its ``sha256`` the body.

  Raises:
    CheckpointNotFoundError: no manifest at ``loc`` (the message says what is there).
    CheckpointCorruptedError: a digest does not match (the manifest is damaged).

  Example:
    >>> import numpy as np, orbax_flax as ofx, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> ofx.save(path, {"state": {"w": np.ones(4, np.float32)}})
    >>> check_manifest(Location.parse(path)).item_bytes
    {'state': 16}
  """
  summary = restoring.read_summary(loc)  # the header and the summary line, checked
  where = f"{loc}/{_manifest.MANIFEST_KEY}"
  data = _location.read_key(loc, _manifest.MANIFEST_KEY,
                            max_bytes=_manifest.MAX_MANIFEST_BYTES + 1)
  if data is None:  # deleted since its summary was read
    raise errors.CheckpointNotFoundError(f"no orbax_flax checkpoint at {loc}: its manifest was"
                                         " removed while it was read")
  if len(data) > _manifest.MAX_MANIFEST_BYTES:
    raise errors.CheckpointFormatError(
        f"{where} is larger than {_manifest.MAX_MANIFEST_BYTES >> 20} MiB, the most a manifest"
        " may hold; damaged or crafted")
  header, _, rest = data.partition(b"\n")
  _, newline, body = rest.partition(b"\n")
  recorded = next((f.partition(b"=")[2].decode(errors="replace") for f in header.split()
                   if f.startswith(b"sha256=")), None)
  actual = hashlib.sha256(body).hexdigest()
  if not newline or recorded != actual:
    raise errors.CheckpointCorruptedError(
        f"checksum mismatch in {where}: its summary is intact, but its body"
        f" ({len(body)} bytes) hashes to {actual[:16]}..., not the recorded"
        f" {str(recorded)[:16]}...: the manifest is cut short or damaged, and the step cannot"
        " be restored. Restore from another step.")
  return summary


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
  for batch, nbytes, hashes in _batches(manifest, set(bad)):
    try:
      reader.read([f for f in batch if isinstance(f, _reading.Fill)],
                  [f for f in batch if isinstance(f, _reading.PackedFill)])
      verified += nbytes
      problems += _content_problems(loc, batch, hashes)
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


def _content_problems(loc: Location, batch: list[Any], hashes: dict[int, str]) -> list[str]:
  """Blocks read intact whose bytes are not those the manifest recorded: a chunk's
  ``chunk_hash``, or a packed piece's hash (``hashes``: ``id(fill)`` -> the recorded hash).

  A differential save records each block's content hash (xxh3-128). A chunk's
  CRC-32C covers only its bytes: a chunk, data file or database put in the
  place of another passes it, but not this comparison.
  """
  out = []
  for f in batch:
    if isinstance(f, _reading.PackedFill):
      if id(f) in hashes and hashing.block_hash(f.dests[0][1]) != hashes[id(f)]:
        out.append(f"checkpoint data is corrupted: item {f.item!r}, the packed small arrays"
                   f" [{f.lo}, {f.hi}) of process {refs.split(f.owner)[1]} ({f.name}) in {loc}:"
                   " their bytes pass their CRC-32C but are not the bytes the manifest"
                   " recorded (packed_pieces): other bytes were put in their place.")
      continue
    if not f.rec.chunk_hash:
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
                   " and, for differential saves, the recorded content hash of every chunk"
                   " and every piece of packed small arrays"),
    "orbax-checkpoint": ("every array's chunks are present and decode (orbax-checkpoint stores no"
                         " checksums: a damaged byte inside a chunk that still decodes goes"
                         " unseen, and a restore returns other values)"),
    "orbax-checkpoint, checksummed": ("every chunk's CRC-32C, and that every array's chunks are"
                                      " present and decode"),
    "safetensors": ("every tensor's byte range is inside its file and readable (safetensors"
                    " stores no checksums)"),
}


def _coverage(manifest: Manifest) -> str:
  """What :func:`_verify_foreign` checked of ``manifest``'s arrays, in words.

  An orbax-checkpoint array whose chunks carry a checksum (``source.checksummed``:
  what :func:`orbax_flax.export_orbax` writes) fails to read when damaged; others,
  and every safetensors tensor, are only checked to be present and to decode.
  """
  if manifest.format != "orbax-checkpoint":
    return COVERAGE[manifest.format]
  arrays = [r for item in manifest.items.values() for r in item.leaves if isinstance(r, Array)]
  checked = [r for r in arrays if getattr(r.source, "checksummed", False)]
  if len(checked) == len(arrays):
    return COVERAGE["orbax-checkpoint, checksummed"]
  if not checked:
    return COVERAGE["orbax-checkpoint"]
  return (f"{COVERAGE['orbax-checkpoint, checksummed']} for the {len(checked)} of {len(arrays)}"
          f" arrays whose chunks carry a CRC-32C; for the others, {COVERAGE['orbax-checkpoint']}")


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
  """Fills for every stored chunk, in batches of about ``_BATCH_BYTES`` (buffers included):
  ``(fills, array bytes, hashes)``, ``hashes`` the content hashes its packed fills are to
  have (``id(fill)`` -> hash).

  ``skip``: ``(item, array name)`` already reported (a packed one skips its buffer). The
  packed buffers of a differential save are read piece by piece (``packed_pieces``: each
  from the step that holds it, into a buffer, to compare its recorded hash; the pieces tile
  the buffer, so every chunk holding this step's bytes is read); other packed buffers chunk
  by chunk.
  """
  batch: list[Any] = []
  hashes: dict[int, str] = {}
  used = nbytes = 0  # buffer bytes, array bytes
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
        nbytes += out.nbytes
        if used >= _BATCH_BYTES:
          yield batch, nbytes, hashes
          batch, hashes, used, nbytes = [], {}, 0, 0
    for owner, lo, hi, expected in _packed_blocks(saved, packed):
      names = [r.path_text for r in packed[owner]
               if r.packed_offset < hi and r.packed_offset + r.nbytes > lo]
      if not names:  # a chunk of another step's buffer that holds none of this step's arrays
        continue
      name = _reading.packed_names(names)
      dests = [] if expected is None else [((), np.empty(hi - lo, np.uint8))]
      fill = _reading.PackedFill(item, owner, lo, hi, np.dtype(np.uint8), (hi - lo,), dests, name)
      batch.append(fill)
      if expected is not None:
        hashes[id(fill)] = expected
      used += (hi - lo) * (1 if expected is None else 2)  # (a chunk read, and its buffer)
      nbytes += hi - lo
      if used >= _BATCH_BYTES:
        yield batch, nbytes, hashes
        batch, hashes, used, nbytes = [], {}, 0, 0
  if batch:
    yield batch, nbytes, hashes


def _packed_blocks(saved: Any, packed: dict[int, list[Array]]):
  """``(owner, lo, hi, hash or None)`` of the blocks of the packed buffers ``packed`` names
  (expanded owner -> its arrays): a differential save's recorded pieces, else the chunks."""
  for owner in packed:
    home, process = refs.split(owner)
    pieces = saved.packed_pieces.get(process)
    if pieces:
      for lo, hi, base, expected in pieces:
        if base + 1 == home:
          yield owner, lo, hi, expected
      continue
    size = saved.packed[owner]
    chunk = _layout.pack_chunk_bytes(size)
    for lo in range(0, size, chunk):
      yield owner, lo, min(size, lo + chunk), None
