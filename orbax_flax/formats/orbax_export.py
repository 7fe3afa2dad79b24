"""Writing orbax-checkpoint (0.12.x) checkpoints from a live, possibly sharded, multi-process tree.

:func:`export_orbax` writes the layout orbax-checkpoint's ``StandardCheckpointer``
and ``CheckpointManager`` restore (read by :mod:`.orbax_checkpoint` too), without
importing orbax-checkpoint and without gathering the tree:

* ``_METADATA``: each leaf's key path (``key_metadata``: dict keys and
  attribute names are type 2, sequence indices type 1) and ``value_type``
  (``jax.Array``, ``np.ndarray``, ``scalar``, or ``None`` for an empty node),
  with ``use_ocdbt: false`` and ``use_zarr3: true``.
* one zarr3 array per array or numeric scalar leaf, in a directory named by
  its keys joined with ``.``: chunks of at most about 64 MiB, each inside one of
  the array's shards (a numpy array or scalar is one shard; along a dimension
  every shard holds whole the last chunk may be partial), zstd-compressed, each
  with a CRC-32C (zarr3's ``crc32c`` codec). Every process writes the chunks of
  the shards it owns (``replica_id`` 0); process 0 writes the metadata.
* ``_sharding``: each ``jax.Array``'s sharding (mesh shape, axis names and
  types, partition spec, device ids) as orbax records it, so a restore without
  a target places arrays as they were (a restore with a target ignores it).
* ``_CHECKPOINT_METADATA`` naming the ``StandardCheckpointHandler``, and
  ``commit_success.txt``.

A string leaf is refused: the ``StandardCheckpointHandler`` that orbax's
``StandardCheckpointer`` and ``StandardRestore`` use can neither save nor restore one
(orbax-checkpoint 0.12.8: "Unsupported type: <class 'str'>"): an item holding one would
restore with no target, neither one naming the string nor one leaving it out.

With ``step`` the directory is a ``CheckpointManager`` run: the item sits in
``<path>/<step>/<item>`` beside the step's ``_CHECKPOINT_METADATA``. The
directory is written under a temporary name and renamed into place by process
0, as our checkpoints are committed.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from orbax_flax.core import _multihost
from orbax_flax.engine import _selecting
from orbax_flax.core import _tree
from orbax_flax.core._location import Location
from orbax_flax.formats import _checks
from orbax_flax.formats import orbax_checkpoint
from orbax_flax.formats import safetensors_export

_HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
_TMP = ".ofx-tmp-export"
_SEQUENCE, _DICT = 1, 2  # orbax's KeyType


def _keys(path: Any) -> list[dict[str, Any]]:
  return [{"key": _tree.key_part(k), "key_type": _SEQUENCE
           if isinstance(k, jax.tree_util.SequenceKey) else _DICT} for k in path]


def _is_empty(x: Any) -> bool:
  """An empty node: a node with no children of its own (None, optax.EmptyState(), {}, [],
  ``()``). orbax records each as a leaf (:func:`_empty_type`), also inside a subtree that
  holds no leaves: optax.sgd's state ``(EmptyState(), EmptyState())`` is two empty nodes.

  Example:
    >>> import optax
    >>> _is_empty(()), _is_empty(optax.EmptyState()), _is_empty((optax.EmptyState(),) * 2)
    (True, True, False)
  """
  children = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)[0]
  return not children


def _empty_type(x: Any) -> str:
  """The value type orbax-checkpoint 0.12 records for an empty node: ``List`` for ``[]``,
  ``Tuple`` for ``()``, ``Dict`` for ``{}`` (any mapping), ``None`` for the others (None, an
  empty namedtuple such as optax.EmptyState(), a dataclass node without fields).

  Example:
    >>> import optax
    >>> [_empty_type(x) for x in ([], (), {}, None, optax.EmptyState())]
    ['List', 'Tuple', 'Dict', 'None', 'None']
  """
  if isinstance(x, list):
    return "List"
  if isinstance(x, tuple):  # a namedtuple is "None" (orbax's default, without rich types)
    return "None" if hasattr(type(x), "_fields") else "Tuple"
  return "Dict" if isinstance(x, Mapping) else "None"


def _zarr3_lacks(where: str, dtype: Any) -> str | None:
  """Why ``dtype`` cannot be a zarr3 array (orbax-checkpoint's), for the leaf at ``where``;
  None when it can. Asks tensorstore's zarr3 driver, which parses a spec without I/O.

  Example:
    >>> import ml_dtypes, numpy as np
    >>> _zarr3_lacks("params/w", np.float32) is None
    True
    >>> _zarr3_lacks("params/q", ml_dtypes.uint4)[:51]
    'params/q: dtype uint4 cannot be stored in a zarr3 a'
  """
  dtype = np.dtype(dtype)
  try:
    ts.Spec({"driver": "zarr3", "kvstore": {"driver": "memory"},
             "metadata": {"data_type": dtype.name}})
    return None
  except ValueError:
    wider = ("uint8" if jax.numpy.issubdtype(dtype, jax.numpy.unsignedinteger) else
             "int8" if jax.numpy.issubdtype(dtype, jax.numpy.integer) else "bfloat16")
    return (f"{where}: dtype {dtype.name} cannot be stored in a zarr3 array (orbax-checkpoint's"
            f" format); cast it to one that holds its values (e.g. x.astype(jnp.{wider})), or"
            f" leave it out with select= (convert: SRC:<selector>) naming the other parts")


def _leaf_plan(tree: Any) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
  """``(tree_metadata, arrays (name, value))`` of ``tree``; ValueError for a leaf
  orbax-checkpoint's ``StandardCheckpointer`` cannot save and restore, naming every one."""
  meta: dict[str, Any] = {}
  arrays: list[tuple[str, Any]] = []
  problems: list[str] = []
  seen: dict[str, str] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_empty)[0]:
    parts = tuple(_tree.key_part(k) for k in path)
    where, name = _tree.path_str(parts), ".".join(parts)
    if not parts:
      problems.append("<root>: the tree is a single leaf; give a dict, e.g. {'params': params}")
      continue
    if name in seen:
      problems.append(f"{where}: stored as {name!r}, as {seen[name]} is")
      continue
    seen[name] = where
    info: dict[str, Any] = {"skip_deserialize": False}
    if _is_empty(leaf):
      info = {"value_type": _empty_type(leaf), "skip_deserialize": True}
    elif safetensors_export.is_lazy(leaf):
      if lacks := _zarr3_lacks(where, leaf.dtype):
        problems.append(lacks)
        continue
      info["value_type"] = "np.ndarray"
      arrays.append((name, leaf))
    elif isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      problems.append(f"{where}: a PRNG key array; export jax.random.key_data(key) instead")
      continue
    elif isinstance(leaf, (jax.Array, np.ndarray)):
      if not _tree.is_supported_dtype(np.dtype(leaf.dtype)):
        problems.append(f"{where}: dtype {leaf.dtype} is not a number type")
        continue
      if lacks := _zarr3_lacks(where, leaf.dtype):
        problems.append(lacks)
        continue
      info["value_type"] = "jax.Array" if isinstance(leaf, jax.Array) else "np.ndarray"
      if isinstance(leaf, jax.Array):  # what orbax records: the shape each shard writes
        info["write_shape"] = [int(d) for d in leaf.sharding.shard_shape(leaf.shape)]
      arrays.append((name, leaf))
    elif isinstance(leaf, str):
      problems.append(
          f"{where}: a string ({_checks.short(leaf)}), which orbax-checkpoint's"
          " StandardCheckpointer can neither save nor restore; leave it out with select="
          " (convert: SRC:<selector>) naming the other parts")
      continue
    elif isinstance(leaf, np.generic) and _tree.is_supported_dtype(leaf.dtype):
      if lacks := _zarr3_lacks(where, leaf.dtype):
        problems.append(lacks)
        continue
      info["value_type"] = "np.ndarray"  # as orbax stores a numpy scalar: 0-d, its dtype kept
      arrays.append((name, np.asarray(leaf)))
    elif isinstance(leaf, (bool, int, float)):
      value = np.asarray(leaf)  # an int outside int64 and uint64 is an object array
      if value.dtype == object:
        problems.append(
            f"{where}: the int {_checks.short(leaf)} does not fit in 64 bits (int64 or uint64),"
            " the widest integer orbax-checkpoint stores; keep it as a float"
            " (float(x), if an approximation will do) or as several 64-bit ints, or leave it"
            " out with select= (convert: SRC:<selector>) naming the other parts")
        continue
      info["value_type"] = "scalar"
      arrays.append((name, value))
    else:
      problems.append(f"{where}: a {type(leaf).__name__} is not an array or number")
      continue
    meta[str(parts)] = {"key_metadata": _keys(path), "value_metadata": info}
  if problems:
    raise ValueError("cannot export these leaves as an orbax-checkpoint:\n  "
                     + "\n  ".join(problems))
  return meta, arrays


def _chunk_shape(value: Any, max_bytes: int = 64 << 20) -> tuple[int, ...]:
  """A chunk of at most about ``max_bytes`` that lies inside one shard wherever it is on
  the chunk grid, so each chunk has one writer. Dimensions are cut leading ones first:
  one every shard holds whole (every dimension of a numpy array) as long as the size allows,
  its last chunk partial (zarr3 clips it to the array; it is inside every shard too); one the
  shards split at a divisor of the shard's length (chunks tile each shard), unless keeping
  it whole and cutting the dimensions after it gives chunks at least twice as large (a
  prime shard length has no divisor but 1 and itself: one-row chunks, thousands of files).

  Example:
    >>> import numpy as np
    >>> _chunk_shape(np.zeros((3, 4), np.float32)), _chunk_shape(np.zeros((), np.int32))
    ((3, 4), ())
    >>> _chunk_shape(np.zeros((1024, 1024, 64), np.float32))
    (256, 1024, 64)
    >>> _chunk_shape(np.zeros((1009, 16), np.float32), max_bytes=4096)  # 1009 is prime
    (64, 16)
  """
  shape = tuple(int(s) for s in value.shape)
  split = [False] * len(shape)
  if isinstance(value, jax.Array) and shape:
    shard = tuple(int(s) for s in value.sharding.shard_shape(shape))
    split = [s != n for s, n in zip(shard, shape)]
    shape = shard
  return tuple(_cut([max(s, 1) for s in shape], split, 0, np.dtype(value.dtype).itemsize,
                    max_bytes))


def _cut(chunk: list[int], split: list[bool], d: int, itemsize: int,
         max_bytes: int) -> list[int]:
  """:func:`_chunk_shape`'s cut of ``chunk`` from dimension ``d`` on."""
  chunk = list(chunk)
  for d in range(d, len(chunk)):
    size = chunk[d]
    rest = itemsize * int(np.prod(chunk[:d] + chunk[d + 1:], dtype=np.int64))
    if rest * size <= max_bytes:
      break
    if not split[d]:
      chunk[d] = max(max_bytes // rest, 1)
      continue
    divisor = max((k for k in range(1, size + 1) if size % k == 0 and rest * k <= max_bytes),
                  default=1)
    cut = _cut(chunk[:d] + [divisor] + chunk[d + 1:], split, d + 1, itemsize, max_bytes)
    whole = _cut(chunk, split, d + 1, itemsize, max_bytes) if d + 1 < len(chunk) else chunk
    nbytes = lambda c: itemsize * int(np.prod(c, dtype=np.int64))
    if max_bytes >= nbytes(whole) >= 2 * nbytes(cut):  # (leading dimensions cut first, else)
      return whole
    return cut
  return chunk


def _spec(directory: str, name: str, value: Any, max_chunk_bytes: int) -> dict[str, Any]:
  shape = [int(s) for s in value.shape]
  return {
      "driver": "zarr3",
      "kvstore": {"driver": "file", "path": os.path.join(directory, name)},
      "metadata": {
          "shape": shape,
          "data_type": np.dtype(value.dtype).name,
          "chunk_grid": {"name": "regular",
                         "configuration": {"chunk_shape": list(_chunk_shape(
                             value, max_chunk_bytes))}},
          # A CRC-32C of each compressed chunk (zarr3's crc32c codec): orbax-checkpoint
          # writes none, but it and every tensorstore reader check it, so a damaged
          # chunk fails to read instead of decoding into other values.
          "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                     {"name": "zstd", "configuration": {"level": 3, "checksum": False}},
                     {"name": "crc32c"}],
      },
      "store_data_equal_to_fill_value": True,
  }


def _sharding_entry(value: Any) -> str | None:
  """orbax's ``_sharding`` record of an array's sharding (what a restore without a target
  places it on), or None where orbax has no record for it."""
  sharding = getattr(value, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    mesh = sharding.mesh
    return json.dumps({
        "sharding_type": "NamedSharding", "shape": [int(s) for s in mesh.devices.shape],
        "axis_names": list(mesh.axis_names),
        "axis_types": [f"AxisType.{t.name}" for t in mesh.axis_types],
        "partition_spec": [list(p) if isinstance(p, tuple) else p for p in sharding.spec],
        "device_mesh": {"mesh": np.vectorize(lambda d: {"id": int(d.id)}, otypes=[object])(
            mesh.devices).tolist()}})
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    (device,) = sharding.device_set
    return json.dumps({"sharding_type": "SingleDeviceSharding",
                       "device_str": f"{device.platform}:{device.id}"})
  return None


def _is_orbax_export(path: str) -> bool:
  """Whether the directory ``path`` is an orbax-checkpoint item or step (``_METADATA`` or
  ``_CHECKPOINT_METADATA``), what :func:`export_orbax` writes; a run directory of steps
  is not one."""
  return orbax_checkpoint.detect(Location.parse(path))


def _write_json(path: str, value: Any) -> None:
  with open(path, "w", encoding="utf-8") as fh:
    json.dump(value, fh)
    fh.flush()
    os.fsync(fh.fileno())


def _step_metadata(handlers: Any) -> dict[str, Any]:
  now = time.time_ns()
  return {"item_handlers": handlers, "metrics": {}, "performance_metrics": {},
          "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now, "custom_metadata": {}}


def export_orbax(path: str, tree: Any, *, step: int | None = None, item: str = "default",
                 overwrite: bool = False,
                 coordination_timeout_seconds: float = _multihost.DEFAULT_TIMEOUT_S,
                 select: str | None = None, max_chunk_bytes: int = 64 << 20) -> str:
  """Writes ``tree`` as an orbax-checkpoint checkpoint, each process its own shards.

  ``orbax.checkpoint.StandardCheckpointer().restore(path, target)`` restores it
  (``step=None``), or ``CheckpointManager(path).restore(step,
  args=StandardRestore(target))`` (with ``step``), onto any mesh the target
  names. Every process of a multi-process job calls it with its part of the
  same tree; nothing is gathered on one host. The layout is in
  ``docs/interop.md``.

  Args:
    path: the item directory to create (``step=None``), or the run directory
      of a ``CheckpointManager`` to add ``step`` to (local; shared by all
      processes).
    tree: a pytree of ``jax.Array``, numpy arrays and numbers (not a single
      leaf; no strings, which ``StandardCheckpointer`` cannot restore); a Linen
      box is kept as orbax keeps it (``.../value``).
    step: write ``<path>/<step>/<item>``, a step of a ``CheckpointManager``.
    item: the item's name in the step (``default`` is what a
      ``CheckpointManager`` without item names restores).
    overwrite: replace what is there (only after the new one is complete): an
      empty directory, an orbax_flax checkpoint, or an orbax-checkpoint item or
      step; anything else there (a run directory, someone's files) is refused.
    coordination_timeout_seconds: how long a process waits for the others.
    select: write only a part of ``tree``, named as ``init_from`` names it:
      ``"params"``, several joined by ``,`` (``"params,batch_stats"``); a
      TrainState's fields are its keys.
    max_chunk_bytes: the most bytes per zarr chunk (each chunk lies inside one
      shard; a reader decodes one chunk at a time).

  Returns:
    The directory written (the item's, or the step's).

  Raises:
    ValueError: a leaf orbax cannot hold (PRNG keys: export their key data; a
      dtype zarr3 lacks, such as uint4, uint2 or float8_e4m3: cast it or leave it
      out with ``select``; a string: leave it out with ``select``; a Python int
      outside int64 and uint64), two leaves
      with one stored name, the directory exists without ``overwrite``, or it holds something an export may not replace even with
      ``overwrite`` (:func:`orbax_flax.formats.safetensors_export.check_destination`);
      raised before anything is written.
    CheckpointCorruptedError: a source array failed its checksum while it was
      read (the export stops; nothing is committed, ``dst`` stays as it was).
    StorageError: writing failed on some process (e.g. the disk is full);
      nothing is committed.

  Example:
    >>> import numpy as np, orbax_flax as ofx, tempfile, os, json
    >>> d = os.path.join(tempfile.mkdtemp(), "exported")
    >>> _ = ofx.export_orbax(d, {"params": {"w": np.ones((2, 3), np.float32)}, "step": 7})
    >>> sorted(json.load(open(os.path.join(d, "_METADATA")))["tree_metadata"])
    ["('params', 'w')", "('step',)"]
  """
  path = _checks.local_directory(path, "export_orbax")
  if select:
    tree = _selecting.pick(tree, select)
  if max_chunk_bytes <= 0:
    raise ValueError(f"max_chunk_bytes={max_chunk_bytes}; give a positive size such as 64 << 20")
  meta, arrays = _leaf_plan(tree)
  if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
    raise ValueError(f"step={step!r}; give a step number >= 0, or None for a lone item")
  if not item or "/" in item or item in (".", ".."):
    raise ValueError(f"item={item!r}; give a plain directory name such as 'default'")
  final = path if step is None else os.path.join(path, str(step))
  safetensors_export.check_destination(final, overwrite, "orbax-checkpoint", _is_orbax_export)
  tmp = final + _TMP
  item_dir = tmp if step is None else os.path.join(tmp, item)
  key = _multihost.namespace("export-orbax", final, coordination_timeout_seconds)
  me = _multihost.process_index()

  def agree(stage: str, error: str) -> None:
    safetensors_export.agree_on_stage(key, final, stage, error, coordination_timeout_seconds,
                                      tmp)

  context = ts.Context()
  error = ""
  if me == 0:  # the layout: every array's metadata, then every process writes its chunks
    futures = []
    try:
      specs = [ts.Spec(_spec(item_dir, n, v, max_chunk_bytes)) for n, v in arrays]
      shutil.rmtree(tmp, ignore_errors=True)
      os.makedirs(item_dir)
      for spec in specs:
        futures.append(ts.open(spec, create=True, context=context))
    except (OSError, ValueError) as e:
      error = f"{type(e).__name__}: {e}"
    # Every create started finishes before a failure removes tmp (agree): one still in
    # flight would write its zarr.json into a new tmp, left behind.
    for f in futures:
      try:
        f.result()
      except (OSError, ValueError) as e:
        error = error or f"{type(e).__name__}: {e}"
  agree("layout", error)
  error = ""
  try:
    for name, value in arrays:
      store = None
      chunk = _chunk_shape(value, max_chunk_bytes)
      for box, data in safetensors_export.owned_boxes(value, me, chunk[0] if chunk else 1):
        if store is None:
          store = ts.open(_spec(item_dir, name, value, max_chunk_bytes), open=True,
                          context=context).result()
        view = store[tuple(slice(lo, hi) for lo, hi in box)] if box else store
        view.write(np.asarray(data)).result()
        del data  # one part in memory at a time
  except (OSError, ValueError) as e:
    error = f"{type(e).__name__}: {e}"
  agree("write", error)
  error = ""
  if me == 0:
    try:
      _write_json(os.path.join(item_dir, "_METADATA"), {
          "tree_metadata": meta, "use_ocdbt": False, "use_zarr3": True,
          "store_array_data_equal_to_fill_value": True, "custom_metadata": None})
      shardings = {base64.b64encode(n.encode()).decode(): e for n, v in arrays
                   if (e := _sharding_entry(v)) is not None}
      if shardings:
        _write_json(os.path.join(item_dir, "_sharding"), shardings)
      if step is None:
        _write_json(os.path.join(tmp, "_CHECKPOINT_METADATA"), _step_metadata(_HANDLER))
      else:
        _write_json(os.path.join(tmp, "_CHECKPOINT_METADATA"), _step_metadata({item: _HANDLER}))
        _write_json(os.path.join(item_dir, "_CHECKPOINT_METADATA"), _step_metadata(_HANDLER))
        with open(os.path.join(item_dir, "commit_success.txt"), "w", encoding="utf-8") as fh:
          fh.write("Checkpoint commit was successful.")
      with open(os.path.join(tmp, "commit_success.txt"), "w", encoding="utf-8") as fh:
        fh.write("Checkpoint commit was successful.")
      os.makedirs(os.path.dirname(final), exist_ok=True)
      safetensors_export.commit_dir(tmp, final)
    except OSError as e:
      error = f"{type(e).__name__}: {e}"
  agree("commit", error)
  return final
