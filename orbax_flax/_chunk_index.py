"""Where each chunk's bytes lie in a local checkpoint's process databases.

A process database is tensorstore's OCDBT key-value store; its index (read
through ``tensorstore.ocdbt.dump``) says, per key, in which data file at which
offset the value lies, or holds a small value inline. :class:`ChunkIndex`
loads these indexes once per restore so that :mod:`orbax_flax._reading` can
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

import tensorstore as ts

from orbax_flax import _location
from orbax_flax import _tsio
from orbax_flax import errors
from orbax_flax._location import Location

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

  def __init__(self, loc: Location, generation: str):
    self.loc, self.gen = loc, generation
    self._dbs: dict[tuple[str, int], dict[bytes, Located] | None] = {}
    self._lock = threading.Lock()

  def db(self, item: str, owner: int) -> str:
    return f"{item}/p{owner}-{self.gen}"

  def load(self, keys: Sequence[tuple[str, int]]) -> None:
    todo = [k for k in dict.fromkeys(keys) if k not in self._dbs]
    if todo:
      with concurrent.futures.ThreadPoolExecutor(min(8, len(todo))) as ex:
        for k, v in zip(todo, ex.map(self._load_one, todo)):
          self._dbs[k] = v

  def get(self, item: str, owner: int) -> dict[bytes, Located] | None:
    return self._dbs.get((item, owner))

  def _load_one(self, key: tuple[str, int]) -> dict[bytes, Located] | None:
    """The index of one database; None if it cannot be described (tensorstore then reads)."""
    db = self.db(*key)
    base = os.path.join(self.loc.local_path, db)
    try:
      store = ts.KvStore.open({"driver": "file", "path": base + "/"},
                              context=_location.default_context()).result()
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
            f"checkpoint data is corrupted: the index of database {base} cannot be read: {e}."
            " Restore from another checkpoint.") from e
      raise _location.storage_error(self.loc, f"reading the index of {db}", e) from e
    except (KeyError, TypeError, IndexError, AttributeError):
      return None  # an index layout this reader does not know: let tensorstore read
