"""The local tier's file: one process's shards of one step (its own copy, or a peer's replica).

Layout (integers little-endian; see ``docs/format.md``)::

  bytes 0-7      b"OFXLOCL1"
  bytes 8-15     n: the length of the sealed index
  bytes 16..     the sealed index (``_manifest.seal``): a line
                 "orbax_flax local index v1 sha256=<hex>" then JSON, padded with
                 spaces so that the payload starts 64-byte aligned
  16 + n ..      the payload: each shard's bytes at the offset the index names
                 (64-byte aligned), one CRC-32C per 16 MiB segment of each

Every byte is covered: the header by its bounds, the index by its SHA-256, the
shard bytes by their CRCs, so a damaged blob is refused, never read wrong.

The index holds, per item, the tree structure and per leaf the engine's own
record (:func:`orbax_flax.engine._planning.array_record`, ``value_record``) plus the
shards this process held (``boxes``), decoded by the manifest's own checking
decoder into the same records (:mod:`orbax_flax.format._manifest`). A restore checks the target with the
engine's :func:`orbax_flax.engine.targets.match_target` and places the arrays with
its :func:`~orbax_flax.engine.restoring.assemble`: the same target gives the same
result, or the same error, as the persistent tier.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from orbax_flax.core import _crc
from orbax_flax.core import _location
from orbax_flax.format import _layout
from orbax_flax.format import _manifest
from orbax_flax.engine import targets
from orbax_flax.engine import _planning
from orbax_flax.core import _staging
from orbax_flax.core import _threads
from orbax_flax.core import _tree
from orbax_flax import errors
from orbax_flax.engine import restoring
from orbax_flax.format._manifest import Array, Item, Manifest
from orbax_flax.formats import _cbytes

MAGIC = b"OFXLOCL1"
HEAD = 16                       # magic + index length
_INDEX_MAGIC = b"orbax_flax local index v1"
ALIGN = 64                      # of the payload and of every shard in it
WRITERS = 8
SEGMENT = 16 << 20              # bytes per checksum, and per parallel read or write


class LayoutChanged(ValueError):
  """The local checkpoint was written with another process layout or other shardings."""


@dataclasses.dataclass
class Blob:
  """A local checkpoint of one process before it is written: its index and its shards.

  ``shards`` are what the index's entries name, in payload order: numpy arrays
  or single-device ``jax.Array`` s, brought to the host only when written
  (:func:`write`), in rounds within a budget. Their CRC-32Cs are filled in by
  the writer, which seals the index last, into the space reserved for it.
  """
  index: dict[str, Any]
  entries: list[dict[str, Any]]   # one per shard, in order (inside ``index``)
  shards: list[Any]
  payload_bytes: int

  @property
  def nbytes(self) -> int:
    return self.header_bytes() + self.payload_bytes

  def header_bytes(self) -> int:
    """The length of the header (magic, length, sealed index), a multiple of :data:`ALIGN`."""
    saved = [e["crc32c"] for e in self.entries]
    for e in self.entries:  # the widest value each CRC can take
      e["crc32c"] = [0xFFFFFFFF] * len(e["crc32c"])
    n = _aligned(HEAD + len(_manifest.seal(_INDEX_MAGIC, json.dumps(self.index).encode())))
    for e, crcs in zip(self.entries, saved):
      e["crc32c"] = crcs
    return n

  def header(self, length: int) -> bytes:
    """The header with the CRCs filled in, padded to exactly ``length`` bytes."""
    body = json.dumps(self.index).encode()
    pad = length - HEAD - len(_manifest.seal(_INDEX_MAGIC, body))
    sealed = _manifest.seal(_INDEX_MAGIC, body + b" " * pad)  # JSON ignores trailing spaces
    return MAGIC + struct.pack("<Q", len(sealed)) + sealed


def _aligned(n: int) -> int:
  return -(-n // ALIGN) * ALIGN


def encode(step: int, items: Mapping[str, Any], *, run: str = "", timeline: str = "") -> Blob:
  """The index of this process's shards of ``items``, and the shards; reads no array data."""
  shards: list[Any] = []
  entries: list[dict[str, Any]] = []
  at = 0
  out_items = {}
  for item, tree in items.items():
    structure, leaves = _tree.encode_structure(tree)
    recs = []
    for path, leaf, kind in leaves:
      if kind is None:
        raise _tree.unsupported_leaf_error(item, path, leaf)
      if kind == "value":
        recs.append(_planning.value_record(path, leaf))
        continue
      if kind == "jax" and leaf.is_deleted():
        raise _planning.deleted_leaf_error(item, path)
      rec, data = _planning.array_record(path, leaf, kind)
      boxes: dict[tuple, dict[str, Any]] = {}
      itemsize = np.dtype(data.dtype).itemsize
      held = ([(_layout.slices_to_box(sh.index, data.shape), sh.device.id, sh.data)
               for sh in data.addressable_shards] if kind == "jax"
              else [(tuple((0, n) for n in data.shape), None, data)])
      for box, device, value in held:
        entry = boxes.get(box)
        if entry is None:
          nbytes = int(np.prod(_layout.box_shape(box), dtype=np.int64)) * itemsize
          entry = boxes[box] = {"box": [list(b) for b in box], "devices": [], "offset": at,
                                "nbytes": nbytes, "crc32c": [0] * -(-nbytes // SEGMENT)}
          shards.append(value)
          entries.append(entry)
          at = _aligned(at + nbytes)
        if device is not None:
          entry["devices"].append(device)
      rec["boxes"] = list(boxes.values())
      recs.append(rec)
    out_items[item] = {"structure": structure, "leaves": recs}
  index = {"step": step, "run": run, "timeline": timeline, "process_index": jax.process_index(),
           "process_count": jax.process_count(),
           "devices": sorted(d.id for d in jax.local_devices()), "segment": SEGMENT,
           "items": out_items}
  return Blob(index, entries, shards, at)


def _host_bytes(value: Any) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(value)).reshape(-1).view(np.uint8)


def write(path: str, blob: Blob, max_host_bytes: int = 0) -> int:
  """Writes ``blob`` to ``path``: shards in rounds of at most ``max_host_bytes`` (0: one), each
  brought to the host in one transfer and written by parallel pwrites that compute each
  segment's CRC-32C on the way (one pass over the bytes); the header last; then fsyncs.

  Returns the file's size.
  """
  head = blob.header_bytes()
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # less the umask
  try:
    os.ftruncate(fd, head + blob.payload_bytes)
    sizes = [e["nbytes"] for e in blob.entries]
    for window in (_layout.split_by_size(sizes, max_host_bytes) if max_host_bytes
                   else [list(range(len(sizes)))]):
      on_device = [k for k in window if isinstance(blob.shards[k], jax.Array)]
      fetched = dict(zip(on_device, jax.device_get([blob.shards[k] for k in on_device])))
      data = {k: _host_bytes(fetched.get(k, blob.shards[k])) for k in window}

      def put(task: tuple[int, int], data=data) -> None:  # one segment of a shard
        k, j = task
        view = data[k][j * SEGMENT:(j + 1) * SEGMENT]
        blob.entries[k]["crc32c"][j] = _crc.value(view)
        pwrite(fd, view, head + blob.entries[k]["offset"] + j * SEGMENT)
      parallel(put, [(k, j) for k in window for j in range(len(blob.entries[k]["crc32c"]))])
      del data, fetched
    pwrite(fd, np.frombuffer(blob.header(head), np.uint8), 0)
    os.fsync(fd)
  finally:
    os.close(fd)
  return head + blob.payload_bytes


def pwrite(fd: int, data: np.ndarray, offset: int) -> None:
  """All of ``data`` into ``fd`` at ``offset``."""
  view, done = memoryview(data).cast("B"), 0
  while done < len(view):
    done += os.pwrite(fd, view[done:], offset + done)


class FileReader:
  """Reads a blob's bytes from its file for a replica exchange, one round at a time
  (:func:`orbax_flax.tiers._exchange.shift_parts`): nothing larger than a round is held."""

  def __init__(self, path: str):
    self._fd = _location.open_plain_fd(path, os.path.dirname(path))
    self.nbytes = os.fstat(self._fd).st_size

  def fill(self, row: np.ndarray, lo: int) -> None:
    """``row`` = bytes ``[lo, lo + len(row))`` of the file, zero past its end."""
    n = max(0, min(row.size, self.nbytes - lo))
    view = memoryview(row)
    parallel(lambda at: _cbytes.pread_exact(self._fd, view[at:min(n, at + SEGMENT)], lo + at),
             list(range(0, n, SEGMENT)))
    row[n:] = 0

  def close(self) -> None:
    os.close(self._fd)


@dataclasses.dataclass
class Payload:
  """A blob's shard bytes: ``data``, each shard at the offset its index entry names."""
  data: np.ndarray

  def box(self, offset: int, nbytes: int) -> np.ndarray:
    return self.data[offset:offset + nbytes]


def _header(head: bytes, size: int, where: str) -> int:
  """The index length a blob's first :data:`HEAD` bytes name, checked against the file size."""
  if len(head) < HEAD or head[:8] != MAGIC:
    raise errors.CheckpointCorruptedError(
        f"{where}: not a local checkpoint (header {head[:8]!r}, {size} bytes); it is damaged")
  (n,) = struct.unpack("<Q", head[8:HEAD])
  if n > size - HEAD:
    raise errors.CheckpointCorruptedError(
        f"{where}: its header names an index of {n} bytes, but the file holds {size}; it is"
        " damaged or cut short")
  return n


def read_blob(path: str, where: str) -> tuple[Manifest, Payload]:
  """The index and shard bytes of a blob file, read by parallel preads.

  The shard bytes go into one fresh 64-byte aligned mapping (JAX's CPU client
  adopts such buffers without a copy). Every segment's CRC-32C is checked by
  the thread that read it, while the bytes are in its cache.

  Raises:
    CheckpointCorruptedError: any byte is damaged; the message names the array.
  """
  fd = _location.open_plain_fd(path, os.path.dirname(path))
  try:
    size = os.fstat(fd).st_size
    n = _header(os.pread(fd, HEAD, 0), size, where)
    index, seg = _index(os.pread(fd, n, HEAD), where)
    start = HEAD + n
    segments = _segments(index, seg, size - start, where)
    payload = Payload(_staging.fresh_arrays([((size - start,), np.dtype(np.uint8))])[0]
                      if size > start else np.empty(0, np.uint8))
    view = memoryview(payload.data)

    def read(t: tuple[int, int, str, int]) -> None:
      lo, length, _, _ = t
      _pread_into(fd, view[lo:lo + length], start + lo, f"{where}: {path} is shorter than its"
                  " index says")
      _check(payload, t, where)
    parallel(read, segments)
  finally:
    os.close(fd)
  return index, payload


def _pread_into(fd: int, view: memoryview, offset: int, short: str) -> None:
  """Fills ``view`` from ``fd`` at ``offset``; CheckpointCorruptedError(``short``) at end of file."""
  try:
    _cbytes.pread_exact(fd, view, offset)
  except EOFError as e:
    raise errors.CheckpointCorruptedError(short) from e


def decode(blob: np.ndarray, where: str) -> tuple[Manifest, Payload]:
  """The index and the bytes of a blob in memory (a received replica); checks every byte."""
  n = _header(blob[:HEAD].tobytes(), blob.nbytes, where)
  index, seg = _index(blob[HEAD:HEAD + n].tobytes(), where)
  payload = Payload(blob[HEAD + n:])
  parallel(lambda t: _check(payload, t, where), _segments(index, seg, payload.data.nbytes, where))
  return index, payload


def _index(data: bytes, where: str) -> tuple[Manifest, int]:
  """The index's items as records, and its segment size (bytes per checksum)."""
  body = _manifest.unseal(_INDEX_MAGIC, data, f"{where} (its index)")
  try:
    index = json.loads(body)
  except ValueError as e:
    raise errors.CheckpointCorruptedError(f"{where}: damaged index ({e})") from e
  if not isinstance(index, dict) or not isinstance(index.get("items"), dict):
    raise errors.CheckpointCorruptedError(f"{where}: its index holds no items")
  seg = index.get("segment")
  if type(seg) is not int or seg < 1:
    raise errors.CheckpointCorruptedError(f"{where}: damaged index (segment {seg!r})")
  return Manifest(items=_manifest.decode_local_items(index["items"], f"{where} (its index)"),
                  process_count=index.get("process_count", 0)), seg


def _segments(index: Manifest, seg: int, size: int, where: str) -> list[tuple[int, int, str, int]]:
  """(payload offset, length, array name, CRC-32C) of every segment, each within ``size``."""
  out = []
  for item, saved in index.items.items():
    for rec in saved.leaves:
      for entry in rec.boxes if isinstance(rec, Array) else ():
        name = f"{item}/{rec.path_text} box {[list(b) for b in entry.box]}"
        offset, nbytes, crcs = entry.offset, entry.nbytes, entry.crc32c
        if offset + nbytes > size or len(crcs) != -(-nbytes // seg):
          problem = ValueError(f"{name}: {nbytes} bytes at {offset} of {size}")
          raise errors.CheckpointCorruptedError(f"{where}: damaged index ({problem!r})")
        out.extend((offset + k * seg, min(seg, nbytes - k * seg), name, crc)
                   for k, crc in enumerate(crcs))
  return out


def _check(payload: Payload, t: tuple[int, int, str, int], where: str) -> None:
  lo, length, name, crc = t
  if _crc.value(payload.data[lo:lo + length]) != crc:
    raise errors.CheckpointCorruptedError(
        f"{where}: checksum mismatch in {name}; the local copy is damaged")


def parallel(fn, tasks: list) -> None:
  """``fn`` over ``tasks`` on up to :data:`WRITERS` threads; the first error is raised."""
  _threads.parallel_map(fn, tasks, WRITERS, name="orbax_flax-blob")


def match(index: Manifest, target: Mapping[str, Any], *, partial: bool = False,
          allow_lossy_casts: bool = False, casts: list | None = None,
          source: str = "the local checkpoint") -> targets.Match:
  """The engine's target check of a blob's index (:func:`orbax_flax.engine.targets.match_target`).

  Raises:
    TreeMismatchError, ValueError: as the persistent tier would for this target.
  """
  return targets.match_target(index, target, partial=partial,
                              allow_lossy_casts=allow_lossy_casts, casts=casts, source=source)


def build(m: targets.Match, index: Manifest, payload: Payload) -> dict[str, Any]:
  """The items ``m`` asks for, from a blob's bytes, placed by the engine (one ``device_put``).

  Each target box must be one shard this process saved (the same mesh and
  shardings): the first device of each adopts the aligned buffer, as in the
  persistent tier. Items asked for whole (``None``) come back as saved.

  Raises:
    LayoutChanged: the target needs a box this blob does not hold whole.
  """
  datas = {}
  for w, item, _ in m.wants:
    held = {e.box: e for e in w.rec.boxes}
    saved = w.rec.np_dtype
    bufs = []
    for box in w.boxes:
      e = held.get(box)
      if e is None:
        raise LayoutChanged(
            f"{item}/{w.rec.path_text}: this process needs box {list(box)},"
            " which its local checkpoint does not hold as one shard (another mesh or sharding)")
      b = payload.box(e.offset, e.nbytes).view(saved).reshape(_layout.box_shape(box))
      bufs.append(b if b.dtype == w.dtype else b.astype(w.dtype))
    datas[id(w)] = bufs
  out = m.trees(restoring.assemble([w for w, _, _ in m.wants], datas))
  for item in m.whole:
    out[item] = _whole(item, index.items[item], payload)
  return out


def _whole(item: str, saved: Item, payload: Payload) -> Any:
  """An item as saved, as host values (e.g. the data iterator positions of every process)."""
  values = []
  for rec in saved.leaves:
    if not isinstance(rec, Array):
      values.append(rec.decoded())
      continue
    full = tuple((0, n) for n in rec.shape)
    entry = next((e for e in rec.boxes if e.box == full), None)
    if entry is None:
      raise LayoutChanged(f"{item}/{rec.path_text}: not held whole here")
    data = payload.box(entry.offset, entry.nbytes).view(rec.np_dtype).reshape(rec.shape)
    values.append(jax.random.wrap_key_data(data, impl=rec.key_impl) if rec.key_impl else data)
  return _tree.decode_structure(saved.structure, values)
