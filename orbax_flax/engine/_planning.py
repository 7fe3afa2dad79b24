"""Phase one of a save: validate the items and plan who writes which bytes.

Every process computes the same plan from the same shardings, without
talking to the others. Two layouts:

* **Chunked**: an array larger than ``PACK_MAX_BYTES``, or one that no single
  process holds whole, is its own zarr3 array whose chunks tile its shards.
  Each chunk has one owner among the processes that hold it, balanced by bytes
  (:func:`assign_owners_grid`): every process computes the same owners, so
  ownership needs no communication.
* **Packed**: small arrays that some process holds whole are concatenated into
  one byte buffer per item and process (the zarr3 array ``packed``). This turns
  hundreds of tiny writes and reads into one each: per-leaf overhead is what
  makes small checkpoints slow.

A plan lists this process's :class:`Piece`s: blocks of bytes, each bound for
one region of one stored array, and where their bytes come from (device
shards, numpy arrays). Planning reads no array data; :mod:`orbax_flax.engine.saving`
brings the bytes to the host (as views, or as a snapshot copy). The plan also
records the manifest (everything but the generation id, which is chosen when
the first bytes are written: ``SaveRun.begin``).

A :class:`Planner` (each :class:`~orbax_flax.Checkpointer` has one) turns the
items of a save into a :class:`Plan`, laying out each array with
:func:`plan_array`. The layout of a tree depends only on its structure,
shapes, dtypes and shardings, so the planner keeps the last few layouts it
worked out (a :class:`_Template` each, with references in place of arrays)
and each save binds its arrays to one: planning a 300-leaf state takes about
a millisecond from the second save on. Planning reads no array data and
writes nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import stat
import time
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orbax_flax.format import _layout
from orbax_flax.core import _location
from orbax_flax.core import _multihost
from orbax_flax.format import _manifest
from orbax_flax.core import _tree
from orbax_flax.format import _tsio
from orbax_flax.format import step_dir
from orbax_flax import errors
from orbax_flax.core._location import Location

LIBRARY_VERSION = "0.1.0"
TMP_MARKER = step_dir.TMP_MARKER
PACK_MAX_BYTES = 1 << 20      # arrays up to this size are packed
PACK_PIECE_BYTES = 32 << 20   # a packed buffer is staged and written in pieces of at most this
PACKED = _layout.PACKED
_PACK_ALIGN = _manifest.PACK_ALIGN  # the manifest's validation checks this layout
_ITEM_NAME = _manifest.ITEM_NAME
_ITEM_NAME_MAX = 255  # NAME_MAX: an item is a directory


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
  """One save: its manifest, and this process's pieces.

  The pieces' sources are the saved arrays' shards, unless the save was planned
  with ``bind=False``: then they are its layout's own pieces (shapes and
  dtypes, no data; never change them) until :meth:`bind` makes the pieces of
  arrays of the same layout (a copy of the state, in the background).
  """
  loc: Location
  manifest: dict[str, Any]
  pieces: list[Piece]
  overwrite: bool
  me: int     # this process's index, and the number of processes, as planned
  nproc: int
  layout: _Template | None = None
  leaves: Mapping[str, list[Any]] | None = None  # the saved items' leaves, in flatten order

  @property
  def nbytes(self) -> int:
    return sum(p.nbytes for p in self.pieces)

  @property
  def copy_bytes(self) -> int:
    """Bytes of a copy of the saved arrays (see :func:`orbax_flax.engine.saving.copy_leaves`)."""
    return self.layout.copy_bytes

  @property
  def copied(self) -> list[tuple[str, int, bool]]:
    """The device arrays such a copy copies (see :class:`_Template`)."""
    return self.layout.copied

  def bind(self, leaves: Mapping[str, list[Any]]) -> list[Piece]:
    """This plan's pieces, their sources the shards of ``leaves`` (same layout as planned)."""
    return self.layout.bind_pieces(leaves)

  def layout_entries(self) -> list[tuple[str, dict[str, Any]]]:
    """What every process of a multi-process save must plan alike (:meth:`_Template.entries`),
    and the dtype conversions, which the manifest records too."""
    return [*self.layout.entries, ("the dtype conversions", {"casts": self.manifest.get("casts", {})})]

  def layout_digest(self) -> str:
    """A digest of :meth:`layout_entries` (16 hex digits): equal on every process of a save.

    Process 0 commits its own plan's manifest over every process's data: a process whose
    plan differs (a renamed key, a missing leaf, another dtype or item name) would commit
    bytes in the wrong place, or bytes the manifest cannot find. Process 0 publishes this
    digest with the generation, and every other process compares it with its own
    (:meth:`orbax_flax.engine.saving.SaveRun.begin`).
    """
    casts = json.dumps(self.manifest.get("casts", {}), sort_keys=True)
    return _digest(self.layout.digest + casts)


def layout_difference(ours: Sequence[tuple[str, dict[str, Any]]],
                      theirs: Sequence[tuple[str, dict[str, Any]]], other: int,
                      compared_all: bool = True) -> str:
  """The first difference between process 0's layout entries (``ours``) and process
  ``other``'s (:meth:`Plan.layout_entries`), in words: a name one of them lacks (an item,
  a leaf), else the fields of the first entry that differ. ``compared_all`` False: ``theirs``
  was cut short (see :func:`orbax_flax.engine.saving`), and may end before the difference.

  Example:
    >>> a = [("item 'state'", {}), ("leaf state/w", {"dtype": "float32"})]
    >>> layout_difference(a, [("item 'state'", {}), ("leaf state/v", {"dtype": "float32"})], 1)
    'process 0 saves leaf state/w where process 1 saves leaf state/v'
    >>> layout_difference(a, [("item 'state'", {}), ("leaf state/w", {"dtype": "bfloat16"})], 1)
    'leaf state/w: process 0 saves it with dtype float32, process 1 with dtype bfloat16'
  """
  names0, names1 = [n for n, _ in ours], [n for n, _ in theirs]
  for k in range(max(len(names0), len(names1))):
    a = names0[k] if k < len(names0) else None
    b = names1[k] if k < len(names1) else None
    if a == b:
      continue
    if b is None and not compared_all:
      break
    if b is None or (a is not None and b in names0[k:] and a not in names1[k:]):
      return f"process 0 saves {a}, which process {other} does not save"
    if a is None or (a in names1[k:] and b not in names0[k:]):
      return f"process {other} saves {b}, which process 0 does not save"
    if a in names1[k:] and b in names0[k:]:
      return f"process 0 and process {other} save {a} and {b} in another order"
    return f"process 0 saves {a} where process {other} saves {b}"
  # Leaves first: an item's own fields (packed sizes, containers) follow from its leaves.
  for (name, f0), (_, f1) in sorted(zip(ours, theirs), key=lambda e: e[0][0].startswith("item ")):
    keys = [key for key in dict.fromkeys([*f0, *f1]) if f0.get(key) != f1.get(key)]
    # What the user chose before what follows from it (stored dtype, bytes, chunks).
    keys = [key for key in keys if key in _CHOSEN] or keys
    if keys:
      said = [_HASHED.get(key, key) for key in keys[:3]]
      if all(key not in _HASHED for key in keys[:3]):
        return (f"{name}: process 0 saves it with "
                + ", ".join(f"{key} {f0.get(key)}" for key in keys[:3])
                + f", process {other} with " + ", ".join(f"{key} {f1.get(key)}" for key in keys[:3]))
      return f"{name}: its {', '.join(said)} differ between process 0 and process {other}"
  return (f"they differ after the first {len(names1)} items and leaves, which process {other}"
          " could not send in full")


_CHOSEN = ("kind", "shape", "dtype", "key_impl", "key_shape", "casts")
# Fields of a layout entry that are digests: what differs, in words.
_HASHED = {"structure": "containers (dict keys, list or tuple, dataclass and namedtuple types)",
           "owners": "chunk writers (which process writes which chunk: the array's sharding)"}


def _digest(value: Any) -> str:
  text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
  return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class _ShardLayout:
  shard_shape: tuple[int, ...]
  holders: Mapping[tuple[int, ...], frozenset[int]]  # shard start -> processes holding it
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
  frozen = types.MappingProxyType({k: frozenset(v) for k, v in holders.items()})
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
    if len(name) > _ITEM_NAME_MAX:  # (ASCII: one byte a character)
      raise ValueError(f"item name {name[:40]}... has {len(name)} characters: an item is a"
                       f" directory, whose name has at most {_ITEM_NAME_MAX} on most file"
                       " systems. Fix: a shorter item name (put the detail in the tree).")


def check_destination(loc: Location, overwrite: bool) -> None:
  """Refuses to write where a checkpoint or foreign data already is.

  Raises:
    CheckpointExistsError: a checkpoint (without ``overwrite``), a file or foreign data is there.
    StorageError: the directory there vanished while it was checked (something else
      changes the path meanwhile).
  """
  if loc.is_local:
    p = loc.local_path
    if TMP_MARKER in loc.name:
      raise ValueError(f"{p}: names containing {TMP_MARKER!r} are reserved for"
                       " in-progress saves; choose another name.")
    if os.path.exists(p):
      try:
        is_dir = stat.S_ISDIR(os.stat(p).st_mode)
        committed = is_dir and os.path.exists(os.path.join(p, _manifest.MANIFEST_KEY))
        foreign = is_dir and not committed and bool(os.listdir(p))
      except FileNotFoundError as e:  # (it existed a moment ago)
        raise errors.StorageError(
            f"{p} was moved or removed while this save checked it: something else changes"
            " this path at the same time (another job writing here, or a process of this job"
            " not saving in step with the others). Nothing was written; save again once"
            " nothing else changes it.") from e
      if not is_dir:
        raise errors.CheckpointExistsError(
            f"{p} exists and is a file, not a checkpoint; choose another path.")
      if foreign:
        raise errors.CheckpointExistsError(
            f"{p} exists, is not empty and is not an orbax_flax checkpoint; refusing to"
            " write there (even with overwrite=True). Choose another path or remove it.")
      if committed and not overwrite:
        raise errors.CheckpointExistsError(
            f"a checkpoint already exists at {p}; pass overwrite=True to replace it or"
            " choose another path.")
  else:
    if _location.list_keys(loc.join(step_dir.INDEX)):  # one small listing, empty as a rule
      raise errors.CheckpointExistsError(
          f"{loc} is a CheckpointManager's directory of steps (it has a step index,"
          f" {step_dir.INDEX}/), not a checkpoint; refusing to write there (even with"
          " overwrite=True). Save to a step of it (its manager's save), or choose another"
          " path.")
    if not overwrite and _location.read_key(loc, _manifest.MANIFEST_KEY) is not None:
      raise errors.CheckpointExistsError(
          f"a checkpoint already exists at {loc}; pass overwrite=True to replace it or"
          " choose another path.")


def pack_pieces(item: str, size: int, sources: list[Source]) -> list[Piece]:
  """This process's packed buffer, cut at leaf boundaries into pieces of bounded size."""
  array = StoredArray(item, PACKED, (size,), "uint8", (_layout.pack_chunk_bytes(size),))
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
  implementation) that :func:`orbax_flax.engine.targets.match_target` checks a
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
  leaf = stored_leaf(leaf)
  shape = tuple(int(s) for s in leaf.shape)
  dtype = np.dtype(leaf.dtype)
  rec.update(shape=list(shape), dtype=dtype.name, stored_dtype=_tsio.stored_dtype(dtype),
             nbytes=math.prod(shape) * dtype.itemsize)
  return rec, leaf


def stored_leaf(leaf: Any) -> Any:
  """The array whose bytes are stored for an array leaf: a PRNG key array's key data, a
  numpy array in native (little-endian) byte order, any other array as it is."""
  if isinstance(leaf, np.ndarray):
    return leaf if leaf.dtype.isnative else leaf.astype(leaf.dtype.newbyteorder("="))
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(leaf)
  return leaf


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
  rec.setdefault("sharding", describe_sharding(sharding))
  if nbytes == 0:
    rec.update(chunk_shape=list(shape), owners=[])
    return rec

  lay = None if sharding is None else _shard_layout(sharding, shape)
  full_holders = frozenset(range(len(load))) if lay is None else lay.full_holders

  if nbytes <= PACK_MAX_BYTES and full_holders:
    owner = assign_owners([full_holders], nbytes, load)[0]
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
  owners = assign_owners_grid(group, group_holders, math.prod(chunk_shape) * dtype.itemsize,
                              load)
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


def describe_sharding(sharding: Any) -> dict[str, Any]:
  """A JSON description of a sharding, for humans and for metadata() (a new dict each call)."""
  if sharding is None:
    return {"type": "host", "text": "numpy (host)"}
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
    mesh = sharding.mesh
    return {"type": "NamedSharding",
            "mesh": {"axis_names": list(mesh.axis_names), "shape": [int(mesh.shape[a]) for a in mesh.axis_names]},
            "spec": spec,
            "text": f"mesh{dict(mesh.shape)} spec{tuple(sharding.spec)}"}
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return {"type": "SingleDeviceSharding", "text": "single device"}
  return {"type": type(sharding).__name__, "text": str(sharding)}


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


def assign_owners(holders: Sequence[frozenset[int]], chunk_bytes: int,
                  load: list[int]) -> list[int]:
  """Picks one writer per chunk among its holders, balancing bytes written.

  Args:
    holders: per chunk, the processes that hold its data.
    chunk_bytes: bytes per chunk.
    load: bytes assigned so far per process; updated in place.

  Returns:
    The owner process of each chunk.

  Example:
    >>> load = [0, 0]
    >>> assign_owners([frozenset({0, 1})] * 4, 10, load), load
    ([0, 1, 0, 1], [20, 20])
  """
  owners = []
  for procs in holders:
    owner = min(procs, key=lambda p: (load[p], p))
    load[owner] += chunk_bytes
    owners.append(owner)
  return owners


def assign_owners_grid(group: np.ndarray, group_holders: Sequence[frozenset[int]],
                       chunk_bytes: int, load: list[int]) -> np.ndarray:
  """:func:`assign_owners` over a chunk grid, in numpy: the same owners, the same ``load``.

  Chunk ``i`` is held by ``group_holders[group[i]]``. Where the holder sets
  are pairwise disjoint (the usual case: one holder per shard, or the
  processes of a data-parallel replica group), each group is assigned on its
  own in closed form: the greedy choice of the least-loaded holder, with equal
  chunks, hands out the slots ``(load[p] + j * chunk_bytes, p)`` in sorted
  order, so the ``m`` chunks of a group take its ``m`` smallest slots. Holder
  sets that overlap are assigned by :func:`assign_owners`, chunk by chunk.

  Args:
    group: per chunk (in order), the index of its holder set.
    group_holders: the holder sets.
    chunk_bytes: bytes per chunk (> 0).
    load: bytes assigned so far per process; updated in place.

  Returns:
    The owner process of each chunk (int64).

  Example:
    >>> load = [5, 0, 0]
    >>> assign_owners_grid(np.array([0, 0, 1, 0]), [frozenset({0, 1}), frozenset({2})], 10, load)
    array([1, 0, 2, 1])
    >>> load
    [15, 20, 10]
  """
  group = np.asarray(group, dtype=np.int64)
  disjoint, single = _holder_sets(tuple(group_holders))
  if not disjoint:
    owners = assign_owners([group_holders[g] for g in group.tolist()], chunk_bytes, load)
    return np.asarray(owners, dtype=np.int64)
  counts = np.bincount(group, minlength=len(group_holders))
  owners = single[group]
  alone = np.flatnonzero((counts > 0) & (single >= 0))  # groups of one holder: all theirs
  if len(alone):
    added = np.zeros(len(load), dtype=np.int64)
    np.add.at(added, single[alone], counts[alone] * chunk_bytes)
    for p in np.flatnonzero(added).tolist():
      load[p] += int(added[p])
  multi = np.flatnonzero((counts > 0) & (single < 0)).tolist()
  if multi:
    order = np.argsort(group, kind="stable")
    ends = np.cumsum(counts)
    for g in multi:
      where = order[ends[g] - counts[g]:ends[g]]
      procs = np.array(sorted(group_holders[g]), dtype=np.int64)
      got = _smallest_slots(np.array([load[p] for p in procs.tolist()], dtype=np.int64),
                            chunk_bytes, len(where))
      owners[where] = procs[got]
      for i, n in enumerate(np.bincount(got, minlength=len(procs)).tolist()):
        load[int(procs[i])] += n * chunk_bytes
  return owners


@functools.lru_cache(maxsize=256)
def _holder_sets(sets: tuple[frozenset[int], ...]) -> tuple[bool, np.ndarray]:
  """Whether ``sets`` are pairwise disjoint, and each set's only process (-1 if several)."""
  disjoint = sum(len(h) for h in sets) == len(frozenset().union(*sets))
  single = np.array([next(iter(h)) if len(h) == 1 else -1 for h in sets], dtype=np.int64)
  single.flags.writeable = False
  return disjoint, single


def _smallest_slots(loads: np.ndarray, c: int, m: int) -> np.ndarray:
  """Positions in ``loads`` of the ``m`` smallest slots ``(loads[i] + j * c, i)``, in order."""
  def count(v: int) -> int:  # slots of value <= v
    return int(np.maximum(0, (v - loads) // c + 1).sum())
  lo = int(loads.min())
  hi = lo + (m - 1) * c  # the least-loaded holder alone has m slots up to here
  while lo < hi:
    mid = (lo + hi) // 2
    if count(mid) >= m:
      hi = mid
    else:
      lo = mid + 1
  per = np.maximum(0, (lo - loads) // c + 1)  # every slot up to the m-th smallest (ties too)
  who = np.repeat(np.arange(len(loads)), per)
  j = np.arange(len(who)) - np.repeat(np.cumsum(per) - per, per)
  value = loads[who] + j * c
  return who[np.lexsort((who, value))[:m]]


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
  devices = _multihost.addressable_device_assignment(sharding)
  out, seen = [], set()
  for k, device in enumerate(devices):
    index = indices[device]
    start = tuple(s.start or 0 for s in index)
    if start not in seen:
      seen.add(start)
      out.append((k, index))
  return tuple(out)


_MAX_LAYOUTS = 16  # layouts a planner keeps


class Planner:
  """Plans the saves of one owner, keeping the layouts it worked out (the last 16).

  Example:
    >>> import numpy as np, tempfile, os
    >>> planner = Planner()
    >>> loc = Location.parse(os.path.join(tempfile.mkdtemp(), "c"))
    >>> plan = planner.plan(loc, {"state": {"w": np.ones(4, np.float32)}})
    >>> [p.nbytes for p in plan.pieces], plan.manifest["items"]["state"]["leaves"][0]["shape"]
    ([16], [4])
  """

  def __init__(self):
    self._layouts: dict[tuple, _Template] = {}  # by what a layout depends on

  def plan(self, loc: Location, items: Mapping[str, Any], overwrite: bool = False,
           custom_metadata: Mapping[str, Any] | None = None, dtype: Any = None, *,
           bind: bool = True) -> Plan:
    """Validates everything and plans this process's writes. Reads no array data and writes
    nothing (it checks the destination).

    ``dtype`` converts arrays first (see :func:`cast_items`); the manifest
    records what each converted array was. ``bind=False`` leaves the pieces
    unbound (:class:`Plan`): finding every shard of a new array costs a few
    microseconds each, which a save of a copy spends in the background.
    """
    items, casts = cast_items(items, dtype)
    check_items(items)
    custom = _custom(custom_metadata)
    me, nproc = _multihost.process_index(), _multihost.process_count()
    template, flat = self._template(items, me, nproc)
    # (A numpy bool array of bytes other than 0/1 keeps its signature, so its layout too.)
    leaves = {item: [_tree.canonical_bool(x) if isinstance(x, np.ndarray) and x.dtype == np.bool_
                     else x for x in leaves] for item, (leaves, _) in flat.items()}
    items_meta = template.bind_records(leaves)
    pieces = template.bind_pieces(leaves) if bind else template.pieces
    check_destination(loc, overwrite)
    manifest = {
        "format": _manifest.FORMAT, "version": _manifest.VERSION,
        "library_version": LIBRARY_VERSION, "created": time.time(),
        "process_count": nproc, "device_count": jax.device_count(),
        "all_chunks_stored": True,
        "database_identity": True,  # each database names itself (orbax_flax.format._tsio.IDENTITY_KEY)
        "custom": custom, "items": items_meta,
    }
    if casts:
      manifest["casts"] = casts
    return Plan(loc, manifest, pieces, overwrite, me, nproc, template, leaves)

  def check(self, items: Mapping[str, Any], custom_metadata: Mapping[str, Any] | None,
            dtype: Any = None) -> None:
    """Refuses what :meth:`plan` would refuse of ``items``, ``custom_metadata`` and ``dtype``
    (item names, leaf types, deleted arrays, metadata, conversions), reading and writing
    nothing and converting nothing; the layout is kept for the plan."""
    cast_items(items, dtype, check_only=True)
    check_items(items)
    _custom(custom_metadata)
    template, flat = self._template(items, _multihost.process_index(), _multihost.process_count())
    template.bind_records({item: leaves for item, (leaves, _) in flat.items()})

  def layout(self, items: Mapping[str, Any]) -> _Template:
    """The layout of a save of ``items``: this process's pieces (shapes and dtypes, no data
    bound) and what a copy of the state costs.

    For sizing the staging memory of a save before it is due. Reads no array
    data and no storage; the layout is kept, so the save's own planning that
    follows is quick. It is shared: do not change it.
    """
    check_items(items)
    template, _ = self._template(items, _multihost.process_index(), _multihost.process_count())
    return template

  def _template(self, items: Mapping[str, Any], me: int,
                nproc: int) -> tuple[_Template, dict[str, Any]]:
    """The (kept) layout of ``items``, and the items flattened."""
    flat = {item: jax.tree_util.tree_flatten(tree) for item, tree in items.items()}
    key = (me, nproc, tuple((item, treedef, tuple(_signature(l) for l in leaves))
                            for item, (leaves, treedef) in flat.items()))
    template = self._layouts.get(key)
    if template is None:
      template = _Template.build(items, me, nproc)
      if template.cacheable(flat):
        if len(self._layouts) >= _MAX_LAYOUTS:
          self._layouts.pop(next(iter(self._layouts)))
        self._layouts[key] = template
    return template, flat


def _custom(custom_metadata: Mapping[str, Any] | None) -> Any:
  """``custom_metadata`` as the manifest will hold it (JSON), or a clear error."""
  try:
    text = json.dumps(dict(custom_metadata or {}), allow_nan=False)
    custom = json.loads(text)
  except (TypeError, ValueError) as e:
    raise TypeError(f"custom_metadata must be a JSON-serialisable dict: {e}") from None
  if len(text) > _manifest.MAX_MANIFEST_BYTES // 2:  # checked here, before anything is written
    raise ValueError(f"custom_metadata is {len(text) >> 20} MiB as JSON; it lives in the"
                     f" checkpoint's manifest, which a reader takes up to"
                     f" {_manifest.MAX_MANIFEST_BYTES >> 20} MiB: keep it under"
                     f" {_manifest.MAX_MANIFEST_BYTES >> 21} MiB, and save large data as an"
                     " item (arrays) instead.")
  return custom


def _signature(leaf: Any) -> tuple:
  """What the layout of a leaf depends on (hashable)."""
  if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
    return ("jax", leaf.shape, leaf.dtype, leaf.sharding)
  if isinstance(leaf, np.ndarray):
    return ("numpy", leaf.shape, leaf.dtype.str)
  return ("other", type(leaf))


def cast_items(items: Mapping[str, Any], dtype: Any, check_only: bool = False
               ) -> tuple[Mapping[str, Any], dict[str, str]]:
  """``items`` with arrays converted for ``save(..., dtype=...)``, and what each was.

  ``check_only``: raise what the conversion refuses, convert nothing (``items`` as given).

  Example:
    >>> items, casts = cast_items({"s": {"w": np.ones(2, np.float32), "n": np.arange(2)}}, "float16")
    >>> items["s"]["w"].dtype, items["s"]["n"].dtype, casts
    (dtype('float16'), dtype('int64'), {'s/w': 'float32'})
  """
  if dtype is None or not isinstance(items, Mapping):
    return items, {}
  casts: dict[str, str] = {}

  def wanted(where: str, have: np.dtype) -> np.dtype | None:
    if callable(dtype) and not isinstance(dtype, (str, np.dtype, type)):
      got = dtype(where, have)
    elif jnp.issubdtype(have, jnp.floating):
      got = dtype
    else:
      got = None
    if got is None:
      return None
    got = _tree.dtype_from_name(got) if isinstance(got, str) else np.dtype(got)
    return None if got == have else got

  out = {}
  for item, tree in items.items():
    def one(kp, leaf, item=item):
      if not isinstance(leaf, (jax.Array, np.ndarray)) or jax.dtypes.issubdtype(
          leaf.dtype, jax.dtypes.prng_key):
        return leaf
      where = f"{item}/{_tree.path_str(tuple(_tree.key_part(k) for k in kp))}"
      to = wanted(where, np.dtype(leaf.dtype))
      if to is None:
        return leaf
      if isinstance(leaf, jax.Array) and jax.dtypes.canonicalize_dtype(to) != to:
        raise ValueError(
            f"save(..., dtype=...) asks for {to.name} for {where}, a jax.Array, but JAX makes"
            f" no {to.name} arrays while jax_enable_x64 is off (it would stay"
            f" {np.dtype(leaf.dtype).name}); enable it (jax.config.update('jax_enable_x64',"
            f" True)), pass host arrays (jax.device_get), or choose a 32-bit dtype")
      casts[where] = np.dtype(leaf.dtype).name
      return leaf if check_only else leaf.astype(to)
    out[item] = jax.tree_util.tree_map_with_path(one, tree)
  return out, casts


@dataclasses.dataclass
class _Ref:
  """A source of a piece, by position: leaf ``leaf`` of item ``item``, addressable shard ``k``."""
  item: str
  leaf: int
  k: int | None  # None: the leaf itself (numpy, or a process-local jax.Array)


class _Template:
  """The plan of one layout, with references in place of arrays."""

  def __init__(self, items_meta, pieces, value_slots, leaf_paths, copied):
    self.items_meta = items_meta        # item -> {structure, leaves (records), packed}
    self.pieces = pieces                # Pieces whose Source.value are _Refs
    self.value_slots = value_slots      # item -> [(record index, leaf index)] of inline values
    self.leaf_paths = leaf_paths        # item -> [key path] of every leaf, in flatten order
    # The device arrays a copy of the state copies (a fully replicated one once, its first
    # shard): (item, leaf index, fully replicated); and the bytes of that copy, numpy leaves
    # (copied on the host) included.
    self.copied: list[tuple[str, int, bool]] = [c for c, _ in copied if c is not None]
    self.copy_bytes: int = sum(n for _, n in copied)

  @property
  def nbytes(self) -> int:
    return sum(p.nbytes for p in self.pieces)

  @functools.cached_property
  def entries(self) -> tuple[tuple[str, dict[str, Any]], ...]:
    """What every process must plan alike, in order: per item its position, containers and
    packed buffer sizes; per leaf its path, and for an array its record (kind, shape, dtype,
    stored dtype, PRNG key implementation, stored name, chunk shape, chunk writers, packed
    offset). Not an inline value's value, which process 0 saves for every process, nor an
    array's sharding text (its layout is in the chunks and their writers). Every process
    computes the same records from the same tree (:mod:`this module <._planning>`)."""
    out = []
    for n, (item, meta) in enumerate(self.items_meta.items()):
      out.append((f"item {item!r}", {"position": n, "structure": _digest(meta["structure"]),
                                     "packed": meta["packed"]}))
      values = dict(self.value_slots[item])
      for r, rec in enumerate(meta["leaves"]):
        if rec is None:  # an inline value
          path = self.leaf_paths[item][values[r]]
          out.append((f"leaf {item}/{_tree.path_str(path)}", {"kind": "value"}))
          continue
        fields = {k: v for k, v in rec.items() if k not in ("path", "sharding", "owners")}
        fields["owners"] = _digest(rec["owners"])
        out.append((f"leaf {item}/{_tree.path_str(tuple(rec['path']))}", fields))
    return tuple(out)

  @functools.cached_property
  def digest(self) -> str:
    return _digest(list(self.entries))

  @classmethod
  def build(cls, items: Mapping[str, Any], me: int, nproc: int) -> _Template:
    load = [0] * nproc
    pieces: list[Piece] = []
    items_meta: dict[str, Any] = {}
    value_slots: dict[str, list[tuple[int, int]]] = {}
    leaf_paths: dict[str, list[Any]] = {}
    copied: list[tuple[tuple[str, int, bool], int]] = []
    for item, tree in items.items():
      structure, leaves = _tree.encode_structure(tree)
      leaf_paths[item] = [path for path, _, _ in leaves]
      records = []
      pack_sizes = [0] * nproc
      packed: list[Source] = []  # this process's packed leaves, by offset
      value_slots[item] = []
      for i, (path, leaf, kind) in enumerate(leaves):
        if kind is None:
          raise _tree.unsupported_leaf_error(item, path, leaf)
        if kind == "value":
          value_slots[item].append((len(records), i))
          records.append(None)
          continue
        rec = plan_array(item, f"a{i}", path, leaf, kind, me, load, pack_sizes, packed,
                                   pieces, lambda k, item=item, i=i: _Ref(item, i, k))
        records.append(rec)
        if kind == "jax" and leaf.sharding.addressable_devices:
          copied.append(_copied(item, i, stored_leaf(leaf)))
        elif kind == "numpy":  # copied on the host
          copied.append((None, rec["nbytes"]))
      if pack_sizes[me]:
        pieces.extend(pack_pieces(item, pack_sizes[me], packed))
      items_meta[item] = {"structure": structure, "leaves": records,
                          "packed": {str(p): s for p, s in enumerate(pack_sizes) if s}}
    return cls(items_meta, pieces, value_slots, leaf_paths, copied)

  def cacheable(self, flat: Mapping[str, Any]) -> bool:
    """True if jax's flatten order is the one the template was built in (it always is for
    dicts, lists, tuples, namedtuples and registered nodes)."""
    return all(len(leaves) == len(self.leaf_paths[item]) for item, (leaves, _) in flat.items())

  def bind_records(self, leaves: Mapping[str, list[Any]]) -> dict[str, Any]:
    """The manifest items of one save of this layout (and a clear error for a deleted array)."""
    for item, values in leaves.items():
      for i, leaf in enumerate(values):
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
          raise deleted_leaf_error(item, self.leaf_paths[item][i])
    items_meta = {}
    for item, meta in self.items_meta.items():
      records = list(meta["leaves"])
      for r, i in self.value_slots[item]:
        value = leaves[item][i]
        if _tree.leaf_kind(value) != "value":  # same type signature, other kind (cannot happen)
          raise TypeError(f"{item}/{_tree.path_str(self.leaf_paths[item][i])}: unexpected leaf")
        records[r] = value_record(self.leaf_paths[item][i], value)
      items_meta[item] = dict(meta, leaves=records)
    return items_meta

  def bind_pieces(self, leaves: Mapping[str, list[Any]]) -> list[Piece]:
    """The pieces of one save of this layout, their sources the shards of ``leaves``."""
    shards: dict[tuple[str, int], Any] = {}  # (item, leaf) -> the leaf, or its addressable shards

    def resolve(ref: _Ref) -> Any:
      got = shards.get((ref.item, ref.leaf))
      if got is None:
        leaf = stored_leaf(leaves[ref.item][ref.leaf])
        replicated = isinstance(leaf, jax.Array) and leaf.is_fully_replicated
        got = shards[(ref.item, ref.leaf)] = (leaf, replicated)
      leaf, replicated = got
      if ref.k is None:
        return leaf
      return leaf.addressable_data(0 if replicated else ref.k)

    pieces = []
    for p in self.pieces:
      sources = [Source(resolve(s.value), s.within, s.offset, s.leaf_shape, s.leaf_dtype, s.index)
                 for s in p.sources]
      pieces.append(Piece(p.array, p.slices, p.shape, p.dtype, sources))
    return pieces


def _copied(item: str, i: int, leaf: jax.Array) -> tuple[tuple[str, int, bool], int]:
  """What a copy of the state copies of one device array, and its bytes: every addressable
  shard (replicas too), or of a fully replicated array its first shard only."""
  replicated = leaf.is_fully_replicated
  shards = 1 if replicated else len(leaf.sharding.addressable_devices)
  shard_shape = leaf.sharding.shard_shape(tuple(leaf.shape))
  return (item, i, replicated), shards * math.prod(shard_shape) * np.dtype(leaf.dtype).itemsize
