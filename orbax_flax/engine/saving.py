"""One save, top to bottom: the handle, the blocking phase, the background phase, the commit.

A save runs in two phases (:class:`orbax_flax.Checkpointer` starts them and
owns the staging memory they use); this module reads in their order.

1. Blocking, in the caller's thread: the items are planned
   (:class:`orbax_flax.engine._planning.Planner`), then, for an async save, a snapshot
   is taken that the caller cannot change any more. The transfer is chosen
   per platform (:func:`transfer`): on CPU, in a single-process job without
   ``max_host_bytes``, for a state up to ``DEVICE_COPY_MAX_BYTES``,
   :func:`copy_leaves`, one copy by XLA of every array into new buffers (the
   shards the save writes are found on the copies in the background); otherwise on
   CPU, and on TPU without ``max_host_bytes``,
   :func:`snapshot`, a copy into the checkpointer's reused staging memory of what
   is not a private host copy already (on TPU each shard's device-to-host copy
   is one: it is kept as it is); on GPU, and on TPU with ``max_host_bytes``, a
   device-to-host transfer into pinned host memory that is only
   *started* here (:func:`to_pinned_host`): XLA orders it before any later
   computation that donates the arrays. A state over ``max_host_bytes`` is staged in rounds
   (:func:`split_rounds`): all but the last are written while the caller waits.
2. Background, in the thread of the :class:`AsyncSave`: :class:`SaveRun`, one save
   on one process, writes the last round, then the processes agree on the verdict
   and process 0 commits (:func:`commit`).

A blocking save (:func:`save`) writes array blocks straight from views of
the device buffers; only packed small arrays are assembled in staging memory.

In the background, a :class:`SaveRun`'s blocks (host data ready, or
made per batch) go into this process's own OCDBT database with tensorstore
(:mod:`orbax_flax.format._tsio`), in batches of about half a second for a save that
may be cancelled, so that a cancellation stops the writing within about a
second; then fsync, then the verdict. With several processes the verdict is
agreed through the coordination service and process 0 commits (:func:`commit`,
below: the manifest written last, made visible atomically; or :func:`discard`);
every process learns the same outcome.

The commit: on a local file system the checkpoint is written to a sibling
``<name>.ofx-tmp-<generation>`` directory (:func:`target`) that is renamed into
place; an overwrite swaps the two directories atomically with ``renameat2``,
or, where paths cannot be swapped (NFS), moves the new databases in and
replaces the manifest. On an object store the manifest ``_CHECKPOINT`` is
written last; data of other generations under the prefix is garbage,
recognisable because the manifest does not name it.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from orbax_flax.engine import _planning
from orbax_flax.core import _location
from orbax_flax.core import _multihost
from orbax_flax.core import _progress
from orbax_flax.core import _staging
from orbax_flax.format import _layout
from orbax_flax.format import _manifest
from orbax_flax.format import _tsio
from orbax_flax.format import step_dir
from orbax_flax.differential import refs
from orbax_flax import errors
from orbax_flax.core._location import Location
from orbax_flax.engine._planning import Piece
from orbax_flax.engine._planning import TMP_MARKER

log = logging.getLogger("orbax_flax")

HOST_TRANSFERS = ("auto", "memcpy", "device_copy", "pinned_host")
# "auto" takes the device_copy transfer on CPU for a copy of at most this many bytes: above
# it, XLA's new buffers may be fresh pages (benchmarks/README.md, item 5).
DEVICE_COPY_MAX_BYTES = 256 << 20

# Writes go out in batches of about half a second each (two in flight), so that a
# cancelled save stops writing within about a second.
_FIRST_BATCH_BYTES = 128 << 20
_MIN_BATCH_BYTES = 64 << 20
_MAX_BATCH_BYTES = 4 << 30
_BATCH_SECONDS = 0.5
# Seconds a failed or cancelled save waits for its batches in flight before its cleanup.
_SETTLE_S = 30.0


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
    transfer: how an async save took its snapshot on this process: "device_copy",
      "memcpy" or "pinned_host" (see ``Checkpointer``'s ``host_transfer``); None for
      a blocking save.
  """

  def __init__(self, path: Location, nbytes: int, started: float):
    self.path = str(path)
    self.loc = path
    self.nbytes = nbytes
    self.blocking_s = 0.0
    self.total_s: float | None = None
    self.started = started
    self.stored_bytes: dict[str, int] | None = None
    self.transfer: str | None = None
    self._error: BaseException | None = None
    self._reported = False
    self._thread: threading.Thread | None = None
    # Set once the background phase has ended. Waited on before Thread.join (which then
    # waits only for the thread's last lines): a Ctrl-C that interrupts Thread.join on
    # Python 3.11 marks a running thread as stopped.
    self._over = threading.Event()
    self._began = threading.Event()  # set first thing by the background thread
    self._pid = os.getpid()  # the process whose exit waits for it (not a forked child)
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

  def run_in_background(self, work: Callable[[], None],
                        fail: Callable[[BaseException], None]) -> None:
    """Runs ``work`` in a daemon thread; at interpreter exit it still commits unless cancelled.

    A KeyboardInterrupt (Ctrl-C) while the thread starts (``Thread.start`` waits for it) leaves
    the save running where its caller never learns of it: it is cancelled before the
    interrupt goes on (it never commits), and runs to its end like any cancelled save.
    A thread that cannot be made (a thread limit) ends the save here with a RuntimeError
    naming the limit: ``fail(error)`` does what ``work`` would have done after an error
    (tells the other processes, removes what the save wrote), in the caller's thread.
    """
    def body() -> None:
      self._began.set()
      try:
        work()
      except BaseException as e:  # pylint: disable=broad-except  # Re-raised in wait().
        self._error = e
      finally:
        atexit.unregister(self._finish_at_exit)
        if self._error is not None:
          # Failed before the exit: if nobody has seen the error when the program ends,
          # say it then (a handle alive at exit is finalized silently). A weak reference:
          # a handle dropped before says it itself (__del__).
          atexit.register(_report_at_exit, weakref.ref(self))
        try:
          self._ended()
        finally:
          self._over.set()
    self._thread = threading.Thread(target=body, name=f"orbax_flax-save-{self.path}", daemon=True)
    atexit.register(self._finish_at_exit)
    try:
      self._thread.start()
    except RuntimeError as e:  # no thread was made (Thread.start raises only then)
      self.cancel()
      self._never_ran(e, fail)
    except BaseException:
      self.cancel()
      # A thread is made in microseconds and runs at once: not begun after seconds, the
      # interrupt came before it was made. Then a new one runs the (cancelled) save to its end.
      if not self._began.wait(_THREAD_START_S):
        self._thread = threading.Thread(target=body, name=f"orbax_flax-save-{self.path}",
                                        daemon=True)
        try:
          self._thread.start()
        except RuntimeError as e:
          try:
            self._never_ran(e, fail)
          except RuntimeError:
            pass  # ended; the interrupt is what the caller hears
      raise

  def _never_ran(self, cause: RuntimeError, fail: Callable[[BaseException], None]) -> None:
    """Ends a save whose thread could not be made (raises): it never wrote nor committed, and
    ``wait()``/``join()``, the checkpointer's next save and ``close()`` return (with this error
    where they raise one) instead of waiting for a thread that does not exist."""
    error = RuntimeError(
        f"the save to {self.path} could not start its background thread ({cause}): this"
        " process is at its limit of threads (ulimit -u, a container's pids.max) or of memory"
        " for thread stacks. The save did not commit; the checkpoints saved before are intact."
        " Fix: raise the limit, or start fewer threads (data loader workers); a blocking save"
        " (async_save=False) needs no thread of its own.")
    error.__cause__ = cause
    atexit.unregister(self._finish_at_exit)
    self._thread = None
    try:
      fail(error)
    except BaseException:  # pylint: disable=broad-except  # it raises ``error``, raised below
      pass
    self._error, self._reported = error, True  # raised here, not again by the next call
    try:
      self._ended()
    finally:
      self._over.set()
    raise error

  def _finish_at_exit(self) -> None:
    """Joins the save at interpreter exit, and says so if it failed (nobody can wait for it
    any more, and the handle's ``__del__`` logs nothing while the interpreter finalizes)."""
    # Not in a child forked while the save ran: its copy of the save has no thread to wait for.
    if not self.cancelled.is_set() and os.getpid() == self._pid:
      self.join()
      self._report_unseen("while the program was exiting")

  def _report_unseen(self, when: str) -> None:
    """Logs the error nobody has seen (once)."""
    error = self.unreported_error()
    if error is not None:
      self.mark_reported()
      log.error("save to %s failed %s, and nobody waited for it: %s: %s. It did not commit;"
                " the checkpoints saved before are intact. Call wait() on the handle (or"
                " close() the checkpointer) before the program ends to see such an error"
                " where it happens.", self.path, when, type(error).__name__, error)

  def run_here(self, work: Callable[[], None]) -> None:
    """Runs ``work`` in the caller's thread (a blocking save)."""
    try:
      work()
    except BaseException as e:  # pylint: disable=broad-except
      self._error = e
    self._ended()

  def cancel(self) -> None:
    """Makes sure this save never commits (if it has not already), and stops its writing if it can.

    A save started with ``cancellable=True`` stops writing within about a second
    (it writes in batches and checks between them); any other save writes out
    what it was handed. Either way it stops before the commit, and ``wait()`` raises
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


def _report_at_exit(handle: weakref.ref) -> None:
  """At exit: the error of a save that failed earlier and is still unseen (its handle alive)."""
  h = handle()
  if h is not None:
    h._report_unseen("before the program ended")  # pylint: disable=protected-access


def start(plan: _planning.Plan, key: str, timeout_s: float,
          started: float) -> tuple[SaveRun, AsyncSave]:
  """The run and the handle of a planned save (``key``: its coordination prefix)."""
  handle = AsyncSave(plan.loc, plan.nbytes, started)
  return SaveRun(plan, key, timeout_s, handle), handle


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


# How long a save's thread may take to begin before a Ctrl-C in its start counts as having
# come before the thread was made (see AsyncSave.run_in_background).
_THREAD_START_S = 5.0


def save_async(plan: _planning.Plan, run: SaveRun, handle: AsyncSave, *, host_transfer: str,
               staging: _staging.Staging, max_host_bytes: int, watchdog_seconds: float,
               cancellable: bool, keep: Callable[[Any], bool], on_end: Callable[[], None]) -> None:
  """Takes the snapshot here (phase one), then writes and commits in ``handle``'s thread.

  ``keep(array)`` names pinned host arrays that are a snapshot already (see
  :func:`to_pinned_host`); ``on_end`` runs once the save is over, either way.
  A failure of phase one is shared with the other processes, then raised.
  """
  try:
    how = handle.transfer = transfer(host_transfer, _leaves(plan), max_host_bytes, plan)
    copies = None
    if how == "device_copy":
      copies = copy_leaves(plan)
      # Packed small arrays are assembled in fresh memory, batch by batch: with two batches in
      # flight (cancellable) the staging arena, reused from its start by every call, would
      # overwrite a batch tensorstore has not written yet. The arena is not used: let it go.
      staging.release()
      last, materialize = [], host_views
    else:
      plan.pieces = plan.bind(plan.leaves)
      last, materialize = _stage(plan, run, how, staging, max_host_bytes, keep)
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
          # The device copy's shards, found here rather than while the caller waits.
          pieces = last if copies is None else plan.bind(copies)
          run.write(pieces, materialize=materialize, cancellable=cancellable)
        except BaseException as e:  # pylint: disable=broad-except
          error = e
        run.finish(error)
    finally:
      on_end()

  def fail(error: BaseException) -> None:
    try:
      run.finish(error)
    finally:
      on_end()

  handle.run_in_background(work, fail)


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


def _leaves(plan: _planning.Plan):
  return (x for xs in plan.leaves.values() for x in xs)


def transfer(host_transfer: str, values: Any, budget: int, layout: Any = None) -> str:
  """How an async save snapshots ``values`` (``budget``: its ``max_host_bytes``, 0 for none;
  ``layout``: its plan or layout, for the size of a device copy): :func:`choose_transfer`
  on the platform of the first device array.

  Example:
    >>> transfer("auto", [np.ones(2)], 0), transfer("pinned_host", [], 0)
    ('memcpy', 'pinned_host')
  """
  # A device copy of arrays that span processes is a multi-process program each: "auto" takes
  # it in a single-process job only, where the processes' choices cannot differ.
  single = _multihost.process_count() == 1
  # Only device arrays gain from it (numpy ones are copied on the host either way).
  gains = layout is not None and single and layout.copied
  copy = (layout.copy_bytes, layout.nbytes) if gains else (0, 0)
  for v in values:
    if isinstance(v, jax.Array):
      # next(iter(...)), never .pop(): devices() is the sharding's own cached set.
      return choose_transfer(host_transfer, next(iter(v.devices())).platform, budget, *copy)
  return choose_transfer(host_transfer, "cpu", budget, *copy)


def choose_transfer(host_transfer: str, platform: str, budget: int, copy_bytes: int = 0,
                    nbytes: int = 0) -> str:
  """``host_transfer``, or for "auto": on CPU "device_copy" for a small state, else "memcpy"
  (device buffers are host memory); "memcpy" on TPU; "pinned_host" on GPU and on a TPU with
  a ``max_host_bytes`` budget.

  "device_copy" (:func:`copy_leaves`) copies every device array into new buffers in one
  call, with no Python per shard, where "memcpy" spends a few microseconds of Python on
  each shard before its copy (at 50 MB in 2,140 shards, half the caller's wait). "auto"
  takes it on CPU in a single-process job when the copy (``copy_bytes``, numpy leaves
  included, see :attr:`~orbax_flax.engine._planning.Plan.copy_bytes`) is at most
  ``DEVICE_COPY_MAX_BYTES`` and at most 1.25x the ``nbytes`` this process writes (it
  copies replicas too), without a budget. A larger copy goes into the staging memory that
  ``Checkpointer.prepare`` touches ahead; XLA's new buffers cannot be.

  On a TPU v5e (``benchmarks/host_transfer.py``, 2 GB) a transfer into pinned host
  memory took 1.8 s to land and 0.7 s more to read on the host, and the async
  save 10.8 s in all; ``copy_to_host_async`` and ``np.asarray`` of every shard
  took 0.26 s, and that save 3.4 s. But JAX keeps such a device-to-host copy on
  the array it was made from (for as long as the caller keeps the array), so
  under a budget, where the rounds' copies must not add up, the pinned transfer
  (new arrays, freed round by round) is taken. GPUs were not measured here:
  they keep the pinned transfer, whose blocking phase only starts the copies.

  Example:
    >>> [choose_transfer("auto", p, b) for p, b in [("cpu", 0), ("cpu", 1 << 30),
    ...                                           ("tpu", 0), ("tpu", 1 << 30), ("gpu", 0)]]
    ['memcpy', 'memcpy', 'memcpy', 'pinned_host', 'pinned_host']
    >>> [choose_transfer("auto", "cpu", 0, c, n) for c, n in [(50e6, 50e6), (100e6, 50e6),
    ...                                                        (2e9, 2e9)]]
    ['device_copy', 'memcpy', 'memcpy']
    >>> choose_transfer("memcpy", "gpu", 0)
    'memcpy'
  """
  if host_transfer != "auto":
    return host_transfer
  if platform == "cpu":
    small = 0 < copy_bytes <= min(DEVICE_COPY_MAX_BYTES, 1.25 * nbytes)
    return "device_copy" if small and not budget else "memcpy"
  if platform == "tpu" and not budget:
    return "memcpy"
  return "pinned_host"


def is_host_copy(value: Any) -> bool:
  """Whether ``np.asarray(value)`` makes a private copy on the host: ``value`` is an array
  (or shard) in an accelerator's own memory, so its host copy is a device-to-host
  transfer that nobody else can change, and a later donation cannot touch.

  Example:
    >>> is_host_copy(np.ones(2)), is_host_copy(jax.numpy.ones(2, device=jax.devices("cpu")[0]))
    (False, False)
  """
  return (isinstance(value, jax.Array) and value.sharding.memory_kind == "device"
          and next(iter(value.devices())).platform != "cpu")


def staged(piece: Piece, how: str, value_of: Callable[[Any], Any] = lambda value: value) -> bool:
  """Whether an async save of transfer ``how`` copies ``piece`` into staging memory: packed
  pieces, and with "memcpy" (:func:`snapshot`) views too (CPU device buffers, numpy arrays),
  not private host copies. ``value_of`` turns a source's value into the array (for pieces
  not bound yet)."""
  if how != "memcpy":  # pinned_host stages packed pieces only; device_copy nothing
    return piece.packed and how == "pinned_host"
  return piece.packed or not is_host_copy(value_of(piece.sources[0].value))


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
  """Host data no later change or donation can touch (the CPU and TPU path of an async save).

  Blocks that are views (CPU device buffers, the caller's numpy arrays) and
  packed small arrays are copied into ``staging``'s memory; a shard in an
  accelerator's memory is kept as its device-to-host copy, which is private
  already (:func:`is_host_copy`): copying it again would only cost time and memory.
  """
  _start_transfers(pieces)
  flags = [staged(p, "memcpy") for p in pieces]
  copied = [p for p, f in zip(pieces, flags) if f]
  bufs = staging.arrays([(p.shape, p.dtype) for p in copied])
  pairs = []
  for p, buf in zip(copied, bufs):
    pairs += _fill_pairs(p, p.packed, buf)
    p.data = buf
  staging.copy(pairs)
  for p, f in zip(pieces, flags):  # after the staging copy: the transfers had that long
    if not f:
      (src, _), = _fill_pairs(p, False, None)
      p.data = src


def copy_leaves(plan: _planning.Plan) -> dict[str, list[Any]]:
  """The "device_copy" snapshot: the plan's leaves, each array copied into new buffers.

  Every device array is copied by XLA, all in one call (a fully replicated one
  once, from its first shard, the one the save writes), into new buffers of its
  sharding; numpy arrays are copied on the host. Returns when the copies are
  done, so that the caller may change or donate its arrays. Which shards the
  save writes is found on the copies afterwards (:meth:`Plan.bind`), in the
  background.
  """
  out = {item: list(leaves) for item, leaves in plan.leaves.items()}
  where, arrays = [], []
  for item, i, replicated in plan.layout.copied:
    x = _planning.stored_leaf(out[item][i])
    where.append((item, i))
    arrays.append(x.addressable_data(0) if replicated else x)
  copies = jax.device_put(arrays, [x.sharding for x in arrays], may_alias=False)
  jax.block_until_ready(copies)
  for (item, i), x in zip(where, copies):
    out[item][i] = x
  for leaves in out.values():
    for i, x in enumerate(leaves):
      if isinstance(x, np.ndarray):
        leaves[i] = np.array(_planning.stored_leaf(x))
  return out


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


# ----------------------------------------------------------------------------
# Phase two: one save on one process, in the background.


class SaveHooks:
  """What a save asks, at four points of its background phase, of a plug-in that changes
  what is written; this class is the plain save's answer (write everything, add nothing).

  A differential save plugs in :class:`orbax_flax.differential.differ.Differ`, which has
  the same four methods; :class:`orbax_flax.Checkpointer` chooses, per save.

  * :meth:`agree`: once the generation is agreed (every process);
  * :meth:`select`: per batch about to be written, the pieces to write;
  * :meth:`publish`: every process before it reports its status (several processes);
  * :meth:`complete`: process 0, the manifest before it is written.
  """

  def agree(self, key: str, timeout_s: float) -> None:
    del key, timeout_s

  def select(self, pieces: Sequence[Piece]) -> Sequence[Piece]:
    return pieces

  def publish(self, key: str, error: BaseException | None, timeout_s: float) -> None:
    del key, error, timeout_s

  def complete(self, manifest: dict[str, Any], key: str, timeout_s: float) -> dict[str, Any]:
    del key, timeout_s
    return manifest


PLAIN = SaveHooks()  # the hooks of a plain save (it has no state)


class SaveRun:
  """One save on one process: agree on a generation, write, agree on the verdict, commit.

  The verdict is one key of the coordination service that can be set only
  once (process 0's "commit", or an abort from whichever process gives up
  first), so every process learns the same outcome. A process that stops
  waiting never deletes data another process may still be writing.

  Args:
    plan: the plan of the save.
    key: a coordination-service prefix unique to this save, same on every process.
    timeout_s: the deadline of each call to the coordination service and of each wait
      for another process (coordination_timeout_seconds).
    handle: the save's handle: its ``cancelled`` (set by ``AsyncSave.cancel()``), the path and
      bytes its progress reports.

  The keys of a save are deleted by the last process done with them.
  """

  def __init__(self, plan: _planning.Plan, key: str, timeout_s: float, handle: AsyncSave):
    self.plan, self.key, self.timeout_s, self.cancelled = plan, key, timeout_s, handle.cancelled
    self.me, self.nproc = plan.me, plan.nproc  # as planned: one value for the whole save
    self.gen: str | None = None
    self.target: Location | None = None
    self.writer: _tsio.ProcessWriter | None = None  # this process's databases, once begun
    self._ctx = None
    self.bytes_written = 0
    self.progress = _progress.Progress(f"save to {handle.path}", handle.nbytes)
    self.hooks: SaveHooks = PLAIN  # a differential save's Differ, or the plain hooks

  # ---------------------------------------------------------------- writing

  def begin(self) -> None:
    """Agrees on the generation id and creates the temporary directory (process 0).

    The other processes check that they save what process 0 does: the same checkpoint, and
    the same plan (:meth:`~orbax_flax.engine._planning.Plan.layout_digest`; process 0's
    manifest describes every process's data). A plan that differs raises here, before this
    process writes anything, and process 0 names the difference in the verdict.
    """
    if self.gen is not None:
      return
    self.progress.phase = "agreeing on the generation" if self.nproc > 1 else "starting"
    final = self.plan.loc
    where = None  # the target, once the generation is known
    if self.me == 0:
      try:
        gen = uuid.uuid4().hex[:16]
        where = target(final, gen)
        if final.is_local:
          try:
            os.makedirs(os.path.dirname(final.local_path), exist_ok=True)
            os.makedirs(where.local_path)
          except OSError as e:
            raise _location.storage_error(final, "creating the checkpoint directory", e) from e
        # With the name saved to: every process must save the same checkpoint (a process
        # that names another, say one step ahead, fails the save on every process); and
        # with the digest of the plan: process 0's manifest must describe every process's
        # data (a process whose tree differs fails the save on every process).
        digest = self.plan.layout_digest() if self.nproc > 1 else "-"
        _multihost.publish(f"{self.key}/gen", f"{gen} {digest} {final.name}",
                           timeout_s=self.timeout_s)
      except BaseException as e:
        if not isinstance(e, _multihost.CoordinationTimeoutError):
          _multihost.publish(f"{self.key}/gen", f"error: {e}", timeout_s=self.timeout_s)
        raise
    else:
      gen = _multihost.fetch(f"{self.key}/gen", self.timeout_s,
                             waiting_for=f"process 0 to start the save to {final}", missing=[0])
      if gen.startswith(_REFUSED):
        raise _refusal_error(gen)
      if gen.startswith("error: "):
        raise errors.StorageError(f"process 0 could not start the save to {final}: {gen[7:]}")
      gen, digest, name = gen.split(" ", 2)
      if name != final.name:
        raise ValueError(
            f"process 0 saves {name!r} and process {self.me} saves {final.name!r} in the same"
            " save: every process of a job must save the same checkpoint (the same step) at"
            " the same time; one that runs other steps than the others is a bug in the loop")
      if digest != self.plan.layout_digest():
        raise _LayoutDiffers(self.plan.layout_entries(),
                             f"process {self.me} saves another tree than process 0 to {final}"
                             " (process 0 names the difference); nothing was written.")
    self.gen, self.target = gen, where or target(final, gen)
    self._ctx = _tsio.context()
    self.writer = _tsio.ProcessWriter(self.target, self.me, self.gen, self._ctx)
    self.hooks.agree(self.key, self.timeout_s)

  def write(self, pieces: Sequence[Piece], materialize: Callable[[Sequence[Piece]], None] | None = None,
            max_batch_bytes: int = 0, cancellable: bool = False) -> None:
    """Writes the pieces (host data ready, or made by ``materialize`` per batch).

    One batch (one commit per database), unless ``max_batch_bytes`` bounds
    it, or ``cancellable``: then batches take about half a second of writing
    each, two in flight, and a cancellation is noticed between them (the
    writing stops within about a second; a little slower overall).
    """
    self.begin()
    self.progress.phase = "writing"
    cap = max_batch_bytes or (_MAX_BATCH_BYTES if cancellable else 1 << 62)
    limit = min(cap, _FIRST_BATCH_BYTES) if cancellable else cap
    pieces = list(pieces)
    sizes = [p.nbytes for p in pieces]
    in_flight: list[tuple[list[Piece], int]] = []  # batches being committed (and their bytes)
    i = 0
    began = time.perf_counter()
    try:
      while i < len(pieces):
        self.check_cancelled()
        batch, size = [], 0
        while i < len(pieces) and (not batch or size + sizes[i] <= limit):
          batch.append(pieces[i])
          size += sizes[i]
          i += 1
        if materialize is not None:
          materialize(batch)
        for p in self.hooks.select(batch):
          a = p.array
          self.writer.add(a.item, a.name, a.shape, a.dtype, a.chunk_shape, p.slices, p.data)
        # Two batches in flight: the next one is issued while this one commits.
        self.writer.flush(depth=2)
        in_flight.append((batch, size))
        if len(in_flight) > 1:  # the oldest batch is committed by now
          self._done(*in_flight.pop(0))
          if cancellable:
            rate = self.bytes_written / max(time.perf_counter() - began, 1e-3)
            limit = int(min(cap, max(_MIN_BATCH_BYTES, rate * _BATCH_SECONDS)))
      self.writer.wait()
    except BaseException as e:
      # The batches in flight end before the error goes on: its cleanup removes their
      # directory, and one still writing would put files back there (a leftover the size of
      # a batch) from host memory the next save may be filling.
      # (Not after a store that did not answer: its batches wait for the same store.)
      if not _location.unanswered(e) and not self.writer.settle(_SETTLE_S):
        log.warning("save to %s: a batch was still being written %.0f s after the save"
                    " stopped (%s); its files may stay in %s, a leftover: a"
                    " CheckpointManager's sweep removes it where the save was one of its steps;"
                    " else remove it by hand", self.plan.loc, _SETTLE_S, type(e).__name__,
                    self.target)
      if isinstance(e, ValueError):
        raise _location.storage_error(self.plan.loc, "writing array data", e) from e
      raise
    for batch, size in in_flight:
      self._done(batch, size)

  def _done(self, batch: Sequence[Piece], size: int) -> None:
    """``batch`` (``size`` bytes) is committed: its views or host copies are no longer needed."""
    for p in batch:
      p.data = None
    self.bytes_written += size
    self.progress.add(size)

  def check_cancelled(self) -> None:
    if self.cancelled.is_set():
      raise errors.SaveCancelledError(
          f"save to {self.plan.loc} was cancelled on process {self.me} before it"
          " committed; nothing was committed.")

  def _sync(self) -> None:
    if self.target is None or not self.target.is_local:
      return
    try:
      self._sync_local()
    except OSError as e:
      raise _location.storage_error(self.plan.loc, "syncing the written data to disk", e) from e

  def _sync_local(self) -> None:
    items = set()
    for db in self.writer.databases:
      items.add(db.split("/")[0])
      path = os.path.join(self.target.local_path, db)
      if os.path.isdir(path):
        _location.fsync_tree(path)
    for item in sorted(items):
      path = os.path.join(self.target.local_path, item)
      if os.path.isdir(path):
        _location.fsync_dir(path)

  # ---------------------------------------------------------------- the verdict

  def finish(self, error: BaseException | None) -> None:
    """Reports this process's result, learns the job's verdict; process 0 commits.

    Raises the local error, or the verdict's error, on every process alike.
    """
    if error is None:
      try:
        self._sync()
      except OSError as e:
        error = e
    if self.nproc == 1:
      if error is None:
        try:
          self.check_cancelled()
          self._commit()
          return
        except BaseException as e:
          error = e
      self._discard(error)
      raise error
    status = _status(error)
    self.progress.phase = "waiting for every process to finish writing"
    answered = True
    try:
      self.hooks.publish(self.key, error, self.timeout_s)
      _multihost.arrive(f"{self.key}/status", status, timeout_s=self.timeout_s)
      if self.me != 0:
        self._follow(error)
      else:
        self._lead(error)
    except _multihost.CoordinationTimeoutError as e:
      if e.missing != [0] or self.me == 0:  # only the service's silence is handled here
        raise
      answered = False
      self._unanswered(e, error)
    finally:
      if answered:
        self._leave()

  def _leave(self) -> None:
    """Every key of this save is read: the last process deletes them (cleanup: if the service
    does not answer, they stay, a few bytes, rather than replace the save's outcome)."""
    try:
      _multihost.leave(self.key, timeout_s=self.timeout_s)
    except _multihost.CoordinationTimeoutError as e:
      log.warning("save to %s: its keys stay in the coordination service: %s", self.plan.loc, e)

  def _unanswered(self, e: _multihost.CoordinationTimeoutError,
                  error: BaseException | None) -> None:
    """A call into the coordination service got no answer in time (process 0, its host, is
    stopped or hung): raises this process's verdict without waiting any longer.

    A process that never reported its part written (``error``) knows that
    nothing can commit: process 0 commits only on every process's "ok". One
    that did report it cannot know whether process 0 decided to commit before
    it stopped answering. Either way this process's abort is posted: it reaches
    the service when it answers again, before process 0's decision if that was
    not taken yet, and the others then learn this verdict.
    """
    if error is not None:
      text = (f"save to {self.plan.loc} aborted by process {self.me}: it failed"
              f" ({_describe(error)}) and then {_lower_first(str(e))} Nothing was committed.")
      _multihost.post_claim(f"{self.key}/decision", f"failed: {text}")
      raise errors.StorageError(text) from error
    text = (f"save to {self.plan.loc} aborted by process {self.me}: {_lower_first(str(e))}"
            " This process had written its part: the checkpoint is committed only if process 0"
            " decided so before it stopped answering (`python -m orbax_flax verify"
            f" {self.plan.loc}` tells).")
    _multihost.post_claim(f"{self.key}/decision", f"failed: {text}")
    raise errors.StorageError(text) from e

  def _follow(self, error: BaseException | None) -> None:
    try:
      decision = _multihost.fetch(f"{self.key}/decision", self.timeout_s,
                                  waiting_for="process 0's commit decision", missing=[0])
    except _multihost.CoordinationTimeoutError:
      missing = _multihost.absent(f"{self.key}/status", timeout_s=self.timeout_s)
      who = (f"process(es) {missing} did not finish writing" if missing
             else "process 0 did not decide")
      decision = _multihost.claim(
          f"{self.key}/decision",
          f"failed: save to {self.plan.loc} aborted by process {self.me} after waiting"
          f" {self.timeout_s:g} s (coordination_timeout_seconds): {who}; nothing was committed.",
          timeout_s=self.timeout_s)
    if decision.startswith(_REFUSED):
      raise _refusal_error(decision) from error
    if error is not None:
      if isinstance(error, errors.SaveCancelledError) or decision == "commit":
        raise error
      # The job's verdict, the same on every process; this process's own cause chained.
      raise errors.StorageError(_verdict_text(decision) + f" (on process {self.me}:"
                                f" {type(error).__name__}: {error})") from error
    if decision == "commit":
      try:
        outcome = _multihost.fetch(f"{self.key}/outcome", self.timeout_s,
                                   waiting_for="process 0 to commit", missing=[0])
      except _multihost.CoordinationTimeoutError as e:
        raise errors.StorageError(
            f"process 0 began committing {self.plan.loc} but did not report within"
            f" {self.timeout_s:g} s; the checkpoint may or may not be committed (`python -m"
            " orbax_flax verify` tells).") from e
      if outcome != "ok":
        raise errors.StorageError(outcome)
      return
    _raise_verdict(decision)

  def _lead(self, error: BaseException | None) -> None:
    final = self.plan.loc
    try:
      statuses = _multihost.gather(f"{self.key}/status", self.timeout_s,
                                   what=f"finish writing its part of {final}")
    except _multihost.CoordinationTimeoutError as e:
      decision = _multihost.claim(
          f"{self.key}/decision",
          f"failed: save to {final} aborted by process 0: {e} Nothing was committed; the data"
          " written so far is a leftover, removed by a later save or manager.",
          timeout_s=self.timeout_s)
      # Never delete here: a process that did not report may still be writing.
      if error is not None:
        raise error
      _raise_verdict(decision)
    failed = [(p, s) for p, s in enumerate(statuses) if s != "ok"]
    if not failed and self.cancelled.is_set():  # cancelled after writing, before the decision
      failed = [(0, _CANCELLED)]
    if failed:
      cancelled = [p for p, s in failed if s.startswith(_CANCELLED)]
      differs = [(p, s) for p, s in failed if s.startswith(_LAYOUT)]
      if differs:
        text = self._differs(*differs[0])
      elif cancelled:
        text = (f"cancelled: save to {final} was cancelled on process"
                f" {', '.join(map(str, cancelled))}; nothing was committed.")
      else:
        text = (f"failed: save to {final} failed, nothing was committed: "
                + "; ".join(f"process {p}: {s}" for p, s in failed))
      decision = _multihost.claim(f"{self.key}/decision", text, timeout_s=self.timeout_s)
    else:
      decision = _multihost.claim(f"{self.key}/decision", "commit", timeout_s=self.timeout_s)
    if decision != "commit":
      self._discard(error)  # every process reported: nobody writes any more
      if decision.startswith(_REFUSED):  # the refusing process's error, on every process
        raise _refusal_error(decision) from error
      if error is not None:
        raise error
      _raise_verdict(decision)
    self.progress.phase = "committing"
    try:
      self._commit()
    except BaseException as e:
      _multihost.publish(f"{self.key}/outcome",
                         f"save to {final} failed on process 0, nothing was committed: {e}",
                         timeout_s=self.timeout_s)
      self._discard(e)
      raise
    _multihost.publish(f"{self.key}/outcome", "ok", timeout_s=self.timeout_s)

  def _differs(self, p: int, status: str) -> str:
    """The refusal of a save whose process ``p`` planned another layout (its ``status``
    holds its layout entries): the first difference, as every process raises it."""
    theirs = json.loads(status[len(_LAYOUT):])
    difference = _planning.layout_difference(
        self.plan.layout_entries(), [tuple(e) for e in theirs["entries"]], p,
        compared_all=not theirs["cut"])
    return _refusal("ValueError", (
        f"the processes of this job save different trees to {self.plan.loc}: {difference}."
        " Every process of a job must save the same tree (the same item names, keys, shapes,"
        " dtypes, shardings and dtype= conversions): process 0 commits the checkpoint's"
        " description of every process's data. Nothing was committed."))

  # ---------------------------------------------------------------- the commit

  def _discard(self, error: BaseException | None) -> None:
    """Removes this save's uncommitted data (only when no process writes any more); after
    ``error``, this process's, one attempt per call if the store stopped answering."""
    if self.target is not None and self.me == 0:
      discard(self.plan, self.gen, self.nproc, after=error)

  def _commit(self) -> None:
    """Process 0: write the manifest last, then make it visible atomically."""
    if self.gen is None:  # nothing to write at all, e.g. only scalars: still a checkpoint
      self.begin()
    commit(self.plan, self.gen, self.nproc, self.target,
           lambda m: self.hooks.complete(m, self.key, self.timeout_s))


_CANCELLED = "cancelled: "  # a status or decision: some process cancelled the save
_REFUSED = "refused: "  # a generation or decision: some process refused the save (JSON follows)


def refuse(key: str, what: str, error: BaseException, timeout_s: float) -> None:
  """Fails the save under ``key`` (``what``: "the save to <path>") on every process: this
  process refused its part (``error``, raised while planning: its items, its destination,
  its options).

  The other processes wait for this save where :class:`SaveRun` makes them wait: process 0
  for every status, the others for the generation (process 0's) and for the decision. So
  the refusal is claimed as the decision (before any status can complete it: nothing
  commits, also where process 0 published the generation and wrote its part already),
  published as the generation by process 0, and reported as this process's status; then
  this process leaves the save's keys. Every other process raises ``error``'s type with
  its reason (:func:`_refusal_error`) as soon as it reaches the save's next wait, never
  after the coordination timeout. A single-process job has nobody to tell. The service
  not answering is logged: ``error`` is what the caller raises either way.
  """
  if _multihost.process_count() == 1:
    return
  me = _multihost.process_index()
  value = _refusal(type(error).__name__, f"process {me} refused {what}:"
                   f" {type(error).__name__}: {error} Every process of the job refuses it (a save is"
                   " the whole job's: the same items, path and options on every process);"
                   " nothing was committed.")
  try:
    _multihost.claim(f"{key}/decision", value, timeout_s=timeout_s)
    if me == 0:
      _multihost.publish(f"{key}/gen", value, timeout_s=timeout_s)
    _multihost.arrive(f"{key}/status", _describe(error), timeout_s=timeout_s)
    _multihost.leave(key, timeout_s=timeout_s)
  except _multihost.CoordinationTimeoutError as e:
    log.warning("%s refused on process %d; the other processes could not be told (they fail"
                " after their coordination timeout): %s", what, me, e)


def _refusal(type_name: str, message: str) -> str:
  """A refusal as a generation or decision: the error's type and its message, as data."""
  return _REFUSED + json.dumps({"type": type_name, "message": message})


# The errors a refusal is raised as on the other processes, by name; any other as a StorageError.
_REFUSAL_TYPES = {c.__name__: c for c in (ValueError, TypeError, *(
    c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.CheckpointError)))}


def _refusal_error(value: str) -> BaseException:
  """The error of a refusal (:func:`_refusal`) as every process raises it."""
  refusal = json.loads(value[len(_REFUSED):])
  return _REFUSAL_TYPES.get(refusal["type"], errors.StorageError)(refusal["message"])


class _LayoutDiffers(ValueError):
  """A process's plan differs from process 0's (:meth:`SaveRun.begin`); ``entries``: its
  layout entries, which its status hands to process 0 to name the difference."""

  def __init__(self, entries: Sequence[tuple[str, dict[str, Any]]], message: str):
    super().__init__(message)
    self.entries = entries


_LAYOUT = "layout: "  # a status: this process's plan differs from process 0's (JSON follows)
_LAYOUT_MAX_BYTES = 1 << 20  # a layout status is cut at about this size (the service's values)


def _status(error: BaseException | None) -> str:
  """This process's status at the vote: "ok", its layout (its plan differs from process 0's,
  cut at about ``_LAYOUT_MAX_BYTES``), or its error (:func:`_describe`)."""
  if error is None:
    return "ok"
  if not isinstance(error, _LayoutDiffers):
    return _describe(error)
  entries, size = [], 0
  for e in error.entries:
    size += len(json.dumps(e))
    if size > _LAYOUT_MAX_BYTES:
      break
    entries.append(e)
  return _LAYOUT + json.dumps({"entries": entries, "cut": len(entries) < len(error.entries)})


def _describe(error: BaseException) -> str:
  if isinstance(error, errors.SaveCancelledError):
    return f"{_CANCELLED}{error}"
  return f"error: {type(error).__name__}: {error}"


def _lower_first(text: str) -> str:
  return text[:1].lower() + text[1:]


def _verdict_text(decision: str) -> str:
  return decision.split(": ", 1)[1] if ": " in decision else decision


def _raise_verdict(decision: str) -> None:
  if decision.startswith(_REFUSED):
    raise _refusal_error(decision)
  if decision.startswith(_CANCELLED):
    raise errors.SaveCancelledError(decision[len(_CANCELLED):])
  raise errors.StorageError(_verdict_text(decision))


# ----------------------------------------------------------------------------
# The commit (process 0), or the discard of a failed save.


def target(final: Location, gen: str) -> Location:
  """Where data is written: a temporary sibling directory, or in place on object stores."""
  return final.sibling(f"{final.name}{TMP_MARKER}{gen}") if final.is_local else final


def commit(plan: _planning.Plan, gen: str, nproc: int, written: Location,
           complete: Callable[[dict[str, Any]], dict[str, Any]] = lambda m: m) -> None:
  """Process 0: writes the manifest of generation ``gen`` last, then makes it visible atomically.

  ``written``: where the data was written (:func:`target`). ``complete`` adds what the
  writing decided (a differential save's references).

  On an object store the manifest's PUT is conditional on what the commit looked at: absent,
  or (an overwrite) the very manifest it replaces. Another save's commit since that look is
  never replaced, even with ``plan.overwrite``: two saves to one path at once are refused
  rather than one of them silently lost.

  Raises:
    CheckpointExistsError: a checkpoint appeared at the path during the save
      and ``plan.overwrite`` is False, or (object stores) another save committed
      there during this commit (nothing was overwritten; this save's data is removed).
    StorageError: the storage refused.
  """
  final = plan.loc
  manifest = complete(dict(plan.manifest, generation=gen))
  data = _manifest.encode(manifest)
  if not final.is_local:
    old, generation = _look(final)
    if (old is not None and not plan.overwrite) or not _put_manifest(final, data, generation):
      _delete_generations(final, _databases(manifest["items"], nproc, gen))  # ours
      if not plan.overwrite:
        raise errors.CheckpointExistsError(f"a checkpoint appeared at {final} during the save;"
                                           " nothing was overwritten.")
      raise errors.CheckpointExistsError(
          f"another save committed a checkpoint at {final} during the save (two saves to one"
          " path at once); it was kept, nothing was overwritten. Save again to replace it.")
    # Committed. What follows is cleanup: it may fail without undoing the commit.
    if old is not None:
      try:
        previous = _manifest.decode(old, str(final))
        dbs = _databases(previous.items, previous.process_count, previous.generation)
      except (errors.CheckpointCorruptedError, KeyError, ValueError):
        dbs = None  # a damaged old manifest: remove every other generation
      try:
        _delete_generations(final, dbs, keep=gen)
      except errors.StorageError as e:
        log.warning("checkpoint %s committed; removing the previous generation failed: %s",
                    final, e)
    return
  try:
    _commit_local(plan, gen, written, data)
  except errors.CheckpointError:
    raise
  except OSError as e:
    raise _location.storage_error(final, "committing the checkpoint", e) from e


def _look(final: Location) -> tuple[bytes | None, bytes]:
  """The manifest at the object-store location ``final`` (None: none yet) and its storage
  generation, which conditions the commit's write (a missing key has a generation too)."""
  key = _manifest.MANIFEST_KEY
  try:
    got = _location.open_kvstore(final).read(key).result()
  except ValueError as e:
    raise _location.storage_error(final, f"reading {key!r}", e) from e
  return (got.value if got.state == "value" else None), got.stamp.generation


def _put_manifest(final: Location, data: bytes, generation: bytes) -> bool:
  """Writes the manifest ``data`` at the object-store location ``final`` only if the key is
  still at ``generation``, what the commit looked at (:func:`_look`). Returns whether it was
  written.

  The condition is S3's ``If-None-Match``/``If-Match`` or GCS's ``ifGenerationMatch``, as
  the writer lease's (:mod:`orbax_flax.manager.leases`). A refusal whose manifest turns out
  to be ``data`` is our own write (its reply lost, the retry refused): it committed.
  """
  key = _manifest.MANIFEST_KEY
  try:
    if _location.open_kvstore(final).write(key, data, if_equal=generation).result().generation:
      return True
  except ValueError as e:
    raise _location.storage_error(final, f"writing {key!r}", e) from e
  return _location.read_key(final, key) == data


def discard(plan: _planning.Plan, gen: str, nproc: int, after: BaseException | None = None
            ) -> None:
  """Process 0: removes the uncommitted data of generation ``gen`` (only once no process
  writes any more). Never raises: a failure is logged, the data is a leftover that a later
  writer's sweep removes.

  ``after``: the error that failed the save. Where it is a store that did not answer through
  its retries (:func:`~orbax_flax.core._location.unanswered`), each call here makes one
  attempt: the cleanup after a stalled store takes a watchdog window per request, not a
  retry sequence.
  """
  where = target(plan.loc, gen)
  loc = _location.without_retries(plan.loc) if _location.unanswered(after) else plan.loc
  try:
    if where.is_local:
      if os.path.isdir(where.local_path):
        failed = step_dir.rmtree_errors(where.local_path)  # removes what it can
        if failed:
          raise failed[0]
    else:
      _delete_generations(loc, _databases(plan.manifest["items"], nproc, gen))
  except (OSError, errors.StorageError) as e:
    log.warning("could not remove the data of the failed save to %s: %s. It is a leftover,"
                " %s: a CheckpointManager's sweep removes it where the save was one of its"
                " steps; else remove it by hand.", plan.loc, e, where)


def _commit_local(plan: _planning.Plan, gen: str, target: Location, data: bytes) -> None:
  """The local part of the commit: manifest, fsync, atomic rename (or swap)."""
  final = plan.loc
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
    _after_commit(final, "syncing its parent directory", _NOT_DURABLE, _location.fsync_dir,
                  os.path.dirname(dst))
    return
  if not plan.overwrite:
    raise errors.CheckpointExistsError(f"a checkpoint appeared at {dst} during the save;"
                                       " nothing was overwritten.")
  if _location.exchange(tmp, dst):
    _after_commit(final, "syncing its parent directory", _NOT_DURABLE, _location.fsync_dir,
                  os.path.dirname(dst))
    # tmp now holds the old checkpoint
    _after_commit(final, "disposing of the checkpoint it replaced", _LEFT_BEHIND.format(tmp),
                  refs.dispose_replaced, final, tmp)
    return
  _replace_in_place(final, tmp, dst, gen, data)


_NOT_DURABLE = ("It may not survive a power loss until the file system writes its directory:"
                " check the disk (an I/O error here is the disk's).")
_LEFT_BEHIND = ("The checkpoint it replaced stays whole at {} (checkpoints that borrow its data"
                " read it there); remove it by hand once none does.")


def _after_commit(final: Location, what: str, consequence: str, fn: Callable[..., None],
                  *args: Any) -> None:
  """Runs a step that follows the commit's atomic switch: the checkpoint is in place and
  restorable whatever it does, so its failure is logged, never raised. Raised, it would tell
  every process that nothing was committed (a manager would not list a step that is there,
  and would refuse its retry as existing), and the failed save's cleanup would remove its
  temporary directory, which after an exchange holds the replaced checkpoint, with data that
  other checkpoints borrow."""
  try:
    fn(*args)
  except OSError as e:
    log.warning("checkpoint %s committed (it is in place and restorable), but %s failed: %s. %s",
                final, what, e, consequence)


def _replace_in_place(final: Location, tmp: str, dst: str, gen: str, manifest: bytes) -> None:
  """Overwrites a local checkpoint where paths cannot be swapped atomically (NFS).

  The new generation's databases move into the old checkpoint next to the old
  ones (new names: nothing is replaced), then one atomic ``os.replace`` of the
  manifest switches from the old generation to the new. Killed before that, the
  old checkpoint is intact; after it, the new one is complete. Then the old
  generation's databases (and items the new one lacks) move into ``tmp`` beside
  the old manifest, and that old checkpoint goes as the exchange's does
  (:func:`orbax_flax.differential.refs.dispose_replaced`: removed, or retired while
  steps borrow from it).
  """
  with _location.open_plain(os.path.join(dst, _manifest.MANIFEST_KEY), dst) as f:
    old_manifest = f.read()
  items = [i for i in os.listdir(tmp) if os.path.isdir(os.path.join(tmp, i))]
  for item in items:
    os.makedirs(os.path.join(dst, item), exist_ok=True)
    for db in os.listdir(os.path.join(tmp, item)):
      os.rename(os.path.join(tmp, item, db), os.path.join(dst, item, db))
    _location.fsync_dir(os.path.join(dst, item))
  staged = os.path.join(dst, f"{_manifest.MANIFEST_KEY}{TMP_MARKER}{gen}")
  _location.write_local_durably(staged, manifest)
  os.replace(staged, os.path.join(dst, _manifest.MANIFEST_KEY))
  # Committed; the rest gathers the old checkpoint in tmp (emptied above) and disposes of it.
  _after_commit(final, "syncing its directory", _NOT_DURABLE, _location.fsync_dir, dst)
  _after_commit(final, "gathering the checkpoint it replaced",
                f"Its data stays in {dst} (databases of other generations) and {tmp}; the"
                " checkpoint at the path reads only its own.", _gather_replaced,
                final, tmp, dst, gen, items, old_manifest)


def _gather_replaced(final: Location, tmp: str, dst: str, gen: str, items: Sequence[str],
                     old_manifest: bytes) -> None:
  """After :func:`_replace_in_place`'s commit: moves the replaced generation's databases
  (and items the new one lacks) from ``dst`` into ``tmp`` beside the old manifest, and
  disposes of that old checkpoint."""
  staged = os.path.join(tmp, f"{_manifest.MANIFEST_KEY}{TMP_MARKER}{gen}")
  _location.write_local_durably(staged, old_manifest)
  os.replace(staged, os.path.join(tmp, _manifest.MANIFEST_KEY))
  for item in os.listdir(dst):
    path = os.path.join(dst, item)
    if not os.path.isdir(path) or os.path.islink(path):
      continue
    for db in os.listdir(path):
      if not db.endswith(f"-{gen}"):
        os.makedirs(os.path.join(tmp, item), exist_ok=True)
        os.rename(os.path.join(path, db), os.path.join(tmp, item, db))
    if item not in items and not os.listdir(path):
      os.rmdir(path)
  _location.fsync_dir(dst)
  refs.dispose_replaced(final, tmp)


def _databases(items: Any, process_count: int, gen: str) -> list[str]:
  """The process databases ``<item>/p<i>-<gen>`` of one generation."""
  return [_tsio.db_name(item, p, gen) for item in items for p in range(process_count)]


def _delete_generations(loc: Location, dbs: Sequence[str] | None, keep: str | None = None) -> None:
  """Deletes the given databases, or (``dbs`` None) every one not of generation ``keep``."""
  if dbs is None:
    found = {"/".join(k.split("/", 2)[:2]) for k in _location.list_keys(loc) if k.count("/") >= 2}
    dbs = [d for d in found if d.split("/")[1].startswith("p") and not d.endswith(f"-{keep}")]
  for db in sorted(dbs):
    _location.delete_prefix(loc, db + "/")
