"""Restoring a checkpoint onto whatever mesh the caller's target describes.

The target is a dict of items, each a pytree whose leaves say what to build:

* ``jax.ShapeDtypeStruct`` with ``.sharding``, or a ``jax.Array`` (its shape,
  dtype and sharding are used): a ``jax.Array`` with that sharding. Each
  process reads only the chunks its own devices need, so any mesh, device
  count or process count works.
* ``np.ndarray``: a host numpy array of that dtype.
* a Python or numpy scalar, str or bytes: the saved value.

A target dtype that differs from the saved one is converted with numpy's
``astype`` (e.g. float32 -> bfloat16 rounds to nearest). Everything is checked
before any array data is read: missing or extra keys, shapes, and shardings
that do not divide the array.
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

from orbax_flax import _layout
from orbax_flax import _location
from orbax_flax import _manifest
from orbax_flax import _reading
from orbax_flax import _staging
from orbax_flax import _tree
from orbax_flax import errors
from orbax_flax._location import Location
from orbax_flax._planning import TMP_MARKER


def _not_found(loc: Location) -> errors.CheckpointNotFoundError:
  if TMP_MARKER in loc.name:
    return errors.CheckpointNotFoundError(
        f"{loc} is the temporary directory of an unfinished or replaced save, not a"
        " committed checkpoint; it is safe to delete.")
  if loc.is_local and not os.path.exists(loc.local_path):
    hint = "The path does not exist."
  else:
    hint = "The path exists but holds no committed checkpoint (an interrupted save?)."
  return errors.CheckpointNotFoundError(f"no committed orbax_flax checkpoint at {loc}. {hint}")


def read_manifest(loc: Location) -> dict[str, Any]:
  """The committed manifest at ``loc``; CheckpointNotFoundError if none."""
  data = None if TMP_MARKER in loc.name else _location.read_key(loc, _manifest.MANIFEST_KEY)
  if data is None:
    raise _not_found(loc)
  return _manifest.decode(data, f"{loc}/{_manifest.MANIFEST_KEY}")


def read_summary(loc: Location) -> dict[str, Any]:
  """The manifest's summary (time, sizes, custom metadata), reading a few KB."""
  where = f"{loc}/{_manifest.MANIFEST_KEY}"
  if TMP_MARKER in loc.name:
    raise _not_found(loc)
  data = _location.read_key(loc, _manifest.MANIFEST_KEY, max_bytes=_manifest.SUMMARY_READ_BYTES)
  if data is None:
    raise _not_found(loc)
  summary = _manifest.decode_summary(data, where)
  if summary is None:  # an unusually long summary: read it all
    summary = {k: v for k, v in read_manifest(loc).items() if k != "items"}
  return summary


@dataclasses.dataclass
class _Want:
  """One array leaf to read: where it comes from and what to build."""
  item: str
  rec: dict[str, Any]
  dtype: np.dtype             # target dtype of the data (key data for PRNG keys)
  sharding: Any               # jax Sharding of the data, or None for host numpy
  shape: tuple[int, ...]      # shape of the data (key data for PRNG keys)
  key_impl: str | None
  boxes: dict[_layout.Box, list[Any]]  # distinct boxes to read -> devices that get them


def restore(path: Any, target: Mapping[str, Any] | None = None, *, partial: bool = False,
            max_host_bytes: int = 0, progress: Any = None) -> dict[str, Any]:
  """Restores a checkpoint, resharded onto the target's shardings.

  Args:
    path: the checkpoint (local path, URL or kvstore spec dict).
    target: item name -> pytree of ``jax.ShapeDtypeStruct`` (with sharding),
      ``jax.Array``, ``np.ndarray`` or scalars, or None to restore that item
      whole as host values in its saved structure. Items not named are not read.
      None restores every item as host numpy arrays in the saved structure
      (namedtuples come back as namedtuples, other custom nodes as dicts, PRNG
      keys as single-device key arrays).
    partial: restore only the leaves the target names. Otherwise a leaf in the
      checkpoint that the target lacks is an error.
    max_host_bytes: a budget for host memory beyond the restored arrays
      (0: none): arrays are read and placed in rounds of at most this many
      bytes, and temporary buffers stay within it (plus one chunk).
    progress: an ``orbax_flax._progress.Progress`` updated with the bytes read.

  Returns:
    item name -> restored pytree, with the target's structure.

  Raises:
    CheckpointNotFoundError: no committed checkpoint at ``path``.
    TreeMismatchError: target and checkpoint disagree; lists every difference.
    CheckpointCorruptedError: a chunk fails its checksum.

  Example:
    >>> import jax, numpy as np, orbax_flax as ofx, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> ofx.save(path, {"state": {"w": np.arange(4.0), "b": np.zeros(2)}})
    >>> sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> target = {"state": {"w": jax.ShapeDtypeStruct((4,), np.float32, sharding=sharding)}}
    >>> ofx.restore(path, target, partial=True)["state"]["w"]
    Array([0., 1., 2., 3.], dtype=float32)
  """
  loc = Location.parse(path)
  manifest = read_manifest(loc)
  if target is None:
    return _restore_all(loc, manifest, max_host_bytes=max_host_bytes, progress=progress)
  if not isinstance(target, Mapping):
    raise TypeError(f"target must be a dict of item name -> pytree (e.g. {{'state':"
                    f" abstract_state}}) or None; got {type(target).__name__}")

  diffs: list[str] = []
  bad_shardings: list[str] = []
  results: dict[str, tuple[Any, list[Any]]] = {}
  wants: list[tuple[_Want, str, int]] = []
  whole: list[str] = []
  for item, subtree in target.items():
    saved_item = manifest["items"].get(item)
    if saved_item is None:
      diffs.append(f"item {item!r}: in target, not in checkpoint (it has"
                   f" {sorted(manifest['items'])})")
      continue
    if subtree is None:
      whole.append(item)
      continue
    saved = {tuple(r["path"]): r for r in saved_item["leaves"]}
    flat, treedef = jax.tree_util.tree_flatten_with_path(subtree)
    out: list[Any] = [None] * len(flat)
    results[item] = (treedef, out)
    seen = set()
    for i, (kp, leaf) in enumerate(flat):
      path_ = tuple(_tree.key_part(k) for k in kp)
      seen.add(path_)
      where = f"{item}/{_tree.path_str(path_)}"
      rec = saved.get(path_)
      if rec is None:
        diffs.append(f"{where}: in target, not in checkpoint")
        continue
      want = _want(item, rec, leaf, where, diffs, bad_shardings)
      if want is None:
        continue
      if isinstance(want, _Value):
        out[i] = want.value
      else:
        wants.append((want, item, i))
    if not partial:
      for path_ in saved:
        if path_ not in seen:
          diffs.append(f"{item}/{_tree.path_str(path_)}: in checkpoint, not in target (pass"
                       " partial=True to restore a subset)")
  if diffs:
    raise errors.TreeMismatchError(
        f"restore target does not match the checkpoint at {loc}:\n  " + "\n  ".join(diffs),
        diffs)
  if bad_shardings:
    raise ValueError("target shardings cannot hold these arrays (JAX needs every sharded"
                     " dimension to divide evenly); change the PartitionSpec or mesh:\n  "
                     + "\n  ".join(bad_shardings))

  if progress is not None:
    progress.total = sum(w.rec["nbytes"] for w, _, _ in wants) + sum(
        r.get("nbytes", 0) for i in whole for r in manifest["items"][i]["leaves"])
    progress.phase = "reading"
  arrays = read_arrays(loc, manifest, [w for w, _, _ in wants], max_host_bytes, progress)
  for (_, item, i), value in zip(wants, arrays):
    results[item][1][i] = value
  out = _restore_all(loc, manifest, whole, max_host_bytes, progress) if whole else {}
  out.update({item: jax.tree_util.tree_unflatten(treedef, leaves)
              for item, (treedef, leaves) in results.items()})
  return {item: out[item] for item in target if item in out}


@dataclasses.dataclass
class _Value:
  value: Any


def _is_key_dtype(dtype: Any) -> bool:
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_impl_name(dtype: Any) -> str | None:
  """The PRNG implementation a key dtype names (``key<rbg>`` -> "rbg"), if jax says."""
  impl = getattr(dtype, "_impl", None)  # jax has no public accessor on a dtype
  return getattr(impl, "name", None)


def _key_data_sharding(sharding: Any, where: str) -> Any:
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec, None))
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return sharding
  raise ValueError(f"{where}: restoring PRNG keys onto a {type(sharding).__name__} is not"
                   " supported; use a NamedSharding or SingleDeviceSharding.")


def _want(item: str, rec: dict[str, Any], leaf: Any, where: str, diffs: list[str],
          bad_shardings: list[str]) -> _Want | _Value | None:
  """Checks one target leaf against its record; returns what to read."""
  saved_kind = rec["kind"]
  if isinstance(leaf, jax.ShapeDtypeStruct) or isinstance(leaf, jax.Array):
    sharding = leaf.sharding
    if sharding is None:
      raise ValueError(f"target leaf {where} is a jax.ShapeDtypeStruct without a sharding; give"
                       " it one (jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh,"
                       " P(...)))) or use a numpy array to restore on the host.")
    shape, dtype = tuple(leaf.shape), leaf.dtype
  elif isinstance(leaf, np.ndarray):
    sharding, shape, dtype = None, leaf.shape, leaf.dtype
  elif _tree.leaf_kind(leaf) == "value":
    if saved_kind == "value":
      return _Value(_tree.decode_value(rec["value"]))
    sharding, shape, dtype = None, _tree.array_shape(rec), None
  else:
    raise TypeError(f"target leaf {where} is a {type(leaf).__name__}; use a"
                    " jax.ShapeDtypeStruct with a sharding, a jax.Array, a numpy array or a"
                    " scalar.")

  if saved_kind == "value":
    value = _tree.decode_value(rec["value"])
    if shape == () and isinstance(value, (bool, int, float, complex, np.generic)) and not _is_key_dtype(dtype):
      array = np.asarray(value, dtype=dtype)
      if sharding is None:
        return _Value(array)
      return _Value(jax.make_array_from_callback((), sharding, lambda _: array))
    diffs.append(f"{where}: checkpoint holds a {type(value).__name__}, target wants an array"
                 f" of shape {shape}")
    return None

  saved_key = rec.get("key_impl")
  if dtype is not None and _is_key_dtype(dtype) != (saved_key is not None):
    diffs.append(f"{where}: " + ("checkpoint holds PRNG keys, target is not a key array" if saved_key
                                 else "target is a PRNG key array, checkpoint holds plain data"))
    return None
  wanted_impl = _key_impl_name(dtype) if saved_key and dtype is not None else None
  if wanted_impl is not None and wanted_impl != saved_key:
    diffs.append(f"{where}: checkpoint holds {saved_key} PRNG keys, target asks for {wanted_impl}"
                 f" keys; keys of one implementation cannot be converted exactly into another."
                 f" Restore into {saved_key} keys (e.g. a target built with"
                 f" jax.random.key(0, impl={saved_key!r})), or make new keys.")
    return None
  saved_shape = _tree.array_shape(rec)
  if tuple(shape) != saved_shape:
    diffs.append(f"{where}: shape {saved_shape} in checkpoint, {tuple(shape)} in target")
    return None
  data_shape = tuple(rec["shape"])
  data_dtype = np.dtype(rec["dtype"]) if (dtype is None or saved_key) else np.dtype(dtype)
  if sharding is not None:
    try:
      sharding.shard_shape(tuple(shape))
    except ValueError as e:
      bad_shardings.append(f"{where} (shape {tuple(shape)}): {e}")
      return None
    if saved_key:
      sharding = _key_data_sharding(sharding, where)
  boxes = {tuple((0, s) for s in data_shape): []} if sharding is None else _boxes(sharding, data_shape)
  return _Want(item, rec, data_dtype, sharding, data_shape, saved_key, boxes)


@functools.lru_cache(maxsize=1024)
def _boxes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[_layout.Box, list[Any]]:
  """The distinct boxes this process's devices hold, and which devices hold each."""
  boxes: dict[_layout.Box, list[Any]] = {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    boxes.setdefault(_layout.slices_to_box(index, shape), []).append(device)
  return boxes


def _restore_all(loc: Location, manifest: dict[str, Any], items: list[str] | None = None,
                 max_host_bytes: int = 0, progress: Any = None) -> dict[str, Any]:
  """Items (default: all) as host numpy arrays, in the saved structure."""
  wants, slots = [], []
  values: dict[str, list[Any]] = {}
  chosen = {k: v for k, v in manifest["items"].items() if items is None or k in items}
  for item, saved_item in chosen.items():
    leaves = saved_item["leaves"]
    values[item] = [None] * len(leaves)
    for i, rec in enumerate(leaves):
      if rec["kind"] == "value":
        values[item][i] = _tree.decode_value(rec["value"])
        continue
      shape = tuple(rec["shape"])
      wants.append(_Want(item, rec, np.dtype(_tree.dtype_from_name(rec["dtype"])), None, shape,
                         rec.get("key_impl"), {tuple((0, s) for s in shape): []}))
      slots.append((item, i))
  if progress is not None and not progress.total:
    progress.total, progress.phase = sum(w.rec["nbytes"] for w in wants), "reading"
  for (item, i), value in zip(slots, read_arrays(loc, manifest, wants, max_host_bytes, progress)):
    values[item][i] = value
  return {item: _tree.decode_structure(saved_item["structure"], values[item])
          for item, saved_item in chosen.items()}


def _windows(wants: list[_Want], budget: int) -> list[list[int]]:
  """Indices of ``wants`` in rounds of at most ``budget`` bytes of host data (0: one round)."""
  if not budget:
    return [list(range(len(wants)))]
  rounds: list[list[int]] = [[]]
  used = 0
  for i, w in enumerate(wants):
    n = sum(math.prod(_layout.box_shape(b)) for b in w.boxes) * np.dtype(w.dtype).itemsize
    if rounds[-1] and used + n > budget:
      rounds.append([])
      used = 0
    rounds[-1].append(i)
    used += n
  return rounds


def _box_buffers(want: _Want, dtype: np.dtype) -> list[np.ndarray]:
  """The array's boxes, 64-byte aligned in one mapping of its own.

  JAX's CPU client adopts aligned buffers without a copy, and each restored
  array frees its memory on its own.
  """
  return _staging.fresh_arrays([(_layout.box_shape(b), dtype) for b in want.boxes])


def read_arrays(loc: Location, manifest: dict[str, Any], wants: list[_Want],
                max_host_bytes: int = 0, progress: Any = None) -> list[Any]:
  """Reads the wanted arrays into fresh buffers, then builds host or device arrays.

  Every box is read straight into the memory that becomes the result (one
  mapping per array, so that each array frees its memory on its own), small
  packed arrays included. With a budget, arrays are read and placed in rounds.
  """
  reader = _reading.Reader(loc, manifest, max_host_bytes, progress)
  out: list[Any] = [None] * len(wants)
  for window in _windows(wants, max_host_bytes):
    fills, packed = [], []
    datas: dict[int, list[np.ndarray]] = {}
    for i in window:
      w = wants[i]
      rec = w.rec
      saved = _tree.dtype_from_name(rec["dtype"])
      if "packed_offset" in rec:
        # A small array: each box it is needed in gets a buffer of its own.
        bufs = _box_buffers(w, saved)
        lo = rec["packed_offset"]
        dests = [(_layout.box_to_slices(b), buf) for b, buf in zip(w.boxes, bufs)]
        packed.append(_reading.PackedFill(w.item, rec["owners"][0], lo, lo + rec["nbytes"],
                                          saved, w.shape, dests, _tree.path_str(tuple(rec["path"]))))
        datas[id(w)] = bufs
      elif not rec["owners"]:
        datas[id(w)] = [np.zeros(_layout.box_shape(b), saved) for b in w.boxes]
      else:
        bufs = _box_buffers(w, _tree.dtype_from_name(rec["stored_dtype"]))
        fills += [_reading.Fill(w.item, rec, b, buf) for b, buf in zip(w.boxes, bufs)]
        datas[id(w)] = [buf if buf.dtype == saved else buf.view(saved) for buf in bufs]
    reader.read(fills, packed)
    for i in window:
      w = wants[i]
      datas[id(w)] = [b if b.dtype == w.dtype else b.astype(w.dtype) for b in datas[id(w)]]
    for i, value in zip(window, _assemble([wants[i] for i in window], datas)):
      out[i] = value
  return out


def _assemble(wants: list[_Want], datas: dict[int, list[np.ndarray]]) -> list[Any]:
  """Host arrays as they are; device arrays placed with one batched device_put.

  ``datas`` holds, per want, one array per box of ``want.boxes``.
  """
  out: list[Any] = [None] * len(wants)
  sharded: list[tuple[int, int]] = []  # (want index, number of shards)
  values, targets, alias = [], [], []
  for i, w in enumerate(wants):
    boxes = datas[id(w)]
    if w.sharding is None:
      out[i] = boxes[0]
    else:
      n = 0
      for devices, data in zip(w.boxes.values(), boxes):
        for j, device in enumerate(devices):
          # The first device may use the buffer in place (zero-copy on CPU when
          # aligned); the others get copies, so donating one cannot change another.
          values.append(data)
          targets.append(device)
          alias.append(j == 0)
          n += 1
      sharded.append((i, n))
  placed = jax.device_put(values, targets, may_alias=alias) if values else []
  k = 0
  for i, n in sharded:
    w = wants[i]
    out[i] = jax.make_array_from_single_device_arrays(w.shape, w.sharding, placed[k:k + n])
    k += n
  for i, w in enumerate(wants):
    if w.key_impl:
      out[i] = jax.random.wrap_key_data(out[i], impl=w.key_impl)
  return out
