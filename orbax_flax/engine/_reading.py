"""Reading stored array bytes into the caller's final buffers.

A restore knows, for every box of every array it builds, the host buffer the
bytes must end up in (:class:`Fill`). This module brings them there:

* **Local checkpoints**: the OCDBT index of each process database (read
  through tensorstore) says in which data file, at which offset, each chunk
  lies. A chunk that covers a contiguous part of one destination is read with
  ``preadv`` straight into it, and its zarr3 CRC-32C checked there: one copy,
  no intermediate buffer, which is what makes a restore run at the speed of
  the disk and take no more memory than the state. A chunk needed by several
  destinations, or only in part (another mesh), is read once into a reused
  temporary buffer, checked, and copied out.
* **Object stores** (or anything the index cannot describe): tensorstore
  reads the chunks and checks them, copying into the destinations.

Where chunks lie comes from the databases' indexes
(:class:`orbax_flax.format._tsio.ChunkIndex`); the shared temporary buffers and
open files (:class:`TempPool` and its kin) are at the end of this module.

Either way the format is tensorstore's own (zarr3 chunks with the ``crc32c``
codec inside OCDBT), so tensorstore reads these checkpoints too. Temporary
memory is bounded by the budget (``max_host_bytes``, or 64 MiB), plus one
chunk.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from orbax_flax.core import _crc
from orbax_flax.core import _threads
from orbax_flax.format import _layout
from orbax_flax.format import _manifest
from orbax_flax.core import _location
from orbax_flax.format import _tsio
from orbax_flax import errors
from orbax_flax.core._location import Location
from orbax_flax.format._manifest import Array, Manifest
from orbax_flax.differential import refs  # chunks another step holds

_DEFAULT_TEMP_BYTES = 64 << 20
_PACKED_SLICE = 512 << 10  # packed chunks are streamed in slices of this size
_THREADS = 8  # deep queues help cold reads; the copies release the GIL


@dataclasses.dataclass
class Fill:
  """``box`` of a chunked array, to land in ``out`` (the box's shape, stored dtype)."""
  item: str
  rec: Array
  box: _layout.Box
  out: np.ndarray


@dataclasses.dataclass
class PackedFill:
  """A small array packed in process ``owner``'s buffer at bytes ``[lo, hi)``.

  Once read, ``out[...] = array[index]`` for every ``(index, out)`` of
  ``dests``; the array has ``dtype`` and ``shape``.
  """
  item: str
  owner: int
  lo: int
  hi: int
  dtype: np.dtype
  shape: tuple[int, ...]
  dests: list[tuple[tuple[slice, ...], np.ndarray]]
  name: str        # key path, for errors ("": the path of ``rec``, worked out only for one)
  rec: Array | None = None
  _partial: np.ndarray | None = None  # the bytes, while an array spanning two chunks is read
  _missing: int = 0

  @property
  def nbytes(self) -> int:
    return self.hi - self.lo

  def deliver(self, lo: int, data: np.ndarray, lock: threading.Lock) -> None:
    """Takes bytes ``[lo, lo + len(data))`` of the packed buffer (those it covers of itself)."""
    a, b = max(self.lo, lo), min(self.hi, lo + data.nbytes)
    part = data[a - lo:b - lo]
    if a == self.lo and b == self.hi:
      whole = part
    else:
      with lock:
        if self._partial is None:
          self._partial, self._missing = np.empty(self.nbytes, np.uint8), self.nbytes
        self._partial[a - self.lo:b - self.lo] = part
        self._missing -= b - a
        if self._missing:
          return
        whole, self._partial = self._partial, None
    array = whole.view(self.dtype).reshape(self.shape)
    for index, out in self.dests:
      np.copyto(out, array[index] if index else array)


def _direct_ok(rec: Array) -> bool:
  dtype = rec.np_stored_dtype
  return sys.byteorder == "little" and dtype.name not in _SUB_BYTE


_SUB_BYTE = frozenset({"int2", "int4", "uint2", "uint4", "float4_e2m1fn"})


class OwnDatabases:
  """Where the chunks of a checkpoint that references no other step are: its own process
  databases, ``<item>/p<process>-<generation>``. (A differential checkpoint's reader uses
  :class:`orbax_flax.differential.refs.Homes`, which finds its bases too.)

  Example:
    >>> OwnDatabases(Location.parse("/tmp/ckpt/7"), "0123456789abcdef").db_name("params", 1)
    'params/p1-0123456789abcdef'
  """

  def __init__(self, loc: Location, generation: str):
    self.loc, self.generation = loc, generation

  def db_name(self, item: str, owner: int) -> str:
    return _tsio.db_name(item, owner, self.generation)

  def home(self, item: str, owner: int) -> tuple[Location, str]:
    """(checkpoint location, database name) of the chunks of ``owner``."""
    return self.loc, self.db_name(item, owner)


class Reader:
  """Fills destination buffers from one checkpoint's stored chunks.

  Args:
    loc: the checkpoint.
    manifest: its decoded manifest.
    max_host_bytes: bound on temporary memory (0: 64 MiB).
  """

  def __init__(self, loc: Location, manifest: Manifest, max_host_bytes: int = 0,
               progress: Any = None):
    self.loc, self.manifest = loc, manifest
    self.progress = progress  # an orbax_flax.core._progress.Progress, or None
    # A differential checkpoint's chunks may lie in the steps it references (its bases).
    self.homes = (refs.Homes(loc, manifest.generation, manifest.bases) if manifest.bases
                  else OwnDatabases(loc, manifest.generation))
    self.index = _tsio.ChunkIndex(loc, self.homes) if loc.is_local else None
    self.temps = TempPool(max_host_bytes or _DEFAULT_TEMP_BYTES)
    self.bytes_read = 0
    self._lock = threading.Lock()
    self._identified: set[tuple[str, int]] = set()

  def db(self, item: str, owner: int) -> str:
    return self.homes.db_name(item, owner)

  # ------------------------------------------------------------------ which database is this

  def identify(self, dbs: Sequence[tuple[str, int]]) -> None:
    """Checks that each ``(item, owner)`` database is the one it is meant to be.

    A database names itself (``orbax_flax.format._tsio.IDENTITY_KEY``: item, process
    and generation). A name that differs means the database was moved from
    another item or process, or copied from another checkpoint: its chunks,
    each intact, would be another array's values. A manifest without
    ``database_identity`` is read without this check.

    Raises:
      CheckpointCorruptedError: naming the database and what it says it is.
    """
    for item, owner in dict.fromkeys(dbs):
      if (item, owner) in self._identified:
        continue
      loc, db = self.homes.home(item, owner)
      found = self._identity_value(item, owner, loc, db)
      own = owner < _manifest.OWNER_STRIDE  # (larger: a base's process)
      if found is None and own and self.manifest.database_identity:
        raise self._wrong_database(item, owner, f"it does not name itself (its {_tsio.IDENTITY_KEY}"
                                   " key is missing): it was not written with this checkpoint")
      if found is not None and found != _tsio.identity(db):
        prefix = len(_tsio.identity(""))
        raise self._wrong_database(item, owner, "it names itself"
                                   f" {found[prefix:prefix + 200].decode(errors='replace')!r},"
                                   f" not {db!r}: it was moved here from another item or process,"
                                   " or copied from another checkpoint")
      self._identified.add((item, owner))

  def _stored_lengths(self, item: str, owner: int) -> dict[bytes, int] | None:
    if self.index is not None:
      index = self.index.get(item, owner)
      return None if index is None else {k: at.length for k, at in index.items()}
    return _tsio.stored_lengths(*self.homes.home(item, owner))

  def _identity_value(self, item: str, owner: int, loc: Location, db: str) -> bytes | None:
    index = self.index.get(item, owner) if self.index is not None else None
    if index is not None:
      at = index.get(_tsio.IDENTITY_KEY.encode())
      if at is None or at.inline is not None:
        return None if at is None else at.inline
      try:
        with _location.open_plain(at.file, str(self.loc)) as f:
          f.seek(at.offset)
          return f.read(min(at.length, 4096))  # (a longer one is no name this library writes)
      except OSError as e:
        raise _location.storage_error(self.loc, f"reading {at.file}", e) from e
    try:
      kv = ts.KvStore.open(_tsio.db_spec(loc, db), context=_tsio.context()).result()
      r = kv.read(_tsio.IDENTITY_KEY).result()
    except ValueError as e:
      raise _read_error(self.loc, item, "(database identity)", self.db(item, owner), e) from e
    return bytes(r.value) if r.state == "value" else None

  # ------------------------------------------------------------------ sizes, before allocating

  def stored_problems(self, arrays: Sequence[tuple[str, Array]]) -> dict[tuple[str, str], str]:
    """What the databases contradict of the manifest's sizes, per ``(item, array name)``.

    Checked against the databases' indexes (local checkpoints), before any
    buffer is allocated: each array's chunks are stored at the length its chunk
    shape gives, and a database holds at least as many of them as the manifest
    assigns to it (every chunk is stored since ``all_chunks_stored``). So an
    array the manifest makes larger than its stored bytes, by its shape, its
    chunk shape or its list of owners, is refused before a byte is allocated
    for it. The indexes place every value inside its data file
    (:class:`orbax_flax.format._tsio.ChunkIndex`), so the stored bytes are bounded by the
    files. Linear in the number of chunks. On an object store the lengths come
    from each database's OCDBT index (a few small reads, no chunk read).
    """
    needs = [(item, rec) for item, rec in arrays if rec.owners]
    dbs = [(item, o) for item, rec in needs for o in set(rec.owners)]
    if self.index is not None:
      self.index.load(dbs)
    self.identify(dbs)
    stats: dict[tuple[str, int], dict[bytes, tuple[int, set[int]]]] = {}
    problems: dict[tuple[str, str], str] = {}
    packed: dict[tuple[str, int], tuple[int, int] | None] = {}  # per buffer, worked out once
    for item, rec in needs:
      if rec.is_packed:
        owner = rec.owners[0]
        if (item, owner) not in packed:
          packed[item, owner] = self._packed_chunks(item, owner)
        if packed[item, owner] is None:
          continue  # in a base's packed buffer: checked as that base's chunks are read
        chunk_bytes, n = packed[item, owner]
        name, per = _layout.PACKED, {owner: n}
      else:
        name, per = rec.name, collections.Counter(rec.owners)
        chunk_bytes = rec.chunk_nbytes
        if rec.np_stored_dtype.name in _SUB_BYTE:
          chunk_bytes = -1  # stored packed by tensorstore: lengths not compared
      for owner, n in per.items():
        if (item, owner) not in stats:
          lengths = self._stored_lengths(item, owner)
          if lengths is None:
            continue  # a layout the index reader does not know: tensorstore checks as it reads
          stats[item, owner] = _array_stats(lengths)
        count, lengths = stats[item, owner].get(name.encode(), (0, set()))
        problem = None
        if count < n and self.manifest.all_chunks_stored:
          problem = (f"the manifest places {n} chunk(s) in this database, which holds {count}:"
                     " the manifest's shape, chunk shape or owners do not match what was stored")
        elif chunk_bytes >= 0 and lengths - {chunk_bytes + 4}:
          problem = (f"its chunks are stored as {sorted(lengths - {chunk_bytes + 4})[0] - 4}"
                     f" bytes where the manifest's chunk shape gives {chunk_bytes}")
        if problem:
          key = (item, rec.name)
          problems.setdefault(key, str(self._corrupted(
              item, rec.path_text if not rec.is_packed else _packed_names_of(rec), owner, problem)))
    return problems

  def _packed_chunks(self, item: str, owner: int) -> tuple[int, int] | None:
    """(chunk length, number of chunks it stores) of a packed buffer; None: a base's."""
    if owner >= _manifest.OWNER_STRIDE:  # a base's process
      return None
    size = self.manifest.items[item].packed[owner]
    chunk_bytes = _layout.pack_chunk_bytes(size)
    pieces = self.manifest.items[item].packed_pieces.get(owner)
    own = ({k for lo, hi, base, _ in pieces if base < 0
            for k in range(lo // chunk_bytes, (hi - 1) // chunk_bytes + 1)} if pieces
           else range(-(-size // chunk_bytes)))  # a differential save stores its own pieces
    return chunk_bytes, len(own)

  # ------------------------------------------------------------------ entry point

  def read(self, fills: Sequence[Fill], packed: Sequence[PackedFill] = ()) -> None:
    """Fills every ``out``; raises CheckpointCorruptedError / StorageError naming the array."""
    dbs = ([(f.item, o) for f in fills for o in set(f.rec.owners)]
           + [(p.item, p.owner) for p in packed])
    if self.index is not None:
      self.index.load(dbs)
    self.identify(dbs)
    jobs: list[tuple[tuple, Any]] = []   # (sort key, callable)
    slow: list[Fill] = []
    chunk_needs: dict[tuple[str, int, str, int], list[tuple[Fill, _layout.Box]]] = {}
    for f in fills:
      rec = f.rec
      chunking = _layout.Chunking(rec.shape, rec.chunk_shape)
      direct = self.index is not None and _direct_ok(rec) and all(
          self.index.get(f.item, o) is not None for o in set(rec.owners))
      if not direct:
        slow.append(f)
        continue
      for c in chunking.chunks_in_box(f.box):
        inner = _layout.intersect(chunking.chunk_box(c), f.box)
        chunk_needs.setdefault((f.item, rec.owners[c], rec.name, c), []).append((f, inner))
    for (item, owner, name, c), dests in chunk_needs.items():
      f0 = dests[0][0]
      chunking = _layout.Chunking(f0.rec.shape, f0.rec.chunk_shape)
      coords = chunking.chunk_coords(c)
      located = self.index.get(item, owner).get(_tsio.chunk_key(name, coords).encode())
      if located is None:
        if not self.manifest.all_chunks_stored:
          continue  # without all_chunks_stored an absent chunk is all zeros
        raise self._corrupted(item, f0.rec.path_text, owner,
                              f"chunk {_tsio.chunk_key(name, coords)} is missing from the database")
      chunk_box = chunking.chunk_box(c)
      order = (located.file or "", located.offset, located.length)
      if (len(dests) == 1 and dests[0][1] == chunk_box and located.file is not None
          and contiguous(chunk_box, dests[0][0].box)):
        f, inner = dests[0]
        jobs.append((order, (self._read_into, (f, inner, located, owner))))
      else:
        jobs.append((order, (self._read_scatter, (dests, chunk_box, located, owner))))
    for item, owner, k, lo, hi, stored, pfs in _packed_groups(packed, self.manifest):
      if self.index is not None and self.index.get(item, owner) is not None:
        key = f"{_layout.PACKED}/c/{k}".encode()
        located = self.index.get(item, owner).get(key)
        if located is None:
          if not self.manifest.all_chunks_stored:
            zeros = np.zeros(hi - lo, np.uint8)  # without all_chunks_stored an absent chunk is zeros
            for p in pfs:
              p.deliver(lo, zeros, self._lock)
            continue
          raise self._corrupted(item, _packed_names(pfs), owner,
                                f"chunk {key.decode()} is missing from the database")
        jobs.append(((located.file or "", located.offset, located.length),
                     (self._read_packed, (pfs, lo, hi, stored, located, owner))))
      else:
        jobs.append((("", 0, 0), (self._read_packed_ts, (pfs, lo, hi, owner))))
    # One task per data file, its chunks in file order: each thread reads files
    # sequentially, as the kernel's readahead likes (cold reads), largest first.
    by_file: dict[str, list[tuple[tuple, Any]]] = {}
    for job in jobs:
      by_file.setdefault(job[0][0], []).append(job)
    tasks = []
    per_task = max(1, -(-len(jobs) // _THREADS))  # few files: each split into contiguous runs
    for file_jobs in by_file.values():
      file_jobs.sort(key=lambda j: j[0])
      tasks += [file_jobs[i:i + per_task] for i in range(0, len(file_jobs), per_task)]
    tasks.sort(key=len, reverse=True)
    fds = Files()
    stop = threading.Event()
    try:
      self._run([(run_in_order, ([(fn, args + (fds,)) for _, (fn, args) in t],
                                  t[0][0][0], t[0][0][1], t[-1][0][1] + t[-1][0][2] - t[0][0][1], fds,
                                  stop))
                 for t in tasks], stop)
    finally:
      fds.close()
    if slow:
      self._read_with_tensorstore(slow)

  def _run(self, calls: list[tuple[Any, tuple]], stop: threading.Event) -> None:
    """Runs ``fn(*args)`` for each call on the reading threads; raises the first failure.

    The first failure ends the read: reads not started are dropped, each
    running one stops after its current chunk (the calls watch ``stop``), and a
    thread waiting for temporary memory is woken. Every wait here is on reads
    of local files, each of which ends.
    """
    def wake() -> None:  # the running calls stop after their current chunk
      stop.set()
      self.temps.abort(errors.CheckpointError("the restore's read ended"))
    try:
      _threads.parallel_map(lambda call: call[0](*call[1]), calls, _THREADS,
                            name="orbax_flax-read", wake=wake)
    finally:
      self.temps.reset()

  # ------------------------------------------------------------------ direct reads

  def _pread(self, fds: Files, item: str, what: object, owner: int, located: _tsio.Located,
             into: np.ndarray | None) -> tuple[np.ndarray, int]:
    """Reads a chunk value into ``into`` (its data part) or a temp; returns (data, stored crc)."""
    n = located.length - 4
    if located.inline is not None:
      value = located.inline
      data = np.frombuffer(value, np.uint8, n)
      if into is not None:
        np.copyto(into, data)
        data = into
      return data, int.from_bytes(value[n:], "little")
    crc = bytearray(4)
    temp = self.temps.get(n) if into is None else None
    dst = into if into is not None else temp[:n]
    try:  # on any error the temporary buffer goes back to the pool (others may wait for it)
      try:
        got = _location.pread_into(fds.get(located.file), [dst, crc], located.offset)
      except FileNotFoundError as e:
        raise self._corrupted(item, what, owner, f"data file {located.file} is missing") from e
      except OSError as e:
        raise _location.storage_error(self.loc, f"reading {located.file}", e) from e
      if got != located.length:
        raise self._corrupted(item, what, owner, f"data file {located.file} is shorter than its"
                              f" index says ({got} of {located.length} bytes at {located.offset}:"
                              " truncated?)")
    except BaseException:
      if temp is not None:
        self.temps.put(temp, n)
      raise
    self._count(got)
    return dst, int.from_bytes(crc, "little")

  def _check(self, data: np.ndarray, stored: int, item: str, what: object, owner: int,
             located: _tsio.Located) -> None:
    if _crc.value(data) != stored:
      where = "inline in the index" if located.file is None else (
          f"{located.file}, bytes {located.offset}+{located.length}")
      raise self._corrupted(item, what, owner, f"the stored CRC-32C does not match the bytes"
                            f" read ({where})")

  def _expect(self, item: str, what: object, owner: int, located: _tsio.Located, n: int) -> None:
    if located.length != n + 4:
      raise self._corrupted(item, what, owner, f"a chunk holds {located.length - 4} bytes where"
                            f" {n} are expected")

  def _read_into(self, f: Fill, inner: _layout.Box, located: _tsio.Located, owner: int,
                 fds: Files) -> None:
    what = f.rec.path_text
    view = flat_view(f.out, inner, f.box)
    self._expect(f.item, what, owner, located, view.nbytes)
    data, crc = self._pread(fds, f.item, what, owner, located, view)
    self._check(data, crc, f.item, what, owner, located)

  def _read_scatter(self, dests: list[tuple[Fill, _layout.Box]], chunk_box: _layout.Box,
                    located: _tsio.Located, owner: int, fds: Files) -> None:
    f0 = dests[0][0]
    what = f0.rec.path_text
    shape = _layout.box_shape(chunk_box)
    n = math.prod(shape) * f0.out.dtype.itemsize
    self._expect(f0.item, what, owner, located, n)
    data, crc = self._pread(fds, f0.item, what, owner, located, None)
    try:
      self._check(data, crc, f0.item, what, owner, located)
      chunk = data.view(f0.out.dtype).reshape(shape)
      for f, inner in dests:
        np.copyto(f.out[_layout.relative(inner, f.box)], chunk[_layout.relative(inner, chunk_box)])
    finally:
      if located.inline is None:
        self.temps.put(data.base if data.base is not None else data, n)

  def _read_packed(self, pfs: list[PackedFill], lo: int, hi: int, stored: int,
                   located: _tsio.Located, owner: int, fds: Files) -> None:
    """One chunk of a packed buffer (``stored`` bytes; ``[lo, hi)`` of the buffer are real)."""
    item = pfs[0].item
    what = _packed_names(pfs)
    self._expect(item, what, owner, located, stored)
    if located.inline is not None:
      data, crc = self._pread(fds, item, what, owner, located, None)
      self._check(data, crc, item, what, owner, located)
      for p in pfs:
        p.deliver(lo, data[:hi - lo], self._lock)
      return
    # Streamed in slices: the bytes go to their arrays as they arrive, the
    # checksum is extended slice by slice and compared at the end (a mismatch
    # fails the restore, so nothing read is ever handed out). Temporary memory
    # is one slice, not one chunk.
    try:
      fd = fds.get(located.file)
    except FileNotFoundError as e:
      raise self._corrupted(item, what, owner, f"data file {located.file} is missing") from e
    except OSError as e:
      raise _location.storage_error(self.loc, f"reading {located.file}", e) from e
    crc = 0
    pos = 0
    while pos < stored:
      n = min(_PACKED_SLICE, stored - pos)
      buf = self.temps.get(n)
      try:
        data = buf[:n]
        got = _location.pread_into(fd, [data], located.offset + pos)
        if got != n:
          raise self._corrupted(item, what, owner, f"data file {located.file} is shorter than"
                                f" its index says (truncated at {located.offset + pos + got})")
        crc = _crc.extend(crc, data)
        if pos < hi - lo:
          real = data[:min(n, hi - lo - pos)]
          for p in pfs:
            if p.lo < lo + pos + real.nbytes and p.hi > lo + pos:
              p.deliver(lo + pos, real, self._lock)
      finally:
        self.temps.put(buf, n)
      pos += n
    tail = os.pread(fd, 4, located.offset + stored)
    if len(tail) != 4:
      raise self._corrupted(item, what, owner, f"data file {located.file} is shorter than its"
                            " index says (truncated?)")
    self._count(stored + 4)
    if crc != int.from_bytes(tail, "little"):
      raise self._corrupted(item, what, owner, "the stored CRC-32C does not match the bytes read"
                            f" ({located.file}, bytes {located.offset}+{located.length})")

  # ------------------------------------------------------------------ through tensorstore

  def _open(self, item: str, owner: int, name: str, shape: Any, dtype: str, chunk: Any,
            ctx: ts.Context) -> Any:
    spec = _tsio.array_spec(_tsio.db_spec(*self.homes.home(item, owner)), name, shape, dtype,
                            chunk)
    # A chunk every save stores (all_chunks_stored) that is missing is damage, or data deleted
    # or replaced under the read: an error, never zeros read in its place.
    spec["fill_missing_data_reads"] = not self.manifest.all_chunks_stored
    return ts.open(spec, open=True, context=ctx)

  def _resolve(self, fut: Any, item: str, what: object, owner: int) -> Any:
    try:
      return fut.result()
    except ValueError as e:
      raise _read_error(self.loc, item, what, self.db(item, owner), e) from e

  def _read_packed_ts(self, pfs: list[PackedFill], lo: int, hi: int, owner: int,
                      fds: Files) -> None:
    del fds
    item = pfs[0].item
    size = self.manifest.items[item].packed[owner]
    st = self._resolve(self._open(item, owner, _layout.PACKED, (size,), "uint8",
                                  (_layout.pack_chunk_bytes(size),), _tsio.context()),
                       item, _packed_names(pfs), owner)
    data = self._resolve(st[lo:hi].read(), item, _packed_names(pfs), owner)
    for p in pfs:
      p.deliver(lo, data, self._lock)

  def _read_with_tensorstore(self, fills: Sequence[Fill]) -> None:
    """Tensorstore reads (object stores): every chunk checked, copied into ``out``.

    Each window's destinations are within the budget; the chunks tensorstore fetches for
    them are held in memory, with their decoded copies, until copied. So at most as many
    chunks as the budget holds twice (one at least) are being read at once: the store's
    concurrent requests, and the reads issued (a fetched chunk waits for its decoding and
    copy, which a busy CPU makes slow: with only the requests bounded, fetched chunks pile
    up while they wait).
    """
    chunk = max((f.rec.chunk_nbytes for f in fills), default=1)
    limit = max(1, min(32, self.temps.limit // max(2 * chunk, 1)))
    requests = {"limit": limit}
    ctx = _tsio.context({"s3_request_concurrency": requests,
                         "gcs_request_concurrency": requests})
    stores = {}
    for f in fills:
      for owner in set(f.rec.owners):
        k = (f.item, owner, f.rec.name)
        if k not in stores:
          r = f.rec
          stores[k] = self._open(f.item, owner, r.name, r.shape, r.stored_dtype, r.chunk_shape,
                                 ctx)
    window, used = [], 0
    for f in list(fills) + [None]:
      if f is not None and (not window or used + f.out.nbytes <= self.temps.limit):
        window.append(f)
        used += f.out.nbytes
        continue
      reading: collections.deque = collections.deque()  # (future, chunks, item, what, owner)
      in_flight = 0  # chunks of the reads in ``reading``
      for g in window:
        rec = g.rec
        chunking = _layout.Chunking(rec.shape, rec.chunk_shape)
        dst = ts.array(g.out, copy=False, write=True).translate_to[tuple(lo for lo, _ in g.box)]
        chunks = chunking.chunks_in_box(g.box)
        owners = {rec.owners[c] for c in chunks}
        if len(owners) == 1:  # one database: boxes of up to ``limit`` chunks
          owner = owners.pop()
          pieces = [(b, owner) for b in chunking.split_box(g.box, limit)]
        else:  # chunk by chunk, each from its owner's database
          pieces = [(_layout.intersect(chunking.chunk_box(c), g.box), rec.owners[c]) for c in chunks]
        what = rec.path_text
        for piece, owner in pieces:
          n = len(chunking.chunks_in_box(piece))
          while reading and in_flight + n > limit:
            fut, done, item, w, o = reading.popleft()
            self._resolve(fut, item, w, o)
            in_flight -= done
          st = self._resolve(stores[g.item, owner, rec.name], g.item, what, owner)
          sl = _layout.box_to_slices(piece)
          reading.append((dst[sl].write(st[sl]), n, g.item, what, owner))
          in_flight += n
      for fut, _, item, what, owner in reading:
        self._resolve(fut, item, what, owner)
      self._count(used)
      window, used = ([f], f.out.nbytes) if f is not None else ([], 0)

  def _count(self, n: int) -> None:
    with self._lock:
      self.bytes_read += n
    if self.progress is not None:
      self.progress.add(n)

  # ------------------------------------------------------------------ errors

  def _wrong_database(self, item: str, owner: int, problem: str) -> errors.CheckpointCorruptedError:
    return errors.CheckpointCorruptedError(
        f"checkpoint data is corrupted: item {item!r}, database"
        f" {self.loc.join(self.db(item, owner))}: {problem}. Restore from another checkpoint.")

  def _corrupted(self, item: str, what: object, owner: int, problem: str) -> errors.CheckpointCorruptedError:
    return errors.CheckpointCorruptedError(
        f"checkpoint data is corrupted: item {item!r}, array {what}, database"
        f" {self.loc.join(self.db(item, owner))}: {problem}. Restore from another checkpoint.")


# ---------------------------------------------------------------- a record's box, read

def read_requests(reader: Reader | None, requests: Sequence[tuple], progress: Any = None) -> None:
  """Fills every request's buffer: the one place a manifest record becomes a read.

  A request is ``(item, record, box, out)``: fill ``out`` (the box's shape, the
  record's dtype) with that box of the array. A transform's record expands
  into requests on the records it was made from (``derived``); a foreign
  record reads itself (``source``); our own records become the reader's
  :class:`Fill`s and :class:`PackedFill`s (one per packed array, however many
  boxes want it), read together. ``progress`` counts the bytes of requests
  the reader does not count itself (foreign and derived records).
  """
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
  fills, sourced = [], []
  packed: dict[tuple[str, int], PackedFill] = {}
  for item, rec, box, out in base:
    if not isinstance(rec, Array):
      out[...] = rec.decoded()
    elif rec.source is not None:
      sourced.append((rec, box, out))
    elif rec.is_packed:
      dest = (_layout.box_to_slices(box), out)
      got = packed.get((item, id(rec)))
      if got is None:
        lo = rec.packed_offset
        packed[(item, id(rec))] = PackedFill(item, rec.owners[0], lo, lo + rec.nbytes,
                                             rec.np_dtype, rec.shape, [dest], "", rec)
      else:
        got.dests.append(dest)
    elif not rec.owners:
      out[...] = 0
    else:
      stored = rec.np_stored_dtype
      fills.append(Fill(item, rec, box, out if out.dtype == stored else out.view(stored)))
  if fills or packed:
    reader.read(fills, list(packed.values()))
  _read_sourced(sourced)
  for finish in reversed(finals):
    finish()
  if progress is not None:
    progress.add(sum(out.nbytes for _, rec, _, out in requests
                     if isinstance(rec, Array) and rec.reads_itself))


def _read_sourced(sourced: list[tuple]) -> None:
  """Foreign records' boxes, on a few threads with an even share of the bytes each (reads
  release the GIL)."""
  shares: list[list[tuple]] = [[] for _ in range(min(_THREADS, len(sourced)))]
  loads = [0] * len(shares)
  for req in sorted(sourced, key=lambda r: -r[2].nbytes):
    k = loads.index(min(loads))
    shares[k].append(req)
    loads[k] += req[2].nbytes

  def run(share):
    for rec, box, out in share:
      rec.source.read(box, out)
  _threads.parallel_map(run, shares, len(shares), name="orbax_flax-read")


def read_whole(reader: Reader | None, item: str, rec: Array) -> np.ndarray:
  """One array, whole, as a host numpy array."""
  out = np.empty(rec.shape, rec.np_dtype)
  read_requests(reader, [(item, rec, tuple((0, int(s)) for s in rec.shape), out)])
  return out


def _array_stats(stored: dict[bytes, int]) -> dict[bytes, tuple[int, set[int]]]:
  """Per array name in a database (``stored``: key -> length): (chunks, their stored lengths)."""
  out: dict[bytes, tuple[int, set[int]]] = {}
  for key, length in stored.items():
    name, sep, _ = key.partition(b"/c/")
    if sep:
      count, lengths = out.get(name, (0, set()))
      lengths.add(length)
      out[name] = (count + 1, lengths)
  return out


def _packed_names_of(rec: Array) -> str:
  return f"{rec.path_text} (packed)"


class _PackedNames:
  """The arrays of one packed chunk, named when a message is written (``str()``), not per read.

  The ``what`` of the read and error helpers below is a str or one of these.
  """

  def __init__(self, pfs: Sequence[PackedFill]):
    self._pfs = pfs

  def __str__(self) -> str:
    return packed_names([p.name or p.rec.path_text for p in self._pfs])


def _packed_names(pfs: Sequence[PackedFill]) -> Any:
  return _PackedNames(pfs)


def packed_names(names: Sequence[str], shown: int = 16) -> str:
  """Names the arrays one packed chunk holds, all of them up to `shown`.

  A packed chunk has one checksum, so every array in it is suspect when it fails; the
  message names each (a user deciding what to re-derive needs the whole list).
  """
  if len(names) == 1:
    return names[0]
  more = f" and {len(names) - shown} more" if len(names) > shown else ""
  return f"one of {', '.join(names[:shown])}{more} (packed together)"


def _packed_groups(packed: Sequence[PackedFill], manifest: Manifest):
  """Per packed chunk needed: (item, owner, chunk index, lo, hi, stored bytes, its fills).

  A packed buffer's last chunk is stored full length (zarr pads edge chunks).
  """
  groups: dict[tuple[str, int, int], list[PackedFill]] = {}
  for p in packed:
    size = manifest.items[p.item].packed[p.owner]
    chunk = _layout.pack_chunk_bytes(size)
    for k in range(p.lo // chunk, (p.hi - 1) // chunk + 1):
      groups.setdefault((p.item, p.owner, k), []).append(p)
  for (item, owner, k), pfs in groups.items():
    size = manifest.items[item].packed[owner]
    chunk = _layout.pack_chunk_bytes(size)
    yield item, owner, k, k * chunk, min(size, (k + 1) * chunk), chunk, pfs


def _read_error(loc: Location, item: str, path: str, db: str, e: Exception) -> Exception:
  if _tsio.is_corruption(e):
    return _tsio.corrupted(item, path, loc, db, e)
  return _location.storage_error(loc, f"reading {item}/{path}", e)


class TempPool:
  """Reused temporary buffers, at most ``limit`` bytes out at once (one larger alone), and
  as many kept for reuse (or the one larger).

  Every :meth:`get` is paired with a :meth:`put` on every path, errors
  included, so a wait in :meth:`get` lasts only as long as the reads holding
  buffers (each bounded: a local ``preadv``). Once a read of the restore has
  failed, :meth:`abort` wakes every waiting thread, which then raises instead
  of waiting for memory the restore no longer needs.
  """

  def __init__(self, limit: int):
    self.limit = limit
    self._free: list[np.ndarray] = []
    self._out = 0
    self._cond = threading.Condition()
    self._aborted: BaseException | None = None

  def get(self, n: int) -> np.ndarray:
    with self._cond:
      while self._out and self._out + n > self.limit and self._aborted is None:
        self._cond.wait()
      if self._aborted is not None:
        raise Aborted() from self._aborted
      self._out += n
      fits = [i for i, b in enumerate(self._free) if b.nbytes >= n]
      if fits:
        return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
    try:
      return np.empty(n, np.uint8)
    except BaseException:
      self.put(None, n)
      raise

  def put(self, buf: np.ndarray | None, n: int) -> None:
    with self._cond:
      self._out -= n
      if buf is not None:
        self._free.append(buf)
      # Kept: up to ``limit`` bytes, or the one buffer larger than it (a chunk larger than
      # the budget, read alone): freed and allocated again at every read, its memory stayed
      # in the allocator's per-thread arenas, many times over.
      self._free.sort(key=lambda b: b.nbytes)
      while len(self._free) > 1 and sum(b.nbytes for b in self._free) > self.limit:
        self._free.pop(0)
      self._cond.notify_all()

  def abort(self, error: BaseException) -> None:
    """Wakes every waiting :meth:`get` (which raises :class:`Aborted`); later gets raise too."""
    with self._cond:
      if self._aborted is None:
        self._aborted = error
      self._cond.notify_all()

  def reset(self) -> None:
    """Ready for the next read of the same reader (after an abort)."""
    with self._cond:
      self._aborted = None

  @property
  def out(self) -> int:
    """Bytes handed out and not yet returned (0 between reads)."""
    with self._cond:
      return self._out


class Aborted(Exception):
  """Raised in a reading thread that stops because another read of the restore failed."""


def contiguous(inner: _layout.Box, outer: _layout.Box) -> bool:
  """True if ``inner`` is one contiguous run of ``outer``'s C-order buffer."""
  sizes = _layout.box_shape(inner)
  full = _layout.box_shape(outer)
  d = next((i for i, s in enumerate(sizes) if s > 1), len(sizes))
  return all(sizes[j] == full[j] for j in range(d + 1, len(sizes)))


def flat_view(out: np.ndarray, inner: _layout.Box, outer: _layout.Box) -> np.ndarray:
  """The bytes of ``inner`` inside ``out`` (which holds ``outer``), as a flat uint8 view."""
  view = out[_layout.relative(inner, outer)]
  return view.reshape(-1).view(np.uint8)


def run_in_order(calls: list[tuple[Any, tuple]], file: str, start: int, length: int,
                  fds: Files, stop: threading.Event | None = None) -> None:
  """Runs the reads of one contiguous span of one data file, in file order.

  The kernel is told first that the whole span will be read (so that cold
  reads stream at the disk's speed rather than chunk by chunk). Once ``stop``
  is set (another read failed), the remaining reads are skipped.
  """
  with fds.reading(file):
    if file and length > 0 and hasattr(os, "posix_fadvise"):
      try:
        os.posix_fadvise(fds.get(file), start, length, os.POSIX_FADV_WILLNEED)
      except OSError:
        pass  # a missing file is reported by the read itself
    for fn, args in calls:
      if stop is not None and stop.is_set():
        return  # another read failed: the restore is over
      fn(*args)


class Files:
  """Read-only file descriptors shared by the reading threads, each open while a task reads
  its file (:meth:`reading`): a restore holds at most one a reading thread, not one a data
  file (a checkpoint of thousands of files under the usual limit of 1024 open files)."""

  def __init__(self):
    self._fds: dict[str, int] = {}
    self._readers: collections.Counter[str] = collections.Counter()
    self._lock = threading.Lock()

  @contextlib.contextmanager
  def reading(self, path: str) -> Iterator[None]:
    """A task reads ``path`` inside: its descriptor (opened at the first :meth:`get`) is
    closed once no task reads it."""
    with self._lock:
      self._readers[path] += 1
    try:
      yield
    finally:
      with self._lock:
        self._readers[path] -= 1
        fd = self._fds.pop(path, None) if not self._readers[path] else None
        if not self._readers[path]:
          del self._readers[path]
      if fd is not None:
        os.close(fd)

  def get(self, path: str) -> int:
    with self._lock:
      if path not in self._fds:
        self._fds[path] = os.open(path, os.O_RDONLY)
      return self._fds[path]

  def close(self) -> None:
    with self._lock:
      for fd in self._fds.values():
        os.close(fd)
      self._fds = {}
