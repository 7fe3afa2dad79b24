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
record (:func:`orbax_flax._planning.array_record`, ``value_record``) plus the
shards this process held (``boxes``). A restore checks the target with the
engine's :func:`orbax_flax.restoring.match_target` and places the arrays with
its :func:`~orbax_flax.restoring.assemble`: the same target gives the same
result, or the same error, as the persistent tier.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import struct
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from orbax_flax import _crc
from orbax_flax import _layout
from orbax_flax import _manifest
from orbax_flax import _planning
from orbax_flax import _staging
from orbax_flax import _tree
from orbax_flax import errors
from orbax_flax import restoring
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
  """A local checkpoint of one process: ``header`` (magic, length, index), then ``pieces``."""
  header: bytes
  pieces: list[np.ndarray]  # uint8 views of the shards (and zero padding), in payload order

  @property
  def nbytes(self) -> int:
    return len(self.header) + sum(p.nbytes for p in self.pieces)

  def parts(self) -> list[np.ndarray]:
    return [np.frombuffer(self.header, np.uint8)] + self.pieces


def encode(step: int, items: Mapping[str, Any], *, run: str = "", timeline: str = "") -> Blob:
  """This process's shards of ``items``: an index and views of the shard bytes (no copy on CPU).

  Each shard's bytes carry one CRC-32C per :data:`SEGMENT` bytes, computed in
  parallel, so that a restore checks each segment as it reads it, in parallel.
  """
  pieces: list[np.ndarray] = []
  entries: list[dict[str, Any]] = []
  shard_pieces: list[int] = []
  at = 0
  out_items = {}
  for item, tree in items.items():
    structure, leaves = _tree.encode_structure(tree)
    recs = []
    for path, leaf in leaves:
      kind = _tree.leaf_kind(leaf)
      if kind is None:
        raise _tree.unsupported_leaf_error(item, path, leaf)
      if kind == "value":
        recs.append(_planning.value_record(path, leaf))
        continue
      if kind == "jax" and leaf.is_deleted():
        raise _planning.deleted_leaf_error(item, path)
      rec, data = _planning.array_record(path, leaf, kind)
      boxes: dict[tuple, dict[str, Any]] = {}
      shards = ([(_layout.slices_to_box(sh.index, data.shape), sh.device.id, sh.data)
                 for sh in data.addressable_shards] if kind == "jax"
                else [(tuple((0, n) for n in data.shape), None, data)])
      for box, device, value in shards:
        entry = boxes.get(box)
        if entry is None:
          raw = np.ascontiguousarray(np.asarray(value)).reshape(-1).view(np.uint8)
          entry = boxes[box] = {"box": [list(b) for b in box], "devices": [], "offset": at,
                                "nbytes": raw.nbytes}
          shard_pieces.append(len(pieces))
          pieces.append(raw)
          entries.append(entry)
          at += raw.nbytes
          pad = -at % ALIGN
          if pad:
            pieces.append(np.zeros(pad, np.uint8))
            at += pad
        if device is not None:
          entry["devices"].append(device)
      rec["boxes"] = list(boxes.values())
      recs.append(rec)
    out_items[item] = {"structure": structure, "leaves": recs}
  shards = [pieces[k] for k in shard_pieces]
  segments = [(k, lo) for k, p in enumerate(shards) for lo in range(0, p.nbytes, SEGMENT)]
  with concurrent.futures.ThreadPoolExecutor(WRITERS) as pool:  # ctypes CRC: no GIL
    crcs = list(pool.map(lambda t: _crc.value(shards[t[0]][t[1]:t[1] + SEGMENT]), segments))
  for entry in entries:
    entry["crc32c"] = []
  for (k, _), crc in zip(segments, crcs):
    entries[k]["crc32c"].append(crc)
  body = json.dumps({
      "step": step, "run": run, "timeline": timeline, "process_index": jax.process_index(),
      "process_count": jax.process_count(), "devices": sorted(d.id for d in jax.local_devices()),
      "segment": SEGMENT, "items": out_items}).encode()
  sealed = _manifest.seal(_INDEX_MAGIC, body)
  pad = -(HEAD + len(sealed) + 1) % ALIGN + 1  # the JSON ends in spaces: the payload is aligned
  sealed = _manifest.seal(_INDEX_MAGIC, body + b" " * pad)
  return Blob(MAGIC + struct.pack("<Q", len(sealed)) + sealed, pieces)


def write_parts(path: str, parts: list[np.ndarray]) -> None:
  """Writes ``parts`` one after another into ``path`` with parallel pwrites, then fsyncs."""
  offsets, at = [], 0
  for part in parts:
    offsets.append(at)
    at += part.nbytes
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  try:
    os.ftruncate(fd, at)

    def put(task: tuple[int, int]) -> None:  # one segment of a part (a large part is many)
      k, lo = task
      view = memoryview(parts[k]).cast("B")[lo:lo + SEGMENT]
      done = 0
      while done < len(view):
        done += os.pwrite(fd, view[done:], offsets[k] + lo + done)
    parallel(put, [(k, lo) for k, p in enumerate(parts) for lo in range(0, p.nbytes, SEGMENT)])
    os.fsync(fd)
  finally:
    os.close(fd)


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


def read_blob(path: str, where: str) -> tuple[dict[str, Any], Payload]:
  """The index and shard bytes of a blob file, read by parallel preads.

  The shard bytes go into one fresh 64-byte aligned mapping (JAX's CPU client
  adopts such buffers without a copy). Every segment's CRC-32C is checked by
  the thread that read it, while the bytes are in its cache.

  Raises:
    CheckpointCorruptedError: any byte is damaged; the message names the array.
  """
  fd = os.open(path, os.O_RDONLY)
  try:
    size = os.fstat(fd).st_size
    n = _header(os.pread(fd, HEAD, 0), size, where)
    index = _index(os.pread(fd, n, HEAD), where)
    start = HEAD + n
    segments = _segments(index, size - start, where)
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


def read_bytes(path: str) -> np.ndarray:
  """A whole file into one fresh buffer, by parallel preads."""
  fd = os.open(path, os.O_RDONLY)
  try:
    size = os.fstat(fd).st_size
    out = np.empty(size, np.uint8)
    view = memoryview(out)
    parallel(lambda lo: _pread_into(fd, view[lo:lo + SEGMENT], lo,
                                    f"{path}: shorter than expected"),
             list(range(0, size, SEGMENT)))
  finally:
    os.close(fd)
  return out


def _pread_into(fd: int, view: memoryview, offset: int, short: str) -> None:
  """Fills ``view`` from ``fd`` at ``offset``; CheckpointCorruptedError(``short``) at end of file."""
  try:
    _cbytes.pread_exact(fd, view, offset)
  except EOFError as e:
    raise errors.CheckpointCorruptedError(short) from e


def decode(blob: np.ndarray, where: str) -> tuple[dict[str, Any], Payload]:
  """The index and the bytes of a blob in memory (a received replica); checks every byte."""
  n = _header(blob[:HEAD].tobytes(), blob.nbytes, where)
  index = _index(blob[HEAD:HEAD + n].tobytes(), where)
  payload = Payload(blob[HEAD + n:])
  parallel(lambda t: _check(payload, t, where), _segments(index, payload.data.nbytes, where))
  return index, payload


def _index(data: bytes, where: str) -> dict[str, Any]:
  body = _manifest.unseal(_INDEX_MAGIC, data, f"{where} (its index)")
  try:
    index = json.loads(body)
  except ValueError as e:
    raise errors.CheckpointCorruptedError(f"{where}: damaged index ({e})") from e
  if not isinstance(index, dict) or not isinstance(index.get("items"), dict):
    raise errors.CheckpointCorruptedError(f"{where}: its index holds no items")
  return index


def _segments(index: dict[str, Any], size: int, where: str) -> list[tuple[int, int, str, int]]:
  """(payload offset, length, array name, CRC-32C) of every segment, each within ``size``."""
  try:
    seg = int(index["segment"])
    out = []
    for item, saved in index["items"].items():
      for rec in saved["leaves"]:
        for entry in rec.get("boxes", ()):
          name = f"{item}/{_tree.path_str(tuple(rec['path']))} box {entry['box']}"
          offset, nbytes, crcs = int(entry["offset"]), int(entry["nbytes"]), entry["crc32c"]
          if seg < 1 or offset < 0 or nbytes < 0 or offset + nbytes > size or len(crcs) != -(
              -nbytes // seg):
            raise ValueError(f"{name}: {nbytes} bytes at {offset} of {size}")
          out.extend((offset + k * seg, min(seg, nbytes - k * seg), name, int(crc))
                     for k, crc in enumerate(crcs))
  except (KeyError, TypeError, ValueError, AttributeError) as e:
    raise errors.CheckpointCorruptedError(f"{where}: damaged index ({e!r})") from None
  return out


def _check(payload: Payload, t: tuple[int, int, str, int], where: str) -> None:
  lo, length, name, crc = t
  if _crc.value(payload.data[lo:lo + length]) != crc:
    raise errors.CheckpointCorruptedError(
        f"{where}: checksum mismatch in {name}; the local copy is damaged")


def parallel(fn, tasks: list) -> None:
  """``fn`` over ``tasks`` on up to :data:`WRITERS` threads; the first error is raised."""
  if len(tasks) <= 1:
    for t in tasks:
      fn(t)
    return
  with concurrent.futures.ThreadPoolExecutor(min(WRITERS, len(tasks))) as pool:
    for f in [pool.submit(fn, t) for t in tasks]:
      f.result()


def match(index: dict[str, Any], target: Mapping[str, Any], *, partial: bool = False,
          allow_lossy_casts: bool = False, casts: list | None = None,
          source: str = "the local checkpoint") -> restoring.Match:
  """The engine's target check of a blob's index (:func:`orbax_flax.restoring.match_target`).

  Raises:
    TreeMismatchError, ValueError: as the persistent tier would for this target.
  """
  return restoring.match_target(index, target, partial=partial,
                                allow_lossy_casts=allow_lossy_casts, casts=casts, source=source)


def build(m: restoring.Match, index: dict[str, Any], payload: Payload) -> dict[str, Any]:
  """The items ``m`` asks for, from a blob's bytes, placed by the engine (one ``device_put``).

  Each target box must be one shard this process saved (the same mesh and
  shardings): the first device of each adopts the aligned buffer, as in the
  persistent tier. Items asked for whole (``None``) come back as saved.

  Raises:
    LayoutChanged: the target needs a box this blob does not hold whole.
  """
  datas = {}
  for w, item, _ in m.wants:
    held = {tuple(map(tuple, e["box"])): e for e in w.rec["boxes"]}
    saved = _tree.dtype_from_name(w.rec["dtype"])
    bufs = []
    for box in w.boxes:
      e = held.get(box)
      if e is None:
        raise LayoutChanged(
            f"{item}/{_tree.path_str(tuple(w.rec['path']))}: this process needs box {list(box)},"
            " which its local checkpoint does not hold as one shard (another mesh or sharding)")
      b = payload.box(e["offset"], e["nbytes"]).view(saved).reshape(_layout.box_shape(box))
      bufs.append(b if b.dtype == w.dtype else b.astype(w.dtype))
    datas[id(w)] = bufs
  out = m.trees(restoring.assemble([w for w, _, _ in m.wants], datas))
  for item in m.whole:
    out[item] = _whole(item, index["items"][item], payload)
  return out


def _whole(item: str, saved: dict[str, Any], payload: Payload) -> Any:
  """An item as saved, as host values (e.g. the data iterator positions of every process)."""
  values = []
  for rec in saved["leaves"]:
    if rec["kind"] == "value":
      values.append(_tree.decode_value(rec["value"]))
      continue
    shape = tuple(rec["shape"])
    full = [list((0, n)) for n in shape]
    entry = next((e for e in rec["boxes"] if e["box"] == full), None)
    if entry is None:
      raise LayoutChanged(f"{item}/{_tree.path_str(tuple(rec['path']))}: not held whole here")
    data = payload.box(entry["offset"], entry["nbytes"]).view(
        _tree.dtype_from_name(rec["dtype"])).reshape(shape)
    values.append(jax.random.wrap_key_data(data, impl=rec["key_impl"]) if rec.get("key_impl")
                  else data)
  return _tree.decode_structure(saved["structure"], values)
