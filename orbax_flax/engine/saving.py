"""One save, top to bottom: the handle, the blocking phase (phase one), then the background.

A save runs in two phases (:class:`orbax_flax.Checkpointer` starts them and
owns the staging memory they use).

1. Blocking, in the caller's thread (this module): the items are planned
   (:class:`orbax_flax.engine._planning.Planner`), then, for an async save, a snapshot
   is taken that the caller cannot change any more. The transfer is chosen
   per platform (:func:`transfer`): on CPU a copy into the checkpointer's
   reused staging memory (:func:`snapshot`); on GPU/TPU a device-to-host
   transfer into pinned host memory that is only *started* here
   (:func:`to_pinned_host`): XLA orders it before any later computation that
   donates the arrays. A state over ``max_host_bytes`` is staged in rounds
   (:func:`split_rounds`): all but the last are written while the caller waits.
2. Background, in the thread of the :class:`AsyncSave`: the last round is
   written, then the processes agree on the verdict and process 0 commits
   (:class:`orbax_flax.engine._save_run.SaveRun`, its commit :func:`orbax_flax.engine._save_run.commit`).

A blocking save (:func:`save`) writes straight from views of the device
buffers and holds no staging copy.
"""

from __future__ import annotations

import atexit
import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from orbax_flax.engine import _planning
from orbax_flax.core import _progress
from orbax_flax.core import _staging
from orbax_flax.format import _layout
from orbax_flax import errors
from orbax_flax.core._location import Location
from orbax_flax.engine._planning import Piece
from orbax_flax.engine._save_run import SaveRun

log = logging.getLogger("orbax_flax")

HOST_TRANSFERS = ("auto", "memcpy", "pinned_host")


class AsyncSave:
  """A save whose background phase may still be running.

  ``wait()`` blocks until the checkpoint is committed on every process and
  re-raises any error of the background phase. An error that nobody waited
  for is raised by the checkpointer's next call instead (a handle of the
  module function :func:`orbax_flax.save_async`, which has no next call,
  logs it when dropped): it is never lost.

  Attributes:
    path: where the checkpoint is written.
    blocking_s: seconds the caller was blocked (planning and host copy).
    total_s: seconds from the call to the commit, once done; else None.
    nbytes: bytes of array data this process writes.
    started: ``time.perf_counter()`` when the save was called.
    stored_bytes: ``{"bytes_written": n, "bytes_reused": m}``, array bytes of every
      process, when known before the commit (a plain save writes all it plans);
      None when only the manifest knows (a differential save's).
  """

  def __init__(self, path: Location, nbytes: int, started: float):
    self.path = str(path)
    self.loc = path
    self.nbytes = nbytes
    self.blocking_s = 0.0
    self.total_s: float | None = None
    self.started = started
    self.stored_bytes: dict[str, int] | None = None
    self._error: BaseException | None = None
    self._reported = False
    self._thread: threading.Thread | None = None
    # Set once the background phase has ended. Waited on before Thread.join (which then
    # waits only for the thread's last lines): a Ctrl-C that interrupts Thread.join on
    # Python 3.11 marks a running thread as stopped.
    self._over = threading.Event()
    self.cancelled = threading.Event()
    self._callbacks: list[Callable[[AsyncSave], None]] | None = []  # None once they ran
    self._callbacks_lock = threading.Lock()

  def add_done_callback(self, fn: Callable[[AsyncSave], None]) -> None:
    """Calls ``fn(self)`` once the save committed or failed: in its thread, before ``wait()``
    and ``join()`` return (at once if it has ended). ``wait()`` inside ``fn`` does not block.
    An error of ``fn`` becomes the save's (or a note on the save's own): never swallowed."""
    with self._callbacks_lock:
      if self._callbacks is not None:
        return self._callbacks.append(fn)
    self._call(fn)

  def _ended(self) -> None:
    self.total_s = time.perf_counter() - self.started
    with self._callbacks_lock:
      callbacks, self._callbacks = self._callbacks or [], None
    for fn in callbacks:
      self._call(fn)

  def _call(self, fn: Callable[[AsyncSave], None]) -> None:
    try:
      fn(self)
    except BaseException as e:  # pylint: disable=broad-except  # the save's error from now on
      if self._error is None:
        self._error, self._reported = e, False
      else:
        self._error.add_note(f"(its done-callback failed too: {type(e).__name__}: {e})")

  def run_in_background(self, work: Callable[[], None]) -> None:
    """Runs ``work`` in a daemon thread; at interpreter exit it still commits unless cancelled."""
    def body() -> None:
      try:
        work()
      except BaseException as e:  # pylint: disable=broad-except  # Re-raised in wait().
        self._error = e
      finally:
        atexit.unregister(self._finish_at_exit)
        try:
          self._ended()
        finally:
          self._over.set()
    self._thread = threading.Thread(target=body, name=f"orbax_flax-save-{self.path}", daemon=True)
    atexit.register(self._finish_at_exit)
    self._thread.start()

  def _finish_at_exit(self) -> None:
    if not self.cancelled.is_set():
      self.join()

  def run_here(self, work: Callable[[], None]) -> None:
    """Runs ``work`` in the caller's thread (a blocking save)."""
    try:
      work()
    except BaseException as e:  # pylint: disable=broad-except
      self._error = e
    self._ended()

  def cancel(self) -> None:
    """Makes sure this save never commits (if it has not already), and stops its writing.

    The background phase stops within about a second (it writes in batches and
    checks between them), before the commit, and ``wait()`` raises
    ``SaveCancelledError``, here and, in a multi-process save, on every other
    process. Used when a preemption grace period runs out. A process other than
    0 that cancels after it finished writing cannot stop process 0's commit.
    A cancelled save never keeps the process from exiting. The next save does
    not raise this cancellation again.
    """
    self.cancelled.set()

  def done(self) -> bool:
    """True once the background phase finished (committed or failed)."""
    return self._thread is None or self._over.is_set()

  def wait(self, timeout: float | None = None) -> None:
    """Blocks until committed; re-raises a background error.

    Raises:
      TimeoutError: if ``timeout`` seconds pass first.
    """
    if self._thread is not None and self._thread is not threading.current_thread():
      if not self._join(timeout):
        raise TimeoutError(f"save to {self.path} still running after {timeout} s")
    if self._error is not None:
      self._reported = True
      raise self._error

  def join(self, timeout: float | None = None) -> bool:
    """Blocks until the background phase ends (at most ``timeout`` s); True if it has. Raises nothing."""
    if self._thread is not None and self._thread is not threading.current_thread():
      self._join(timeout)
    return self.done()

  def _join(self, timeout: float | None) -> bool:
    """Waits for the background phase, then for its thread's last lines (they free the save's
    tensorstore objects: a process that exits first may abort)."""
    if not self._over.wait(timeout):
      return False
    self._thread.join()  # it has ended its work: milliseconds
    return True

  def unreported_error(self) -> BaseException | None:
    """The error nobody has seen (a cancellation someone asked for does not count)."""
    if self._error is None or self._reported:
      return None
    if isinstance(self._error, errors.SaveCancelledError) and self.cancelled.is_set():
      return None
    return self._error

  def mark_reported(self) -> None:
    self._reported = True

  def __del__(self, _finalizing=sys.is_finalizing) -> None:
    # (bound at definition: at interpreter exit this module's globals may be None already)
    error = None if _finalizing() else self.unreported_error()
    if error is not None:  # dropped with an error nobody waited for: say it, once
      log.error("save to %s failed and nobody waited for it: %s: %s", self.path,
                type(error).__name__, error)

  def __repr__(self) -> str:
    state = "running" if not self.done() else ("failed" if self._error else "committed")
    return f"AsyncSave({self.path!r}, {state})"


# ----------------------------------------------------------------------------
# The two ways a save runs.


def start(plan: _planning.Plan, key: str, timeout_s: float,
          started: float) -> tuple[SaveRun, AsyncSave]:
  """The run and the handle of a planned save (``key``: its coordination prefix)."""
  handle = AsyncSave(plan.loc, plan.nbytes, started)
  return SaveRun(plan, key, timeout_s, handle.cancelled), handle


def save(plan: _planning.Plan, run: SaveRun, handle: AsyncSave, *, staging: _staging.Staging,
         max_host_bytes: int, watchdog_seconds: float) -> None:
  """Runs a blocking save in the caller's thread; ``handle.wait()`` then raises its error.

  Array blocks are written from views of the device buffers; packed small
  arrays are assembled in ``staging`` (kept warm if its owner keeps it).
  """
  def work() -> None:
    error = None
    try:
      materialize = lambda ps: host_views(ps, staging)  # noqa: E731
      for r in split_rounds(plan.pieces, max_host_bytes):
        run.write(r, materialize=materialize, max_batch_bytes=max_host_bytes)
    except BaseException as e:  # pylint: disable=broad-except  # shared, then raised
      error = e
    run.finish(error)

  with _progress.Monitor(run.progress, watchdog_seconds, terminal=False):
    handle.run_here(work)


def save_async(plan: _planning.Plan, run: SaveRun, handle: AsyncSave, *, host_transfer: str,
               staging: _staging.Staging, max_host_bytes: int, watchdog_seconds: float,
               cancellable: bool, keep: Callable[[Any], bool], on_end: Callable[[], None]) -> None:
  """Takes the snapshot here (phase one), then writes and commits in ``handle``'s thread.

  ``keep(array)`` names pinned host arrays that are a snapshot already (see
  :func:`to_pinned_host`); ``on_end`` runs once the save is over, either way.
  A failure of phase one is shared with the other processes, then raised.
  """
  try:
    last, materialize = _stage(plan, run, transfer(host_transfer, _sources(plan.pieces)),
                               staging, max_host_bytes, keep)
  except BaseException as e:
    handle.run_here(lambda: run.finish(e))  # tells the other processes, then raises
    on_end()
    handle.wait()
    raise
  handle.blocking_s = time.perf_counter() - handle.started

  def work() -> None:
    try:
      with _progress.Monitor(run.progress, watchdog_seconds, terminal=False):
        error = None
        try:
          run.write(last, materialize=materialize, cancellable=cancellable)
        except BaseException as e:  # pylint: disable=broad-except
          error = e
        run.finish(error)
    finally:
      on_end()

  handle.run_in_background(work)


def _stage(plan: _planning.Plan, run: SaveRun, how: str, staging: _staging.Staging, budget: int,
           keep: Callable[[Any], bool]) -> tuple[list[Piece], Callable[..., None] | None]:
  """Phase one: snapshots every round; writes all but the last (over the budget).

  Returns the last round and how its host data is made per batch (None: ready).
  """
  if how == "pinned_host" and not budget:
    to_pinned_host(plan.pieces, keep=keep)
    return plan.pieces, host_views
  stage = host_views if how == "pinned_host" else (lambda ps: snapshot(ps, staging))
  rounds = split_rounds(plan.pieces, budget)
  for r in rounds[:-1]:  # over the budget: written while the caller waits
    stage(r)
    run.write(r)
  if how == "pinned_host":  # written after the caller goes on: a copy
    to_pinned_host(rounds[-1], keep=keep)
  stage(rounds[-1])
  return rounds[-1], None


def _sources(pieces: Sequence[Piece]):
  return (s.value for p in pieces for s in p.sources)


def transfer(host_transfer: str, values: Any) -> str:
  """How an async save snapshots ``values``: ``host_transfer``, or for "auto" "memcpy" on
  CPU (device buffers are host memory) and "pinned_host" on GPU/TPU.

  Example:
    >>> transfer("auto", [np.ones(2)]), transfer("pinned_host", [])
    ('memcpy', 'pinned_host')
  """
  if host_transfer != "auto":
    return host_transfer
  for v in values:
    if isinstance(v, jax.Array):
      # next(iter(...)), never .pop(): devices() is the sharding's own cached set.
      return "memcpy" if next(iter(v.devices())).platform == "cpu" else "pinned_host"
  return "memcpy"


# ----------------------------------------------------------------------------
# Bringing the bytes to the host.


def _start_transfers(pieces: Sequence[Piece]) -> None:
  """Starts every device-to-host copy at once (nothing to do on the CPU backend)."""
  for p in pieces:
    for s in p.sources:
      v = s.value
      if isinstance(v, jax.Array) and v.sharding.memory_kind != "pinned_host":
        if next(iter(v.devices())).platform == "cpu":
          return  # host memory already: views are free
        v.copy_to_host_async()


def _fill_pairs(piece: Piece, packed: bool,
                buf: np.ndarray | None) -> list[tuple[np.ndarray, np.ndarray]]:
  """(source, destination) copies that fill ``buf`` with ``piece``'s bytes (a host view of
  each source: ``np.asarray`` of a CPU or pinned-host array copies nothing)."""
  if not packed:
    s = piece.sources[0]
    src = np.asarray(s.value)
    return [(src if s.within is None else src[s.within], buf)]
  pairs = []
  for s in piece.sources:
    n = math.prod(s.leaf_shape) * s.leaf_dtype.itemsize
    leaf = buf[s.offset:s.offset + n].view(s.leaf_dtype).reshape(s.leaf_shape)
    pairs.append((np.asarray(s.value), leaf[s.index] if s.index else leaf))
  return pairs


def host_views(pieces: Sequence[Piece], staging: _staging.Staging | None = None) -> None:
  """Host data for a blocking save: views where possible (one host copy per shard at most).

  Array blocks are views of the device buffers (zero-copy on CPU; one
  device-to-host copy each on accelerators, all started at once); packed
  buffers are assembled in ``staging``'s memory, or fresh memory.
  """
  _start_transfers(pieces)
  flags = [p.packed for p in pieces]
  packed = [p for p, f in zip(pieces, flags) if f]
  specs = [(p.shape, p.dtype) for p in packed]
  bufs = staging.arrays(specs) if staging is not None else _staging.fresh_arrays(specs)
  pairs = []
  for p, buf in zip(packed, bufs):
    pairs += _fill_pairs(p, True, buf)
    p.data = buf
  _staging.copy_all(pairs)
  for p, f in zip(pieces, flags):
    if not f:
      (src, _), = _fill_pairs(p, False, None)
      p.data = src


def snapshot(pieces: Sequence[Piece], staging: _staging.Staging) -> None:
  """Copies every block into ``staging``'s memory (the CPU path of an async save)."""
  _start_transfers(pieces)
  bufs = staging.arrays([(p.shape, p.dtype) for p in pieces])
  flags = [p.packed for p in pieces]
  pairs = []
  for p, f, buf in zip(pieces, flags, bufs):
    pairs += _fill_pairs(p, f, buf)
    p.data = buf
  staging.copy(pairs)


def to_pinned_host(pieces: Sequence[Piece], keep=lambda value: False) -> None:
  """Starts a copy of every device source into pinned host memory, all in one call.

  The accelerator path of an async save: it returns before the copies finish.
  XLA orders each copy before any later computation that donates or
  overwrites the source, so the snapshot is exact. Arrays already in pinned
  host memory (the caller's, e.g. host-offloaded optimizer state) are copied
  like any other, except those ``keep(array)`` says are a snapshot already
  (the checkpointer's own, :meth:`Checkpointer.host_snapshot`). numpy sources
  (which the caller could change) are copied now. :func:`host_views` later
  turns the pinned arrays into host views, without another copy.
  """
  sources = [s for p in pieces for s in p.sources]
  device = [s for s in sources if isinstance(s.value, jax.Array) and not keep(s.value)]
  if device:
    shardings = [s.value.sharding.with_memory_kind("pinned_host") for s in device]
    for s, pinned in zip(device, jax.device_put([s.value for s in device], shardings,
                                                may_alias=False)):
      s.value = pinned
  for s in sources:
    if isinstance(s.value, np.ndarray):
      s.value = np.array(s.value)


def pin_on_host(tree: Any) -> Any:
  """``tree`` with every device array copied into pinned host memory, in one call.

  The snapshot a step due in both tiers shares (accelerators): the local tier
  reads these host arrays and the persistent save adopts them as its own
  snapshot (:func:`to_pinned_host` keeps the ones its ``keep`` names), so the
  state crosses to the host once. Arrays already in pinned host memory are
  copied too: the caller may donate them once this returns.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  moved = [k for k, x in enumerate(leaves) if isinstance(x, jax.Array)
           and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
  if moved:
    pinned = jax.device_put([leaves[k] for k in moved],
                            [leaves[k].sharding.with_memory_kind("pinned_host") for k in moved],
                            may_alias=False)
    for k, x in zip(moved, pinned):
      leaves[k] = x
  return jax.tree_util.tree_unflatten(treedef, leaves)


def split_rounds(pieces: Sequence[Piece], budget: int) -> list[list[Piece]]:
  """Groups pieces into rounds of at most ``budget`` bytes (a larger piece is alone).

  Example:
    >>> from orbax_flax.engine._planning import StoredArray
    >>> a = StoredArray("i", "a0", (8,), "uint8", (8,))
    >>> ps = [Piece(a, (), (n,), np.dtype(np.uint8), []) for n in (4, 4, 9, 1)]
    >>> [[p.nbytes for p in r] for r in split_rounds(ps, 8)]
    [[4, 4], [9], [1]]
  """
  if not budget:
    return [list(pieces)]
  return [[pieces[i] for i in r]
          for r in _layout.split_by_size([p.nbytes for p in pieces], budget)]
