"""Where each chunk's bytes lie in a local checkpoint's process databases.

A process database is tensorstore's OCDBT key-value store; its index (read
through ``tensorstore.ocdbt.dump``) says, per key, in which data file at which
offset the value lies, or holds a small value inline. :class:`ChunkIndex`
loads these indexes once per restore so that :mod:`orbax_flax.engine._reading` can
``preadv`` chunks straight into their destinations. An index layout this code
does not know yields None: the reader then lets tensorstore read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

import tensorstore as ts

from orbax_flax.core import _location
from orbax_flax.format import _tsio
from orbax_flax import errors
from orbax_flax.core._location import Location

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
    self.loc, self.homes = loc, homes  # homes: an orbax_flax.differential.refs.Homes
    self._dbs: dict[tuple[str, int], dict[bytes, Located] | None] = {}
    self._lock = threading.Lock()

  def db(self, item: str, owner: int) -> str:
    return self.homes.db_name(item, owner)

  def load(self, keys: Sequence[tuple[str, int]]) -> None:
    todo = [k for k in dict.fromkeys(keys) if k not in self._dbs]
    if todo:
      with concurrent.futures.ThreadPoolExecutor(min(8, len(todo))) as ex:
        for k, v in zip(todo, ex.map(self._load_one, todo)):
          self._dbs[k] = v

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
      dump = ts.ocdbt.dump(store).result()
      out: dict[bytes, Located] = {}
      root = dump["versions"][-1]["root"].get("location")
      stack = [root] if root else []
      while stack:
        node = ts.ocdbt.dump(store, stack.pop()).result()
        for entry in node.get("entries", []):
          child = entry.get("node") or entry.get("location")
          if isinstance(child, str) and child.startswith("btreenode::"):
            stack.append(child)
          elif "indirect_value" in entry:
            file, offset, length = str(entry["indirect_value"]).split("::", 1)[1].rsplit(":", 2)
            if not _DATA_FILE.match(file):
              return None  # not a name tensorstore writes: never followed outside the database
            out[bytes(entry["key"])] = Located(os.path.join(base, file), int(offset), int(length))
          elif "inline_value" in entry:
            value = bytes(entry["inline_value"])
            out[bytes(entry["key"])] = Located(None, 0, len(value), value)
      return out
    except ValueError as e:
      if _tsio.is_corruption(e):
        raise errors.CheckpointCorruptedError(
            f"checkpoint data is corrupted: the index of database {base} cannot be read:"
            f" {_tsio.what_failed(e)} ({e})."
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
    _refuse_link(path, db)
  for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
    for name in dirnames + filenames:
      _refuse_link(os.path.join(dirpath, name), db)


def _refuse_link(path: str, db: str) -> None:
  if os.path.islink(path):
    try:
      target = os.readlink(path)
    except OSError:
      target = "?"
    raise errors.CheckpointFormatError(
        f"{path} is a symbolic link (to {target}) inside the checkpoint's database {db}: a"
        " checkpoint reads only its own files, never through a link (orbax_flax never writes"
        " one; the checkpoint was crafted or assembled by hand). Copy the real files in place"
        " of the link, or restore another checkpoint.")


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
    root = ts.ocdbt.dump(store).result()["versions"][-1]["root"].get("location")
    level = [root] if root else []
    while level:  # one level of the tree at a time, its nodes read concurrently
      nodes = [ts.ocdbt.dump(store, node) for node in level]
      level = []
      for entry in (e for node in nodes for e in node.result().get("entries", [])):
        child = entry.get("node") or entry.get("location")
        if isinstance(child, str) and child.startswith("btreenode::"):
          level.append(child)
        elif "indirect_value" in entry:
          out[bytes(entry["key"])] = int(str(entry["indirect_value"]).rsplit(":", 1)[1])
        elif "inline_value" in entry:
          out[bytes(entry["key"])] = len(bytes(entry["inline_value"]))
  except ValueError as e:
    if _tsio.is_corruption(e):
      raise errors.CheckpointCorruptedError(
          f"checkpoint data is corrupted: the index of database {loc.join(db)} cannot be read:"
          f" {_tsio.what_failed(e)} ({e}). Restore from another checkpoint.") from e
    raise _location.storage_error(loc, f"reading the index of {db}", e) from e
  except (KeyError, TypeError, IndexError, AttributeError) as e:
    raise errors.CheckpointCorruptedError(
        f"checkpoint data is corrupted: the index of database {loc.join(db)} has a layout this"
        f" reader does not know ({type(e).__name__}: {e}).") from e
  return out
