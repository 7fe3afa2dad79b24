"""The checkpoint manifest: one JSON file, written last, that commits a save.

``<checkpoint>/_CHECKPOINT`` holds everything needed to read the checkpoint
without touching array data: items, their tree structure, and per array the
key path, shape, dtype, chunk grid, which process's database holds each chunk,
and a description of the sharding it was saved with. Inline values (scalars,
strings) live here too.

Layout: a header line with SHA-256s, a one-line JSON *summary* (commit time,
process and device count, custom metadata, bytes per item), then the JSON
*body* (items). The summary's own hash lets a manager list thousands of steps
by reading a few KB of each manifest; a flipped byte anywhere is detected, not
parsed.

An array of many chunks (thousands of hosts) stores its chunk owners compactly
(``owners_z``: zlib-compressed little-endian uint32, base64), which makes the
manifest format version 2; :func:`decode` turns them back into the ``owners``
list, so readers see the same manifest either way. A manifest without such an
array is written as version 1, readable by every orbax_flax.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import keyword
import math
import re
import zlib
from typing import Any, NoReturn

import jax
import numpy as np

from orbax_flax import _tree
from orbax_flax import _tsio
from orbax_flax import errors
from orbax_flax.differential import refs  # references to other steps' bytes

MANIFEST_KEY = "_CHECKPOINT"
PACK_ALIGN = 16  # packed arrays start at multiples of this (orbax_flax._planning lays them out)
FORMAT = "orbax_flax"
VERSION = 2                 # the newest format version, written only when needed (see encode)
READS = (1, 2)              # the format versions this library reads
COMPACT_OWNERS = 1024       # an array of this many chunks or more stores its owners compactly
_MAX_OWNERS = 1 << 24       # chunks of one array a reader accepts (512 TB at 32 MiB a chunk)
_MAGIC = b"orbax_flax checkpoint v1 "
SUMMARY_READ_BYTES = 4 << 10  # enough for the header and a typical summary (else see summary_extent)


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _dumps(obj: Any) -> bytes:
  return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def encode(manifest: dict[str, Any], compact_owners: int = COMPACT_OWNERS) -> bytes:
  """Serialises a manifest: header, summary line, body.

  Owner lists of ``compact_owners`` chunks or more are stored as ``owners_z``
  (format version 2); a manifest without any is version 1. The records of
  ``manifest`` are not changed.
  """
  items, compacted = {}, False
  for name, item in manifest["items"].items():
    leaves = []
    for rec in item["leaves"]:
      owners = rec.get("owners") if isinstance(rec, dict) else None
      if owners is not None and len(owners) >= compact_owners:
        rec = {k: v for k, v in rec.items() if k != "owners"}
        rec["owners_z"] = base64.b64encode(
            zlib.compress(np.asarray(owners, "<u4").tobytes(), 1)).decode()
        compacted = True
      leaves.append(rec)
    items[name] = dict(item, leaves=leaves)
  version = 2 if compacted else 1
  summary = {k: v for k, v in manifest.items() if k != "items"}
  summary["version"] = version
  summary["item_bytes"] = {name: sum(r.get("nbytes", 0) for r in item["leaves"])
                           for name, item in manifest["items"].items()}
  summary_line = _dumps(summary)
  body = _dumps({"format": FORMAT, "version": version, "items": items})
  header = _MAGIC + (f"summary_sha256={_sha(summary_line)} sha256={_sha(body)}"
                     f" summary_bytes={len(summary_line)}").encode()
  return header + b"\n" + summary_line + b"\n" + body


def _split_header(data: bytes, where: str) -> tuple[dict[str, str], bytes]:
  header, _, rest = data.partition(b"\n")
  if not header.startswith(_MAGIC):
    raise errors.CheckpointCorruptedError(
        f"{where} is not an orbax_flax manifest (bad header {header[:40]!r}); the file"
        " is damaged or was not written by this version of orbax_flax.")
  fields = dict(f.split("=", 1) for f in header[len(_MAGIC):].decode(errors="replace").split()
                if "=" in f)
  return fields, rest


def _verify(what: bytes, digest: str | None, where: str) -> None:
  actual = _sha(what)
  if digest != actual:
    raise errors.CheckpointCorruptedError(
        f"checksum mismatch in {where}: recorded sha256 {str(digest)[:16]}..., content"
        f" hashes to {actual[:16]}...; the manifest is corrupted. Restore from another"
        " checkpoint.")


def _json(data: bytes, where: str, what: str) -> dict[str, Any]:
  try:
    value = json.loads(data)
  except (ValueError, RecursionError) as e:
    raise errors.CheckpointCorruptedError(f"{where}: the {what} is not valid JSON ({e})") from None
  if not isinstance(value, dict):
    raise errors.CheckpointFormatError(f"{where}: the {what} is a {type(value).__name__}, not a"
                                       " JSON object; not an orbax_flax manifest")
  return value


def seal(magic: bytes, body: bytes) -> bytes:
  """``body`` behind a header line that names it (``magic``) and holds its SHA-256.

  The digest the manifest uses, for the other small files that must never be
  read damaged (the local tier's index and commit record): see :func:`unseal`.

  Example:
    >>> data = seal(b"example v1", b'{"a": 1}')
    >>> unseal(b"example v1", data, "example")
    b'{"a": 1}'
  """
  return magic + b" sha256=" + _sha(body).encode() + b"\n" + body


def unseal(magic: bytes, data: bytes, where: str) -> bytes:
  """The body of a :func:`seal`-ed file; CheckpointCorruptedError if any byte is damaged."""
  header, newline, body = data.partition(b"\n")
  prefix = magic + b" sha256="
  if not newline or not header.startswith(prefix):
    raise errors.CheckpointCorruptedError(
        f"{where}: damaged or foreign file (its header is {header[:48]!r}, not {magic!r})")
  digest = header[len(prefix):].decode(errors="replace")
  actual = _sha(body)
  if digest != actual:
    raise errors.CheckpointCorruptedError(
        f"checksum mismatch in {where}: recorded sha256 {digest[:16]}..., content hashes to"
        f" {actual[:16]}...; the file is damaged")
  return body


def decode_summary(data: bytes, where: str) -> dict[str, Any] | None:
  """The verified summary from the first bytes of a manifest; None if cut short."""
  fields, rest = _split_header(data, where)
  line, newline, _ = rest.partition(b"\n")
  if not newline:
    return None
  _verify(line, fields.get("summary_sha256"), where)
  summary = _json(line, where, "summary")
  _check_version(summary, where)
  _Checker(where).summary(summary)
  return summary


def _check_version(parsed: dict[str, Any], where: str) -> int:
  if parsed.get("format") != FORMAT:
    raise errors.CheckpointFormatError(
        f"{where}: format {parsed.get('format')!r}, not {FORMAT!r}; this is not an orbax_flax"
        " checkpoint.")
  version = parsed.get("version")
  if type(version) is not int or version not in READS:
    newer = type(version) is int and version > VERSION
    raise errors.CheckpointFormatError(
        f"{where}: written in orbax_flax checkpoint format version {version!r}"
        f"{' (by a newer orbax_flax)' if newer else ''}; this orbax_flax reads format versions"
        f" {', '.join(map(str, READS))}." + (" Upgrade orbax_flax to read it." if newer else ""))
  return version


def summary_extent(data: bytes) -> int | None:
  """How many leading bytes of a manifest hold its header and summary, if its header says so.

  For a summary longer than :data:`SUMMARY_READ_BYTES`: the reader reads that
  many bytes instead of the whole manifest. None for manifests written before
  the header recorded it (or a header that is not ours: decoding tells why).
  """
  header, newline, _ = data.partition(b"\n")
  if not newline or not header.startswith(_MAGIC):
    return None
  for field in header[len(_MAGIC):].split():
    name, _, value = field.partition(b"=")
    if name == b"summary_bytes" and value.isdigit():
      return len(header) + 1 + int(value) + 1
  return None


def decode(data: bytes, where: str) -> dict[str, Any]:
  """Parses, verifies and validates a whole manifest; raises CheckpointCorruptedError."""
  fields, rest = _split_header(data, where)
  line, _, body = rest.partition(b"\n")
  _verify(line, fields.get("summary_sha256"), where)
  _verify(body, fields.get("sha256"), where)
  parsed = _json(body, where, "body")
  manifest = _json(line, where, "summary")
  version = _check_version(parsed, where)
  _check_version(manifest, where)
  manifest["items"] = parsed.get("items")
  if version >= 2:
    _expand_owners(manifest["items"], where)
  validate(manifest, where)
  refs.expand(manifest)  # a differential save's references, folded into the owners
  manifest["version"] = version
  return manifest


def _expand_owners(items: Any, where: str) -> None:
  """Replaces every ``owners_z`` by the ``owners`` list it encodes (checked by validate next)."""
  def bad(problem: str):
    raise errors.CheckpointCorruptedError(
        f"{where}: {problem}; this manifest was not written by orbax_flax (damaged or crafted).")

  if not isinstance(items, dict):
    return  # validate says what is wrong
  for name, item in items.items():
    for rec in item.get("leaves", []) if isinstance(item, dict) else []:
      if not isinstance(rec, dict) or "owners_z" not in rec:
        continue
      shape, chunk, text = rec.get("shape"), rec.get("chunk_shape"), rec.pop("owners_z")
      if (not isinstance(shape, list) or not isinstance(chunk, list) or len(shape) != len(chunk)
          or not all(type(d) is int and d >= 0 for d in shape)
          or not all(type(c) is int and c >= 1 for c in chunk) or "owners" in rec):
        bad(f"item {name!r}: compact owners for shape {shape!r}, chunk shape {chunk!r}")
      count = math.prod(-(-s // c) for s, c in zip(shape, chunk))
      if count > _MAX_OWNERS or not isinstance(text, str):
        bad(f"item {name!r}: {count} chunk owners (at most {_MAX_OWNERS} read)")
      try:
        inflate = zlib.decompressobj()
        raw = inflate.decompress(base64.b64decode(text, validate=True), count * 4 + 1)
        complete = inflate.eof and not inflate.unconsumed_tail
      except (binascii.Error, zlib.error, ValueError) as e:
        bad(f"item {name!r}: compact owners do not decode ({e})")
      if not complete or len(raw) != count * 4:
        bad(f"item {name!r}: compact owners hold {len(raw) // 4} entries for {count} chunks")
      rec["owners"] = np.frombuffer(raw, "<u4").tolist()


ITEM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_GENERATION = re.compile(r"^[0-9a-f]{16}$")
_ARRAY_NAME = re.compile(r"^a[0-9]+$")
_OWNER = re.compile(r"^(0|[1-9][0-9]*)$")
_INT_TEXT = re.compile(r"^-?[0-9]{1,4000}$")
_NODES = frozenset({"dict", "list", "tuple", "namedtuple", "node", "none", "leaf"})


def validate(manifest: dict[str, Any], where: str) -> None:
  """Checks every name, number, dtype and path a reader will use, in one pass.

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

  Raises:
    CheckpointFormatError: naming the manifest, the field and the value.
  """
  _Checker(where).manifest(manifest)


class _Checker:
  """One pass over a decoded manifest (see :func:`validate`)."""

  def __init__(self, where: str):
    self.where = where

  def bad(self, problem: str) -> NoReturn:
    raise errors.CheckpointFormatError(
        f"{self.where}: {problem}; this manifest was not written by orbax_flax (damaged or"
        " crafted).")

  def count(self, x: Any, what: str, lo: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < lo:
      self.bad(f"{what} is {_short(x)}, not an integer >= {lo}")
    return x

  def summary(self, s: dict[str, Any]) -> None:
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
                        ("all_chunks_stored", bool), (refs.BASES, list), (refs.STORED_BYTES, dict)):
      if field in s and not isinstance(s[field], kind):
        self.bad(f"{field} is {_short(s[field])}, not a {kind.__name__}")
    for leaf, dtype in s.get("casts", {}).items():
      if not isinstance(dtype, str):
        self.bad(f"casts[{leaf!r}] is {_short(dtype)}, not a dtype name")

  def manifest(self, manifest: dict[str, Any]) -> None:
    self.summary(manifest)
    nproc = manifest["process_count"]
    items = manifest.get("items")
    if not isinstance(items, dict):
      self.bad(f"items is {_short(items)}, not an object")
    for name, item in items.items():
      if not ITEM_NAME.match(name) or name == MANIFEST_KEY:
        self.bad(f"item name {name!r} is not a plain name")
      if not isinstance(item, dict) or not isinstance(item.get("leaves"), list):
        self.bad(f"item {name!r} has no list of leaves")
      self.item(name, item, nproc)
    refs.check_items(manifest, self.bad)  # differential saves

  def item(self, name: str, item: dict[str, Any], nproc: int) -> None:
    packed = item.get("packed", {})
    if not isinstance(packed, dict):
      self.bad(f"item {name!r}: packed is {_short(packed)}, not an object")
    for owner, size in packed.items():
      if not _OWNER.match(owner) or int(owner) >= nproc:
        self.bad(f"item {name!r}: packed buffer of process {owner!r}, of {nproc} process(es)")
      self.count(size, f"item {name!r}: packed[{owner!r}]")
    leaves = item["leaves"]
    slots: dict[str, list[tuple[int, int, str]]] = {}
    names: dict[str, str] = {}
    for rec in leaves:
      if not isinstance(rec, dict):
        self.bad(f"item {name!r}: a leaf is {_short(rec)}, not an object")
      path = rec.get("path")
      if not isinstance(path, list) or not all(isinstance(p, str) for p in path):
        self.bad(f"item {name!r}: a leaf's path is {_short(path)}, not a list of keys")
      where = f"item {name!r}, leaf {'/'.join(path)!r}"
      kind = rec.get("kind")
      if kind == "value":
        self.value(rec.get("value"), where)
        continue
      if kind not in ("jax", "numpy"):
        self.bad(f"{where}: kind {_short(kind)}")
      array = rec.get("name")
      if not isinstance(array, str) or not _ARRAY_NAME.match(array):
        self.bad(f"{where}: array name {_short(array)} is not a<N>")
      if array in names:
        self.bad(f"{where}: array name {array!r} is also that of leaf {names[array]!r}")
      names[array] = "/".join(path)
      self.array(rec, where, nproc, packed, slots)
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
    self.structure(item.get("structure"), leaves, f"item {name!r}")

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
    try:
      dtype = _tree.dtype_from_name(name) if isinstance(name, str) else None
    except (TypeError, AttributeError, ValueError):
      dtype = None
    if dtype is None or not _tree.is_supported_dtype(dtype) or dtype.name != name:
      self.bad(f"{what} {_short(name)} is not a numeric dtype")
    return dtype

  def array(self, rec: dict[str, Any], where: str, nproc: int, packed: dict[str, int],
            slots: dict[str, list[tuple[int, int, str]]]) -> None:
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
    if "key_impl" in rec:
      self.key(rec, shape, dtype, where)
    owners = rec.get("owners")
    # In C (map, min, max): a manifest of 8,192 devices has millions of owners.
    if not isinstance(owners, list) or (owners and (
        not set(map(type, owners)) <= {int} or min(owners) < 0 or max(owners) >= nproc)):
      self.bad(f"{where}: owners {_short(owners)}, for {nproc} process(es)")
    if "packed_offset" in rec:
      lo = self.count(rec["packed_offset"], f"{where}: packed_offset")
      if len(owners) != 1 or str(owners[0]) not in packed or nbytes == 0:
        self.bad(f"{where}: a packed array of owners {owners}, and packed buffers of processes"
                 f" {sorted(packed)}")
      slots.setdefault(str(owners[0]), []).append((lo, nbytes, "/".join(rec["path"])))
      return
    chunk = rec.get("chunk_shape")
    if not isinstance(chunk, list) or len(chunk) != len(shape):
      self.bad(f"{where}: chunk_shape {_short(chunk)} for shape {shape}")
    for c, s in zip(chunk, shape):
      self.count(c, f"{where}: a chunk dimension")
    if not owners:
      if nbytes:
        self.bad(f"{where}: {nbytes} bytes, and no owners")
      return
    if any(c < 1 or c > max(s, 1) for c, s in zip(chunk, shape)):
      self.bad(f"{where}: chunk_shape {chunk} for shape {shape}")
    grid = math.prod(-(-s // c) for s, c in zip(shape, chunk))
    if len(owners) != grid:
      self.bad(f"{where}: {len(owners)} chunk owners for {grid} chunks")

  def key(self, rec: dict[str, Any], shape: list[int], dtype: np.dtype, where: str) -> None:
    impl, key_shape = rec.get("key_impl"), rec.get("key_shape")
    data = _key_data(impl) if isinstance(impl, str) else None
    if data is None:
      self.bad(f"{where}: key_impl {_short(impl)} is not a PRNG implementation jax knows")
    if (not isinstance(key_shape, list) or list(shape) != list(key_shape) + list(data[0])
        or dtype != data[1]):
      self.bad(f"{where}: PRNG keys of shape {_short(key_shape)} ({impl}) are stored as"
               f" {data[1]}{list(data[0])} per key, not {dtype.name}{shape}")

  def structure(self, root: Any, leaves: list[dict[str, Any]], where: str) -> None:
    """The structure is a tree naming leaf ``i`` once, at ``leaves[i]['path']``."""
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
            or seen[i] or tuple(leaves[i]["path"]) != path):
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


@functools.lru_cache(maxsize=1024)
def describe_sharding(sharding: Any) -> dict[str, Any]:
  """A JSON description of a sharding, for humans and for metadata() (shared: do not modify)."""
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
