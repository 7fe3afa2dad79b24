"""Reading checkpoints written by orbax-checkpoint (0.12.x), without importing it.

What orbax-checkpoint writes, and what this module reads:

* **A pytree item** (``StandardCheckpointer``, ``PyTreeCheckpointer``, one item
  of a ``CheckpointManager`` step): a directory with ``_METADATA`` (JSON:
  ``tree_metadata`` maps each leaf's key path to its keys and
  ``value_type``, plus ``use_ocdbt`` and ``use_zarr3``), the arrays, and
  ``_strings.json`` for string leaves. Each array is a zarr (v2) or zarr3 array
  named by its keys joined with ``.`` (``params.Dense_0.kernel``): inside the
  item's OCDBT database (``manifest.ocdbt``, the default) or in a directory of
  its own. Compression (zstd by default) is whatever the array's metadata
  says; tensorstore decodes it. Scalars are 0-d arrays. A typed PRNG key array
  (``jax.random.key``) is stored as its key data (``uint32``, trailing
  dimensions per key) and named a key in ``array_metadatas/process_0`` (JSON:
  per ``jax.Array`` its ``param_name`` and ``ext_metadata.random_key_impl``); it
  is read as keys of that implementation, as orbax-checkpoint restores it.
* **A step of a ``CheckpointManager``**: ``_CHECKPOINT_METADATA`` names the
  items (``ocp.args.Composite``) and their handlers; pytree items are read as
  above, JSON items (``JsonSave``) as values.
* **A run directory**: numbered step directories (on an object store, key
  prefixes); :func:`steps` lists the committed ones (``commit_success.txt``, which
  orbax writes last where it cannot rename, or ``_CHECKPOINT_METADATA``).
* **flax's legacy checkpoints** (``flax.training.checkpoints``): a directory
  of ``checkpoint_<N>`` entries, each an orbax pytree item (or, before orbax, a
  msgpack file this module does not read); :func:`legacy_steps` lists them.

Arrays are read through tensorstore, box by box, so each process reads only the
chunks its devices need. Scalars and strings are read when the checkpoint is
opened (they are small and a target may want them as values).
"""

from __future__ import annotations

import ast
import math
import os
import re
from typing import Any, NamedTuple

import jax
import numpy as np
import tensorstore as ts

from orbax_flax.core import _location
from orbax_flax.core import _tree
from orbax_flax import errors
from orbax_flax.core._location import Location
from orbax_flax.format import _manifest
from orbax_flax.format._manifest import Array, Item, Manifest, Record, Value
from orbax_flax.formats import _checks

FORMAT = "orbax-checkpoint"
DEFAULT_ITEM = "default"
_PYTREE_METADATA = "_METADATA"
_STEP_METADATA = "_CHECKPOINT_METADATA"
_COMMIT = "commit_success.txt"  # a committed step (where orbax cannot rename: object stores)
_STRINGS = "_strings.json"
# Written by every process, each listing every jax.Array; orbax reads the first it finds.
_ARRAY_METADATAS = "array_metadatas/process_0"
_MAX_ARRAY_METADATAS_BYTES = 64 << 20  # orbax writes ~200 B an array: 300,000 arrays
_ARRAY_TYPES = ("jax.Array", "np.ndarray")
# value_type -> the empty node orbax 0.12 records and reads back (a namedtuple's "NamedTuple",
# written with its experimental rich types, reads as None without them, as orbax reads it)
_EMPTY_TYPES = {"None": None, "Dict": {}, "List": [], "Tuple": (), "NamedTuple": None}
_SEQUENCE, _DICT = 1, 2  # orbax's KeyType
_SLAB_BYTES = 16 << 20


def _read_json(loc: Location, key: str) -> Any | None:
  data = _location.read_key(loc, key)
  if data is None:
    return None
  return _checks.load_json(data, f"{loc}/{key}")


class _Leaf(NamedTuple):
  keys: tuple[tuple[str, int], ...]  # (key, orbax key type) from the root
  value_type: str
  skip_deserialize: bool

  @property
  def path(self) -> list[str]:
    return [k for k, _ in self.keys]


def read_tree_metadata(loc: Location) -> tuple[list[_Leaf], bool, bool] | None:
  """A pytree item's ``_METADATA``, checked in one pass; None if there is none.

  Checked: the file is a JSON object whose ``tree_metadata`` is an object of
  leaves; each leaf's keys (``key_metadata``: objects of a string or integer
  ``key`` and a ``key_type`` of 1 or 2, or else the entry's own name, a Python
  tuple literal) and its ``value_metadata`` (an object with a string
  ``value_type``); ``use_ocdbt``/``use_zarr3`` are booleans; and the name an
  array is stored under (its keys joined by ``.``) names an entry inside the
  item (no ``/``, ``..``), so a crafted file cannot open another directory's
  arrays. Anything else raises CheckpointFormatError naming the file, the leaf,
  the field and the value.

  Returns:
    ``(leaves without the empty nodes, use_ocdbt, use_zarr3)``.
  """
  where = f"{loc}/{_PYTREE_METADATA}"
  meta = _read_json(loc, _PYTREE_METADATA)
  if meta is None:
    return None
  meta = _checks.json_object(meta, where)
  tree_meta = meta.get("tree_metadata")
  if not isinstance(tree_meta, dict):
    raise errors.CheckpointFormatError(
        f"{where}: tree_metadata is {_checks.short(tree_meta)}, not an object; written by an"
        " orbax-checkpoint version this reader does not know, or damaged")
  flags = []
  for field, default in (("use_ocdbt", True), ("use_zarr3", False)):
    flag = meta.get(field, default)
    if not isinstance(flag, bool):
      raise errors.CheckpointFormatError(f"{where}: {field} is {_checks.short(flag)}, not a"
                                         " boolean")
    flags.append(flag)

  def bad(key_text: str, problem: str) -> errors.CheckpointFormatError:
    return errors.CheckpointFormatError(f"{where}: leaf {_checks.short(key_text)}: {problem};"
                                        " damaged or crafted")

  leaves = []
  for key_text, info in tree_meta.items():
    if not isinstance(info, dict):
      raise bad(key_text, f"is {_checks.kind(info)} ({_checks.short(info)}), not an object")
    raw = info.get("key_metadata")
    if raw:
      if not isinstance(raw, list):
        raise bad(key_text, f"key_metadata is {_checks.short(raw)}, not a list")
      keys = []
      for k in raw:
        key = k.get("key") if isinstance(k, dict) else None
        ktype = k.get("key_type", _DICT) if isinstance(k, dict) else None
        if not (isinstance(key, str) or _checks.is_int(key)) or not _checks.is_int(ktype) or ktype not in (_SEQUENCE, _DICT):
          raise bad(key_text, f"key_metadata entry {_checks.short(k)} is not {{'key': a string"
                    " or integer, 'key_type': 1 or 2}")
        keys.append((str(key), ktype))
    else:
      try:
        parsed = ast.literal_eval(key_text)
      except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        parsed = None
      if not isinstance(parsed, tuple) or not all(
          isinstance(k, str) or _checks.is_int(k) for k in parsed):
        raise bad(key_text, "has no key_metadata, and its name is not a tuple of keys")
      keys = [(str(k), _DICT) for k in parsed]
    vm = info.get("value_metadata", {})
    if not isinstance(vm, dict) or not isinstance(vm.get("value_type"), str):
      raise bad(key_text, f"value_metadata is {_checks.short(vm)}, not an object with a string"
                " value_type")
    skip = vm.get("skip_deserialize", False)
    if not isinstance(skip, bool):
      raise bad(key_text, f"skip_deserialize is {_checks.short(skip)}, not a boolean")
    if vm["value_type"] in _EMPTY_TYPES:
      # None (optax.EmptyState() too), an empty dict, list or tuple (orbax 0.12): no leaf to read
      leaves.append(_Leaf(tuple(keys), vm["value_type"], False))
      continue
    leaf = _Leaf(tuple(keys), vm["value_type"], skip)
    if not skip and leaf.value_type in _ARRAY_TYPES + ("scalar",):
      # A "/" inside a key nests the array in the item (orbax-checkpoint does that itself).
      _checks.relative_name(".".join(leaf.path), where, f"the array name of leaf {key_text!r}")
    leaves.append(leaf)
  return leaves, flags[0], flags[1]


class _KeyData(NamedTuple):
  """What a PRNG implementation stores per key: ``impl``'s key data has ``shape`` and ``dtype``."""
  impl: str
  shape: tuple[int, ...]
  dtype: np.dtype


def read_array_metadatas(loc: Location) -> dict[str, _KeyData]:
  """The PRNG key arrays a pytree item's ``array_metadatas`` names: array name -> its keys.

  orbax-checkpoint writes ``array_metadatas/process_<i>`` from every process, each listing
  every ``jax.Array`` it saved (``param_name``, the array's name; ``ext_metadata``, null or
  an object whose ``random_key_impl`` names a typed key's implementation). Process 0's is
  read (orbax reads the first it finds). Missing, or naming no key: no keys.

  Checked: neither the directory nor the file is a symbolic link or other special file (a
  local item); the file is at most ``_MAX_ARRAY_METADATAS_BYTES`` (not read beyond); it is
  a JSON object whose ``array_metadatas`` is a list of ``{"array_metadata": {...}}``
  objects, each ``param_name`` a string and ``ext_metadata`` null or an object; a
  ``random_key_impl`` (null: no key) is a string naming a PRNG implementation jax knows;
  no array is named with two implementations. Anything else raises CheckpointFormatError
  naming the file, the array and the value. Names that are not arrays of the item are
  left to the caller (orbax ignores them).

  Example:
    >>> import json, os, tempfile
    >>> from orbax_flax.core._location import Location
    >>> d = tempfile.mkdtemp(); os.makedirs(os.path.join(d, "array_metadatas"))
    >>> doc = {"array_metadatas": [{"array_metadata": {"param_name": "rng", "write_shape": [2],
    ...     "chunk_shape": [2], "ext_metadata": {"random_key_impl": "threefry2x32"}}}]}
    >>> _ = open(os.path.join(d, "array_metadatas", "process_0"), "w").write(json.dumps(doc))
    >>> read_array_metadatas(Location.parse(d))
    {'rng': _KeyData(impl='threefry2x32', shape=(2,), dtype=dtype('uint32'))}
  """
  where = f"{loc}/{_ARRAY_METADATAS}"
  if loc.is_local:  # a link would lead anywhere; a FIFO would block the read forever
    for part in (os.path.dirname(_ARRAY_METADATAS), _ARRAY_METADATAS):
      _location.refuse_special(os.path.join(loc.local_path, part), str(loc))
  data = _location.read_key(loc, _ARRAY_METADATAS, max_bytes=_MAX_ARRAY_METADATAS_BYTES + 1)
  if data is None:
    return {}
  if len(data) > _MAX_ARRAY_METADATAS_BYTES:
    raise errors.CheckpointFormatError(
        f"{where} is larger than {_MAX_ARRAY_METADATAS_BYTES} bytes, more than orbax-checkpoint"
        " writes for any tree this reader accepts; damaged or crafted, it is not read")
  doc = _checks.json_object(_checks.load_json(data, where), where)
  entries = doc.get("array_metadatas", [])
  if not isinstance(entries, list):
    raise errors.CheckpointFormatError(f"{where}: array_metadatas is {_checks.short(entries)},"
                                       " not a list; damaged or crafted")
  impls: dict[str, str | None] = {}
  for entry in entries:
    meta = entry.get("array_metadata") if isinstance(entry, dict) else None
    if not isinstance(meta, dict):
      raise errors.CheckpointFormatError(f"{where}: entry {_checks.short(entry)} is not an object"
                                         " {'array_metadata': {...}}; damaged or crafted")
    name, ext = meta.get("param_name"), meta.get("ext_metadata")
    if not isinstance(name, str):
      raise errors.CheckpointFormatError(f"{where}: param_name is {_checks.short(name)}, not a"
                                         " string; damaged or crafted")
    if ext is not None and not isinstance(ext, dict):
      raise errors.CheckpointFormatError(f"{where}: array {name!r}: ext_metadata is"
                                         f" {_checks.short(ext)}, not an object or null")
    impl = (ext or {}).get("random_key_impl")
    if impl is not None and not isinstance(impl, str):
      raise errors.CheckpointFormatError(f"{where}: array {name!r}: random_key_impl is"
                                         f" {_checks.short(impl)}, not a string")
    if impls.get(name, impl) != impl:
      raise errors.CheckpointFormatError(
          f"{where}: array {name!r} is listed twice, as {impls[name]!r} and {impl!r} keys;"
          " damaged or crafted")
    impls[name] = impl
  known: dict[str, _KeyData] = {}
  out = {}
  for name, impl in impls.items():
    if impl is None:
      continue
    if impl not in known:
      try:
        data = jax.eval_shape(lambda i=impl: jax.random.key_data(jax.random.key(0, impl=i)))
      except (ValueError, TypeError, KeyError) as e:
        raise errors.CheckpointFormatError(
            f"{where}: array {name!r}: random_key_impl {_checks.short(impl)} is not a PRNG"
            f" implementation jax knows ({str(e)[:300]}). Restore where jax knows it"
            f" (jax.random.key(0, impl={impl!r}) must work there: the jax version and PRNG"
            " implementations the run saved with), or the file is damaged.") from None
      known[impl] = _KeyData(impl, tuple(data.shape), np.dtype(data.dtype))
    out[name] = known[impl]
  return out


class _StepMetadata(NamedTuple):
  handlers: dict[str, str] | None  # item name -> handler; None: not a step of named items
  custom: dict[str, Any]
  metrics: dict[str, Any]
  time_ns: int


def read_step_metadata(loc: Location) -> _StepMetadata:
  """A step's ``_CHECKPOINT_METADATA``, checked in one pass (all empty if there is none).

  Checked: the file is a JSON object; ``item_handlers`` is a handler name, or
  an object of item names to handler names (or null) where every item name
  names a directory inside the step (no ``/``, ``..``, absolute paths); the
  custom metadata and metrics are objects; the timestamps are integers.
  """
  where = f"{loc}/{_STEP_METADATA}"
  meta = _read_json(loc, _STEP_METADATA)
  if meta is None:
    return _StepMetadata(None, {}, {}, 0)
  meta = _checks.json_object(meta, where)
  handlers = meta.get("item_handlers")
  if isinstance(handlers, dict):
    for name, handler in handlers.items():
      _checks.plain_name(name, where, "item name")
      if handler is not None and not isinstance(handler, str):
        raise errors.CheckpointFormatError(f"{where}: item {name!r} has handler"
                                           f" {_checks.short(handler)}, not a name")
  elif handlers is not None and not isinstance(handlers, str):
    raise errors.CheckpointFormatError(f"{where}: item_handlers is {_checks.short(handlers)},"
                                       " not an object of item names")
  out = {}
  for field in ("custom_metadata", "metrics"):
    value = meta.get(field) or {}
    if not isinstance(value, dict):
      raise errors.CheckpointFormatError(f"{where}: {field} is {_checks.short(value)}, not an"
                                         " object")
    out[field] = value
  t = meta.get("commit_timestamp_nsecs") or meta.get("init_timestamp_nsecs") or 0
  if not _checks.is_int(t) or not 0 <= t <= _manifest.LAST_TIME * 10**9:
    raise errors.CheckpointFormatError(f"{where}: timestamp {_checks.short(t)} is not an integer"
                                       " of nanoseconds since 1970 before the year 9000")
  return _StepMetadata(handlers if isinstance(handlers, dict) else None, out["custom_metadata"],
                       out["metrics"], t)


def detect(loc: Location) -> bool:
  """True if ``loc`` is an orbax-checkpoint pytree item or step directory."""
  return (_location.read_key(loc, _PYTREE_METADATA, max_bytes=1) is not None
          or _location.read_key(loc, _STEP_METADATA, max_bytes=1) is not None)


def steps(loc: Location) -> list[int]:
  """The committed steps of an orbax-checkpoint run directory, oldest first.

  A step is ``<step>/`` holding ``commit_success.txt`` or ``_CHECKPOINT_METADATA``:
  a directory on a file system, a key prefix on an object store (one listing of
  ``loc``). A prefix that cannot be listed (a bucket that does not exist) holds
  none: the caller's own read of it says why.

  Example:
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> os.makedirs(os.path.join(d, "20")); open(os.path.join(d, "20", _COMMIT), "w").close()
    >>> os.makedirs(os.path.join(d, "30", "default"))   # unfinished: no marker
    >>> steps(Location.parse(d))
    [20]
  """
  if loc.is_local:
    if not os.path.isdir(loc.local_path):
      return []
    try:
      names = os.listdir(loc.local_path)
    except OSError as e:
      raise _location.storage_error(loc, "listing its steps", e) from e
    return sorted(int(name) for name in names
                  if _is_step(name) and any(
                      os.path.exists(os.path.join(loc.local_path, name, marker))
                      for marker in (_COMMIT, _STEP_METADATA)))
  out = set()
  for key in _keys(loc):
    head, _, rest = key.partition("/")
    if _is_step(head) and rest in (_COMMIT, _STEP_METADATA):
      out.add(int(head))
  return sorted(out)


_LEGACY = re.compile(r"checkpoint_(\d+)")  # flax.training.checkpoints' default prefix


def legacy_steps(loc: Location) -> list[tuple[int, str]]:
  """``(step, name)`` of flax's legacy ``checkpoint_<N>`` entries, oldest first.

  Temporary entries (``checkpoint_40.orbax-checkpoint-tmp-...``) are not listed.
  On an object store an entry is a key prefix (an orbax pytree) or a key (a
  msgpack file).

  Raises:
    StorageError: a local directory that cannot be listed.
  """
  if loc.is_local:
    try:
      names = set(os.listdir(loc.local_path)) if os.path.isdir(loc.local_path) else set()
    except OSError as e:
      raise _location.storage_error(loc, "listing its entries", e) from e
  else:
    names = {key.partition("/")[0] for key in _keys(loc)}
  return sorted((int(m.group(1)), name) for name in names if (m := _LEGACY.fullmatch(name)))


def _is_step(name: str) -> bool:
  return name.isascii() and name.isdigit()


def _keys(loc: Location) -> list[str]:
  """Every key under the object-store prefix ``loc``; none if it cannot be listed."""
  try:
    return _location.list_keys(loc)
  except errors.StorageError:
    return []


class _Array:
  """One zarr/zarr3 array of an orbax item, read box by box through tensorstore.

  ``checksummed``: every chunk carries a checksum that tensorstore checks when it
  reads it (zarr3's ``crc32c`` codec, or zstd's content checksum), so a damaged
  chunk fails to read. orbax-checkpoint writes none; :func:`orbax_flax.export_orbax`
  writes a CRC-32C.
  """

  def __init__(self, store: ts.TensorStore, name: str):
    self.store, self.name = store, name
    self.checksummed = _checksummed(store.codec.to_json().get("codecs") or [])

  def read(self, box: tuple[tuple[int, int], ...], out: np.ndarray) -> None:
    try:
      self._read(box, out)
    except ValueError as e:  # tensorstore's errors: a damaged or missing chunk, a bad codec
      raise errors.CheckpointCorruptedError(f"cannot read array {self.name!r}: {e}") from e

  def _read(self, box: tuple[tuple[int, int], ...], out: np.ndarray) -> None:
    if not box:
      ts.array(out, copy=False, write=True).write(self.store).result()
      return
    # Straight into the caller's buffer, in slabs of whole chunk rows of about
    # _SLAB_BYTES: tensorstore holds a slab's compressed and decoded chunks at
    # once, so the temporary memory stays bounded whatever the array's size.
    chunk_rows = int(self.store.chunk_layout.read_chunk.shape[0] or 1)
    row_bytes = out.nbytes // max(out.shape[0], 1)
    rows = max(chunk_rows, _SLAB_BYTES // max(row_bytes, 1) // chunk_rows * chunk_rows)
    lo0, hi0 = box[0]
    start = lo0
    while start < hi0:
      stop = min(hi0, (start // chunk_rows) * chunk_rows + rows)
      view = self.store[(slice(start, stop),) + tuple(slice(lo, hi) for lo, hi in box[1:])]
      ts.array(out[start - lo0:stop - lo0], copy=False, write=True).write(
          view.translate_to[0]).result()
      start = stop

  def describe(self) -> str:
    return self.name

  @property
  def chunk_rows(self) -> int:
    """Rows of the first dimension in one stored chunk: a reader that takes slabs of rows
    aligned to them decodes each chunk once."""
    shape = self.store.chunk_layout.read_chunk.shape
    return int(shape[0] or 1) if shape else 1


def _checksummed(codecs: list[Any]) -> bool:
  """Whether a zarr3 codec chain checks every chunk's bytes when it decodes them: a
  ``crc32c`` codec, a zstd content checksum, or a sharding codec whose inner chain does.

  Example:
    >>> _checksummed([{"name": "bytes"}, {"name": "zstd"}, {"name": "crc32c"}])
    True
    >>> _checksummed([{"name": "bytes"}, {"name": "zstd", "configuration": {"checksum": False}}])
    False
  """
  for codec in codecs:
    if not isinstance(codec, dict):
      continue
    config = codec.get("configuration") or {}
    if codec.get("name") == "crc32c" or (codec.get("name") == "zstd" and config.get("checksum")):
      return True
    if codec.get("name") == "sharding_indexed" and _checksummed(config.get("codecs") or []):
      return True
  return False


def _array_spec(item: Location, name: str, ocdbt: bool, zarr3: bool) -> dict[str, Any]:
  kv = ({"driver": "ocdbt", "base": item.spec(), "path": name} if ocdbt else item.spec(name))
  # A missing chunk is an error, as in orbax-checkpoint's own reader (it writes every chunk,
  # fill values included): tensorstore would otherwise read it as zeros, and verify pass.
  return {"driver": "zarr3" if zarr3 else "zarr", "kvstore": kv, "fill_missing_data_reads": False}


_AGGREGATE = "checkpoint"  # older orbax versions' msgpack file of aggregated leaves


def _read_aggregate(loc: Location) -> Any:
  data = _location.read_key(loc, _AGGREGATE)
  if data is None:
    raise errors.CheckpointFormatError(
        f"{loc}: _METADATA says some leaves are in the aggregate file {_AGGREGATE!r}, which is"
        " missing; the checkpoint is incomplete")
  from flax import serialization  # pylint: disable=g-import-not-at-top  # msgpack with numpy
  try:
    return serialization.msgpack_restore(data)
  except Exception as e:  # msgpack raises its own errors  pylint: disable=broad-except
    raise errors.CheckpointCorruptedError(f"{loc}/{_AGGREGATE} is not readable msgpack: {e}") from e


class _InMemory:
  """An array read from the aggregate file: boxes are slices of it."""

  def __init__(self, value: np.ndarray):
    self.value = value

  def read(self, box, out):
    out[...] = self.value[tuple(slice(lo, hi) for lo, hi in box)] if box else self.value


def _aggregate_leaf(loc: Location, aggregate: Any, path: list[str]) -> Record:
  node = aggregate
  for k in path:
    if isinstance(node, dict) and k in node:
      node = node[k]
    elif isinstance(node, (list, tuple)) and k.isdigit() and int(k) < len(node):
      node = node[int(k)]
    else:
      raise errors.CheckpointFormatError(
          f"{loc}: leaf {'.'.join(path)} is marked as aggregated but is not in {_AGGREGATE!r}")
  if isinstance(node, (np.ndarray, np.generic)) and not _tree.is_supported_dtype(node.dtype):
    raise errors.CheckpointFormatError(
        f"{loc}: aggregated leaf {'.'.join(path)} has dtype {node.dtype}, which orbax_flax cannot"
        " read")
  if isinstance(node, np.ndarray) and node.ndim > 0:
    return Array(path=tuple(path), kind="array", shape=tuple(node.shape),
                 dtype=node.dtype.name, nbytes=node.nbytes, sharding="aggregate file",
                 source=_InMemory(node))
  value = node.item() if isinstance(node, (np.ndarray, np.generic)) else node
  if not isinstance(value, (bool, int, float, complex, str, bytes)):
    raise errors.CheckpointFormatError(
        f"{loc}: aggregated leaf {'.'.join(path)} is a {type(value).__name__}, which orbax_flax"
        " cannot read")
  return Value(tuple(path), _tree.encode_value(value))


def open_item(loc: Location) -> tuple[Item, str | None]:
  """Our manifest item for one orbax pytree or JSON item, and its layout (None for JSON)."""
  where = f"{loc}/{_PYTREE_METADATA}"
  found = read_tree_metadata(loc)
  if found is None:
    json_item = _read_json(loc, "metadata")
    if json_item is None:
      if _committed(loc):
        raise errors.CheckpointCorruptedError(
            f"{loc} is a committed orbax-checkpoint item ({_COMMIT}) whose {_PYTREE_METADATA}"
            " is missing: the item is incomplete (a file lost in a copy, or deleted) and cannot"
            " be read. Restore from another copy or step.")
      raise errors.CheckpointNotFoundError(f"{loc} is not an orbax-checkpoint item (no"
                                           f" {_PYTREE_METADATA})")
    try:
      structure, leaves = _tree.encode_structure(json_item)
    except RecursionError:
      raise errors.CheckpointFormatError(f"{loc}/metadata: nested too deeply") from None
    return Item(structure, tuple(Value(tuple(p), _tree.encode_value(v)) for p, v, _ in leaves)), None
  entries, ocdbt, zarr3 = found
  keys = (read_array_metadatas(loc) if any(e.value_type == "jax.Array" and not e.skip_deserialize
                                           for e in entries) else {})
  # A sequence is known by its children's key type, empty nodes' too (optax.sgd's state is
  # two empty nodes: orbax reads it back as [None, None]).
  sequences = frozenset(tuple(k for k, _ in e.keys[:d]) for e in entries
                        for d, (_, t) in enumerate(e.keys) if t == _SEQUENCE)
  empty = {tuple(e.path): _EMPTY_TYPES[e.value_type] for e in entries
           if e.value_type in _EMPTY_TYPES}
  entries = [e for e in entries if e.value_type not in _EMPTY_TYPES]
  try:
    structure, order = _tree.structure_from_paths([tuple(e.path) for e in entries], sequences,
                                                  empty)
  except errors.TreeMismatchError as e:
    raise errors.CheckpointFormatError(f"{where}: {e}") from None
  strings = None
  context = _location.context()
  aggregate = None
  opening = []
  recs: list[Record | None] = [None] * len(entries)
  for i, e in enumerate(entries):
    path, name, vtype = e.path, ".".join(e.path), e.value_type
    if e.skip_deserialize:
      # Kept in the msgpack aggregate file (``checkpoint``) of older orbax versions.
      if aggregate is None:
        aggregate = _read_aggregate(loc)
      recs[i] = _aggregate_leaf(loc, aggregate, path)
    elif vtype == "string":
      if strings is None:
        strings = _checks.json_object(_read_json(loc, _STRINGS) or {}, f"{loc}/{_STRINGS}")
      if not isinstance(strings.get(name), str):
        raise errors.CheckpointFormatError(
            f"{loc}/{_STRINGS}: string leaf {name!r} is {_checks.short(strings.get(name))}, not a"
            " string")
      recs[i] = Value(tuple(path), _tree.encode_value(strings[name]))
    elif vtype in _ARRAY_TYPES or vtype == "scalar":
      opening.append((i, path, name, vtype, ts.open(_array_spec(loc, name, ocdbt, zarr3),
                                                    open=True, read=True, context=context)))
    else:
      raise errors.CheckpointFormatError(
          f"{where}: leaf {name!r} has value_type {vtype!r}, which orbax_flax cannot read (it reads"
          f" {', '.join(_ARRAY_TYPES)}, scalars and strings)")

  def opened(fut: Any, name: str) -> Any:
    try:
      return fut.result()
    except Exception as e:  # tensorstore raises ValueError and friends  pylint: disable=broad-except
      raise errors.CheckpointCorruptedError(
          f"{loc}: cannot open or read array {name!r} ({'zarr3' if zarr3 else 'zarr'}"
          f"{' in OCDBT' if ocdbt else ''}): {e}") from e

  scalars = []
  for i, path, name, vtype, fut in opening:
    store = opened(fut, name)
    dtype = np.dtype(store.dtype.numpy_dtype)
    shape = tuple(int(s) for s in store.shape)
    if not _tree.is_supported_dtype(dtype):
      raise errors.CheckpointFormatError(f"{loc}: array {name!r} has dtype {dtype}, which"
                                         " orbax_flax cannot read")
    if vtype == "scalar":
      if math.prod(shape) != 1:
        raise errors.CheckpointFormatError(f"{where}: leaf {name!r} is a scalar, but its array"
                                           f" has shape {list(shape)}")
      scalars.append((i, path, name, store.read()))
      continue
    key = keys.get(name) if vtype == "jax.Array" else None
    if key is not None and (len(shape) < len(key.shape) or dtype != key.dtype
                            or shape[len(shape) - len(key.shape):] != key.shape):
      raise errors.CheckpointFormatError(
          f"{loc}/{_ARRAY_METADATAS}: array {name!r} holds {dtype}{list(shape)}, not the key data"
          f" of {key.impl} keys ({key.dtype}[..., {', '.join(map(str, key.shape))}]); damaged"
          " or crafted")
    recs[i] = Array(path=tuple(path), kind="array", shape=shape, dtype=dtype.name,
                    nbytes=math.prod(shape) * dtype.itemsize,
                    sharding="zarr3" if zarr3 else "zarr", source=_Array(store, name),
                    key_impl=key.impl if key else None,
                    key_shape=shape[:len(shape) - len(key.shape)] if key else None)
  for i, path, name, fut in scalars:
    value = opened(fut, name)
    recs[i] = Value(tuple(path), _tree.encode_value(np.asarray(value).item()))
  return (Item(structure, tuple(recs[i] for i in order)),
          ("OCDBT, " if ocdbt else "") + ("zarr3" if zarr3 else "zarr"))


def _committed(loc: Location) -> bool:
  """Whether orbax-checkpoint marked ``loc`` (an item or a step) committed: it writes
  ``commit_success.txt`` last into each, and our exports do too."""
  return _location.read_key(loc, _COMMIT, max_bytes=1) is not None


def open_checkpoint(loc: Location) -> Manifest:
  """A manifest-like description of an orbax-checkpoint item or step directory.

  Raises:
    CheckpointNotFoundError: no item this reader knows at ``loc``.
    CheckpointCorruptedError: ``loc`` is committed (``commit_success.txt``) but an
      item's ``_METADATA``, or an item its ``_CHECKPOINT_METADATA`` names, is missing;
      CheckpointFormatError for a metadata file that does not hold what orbax writes.
  """
  step = read_step_metadata(loc)
  has_tree = _location.read_key(loc, _PYTREE_METADATA, max_bytes=1) is not None
  items: dict[str, tuple[Item, str | None]] = {}
  skipped: dict[str, str] = {}
  if has_tree or step.handlers is None:
    if has_tree:
      items[DEFAULT_ITEM] = open_item(loc)
    elif _location.read_key(loc.join(DEFAULT_ITEM), _PYTREE_METADATA, max_bytes=1) is not None:
      items[DEFAULT_ITEM] = open_item(loc.join(DEFAULT_ITEM))  # a one-item manager's step
    elif _committed(loc):
      raise errors.CheckpointCorruptedError(
          f"{loc} is a committed orbax-checkpoint item or step ({_COMMIT}) whose"
          f" {_PYTREE_METADATA} is missing (here and in {loc.join(DEFAULT_ITEM)}): it is"
          " incomplete (a file lost in a copy, or deleted) and cannot be read. Restore from"
          " another copy or step.")
    else:
      raise errors.CheckpointNotFoundError(
          f"{loc} is an orbax-checkpoint step directory ({_STEP_METADATA}) without an item this"
          f" reader knows ({_PYTREE_METADATA} is missing here and in {loc.join(DEFAULT_ITEM)}; an"
          " unfinished save?); pass the directory of one of its pytree items")
    any_item = True
  else:
    for name, handler in sorted(step.handlers.items()):
      sub = loc.join(name)
      if "PyTree" in str(handler) or "Standard" in str(handler) or "Json" in str(handler):
        try:
          items[name] = open_item(sub)
        except errors.CheckpointNotFoundError as e:
          if not _committed(loc):
            raise
          raise errors.CheckpointCorruptedError(
              f"{loc} is a committed orbax-checkpoint step ({_COMMIT}) whose item {name!r},"
              f" named in its {_STEP_METADATA}, cannot be found ({e}): the step is incomplete"
              " (a file lost in a copy, or deleted). Restore from another copy or step.") from e
      else:
        skipped[name] = str(handler)
    any_item = False
  custom = dict(step.custom)
  if skipped:
    custom["items_not_read"] = skipped
  layouts = sorted({layout for _, layout in items.values() if layout is not None})
  return Manifest(
      format=FORMAT, any_item=any_item, items={k: item for k, (item, _) in items.items()},
      created=step.time_ns / 1e9, process_count=0, device_count=0,
      library_version="orbax-checkpoint" + (f" ({', '.join(layouts)})" if layouts else ""),
      custom=custom)
