"""All array bytes go through tensorstore: zarr3 arrays inside OCDBT databases.

Each process writes the chunks it owns into its own OCDBT database per item
(``<item>/p<process>-<generation>``): one manifest and a few large data files
per process, whatever the number of arrays. Every chunk is encoded with the
zarr3 ``crc32c`` codec, so tensorstore verifies each chunk it reads; OCDBT
checksums its own tree nodes. Writes to one database go in one non-atomic
transaction per batch, so its manifest is written once per batch (once for a
save written in one batch).

A database's index (read through ``tensorstore.ocdbt.dump``, walked by
:func:`index_entries`) says, per key, in which data file at which offset the
value lies, or holds a small value inline. :class:`ChunkIndex` loads the
indexes of a local checkpoint once per restore so that
:mod:`orbax_flax.engine._reading` can ``preadv`` chunks straight into their
destinations (an index layout this code does not know yields None: the
reader then lets tensorstore read); :func:`stored_lengths` gives the stored
length of every value on any store, before a reader allocates anything.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from orbax_flax.core import _location
from orbax_flax.core import _threads
from orbax_flax import errors
from orbax_flax.core._location import Location

# zarr3 data types tensorstore stores natively; others are stored as raw bits.
_ZARR3_DTYPES = frozenset({
    "bool", "int2", "int4", "int8", "int16", "int32", "int64", "uint8", "uint16",
    "uint32", "uint64", "float16", "bfloat16", "float32", "float64", "complex64",
    "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e4m3b11fnuz", "float8_e3m4", "float8_e8m0fnu", "float4_e2m1fn"})

_CODECS = [{"name": "bytes"}, {"name": "crc32c"}]


@functools.lru_cache(maxsize=None)
def stored_dtype(dtype: np.dtype) -> str:
  """The zarr3 dtype an array is stored as (raw unsigned bits if unsupported)."""
  dtype = np.dtype(dtype)
  if dtype.name in _ZARR3_DTYPES:
    return dtype.name
  return f"uint{8 * dtype.itemsize}"


def context(extra: dict[str, Any] | None = None) -> ts.Context:
  """A fresh tensorstore context: no chunk cache, parallel I/O (plus ``extra`` resources)."""
  return ts.Context({
      **_location.context_spec(),
      "cache_pool": {"total_bytes_limit": 0},
      "file_io_concurrency": {"limit": 64},  # deep queues help cold reads
      **(extra or {}),
  })


# OCDBT starts a new data file after this many bytes. Several medium files are
# written concurrently, which is much faster than one big file.
DATA_FILE_BYTES = 64 << 20


def db_spec(loc: Location, db: str) -> dict[str, Any]:
  """The OCDBT spec of database ``db`` (:func:`db_name`) of the checkpoint at ``loc``."""
  return {"driver": "ocdbt", "base": loc.spec(db + "/"), "target_data_file_size": DATA_FILE_BYTES}


def array_spec(db: dict[str, Any], name: str, shape: Sequence[int], dtype: str,
               chunk_shape: Sequence[int]) -> dict[str, Any]:
  """The zarr3 spec of array ``name`` in the database of spec ``db`` (:func:`db_spec`)."""
  return {
      "driver": "zarr3",
      "kvstore": {**db, "path": name + "/"},
      # Every chunk is stored, zeros too: a chunk missing from a checkpoint is
      # then damage, never an all-zero chunk left out.
      "store_data_equal_to_fill_value": True,
      "metadata": {
          "shape": list(shape),
          "data_type": dtype,
          "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
          "chunk_key_encoding": {"name": "default"},
          "codecs": _CODECS,
      },
  }


# Each process database holds, beside its arrays, one key naming the database itself:
# ``<item>/p<process>-<generation>``, relative to its checkpoint. A reader compares it with
# the database it meant to open, so a database moved to another item or process, or copied
# in from another checkpoint, is an error, not another array's values (docs/format.md).
IDENTITY_KEY = "ofx_database"


def identity(db: str) -> bytes:
  """The value of :data:`IDENTITY_KEY` in database ``db`` (``<item>/p<process>-<generation>``)."""
  return b"orbax_flax database " + db.encode()


def as_stored(data: np.ndarray, dtype: str) -> np.ndarray:
  return data if data.dtype.name == dtype else data.view(dtype)


def db_name(item: str, process: int, generation: str) -> str:
  """The database of ``process``'s chunks of ``item`` in the checkpoint of ``generation``,
  relative to the checkpoint (docs/format.md).

  Example:
    >>> db_name("params", 1, "0123456789abcdef")
    'params/p1-0123456789abcdef'
  """
  return f"{item}/p{process}-{generation}"


class ProcessWriter:
  """One process's databases in one checkpoint, one an item, each made as its item's first
  block arrives: :meth:`add` queues a block, :meth:`flush` and :meth:`wait` act on them all
  (see :class:`DatabaseWriter`)."""

  def __init__(self, loc: Location, process: int, generation: str, ctx: ts.Context):
    self._loc, self._process, self._gen, self._ctx = loc, process, generation, ctx
    self.databases: dict[str, DatabaseWriter] = {}  # by name (:func:`db_name`)

  def add(self, item: str, name: str, shape: Sequence[int], dtype: str,
          chunk_shape: Sequence[int], slices: Any, data: np.ndarray) -> None:
    """Queues ``data`` for ``array[slices]`` of the array ``name`` of ``item``."""
    db = db_name(item, self._process, self._gen)
    w = self.databases.get(db)
    if w is None:
      w = self.databases[db] = DatabaseWriter(db, db_spec(self._loc, db), self._ctx)
    w.add(name, shape, dtype, chunk_shape, slices, data)

  def flush(self, depth: int = 2) -> None:
    for w in self.databases.values():
      w.flush(depth=depth)

  def wait(self) -> None:
    for w in self.databases.values():
      w.wait()

  def settle(self, timeout_s: float) -> bool:
    """See :meth:`DatabaseWriter.settle`: every database's batches, ``timeout_s`` in all."""
    deadline = time.monotonic() + timeout_s
    return all([w.settle(deadline) for w in self.databases.values()])


class DatabaseWriter:
  """Writes blocks of several arrays into one OCDBT database, one transaction per batch.

  ``add`` queues writes; ``flush`` issues every queued write (tensorstore runs
  them concurrently) and starts committing them as one OCDBT version, without
  waiting: batches overlap, and :meth:`wait` (or, with ``depth=2``, the next
  ``flush``) waits for them. The data handed to ``add`` must stay unchanged until its
  batch is committed (tensorstore references it, without a copy).
  """

  def __init__(self, db: str, spec: dict[str, Any], ctx: ts.Context):
    self._db, self._spec, self._ctx = db, spec, ctx  # spec: the database's (:func:`db_spec`)
    self._named = False  # the database's identity key written (with its first batch)
    self._pending: list[tuple[Any, Any, np.ndarray]] = []
    self._stores: dict[str, Any] = {}
    self._commits: list[Any] = []

  def add(self, name: str, shape: Sequence[int], dtype: str, chunk_shape: Sequence[int],
          slices: Any, data: np.ndarray) -> None:
    """Queues ``data`` for ``array[slices]`` of the array ``name``."""
    self._pending.append(((name, tuple(shape), dtype, tuple(chunk_shape)), slices,
                          as_stored(data, dtype)))

  def flush(self, depth: int = 2) -> None:
    """Issues and starts committing everything queued; at most ``depth`` batches in flight.

    A batch that creates arrays commits before anything else is issued (later
    batches open what it created).
    """
    if not self._pending:
      return
    pending, self._pending = self._pending, []
    txn = ts.Transaction(atomic=False)
    new = {key[0]: key[1:] for key, _, _ in pending if key[0] not in self._stores}
    if new:
      self.wait()
    created = {n: ts.open(array_spec(self._spec, n, *a), create=True, context=self._ctx,
                          transaction=txn) for n, a in new.items()}
    stores = {n: f.result() for n, f in created.items()}
    writes = [(stores[key[0]] if key[0] in stores else self._stores[key[0]].with_transaction(txn))
              [slices].write(data, can_reference_source_data_indefinitely=True)
              for key, slices, data in pending]
    if not self._named:
      kv = ts.KvStore.open(self._spec, context=self._ctx).result()
      writes.append(kv.with_transaction(txn).write(IDENTITY_KEY, identity(self._db)))
      self._named = True
    for w in writes:  # staged in the transaction (no I/O yet)
      w.result()
    commit = txn.commit_async()
    if new:
      commit.result()
      opened = {n: ts.open(array_spec(self._spec, n, *a), open=True, context=self._ctx)
                for n, a in new.items()}
      self._stores.update({n: f.result() for n, f in opened.items()})
      return
    self._commits.append(commit)
    while len(self._commits) > max(0, depth - 1):
      self._commits.pop(0).result()

  def wait(self) -> None:
    """Waits until every batch is committed."""
    while self._commits:
      self._commits.pop(0).result()

  def settle(self, deadline: float) -> bool:
    """After a failure: drops what is queued and waits, until ``deadline`` (``time.monotonic``),
    for the batches being committed to end, whatever their outcome (the failure that stops
    the save is the one reported). Whether they all ended."""
    self._pending = []
    while self._commits:
      try:
        self._commits[0].result(timeout=max(0.0, deadline - time.monotonic()))
      except Exception:  # pylint: disable=broad-except  # ended: failed too, or cancelled
        if not self._commits[0].done():  # (a TimeoutError: still being committed)
          return False
      self._commits.pop(0)
    return True


_KEY_IN_ERROR = re.compile(r'Error reading "([^"]+)"')


# Status codes that say the store could not be reached or refused us; any
# other failure to read a committed checkpoint means its bytes are wrong.
_TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "PERMISSION_DENIED", "UNAUTHENTICATED",
              "RESOURCE_EXHAUSTED", "CANCELLED", "ABORTED", "Connection refused",
              "Couldn't connect", "Could not resolve host")


def is_corruption(e: Exception) -> bool:
  """True if a read of committed data failed because the bytes are wrong."""
  s = str(e)
  return not any(t in s for t in _TRANSIENT)


def locate(loc: Location, db: str, message: str) -> str:
  """Best effort: the data file (and offset) holding the chunk named in an error."""
  m = _KEY_IN_ERROR.search(message)
  base = str(loc.join(db))
  if not m:
    return base
  key = m.group(1)
  try:
    store = _location.open_kvstore(loc, db + "/")
    found = next((str(e["indirect_value"]) for e in index_entries(store)
                  if e.get("key") == key.encode() and "indirect_value" in e), None)
  except (ValueError, KeyError, TypeError, IndexError, AttributeError, errors.StorageError):
    found = None
  if not found:
    return f"{base} (key {key})"
  file, offset, length = found.split("::", 1)[1].rsplit(":", 2)
  return f"{os.path.join(base, file)} (key {key}, bytes {offset}+{length})"


def _dumped(future: Any) -> Any:
  """The result of a ``tensorstore.ocdbt.dump``, without the references it leaks.

  tensorstore (0.1.86 and earlier: ``JsonToPyObject`` hands ``PyDict_SetItem`` references
  it releases, and that call takes none) leaves one reference too many on every key and
  value of every dict it returns: each dump of an index leaked it whole, every restore
  (about 100 KiB a restore of a 300-array model; an evaluator restores every step for
  weeks). Where the installed tensorstore does so (:func:`_dump_leaks`), each of those
  references is released here; a fixed tensorstore is left alone.
  """
  result = future.result()
  if _dump_leaks():
    _release_extra(result)
  return result


def _refs(d: dict[Any, Any]) -> tuple[int, int]:
  """The reference counts of ``d``'s first key and of its value."""
  k = next(iter(d))
  v = d[k]
  return sys.getrefcount(k), sys.getrefcount(v)


@functools.cache
def _dump_leaks() -> bool:
  """Whether the installed tensorstore's dumps leak (probed once, on a database in memory):
  the first key of a dump and its value each hold exactly one reference more than a key
  and a value of a dict Python built (each seen through the same frames, so only the dict's
  own references differ). Anything else: nothing is ever released that might be held."""
  ctx = ts.Context()
  db = ts.KvStore.open({"driver": "ocdbt", "base": "memory://"}, context=ctx).result()
  db.write("probe", b"x").result()
  result = ts.ocdbt.dump(ts.KvStore.open("memory://", context=ctx).result()).result()
  built = {"".join(["con", "fig"]): {"".join(["k", "1"]): None}}
  (key, value), (key0, value0) = _refs(result), _refs(built)
  leaks = key - key0 == 1 and value - value0 == 1
  if leaks:
    _release_extra(result)
  return leaks


def _release_extra(tree: Any) -> None:
  """Releases the reference too many on every key and value of every dict in ``tree``."""
  if isinstance(tree, list):
    for x in tree:
      _release_extra(x)
  elif isinstance(tree, dict):
    for k, v in list(tree.items()):
      _release_extra(v)
      _DECREF(k)
      _DECREF(v)


_DECREF = ctypes.pythonapi.Py_DecRef
_DECREF.argtypes = [ctypes.py_object]
_DECREF.restype = None


def index_entries(store: ts.KvStore) -> Iterator[dict[str, Any]]:
  """Every value entry of an OCDBT database's index (a ``key`` with an ``indirect_value``
  ``"...::<file>:<offset>:<length>"`` or an ``inline_value``): the one walk of the index tree,
  one level at a time, the nodes of a level read concurrently (a large index on an object
  store costs its depth in round trips, not its node count).

  Raises:
    ValueError: tensorstore cannot read the index (see :func:`is_corruption`).
    KeyError, TypeError, IndexError, AttributeError: a layout of the dump this walk does
      not know.
  """
  root = _dumped(ts.ocdbt.dump(store))["versions"][-1]["root"].get("location")
  level = [root] if root else []
  while level:
    nodes = [ts.ocdbt.dump(store, node) for node in level]
    level = []
    for entry in (e for node in nodes for e in _dumped(node).get("entries", [])):
      child = entry.get("node") or entry.get("location")
      if isinstance(child, str) and child.startswith("btreenode::"):
        level.append(child)
      elif "indirect_value" in entry or "inline_value" in entry:
        yield entry


# What a tensorstore error says failed, by what its text holds (first match wins).
_FAILURES = (
    (("checksum", "Checksum", "CRC", "Digest mismatch"),
     "the stored checksum does not match the bytes read"),
    (("NOT_FOUND",), "a file or key it needs is missing"),
    (("OUT_OF_RANGE",), "a file is shorter than its index says (truncated?)"),
    (("DATA_LOSS",), "the stored bytes do not decode (damaged)"),
    (("FAILED_PRECONDITION", "INVALID_ARGUMENT"),
     "the stored array metadata does not match the manifest"),
)


def what_failed(e: Exception) -> str:
  """A phrase naming what a tensorstore read error says went wrong.

  Example:
    >>> what_failed(ValueError('NOT_FOUND: Error reading "a0/c/0"'))
    'a file or key it needs is missing'
    >>> what_failed(ValueError("INTERNAL: something else"))
    'tensorstore could not read it (INTERNAL)'
  """
  text = str(e).split(" [tensorstore_spec=", 1)[0]  # (the spec names the crc32c codec)
  for marks, phrase in _FAILURES:
    if any(m in text for m in marks):
      return phrase
  code = text.split(":", 1)[0].strip()
  return "tensorstore could not read it" + (f" ({code})" if code.isupper() else "")


def corrupted(item: str, path: str, loc: Location, db: str, e: Exception) -> errors.CheckpointCorruptedError:
  where = locate(loc, db, str(e))
  return errors.CheckpointCorruptedError(
      f"checkpoint data is corrupted: item {item!r}, array {path}, file {where}:"
      f" {what_failed(e)} ({e}). Restore from another checkpoint.")


# ------------------------------------------------ where each chunk lies (local checkpoints)

_DATA_FILE = re.compile(r"^d/[0-9A-Za-z_-]+$")  # OCDBT data files: d/<hex>


@dataclasses.dataclass(frozen=True)
class Located:
  """Where one value lies: ``length`` bytes at ``offset`` of ``file`` (or ``inline``)."""
  file: str | None   # data file, or None for a value stored inline in the index
  offset: int
  length: int
  inline: bytes | None = None


def chunk_key(name: str, coords: Sequence[int]) -> str:
  """The key of chunk ``coords`` of zarr3 array ``name`` (default chunk key encoding)."""
  return name + "/c" + "".join(f"/{c}" for c in coords)


class ChunkIndex:
  """Chunk locations of the process databases of one checkpoint, loaded on first use."""

  def __init__(self, loc: Location, homes: Any):
    self.loc, self.homes = loc, homes  # where each owner's database is (db_name(item, owner))
    self._dbs: dict[tuple[str, int], dict[bytes, Located] | None] = {}
    self._lock = threading.Lock()

  def db(self, item: str, owner: int) -> str:
    return self.homes.db_name(item, owner)

  def load(self, keys: Sequence[tuple[str, int]]) -> None:
    todo = [k for k in dict.fromkeys(keys) if k not in self._dbs]
    if todo:
      loaded = _threads.parallel_map(self._load_one, todo, 8, name="orbax_flax-index")
      self._dbs.update(zip(todo, loaded))

  def get(self, item: str, owner: int) -> dict[bytes, Located] | None:
    return self._dbs.get((item, owner))

  def _load_one(self, key: tuple[str, int]) -> dict[bytes, Located] | None:
    """The index of one database; None if it cannot be described (tensorstore then reads).

    Raises:
      CheckpointFormatError: a link inside the checkpoint (see :func:`check_no_links`).
      CheckpointCorruptedError: the index cannot be read, or places a value outside its
        data file (missing or truncated), checked here before any read allocates memory.
    """
    db = self.db(*key)
    base = os.path.normpath(os.path.join(self.loc.local_path, db))  # (a base: ../<dir>/...)
    check_no_links(self.loc.local_path, db)
    out = self._read_index(db, base)
    if out is not None:
      _check_extents(out, base)
    return out

  def _read_index(self, db: str, base: str) -> dict[bytes, Located] | None:
    try:
      store = ts.KvStore.open({"driver": "file", "path": base + "/"},
                              context=_location.context()).result()
      out: dict[bytes, Located] = {}
      for entry in index_entries(store):
        if "indirect_value" in entry:
          file, offset, length = str(entry["indirect_value"]).split("::", 1)[1].rsplit(":", 2)
          if not _DATA_FILE.match(file):
            return None  # not a name tensorstore writes: never followed outside the database
          out[bytes(entry["key"])] = Located(os.path.join(base, file), int(offset), int(length))
        else:
          value = bytes(entry["inline_value"])
          out[bytes(entry["key"])] = Located(None, 0, len(value), value)
      return out
    except ValueError as e:
      if is_corruption(e):
        raise errors.CheckpointCorruptedError(
            f"checkpoint data is corrupted: the index of database {base} cannot be read:"
            f" {what_failed(e)} ({e})."
            " Restore from another checkpoint.") from e
      raise _location.storage_error(self.loc, f"reading the index of {db}", e) from e
    except (KeyError, TypeError, IndexError, AttributeError):
      return None  # an index layout this reader does not know: let tensorstore read


def check_no_links(root: str, db: str) -> None:
  """Refuses a symbolic link anywhere in database ``db`` of the local checkpoint ``root``.

  The item directory, the database directory and everything in it (its
  manifest, ``d/`` and data files): a checkpoint reads only its own files
  (promise 7), and a link would lead anywhere. ``db`` is relative to ``root``;
  a differential base's (``../<step>/<item>/...``) is checked from that step's
  directory down.

  Raises:
    CheckpointFormatError: naming the link and where it points.
  """
  parts = db.split("/")
  top = root
  if parts[0] == "..":  # a sibling step's database: its directory is where confinement starts
    top, parts = os.path.join(os.path.dirname(os.path.normpath(root)), parts[1]), parts[2:]
  path = top
  for part in parts:
    path = os.path.join(path, part)
    _location.refuse_special(path, f"the checkpoint's database {db}")
  for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
    for name in dirnames + filenames:
      _location.refuse_special(os.path.join(dirpath, name), f"the checkpoint's database {db}")


def _check_extents(index: dict[bytes, Located], base: str) -> None:
  """Every value the index places in a data file lies inside that file."""
  sizes: dict[str, int] = {}
  for key, at in index.items():
    if at.file is None:
      continue
    if at.file not in sizes:
      try:
        sizes[at.file] = os.stat(at.file).st_size
      except FileNotFoundError:
        raise errors.CheckpointCorruptedError(
            f"checkpoint data is corrupted: data file {at.file} of database {base} is missing"
            f" (its index names it for key {key.decode(errors='replace')}). Restore from another"
            " checkpoint.") from None
      except OSError as e:
        raise errors.StorageError(f"cannot read data file {at.file}: {e}") from e
    if at.offset + at.length > sizes[at.file]:
      raise errors.CheckpointCorruptedError(
          f"checkpoint data is corrupted: data file {at.file} of database {base} is"
          f" {sizes[at.file]} bytes, where its index places key {key.decode(errors='replace')}"
          f" at bytes {at.offset}+{at.length} (truncated?). Restore from another checkpoint.")


def stored_lengths(loc: Location, db: str) -> dict[bytes, int]:
  """Key -> stored length of every value of database ``db`` of ``loc``, on any store.

  From the OCDBT index alone (a few small reads on an object store, no value
  read): what a reader compares with the sizes a manifest states before it
  allocates anything.

  Raises:
    CheckpointCorruptedError: the index cannot be read (damaged or missing).
    StorageError: the store cannot be reached.
  """
  store = _location.open_kvstore(loc, db + "/")
  out: dict[bytes, int] = {}
  try:
    for entry in index_entries(store):
      if "indirect_value" in entry:
        out[bytes(entry["key"])] = int(str(entry["indirect_value"]).rsplit(":", 1)[1])
      else:
        out[bytes(entry["key"])] = len(bytes(entry["inline_value"]))
  except ValueError as e:
    if is_corruption(e):
      raise errors.CheckpointCorruptedError(
          f"checkpoint data is corrupted: the index of database {loc.join(db)} cannot be read:"
          f" {what_failed(e)} ({e}). Restore from another checkpoint.") from e
    raise _location.storage_error(loc, f"reading the index of {db}", e) from e
  except (KeyError, TypeError, IndexError, AttributeError) as e:
    raise errors.CheckpointCorruptedError(
        f"checkpoint data is corrupted: the index of database {loc.join(db)} has a layout this"
        f" reader does not know ({type(e).__name__}: {e}).") from e
  return out
