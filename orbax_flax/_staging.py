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
"""

from __future__ import annotations

import concurrent.futures
import math
import mmap
import os
import threading
from collections.abc import Sequence

import numpy as np

_ALIGN = 64          # JAX's CPU client adopts 64-byte aligned host buffers without a copy
_GRAIN = 2 << 20     # arenas grow in 2 MiB steps


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


def _mapping(nbytes: int) -> np.ndarray:
  m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  if nbytes >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
    try:  # 2 MiB pages where the kernel allows them: 512x fewer faults on first touch
      m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
      pass
  return np.frombuffer(m, np.uint8)


_HUGE = 4 << 20


def copy_all(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
  for src, dst in pairs:
    np.copyto(dst, src)


class Staging:
  """A reusable staging arena and the threads that copy into it.

  Not thread-safe: its owner runs one snapshot at a time, and calls
  :meth:`arrays` again only after the data of the previous call is written.

  Example:
    >>> s = Staging()
    >>> (a,) = s.arrays([((4,), np.dtype(np.float32))])
    >>> s.copy([(np.arange(4, dtype=np.float32), a)]); a
    array([0., 1., 2., 3.], dtype=float32)
    >>> s.nbytes >= 16
    True
    >>> s.release(); s.nbytes
    0
  """

  def __init__(self, threads: int | None = None):
    self._arena: np.ndarray | None = None
    self._threads = threads or min(8, max(2, os.cpu_count() or 1))
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._lock = threading.Lock()

  @property
  def nbytes(self) -> int:
    """Bytes of staging memory held now."""
    return 0 if self._arena is None else self._arena.nbytes

  def arrays(self, specs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
    """Uninitialised aligned arrays of (shape, dtype) inside the arena (grown if needed).

    The arrays of the previous call share the same memory: they must not be in
    use any more.
    """
    _, sizes = _sizes(specs)
    need = sum(sizes)
    if need and (self._arena is None or self._arena.nbytes < need):
      self._arena = None  # drop the old mapping first: never hold two
      self._arena = _mapping(-(-need // _GRAIN) * _GRAIN)
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
    with self._lock:
      if self._pool is None:
        self._pool = concurrent.futures.ThreadPoolExecutor(self._threads,
                                                           thread_name_prefix="orbax_flax-copy")
    # One task per thread, balanced by bytes (largest first): few tasks, not one per copy.
    groups: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(self._threads)]
    loads = [0] * self._threads
    for pair in sorted(pairs, key=lambda p: -p[1].nbytes):
      i = loads.index(min(loads))
      groups[i].append(pair)
      loads[i] += pair[1].nbytes
    for f in [self._pool.submit(copy_all, g) for g in groups if g]:
      f.result()

  def release(self) -> None:
    """Hands the staging memory back to the OS (its arrays must be unused)."""
    self._arena = None

  def close(self) -> None:
    """Releases the memory and stops the copy threads."""
    self.release()
    with self._lock:
      pool, self._pool = self._pool, None
    if pool is not None:
      pool.shutdown(wait=True)
