"""Phase one of a save: validate the items and plan who writes which bytes.

Every process computes the same plan from the same shardings, without
talking to the others. Two layouts:

* **Chunked**: an array larger than ``PACK_MAX_BYTES``, or one that no single
  process holds whole, is its own zarr3 array whose chunks tile its shards.
  Each chunk has one owner among the processes that hold it, balanced by bytes.
* **Packed**: small arrays that some process holds whole are concatenated into
  one byte buffer per item and process (the zarr3 array ``packed``). This turns
  hundreds of tiny writes and reads into one each: per-leaf overhead is what
  makes small checkpoints slow.

A plan lists this process's :class:`Piece`s: blocks of bytes, each bound for
one region of one stored array, and where their bytes come from (device
shards, numpy arrays). Planning reads no array data; :mod:`orbax_flax.engine.saving`
brings the bytes to the host (as views, or as a snapshot copy). The plan also
records the manifest (everything but the generation id, which is chosen when
the background phase starts). This module says what a plan is and how one
array is laid out (:func:`plan_array`); :class:`orbax_flax.engine._planner.Planner`
plans whole saves and keeps the layouts it worked out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from orbax_flax.format import _layout
from orbax_flax.core import _location
from orbax_flax.format import _manifest
from orbax_flax.core import _tree
from orbax_flax.format import _tsio
from orbax_flax.format import step_dir
from orbax_flax import errors
from orbax_flax.core._location import Location

LIBRARY_VERSION = "0.1.0"
TMP_MARKER = step_dir.TMP_MARKER
PACK_MAX_BYTES = 1 << 20      # arrays up to this size are packed
PACK_CHUNK_BYTES = 4 << 20    # checksum granularity of a packed buffer
PACK_PIECE_BYTES = 32 << 20   # a packed buffer is staged and written in pieces of at most this
PACKED = "packed"             # name of the packed zarr3 array in each database
_PACK_ALIGN = _manifest.PACK_ALIGN  # the manifest's validation checks this layout
_ITEM_NAME = _manifest.ITEM_NAME


@dataclasses.dataclass(frozen=True)
class StoredArray:
  """A zarr3 array of one process's database: where pieces are written."""
  item: str
  name: str
  shape: tuple[int, ...]
  dtype: str                 # the stored (zarr3) dtype
  chunk_shape: tuple[int, ...]


@dataclasses.dataclass
class Source:
  """Where some of a piece's bytes come from.

  ``value`` is a numpy array or a single-device ``jax.Array`` (one shard).
  An array piece has one source, ``value[within]`` (``within`` None: all of
  it). A packed piece has one source per shard of each small leaf: the
  leaf's bytes start ``offset`` bytes into the piece, the leaf has
  ``leaf_shape``/``leaf_dtype``, and this source fills ``leaf[index]``.
  """
  value: Any
  within: tuple[slice, ...] | None = None
  offset: int | None = None
  leaf_shape: tuple[int, ...] = ()
  leaf_dtype: Any = None
  index: tuple[slice, ...] = ()


@dataclasses.dataclass
class Piece:
  """One block this process writes into ``array[slices]``."""
  array: StoredArray
  slices: tuple[slice, ...]
  shape: tuple[int, ...]
  dtype: np.dtype            # of the host data (the user's dtype; stored bits may differ)
  sources: list[Source]
  data: np.ndarray | None = None

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize

  @property
  def packed(self) -> bool:
    return self.sources[0].offset is not None if self.sources else True


@dataclasses.dataclass
class Plan:
  loc: Location
  manifest: dict[str, Any]
  pieces: list[Piece]
  overwrite: bool

  @property
  def nbytes(self) -> int:
    return sum(p.nbytes for p in self.pieces)


@dataclasses.dataclass(frozen=True)
class _ShardLayout:
  shard_shape: tuple[int, ...]
  holders: dict[tuple[int, ...], frozenset[int]]  # shard start -> processes holding it
  full_holders: frozenset[int]                    # processes holding every shard
  holder_sets: tuple[frozenset[int], ...]         # the distinct values of holders
  holder_table: np.ndarray                        # over the grid of shards: index in holder_sets
  max_holders: int                                # the most processes holding one shard


@functools.lru_cache(maxsize=1024)
def _shard_layout(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> _ShardLayout:
  holders: dict[tuple[int, ...], set[int]] = {}
  for device, index in sharding.devices_indices_map(shape).items():
    start = tuple(s.start or 0 for s in index)
    holders.setdefault(start, set()).add(device.process_index)
  frozen = {k: frozenset(v) for k, v in holders.items()}
  shard_shape = tuple(sharding.shard_shape(shape))
  sets: dict[frozenset[int], int] = {}
  group = np.array([sets.setdefault(h, len(sets)) for h in frozen.values()], dtype=np.int64)
  # Each shard's position in the grid of shards (its start over the shard shape).
  coords = np.array(list(frozen), dtype=np.int64).reshape(len(frozen), len(shard_shape))
  coords //= np.maximum(np.array(shard_shape, dtype=np.int64), 1)
  table = np.full(tuple(coords.max(axis=0) + 1), -1, dtype=np.int64)
  table[tuple(coords.T) if shard_shape else ()] = group if shard_shape else group[0]
  table.flags.writeable = False
  return _ShardLayout(shard_shape, frozen, frozenset.intersection(*sets), tuple(sets), table,
                      max(map(len, sets)))


def check_items(items: Any) -> None:
  if not isinstance(items, Mapping) or not items:
    raise TypeError(f"items must be a non-empty dict mapping item names to pytrees, e.g."
                    f" {{'state': state, 'extra': {{'epoch': 3}}}}; got {type(items).__name__}")
  for name in items:
    if not isinstance(name, str) or not _ITEM_NAME.match(name) or name == _manifest.MANIFEST_KEY:
      raise ValueError(f"invalid item name {name!r}: use letters, digits, '_', '.', '-',"
                       f" starting with a letter or digit (e.g. 'state'), other than"
                       f" {_manifest.MANIFEST_KEY!r}.")


def check_destination(loc: Location, overwrite: bool) -> None:
  """Refuses to write where a checkpoint or foreign data already is."""
  if loc.is_local:
    p = loc.local_path
    if TMP_MARKER in loc.name:
      raise ValueError(f"{p}: names containing {TMP_MARKER!r} are reserved for"
                       " in-progress saves; choose another name.")
    if os.path.exists(p):
      if not os.path.isdir(p):
        raise errors.CheckpointExistsError(
            f"{p} exists and is a file, not a checkpoint; choose another path.")
      committed = os.path.exists(os.path.join(p, _manifest.MANIFEST_KEY))
      if not committed and os.listdir(p):
        raise errors.CheckpointExistsError(
            f"{p} exists, is not empty and is not an orbax_flax checkpoint; refusing to"
            " write there (even with overwrite=True). Choose another path or remove it.")
      if committed and not overwrite:
        raise errors.CheckpointExistsError(
            f"a checkpoint already exists at {p}; pass overwrite=True to replace it or"
            " choose another path.")
  elif not overwrite and _location.read_key(loc, _manifest.MANIFEST_KEY) is not None:
    raise errors.CheckpointExistsError(
        f"a checkpoint already exists at {loc}; pass overwrite=True to replace it or"
        " choose another path.")


def pack_chunk_bytes(size: int) -> int:
  """The chunk length of a packed buffer of ``size`` bytes (its checksum granularity)."""
  return min(size, PACK_CHUNK_BYTES)


def pack_pieces(item: str, size: int, sources: list[Source]) -> list[Piece]:
  """This process's packed buffer, cut at leaf boundaries into pieces of bounded size."""
  array = StoredArray(item, PACKED, (size,), "uint8", (pack_chunk_bytes(size),))
  pieces: list[Piece] = []
  start, group = 0, []

  def close(end: int) -> None:
    for s in group:
      s.offset -= start
    pieces.append(Piece(array, (slice(start, end),), (end - start,), np.dtype(np.uint8), list(group)))

  for s in sorted(sources, key=lambda s: s.offset):
    if group and s.offset - start >= PACK_PIECE_BYTES:
      end = s.offset
      close(end)
      start, group = end, []
    group.append(s)
  close(size)
  return pieces


def array_record(path: _tree.Path, leaf: Any, kind: str) -> tuple[dict[str, Any], Any]:
  """The record every tier keeps of an array leaf, and the array whose bytes are stored.

  The one encoding of an array's identity (key path, shape, dtype, PRNG key
  implementation) that :func:`orbax_flax.engine._matching.match_target` checks a
  target against; where the bytes go is up to the tier. PRNG keys are stored
  as their key data; numpy arrays in little-endian byte order.

  Example:
    >>> rec, data = array_record(("w",), np.zeros((2, 3), ">f4"), "numpy")
    >>> rec["shape"], rec["dtype"], rec["nbytes"], data.dtype.isnative
    ([2, 3], 'float32', 24, True)
  """
  rec: dict[str, Any] = {"path": list(path), "kind": kind}
  if kind == "jax" and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    rec.update(key_impl=str(jax.random.key_impl(leaf)), key_shape=list(leaf.shape))
    leaf = jax.random.key_data(leaf)
  elif kind == "numpy" and not leaf.dtype.isnative:
    leaf = leaf.astype(leaf.dtype.newbyteorder("="))  # stored little-endian, as named
  shape = tuple(int(s) for s in leaf.shape)
  dtype = np.dtype(leaf.dtype)
  rec.update(shape=list(shape), dtype=dtype.name, stored_dtype=_tsio.stored_dtype(dtype),
             nbytes=math.prod(shape) * dtype.itemsize)
  return rec, leaf


def value_record(path: _tree.Path, value: Any) -> dict[str, Any]:
  """The record of an inline value leaf (a scalar, str, bytes), as every tier keeps it."""
  return {"path": list(path), "kind": "value", "value": _tree.encode_value(value)}


def deleted_leaf_error(item: str, path: _tree.Path) -> errors.UnsupportedLeafError:
  return errors.UnsupportedLeafError(
      f"Cannot save leaf {item}/{_tree.path_str(path)}: its jax.Array was deleted (donated to a"
      " jitted function?). Save the state before donating it, or save the arrays the function"
      " returned.")


def plan_array(item: str, name: str, path: _tree.Path, leaf: Any, kind: str, me: int,
                load: list[int], pack_sizes: list[int], packed: list[Source],
                pieces: list[Piece], ref: Any) -> dict[str, Any]:
  """The record of one array, and this process's pieces of it (sources as ``ref(k)``)."""
  rec, leaf = array_record(path, leaf, kind)
  sharding = leaf.sharding if kind == "jax" else None
  if sharding is not None and len(load) > 1 and leaf.is_fully_addressable:
    # A process-local array (e.g. jnp.int32(0)) in a multi-process job: like a
    # numpy leaf, every process holds its own copy, assumed identical.
    sharding = None
    rec["sharding"] = {"type": "process-local", "text": "process-local (same on every process)"}
  shape = tuple(rec["shape"])
  dtype = np.dtype(leaf.dtype)
  nbytes = rec["nbytes"]
  rec["name"] = name
  rec.setdefault("sharding", _manifest.describe_sharding(sharding))
  if nbytes == 0:
    rec.update(chunk_shape=list(shape), owners=[])
    return rec

  lay = None if sharding is None else _shard_layout(sharding, shape)
  full_holders = frozenset(range(len(load))) if lay is None else lay.full_holders

  if nbytes <= PACK_MAX_BYTES and full_holders:
    owner = _layout.assign_owners([full_holders], nbytes, load)[0]
    offset = pack_sizes[owner]
    pack_sizes[owner] = offset + -(-nbytes // _PACK_ALIGN) * _PACK_ALIGN
    rec.update(owners=[owner], packed_offset=offset)
    if owner == me:
      for k, index in _unique_shards(leaf, kind, sharding):
        packed.append(Source(ref(k), None, offset, shape, dtype, index))
    return rec

  shard_shape = shape if lay is None else lay.shard_shape
  # A shard held by k processes is cut into at least k chunks, so that its
  # holders share the writing.
  sharers = len(full_holders) if lay is None else lay.max_holders
  shard_bytes = math.prod(shard_shape) * dtype.itemsize
  chunk_limit = min(_layout.DEFAULT_MAX_CHUNK_BYTES, -(-shard_bytes // sharers))
  chunk_shape = _layout.choose_chunk_shape(shard_shape, dtype.itemsize, chunk_limit)
  # The chunk grid in numpy (millions of chunks at thousands of devices): each
  # chunk's position, the shard it lies in, and that shard's holders.
  chunking = _layout.Chunking(shape, chunk_shape)
  grid = chunking.grid
  coords = np.unravel_index(np.arange(chunking.num_chunks), grid) if grid else ()
  shard_coords = [c * n // s for c, n, s in zip(coords, chunk_shape, shard_shape)]
  group, group_holders = _chunk_holder_groups(lay, full_holders, shard_coords, shard_shape,
                                              chunking.num_chunks)
  owners = _layout.assign_owners_grid(group, group_holders,
                                      math.prod(chunk_shape) * dtype.itemsize, load)
  mine = np.flatnonzero(owners == me).tolist()
  rec.update(chunk_shape=list(chunk_shape), owners=owners.tolist())
  if not mine:
    return rec
  array = StoredArray(item, name, shape, rec["stored_dtype"], chunk_shape)
  local = {tuple(0 for _ in shape): None} if lay is None else {
      tuple(s.start or 0 for s in index): k for k, index in _unique_shards(leaf, kind, sharding)}
  for c in mine:
    box = tuple((int(x[c]) * n, (int(x[c]) + 1) * n) for x, n in zip(coords, chunk_shape))
    start = tuple(int(x[c]) * s for x, s in zip(shard_coords, shard_shape))
    within = None
    if chunk_shape != shard_shape:
      within = _layout.relative(box, tuple((s, s + n) for s, n in zip(start, shard_shape)))
    pieces.append(Piece(array, _layout.box_to_slices(box), chunk_shape, dtype,
                        [Source(ref(local[start]), within)]))
  return rec


def _chunk_holder_groups(lay: _ShardLayout | None, full_holders: frozenset[int],
                         shard_coords: list[np.ndarray], shard_shape: tuple[int, ...],
                         num_chunks: int) -> tuple[np.ndarray, tuple[frozenset[int], ...]]:
  """Per chunk, the index of its shard's holder set; and the distinct holder sets."""
  if lay is None:
    return np.zeros(num_chunks, dtype=np.int64), (full_holders,)
  table, sets = lay.holder_table, lay.holder_sets
  group = table[tuple(shard_coords)] if shard_shape else np.full(num_chunks, table[()])
  if (group < 0).any():  # a chunk in no shard: the sharding's layout is not a grid
    raise ValueError(f"shards {sorted(lay.holders)} of shape {shard_shape} do not tile the array")
  return np.asarray(group, dtype=np.int64).reshape(num_chunks), sets


def _unique_shards(leaf: Any, kind: str, sharding: Any) -> list[tuple[int | None, tuple[slice, ...]]]:
  """(shard position, index) of each distinct shard this process holds; (None, ()) for the
  leaf itself (numpy, or a process-local jax.Array)."""
  if kind == "numpy" or sharding is None:
    return [(None, ())]
  return list(_distinct_shards(leaf.sharding, tuple(leaf.shape)))


@functools.lru_cache(maxsize=1024)
def _distinct_shards(sharding: jax.sharding.Sharding,
                     shape: tuple[int, ...]) -> tuple[tuple[int, tuple[slice, ...]], ...]:
  """(position among the addressable shards, index) of each distinct shard of a layout.

  jax orders an array's addressable shards by its sharding's device
  assignment, so the positions hold for every array of that sharding.
  """
  indices = sharding.addressable_devices_indices_map(shape)
  devices = sharding._addressable_device_assignment  # pylint: disable=protected-access
  out, seen = [], set()
  for k, device in enumerate(devices):
    index = indices[device]
    start = tuple(s.start or 0 for s in index)
    if start not in seen:
      seen.add(start)
      out.append((k, index))
  return tuple(out)
