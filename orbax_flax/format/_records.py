"""Manifest records: the typed view of a checkpoint's items, and their one decoder.

A manifest's items are JSON on disk (``docs/format.md``); its decoder checks
every name, number, dtype and path a reader will use and builds these frozen
records in the same pass, so no reader indexes JSON: an item is an
:class:`Item` (its tree structure, its leaves, its packed buffers), a leaf a
:class:`Value` (inline) or an :class:`Array`, whose bytes are in one of:

* our chunked arrays: chunk ``c`` in the database of process ``owners[c]``;
* our packed arrays: ``[packed_offset, packed_offset + nbytes)`` of process
  ``owners[0]``'s packed buffer;
* the local tier's blob: ``boxes`` (the shards this process holds);
* a foreign format's file: ``source`` reads a box into a buffer;
* a transform of other records: ``derived`` expands a box into reads of them.

A :class:`Summary` is the manifest's first line (time, processes, custom
metadata); a :class:`Manifest` is a summary with its items. Foreign formats
(:mod:`orbax_flax.formats`) and transforms build records directly.

Example:
  >>> a = Array(path=("w",), kind="numpy", shape=(2, 3), dtype="float32", nbytes=24,
  ...           chunk_shape=(2, 3), owners=(0,))
  >>> a.path_text, a.user_shape, a.np_dtype.itemsize, a.is_packed
  ('w', (2, 3), 4, False)

The one decoder of manifests into these records is :mod:`orbax_flax.format._records_decode`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, ClassVar, Union

import numpy as np

from orbax_flax.core import _tree


@dataclasses.dataclass(frozen=True)
class Value:
  """A leaf stored inline: a scalar, string or bytes (``value``: its tagged JSON form)."""
  path: tuple[str, ...]
  value: Mapping[str, Any]
  kind: ClassVar[str] = "value"
  nbytes: ClassVar[int] = 0

  @property
  def path_text(self) -> str:
    return _tree.path_str(self.path)

  def decoded(self) -> Any:
    """The Python (or numpy scalar) value."""
    return _tree.decode_value(self.value)


@dataclasses.dataclass(frozen=True)
class Held:
  """One shard the local tier's blob holds: ``box`` at ``[offset, offset + nbytes)``."""
  box: tuple[tuple[int, int], ...]
  offset: int
  nbytes: int
  crc32c: tuple[int, ...]        # one per SEGMENT of the shard's bytes
  devices: tuple[int, ...] = ()  # the local devices it was saved from


@dataclasses.dataclass(frozen=True)
class Array:
  """An array leaf: what it is (``shape``/``dtype`` of the stored data) and where its bytes are.

  For PRNG keys ``key_impl``/``key_shape`` say which keys; ``shape``/``dtype``
  describe their key data. Exactly one placement applies (see the module).
  """
  path: tuple[str, ...]
  kind: str                # "jax" / "numpy" (saved by us), "array" (a foreign format, a transform)
  shape: tuple[int, ...]
  dtype: str
  nbytes: int
  stored_dtype: str = ""   # zarr3's name of the stored bytes (ours)
  name: str = ""           # a<N> (ours), the tensor's name (safetensors)
  sharding: str = ""       # what the saved sharding was, for people
  key_impl: str | None = None
  key_shape: tuple[int, ...] | None = None
  chunk_shape: tuple[int, ...] | None = None
  owners: tuple[int, ...] = ()
  packed_offset: int | None = None
  boxes: tuple[Held, ...] = ()
  source: Any = None       # a foreign format's reader: ``source.read(box, out)``
  derived: Any = None      # a transform's: ``derived.expand(box, out) -> (requests, finish)``
  # Differential saves (orbax_flax.differential.refs): per chunk its xxh3-128 and
  # the step holding it (-1: this checkpoint, else an index into the summary's bases); the
  # decoder folds chunk_base into ``owners`` (home * OWNER_STRIDE + process).
  chunk_hash: tuple[str, ...] | None = None
  chunk_base: tuple[int, ...] | None = None

  @functools.cached_property
  def path_text(self) -> str:
    return _tree.path_str(self.path)

  @functools.cached_property
  def user_shape(self) -> tuple[int, ...]:
    """The shape a user sees: the key shape for PRNG keys."""
    return self.key_shape if self.key_shape is not None else self.shape

  @functools.cached_property
  def np_dtype(self) -> np.dtype:
    return _tree.dtype_from_name(self.dtype)

  @functools.cached_property
  def np_stored_dtype(self) -> np.dtype:
    return _tree.dtype_from_name(self.stored_dtype)

  @functools.cached_property
  def is_packed(self) -> bool:
    return self.packed_offset is not None

  @functools.cached_property
  def reads_itself(self) -> bool:
    """True for a foreign format's or a transform's array (not read by the engine)."""
    return self.source is not None or self.derived is not None


Record = Union[Value, Array]


@dataclasses.dataclass(frozen=True)
class Item:
  """One item: its tree ``structure`` (JSON, see ``_tree.decode_structure``) and leaves."""
  structure: Any
  leaves: tuple[Record, ...]
  packed: Mapping[int, int] = dataclasses.field(default_factory=dict)  # process -> buffer bytes
  # A differential save's segments of each process's packed buffer: (lo, hi, base, hash).
  packed_pieces: Mapping[int, tuple[tuple[int, int, int, str], ...]] = dataclasses.field(
      default_factory=dict)

  def by_path(self) -> dict[tuple[str, ...], Record]:
    return {r.path: r for r in self.leaves}


@dataclasses.dataclass(frozen=True)
class Base:
  """A step whose data a differential save references: a sibling directory, its generation."""
  dir: str
  generation: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Summary:
  """The manifest's summary line: what a listing reads."""
  format: str = "orbax_flax"
  version: int = 1
  created: float = 0.0
  process_count: int = 0
  device_count: int = 0
  library_version: str = ""
  generation: str = ""
  custom: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  casts: Mapping[str, str] = dataclasses.field(default_factory=dict)  # leaf -> dtype in memory
  item_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
  all_chunks_stored: bool = False
  database_identity: bool = False  # every database of this checkpoint holds its identity key
  bases: tuple[Base, ...] = ()                 # a differential save's referenced steps
  stored_bytes: Mapping[str, int] | None = None  # a differential save's {"own", "borrowed"}
  scrub_turn: int = 0  # a differential save's turn in the read-back of what it borrows


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest(Summary):
  """A whole manifest: the summary and the items (ours, or a foreign format's in memory).

  ``any_item``: a foreign checkpoint of one unnamed item, read under any item name.
  """
  items: Mapping[str, Item]
  any_item: bool = False

  def summary(self) -> Summary:
    return Summary(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Summary)})
