"""All array bytes go through tensorstore: zarr3 arrays inside OCDBT databases.

Each process writes the chunks it owns into its own OCDBT database per item
(``<item>/p<process>-<generation>``): one manifest and a few large data files
per process, whatever the number of arrays. Every chunk is encoded with the
zarr3 ``crc32c`` codec, so tensorstore verifies each chunk it reads; OCDBT
checksums its own tree nodes. Writes to one database share one non-atomic
transaction, so the database's manifest is written once, at commit.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from orbax_flax.core import _location
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


def context() -> ts.Context:
  """A fresh tensorstore context: no chunk cache, parallel I/O."""
  return ts.Context({
      **_location.context_spec(),
      "cache_pool": {"total_bytes_limit": 0},
      "file_io_concurrency": {"limit": 64},  # deep queues help cold reads
  })


# OCDBT starts a new data file after this many bytes. Several medium files are
# written concurrently, which is much faster than one big file.
DATA_FILE_BYTES = 64 << 20


def db_spec(loc: Location, db: str) -> dict[str, Any]:
  return {"driver": "ocdbt", "base": loc.spec(db + "/"), "target_data_file_size": DATA_FILE_BYTES}


def array_spec(loc: Location, db: str, name: str, shape: Sequence[int], dtype: str,
               chunk_shape: Sequence[int]) -> dict[str, Any]:
  return {
      "driver": "zarr3",
      "kvstore": {**db_spec(loc, db), "path": name + "/"},
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


class DatabaseWriter:
  """Writes blocks of several arrays into one OCDBT database, one transaction per batch.

  ``add`` queues writes; ``flush`` issues every queued write (tensorstore runs
  them concurrently) and starts committing them as one OCDBT version, without
  waiting: batches overlap, and :meth:`wait` (or the next-but-one ``flush``)
  waits for them. The data handed to ``add`` must stay unchanged until its
  batch is committed (tensorstore references it, without a copy).
  """

  def __init__(self, loc: Location, db: str, ctx: ts.Context):
    self._loc, self._db, self._ctx = loc, db, ctx
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
    created = {n: ts.open(array_spec(self._loc, self._db, n, *a), create=True, context=self._ctx,
                          transaction=txn) for n, a in new.items()}
    stores = {n: f.result() for n, f in created.items()}
    writes = [(stores[key[0]] if key[0] in stores else self._stores[key[0]].with_transaction(txn))
              [slices].write(data, can_reference_source_data_indefinitely=True)
              for key, slices, data in pending]
    if not self._named:
      kv = ts.KvStore.open(db_spec(self._loc, self._db), context=self._ctx).result()
      writes.append(kv.with_transaction(txn).write(IDENTITY_KEY, identity(self._db)))
      self._named = True
    for w in writes:  # staged in the transaction (no I/O yet)
      w.result()
    commit = txn.commit_async()
    if new:
      commit.result()
      opened = {n: ts.open(array_spec(self._loc, self._db, n, *a), open=True, context=self._ctx)
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

  def abort(self) -> None:
    """Drops what is queued; batches being committed still finish."""
    self._pending = []


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
    dump = ts.ocdbt.dump(store).result()
    root = dump["versions"][-1]["root"].get("location")
    found = _find_value(store, root, key.encode()) if root else None
  except (ValueError, errors.StorageError):
    found = None
  if not found:
    return f"{base} (key {key})"
  file, offset, length = found.split("::", 1)[1].rsplit(":", 2)
  return f"{os.path.join(base, file)} (key {key}, bytes {offset}+{length})"


def _find_value(store: ts.KvStore, node: str, key: bytes) -> str | None:
  dump = ts.ocdbt.dump(store, node).result()
  for entry in dump.get("entries", []):
    if entry.get("key") == key and "indirect_value" in entry:
      return str(entry["indirect_value"])
    child = entry.get("node") or entry.get("location")
    if isinstance(child, str) and child.startswith("btreenode::"):
      found = _find_value(store, child, key)
      if found:
        return found
  return None


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
