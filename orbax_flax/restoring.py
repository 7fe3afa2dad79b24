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
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from orbax_flax import _layout
from orbax_flax import _location
from orbax_flax import _manifest
from orbax_flax import _tree
from orbax_flax import _tsio
from orbax_flax import errors
from orbax_flax import saving
from orbax_flax._location import Location


def read_manifest(loc: Location) -> dict[str, Any]:
  """The committed manifest at ``loc``; CheckpointNotFoundError if none."""
  data = _location.read_key(loc, _manifest.MANIFEST_KEY)
  if data is None:
    hint = ""
    if loc.is_local and saving.TMP_MARKER in loc.name:
      hint = " This is the temporary directory of an unfinished save."
    elif loc.is_local and not os.path.exists(loc.local_path):
      hint = " The path does not exist."
    else:
      hint = " The path exists but holds no committed checkpoint (an interrupted save?)."
    raise errors.CheckpointNotFoundError(f"no committed orbax_flax checkpoint at {loc}.{hint}")
  return _manifest.decode(data, f"{loc}/{_manifest.MANIFEST_KEY}")


@dataclasses.dataclass
class _Want:
  """One array leaf to read: where it comes from and what to build."""
  item: str
  rec: dict[str, Any]
  dtype: np.dtype             # target dtype of the data (key data for PRNG keys)
  sharding: Any               # jax Sharding of the data, or None for host numpy
  shape: tuple[int, ...]      # shape of the data (key data for PRNG keys)
  key_impl: str | None = None
  boxes: dict[_layout.Box, list[Any]] = dataclasses.field(default_factory=dict)


def restore(path: Any, target: Mapping[str, Any] | None = None, *, partial: bool = False) -> dict[str, Any]:
  """Restores a checkpoint, resharded onto the target's shardings.

  Args:
    path: the checkpoint (local path, URL or kvstore spec dict).
    target: item name -> pytree of ``jax.ShapeDtypeStruct`` (with sharding),
      ``jax.Array``, ``np.ndarray`` or scalars. Items not named are not read.
      None restores every item as host numpy arrays in the saved structure
      (namedtuples come back as namedtuples, other custom nodes as dicts, PRNG
      keys as single-device key arrays).
    partial: restore only the leaves the target names. Otherwise a leaf in the
      checkpoint that the target lacks is an error.

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
  saving.wait_for_inflight_save(loc)
  manifest = read_manifest(loc)
  if target is None:
    return _restore_all(loc, manifest)
  if not isinstance(target, Mapping):
    raise TypeError(f"target must be a dict of item name -> pytree (e.g. {{'state':"
                    f" abstract_state}}) or None; got {type(target).__name__}")

  diffs: list[str] = []
  bad_shardings: list[str] = []
  results: dict[str, tuple[Any, list[Any]]] = {}
  wants: list[tuple[_Want, str, int]] = []
  for item, subtree in target.items():
    saved_item = manifest["items"].get(item)
    if saved_item is None:
      diffs.append(f"item {item!r}: in target, not in checkpoint (it has"
                   f" {sorted(manifest['items'])})")
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

  arrays = _read(loc, manifest, [w for w, _, _ in wants])
  for (_, item, i), value in zip(wants, arrays):
    results[item][1][i] = value
  return {item: jax.tree_util.tree_unflatten(treedef, out)
          for item, (treedef, out) in results.items()}


@dataclasses.dataclass
class _Value:
  value: Any


def _is_key_dtype(dtype: Any) -> bool:
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


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
  want = _Want(item, rec, data_dtype, sharding, data_shape, saved_key)
  if sharding is None:
    want.boxes[tuple((0, s) for s in data_shape)] = []
  else:
    for device, index in sharding.addressable_devices_indices_map(data_shape).items():
      want.boxes.setdefault(_layout.slices_to_box(index, data_shape), []).append(device)
  return want


def _restore_all(loc: Location, manifest: dict[str, Any]) -> dict[str, Any]:
  """Every item as host numpy arrays, in the saved structure."""
  wants, slots = [], []
  values: dict[str, list[Any]] = {}
  for item, saved_item in manifest["items"].items():
    leaves = saved_item["leaves"]
    values[item] = [None] * len(leaves)
    for i, rec in enumerate(leaves):
      if rec["kind"] == "value":
        values[item][i] = _tree.decode_value(rec["value"])
        continue
      shape = tuple(rec["shape"])
      want = _Want(item, rec, np.dtype(_tree.dtype_from_name(rec["dtype"])), None, shape,
                   rec.get("key_impl"))
      want.boxes[tuple((0, s) for s in shape)] = []
      wants.append(want)
      slots.append((item, i))
  for (item, i), value in zip(slots, _read(loc, manifest, wants)):
    values[item][i] = value
  return {item: _tree.decode_structure(saved_item["structure"], values[item])
          for item, saved_item in manifest["items"].items()}


class _Pending:
  """A box being read: one tensorstore read, or several pieces to assemble."""

  def __init__(self, want: _Want, box: _layout.Box, reads: list[tuple[_layout.Box, str, Any]]):
    self.want, self.box, self.reads = want, box, reads

  def result(self, loc: Location) -> np.ndarray:
    want, rec = self.want, self.want.rec
    saved_dtype = _tree.dtype_from_name(rec["dtype"])
    out = None
    for piece, db, fut in self.reads:
      try:
        data = fut.result()
      except ValueError as e:
        raise _read_error(loc, want.item, rec, db, e) from e
      if data.dtype != saved_dtype:
        data = data.view(saved_dtype)
      if len(self.reads) == 1:
        out = data
        break
      if out is None:
        out = np.empty(_layout.box_shape(self.box), saved_dtype)
      out[_layout.relative(piece, self.box)] = data
    if out is None:
      out = np.zeros(_layout.box_shape(self.box), saved_dtype)
    if out.dtype != want.dtype:
      out = out.astype(want.dtype)
    return out


def _read_error(loc: Location, item: str, rec: dict[str, Any], db: str, e: Exception) -> Exception:
  path = _tree.path_str(tuple(rec["path"]))
  s = str(e)
  if _tsio.is_data_loss(e) or any(c in s for c in ("NOT_FOUND", "FAILED_PRECONDITION", "INVALID_ARGUMENT")):
    return _tsio.corrupted(item, path, loc, db, e)
  return _location._storage_error(loc, f"reading {item}/{path}", e)


def _read(loc: Location, manifest: dict[str, Any], wants: list[_Want]) -> list[Any]:
  """Issues every read at once, then assembles host or device arrays."""
  ctx = _tsio.context()
  gen = manifest["generation"]
  stores: dict[tuple[str, int, str], Any] = {}

  def store(want: _Want, owner: int) -> tuple[str, Any]:
    rec = want.rec
    db = f"{want.item}/p{owner}-{gen}"
    k = (want.item, owner, rec["name"])
    if k not in stores:
      spec = _tsio.array_spec(loc, db, rec["name"], rec["shape"], rec["stored_dtype"], rec["chunk_shape"])
      stores[k] = ts.open(spec, open=True, context=ctx)
    return db, stores[k]

  # Open every array first so that the opens run concurrently.
  for want in wants:
    for owner in set(want.rec["owners"]):
      store(want, owner)
  pending: list[list[_Pending]] = []
  for want in wants:
    rec = want.rec
    chunking = _layout.Chunking(tuple(rec["shape"]), tuple(rec["chunk_shape"]))
    per_box = []
    for box in want.boxes:
      reads = []
      if rec["owners"]:
        chunks = chunking.chunks_in_box(box)
        owners = {rec["owners"][c] for c in chunks}
        if len(owners) == 1:
          pieces = [(box, owners.pop())]
        else:
          pieces = [(_layout.intersect(chunking.chunk_box(c), box), rec["owners"][c]) for c in chunks]
        for piece, owner in pieces:
          db, opened = store(want, owner)
          try:
            st = opened.result()
          except ValueError as e:
            raise _read_error(loc, want.item, rec, db, e) from e
          reads.append((piece, db, st[_layout.box_to_slices(piece)].read()))
      per_box.append(_Pending(want, box, reads))
    pending.append(per_box)
  return [_assemble(want, [p.result(loc) for p in per_box])
          for want, per_box in zip(wants, pending)]


def _assemble(want: _Want, datas: list[np.ndarray]) -> Any:
  if want.sharding is None:
    data = datas[0]
    if want.key_impl:
      return jax.random.wrap_key_data(data, impl=want.key_impl)
    return data
  shards = []
  for (box, devices), data in zip(want.boxes.items(), datas):
    for j, device in enumerate(devices):
      # The first device may use the buffer in place (zero-copy on CPU when
      # aligned); the others get copies so that donating one cannot change
      # another.
      shards.append(jax.device_put(data, device, may_alias=(j == 0)))
  array = jax.make_array_from_single_device_arrays(want.shape, want.sharding, shards)
  if want.key_impl:
    return jax.random.wrap_key_data(array, impl=want.key_impl)
  return array
