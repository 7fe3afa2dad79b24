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

The plan also records the manifest (everything but the generation id, which is
chosen when the background phase starts).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import math
import mmap
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from orbax_flax import _layout
from orbax_flax import _location
from orbax_flax import _manifest
from orbax_flax import _multihost
from orbax_flax import _tree
from orbax_flax import _tsio
from orbax_flax import errors
from orbax_flax._location import Location

LIBRARY_VERSION = "0.1.0"
TMP_MARKER = ".ofx-tmp-"
PACK_MAX_BYTES = 1 << 20      # arrays up to this size are packed
PACK_CHUNK_BYTES = 4 << 20    # checksum granularity of a packed buffer
PACKED = "packed"             # name of the packed zarr3 array in each database
_PACK_ALIGN = 16
_ITEM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclasses.dataclass
class Piece:
  """One chunk this process writes: where it goes and its host data."""
  slices: tuple[slice, ...]
  data: np.ndarray


@dataclasses.dataclass
class ArrayWrite:
  """A chunked array: the chunks of it that this process writes."""
  item: str
  name: str
  shape: tuple[int, ...]
  dtype: str
  chunk_shape: tuple[int, ...]
  pieces: list[Piece]


@dataclasses.dataclass
class PackWrite:
  """This process's packed buffer for one item."""
  item: str
  size: int
  sources: list[tuple[int, np.dtype, tuple[int, ...], Any]]  # offset, dtype, shape, leaf
  buffer: np.ndarray | None = None


@dataclasses.dataclass
class Plan:
  loc: Location
  manifest: dict[str, Any]
  arrays: list[ArrayWrite]
  packs: list[PackWrite]
  overwrite: bool
  seq: int
  cancelled: Any = None  # a threading.Event set by AsyncSave.cancel()

  @property
  def nbytes(self) -> int:
    return (sum(p.data.nbytes for a in self.arrays for p in a.pieces)
            + sum(p.size for p in self.packs))


@dataclasses.dataclass(frozen=True)
class _ShardLayout:
  shard_shape: tuple[int, ...]
  holders: dict[tuple[int, ...], frozenset[int]]  # shard start -> processes holding it
  full_holders: frozenset[int]                    # processes holding every shard


@functools.lru_cache(maxsize=1024)
def _shard_layout(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> _ShardLayout:
  holders: dict[tuple[int, ...], set[int]] = {}
  for device, index in sharding.devices_indices_map(shape).items():
    start = tuple(s.start or 0 for s in index)
    holders.setdefault(start, set()).add(device.process_index)
  procs = set().union(*holders.values())
  full = frozenset(p for p in procs if all(p in h for h in holders.values()))
  return _ShardLayout(tuple(sharding.shard_shape(shape)),
                      {k: frozenset(v) for k, v in holders.items()}, full)


def check_items(items: Any) -> None:
  if not isinstance(items, Mapping) or not items:
    raise TypeError(f"items must be a non-empty dict mapping item names to pytrees, e.g."
                    f" {{'state': state, 'extra': {{'epoch': 3}}}}; got {type(items).__name__}")
  for name in items:
    if not isinstance(name, str) or not _ITEM_NAME.match(name):
      raise ValueError(f"invalid item name {name!r}: use letters, digits, '_', '.', '-',"
                       " starting with a letter or digit (e.g. 'state').")


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


def make_plan(loc: Location, items: Mapping[str, Any], overwrite: bool,
              custom_metadata: Mapping[str, Any] | None, seq: int) -> Plan:
  """Validates everything and plans this process's writes. Writes nothing."""
  check_items(items)
  try:
    custom = json.loads(json.dumps(dict(custom_metadata or {}), allow_nan=False))
  except (TypeError, ValueError) as e:
    raise TypeError(f"custom_metadata must be a JSON-serialisable dict: {e}") from None
  me, nproc = _multihost.process_index(), _multihost.process_count()
  load = [0] * nproc
  arrays: list[ArrayWrite] = []
  packs: list[PackWrite] = []
  items_meta: dict[str, Any] = {}
  for item, tree in items.items():
    structure, leaves = _tree.encode_structure(tree)
    records = []
    pack_sizes = [0] * nproc
    pack = PackWrite(item, 0, [])
    for i, (path, leaf) in enumerate(leaves):
      kind = _tree.leaf_kind(leaf)
      if kind is None:
        raise _tree.unsupported_leaf_error(item, path, leaf)
      if kind == "jax" and leaf.is_deleted():
        raise errors.UnsupportedLeafError(
            f"Cannot save leaf {item}/{_tree.path_str(path)}: its jax.Array was deleted"
            " (donated to a jitted function?). Save the state before donating it, or save"
            " the arrays the function returned.")
      if kind == "numpy" and not leaf.dtype.isnative:
        leaf = leaf.astype(leaf.dtype.newbyteorder("="))  # stored little-endian, as named
      if kind == "value":
        records.append({"path": list(path), "kind": "value", "value": _tree.encode_value(leaf)})
        continue
      rec, write = _plan_array(item, f"a{i}", path, leaf, kind, me, load, pack_sizes, pack)
      records.append(rec)
      if write is not None and write.pieces:
        arrays.append(write)
    pack.size = pack_sizes[me]
    if pack.size:
      packs.append(pack)
    items_meta[item] = {"structure": structure, "leaves": records,
                        "packed": {str(p): s for p, s in enumerate(pack_sizes) if s}}
  check_destination(loc, overwrite)
  manifest = {
      "format": _manifest.FORMAT, "version": _manifest.VERSION,
      "library_version": LIBRARY_VERSION, "created": time.time(),
      "process_count": nproc, "device_count": jax.device_count(),
      "custom": custom, "items": items_meta,
  }
  return Plan(loc, manifest, arrays, packs, overwrite, seq)


def _plan_array(item: str, name: str, path: _tree.Path, leaf: Any, kind: str, me: int,
                load: list[int], pack_sizes: list[int],
                pack: PackWrite) -> tuple[dict[str, Any], ArrayWrite | None]:
  rec: dict[str, Any] = {"path": list(path), "kind": kind}
  if kind == "jax" and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    rec.update(key_impl=str(jax.random.key_impl(leaf)), key_shape=list(leaf.shape))
    leaf = jax.random.key_data(leaf)
  sharding = leaf.sharding if kind == "jax" else None
  if sharding is not None and len(load) > 1 and leaf.is_fully_addressable:
    # A process-local array (e.g. jnp.int32(0)) in a multi-process job: like a
    # numpy leaf, every process holds its own copy, assumed identical.
    sharding, leaf = None, np.asarray(leaf)
    rec["sharding"] = {"type": "process-local", "text": "process-local (same on every process)"}
  shape = tuple(int(s) for s in leaf.shape)
  dtype = np.dtype(leaf.dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  rec.update(name=name, shape=list(shape), dtype=dtype.name,
             stored_dtype=_tsio.stored_dtype(dtype), nbytes=nbytes)
  rec.setdefault("sharding", _manifest.describe_sharding(sharding))
  if nbytes == 0:
    rec.update(chunk_shape=list(shape), owners=[])
    return rec, None

  if sharding is None:
    lay = None
    full_holders = frozenset(range(len(load)))
  else:
    lay = _shard_layout(sharding, shape)
    full_holders = lay.full_holders

  if nbytes <= PACK_MAX_BYTES and full_holders:
    owner = _layout.assign_owners([full_holders], nbytes, load)[0]
    offset = pack_sizes[owner]
    pack_sizes[owner] = offset + -(-nbytes // _PACK_ALIGN) * _PACK_ALIGN
    rec.update(owners=[owner], packed_offset=offset)
    if owner == me:
      pack.sources.append((offset, dtype, shape, leaf))
    return rec, None

  shard_shape = shape if lay is None else lay.shard_shape
  # A shard held by k processes is cut into at least k chunks, so that its
  # holders share the writing.
  sharers = len(full_holders) if lay is None else max(len(h) for h in lay.holders.values())
  shard_bytes = math.prod(shard_shape) * dtype.itemsize
  chunk_limit = min(_layout.DEFAULT_MAX_CHUNK_BYTES, -(-shard_bytes // sharers))
  chunk_shape = _layout.choose_chunk_shape(shard_shape, dtype.itemsize, chunk_limit)
  chunking = _layout.Chunking(shape, chunk_shape)
  chunk_boxes = [chunking.chunk_box(c) for c in range(chunking.num_chunks)]
  starts = [tuple((lo // s) * s for (lo, _), s in zip(b, shard_shape)) for b in chunk_boxes]
  holders = [full_holders if lay is None else lay.holders[s] for s in starts]
  owners = _layout.assign_owners(holders, math.prod(chunk_shape) * dtype.itemsize, load)
  rec.update(chunk_shape=list(chunk_shape), owners=owners)
  write = ArrayWrite(item, name, shape, rec["stored_dtype"], chunk_shape, [])
  if me not in owners:
    return rec, write
  if lay is None:
    local = {tuple(0 for _ in shape): leaf}
  else:
    local = {}
    for shard in leaf.addressable_shards:
      local.setdefault(tuple(s.start or 0 for s in shard.index), shard)
  views: dict[tuple[int, ...], np.ndarray] = {}
  for box, start, owner in zip(chunk_boxes, starts, owners):
    if owner != me:
      continue
    if start not in views:
      src = local[start]
      views[start] = src if isinstance(src, np.ndarray) else np.asarray(src.data)
    if chunk_shape == shard_shape:  # the common case: one chunk per shard
      data = views[start]
    else:
      shard_box = tuple((s, s + n) for s, n in zip(start, shard_shape))
      data = views[start][_layout.relative(box, shard_box)]
    write.pieces.append(Piece(_layout.box_to_slices(box), data))
  return rec, write


def fill_packs(plan: Plan) -> None:
  """Copies every packed leaf of this process into its item's buffer."""
  for pack in plan.packs:
    buf = np.zeros(pack.size, np.uint8)
    for offset, dtype, shape, leaf in pack.sources:
      dst = buf[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
      if isinstance(leaf, np.ndarray):
        dst[...] = leaf
        continue
      seen = set()
      for shard in leaf.addressable_shards:
        start = tuple(s.start or 0 for s in shard.index)
        if start not in seen:
          seen.add(start)
          dst[shard.index] = np.asarray(shard.data)
    pack.buffer = buf
    pack.sources = []


_copy_pool: concurrent.futures.ThreadPoolExecutor | None = None


def pack_chunk_bytes(size: int) -> int:
  """The chunk length of a packed buffer of ``size`` bytes (its checksum granularity)."""
  return min(size, PACK_CHUNK_BYTES)


def aligned_arrays(specs: list[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
  """Uninitialised 64-byte aligned arrays of (shape, dtype), carved from one fresh mapping.

  One anonymous mapping instead of thousands of allocations: steadier copy times
  (no transparent-huge-page compaction, which made copies up to 2x slower on the
  VMs we measured) and an exact return to the OS once every array is freed.
  64-byte alignment lets JAX's CPU client adopt a buffer without copying it.

  Example:
    >>> a, b = aligned_arrays([((3,), np.dtype(np.float32)), ((2, 2), np.dtype(np.int8))])
    >>> a.shape, b.dtype, b.ctypes.data % 64
    ((3,), dtype('int8'), 0)
  """
  nbytes = [math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in specs]
  sizes = [-(-n // 64) * 64 for n in nbytes]
  if not sum(sizes):
    return [np.empty(shape, dtype) for shape, dtype in specs]
  arena = np.frombuffer(mmap.mmap(-1, sum(sizes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                        np.uint8)
  out, offset = [], 0
  for (shape, dtype), n, size in zip(specs, nbytes, sizes):
    out.append(arena[offset:offset + n].view(dtype).reshape(shape))
    offset += size
  return out


def copy_pieces(plan: Plan) -> None:
  """Copies every chunk to fresh host memory, in parallel threads."""
  global _copy_pool
  pieces = sorted((p for a in plan.arrays for p in a.pieces), key=lambda p: -p.data.nbytes)
  if not pieces:
    return
  if _copy_pool is None:
    _copy_pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=max(2, os.cpu_count() or 1), thread_name_prefix="orbax_flax-copy")
  jobs = list(zip(pieces, aligned_arrays([(p.data.shape, p.data.dtype) for p in pieces])))

  def copy(job: tuple[Piece, np.ndarray]) -> None:
    piece, dst = job
    np.copyto(dst, piece.data)
    piece.data = dst

  for f in [_copy_pool.submit(copy, j) for j in jobs]:
    f.result()
