"""The one decoder of manifests: JSON in, checked records (:mod:`orbax_flax.format._records`) out.

A manifest's hashes only say it is intact, not that it was written by this
library: names become paths, offsets select bytes and dtypes become buffers.
Every field a reader will use is checked in the pass that builds its record,
for the commit manifest (:func:`decode`) and the local tier's blob index
(:func:`decode_local_items`); a reader never sees unchecked JSON.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import keyword
import math
import re
from collections.abc import Mapping
from typing import Any, NoReturn

import jax
import numpy as np

from orbax_flax.core import _tree
from orbax_flax.format import _tsio
from orbax_flax import errors
from orbax_flax.format._records import Array, Base, Held, Item, Manifest, Record, Summary, Value

PACK_ALIGN = 16  # packed arrays start at multiples of this (orbax_flax.engine._planning lays them out)
ITEM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_GENERATION = re.compile(r"^[0-9a-f]{16}$")
_ARRAY_NAME = re.compile(r"^a[0-9]+$")
_OWNER = re.compile(r"^(0|[1-9][0-9]*)$")
_INT_TEXT = re.compile(r"^-?[0-9]{1,4000}$")
_HASH = re.compile(r"^[0-9a-f]{32}$")
BASE_DIR = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]*$")  # a differential base: a sibling step
OWNER_STRIDE = 1 << 24  # expanded owners: home * OWNER_STRIDE + process (home 0: this one)
_NODES = frozenset({"dict", "list", "tuple", "namedtuple", "node", "none", "leaf"})


def decode_summary(summary: Mapping[str, Any], where: str) -> Summary:
  """The checked :class:`Summary` of a summary line's JSON (its format and version checked).

  Raises:
    CheckpointFormatError: naming the manifest, the field and the value.
  """
  return Summary(**_Checker(where).summary(summary))


def decode(summary: Mapping[str, Any], items: Any, version: int, where: str) -> Manifest:
  """The checked :class:`Manifest` of a manifest's summary and items (JSON, owners expanded).

  A manifest's hashes only say it is intact, not that it was written by this
  library: names become paths, offsets select bytes and dtypes become buffers,
  so a crafted one must not point a read outside the checkpoint, at another
  array's bytes, or build objects. Checked, besides the summary's fields:

  * item names are plain names (no ``/`` or ``..``);
  * the structure is well formed and names each leaf exactly once, at the key
    path its record states;
  * inline values decode exactly (a tag, and a value of that tag's type);
  * arrays: a unique name ``a<N>``, ``dtype`` and ``stored_dtype`` as a save
    writes them (the stored one is the dtype, or its raw bits where zarr3 lacks
    it), a shape of integers whose size fits in memory, ``nbytes`` equal to the
    shape's bytes, owners among the processes; a chunk grid of chunks no larger
    than the array with one owner per chunk; or a packed slot, where each
    process's packed arrays tile its buffer exactly as a save lays them out
    (each at the next multiple of ``PACK_ALIGN`` bytes: no gaps, no overlaps);
    PRNG keys of an implementation jax knows, with its key data's shape.
  * a differential save's references (bases: sibling steps; per chunk or packed segment: -1
    or a base; orbax_flax.differential.refs), folded into owners (base + 1) * OWNER_STRIDE.

  Raises:
    CheckpointFormatError: naming the manifest, the field and the value.
  """
  checker = _Checker(where)
  fields = checker.summary(summary)
  fields["version"] = version
  return Manifest(items=checker.items(items, fields["process_count"]), **fields)


def decode_local_items(items: Any, where: str) -> dict[str, Item]:
  """The checked items of a local tier blob's index: arrays held as ``boxes``.

  The same checks as :func:`decode` for paths, values, dtypes, shapes, keys and
  structure; each held box lies within its array (offsets are checked against
  the blob by its reader).

  Raises:
    CheckpointFormatError: naming the index, the field and the value.
  """
  return _Checker(where, local=True).items(items, 0)


class _Checker:
  """One pass over a manifest's JSON that checks it and builds its records."""

  def __init__(self, where: str, local: bool = False):
    self.where, self.local = where, local
    self.nbases = 0  # the summary's differential bases
    self._dtypes: dict[str, np.dtype] = {}  # the dtype names checked so far

  def bad(self, problem: str) -> NoReturn:
    what = "index" if self.local else "manifest"
    raise errors.CheckpointFormatError(
        f"{self.where}: {problem}; this {what} was not written by orbax_flax (damaged or"
        " crafted).")

  def count(self, x: Any, what: str, lo: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < lo:
      self.bad(f"{what} is {_short(x)}, not an integer >= {lo}")
    return x

  def summary(self, s: Mapping[str, Any]) -> dict[str, Any]:
    self.count(s.get("process_count"), "process_count", 1)
    self.count(s.get("device_count"), "device_count")
    gen = s.get("generation")
    if not isinstance(gen, str) or not _GENERATION.match(gen):
      self.bad(f"generation {_short(gen)} is not 16 hex digits")
    created = s.get("created")
    if isinstance(created, bool) or not isinstance(created, (int, float)) or created != created:
      self.bad(f"created is {_short(created)}, not a time")
    if not isinstance(s.get("library_version"), str):
      self.bad(f"library_version is {_short(s.get('library_version'))}, not a string")
    for field, kind in (("custom", dict), ("casts", dict), ("item_bytes", dict),
                        ("all_chunks_stored", bool), ("database_identity", bool),
                        ("bases", list)):
      if field in s and not isinstance(s[field], kind):
        self.bad(f"{field} is {_short(s[field])}, not a {kind.__name__}")
    for leaf, dtype in s.get("casts", {}).items():
      if not isinstance(dtype, str):
        self.bad(f"casts[{leaf!r}] is {_short(dtype)}, not a dtype name")
    bases, stored = _differential(self, s, gen)
    turn = s.get("scrub_turn", 0)
    if type(turn) is not int or not 0 <= turn < 1 << 31:
      self.bad(f"scrub_turn is {_short(turn)}, not a count")
    return {"format": s["format"], "version": s["version"], "created": created,
            "process_count": s["process_count"], "device_count": s["device_count"],
            "library_version": s["library_version"], "generation": gen,
            "custom": s.get("custom", {}), "casts": s.get("casts", {}),
            "item_bytes": s.get("item_bytes", {}),
            "all_chunks_stored": s.get("all_chunks_stored", False),
            "database_identity": s.get("database_identity", False), "bases": bases,
            "stored_bytes": stored, "scrub_turn": turn}

  def items(self, items: Any, nproc: int) -> dict[str, Item]:
    if not isinstance(items, dict):
      self.bad(f"items is {_short(items)}, not an object")
    out = {}
    for name, item in items.items():
      if not ITEM_NAME.match(name):
        self.bad(f"item name {name!r} is not a plain name")
      if not isinstance(item, dict) or not isinstance(item.get("leaves"), list):
        self.bad(f"item {name!r} has no list of leaves")
      out[name] = self.item(name, item, nproc)
    return out

  def item(self, name: str, item: dict[str, Any], nproc: int) -> Item:
    packed = item.get("packed", {})
    if not isinstance(packed, dict):
      self.bad(f"item {name!r}: packed is {_short(packed)}, not an object")
    for owner, size in packed.items():
      if not _OWNER.match(owner) or int(owner) >= nproc:
        self.bad(f"item {name!r}: packed buffer of process {owner!r}, of {nproc} process(es)")
      self.count(size, f"item {name!r}: packed[{owner!r}]")
    leaves: list[Record] = []
    slots: dict[str, list[tuple[int, int, str]]] = {}
    names: dict[str, str] = {}
    for rec in item["leaves"]:
      if not isinstance(rec, dict):
        self.bad(f"item {name!r}: a leaf is {_short(rec)}, not an object")
      path = rec.get("path")
      if not isinstance(path, list) or not all(isinstance(p, str) for p in path):
        self.bad(f"item {name!r}: a leaf's path is {_short(path)}, not a list of keys")
      where = f"item {name!r}, leaf {'/'.join(path)!r}"
      kind = rec.get("kind")
      if kind == "value":
        self.value(rec.get("value"), where)
        leaves.append(Value(tuple(path), rec["value"]))
        continue
      if kind not in ("jax", "numpy"):
        self.bad(f"{where}: kind {_short(kind)}")
      array = rec.get("name")
      if not self.local:
        if not isinstance(array, str) or not _ARRAY_NAME.match(array):
          self.bad(f"{where}: array name {_short(array)} is not a<N>")
        if array in names:
          self.bad(f"{where}: array name {array!r} is also that of leaf {names[array]!r}")
        names[array] = "/".join(path)
      leaves.append(self.array(rec, where, nproc, packed, slots))
    for owner in packed:
      at = 0
      taken = slots.get(owner, [])
      for lo, size, what in sorted(taken):
        if lo != at:
          self.bad(f"item {name!r}: packed array {what!r} is at byte {lo} of process {owner}'s"
                   f" buffer, where a save puts it at byte {at}")
        at = lo + -(-size // PACK_ALIGN) * PACK_ALIGN
      if at != packed[owner]:
        self.bad(f"item {name!r}: process {owner}'s packed buffer is {packed[owner]} bytes, its"
                 f" arrays fill {at}")
    structure = item.get("structure")
    self.structure(structure, leaves, f"item {name!r}")
    sizes = {int(k): v for k, v in packed.items()}
    pieces = {} if self.local else _pieces(self, name, item, packed)
    for i, r in enumerate(leaves):  # a packed array in a base's segment: that base's buffer
      if pieces and isinstance(r, Array) and r.is_packed and r.owners[0] in pieces:
        base = next(p[2] for p in pieces[r.owners[0]] if p[0] <= r.packed_offset < p[1])
        if base >= 0:
          leaves[i] = dataclasses.replace(r, owners=(r.owners[0] + (base + 1) * OWNER_STRIDE,))
          sizes[leaves[i].owners[0]] = sizes[r.owners[0]]
    return Item(structure, tuple(leaves), sizes, pieces)

  def value(self, value: Any, where: str) -> None:
    if not isinstance(value, dict):
      self.bad(f"{where}: value {_short(value)} is not a tagged value")
    t, v = value.get("t"), value.get("v")
    ok = {"bool": lambda: isinstance(v, bool),
          "int": lambda: isinstance(v, str) and _INT_TEXT.match(v),
          "float": lambda: isinstance(v, str) and _hex_float(v),
          "complex": lambda: (isinstance(v, list) and len(v) == 2
                              and all(isinstance(x, str) and _hex_float(x) for x in v)),
          "str": lambda: isinstance(v, str),
          "bytes": lambda: isinstance(v, str) and _b64(v) is not None,
          "np": lambda: self.np_value(value, where)}.get(t) if isinstance(t, str) else None
    if ok is None or not ok():
      self.bad(f"{where}: inline value {_short(value)} is of an unknown type, or malformed")

  def np_value(self, value: dict[str, Any], where: str) -> bool:
    dtype = self.dtype(value.get("dtype"), f"{where}: value dtype")
    raw = _b64(value.get("b64")) if isinstance(value.get("b64"), str) else None
    return raw is not None and len(raw) == dtype.itemsize

  def dtype(self, name: Any, what: str) -> np.dtype:
    if isinstance(name, str) and name in self._dtypes:
      return self._dtypes[name]
    try:
      dtype = _tree.dtype_from_name(name) if isinstance(name, str) else None
    except (TypeError, AttributeError, ValueError):
      dtype = None
    if dtype is None or not _tree.is_supported_dtype(dtype) or dtype.name != name:
      self.bad(f"{what} {_short(name)} is not a numeric dtype")
    self._dtypes[name] = dtype
    return dtype

  def array(self, rec: dict[str, Any], where: str, nproc: int, packed: dict[str, int],
            slots: dict[str, list[tuple[int, int, str]]]) -> Array:
    dtype = self.dtype(rec.get("dtype"), f"{where}: dtype")
    stored = rec.get("stored_dtype")
    if stored != _tsio.stored_dtype(dtype):
      self.bad(f"{where}: stored_dtype {_short(stored)} for dtype {dtype.name}, where a save"
               f" stores {_tsio.stored_dtype(dtype)}")
    shape = rec.get("shape")
    problem = _tree.shape_problem(shape, dtype.itemsize)
    if problem:
      self.bad(f"{where}: shape {_short(shape)}: {problem}")
    nbytes = math.prod(shape) * dtype.itemsize
    if rec.get("nbytes") != nbytes or isinstance(rec.get("nbytes"), bool):
      self.bad(f"{where}: nbytes {_short(rec.get('nbytes'))}, where shape {shape} of"
               f" {dtype.name} has {nbytes}")
    sharding = rec.get("sharding", {})
    if not isinstance(sharding, dict) or not isinstance(sharding.get("text", ""), str):
      self.bad(f"{where}: sharding {_short(sharding)} is not an object with a text")
    key_shape = self.key(rec, shape, dtype, where) if "key_impl" in rec else None
    common = dict(path=tuple(rec["path"]), kind=rec["kind"], shape=tuple(shape),
                  dtype=dtype.name, nbytes=nbytes, stored_dtype=stored,
                  name=rec.get("name", "") if self.local else rec["name"],
                  sharding=sharding.get("text", ""), key_impl=rec.get("key_impl"),
                  key_shape=key_shape)
    if self.local:
      return Array(**common, boxes=self.boxes(rec.get("boxes"), shape, where))
    owners = rec.get("owners")
    # In C (map, min, max): a manifest of 8,192 devices has millions of owners.
    if not isinstance(owners, list) or (owners and (
        not set(map(type, owners)) <= {int} or min(owners) < 0 or max(owners) >= nproc)):
      self.bad(f"{where}: owners {_short(owners)}, for {nproc} process(es)")
    if "packed_offset" in rec:
      if "chunk_hash" in rec or "chunk_base" in rec:
        self.bad(f"{where}: a packed array with per-chunk hashes or bases")
      lo = self.count(rec["packed_offset"], f"{where}: packed_offset")
      if len(owners) != 1 or str(owners[0]) not in packed or nbytes == 0:
        self.bad(f"{where}: a packed array of owners {owners}, and packed buffers of processes"
                 f" {sorted(packed)}")
      slots.setdefault(str(owners[0]), []).append((lo, nbytes, "/".join(rec["path"])))
      return Array(**common, owners=tuple(owners), packed_offset=lo)
    chunk = rec.get("chunk_shape")
    if not isinstance(chunk, list) or len(chunk) != len(shape):
      self.bad(f"{where}: chunk_shape {_short(chunk)} for shape {shape}")
    for c, s in zip(chunk, shape):
      self.count(c, f"{where}: a chunk dimension")
    if not owners:
      if nbytes:
        self.bad(f"{where}: {nbytes} bytes, and no owners")
      return Array(**common, chunk_shape=tuple(chunk))
    if any(c < 1 or c > max(s, 1) for c, s in zip(chunk, shape)):
      self.bad(f"{where}: chunk_shape {chunk} for shape {shape}")
    grid = math.prod(-(-s // c) for s, c in zip(shape, chunk))
    if len(owners) != grid:
      self.bad(f"{where}: {len(owners)} chunk owners for {grid} chunks")
    hashes, homes = rec.get("chunk_hash"), rec.get("chunk_base")  # differential saves
    if hashes is not None and (not isinstance(hashes, list) or len(hashes) != grid or not all(
        isinstance(h, str) and _HASH.match(h) for h in hashes)):
      self.bad(f"{where}: chunk_hash {_short(hashes)} for {grid} chunk(s)")
    if homes is not None and (not isinstance(homes, list) or len(homes) != grid or not all(
        type(b) is int and -1 <= b < self.nbases for b in homes)):
      self.bad(f"{where}: chunk_base {_short(homes)}: per chunk -1 or one of {self.nbases}")
    if homes is not None:  # each chunk's owner names the step that holds it
      owners = [o + (b + 1) * OWNER_STRIDE for o, b in zip(owners, homes)]
    return Array(**common, chunk_shape=tuple(chunk), owners=tuple(owners), chunk_hash=hashes and
                 tuple(hashes), chunk_base=homes and tuple(homes))

  def boxes(self, boxes: Any, shape: list[int], where: str) -> tuple[Held, ...]:
    if not isinstance(boxes, list):
      self.bad(f"{where}: boxes {_short(boxes)} is not a list")
    out = []
    for e in boxes:
      box = e.get("box") if isinstance(e, dict) else None
      if not isinstance(box, list) or len(box) != len(shape) or not all(
          isinstance(b, list) and len(b) == 2 and all(type(x) is int for x in b)
          and 0 <= b[0] <= b[1] <= s for b, s in zip(box, shape)):
        self.bad(f"{where}: box {_short(box)} of an array of shape {shape}")
      crcs, devices = e.get("crc32c"), e.get("devices", [])
      if not isinstance(crcs, list) or not all(type(c) is int for c in crcs) or not isinstance(
          devices, list) or not all(type(d) is int for d in devices):
        self.bad(f"{where}: box {box}: checksums {_short(crcs)}, devices {_short(devices)}")
      out.append(Held(tuple((lo, hi) for lo, hi in box), self.count(e.get("offset"), f"{where}:"
                      " a box's offset"), self.count(e.get("nbytes"), f"{where}: a box's nbytes"),
                      tuple(crcs), tuple(devices)))
    return tuple(out)

  def key(self, rec: dict[str, Any], shape: list[int], dtype: np.dtype,
          where: str) -> tuple[int, ...]:
    impl, key_shape = rec.get("key_impl"), rec.get("key_shape")
    data = _key_data(impl) if isinstance(impl, str) else None
    if data is None:
      self.bad(f"{where}: key_impl {_short(impl)} is not a PRNG implementation jax knows")
    if (not isinstance(key_shape, list) or list(shape) != list(key_shape) + list(data[0])
        or dtype != data[1]):
      self.bad(f"{where}: PRNG keys of shape {_short(key_shape)} ({impl}) are stored as"
               f" {data[1]}{list(data[0])} per key, not {dtype.name}{shape}")
    return tuple(key_shape)

  def structure(self, root: Any, leaves: list[Record], where: str) -> None:
    """The structure is a tree naming leaf ``i`` once, at ``leaves[i].path``."""
    seen = [False] * len(leaves)
    todo = [(root, ())]
    while todo:
      node, path = todo.pop()
      t = node.get("t") if isinstance(node, dict) else None
      if not isinstance(t, str) or t not in _NODES:
        self.bad(f"{where}: structure node {_short(node)} at {'/'.join(path)!r}")
      if t == "none":
        continue
      if t == "leaf":
        i = node.get("i")
        if (isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(leaves)
            or seen[i] or leaves[i].path != path):
          self.bad(f"{where}: the structure's leaf {_short(i)} at {'/'.join(path)!r} is not"
                   " one of its leaves, or not at that leaf's path")
        seen[i] = True
        continue
      children = node.get("c")
      if not isinstance(children, list):
        self.bad(f"{where}: structure node at {'/'.join(path)!r} has no list of children")
      if t in ("list", "tuple"):
        keys = [str(j) for j in range(len(children))]
      else:
        keys = node.get("k")
        int_keys = t == "dict" and node.get("int_keys") is True
        if (not isinstance(keys, list) or len(keys) != len(children)
            or not all(isinstance(k, str) if not int_keys else
                       isinstance(k, int) and not isinstance(k, bool) for k in keys)
            or len({str(k) for k in keys}) != len(keys)):
          self.bad(f"{where}: structure node at {'/'.join(path)!r} has keys {_short(keys)} for"
                   f" {len(children)} children")
        keys = [str(k) for k in keys]
        if t == "namedtuple" and not _namedtuple_ok(node.get("name"), keys):
          self.bad(f"{where}: namedtuple {_short(node.get('name'))} with fields {keys}")
      todo.extend((c, path + (k,)) for k, c in zip(keys, children))
    if not all(seen):
      self.bad(f"{where}: the structure omits leaf {seen.index(False)}")


def _differential(c: _Checker, s: Mapping[str, Any], gen: str) -> tuple[tuple[Base, ...], Any]:
  """A differential save's ``bases`` and ``stored_bytes`` (see differential.refs)."""
  out = []
  for k, b in enumerate(s.get("bases", [])):  # (a list: checked with the summary's fields)
    if (not isinstance(b, dict) or not isinstance(b.get("dir"), str)
        or not BASE_DIR.match(b["dir"]) or not isinstance(b.get("generation"), str)
        or not _GENERATION.match(b["generation"])):
      c.bad(f"bases[{k}] is {_short(b)}: a reference must name a sibling step directory (a"
               " plain name, inside the checkpoint's parent) and a generation of 16 hex digits")
    if b["generation"] == gen:
      c.bad(f"bases[{k}] names this checkpoint's own generation")
    out.append(Base(b["dir"], b["generation"]))
  stored = s.get("stored_bytes")
  if stored is not None and (not isinstance(stored, dict) or not all(
      type(stored.get(k)) is int and stored[k] >= 0 for k in ("own", "borrowed"))):
    c.bad(f"stored_bytes is {_short(stored)}, not {{'own': n, 'borrowed': m}}")
  c.nbases = len(out)
  return tuple(out), stored



def _pieces(c: _Checker, name: str, item: dict[str, Any], packed: dict[str, int]) -> dict[int, Any]:
  """A differential save's ``packed_pieces``: per process, segments tiling its buffer."""
  pieces = item.get("packed_pieces", {})
  if not isinstance(pieces, dict) or set(pieces) - set(packed):
    c.bad(f"item {name!r}: packed_pieces {_short(pieces)} for buffers {sorted(packed)}")
  out = {}
  for owner, ps in pieces.items():
    at = 0
    for p in ps if isinstance(ps, list) else [None]:
      if (not isinstance(p, list) or len(p) != 4 or not all(type(x) is int for x in p[:3])
          or p[0] != at or p[1] <= p[0] or not -1 <= p[2] < c.nbases
          or not isinstance(p[3], str) or not _HASH.match(p[3])):
        c.bad(f"item {name!r}: packed piece {_short(p)} of process {owner} (pieces tile the"
                 f" buffer from byte {at}; a base is -1 or one of {c.nbases})")
      at = p[1]
    if at != packed[owner]:
      c.bad(f"item {name!r}: packed pieces of process {owner} cover {at} of {packed[owner]} bytes")
    out[int(owner)] = tuple(tuple(p) for p in ps)
  return out


def _short(x: Any) -> str:
  text = repr(x)
  return text if len(text) <= 120 else text[:117] + "..."


def _hex_float(text: str) -> bool:
  try:
    float.fromhex(text)
  except (ValueError, OverflowError):
    return False
  return True


def _b64(text: str) -> bytes | None:
  try:
    return base64.b64decode(text, validate=True)
  except ValueError:  # binascii.Error
    return None


def _namedtuple_ok(name: Any, fields: list[str]) -> bool:
  return all(isinstance(n, str) and n.isidentifier() and not keyword.iskeyword(n)
             for n in [name, *fields]) and not any(f.startswith("_") for f in fields)


@functools.lru_cache(maxsize=16)
def _key_data(impl: str) -> tuple[tuple[int, ...], np.dtype] | None:
  """The shape and dtype of one key's data for a PRNG implementation jax knows, else None."""
  try:
    data = jax.random.key_data(jax.random.key(0, impl=impl))
  except (ValueError, TypeError, KeyError):
    return None
  return tuple(data.shape), np.dtype(data.dtype)

