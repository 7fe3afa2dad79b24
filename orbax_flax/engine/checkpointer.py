"""The engine as an object: it owns the staging memory of its saves and the save in flight.

:class:`Checkpointer` owns what outlives one call: the host memory an async
save stages into (kept between saves, so that from the second save on the
blocking phase is a copy into memory already touched), the save in flight
(one at a time; its error is raised by the next call if nobody waited), and
the layouts it planned. The save itself, top to bottom, is
:mod:`orbax_flax.engine.saving`; a restore is :mod:`orbax_flax.engine.restoring`.

The module functions :func:`save` and :func:`save_async` make a checkpointer
of their own for each call (its keys derive from the path; it keeps no
staging memory), and :func:`restore` needs none: each call is independent of
every other (use a :class:`Checkpointer` for one save at a time).

Host memory, in short: an async save holds one staging copy of what this
process writes (or ``max_host_bytes``, in rounds) from its first save until
:meth:`Checkpointer.close` (only during each save with
``keep_staging_memory=False``); :meth:`Checkpointer.prepare` touches it before
the first save. docs/engine.md ("Host memory and the blocking phase") has the rest.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import jax

from orbax_flax.core import _multihost
from orbax_flax.engine import _planning
from orbax_flax.core import _progress
from orbax_flax.core import _staging
from orbax_flax.engine import restoring
from orbax_flax.engine import saving
from orbax_flax.core._location import Location
from orbax_flax.differential import differ as differ_lib

HOST_TRANSFERS = saving.HOST_TRANSFERS


_WATCHDOG_SECONDS = 600.0


class Checkpointer:
  """Saves and restores checkpoints, keeping staging memory between async saves.

  Args:
    max_host_bytes: a budget for the host memory of one save or restore
      (0: none). A larger async save stages in rounds, blocking the caller
      longer; a restore reads in rounds. Peak extra host memory stays at most
      the budget plus the largest chunk (32 MiB by default).
    keep_staging_memory: keep the staging copy between async saves (fast
      blocking phase from the second save on). False releases it after every
      save, for memory-tight hosts; each save then copies into fresh pages.
    coordination_timeout_seconds: the deadline of every call to the
      coordination service and of every wait for the other processes; the
      error names who is missing.
    host_transfer: how an async save snapshots device arrays: "memcpy" (a
      host copy while the caller waits: on CPU, where device buffers are host
      memory, a copy into the staging memory; on an accelerator each shard's
      device-to-host copy, started for every shard at once, which JAX keeps
      on the array while it lives; the default on CPU for a state over 256
      MiB or in a multi-process job, and on TPU without ``max_host_bytes``),
      "device_copy" (every array copied into new device buffers by XLA in one
      call, the shards to write found on the copies in the background; the
      default on CPU for a smaller state with device arrays in a
      single-process job, without ``max_host_bytes``, with which it is
      refused), "pinned_host" (a device-to-host transfer into
      pinned memory, started for every shard at once and ordered by XLA
      before any later donation; the default on GPU, and on TPU with
      ``max_host_bytes``), or "auto".
    coordination_key: a coordination-service prefix for this checkpointer's
      saves, the same on every process (a manager passes one derived from its
      directory, the module functions the n-th of their own, counted per process). Default:
      one per checkpointer, counted in the coordination service: create
      checkpointers without a key in the same order on every process.
    watchdog_seconds: a save or restore running longer logs its phase, bytes
      done, RSS and (once) every thread's Python stack (0: off).
    differential: write only the chunks that changed since the base step,
      referencing the rest (``self.differential``: a
      :class:`orbax_flax.differential.differ.Differential`; None when off).

  Example:
    >>> import numpy as np, orbax_flax as ofx, tempfile, os
    >>> root = tempfile.mkdtemp()
    >>> with ofx.Checkpointer() as ckptr:
    ...   for step in range(3):
    ...     _ = ckptr.save_async(os.path.join(root, str(step)), {"state": {"w": np.full(4, step)}})
    ...   ckptr.wait()
    ...   ckptr.restore(os.path.join(root, "2"))["state"]["w"]
    array([2, 2, 2, 2])
  """

  def __init__(self, *, max_host_bytes: int = 0, keep_staging_memory: bool = True,
               coordination_timeout_seconds: float = _multihost.DEFAULT_TIMEOUT_S,
               host_transfer: str = "auto", coordination_key: str | None = None,
               watchdog_seconds: float = _WATCHDOG_SECONDS, differential: bool = False):
    if isinstance(max_host_bytes, bool) or not isinstance(max_host_bytes, int) or max_host_bytes < 0:
      raise ValueError(f"max_host_bytes={max_host_bytes!r}: must be an int >= 0 (bytes; 0: no"
                       " budget), e.g. 8 << 30 for 8 GiB.")
    if not coordination_timeout_seconds or coordination_timeout_seconds <= 0:
      raise ValueError(f"coordination_timeout_seconds={coordination_timeout_seconds!r}: must be"
                       " > 0 (seconds a process waits for the others).")
    if host_transfer not in HOST_TRANSFERS:
      raise ValueError(f"host_transfer={host_transfer!r}: must be one of {HOST_TRANSFERS}.")
    if host_transfer == "device_copy" and max_host_bytes:
      raise ValueError(f"host_transfer='device_copy' copies the whole state at once, which"
                       f" max_host_bytes={max_host_bytes} forbids: use host_transfer='auto' or"
                       " 'memcpy' (staged in rounds within the budget), or max_host_bytes=0.")
    _multihost.check_distributed()
    self.max_host_bytes = max_host_bytes
    self.keep_staging_memory = keep_staging_memory
    self.coordination_timeout_seconds = float(coordination_timeout_seconds)
    self.host_transfer = host_transfer
    self.watchdog_seconds = watchdog_seconds
    if not isinstance(differential, bool):
      raise TypeError(f"differential={differential!r}: must be True or False.")
    # Differential saves plug their hooks into each save; None: plain saves, which never
    # enter orbax_flax.differential.
    self.differential = differ_lib.Differential() if differential else None
    # Taken now (a timed count), not per save: a save's first coordination is then its own
    # agreement, so a frozen process 0 gives every process the same verdict, never a count
    # that one process took and another did not.
    self._key = coordination_key or _multihost.namespace("checkpointer", "",
                                                         coordination_timeout_seconds)
    self._seq = 0
    self._planner = _planning.Planner()
    self._staging = _staging.Staging(limit=max_host_bytes)
    self._own_snapshots: dict[int, Any] = {}  # buffer address -> weakref (host_snapshot)
    self._inflight: saving.AsyncSave | None = None
    self._lock = threading.Lock()
    # Held by save, save_async (until it returns), prepare, wait and close: one caller at a
    # time, also when threads share the checkpointer (its staging memory is one save's).
    self._one_save = threading.Lock()
    self._closed = False

  # ------------------------------------------------------------------ state

  @property
  def staging_bytes(self) -> int:
    """Host memory held for staging now (0 after ``close()``)."""
    return self._staging.nbytes

  def staging_stats(self) -> _staging.Stats:
    """Staging memory held, prepared so far, and how many arenas were mapped (see :meth:`prepare`)."""
    return self._staging.stats()

  @property
  def inflight(self) -> saving.AsyncSave | None:
    """The async save still running, if any."""
    h = self._inflight
    return h if h is not None and not h.done() else None

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("this Checkpointer is closed; create a new one")

  def _finish_inflight(self) -> None:
    """Waits for the previous save; raises its error if nobody has seen it."""
    prev = self._inflight
    if prev is None:
      return
    prev.join()
    self._inflight = None  # only once it has ended: a Ctrl-C in the join can still cancel it
    error = prev.unreported_error()
    if error is not None:
      prev.mark_reported()
      error.add_note(f"(raised by the earlier save_async to {prev.path}, which nobody waited for)")
      raise error

  def wait(self) -> None:
    """Blocks until the save in flight is committed; raises its error if nobody has seen it."""
    with self._one_save:
      self._finish_inflight()

  def close(self) -> None:
    """Waits for the save in flight, then releases the staging memory and threads.

    Interrupted (Ctrl-C) while the save in flight writes, it abandons that save (it never
    commits) and releases the staging memory, which the save may still be writing from, once
    the save has ended.
    """
    with self._one_save:
      if self._closed:
        return
      try:
        self._finish_inflight()
      except BaseException as e:
        self._closed = True
        running = self._inflight
        if isinstance(e, Exception) or running is None or running.done():
          self._staging.close()
        else:
          running.cancel()
          running.add_done_callback(lambda _: self._staging.close())
        raise
      self._closed = True
      self._staging.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ------------------------------------------------------------------ saving

  def check(self, items: Mapping[str, Any],
            custom_metadata: Mapping[str, Any] | None = None, dtype: Any = None) -> None:
    """Raises what a save of ``items`` would refuse before writing (item names, leaf types,
    deleted arrays, ``custom_metadata``, a ``dtype`` conversion), and reads, writes and
    converts nothing: for a caller that writes bookkeeping of its own before the save (the
    manager's rollback record).

    In a multi-process job a refusal here is the refusal of the save that was to follow: it
    takes that save's turn and fails it on every other process (with this error's type and
    reason), so that a caller that then saves only where the check passed stays in step.

    Example:
      >>> import numpy as np
      >>> ckptr = Checkpointer()
      >>> ckptr.check({"state": {"w": np.zeros(2), "f": len}})
      Traceback (most recent call last):
      ...
      orbax_flax.errors.UnsupportedLeafError: Cannot save leaf state/f: builtin_function_or_method is not a supported leaf type. ...
      >>> ckptr.close()
    """
    try:
      self._planner.check(items, custom_metadata, dtype)
    except BaseException as e:
      if _multihost.process_count() > 1:  # the refusal of the save that was to follow
        saving.refuse(self._next_key(), "the save it checked", e,
                      self.coordination_timeout_seconds)
      raise

  def prepare(self, items: Mapping[str, Any]) -> int:
    """Prepares the staging memory an async save of ``items`` will copy into, in the background.

    Without it the first async save of a process copies into fresh memory,
    faulting in every page while the caller waits. This maps the memory now
    (the size of the save's largest staging round) and touches it from a
    low-priority thread in short slices with pauses between them, so that a
    training step is not slowed measurably. The first save then copies into
    it: it is the save's own staging memory, never a second copy; a save that
    comes before the touching ends stops it and uses what is there. Reads no
    array data, writes nothing, talks to no other process.

    Only what the save will copy is prepared: on an accelerator with the memcpy
    transfer each shard's device-to-host copy is its snapshot, and only packed
    small arrays are staged. Nothing is prepared (0 is returned) when an async
    save would not stage (the pinned-host and device_copy transfers), with ``keep_staging_memory=False``, while a
    save is in flight, when enough staging memory is held already, or when
    the memory needed is over ``max_host_bytes`` (then the first save
    allocates it as without preparation).

    Args:
      items: what the save will save (arrays with their final shapes, dtypes
        and shardings; their values are not read).

    Returns:
      The bytes of staging memory being prepared.

    Example:
      >>> import numpy as np, orbax_flax as ofx, tempfile, os
      >>> with ofx.Checkpointer() as ckptr:
      ...   items = {"state": {"w": np.ones((1024, 1024), np.float32)}}
      ...   ckptr.prepare(items) >= 4 << 20
      ...   _ = ckptr.save_async(os.path.join(tempfile.mkdtemp(), "c"), items)
      ...   ckptr.wait()
      ...   ckptr.staging_stats().mappings  # the save copied into the prepared memory
      True
      1
    """
    with self._one_save:
      return self._prepare(items)

  def _prepare(self, items: Mapping[str, Any]) -> int:
    self._check_open()
    if not self.keep_staging_memory or self.inflight is not None:
      return 0
    leaves = {item: jax.tree_util.tree_leaves(tree) for item, tree in items.items()}
    layout = self._planner.layout(items)
    how = saving.transfer(self.host_transfer, (x for xs in leaves.values() for x in xs),
                          self.max_host_bytes, layout)
    if how != "memcpy":  # nothing staged (pinned_host's and device_copy's copies are new arrays)
      return 0
    value_of = lambda ref: leaves[ref.item][ref.leaf]  # noqa: E731  (the layout's sources)
    rounds = saving.split_rounds(layout.pieces, self.max_host_bytes)
    need = max(_staging.arena_bytes([(p.shape, p.dtype) for p in r
                                     if saving.staged(p, how, value_of)]) for r in rounds)
    return self._staging.prepare(need)

  def wait_prepared(self, timeout: float | None = None) -> bool:
    """Blocks until the memory of :meth:`prepare` is touched; True if it is (or none is pending)."""
    return self._staging.wait_prepared(timeout)

  def save(self, path: Any, items: Mapping[str, Any], *, overwrite: bool = False,
           custom_metadata: Mapping[str, Any] | None = None, dtype: Any = None) -> None:
    """Saves ``items`` and returns once committed on every process.

    Writes array blocks straight from the device buffers (views on CPU; one
    device-to-host copy per shard on accelerators, all started at once); only
    packed small arrays are assembled in the staging memory (kept unless
    ``keep_staging_memory=False``). Arguments as for :func:`orbax_flax.save`.
    """
    with self._one_save:
      self._check_open()
      self._finish_inflight()
      plan, run, handle = self._start(path, items, overwrite, custom_metadata, dtype)
      try:
        saving.save(plan, run, handle, staging=self._staging,
                    max_host_bytes=self.max_host_bytes, watchdog_seconds=self.watchdog_seconds)
      finally:
        self._after_save()
      handle.wait()

  def save_async(self, path: Any, items: Mapping[str, Any], *, overwrite: bool = False,
                 custom_metadata: Mapping[str, Any] | None = None, dtype: Any = None,
                 cancellable: bool = False) -> saving.AsyncSave:
    """Starts a save; returns once the caller may change or donate its arrays.

    The blocking phase is a snapshot: a copy by XLA into new device buffers (CPU, up to 256 MiB),
    a copy into this checkpointer's staging memory (CPU, larger states), each shard's
    device-to-host copy (TPU), or a transfer into pinned host memory that XLA orders before
    any later donation (GPU, and TPU with ``max_host_bytes``). Only one
    save runs at a time: this call first waits for the previous one, and raises its error if nobody
    called ``wait()``. Arguments as for :func:`orbax_flax.save`, and:

    Args:
      cancellable: write in batches of about half a second, so that
        ``AsyncSave.cancel()`` stops the writing within about a second (a
        preemption save with a grace period). Otherwise ``cancel()`` still
        keeps the save from committing, but the data already handed to
        tensorstore is written out (in the background; it never holds the
        process's exit).

    Returns:
      An :class:`AsyncSave`; ``wait()`` blocks until committed.
    """
    with self._one_save:
      self._check_open()
      self._finish_inflight()
      plan, run, handle = self._start(path, items, overwrite, custom_metadata, dtype, bind=False)
      # In flight from here, whatever interrupts this call: the next save waits for it (its
      # writing may use the staging memory the next one copies into).
      self._inflight = handle
      saving.save_async(plan, run, handle, host_transfer=self.host_transfer,
                        staging=self._staging, max_host_bytes=self.max_host_bytes,
                        watchdog_seconds=self.watchdog_seconds, cancellable=cancellable,
                        keep=self._is_own_snapshot, on_end=self._after_save)
      return handle

  def _start(self, path: Any, items: Mapping[str, Any], overwrite: bool,
             custom_metadata: Mapping[str, Any] | None, dtype: Any, bind: bool = True):
    started = time.perf_counter()
    key = self._next_key()  # taken before anything can refuse: every process takes it
    try:
      loc = Location.parse(path)
      if loc.is_local and os.path.islink(loc.local_path):
        # A link (model -> /bigdisk/model): the checkpoint goes where it points, its
        # temporary directory beside it (one disk: the commit's rename), and the link stays.
        loc = Location.parse(os.path.realpath(loc.local_path))
      plan = self._planner.plan(loc, items, overwrite, custom_metadata, dtype, bind=bind)
    except BaseException as e:
      saving.refuse(key, f"the save to {path}", e, self.coordination_timeout_seconds)
      raise
    run, handle = saving.start(plan, key, self.coordination_timeout_seconds, started)
    if self.differential is not None:
      run.hooks = self.differential.differ(plan, lambda: handle.total_s is None)
    else:  # every planned byte is written: known now, on every process
      handle.stored_bytes = {"bytes_written": sum(r.get("nbytes", 0) for item in
                                                  plan.manifest["items"].values()
                                                  for r in item["leaves"]), "bytes_reused": 0}
    return plan, run, handle

  def _next_key(self) -> str:
    """The coordination prefix of the next save: one per save, the same on every process.

    Every save takes its own, refused or not, so that the n-th save of every process has
    the same key: a process that refused a save without taking its key would meet the
    others' next save under the key of this one ("process 0 saves 'N' and process 1 saves
    'N+1'", for every later save of the job).
    """
    with self._lock:
      self._seq += 1
      return f"{self._key}/{self._seq}"

  def host_snapshot(self, items: Mapping[str, Any]) -> Mapping[str, Any]:
    """``items`` as an async save of this checkpointer would snapshot them, to share.

    With the pinned-host transfer (GPU) every device array is copied into pinned host memory
    once; a save of the result takes those copies as its snapshot, and anyone else (the local tier)
    reads the same host arrays. With the memcpy transfer ``items`` is returned as it is: on CPU
    device buffers are host memory already (its views are free; the save makes its one copy), and
    on TPU each tier reads the device arrays itself (jaxlib keeps the first device-to-host copy
    of a shard on it, and a second reader of the same shard gets that copy). With
    ``max_host_bytes`` it is returned as it is too: a whole copy would exceed the budget, so each
    tier brings its arrays over in rounds. Arrays the caller already keeps in pinned host memory
    are copied as well: the result is a snapshot the caller may donate from.
    """
    if saving.transfer(self.host_transfer, jax.tree_util.tree_leaves(dict(items)),
                       self.max_host_bytes) != "pinned_host":
      return items
    if self.max_host_bytes:  # no whole copy: each tier stages in rounds within the budget
      return items
    out = saving.pin_on_host(dict(items))
    # The buffers of these copies, with the arrays that hold them: while an array lives, no
    # other array can have its buffers' addresses, so a save recognises its shards by address.
    self._own_snapshots = {
        sh.data.unsafe_buffer_pointer(): weakref.ref(x) for x in jax.tree_util.tree_leaves(out)
        if isinstance(x, jax.Array) and x.sharding.memory_kind == "pinned_host"
        for sh in x.addressable_shards}
    return out

  def _is_own_snapshot(self, value: Any) -> bool:
    """Whether ``value`` (an array or one shard of one) is in a copy :meth:`host_snapshot`
    made that is still alive; a user's own pinned array is not, and gets copied."""
    if value.sharding.memory_kind != "pinned_host" or value.is_deleted():
      return False
    ref = self._own_snapshots.get(value.unsafe_buffer_pointer())
    return ref is not None and ref() is not None

  def _after_save(self) -> None:
    if not self.keep_staging_memory:
      self._staging.release()

  # ------------------------------------------------------------------ restoring

  def restore(self, path: Any, target: Mapping[str, Any] | None = None, *, partial: bool = False,
              allow_lossy_casts: bool = False, transforms: Any = None, read_once: bool = False,
              max_host_bytes: int | None = None, progress: Any = None,
              casts: list | None = None) -> dict[str, Any]:
    """Restores a checkpoint (see :func:`orbax_flax.restore`).

    A save of this checkpointer to the same path still in flight is waited
    for first. ``max_host_bytes=None``: the budget of what is called, this
    checkpointer's ``max_host_bytes`` (0: no budget). ``progress`` defaults to
    a new one the watchdog watches.
    """
    loc = Location.parse(path)
    self.wait_for(loc)
    return _watched_restore(loc, target, self.watchdog_seconds, partial=partial,
                            allow_lossy_casts=allow_lossy_casts, transforms=transforms,
                            read_once=read_once, progress=progress, casts=casts,
                            max_host_bytes=self.max_host_bytes if max_host_bytes is None
                            else max_host_bytes)

  def wait_for(self, path: Any) -> None:
    """Blocks until this checkpointer's save to ``path``, if in flight, is done. Never raises:
    its error is raised by the next save or ``wait()``."""
    loc = Location.parse(path)
    h = self._inflight
    if h is not None and h.loc == loc:
      h.join()


def save(path: Any, items: Mapping[str, Any], *, overwrite: bool = False,
         custom_metadata: Mapping[str, Any] | None = None, dtype: Any = None) -> None:
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
    dtype: store arrays in another dtype: one dtype for every floating array
      (e.g. ``"bfloat16"`` to serve float32 params; integer, bool and key
      arrays are kept), or a function ``(key path text, dtype) -> dtype or
      None``. The arrays are converted on their devices before the snapshot;
      ``metadata(path).casts`` records what each converted array was.

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
  with _one_save(path) as ckptr:
    ckptr.save(path, items, overwrite=overwrite, custom_metadata=custom_metadata, dtype=dtype)


def save_async(path: Any, items: Mapping[str, Any], *, overwrite: bool = False,
               custom_metadata: Mapping[str, Any] | None = None, dtype: Any = None,
               cancellable: bool = False) -> saving.AsyncSave:
  """Starts a save and returns once the state is copied to host memory.

  Arguments are those of :func:`save` and :meth:`Checkpointer.save_async`.
  The caller may then donate or change its arrays. Each call is independent:
  it waits for no earlier save, and its error is raised by the handle's
  ``wait()`` (or logged, if the handle is dropped without one). The host copy
  goes into fresh memory, released when the save ends. For repeated saves a
  :class:`Checkpointer` (or :class:`orbax_flax.CheckpointManager`) keeps it,
  and blocks much less; it also runs one save at a time and raises the error
  of a save nobody waited for on its next call.

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
  return _one_save(path).save_async(path, items, overwrite=overwrite, dtype=dtype,
                                    custom_metadata=custom_metadata, cancellable=cancellable)


def _one_save(path: Any) -> Checkpointer:
  """The checkpointer of one module-function save: no staging memory kept, the keys of this
  process's next module-function save, whatever its path. Every process makes its saves in
  the same order, so the n-th meets the n-th: one that names another path than process 0's
  (a per-process temporary directory, a host name in it) is refused at once, naming both,
  where keys of the path never met and each waited for the coordination timeout."""
  del path  # (checked against the other processes' by the save itself)
  key = _multihost.namespace("save", "module functions", _multihost.DEFAULT_TIMEOUT_S)
  return Checkpointer(keep_staging_memory=False, coordination_key=key)


def restore(path: Any, target: Mapping[str, Any] | None = None, *, partial: bool = False,
            allow_lossy_casts: bool = False, transforms: Any = None, read_once: bool = False,
            max_host_bytes: int | None = None, progress: Any = None,
            casts: list | None = None) -> dict[str, Any]:
  """Restores a checkpoint, resharded onto the target's shardings.

  See :func:`orbax_flax.engine.restoring.restore` for the arguments.
  ``max_host_bytes=None``: the budget of what is called, and a module function
  has none: no budget (0 says the same). A save still in flight is not waited
  for: ``wait()`` on its handle first (a :class:`Checkpointer` waits for its
  own).

  Example:
    >>> import jax, numpy as np, orbax_flax as ofx, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> ofx.save(path, {"state": {"w": np.arange(4, dtype=np.float32), "b": np.zeros(2)}})
    >>> sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> target = {"state": {"w": jax.ShapeDtypeStruct((4,), np.float32, sharding=sharding)}}
    >>> ofx.restore(path, target, partial=True)["state"]["w"]
    Array([0., 1., 2., 3.], dtype=float32)
  """
  return _watched_restore(Location.parse(path), target, _WATCHDOG_SECONDS, partial=partial,
                          allow_lossy_casts=allow_lossy_casts, transforms=transforms, casts=casts,
                          read_once=read_once, max_host_bytes=max_host_bytes, progress=progress)


def _watched_restore(loc: Location, target: Any, watchdog_seconds: float, *,
                     progress: Any = None, **kwargs) -> dict[str, Any]:
  """:func:`orbax_flax.engine.restoring.restore` under the watchdog (and a terminal progress line)."""
  progress = _progress.Progress(f"restore of {loc}") if progress is None else progress
  with _progress.Monitor(progress, watchdog_seconds):
    return restoring.restore(loc, target, progress=progress, **kwargs)
