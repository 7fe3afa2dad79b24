"""Restoring a checkpoint onto whatever mesh the caller's target describes.

The target is a dict of items, each a pytree whose leaves say what to build:

* ``jax.ShapeDtypeStruct`` with ``.sharding``, or a ``jax.Array`` (its shape,
  dtype and sharding are used): a ``jax.Array`` with that sharding. Each
  process reads only the chunks its own devices need, so any mesh, device
  count or process count works.
* ``np.ndarray``: a host numpy array of that dtype.
* a Python or numpy scalar, str or bytes: the saved value. A Python scalar
  (e.g. a ``TrainState``'s int ``step``) stays a Python scalar even when the
  checkpoint holds a 0-d array (a step saved after a jitted update).

A target dtype that differs from the saved one is converted with numpy's
``astype`` when that is exact (int8 -> float32); a conversion that loses
information (float32 -> bfloat16 or int8) needs ``allow_lossy_casts=True``.
Everything is checked before any array data is read: missing or extra keys,
shapes, dtypes, and shardings that do not divide the array.
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
from orbax_flax import targets
from orbax_flax._location import Location
from orbax_flax._planning import TMP_MARKER
from orbax_flax._records import Array, Manifest, Record, Summary


def _not_found(loc: Location) -> errors.CheckpointNotFoundError:
  """No checkpoint at ``loc``: say what is there instead, and what to pass."""
  if TMP_MARKER in loc.name:
    return errors.CheckpointNotFoundError(
        f"{loc} is the directory of a save that has not committed (in progress, or"
        " interrupted), not a checkpoint.")
  if loc.is_local and not os.path.exists(loc.local_path):
    return errors.CheckpointNotFoundError(
        f"no orbax_flax checkpoint at {loc}: the path does not exist.")
  return errors.CheckpointNotFoundError(f"no orbax_flax checkpoint at {loc}: {_what_is_there(loc)}")


def _what_is_there(loc: Location) -> str:
  from orbax_flax import step_dir  # pylint: disable=g-import-not-at-top  # step_dir needs _planning
  from orbax_flax.formats import orbax_checkpoint  # pylint: disable=g-import-not-at-top
  ocp_steps = orbax_checkpoint.steps(loc)
  if ocp_steps:
    return (f"it is an orbax-checkpoint run directory holding {_steps_text(ocp_steps)}; pass one"
            f" step, e.g. {loc.join(str(ocp_steps[-1]))} (or one item of it, e.g."
            f" {loc.join(str(ocp_steps[-1])).join('default')})")
  try:
    steps, leftovers = step_dir.list_steps(loc)
  except NotADirectoryError:
    return "it is not a directory."
  except errors.StorageError as e:  # e.g. a bucket that does not exist
    return f"it cannot be listed: {e}"
  if steps:
    return (f"it is a directory of steps, holding {_steps_text(steps)}; pass one of them, e.g."
            f" {loc.join(str(steps[-1]))}")
  try:
    inner, _ = step_dir.list_steps(loc.join("checkpoints"))
  except (NotADirectoryError, errors.StorageError):
    inner = []
  if inner:
    return (f"it looks like a run's workdir: its checkpoints are in {loc.join('checkpoints')},"
            f" holding {_steps_text(inner)}; pass e.g. {loc.join('checkpoints').join(str(inner[-1]))}")
  names = set(os.listdir(loc.local_path)) if loc.is_local else set()
  if names & {"_sharding", "manifest.ocdbt", "commit_success.txt"}:
    return ("it looks like an orbax-checkpoint checkpoint without its _METADATA (an unfinished"
            " save?); nothing here can be read.")
  if leftovers:
    return ("it holds only uncommitted saves (in progress or interrupted): "
            + ", ".join(l.name for l in leftovers[:3]))
  if not loc.is_local and not _location.list_keys(loc):
    return "nothing is stored under this prefix: check the bucket name and the path."
  return "the path exists but holds no committed checkpoint (a save in progress or interrupted?)."


def _steps_text(steps: list[int]) -> str:
  shown = ", ".join(map(str, steps)) if len(steps) <= 6 else (
      f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-2:]))}")
  return f"step(s) [{shown}]"


def read_manifest(loc: Location) -> Manifest:
  """The committed manifest at ``loc``; CheckpointNotFoundError if none."""
  data = None if TMP_MARKER in loc.name else _location.read_key(loc, _manifest.MANIFEST_KEY)
  if data is None:
    raise _not_found(loc)
  return _manifest.decode(data, f"{loc}/{_manifest.MANIFEST_KEY}")


def open_manifest(path: Any) -> tuple[Location, Manifest]:
  """The manifest of the checkpoint at ``path``, in any format ``restore`` reads.

  Ours is read and verified; an orbax-checkpoint or safetensors checkpoint is
  described by an in-memory manifest of the same shape (see
  :mod:`orbax_flax.formats`).
  """
  from orbax_flax import formats  # pylint: disable=g-import-not-at-top  # formats imports us
  loc = Location.parse(path)
  if TMP_MARKER not in loc.name:
    data = _location.read_key(loc, _manifest.MANIFEST_KEY)
    if data is not None:
      return loc, _manifest.decode(data, f"{loc}/{_manifest.MANIFEST_KEY}")
    foreign = formats.open_foreign(loc)
    if foreign is not None:
      return loc, foreign
  raise _not_found(loc)


def reader_for(loc: Location, manifest: Manifest, max_host_bytes: int = 0,
               progress: Any = None) -> _reading.Reader | None:
  """The engine's reader for our own format; None for a foreign one (its leaves read themselves)."""
  if manifest.format != _manifest.FORMAT:
    return None
  return _reading.Reader(loc, manifest, max_host_bytes, progress)


def read_summary(loc: Location) -> Summary:
  """The manifest's summary (time, sizes, custom metadata), reading a few KB."""
  where = f"{loc}/{_manifest.MANIFEST_KEY}"
  if TMP_MARKER in loc.name:
    raise _not_found(loc)
  data = _location.read_key(loc, _manifest.MANIFEST_KEY, max_bytes=_manifest.SUMMARY_READ_BYTES)
  if data is None:
    raise _not_found(loc)
  summary = _manifest.decode_summary(data, where)
  extent = _manifest.summary_extent(data) if summary is None else None
  if extent is not None and extent > len(data):  # a long summary: read just that much
    data = _location.read_key(loc, _manifest.MANIFEST_KEY, max_bytes=extent)
    summary = None if data is None else _manifest.decode_summary(data, where)
  if summary is None:  # a long summary of a manifest that does not say its length: read it all
    summary = read_manifest(loc).summary()
  return summary


@dataclasses.dataclass
class _Want:
  """One array leaf to read: where it comes from and what to build."""
  item: str
  rec: Array
  dtype: np.dtype             # target dtype of the data (key data for PRNG keys)
  sharding: Any               # jax Sharding of the data, or None for host numpy
  shape: tuple[int, ...]      # shape of the data (key data for PRNG keys)
  key_impl: str | None
  boxes: dict[_layout.Box, list[Any]]  # distinct boxes to read -> devices that get them
  committed: bool = True      # False: placed uncommitted on the default device (as the target was)


def restore(path: Any, target: Mapping[str, Any] | None = None, *, partial: bool = False,
            max_host_bytes: int = 0, allow_lossy_casts: bool = False, progress: Any = None,
            casts: list | None = None, transforms: Any = None,
            read_once: bool = False) -> dict[str, Any]:
  """Restores a checkpoint of any format, resharded onto the target's shardings.

  Reads our own checkpoints, orbax-checkpoint ones (an item, a step of its
  ``CheckpointManager``) and safetensors files or directories; the format is
  detected from the files (``metadata(path).format``). A checkpoint with one
  unnamed item (safetensors, one orbax pytree item) is read by a target of one
  item, whatever its name.

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
    allow_lossy_casts: allow dtype conversions that lose information (float to
      int or bool, a wider type into a narrower one such as float32 to
      bfloat16). Without it they are reported, by key path, before any data is
      read; exact ones (int8 to float32, bfloat16 to float32) always happen.
    progress: an ``orbax_flax._progress.Progress`` updated with the bytes read.
    casts: a list that receives ``(key path, saved dtype, target dtype, exact)``
      for every conversion made.
    transforms: a list of :mod:`orbax_flax.transforms` (rename, drop, take
      from the target, stack, unstack, cast), applied in order to what the
      checkpoint holds before the target is checked.
    read_once: read each array once across its replicas, then broadcast:
      an array the target replicates over some mesh axes (data-parallel
      copies, often on other hosts) is read split over those axes as well, so
      each byte comes from storage once, and a resharding jit gathers it with
      collectives (gloo on CPU, NCCL on GPU). Saves storage bandwidth when many
      replicas read one checkpoint; costs a collective.

  Returns:
    item name -> restored pytree, with the target's structure.

  Raises:
    CheckpointNotFoundError: no committed checkpoint at ``path``.
    TreeMismatchError: target and checkpoint disagree; lists every difference.
    CheckpointCorruptedError: a chunk fails its checksum.

  Example:
    >>> import jax, numpy as np, orbax_flax as ofx, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> ofx.save(path, {"state": {"w": np.arange(4, dtype=np.float32), "b": np.zeros(2)}})
    >>> sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> target = {"state": {"w": jax.ShapeDtypeStruct((4,), np.float32, sharding=sharding)}}
    >>> ofx.restore(path, target, partial=True)["state"]["w"]
    Array([0., 1., 2., 3.], dtype=float32)
  """
  from orbax_flax import formats  # pylint: disable=g-import-not-at-top  # formats imports us
  from orbax_flax.formats import transforms as transforms_lib  # pylint: disable=g-import-not-at-top
  if read_once and target is not None:
    read_target = _read_once_target(dict(target), None if transforms else open_manifest(path)[1])
    out = restore(path, read_target, partial=partial, max_host_bytes=max_host_bytes,
                  allow_lossy_casts=allow_lossy_casts, progress=progress, casts=casts,
                  transforms=transforms)
    return _reshard_like(out, {k: target[k] for k in out})
  loc, manifest = open_manifest(path)
  if target is not None and not isinstance(target, Mapping):
    raise TypeError(f"target must be a dict of item name -> pytree (e.g. {{'state':"
                    f" abstract_state}}) or None; got {type(target).__name__}")
  if target is not None:
    manifest = formats.match_items(manifest, list(target))
  manifest = transforms_lib.apply(manifest, transforms or ())
  from_target = transforms_lib.from_target(transforms)
  if target is None:
    return _restore_all(loc, manifest, max_host_bytes=max_host_bytes, progress=progress)

  match = match_target(manifest, target, partial=partial, allow_lossy_casts=allow_lossy_casts,
                       casts=casts, from_target=from_target, source=str(loc))
  wants, whole = match.wants, match.whole
  if progress is not None:
    progress.total = sum(w.rec.nbytes for w, _, _ in wants) + sum(
        r.nbytes for i in whole for r in manifest.items[i].leaves)
    progress.phase = "reading"
  arrays = read_arrays(loc, manifest, [w for w, _, _ in wants], max_host_bytes, progress)
  out = _restore_all(loc, manifest, whole, max_host_bytes, progress) if whole else {}
  out.update(match.trees(arrays))
  return {item: out[item] for item in target if item in out}


@dataclasses.dataclass
class Match:
  """A target checked against a checkpoint's items: what to read and where it goes.

  ``results[item]`` is ``(treedef, leaves)`` with values already in place and
  ``None`` where an array of ``wants`` (``(want, item, leaf index)``) goes;
  ``whole`` lists the items the target asks for as saved (``None``).
  """
  results: dict[str, tuple[Any, list[Any]]]
  wants: list[tuple[_Want, str, int]]
  whole: list[str]
  as_python: set[tuple[str, int]] = dataclasses.field(default_factory=set)  # Python scalar targets

  def trees(self, arrays: list[Any]) -> dict[str, Any]:
    """The target's items, with ``arrays`` (one per want, in order) in place.

    A Python scalar target leaf read from a 0-d array comes back a Python scalar.
    """
    for (_, item, i), value in zip(self.wants, arrays):
      self.results[item][1][i] = value.item() if (item, i) in self.as_python else value
    return {item: jax.tree_util.tree_unflatten(treedef, leaves)
            for item, (treedef, leaves) in self.results.items()}


def match_target(manifest: Manifest, target: Mapping[str, Any], *, partial: bool = False,
                 allow_lossy_casts: bool = False, casts: list | None = None,
                 from_target: Any = (), source: str = "the checkpoint") -> Match:
  """Checks ``target`` against the saved items of ``manifest``; reads no array data.

  The one target check of every place a checkpoint lives (the persistent
  tier, the local tier): missing or extra keys, shapes, dtypes and casts
  (``allow_lossy_casts``, recorded into ``casts``), PRNG keys, shardings.

  Raises:
    TreeMismatchError: every difference, by key path.
    ValueError: a target sharding cannot hold its array.
  """
  diffs: list[str] = []
  bad_shardings: list[str] = []
  results: dict[str, tuple[Any, list[Any]]] = {}
  wants: list[tuple[_Want, str, int]] = []
  as_python: set[tuple[str, int]] = set()  # Python scalar targets read from 0-d arrays
  whole: list[str] = []
  for item, subtree in target.items():
    saved_item = manifest.items.get(item)
    if saved_item is None:
      diffs.append(f"item {item!r}: in target, not in checkpoint (it has"
                   f" {sorted(manifest.items)})")
      continue
    if subtree is None:
      whole.append(item)
      continue
    saved = saved_item.by_path()
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
        if any(t.matches(_tree.path_str(path_)) for t in from_target):
          if isinstance(leaf, (jax.Array, np.ndarray)) or _tree.leaf_kind(leaf) == "value":
            out[i] = leaf
          else:
            diffs.append(f"{where}: not in checkpoint, and FromTarget needs a concrete value in"
                         f" the target (an array), not a {type(leaf).__name__}")
          continue
        diffs.append(f"{where}: in target, not in checkpoint")
        continue
      want = _want(item, rec, leaf, where, diffs, bad_shardings, allow_lossy_casts, casts)
      if want is None:
        continue
      if isinstance(want, _Value):
        out[i] = want.value
      else:
        wants.append((want, item, i))
        if type(leaf) in (bool, int, float, complex) and want.shape == () and not want.key_impl:
          as_python.add((item, i))
    if not partial:
      for path_ in saved:
        if path_ not in seen:
          diffs.append(f"{item}/{_tree.path_str(path_)}: in checkpoint, not in target (pass"
                       " partial=True to restore a subset)")
  if diffs:
    raise errors.TreeMismatchError(
        f"restore target does not match the checkpoint at {source}:\n  " + "\n  ".join(diffs),
        diffs)
  if bad_shardings:
    raise ValueError("target shardings cannot hold these arrays (JAX needs every sharded"
                     " dimension to divide evenly); change the PartitionSpec or mesh:\n  "
                     + "\n  ".join(bad_shardings))
  return Match(results, wants, whole, as_python)


def read_once_spec(sharding: jax.sharding.NamedSharding, shape: tuple[int, ...],
                   chunk_shape: tuple[int, ...] | None = None) -> jax.sharding.PartitionSpec:
  """``sharding``'s spec with the mesh axes it replicates over across processes added where
  they divide (so that each process reads a distinct part).

  With the stored ``chunk_shape``, an axis is added only along a dimension
  where each process's part is made of whole chunks: storage is read in whole
  chunks, so any other split would read the same bytes and add a collective.

  Example:
    >>> import numpy as np
    >>> n = len(jax.devices())
    >>> mesh = jax.make_mesh((2, n // 2), ("data", "model")) if n % 2 == 0 else None
    >>> P = jax.sharding.PartitionSpec
    >>> # One process: its replicas are read once already, so nothing changes.
    >>> mesh is None or read_once_spec(jax.sharding.NamedSharding(mesh, P(None, "model")),
    ...                                (8, 4 * n)) == P(None, "model")
    True
  """
  spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  used = {a for p in spec if p is not None for a in ((p,) if isinstance(p, str) else p)}
  sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape))
  procs = np.vectorize(lambda d: d.process_index)(sharding.mesh.devices)
  for k, axis in enumerate(sharding.mesh.axis_names):
    # Replicas within one process are read once already (one read, copies to its devices):
    # only axes along which the processes change are worth a collective.
    crosses = bool((procs != np.take(procs, [0], axis=k)).any())
    if axis in used or sizes[axis] == 1 or not crosses:
      continue
    for d, n in enumerate(shape):
      parts = () if spec[d] is None else ((spec[d],) if isinstance(spec[d], str) else tuple(spec[d]))
      split = math.prod(sizes[a] for a in parts) * sizes[axis]
      whole_chunks = chunk_shape is None or (n % split == 0 and (n // split) % chunk_shape[d] == 0)
      if n % split == 0 and whole_chunks:
        spec[d] = parts + (axis,) if parts else axis
        used.add(axis)
        break
  return jax.sharding.PartitionSpec(*spec)


def _read_once_target(target: dict[str, Any], manifest: Manifest | None) -> dict[str, Any]:
  """The target to read with for ``read_once``: leaves split further where that saves bytes.

  ``manifest`` (None: unknown, e.g. under transforms) gives each array's stored
  chunk shape; a packed array (small, stored inside a shared buffer) is read
  as it is.
  """
  out = {}
  for item, tree in target.items():
    if manifest is None:
      out[item] = jax.tree.map(lambda x: _read_once_leaf(x, None), tree)
      continue
    saved_item = manifest.items.get(item)
    saved = saved_item.by_path() if saved_item is not None else {}

    def leaf_for(kp, x, saved=saved):
      rec = saved.get(tuple(_tree.key_part(k) for k in kp))
      if not isinstance(rec, Array) or rec.is_packed or not rec.chunk_shape:
        return x
      return _read_once_leaf(x, rec.chunk_shape)
    out[item] = jax.tree_util.tree_map_with_path(leaf_for, tree)
  return out


def _read_once_leaf(leaf: Any, chunk_shape: tuple[int, ...] | None) -> Any:
  sharding = getattr(leaf, "sharding", None)
  if not isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array)) or not isinstance(
      sharding, jax.sharding.NamedSharding) or _is_key_dtype(leaf.dtype):
    return leaf
  if chunk_shape is not None and len(chunk_shape) != len(leaf.shape):
    chunk_shape = None
  spec = read_once_spec(sharding, tuple(leaf.shape), chunk_shape)
  full = lambda sp: tuple(sp) + (None,) * (len(leaf.shape) - len(sp))  # noqa: E731
  if full(spec) == full(sharding.spec):  # P(None, None) is P(): nothing to split, no collective
    return leaf
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                              sharding=jax.sharding.NamedSharding(sharding.mesh, spec))


def _reshard_like(out: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
  """Arrays of ``out`` moved onto the target's shardings with one jit (collectives)."""
  flat_out, treedef = jax.tree_util.tree_flatten(out)
  flat_target = treedef.flatten_up_to(target)
  idx = [i for i, (x, t) in enumerate(zip(flat_out, flat_target))
         if isinstance(x, jax.Array) and getattr(t, "sharding", None) is not None
         and x.sharding != t.sharding]
  if idx:
    shardings = tuple(flat_target[i].sharding for i in idx)
    moved = jax.jit(lambda *xs: xs, out_shardings=shardings)(*(flat_out[i] for i in idx))
    for i, x in zip(idx, moved):
      flat_out[i] = x
  return jax.tree_util.tree_unflatten(treedef, flat_out)


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


def _want(item: str, rec: Record, leaf: Any, where: str, diffs: list[str],
          bad_shardings: list[str], allow_lossy: bool = False,
          casts: list | None = None) -> _Want | _Value | None:
  """Checks one target leaf against its record; returns what to read."""
  saved_kind = rec.kind
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
      return _Value(rec.decoded())
    sharding, shape, dtype = None, rec.user_shape, None
  else:
    raise TypeError(f"target leaf {where} is a {type(leaf).__name__}; use a"
                    " jax.ShapeDtypeStruct with a sharding, a jax.Array, a numpy array or a"
                    " scalar.")

  if saved_kind == "value":
    value = rec.decoded()
    if shape == () and isinstance(value, (bool, int, float, complex, np.generic)) and not _is_key_dtype(dtype):
      if dtype is not None:
        source = np.asarray(value).dtype
        if not _cast_ok(source, np.dtype(dtype), where, allow_lossy, diffs, casts):
          return None
      array = np.asarray(value, dtype=dtype)
      if sharding is None:
        return _Value(array)
      if targets.is_uncommitted(leaf):
        return _Value(jax.device_put(array))
      return _Value(jax.make_array_from_callback((), sharding, lambda _: array))
    diffs.append(f"{where}: checkpoint holds a {type(value).__name__}, target wants an array"
                 f" of shape {shape}")
    return None

  saved_key = rec.key_impl
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
  saved_shape = rec.user_shape
  if tuple(shape) != saved_shape:
    diffs.append(f"{where}: shape {saved_shape} in checkpoint, {tuple(shape)} in target")
    return None
  data_shape = rec.shape
  data_dtype = np.dtype(rec.dtype) if (dtype is None or saved_key) else np.dtype(dtype)
  if not saved_key and not _cast_ok(rec.np_dtype, data_dtype, where, allow_lossy, diffs, casts):
    return None
  if sharding is not None:
    try:
      sharding.shard_shape(tuple(shape))
    except ValueError as e:
      bad_shardings.append(f"{where} (shape {tuple(shape)}): {e}")
      return None
    if saved_key:
      sharding = _key_data_sharding(sharding, where)
  boxes = {tuple((0, s) for s in data_shape): []} if sharding is None else _boxes(sharding, data_shape)
  committed = not (isinstance(sharding, jax.sharding.SingleDeviceSharding)
                   and targets.is_uncommitted(leaf))
  return _Want(item, rec, data_dtype, sharding, data_shape, saved_key, boxes, committed)


def lossless(saved: np.dtype, target: np.dtype) -> bool:
  """True if every value of ``saved`` converts to ``target`` exactly.

  numpy's "safe" casting, which knows the ml_dtypes types: int8 -> float32 or
  bfloat16 -> float32 are exact; float -> int, float32 -> bfloat16 or
  int64 -> float32 are not.

  Example:
    >>> import ml_dtypes
    >>> lossless(np.dtype("int8"), np.dtype("float32")), lossless(np.dtype("float32"), np.dtype("int8"))
    (True, False)
    >>> lossless(np.dtype("float32"), np.dtype(ml_dtypes.bfloat16))
    False
  """
  if saved == target:
    return True
  try:
    return bool(np.can_cast(saved, target, casting="safe"))
  except TypeError:
    return False


def _cast_ok(saved: np.dtype, target: np.dtype, where: str, allow_lossy: bool, diffs: list[str],
             casts: list | None) -> bool:
  """Records a dtype change; refuses (into ``diffs``) one that loses information unless allowed."""
  if saved == target:
    return True
  exact = lossless(saved, target)
  if not exact and not allow_lossy:
    diffs.append(f"{where}: {saved} in checkpoint, {target} in target: converting loses"
                 f" information; pass allow_lossy_casts=True (checkpoint.allow_lossy_casts for"
                 f" a resume) to convert anyway, rounding or truncating, or restore as {saved}"
                 " and cast yourself")
    return False
  if casts is not None:
    casts.append((where, str(saved), str(target), exact))
  return True


@functools.lru_cache(maxsize=1024)
def _boxes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[_layout.Box, list[Any]]:
  """The distinct boxes this process's devices hold, and which devices hold each."""
  boxes: dict[_layout.Box, list[Any]] = {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    boxes.setdefault(_layout.slices_to_box(index, shape), []).append(device)
  return boxes


def _restore_all(loc: Location, manifest: Manifest, items: list[str] | None = None,
                 max_host_bytes: int = 0, progress: Any = None) -> dict[str, Any]:
  """Items (default: all) as host numpy arrays, in the saved structure."""
  wants, slots = [], []
  values: dict[str, list[Any]] = {}
  chosen = {k: v for k, v in manifest.items.items() if items is None or k in items}
  for item, saved_item in chosen.items():
    leaves = saved_item.leaves
    values[item] = [None] * len(leaves)
    for i, rec in enumerate(leaves):
      if not isinstance(rec, Array):
        values[item][i] = rec.decoded()
        continue
      shape = rec.shape
      wants.append(_Want(item, rec, rec.np_dtype, None, shape, rec.key_impl,
                         {tuple((0, s) for s in shape): []}))
      slots.append((item, i))
  if progress is not None and not progress.total:
    progress.total, progress.phase = sum(w.rec.nbytes for w in wants), "reading"
  for (item, i), value in zip(slots, read_arrays(loc, manifest, wants, max_host_bytes, progress)):
    values[item][i] = value
  return {item: _tree.decode_structure(saved_item.structure, values[item])
          for item, saved_item in chosen.items()}


def _windows(wants: list[_Want], budget: int) -> list[list[int]]:
  """Indices of ``wants`` in rounds of at most ``budget`` bytes of host data (0: one round)."""
  if not budget:
    return [list(range(len(wants)))]
  return _layout.split_by_size(
      [sum(math.prod(_layout.box_shape(b)) for b in w.boxes) * np.dtype(w.dtype).itemsize
       for w in wants], budget)


def _box_buffers(want: _Want, dtype: np.dtype) -> list[np.ndarray]:
  """The array's boxes, 64-byte aligned in one mapping of its own.

  JAX's CPU client adopts aligned buffers without a copy, and each restored
  array frees its memory on its own.
  """
  return _staging.fresh_arrays([(_layout.box_shape(b), dtype) for b in want.boxes])


def read_arrays(loc: Location, manifest: Manifest, wants: list[_Want],
                max_host_bytes: int = 0, progress: Any = None) -> list[Any]:
  """Reads the wanted arrays into fresh buffers, then builds host or device arrays.

  Every box is read straight into the memory that becomes the result (one
  mapping per array, so that each array frees its memory on its own), small
  packed arrays included. With a budget, arrays are read and placed in rounds.
  """
  from orbax_flax.formats import _read  # pylint: disable=g-import-not-at-top  # formats imports us
  reader = reader_for(loc, manifest, max_host_bytes, progress)
  out: list[Any] = [None] * len(wants)
  for window in _windows(wants, max_host_bytes):
    fills, packed, requests = [], [], []
    datas: dict[int, list[np.ndarray]] = {}
    for i in window:
      w = wants[i]
      rec = w.rec
      saved = rec.np_dtype
      if _read.needs_generic(rec):
        # A foreign format's array, or one a transform made: read box by box.
        bufs = _box_buffers(w, saved)
        requests += [(w.item, rec, b, buf) for b, buf in zip(w.boxes, bufs)]
        datas[id(w)] = bufs
      elif rec.is_packed:
        # A small array: each box it is needed in gets a buffer of its own.
        bufs = _box_buffers(w, saved)
        lo = rec.packed_offset
        dests = [(_layout.box_to_slices(b), buf) for b, buf in zip(w.boxes, bufs)]
        packed.append(_reading.PackedFill(w.item, rec.owners[0], lo, lo + rec.nbytes,
                                          saved, w.shape, dests, rec.path_text))
        datas[id(w)] = bufs
      elif not rec.owners:
        datas[id(w)] = [np.zeros(_layout.box_shape(b), saved) for b in w.boxes]
      else:
        bufs = _box_buffers(w, rec.np_stored_dtype)
        fills += [_reading.Fill(w.item, rec, b, buf) for b, buf in zip(w.boxes, bufs)]
        datas[id(w)] = [buf if buf.dtype == saved else buf.view(saved) for buf in bufs]
    if fills or packed:
      reader.read(fills, packed)
    if requests:
      _read.read_requests(reader, requests)
      if progress is not None:
        progress.add(sum(buf.nbytes for _, _, _, buf in requests))
    for i in window:
      w = wants[i]
      datas[id(w)] = [b if b.dtype == w.dtype else b.astype(w.dtype) for b in datas[id(w)]]
    for i, value in zip(window, assemble([wants[i] for i in window], datas)):
      out[i] = value
  return out


def assemble(wants: list[_Want], datas: dict[int, list[np.ndarray]]) -> list[Any]:
  """Host arrays as they are; device arrays placed with one batched device_put.

  The placement of every tier (the local tier's too), PRNG keys wrapped back.

  ``datas`` holds, per want, one array per box of ``want.boxes``. An
  uncommitted want (its target was an uncommitted single-device array) is put
  on the default device without committing it, so that a jitted step may use
  it beside arrays on any mesh, as it could before the save.
  """
  out: list[Any] = [None] * len(wants)
  sharded: list[tuple[int, int]] = []  # (want index, number of shards)
  values, devices_, alias = [], [], []
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
          devices_.append(device if w.committed else None)
          alias.append(j == 0)
          n += 1
      sharded.append((i, n))
  placed = jax.device_put(values, devices_, may_alias=alias) if values else []
  k = 0
  for i, n in sharded:
    w = wants[i]
    out[i] = (jax.make_array_from_single_device_arrays(w.shape, w.sharding, placed[k:k + n])
              if w.committed else placed[k])
    k += n
  for i, w in enumerate(wants):
    if w.key_impl:
      out[i] = jax.random.wrap_key_data(out[i], impl=w.key_impl)
  return out
