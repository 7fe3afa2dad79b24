"""Host memory for snapshots: one arena reused from save to save, filled in parallel.

An async save must copy the state out of the device buffers before it returns
(the caller may donate or overwrite them next). Copying into fresh pages is
what makes that slow: every page is faulted in and zeroed by the kernel, at a
third of the speed of a copy into pages already touched. :class:`Staging`
keeps one anonymous mapping between saves and carves each save's buffers out
of it, so from the second save on the copy runs at memory speed. It holds at
most one staging copy of the state (the largest seen, or the budget); it is
released by :meth:`Staging.release` (``Checkpointer.close()``), or after every
save when the owner asks for that.

The first save of a process still pays for fresh pages, unless the arena is
prepared before it (:meth:`Staging.prepare`): mapped at the size the save will
need and touched by a low-priority background thread in short slices, with a
pause after each, so that the training thread is not slowed measurably. The
prepared arena *is* the staging memory the save copies into (one copy, never
two); a save that comes before the touching is done stops it and copies into
what is there (the rest is faulted in by the copy, as without preparation).
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from orbax_flax.core import _threads

_ALIGN = 64          # JAX's CPU client adopts 64-byte aligned host buffers without a copy
_GRAIN = 2 << 20     # arenas grow in 2 MiB steps
_TOUCH_SLICE = 8 << 20  # a prepared arena is touched in slices of this size ...
_TOUCH_DUTY = 0.5       # ... each followed by a pause as long as the slice took
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable, without writing them


def arena_bytes(specs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> int:
  """Bytes of arena that :meth:`Staging.arrays` needs for ``specs`` (64-byte aligned each).

  Example:
    >>> arena_bytes([((3,), np.dtype(np.float32)), ((100,), np.dtype(np.int8))])
    192
  """
  return sum(_sizes(specs)[1])


def _sizes(specs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> tuple[list[int], list[int]]:
  nbytes = [math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in specs]
  return nbytes, [-(-n // _ALIGN) * _ALIGN for n in nbytes]


def carve(buffer: np.ndarray, specs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
  """Arrays of (shape, dtype), 64-byte aligned, laid out one after another in ``buffer``."""
  nbytes, sizes = _sizes(specs)
  out, offset = [], 0
  for (shape, dtype), n, size in zip(specs, nbytes, sizes):
    out.append(buffer[offset:offset + n].view(dtype).reshape(shape))
    offset += size
  return out


def fresh_arrays(specs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
  """Uninitialised aligned arrays carved from one new mapping (freed with the last of them).

  One anonymous mapping instead of thousands of allocations: steadier copy times
  and an exact return to the OS once every array is freed.

  Example:
    >>> a, b = fresh_arrays([((3,), np.dtype(np.float32)), ((2, 2), np.dtype(np.int8))])
    >>> a.shape, b.dtype, b.ctypes.data % 64
    ((3,), dtype('int8'), 0)
  """
  _, sizes = _sizes(specs)
  if not sum(sizes):
    return [np.empty(shape, dtype) for shape, dtype in specs]
  return carve(_mapping(sum(sizes)), specs)


def fresh_groups(groups: Sequence[Sequence[tuple[tuple[int, ...], np.dtype]]]
                 ) -> list[list[np.ndarray]]:
  """:func:`fresh_arrays` of each group: a mapping per group, which its arrays free together;
  groups of at most ``_SMALL_GROUP`` bytes share one (a mapping is a page at least: 100,000
  restored scalars held 450 MiB, one page each, for 1.6 MB of values).

  Example:
    >>> small, big, empty = fresh_groups([[((3,), np.dtype(np.float32))],
    ...                                   [((4096,), np.dtype(np.float32))], []])
    >>> len(small), len(big), len(empty), small[0].ctypes.data % 64
    (1, 1, 0, 0)
  """
  sizes = [sum(_sizes(specs)[1]) for specs in groups]
  small = [i for i, size in enumerate(sizes) if 0 < size <= _SMALL_GROUP]
  shares = set(small)
  out = [None if i in shares else fresh_arrays(specs) for i, specs in enumerate(groups)]
  shared = fresh_arrays([spec for i in small for spec in groups[i]])
  for i in small:
    out[i], shared = shared[:len(groups[i])], shared[len(groups[i]):]
  return out


_SMALL_GROUP = 2048  # bytes: groups up to half a page share a mapping


def _mapping(nbytes: int) -> np.ndarray:
  m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  if nbytes >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
    try:  # 2 MiB pages where the kernel allows them: 512x fewer faults on first touch
      m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
      pass
  return np.frombuffer(m, np.uint8)


_HUGE = 4 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
  try:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
  except OSError:
    return None
  libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
  libc.madvise.restype = ctypes.c_int
  return libc


def touch(address: int, nbytes: int, populate: bool) -> bool:
  """Faults in ``nbytes`` of anonymous memory at ``address``, without holding the GIL.

  ``populate``: ``madvise(MADV_POPULATE_WRITE)`` (Linux >= 5.14), which
  allocates the pages without writing them, so it may run while another
  thread copies into them; else ``memset``, which writes zeros. Both run in C
  through ctypes, which releases the GIL.

  Returns False where ``populate`` failed (ENOMEM under a cgroup's memory pressure, say):
  nothing was written. It never falls back to zeros, which would land on what a save
  copies into these pages meanwhile (a save does not wait for a populating thread).
  """
  if populate:
    return _libc().madvise(address, nbytes, _MADV_POPULATE_WRITE) == 0
  ctypes.memset(address, 0, nbytes)
  return True


def _can_populate(address: int) -> bool:
  """True if the kernel faults pages in for ``madvise(MADV_POPULATE_WRITE)`` (tried on one page)."""
  libc = _libc()
  return libc is not None and libc.madvise(address, mmap.PAGESIZE, _MADV_POPULATE_WRITE) == 0


def _lower_priority() -> None:
  """Makes the calling thread the last one the scheduler runs (nice 19; Linux: per thread)."""
  try:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
  except (OSError, AttributeError):
    pass  # not Linux, or not allowed: the pauses between slices still bound its share


class Stats(NamedTuple):
  """What a :class:`Staging` holds, for introspection and tests.

  Attributes:
    nbytes: bytes of staging memory held now.
    prepared_bytes: bytes of it touched by :meth:`Staging.prepare` so far.
    mappings: how many arenas were mapped so far (a save that reuses the
      arena, prepared or kept, maps none).
    preparing: True while the background touching runs.
  """
  nbytes: int
  prepared_bytes: int
  mappings: int
  preparing: bool


def copy_all(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
  for src, dst in pairs:
    np.copyto(dst, src)


class Staging:
  """A reusable staging arena and the threads that copy into it.

  Not thread-safe: its owner runs one snapshot at a time, and calls
  :meth:`arrays` again only after the data of the previous call is written.
  The one background thread it runs itself (:meth:`prepare`) is stopped and
  joined before :meth:`arrays`, :meth:`release` or a new :meth:`prepare`
  touch the arena.

  Args:
    threads: copy threads (default: the CPU count, between 2 and 8).
    limit: the most bytes an arena may have (0: no limit); the 2 MiB rounding
      never goes past it, and :meth:`prepare` prepares nothing larger.

  Example:
    >>> s = Staging()
    >>> (a,) = s.arrays([((4,), np.dtype(np.float32))])
    >>> s.copy([(np.arange(4, dtype=np.float32), a)]); a
    array([0., 1., 2., 3.], dtype=float32)
    >>> s.nbytes >= 16
    True
    >>> s.release(); s.nbytes
    0
    >>> s.prepare(16 << 20)  # before a first save: mapped now, touched in the background
    16777216
    >>> s.wait_prepared(60), s.stats().prepared_bytes
    (True, 16777216)
    >>> _ = s.arrays([((4 << 20,), np.dtype(np.float32))])  # the prepared arena, reused
    >>> s.stats().mappings
    2
    >>> s.close()
  """

  def __init__(self, threads: int | None = None, limit: int = 0):
    self._arena: np.ndarray | None = None
    self._threads = threads or min(8, max(2, os.cpu_count() or 1))
    self._limit = limit
    self._mappings = 0
    self._prepared = 0
    self._preparer: threading.Thread | None = None
    self._stop = threading.Event()
    # Set by the preparer as it ends: waited on instead of joining its thread, which a Ctrl-C
    # in join() can leave looking ended while it still writes (CPython 3.11/3.12).
    self._ended = threading.Event()
    self._zeroing = False  # the preparer writes zeros (no MADV_POPULATE_WRITE): always joined

  @property
  def nbytes(self) -> int:
    """Bytes of staging memory held now."""
    return 0 if self._arena is None else self._arena.nbytes

  def stats(self) -> Stats:
    """What is held and prepared now (see :class:`Stats`)."""
    preparer = self._preparer
    return Stats(self.nbytes, self._prepared, self._mappings,
                 preparer is not None and not self._ended.is_set() and not self._stop.is_set())

  def _size_for(self, need: int) -> int:
    size = -(-need // _GRAIN) * _GRAIN
    return max(need, self._limit) if self._limit and size > self._limit else size

  def _map(self, need: int) -> None:
    self._stop_preparing(wait=True)  # its thread holds the old mapping until it ends
    self._arena = None  # drop the old mapping first: never hold two
    self._arena = _mapping(self._size_for(need))
    self._mappings += 1
    self._prepared = 0

  def prepare(self, need: int) -> int:
    """Maps an arena of ``need`` bytes now and touches its pages in the background.

    For the first save of a process, called as soon as its size is known:
    the save then copies into touched memory, the same memory :meth:`arrays`
    hands out. A daemon thread touches it in 8 MiB slices (the GIL released),
    pausing after each as long as the slice took, at the lowest priority (nice
    19) where the kernel faults pages in without writing them: then a save
    never waits for it (it may finish its slice while the save copies). Where
    the kernel cannot (before Linux 5.14) it writes zeros, at normal priority,
    and a save waits for its current slice (milliseconds). An arena already
    large enough is kept as it is.

    Returns:
      The bytes being prepared: 0 if the arena held is large enough already,
      or if ``need`` itself is over the ``limit`` (the rounding never goes past it).
    """
    self._stop_preparing()
    if not need or (self._arena is not None and self._arena.nbytes >= need):
      return 0
    if self._limit and self._size_for(need) > self._limit:
      return 0
    self._map(need)
    self._stop, self._ended = threading.Event(), threading.Event()
    self._zeroing = not _can_populate(self._arena.ctypes.data)
    self._preparer = threading.Thread(target=self._touch,
                                      args=(self._arena, self._stop, not self._zeroing,
                                            self._ended),
                                      name="orbax_flax-prepare-staging", daemon=True)
    self._preparer.start()
    return self._arena.nbytes

  def _touch(self, arena: np.ndarray, stop: threading.Event, populate: bool,
             ended: threading.Event) -> None:
    try:
      if populate:  # it never writes: nothing has to wait for it, so it may wait for everyone
        _lower_priority()
      address, n, done = arena.ctypes.data, arena.nbytes, 0
      while done < n and not stop.is_set():
        size = min(_TOUCH_SLICE, n - done)
        start = time.perf_counter()
        if not touch(address + done, size, populate):
          break  # the pages are faulted in by the save's own copy instead
        done += size
        if not stop.is_set():
          self._prepared = done
        stop.wait((time.perf_counter() - start) * (1 / _TOUCH_DUTY - 1))
    finally:
      ended.set()

  def wait_prepared(self, timeout: float | None = None) -> bool:
    """Waits for the background touching to end; True if none is pending any more."""
    preparer = self._preparer
    if preparer is None or self._stop.is_set():
      return True
    return self._ended.wait(timeout)

  def _stop_preparing(self, wait: bool = False) -> None:
    """Stops the background touching before anything else uses the arena.

    Waits for its current slice only if it writes zeros, or if ``wait`` (the
    arena is about to be dropped: its thread holds it until it ends).
    """
    preparer = self._preparer
    if preparer is None:
      return
    self._stop.set()
    if wait or self._zeroing:
      self._ended.wait()  # (its last slice: milliseconds)
      self._preparer = None

  def arrays(self, specs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
    """Uninitialised aligned arrays of (shape, dtype) inside the arena (grown if needed).

    The arrays of the previous call share the same memory: they must not be in
    use any more.
    """
    self._stop_preparing()
    need = arena_bytes(specs)
    if need and (self._arena is None or self._arena.nbytes < need):
      self._map(need)
    if not need:
      return [np.empty(shape, dtype) for shape, dtype in specs]
    return carve(self._arena, specs)

  def copy(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """``np.copyto(dst, src)`` for every pair, largest first, spread over threads."""
    if not pairs:
      return
    total = sum(d.nbytes for _, d in pairs)
    if len(pairs) == 1 or total < (4 << 20):
      copy_all(pairs)
      return
    # One task per thread, balanced by bytes (largest first): few tasks, not one per copy.
    groups: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(self._threads)]
    loads = [0] * self._threads
    for pair in sorted(pairs, key=lambda p: -p[1].nbytes):
      i = loads.index(min(loads))
      groups[i].append(pair)
      loads[i] += pair[1].nbytes
    _threads.parallel_map(copy_all, [g for g in groups if g], self._threads,
                          name="orbax_flax-copy")

  def release(self) -> None:
    """Hands the staging memory back to the OS (its arrays must be unused).

    A preparation still running is stopped; its thread lets go of the memory
    at the end of its current slice.
    """
    self._stop_preparing()
    self._arena = None
    self._prepared = 0

  def close(self) -> None:
    """Releases the memory, as :meth:`release` (the copy threads end with each copy)."""
    self.release()
