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

import ctypes
import errno
import os
import shutil
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from orbax_flax import _location
from orbax_flax import _manifest
from orbax_flax import _multihost
from orbax_flax import _planning
from orbax_flax import _tsio
from orbax_flax import errors
from orbax_flax._location import Location
from orbax_flax._planning import TMP_MARKER


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

  def __init__(self, plan: _planning.Plan, blocking_s: float, start: float):
    self.path = str(plan.loc)
    self.blocking_s = blocking_s
    self.total_s: float | None = None
    self.nbytes = plan.nbytes
    self._loc = plan.loc
    self._plan: _planning.Plan | None = plan
    self._start = start
    self._error: BaseException | None = None
    self._reported = False
    self._thread: threading.Thread | None = None
    self._cancelled = threading.Event()
    plan.cancelled = self._cancelled

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

  def cancel(self) -> None:
    """Makes sure this save never commits (if it has not already).

    The background phase stops before the commit and ``wait()`` raises
    ``SaveCancelledError``, here and, in a multi-process save, on every other
    process. Used when a preemption grace period runs out. A process other than
    0 that cancels after it finished writing cannot stop process 0's commit.
    The next save does not raise this cancellation again.
    """
    self._cancelled.set()

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


def _finish_inflight() -> None:
  """Waits for the previous save; raises its error if nobody has seen it."""
  global _inflight
  prev, _inflight = _inflight, None
  if prev is None:
    return
  if prev._thread is not None:
    prev._thread.join()
  asked = isinstance(prev._error, errors.SaveCancelledError) and prev._cancelled.is_set()
  if prev._error is not None and not prev._reported and not asked:  # cancel() expects it
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
  plan = _planning.make_plan(Location.parse(path), items, overwrite, custom_metadata, _seq)
  _planning.fill_packs(plan)
  if _copy:
    _planning.copy_pieces(plan)
  handle = AsyncSave(plan, time.perf_counter() - start, start)
  if _copy:
    handle._start_background()
    _inflight = handle
  else:
    handle._run()
  return handle


# ----------------------------------------------------------------------------
# Phase 2: write, agree, commit.


def _write_and_commit(plan: _planning.Plan) -> None:
  me = _multihost.process_index()
  key = f"orbax_flax/save/{plan.seq}"
  final = plan.loc
  if me == 0:
    try:
      gen = uuid.uuid4().hex[:16]
      if final.is_local:
        os.makedirs(os.path.dirname(final.local_path), exist_ok=True)
        os.makedirs(_target(final, gen).local_path)
      _multihost.publish(f"{key}/gen", gen)
    except BaseException as e:
      _multihost.publish(f"{key}/gen", f"error: {e}")
      raise
  else:
    gen = _multihost.fetch(f"{key}/gen")
    if gen.startswith("error: "):
      raise errors.StorageError(f"process 0 could not start the save to {final}: {gen[7:]}")
  target = _target(final, gen)

  error: BaseException | None = None
  try:
    _write_arrays(plan, target, gen)
  except BaseException as e:  # pylint: disable=broad-except  # Shared, then re-raised.
    error = e
  status = "ok" if error is None else f"error: {type(error).__name__}: {error}"
  if me != 0:
    _multihost.publish(f"{key}/status/{me}", status)
    if error is not None:
      raise error
    verdict = _multihost.fetch(f"{key}/verdict")
    if verdict.startswith(_CANCELLED):
      raise errors.SaveCancelledError(verdict[len(_CANCELLED):])
    if verdict != "ok":
      raise errors.StorageError(verdict[7:])
    return

  verdict = "ok"
  try:
    statuses = [status] + [_multihost.fetch(f"{key}/status/{p}")
                           for p in range(1, _multihost.process_count())]
    if _multihost.process_count() > 1:
      # Every process has reported on this save, so each has read the previous verdict.
      _multihost.delete(f"orbax_flax/save/{plan.seq - 1}")
    if error is not None:
      raise error
    failed = [f"process {p}: {s[7:]}" for p, s in enumerate(statuses) if s != "ok"]
    cancelled = [f for f in failed if f.split(": ", 2)[1] == errors.SaveCancelledError.__name__]
    if cancelled:
      raise errors.SaveCancelledError(f"save to {final} was cancelled on "
                                      + ", ".join(f.split(":")[0] for f in cancelled)
                                      + "; nothing was committed.")
    if failed:
      raise errors.StorageError(f"save to {final} failed, nothing was committed: "
                                + "; ".join(failed))
    _commit(plan, target, gen)
  except BaseException as e:
    if isinstance(e, errors.SaveCancelledError):
      verdict = f"{_CANCELLED}{e}"
    else:
      verdict = f"error: save to {final} failed on process 0, nothing was committed: {e}"
    if final.is_local and os.path.isdir(target.local_path):
      shutil.rmtree(target.local_path, ignore_errors=True)
    raise
  finally:
    _multihost.publish(f"{key}/verdict", verdict)


_CANCELLED = "cancelled: "  # verdict prefix: some process cancelled the save


def _target(final: Location, gen: str) -> Location:
  """Where data is written: a temporary sibling directory, or in place on object stores."""
  return final.sibling(f"{final.name}{TMP_MARKER}{gen}") if final.is_local else final


def _check_cancelled(plan: _planning.Plan) -> None:
  if plan.cancelled is not None and plan.cancelled.is_set():
    raise errors.SaveCancelledError(
        f"save to {plan.loc} was cancelled on process {_multihost.process_index()} before it"
        " committed; nothing was committed.")


def _write_arrays(plan: _planning.Plan, target: Location, gen: str) -> None:
  _check_cancelled(plan)
  me = _multihost.process_index()
  ctx = _tsio.context()
  writers: dict[str, _tsio.DatabaseWriter] = {}

  def writer(item: str) -> _tsio.DatabaseWriter:
    db = f"{item}/p{me}-{gen}"
    if db not in writers:
      writers[db] = _tsio.DatabaseWriter(target, db, ctx)
    return writers[db]

  for pack in plan.packs:
    chunk = _planning.pack_chunk_bytes(pack.size)
    writer(pack.item).add(_planning.PACKED, (pack.size,), "uint8", (chunk,),
                          [((slice(0, pack.size),), pack.buffer)])
  for a in plan.arrays:
    writer(a.item).add(a.name, a.shape, a.dtype, a.chunk_shape,
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
    for item in {db.split('/')[0] for db in writers}:
      _location.fsync_dir(os.path.join(target.local_path, item))


def _commit(plan: _planning.Plan, target: Location, gen: str) -> None:
  """Process 0: write the manifest last, then make it visible atomically."""
  final = plan.loc
  _check_cancelled(plan)
  manifest = dict(plan.manifest, generation=gen)
  data = _manifest.encode(manifest)
  if not final.is_local:
    old = _location.read_key(final, _manifest.MANIFEST_KEY)
    if old is not None and not plan.overwrite:
      _delete_generation(final, manifest, keep="")  # ours, written next to theirs
      raise errors.CheckpointExistsError(f"a checkpoint appeared at {final} during the save;"
                                         " nothing was overwritten.")
    _location.write_key(final, _manifest.MANIFEST_KEY, data)
    if old is not None:
      _delete_generation(final, _manifest.decode(old, str(final)), keep=gen)
    return
  # Every writer fsync'd its own files and directories; the manifest and the
  # directory that holds it are the last things made durable before the rename.
  _location.write_local_durably(os.path.join(target.local_path, _manifest.MANIFEST_KEY), data)
  _location.fsync_dir(target.local_path)
  tmp, dst = target.local_path, final.local_path
  committed = os.path.exists(os.path.join(dst, _manifest.MANIFEST_KEY))
  if not committed:
    # Nothing there, or an empty directory (replaced). Whatever appeared at dst
    # since the plan was checked makes the rename fail: it is never replaced.
    try:
      os.rename(tmp, dst)
    except OSError as e:
      if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
        raise
      raise errors.CheckpointExistsError(
          f"{dst} was created by someone else during the save; nothing was overwritten."
          " Choose another path.") from e
    _location.fsync_dir(os.path.dirname(dst))
    return
  if not plan.overwrite:
    raise errors.CheckpointExistsError(f"a checkpoint appeared at {dst} during the save;"
                                       " nothing was overwritten.")
  if _location.exchange(tmp, dst):
    _location.fsync_dir(os.path.dirname(dst))
    shutil.rmtree(tmp, ignore_errors=True)  # Now holds the old checkpoint.
    return
  _replace_in_place(tmp, dst, gen, data)


def _replace_in_place(tmp: str, dst: str, gen: str, manifest: bytes) -> None:
  """Overwrites a local checkpoint where paths cannot be swapped atomically (NFS).

  The new generation's databases move into the old checkpoint next to the old
  ones (new names: nothing is replaced), then one atomic ``os.replace`` of the
  manifest switches from the old generation to the new. Killed before that, the
  old checkpoint is intact; after it, the new one is complete.
  """
  old = _manifest.decode(open(os.path.join(dst, _manifest.MANIFEST_KEY), "rb").read(), dst)
  items = [i for i in os.listdir(tmp) if os.path.isdir(os.path.join(tmp, i))]
  for item in items:
    os.makedirs(os.path.join(dst, item), exist_ok=True)
    for db in os.listdir(os.path.join(tmp, item)):
      os.rename(os.path.join(tmp, item, db), os.path.join(dst, item, db))
    _location.fsync_dir(os.path.join(dst, item))
  staged = os.path.join(dst, f"{_manifest.MANIFEST_KEY}{TMP_MARKER}{gen}")
  _location.write_local_durably(staged, manifest)
  os.replace(staged, os.path.join(dst, _manifest.MANIFEST_KEY))
  _location.fsync_dir(dst)
  _delete_generation(Location.parse(dst), old, keep=gen)
  for item in old["items"]:  # items the new checkpoint no longer has
    path = os.path.join(dst, item)
    if item not in items and os.path.isdir(path) and not os.listdir(path):
      os.rmdir(path)
  shutil.rmtree(tmp, ignore_errors=True)


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
