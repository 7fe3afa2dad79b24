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
  says; tensorstore decodes it. Scalars are 0-d arrays.
* **A step of a ``CheckpointManager``**: ``_CHECKPOINT_METADATA`` names the
  items (``ocp.args.Composite``) and their handlers; pytree items are read as
  above, JSON items (``JsonSave``) as values.
* **A run directory**: numbered step directories; :func:`steps` lists the
  committed ones (``commit_success.txt`` or ``_CHECKPOINT_METADATA``).

Arrays are read through tensorstore, box by box, so each process reads only the
chunks its devices need. Scalars and strings are read when the checkpoint is
opened (they are small and a target may want them as values).
"""

from __future__ import annotations

import ast
import json
import os
from typing import Any

import numpy as np
import tensorstore as ts

from orbax_flax import _location
from orbax_flax import _tree
from orbax_flax import errors
from orbax_flax._location import Location

FORMAT = "orbax-checkpoint"
DEFAULT_ITEM = "default"
_PYTREE_METADATA = "_METADATA"
_STEP_METADATA = "_CHECKPOINT_METADATA"
_STRINGS = "_strings.json"
_ARRAY_TYPES = ("jax.Array", "np.ndarray")
_SEQUENCE = 1  # orbax's KeyType.SEQUENCE; 2 is DICT
_SLAB_BYTES = 16 << 20


def _read_json(loc: Location, key: str) -> Any | None:
  data = _location.read_key(loc, key)
  if data is None:
    return None
  try:
    return json.loads(data)
  except ValueError as e:
    raise errors.CheckpointFormatError(f"{loc}/{key} is not valid JSON ({e}); damaged?") from e


def detect(loc: Location) -> bool:
  """True if ``loc`` is an orbax-checkpoint pytree item or step directory."""
  return (_location.read_key(loc, _PYTREE_METADATA, max_bytes=1) is not None
          or _location.read_key(loc, _STEP_METADATA, max_bytes=1) is not None)


def steps(loc: Location) -> list[int]:
  """The committed steps of an orbax-checkpoint run directory (local), oldest first."""
  if not loc.is_local or not os.path.isdir(loc.local_path):
    return []
  out = []
  for name in os.listdir(loc.local_path):
    full = os.path.join(loc.local_path, name)
    if name.isdigit() and (os.path.exists(os.path.join(full, "commit_success.txt"))
                           or os.path.exists(os.path.join(full, _STEP_METADATA))):
      out.append(int(name))
  return sorted(out)


class _Array:
  """One zarr/zarr3 array of an orbax item, read box by box through tensorstore."""

  def __init__(self, store: ts.TensorStore, name: str):
    self.store, self.name = store, name

  def read(self, box: tuple[tuple[int, int], ...], out: np.ndarray) -> None:
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


def _array_spec(item: Location, name: str, ocdbt: bool, zarr3: bool) -> dict[str, Any]:
  kv = ({"driver": "ocdbt", "base": item.spec(), "path": name} if ocdbt else item.spec(name))
  return {"driver": "zarr3" if zarr3 else "zarr", "kvstore": kv}


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


def _aggregate_leaf(loc: Location, aggregate: Any, path: list[str]) -> dict[str, Any]:
  node = aggregate
  for k in path:
    if isinstance(node, dict) and k in node:
      node = node[k]
    elif isinstance(node, (list, tuple)) and k.isdigit() and int(k) < len(node):
      node = node[int(k)]
    else:
      raise errors.CheckpointFormatError(
          f"{loc}: leaf {'.'.join(path)} is marked as aggregated but is not in {_AGGREGATE!r}")
  if isinstance(node, np.ndarray) and node.ndim > 0:
    return {"kind": "array", "path": path, "shape": list(node.shape), "dtype": node.dtype.name,
            "nbytes": node.nbytes, "sharding": {"text": "aggregate file"},
            "source": _InMemory(node)}
  value = node.item() if isinstance(node, (np.ndarray, np.generic)) else node
  if not isinstance(value, (bool, int, float, complex, str, bytes)):
    raise errors.CheckpointFormatError(
        f"{loc}: aggregated leaf {'.'.join(path)} is a {type(value).__name__}, which orbax_flax"
        " cannot read")
  return {"kind": "value", "path": path, "value": _tree.encode_value(value), "nbytes": 0}


def open_item(loc: Location) -> dict[str, Any]:
  """Our manifest item (leaves and structure) for one orbax pytree or JSON item."""
  meta = _read_json(loc, _PYTREE_METADATA)
  if meta is None:
    json_item = _read_json(loc, "metadata")
    if json_item is None:
      raise errors.CheckpointNotFoundError(f"{loc} is not an orbax-checkpoint item (no"
                                           f" {_PYTREE_METADATA})")
    structure, leaves = _tree.encode_structure(json_item)
    return {"structure": structure, "leaves": [
        {"kind": "value", "path": list(p), "value": _tree.encode_value(v), "nbytes": 0}
        for p, v in leaves]}
  tree_meta = meta.get("tree_metadata")
  if not isinstance(tree_meta, dict):
    raise errors.CheckpointFormatError(f"{loc}/{_PYTREE_METADATA} has no tree_metadata; written"
                                       " by an orbax-checkpoint version this reader does not know")
  ocdbt = bool(meta.get("use_ocdbt", True))
  zarr3 = bool(meta.get("use_zarr3", False))
  strings = None
  entries = []
  for key_text, info in tree_meta.items():
    keys = tuple((str(k["key"]), int(k.get("key_type", 2))) for k in info.get("key_metadata", ()))
    if not keys:
      keys = tuple((str(k), 2) for k in ast.literal_eval(key_text))
    vm = info.get("value_metadata", {})
    if vm.get("value_type") == "None":
      continue  # an empty node (None, optax.EmptyState()): no leaf to read
    entries.append((keys, vm))
  context = _location.default_context()
  aggregate = None
  opening = []
  recs: list[dict[str, Any] | None] = [None] * len(entries)
  for i, (keys, vm) in enumerate(entries):
    path = [k for k, _ in keys]
    name = ".".join(path)
    vtype = vm.get("value_type")
    if vm.get("skip_deserialize"):
      # Kept in the msgpack aggregate file (``checkpoint``) of older orbax versions.
      if aggregate is None:
        aggregate = _read_aggregate(loc)
      recs[i] = _aggregate_leaf(loc, aggregate, path)
    elif vtype == "string":
      if strings is None:
        strings = _read_json(loc, _STRINGS) or {}
      if name not in strings:
        raise errors.CheckpointFormatError(f"{loc}: string leaf {name!r} missing from {_STRINGS}")
      recs[i] = {"kind": "value", "path": path, "value": _tree.encode_value(str(strings[name])),
                 "nbytes": 0}
    elif vtype in _ARRAY_TYPES or vtype == "scalar":
      opening.append((i, path, name, vtype, ts.open(_array_spec(loc, name, ocdbt, zarr3),
                                                    open=True, read=True, context=context)))
    else:
      raise errors.CheckpointFormatError(
          f"{loc}: leaf {name!r} has value_type {vtype!r}, which orbax_flax cannot read (it reads"
          f" {', '.join(_ARRAY_TYPES)}, scalars and strings)")
  scalars = []
  for i, path, name, vtype, fut in opening:
    try:
      store = fut.result()
    except Exception as e:  # tensorstore raises ValueError and friends  pylint: disable=broad-except
      raise errors.CheckpointCorruptedError(
          f"{loc}: cannot open array {name!r} ({'zarr3' if zarr3 else 'zarr'}"
          f"{' in OCDBT' if ocdbt else ''}): {e}") from e
    dtype = np.dtype(store.dtype.numpy_dtype)
    shape = tuple(int(s) for s in store.shape)
    if vtype == "scalar":
      scalars.append((i, path, store.read()))
      continue
    recs[i] = {"kind": "array", "path": path, "shape": list(shape), "dtype": dtype.name,
               "nbytes": int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
               "sharding": {"text": "zarr3" if zarr3 else "zarr"}, "source": _Array(store, name)}
  for i, path, fut in scalars:
    value = fut.result()
    recs[i] = {"kind": "value", "path": path, "value": _tree.encode_value(np.asarray(value).item()),
               "nbytes": 0}
  sequences = frozenset(tuple(k for k, _ in keys[:d]) for keys, _ in entries
                        for d, (_, t) in enumerate(keys) if t == _SEQUENCE)
  structure, order = _tree.structure_from_paths([tuple(k for k, _ in keys) for keys, _ in entries],
                                                sequences)
  return {"structure": structure, "leaves": [recs[i] for i in order],
          "layout": ("OCDBT, " if ocdbt else "") + ("zarr3" if zarr3 else "zarr")}


def open_checkpoint(loc: Location) -> dict[str, Any]:
  """A manifest-like description of an orbax-checkpoint item or step directory."""
  step_meta = _read_json(loc, _STEP_METADATA) or {}
  has_tree = _location.read_key(loc, _PYTREE_METADATA, max_bytes=1) is not None
  handlers = step_meta.get("item_handlers")
  items: dict[str, Any] = {}
  skipped: dict[str, str] = {}
  if has_tree or not isinstance(handlers, dict):
    if has_tree:
      items[DEFAULT_ITEM] = open_item(loc)
    elif _location.read_key(loc.join(DEFAULT_ITEM), _PYTREE_METADATA, max_bytes=1) is not None:
      items[DEFAULT_ITEM] = open_item(loc.join(DEFAULT_ITEM))  # a one-item manager's step
    else:
      raise errors.CheckpointNotFoundError(
          f"{loc} is an orbax-checkpoint step directory ({_STEP_METADATA}) without an item this"
          f" reader knows ({_PYTREE_METADATA} is missing here and in {loc.join(DEFAULT_ITEM)}; an"
          " unfinished save?); pass the directory of one of its pytree items")
    any_item = True
  else:
    for name, handler in sorted(handlers.items()):
      sub = loc.join(name)
      if "PyTree" in str(handler) or "Standard" in str(handler) or "Json" in str(handler):
        items[name] = open_item(sub)
      else:
        skipped[name] = str(handler)
    any_item = False
  t = step_meta.get("commit_timestamp_nsecs") or step_meta.get("init_timestamp_nsecs") or 0
  custom = dict(step_meta.get("custom_metadata") or {})
  if skipped:
    custom["items_not_read"] = skipped
  layouts = sorted({i.pop("layout") for i in items.values() if "layout" in i})
  return {
      "format": FORMAT, "any_item": any_item, "default_item": DEFAULT_ITEM, "items": items,
      "created": t / 1e9, "process_count": 0, "device_count": 0,
      "library_version": "orbax-checkpoint" + (f" ({', '.join(layouts)})" if layouts else ""),
      "custom": custom, "metrics": step_meta.get("metrics") or {},
  }
