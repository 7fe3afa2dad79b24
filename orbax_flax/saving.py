"""Saving a checkpoint: ``save`` (blocking) and ``save_async`` (two-phase).

A save runs in two phases.

1. Blocking, in the caller's thread: validate the items, plan which chunks
   this process writes (every process computes the same plan from the
   shardings), and, for ``save_async``, copy those chunks to host memory. After
   this the caller may donate or overwrite its arrays.
2. Background: write this process's chunks into its own OCDBT database with
   tensorstore, fsync, then commit. With several processes the commit is
   agreed through the coordination service: process 0 writes the manifest only
   after every process reported success, then publishes the verdict.

Commit is atomic. On a local file system the checkpoint is written to a
sibling ``<name>.ofx-tmp-<generation>`` directory that is renamed into place
(an overwrite swaps the two directories atomically with ``renameat2``). On an
object store the manifest ``_CHECKPOINT`` is written last; data of other
generations under the prefix is garbage, recognisable because the manifest
does not name it.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import json
import math
import os
import re
import shutil
import threading
import time
import uuid
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
_ITEM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclasses.dataclass
class _Piece:
  """One chunk this process writes: where it goes and its host data."""
  slices: tuple[slice, ...]
  data: np.ndarray


@dataclasses.dataclass
class _ArrayPlan:
  item: str
  name: str
  shape: tuple[int, ...]
  dtype: str
  chunk_shape: tuple[int, ...]
  pieces: list[_Piece]


@dataclasses.dataclass
class _Plan:
  loc: Location
  manifest: dict[str, Any]   # without "generation", filled at commit
  arrays: list[_ArrayPlan]   # the chunks this process writes
  overwrite: bool
  seq: int

  @property
  def nbytes(self) -> int:
    return sum(p.data.nbytes for a in self.arrays for p in a.pieces)


class AsyncSave:
  """A save whose background phase may still be running.

  ``wait()`` blocks until the checkpoint is committed on every process and
  re-raises any error of the background phase. An error that nobody waited
  for is raised by the next ``save``/``save_async`` call instead: it is never
  lost.

  Attributes:
    path: where the checkpoint is written.
    blocking_s: seconds the caller was blocked (planning and host copy).
    total_s: seconds from the call to the commit, once done; else None.
    nbytes: bytes of array data this process writes.
  """

  def __init__(self, plan: _Plan, blocking_s: float, start: float):
    self.path = str(plan.loc)
    self.blocking_s = blocking_s
    self.total_s: float | None = None
    self.nbytes = plan.nbytes
    self._loc = plan.loc
    self._plan: _Plan | None = plan
    self._start = start
    self._error: BaseException | None = None
    self._reported = False
    self._thread: threading.Thread | None = None

  def _run(self) -> None:
    try:
      _write_and_commit(self._plan)
    except BaseException as e:  # pylint: disable=broad-except  # Re-raised in wait().
      self._error = e
    finally:
      self._plan = None  # Frees the host copy.
      _release_memory()
      self.total_s = time.perf_counter() - self._start

  def _start_background(self) -> None:
    self._thread = threading.Thread(target=self._run, name=f"orbax_flax-save-{self.path}")
    self._thread.start()

  def done(self) -> bool:
    """True once the background phase finished (committed or failed)."""
    return self._thread is None or not self._thread.is_alive()

  def wait(self, timeout: float | None = None) -> None:
    """Blocks until committed; re-raises a background error.

    Raises:
      TimeoutError: if ``timeout`` seconds pass first.
    """
    if self._thread is not None:
      self._thread.join(timeout)
      if self._thread.is_alive():
        raise TimeoutError(f"save to {self.path} still running after {timeout} s")
    if self._error is not None:
      self._reported = True
      raise self._error

  def __repr__(self) -> str:
    state = "running" if not self.done() else ("failed" if self._error else "committed")
    return f"AsyncSave({self.path!r}, {state})"


_inflight: AsyncSave | None = None
_seq = 0
_copy_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _finish_inflight() -> None:
  """Waits for the previous save; raises its error if nobody has seen it."""
  global _inflight
  prev, _inflight = _inflight, None
  if prev is None:
    return
  if prev._thread is not None:
    prev._thread.join()
  if prev._error is not None and not prev._reported:
    prev._reported = True
    prev._error.add_note(f"(raised by the earlier save_async to {prev.path}, which nobody"
                         " waited for)")
    raise prev._error


def wait_for_inflight_save(loc: Location | None = None) -> None:
  """Blocks until a running save (to ``loc``, if given) is done. No raise."""
  prev = _inflight
  if prev is not None and (loc is None or prev._loc == loc) and prev._thread is not None:
    prev._thread.join()


def save(path: Any, items: Mapping[str, Any], *, overwrite: bool = False,
         custom_metadata: Mapping[str, Any] | None = None) -> None:
  """Saves ``items`` as one checkpoint and returns once it is committed.

  Args:
    path: a local directory path, a URL (``s3://bucket/prefix``,
      ``gs://bucket/prefix``) or a tensorstore kvstore spec dict.
    items: item name -> pytree. Each item is stored separately and can be
      restored alone. Leaves: ``jax.Array`` (any sharding, typed PRNG keys
      included), numpy arrays, Python/numpy scalars, str, bytes, None.
    overwrite: replace an existing committed checkpoint at ``path``. The old
      one stays valid until the new one commits.
    custom_metadata: JSON-serialisable dict stored with the checkpoint and
      returned by :func:`orbax_flax.metadata`.

  Raises:
    CheckpointExistsError: a committed checkpoint exists and not overwrite.
    UnsupportedLeafError: a leaf cannot be saved (names its key path).

  Example:
    >>> import numpy as np, orbax_flax as ofx, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> ofx.save(path, {"state": {"w": np.ones(3)}, "extra": {"epoch": 3}})
    >>> ofx.restore(path)["extra"]
    {'epoch': 3}
  """
  save_async(path, items, overwrite=overwrite, custom_metadata=custom_metadata,
             _copy=False).wait()


def save_async(path: Any, items: Mapping[str, Any], *, overwrite: bool = False,
               custom_metadata: Mapping[str, Any] | None = None,
               _copy: bool = True) -> AsyncSave:
  """Starts a save and returns once the state is copied to host memory.

  Arguments are those of :func:`save`. The caller may then donate or change
  its arrays. Only one save runs at a time per process: this call first waits
  for the previous one, and raises its error if nobody called ``wait()``.

  Returns:
    An :class:`AsyncSave`; ``wait()`` blocks until committed.

  Example:
    >>> import numpy as np, orbax_flax as ofx, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> handle = ofx.save_async(path, {"state": {"w": np.ones(3)}})
    >>> handle.wait()
    >>> float(ofx.restore(path)["state"]["w"].sum())
    3.0
  """
  global _inflight, _seq
  _finish_inflight()
  start = time.perf_counter()
  _seq += 1
  plan = _plan(Location.parse(path), items, overwrite, custom_metadata, _seq)
  if _copy:
    _snapshot(plan)
  handle = AsyncSave(plan, time.perf_counter() - start, start)
  if _copy:
    handle._start_background()
    _inflight = handle
  else:
    handle._run()
  return handle


# ----------------------------------------------------------------------------
# Phase 1: validation and planning (every process computes the same plan).


def _check_items(items: Any) -> None:
  if not isinstance(items, Mapping) or not items:
    raise TypeError(f"items must be a non-empty dict mapping item names to pytrees, e.g."
                    f" {{'state': state, 'extra': {{'epoch': 3}}}}; got {type(items).__name__}")
  for name in items:
    if not isinstance(name, str) or not _ITEM_NAME.match(name):
      raise ValueError(f"invalid item name {name!r}: use letters, digits, '_', '.', '-',"
                       " starting with a letter or digit (e.g. 'state').")


def _check_destination(loc: Location, overwrite: bool) -> None:
  if loc.is_local:
    p = loc.local_path
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
    if TMP_MARKER in loc.name:
      raise ValueError(f"{p}: names containing {TMP_MARKER!r} are reserved for"
                       " in-progress saves; choose another name.")
  elif not overwrite and _location.read_key(loc, _manifest.MANIFEST_KEY) is not None:
    raise errors.CheckpointExistsError(
        f"a checkpoint already exists at {loc}; pass overwrite=True to replace it or"
        " choose another path.")


def _plan(loc: Location, items: Mapping[str, Any], overwrite: bool,
          custom_metadata: Mapping[str, Any] | None, seq: int) -> _Plan:
  _check_items(items)
  if custom_metadata is not None:
    try:
      custom = json.loads(json.dumps(dict(custom_metadata), allow_nan=False))
    except (TypeError, ValueError) as e:
      raise TypeError(f"custom_metadata must be a JSON-serialisable dict: {e}") from None
  else:
    custom = {}
  me, nproc = _multihost.process_index(), _multihost.process_count()
  load = [0] * nproc
  arrays: list[_ArrayPlan] = []
  items_meta: dict[str, Any] = {}
  for item, tree in items.items():
    structure, leaves = _tree.encode_structure(tree)
    records = []
    for i, (path, leaf) in enumerate(leaves):
      kind = _tree.leaf_kind(leaf)
      if kind is None:
        raise _tree.unsupported_leaf_error(item, path, leaf)
      if kind == "value":
        records.append({"path": list(path), "kind": "value", "value": _tree.encode_value(leaf)})
        continue
      rec, plan = _plan_array(item, f"a{i}", path, leaf, kind, me, load)
      records.append(rec)
      if plan.pieces:
        arrays.append(plan)
    items_meta[item] = {"structure": structure, "leaves": records}
  _check_destination(loc, overwrite)
  manifest = {
      "format": _manifest.FORMAT, "version": _manifest.VERSION,
      "library_version": LIBRARY_VERSION, "created": time.time(),
      "process_count": nproc, "device_count": jax.device_count(),
      "custom": custom, "items": items_meta,
  }
  return _Plan(loc, manifest, arrays, overwrite, seq)


def _plan_array(item: str, name: str, path: _tree.Path, leaf: Any, kind: str, me: int,
                load: list[int]) -> tuple[dict[str, Any], _ArrayPlan]:
  key_impl = None
  key_shape = None
  if kind == "jax" and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    key_impl = str(jax.random.key_impl(leaf))
    key_shape = list(leaf.shape)
    leaf = jax.random.key_data(leaf)
  shape = tuple(int(s) for s in leaf.shape)
  dtype = np.dtype(leaf.dtype)
  sharding = leaf.sharding if kind == "jax" else None
  rec: dict[str, Any] = {
      "path": list(path), "kind": kind, "name": name, "shape": list(shape),
      "dtype": dtype.name, "stored_dtype": _tsio.stored_dtype(dtype),
      "nbytes": int(math.prod(shape) * dtype.itemsize),
      "sharding": _manifest.describe_sharding(sharding),
  }
  if key_impl is not None:
    rec.update(key_impl=key_impl, key_shape=key_shape)
  plan = _ArrayPlan(item, name, shape, rec["stored_dtype"], (), [])
  if math.prod(shape) == 0:
    rec.update(chunk_shape=list(shape), owners=[])
    return rec, plan

  if sharding is not None and len(load) > 1 and leaf.is_fully_addressable:
    # A process-local array (e.g. jnp.int32(0)) in a multi-process job: like a
    # numpy leaf, every process holds its own copy, assumed identical.
    sharding, leaf = None, np.asarray(leaf)
    rec["sharding"] = {"type": "process-local", "text": "process-local (same on every process)"}
  if sharding is None:
    shard_shape = shape
    shard_boxes = {tuple(0 for _ in shape): frozenset(range(len(load)))}
    local = {tuple(0 for _ in shape): (tuple((0, s) for s in shape), leaf)}
  else:
    shard_shape = tuple(sharding.shard_shape(shape))
    holders: dict[tuple[int, ...], set[int]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
      box = _layout.slices_to_box(index, shape)
      holders.setdefault(tuple(lo for lo, _ in box), set()).add(device.process_index)
    shard_boxes = {k: frozenset(v) for k, v in holders.items()}
    local = {}
    for shard in leaf.addressable_shards:
      box = _layout.slices_to_box(shard.index, shape)
      local.setdefault(tuple(lo for lo, _ in box), (box, shard))

  chunk_shape = _layout.choose_chunk_shape(shard_shape, dtype.itemsize)
  chunking = _layout.Chunking(shape, chunk_shape)
  chunk_boxes = [chunking.chunk_box(c) for c in range(chunking.num_chunks)]
  starts = [tuple((lo // s) * s for (lo, _), s in zip(b, shard_shape)) for b in chunk_boxes]
  owners = _layout.assign_owners([shard_boxes[s] for s in starts],
                                 math.prod(chunk_shape) * dtype.itemsize, load)
  rec.update(chunk_shape=list(chunk_shape), owners=owners)
  plan.chunk_shape = chunk_shape
  views: dict[tuple[int, ...], np.ndarray] = {}
  for box, start, owner in zip(chunk_boxes, starts, owners):
    if owner != me:
      continue
    shard_box, src = local[start]
    if start not in views:
      views[start] = src if isinstance(src, np.ndarray) else np.asarray(src.data)
    data = views[start][_layout.relative(box, shard_box)]
    plan.pieces.append(_Piece(_layout.box_to_slices(box), data))
  return rec, plan


def _snapshot(plan: _Plan) -> None:
  """Copies every piece to fresh host memory, in parallel threads."""
  global _copy_pool
  pieces = [p for a in plan.arrays for p in a.pieces]
  if not pieces:
    return
  if _copy_pool is None:
    _copy_pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=max(2, os.cpu_count() or 1), thread_name_prefix="orbax_flax-copy")

  def copy(p: _Piece) -> None:
    p.data = np.array(p.data, copy=True, order="C")

  for f in [_copy_pool.submit(copy, p) for p in sorted(pieces, key=lambda p: -p.data.nbytes)]:
    f.result()


# ----------------------------------------------------------------------------
# Phase 2: write, agree, commit.


def _write_and_commit(plan: _Plan) -> None:
  me = _multihost.process_index()
  key = f"orbax_flax/save/{plan.seq}"
  final = plan.loc
  if me == 0:
    try:
      gen = uuid.uuid4().hex[:16]
      if final.is_local:
        os.makedirs(os.path.dirname(final.local_path), exist_ok=True)
        target = final.sibling(f"{final.name}{TMP_MARKER}{gen}")
        os.makedirs(target.local_path)
      _multihost.publish(f"{key}/gen", gen)
    except BaseException as e:
      _multihost.publish(f"{key}/gen", f"error: {e}")
      raise
  else:
    gen = _multihost.fetch(f"{key}/gen")
    if gen.startswith("error: "):
      raise errors.StorageError(f"process 0 could not start the save to {final}: {gen[7:]}")
  target = final.sibling(f"{final.name}{TMP_MARKER}{gen}") if final.is_local else final

  status = "ok"
  try:
    _write_arrays(plan, target, gen)
  except BaseException as e:
    status = f"error: {type(e).__name__}: {e}"
    if me != 0:
      _multihost.publish(f"{key}/status/{me}", status)
      raise
  if me == 0:
    if _multihost.process_count() > 1:
      _multihost.delete(f"orbax_flax/save/{plan.seq - 1}")
    statuses = [status] + [_multihost.fetch(f"{key}/status/{p}")
                           for p in range(1, _multihost.process_count())]
    failed = [f"process {p}: {s[7:]}" for p, s in enumerate(statuses) if s != "ok"]
    verdict = "ok"
    try:
      if failed:
        raise errors.StorageError(f"save to {final} failed, nothing was committed: "
                                  + "; ".join(failed))
      _commit(plan, target, gen)
    except BaseException as e:
      verdict = f"error: {e}"
      if final.is_local and os.path.isdir(target.local_path):
        shutil.rmtree(target.local_path, ignore_errors=True)
      raise
    finally:
      _multihost.publish(f"{key}/verdict", verdict)
  else:
    _multihost.publish(f"{key}/status/{me}", "ok")
    verdict = _multihost.fetch(f"{key}/verdict")
    if verdict != "ok":
      raise errors.StorageError(verdict[7:])


def _write_arrays(plan: _Plan, target: Location, gen: str) -> None:
  me = _multihost.process_index()
  ctx = _tsio.context()
  writers: dict[str, _tsio.DatabaseWriter] = {}
  for a in plan.arrays:
    db = f"{a.item}/p{me}-{gen}"
    if db not in writers:
      writers[db] = _tsio.DatabaseWriter(target, db, ctx)
    writers[db].add(a.name, a.shape, a.dtype, a.chunk_shape,
                    [(p.slices, p.data) for p in a.pieces])
  try:
    for w in writers.values():
      w.start()
    for w in writers.values():
      w.commit()
  except ValueError as e:
    raise _location._storage_error(target, "writing array data", e) from e
  if target.is_local:
    for db in writers:
      _location.fsync_tree(os.path.join(target.local_path, db))
    for item in {a.item for a in plan.arrays}:
      _location.fsync_dir(os.path.join(target.local_path, item))


def _commit(plan: _Plan, target: Location, gen: str) -> None:
  """Process 0: write the manifest last, then make it visible atomically."""
  final = plan.loc
  manifest = dict(plan.manifest, generation=gen)
  data = _manifest.encode(manifest)
  if not final.is_local:
    old = _location.read_key(final, _manifest.MANIFEST_KEY) if plan.overwrite else None
    _location.write_key(final, _manifest.MANIFEST_KEY, data)
    if old is not None:
      _delete_generation(final, _manifest.decode(old, str(final)), keep=gen)
    return
  _location.write_key(target, _manifest.MANIFEST_KEY, data)
  _location.fsync_tree(target.local_path)
  tmp, dst = target.local_path, final.local_path
  replaced = os.path.isdir(dst) and _location.exchange(tmp, dst)
  if not replaced:
    if os.path.isdir(dst) and os.listdir(dst):
      if not plan.overwrite:
        raise errors.CheckpointExistsError(f"a checkpoint appeared at {dst} during the save;"
                                           " nothing was overwritten.")
      old = final.sibling(f"{final.name}{TMP_MARKER}{gen}-old").local_path
      os.rename(dst, old)
      os.rename(tmp, dst)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.rename(tmp, dst)
  _location.fsync_dir(os.path.dirname(dst))
  if replaced:
    shutil.rmtree(tmp, ignore_errors=True)  # Now holds the old checkpoint.


def _delete_generation(loc: Location, old_manifest: dict[str, Any], keep: str) -> None:
  old_gen = old_manifest.get("generation")
  if not old_gen or old_gen == keep:
    return
  for item in old_manifest["items"]:
    for p in range(old_manifest["process_count"]):
      _location.delete_prefix(loc, f"{item}/p{p}-{old_gen}/")


def _release_memory() -> None:
  """Hands freed staging memory back to the OS (glibc keeps it otherwise)."""
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass
