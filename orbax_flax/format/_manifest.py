"""The checkpoint manifest: its records, the file that commits a save, and its one decoder.

``<checkpoint>/_CHECKPOINT`` holds everything needed to read the checkpoint
without touching array data: items, their tree structure, and per array the
key path, shape, dtype, chunk grid, which process's database holds each chunk,
and a description of the sharding it was saved with. Inline values (scalars,
strings) live here too. This module reads top to bottom in three parts:

1. **Records**: the typed view a reader uses. An item is an :class:`Item` (its
   tree structure, its leaves, its packed buffers), a leaf a :class:`Value`
   (inline) or an :class:`Array`, whose bytes are in one of:

   * our chunked arrays: chunk ``c`` in the database of process ``owners[c]``;
   * our packed arrays: ``[packed_offset, packed_offset + nbytes)`` of process
     ``owners[0]``'s packed buffer;
   * the local tier's blob: ``boxes`` (the shards this process holds);
   * a foreign format's file: ``source`` reads a box into a buffer;
   * a transform of other records: ``derived`` expands a box into reads of them.

   A :class:`Summary` is the manifest's first line (time, processes, custom
   metadata); a :class:`Manifest` is a summary with its items. Foreign formats
   (:mod:`orbax_flax.formats`) and transforms build records directly.
2. **The file** (:func:`encode`, :func:`decode`, :func:`decode_summary`): a
   header line with SHA-256s, a one-line JSON *summary* (the time the save was planned, process
   and device count, custom metadata, bytes per item), then the JSON *body*
   (items). The summary's own hash lets a manager list thousands of steps by
   reading a few KB of each manifest; a flipped byte anywhere is detected, not
   parsed. An array of many chunks (thousands of hosts) stores its chunk owners
   compactly (``owners_z``: zlib-compressed little-endian uint32, base64), which
   makes the manifest format version 2; :func:`decode` turns them back into the
   ``owners`` list. A differential save's manifest (it borrows from other steps:
   ``bases``) is version 3. Any other manifest is written as version 1, readable
   by every orbax_flax.
3. **Checking**: a manifest's hashes only say it is intact, not that it was
   written by this library: names become paths, offsets select bytes and dtypes
   become buffers. Every field a reader will use is checked in the pass that
   builds its record, for the commit manifest and the local tier's blob index
   (:func:`decode_local_items`); a reader never sees unchecked JSON.

Example:
  >>> a = Array(path=("w",), kind="numpy", shape=(2, 3), dtype="float32", nbytes=24,
  ...           chunk_shape=(2, 3), owners=(0,))
  >>> a.path_text, a.user_shape, a.np_dtype.itemsize, a.is_packed
  ('w', (2, 3), 4, False)
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import hashlib
import json
import keyword
import math
import re
import zlib
from collections.abc import Mapping
from typing import Any, ClassVar, NoReturn, Union

import jax
import numpy as np

from orbax_flax.core import _tree
from orbax_flax.format import _tsio
from orbax_flax import errors

MANIFEST_KEY = "_CHECKPOINT"
FORMAT = "orbax_flax"
VERSION = 3                 # the newest format version, written only when needed (see encode)
READS = (1, 2, 3)           # the format versions this library reads
COMPACT_OWNERS = 1024       # an array of this many chunks or more stores its owners compactly
_MAX_OWNERS = 1 << 24       # chunks of one array a reader accepts (512 TB at 32 MiB a chunk)
_MAGIC = b"orbax_flax checkpoint v1 "
# The largest manifest read or written. A manifest holds a few hundred bytes a leaf (owners of
# many chunks compacted, ~40 bytes a chunk of a differential save's hashes): 20,000 leaves are
# ~6 MB; a crafted one must not make a reader load gigabytes of JSON.
MAX_MANIFEST_BYTES = 256 << 20
SUMMARY_READ_BYTES = 4 << 10  # enough for the header and a typical summary (else see summary_extent)
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


# ---------------------------------------------------------------------------- records


# 9000-01-01 (UTC) in seconds: a time whose local date, anywhere, datetime holds (``show``
# prints it); a later one (or inf, NaN) is damage, in our manifests and in other formats'.
LAST_TIME = 221845392000


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

  np_dtype: np.dtype | None = dataclasses.field(default=None, repr=False, compare=False)
  """``dtype`` as a numpy dtype: given by the decoder, which has it, else worked out."""
  # Facts read for every leaf of every restore, set once when the record is built:
  user_shape: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
  """The shape a user sees: the key shape for PRNG keys."""
  is_packed: bool = dataclasses.field(init=False, repr=False, compare=False)
  """True if the array's bytes are in its process's packed buffer."""
  reads_itself: bool = dataclasses.field(init=False, repr=False, compare=False)
  """True for a foreign format's or a transform's array (not read by the engine)."""

  def __post_init__(self):
    set_ = object.__setattr__  # (frozen)
    if self.np_dtype is None or self.np_dtype.name != self.dtype:  # (replace(r, dtype=...))
      set_(self, "np_dtype", _tree.dtype_from_name(self.dtype))
    set_(self, "user_shape", self.key_shape if self.key_shape is not None else self.shape)
    set_(self, "is_packed", self.packed_offset is not None)
    set_(self, "reads_itself", self.source is not None or self.derived is not None)

  @functools.cached_property
  def path_text(self) -> str:
    return _tree.path_str(self.path)

  @functools.cached_property
  def np_stored_dtype(self) -> np.dtype:
    return _tree.dtype_from_name(self.stored_dtype)

  @functools.cached_property
  def chunk_nbytes(self) -> int:
    """The bytes of one stored chunk (before tensorstore's codecs)."""
    return math.prod(self.chunk_shape) * self.np_stored_dtype.itemsize


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


# ---------------------------------------------------------------------------- the file


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _dumps(obj: Any) -> bytes:
  return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def encode(manifest: dict[str, Any], compact_owners: int = COMPACT_OWNERS) -> bytes:
  """Serialises a manifest: header, summary line, body.

  Owner lists of ``compact_owners`` chunks or more are stored as ``owners_z``
  (format version 2); a differential save's manifest (``bases``) is version 3, so that a
  reader from before differential saves, which would read fill values where the step
  borrows, refuses it; any other manifest is version 1. The records of ``manifest`` are
  not changed.
  """
  items, compacted = {}, False
  for name, item in manifest["items"].items():
    leaves = []
    for rec in item["leaves"]:
      owners = rec.get("owners") if isinstance(rec, dict) else None
      if owners is not None and len(owners) >= compact_owners:
        rec = {k: v for k, v in rec.items() if k != "owners"}
        rec["owners_z"] = _pack_owners(owners)
        compacted = True
      leaves.append(rec)
    items[name] = dict(item, leaves=leaves)
  version = 3 if manifest.get("bases") else 2 if compacted else 1
  summary = {k: v for k, v in manifest.items() if k != "items"}
  summary["version"] = version
  summary["item_bytes"] = {name: sum(r.get("nbytes", 0) for r in item["leaves"])
                           for name, item in manifest["items"].items()}
  summary_line = _dumps(summary)
  body = _dumps({"format": FORMAT, "version": version, "items": items})
  header = _MAGIC + (f"summary_sha256={_sha(summary_line)} sha256={_sha(body)}"
                     f" summary_bytes={len(summary_line)}").encode()
  data = header + b"\n" + summary_line + b"\n" + body
  if len(data) > MAX_MANIFEST_BYTES:
    leaves = sum(len(i["leaves"]) for i in manifest["items"].values())
    raise ValueError(
        f"the checkpoint's manifest would be {len(data) >> 20} MiB, more than the"
        f" {MAX_MANIFEST_BYTES >> 20} MiB a reader accepts ({leaves} leaves): save fewer,"
        " larger arrays (e.g. stack per-layer weights), or less custom metadata.")
  return data


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


def decode_summary(data: bytes, where: str) -> Summary | None:
  """The verified summary from the first bytes of a manifest; None if cut short."""
  fields, rest = _split_header(data, where)
  line, newline, _ = rest.partition(b"\n")
  if not newline:
    return None
  _verify(line, fields.get("summary_sha256"), where)
  summary = _json(line, where, "summary")
  _check_version(summary, where)
  return _summary_record(summary, where)


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
  many bytes instead of the whole manifest. None when the header has no
  ``summary_bytes`` (or is not ours: decoding tells why).
  """
  header, newline, _ = data.partition(b"\n")
  if not newline or not header.startswith(_MAGIC):
    return None
  for field in header[len(_MAGIC):].split():
    name, _, value = field.partition(b"=")
    if name == b"summary_bytes" and value.isdigit():
      return len(header) + 1 + int(value) + 1
  return None


def decode(data: bytes, where: str) -> Manifest:
  """Parses, verifies and checks a whole manifest into records (see :func:`_manifest_record`).

  Raises:
    CheckpointCorruptedError: a damaged manifest (CheckpointFormatError: one
      not written by orbax_flax, naming the field and the value).
  """
  fields, rest = _split_header(data, where)
  line, _, body = rest.partition(b"\n")
  _verify(line, fields.get("summary_sha256"), where)
  _verify(body, fields.get("sha256"), where)
  parsed = _json(body, where, "body")
  summary = _json(line, where, "summary")
  version = _check_version(parsed, where)
  _check_version(summary, where)
  items = parsed.get("items")
  if version >= 2:
    _expand_owners(items, where)
  return _manifest_record(summary, items, version, where)


def _pack_owners(owners: list[int]) -> str:
  return base64.b64encode(zlib.compress(np.asarray(owners, "<u4").tobytes(), 1)).decode()


def _expand_owners(items: Any, where: str) -> None:
  """Replaces every ``owners_z`` by the ``owners`` list it encodes (checked when decoded next)."""
  def bad(problem: str):
    raise errors.CheckpointCorruptedError(
        f"{where}: {problem}; this manifest was not written by orbax_flax (damaged or crafted).")

  if not isinstance(items, dict):
    return  # the decoder says what is wrong
  for name, item in items.items():
    leaves = item.get("leaves") if isinstance(item, dict) else None
    for rec in leaves if isinstance(leaves, list) else []:  # (else: the decoder says)
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


# ---------------------------------------------------------------------------- checking


# The most bytes an array's dimensions may span (zero dimensions counted as one):
# numpy and jax index with signed 64-bit sizes.
MAX_ARRAY_BYTES = 1 << 62


def shape_problem(shape: Any, itemsize: int) -> str | None:
  """What is wrong with a shape read from a file, or None: a list of ints >= 0 whose
  extent (zero dimensions counted as one) times ``itemsize`` fits in ``MAX_ARRAY_BYTES``.

  Example:
    >>> shape_problem([2, 3], 4) is None, shape_problem([-1], 4), shape_problem([0, 2**61], 4)
    (True, 'dimension -1 is negative', 'spans more than 2**62 bytes')
  """
  if not isinstance(shape, (list, tuple)):
    return f"{shape!r} is not a list of dimensions"
  extent = itemsize
  for d in shape:
    if isinstance(d, bool) or not isinstance(d, int):
      return f"dimension {d!r} is not an integer"
    if d < 0:
      return f"dimension {d} is negative"
    extent *= max(d, 1)
    if extent > MAX_ARRAY_BYTES:
      return "spans more than 2**62 bytes"
  return None


def _summary_record(summary: Mapping[str, Any], where: str) -> Summary:
  """The checked :class:`Summary` of a summary line's JSON (its format and version checked).

  Raises:
    CheckpointFormatError: naming the manifest, the field and the value.
  """
  return Summary(**_Checker(where).summary(summary))


def _manifest_record(summary: Mapping[str, Any], items: Any, version: int, where: str) -> Manifest:
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

  The same checks as :func:`_manifest_record` for paths, values, dtypes, shapes, keys and
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
    if (isinstance(created, bool) or not isinstance(created, (int, float))
        or not 0 <= created <= LAST_TIME):
      self.bad(f"created is {_short(created)}, not a time since 1970 before the year 9000")
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
    problem = shape_problem(shape, dtype.itemsize)
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
                  dtype=dtype.name, np_dtype=dtype, nbytes=nbytes, stored_dtype=stored,
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
    _tree.float_from_text(text)
  except (ValueError, OverflowError):
    return False
  return True


def _b64(text: str) -> bytes | None:
  try:
    return base64.b64decode(text, validate=True)
  except ValueError:  # binascii.Error
    return None


def _namedtuple_ok(name: Any, fields: list[str]) -> bool:
  """Names a namedtuple may have: identifiers, no keywords, no field starting with "_" but
  "_<its index>" (what ``namedtuple(..., rename=True)`` names a field it could not take)."""
  return all(isinstance(n, str) and n.isidentifier() and not keyword.iskeyword(n)
             for n in [name, *fields]) and not any(
                 f.startswith("_") and f != f"_{i}" for i, f in enumerate(fields))


@functools.lru_cache(maxsize=16)
def _key_data(impl: str) -> tuple[tuple[int, ...], np.dtype] | None:
  """The shape and dtype of one key's data for a PRNG implementation jax knows, else None."""
  try:
    data = jax.random.key_data(jax.random.key(0, impl=impl))
  except (ValueError, TypeError, KeyError):
    return None
  return tuple(data.shape), np.dtype(data.dtype)
