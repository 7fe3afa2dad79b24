"""Host memory and open files shared by the reading threads of one restore.

:class:`TempPool` bounds the temporary buffers (a chunk read in part, or for
several destinations) to a byte budget; :class:`Files` shares read-only file
descriptors; :func:`run_in_order` runs the reads of one span of a data file in
file order after telling the kernel the span will be read. ``contiguous`` and
``flat_view`` say when a box can be read straight into its destination.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from orbax_flax.format import _layout


class TempPool:
  """Reused temporary buffers, at most ``limit`` bytes out at once (one larger alone).

  Every :meth:`get` is paired with a :meth:`put` on every path, errors
  included, so a wait in :meth:`get` lasts only as long as the reads holding
  buffers (each bounded: a local ``preadv``). Once a read of the restore has
  failed, :meth:`abort` wakes every waiting thread, which then raises instead
  of waiting for memory the restore no longer needs.
  """

  def __init__(self, limit: int):
    self.limit = limit
    self._free: list[np.ndarray] = []
    self._out = 0
    self._cond = threading.Condition()
    self._aborted: BaseException | None = None

  def get(self, n: int) -> np.ndarray:
    with self._cond:
      while self._out and self._out + n > self.limit and self._aborted is None:
        self._cond.wait()
      if self._aborted is not None:
        raise Aborted() from self._aborted
      self._out += n
      fits = [i for i, b in enumerate(self._free) if b.nbytes >= n]
      if fits:
        return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
    try:
      return np.empty(n, np.uint8)
    except BaseException:
      self.put(None, n)
      raise

  def put(self, buf: np.ndarray | None, n: int) -> None:
    with self._cond:
      self._out -= n
      if buf is not None:
        self._free.append(buf)
      while sum(b.nbytes for b in self._free) > self.limit and self._free:
        self._free.pop(0)
      self._cond.notify_all()

  def abort(self, error: BaseException) -> None:
    """Wakes every waiting :meth:`get` (which raises :class:`Aborted`); later gets raise too."""
    with self._cond:
      if self._aborted is None:
        self._aborted = error
      self._cond.notify_all()

  def reset(self) -> None:
    """Ready for the next read of the same reader (after an abort)."""
    with self._cond:
      self._aborted = None

  @property
  def out(self) -> int:
    """Bytes handed out and not yet returned (0 between reads)."""
    with self._cond:
      return self._out


class Aborted(Exception):
  """Raised in a reading thread that stops because another read of the restore failed."""


def contiguous(inner: _layout.Box, outer: _layout.Box) -> bool:
  """True if ``inner`` is one contiguous run of ``outer``'s C-order buffer."""
  sizes = _layout.box_shape(inner)
  full = _layout.box_shape(outer)
  d = next((i for i, s in enumerate(sizes) if s > 1), len(sizes))
  return all(sizes[j] == full[j] for j in range(d + 1, len(sizes)))


def flat_view(out: np.ndarray, inner: _layout.Box, outer: _layout.Box) -> np.ndarray:
  """The bytes of ``inner`` inside ``out`` (which holds ``outer``), as a flat uint8 view."""
  view = out[_layout.relative(inner, outer)]
  return view.reshape(-1).view(np.uint8)


def run_in_order(calls: list[tuple[Any, tuple]], file: str, start: int, length: int,
                  fds: Files, stop: threading.Event | None = None) -> None:
  """Runs the reads of one contiguous span of one data file, in file order.

  The kernel is told first that the whole span will be read (so that cold
  reads stream at the disk's speed rather than chunk by chunk). Once ``stop``
  is set (another read failed), the remaining reads are skipped.
  """
  if file and length > 0 and hasattr(os, "posix_fadvise"):
    try:
      os.posix_fadvise(fds.get(file), start, length, os.POSIX_FADV_WILLNEED)
    except OSError:
      pass  # a missing file is reported by the read itself
  for fn, args in calls:
    if stop is not None and stop.is_set():
      return  # another read failed: the restore is over
    fn(*args)


class Files:
  """Open read-only file descriptors, shared by the reading threads."""

  def __init__(self):
    self._fds: dict[str, int] = {}
    self._lock = threading.Lock()

  def get(self, path: str) -> int:
    with self._lock:
      if path not in self._fds:
        self._fds[path] = os.open(path, os.O_RDONLY)
      return self._fds[path]

  def close(self) -> None:
    with self._lock:
      for fd in self._fds.values():
        os.close(fd)
      self._fds = {}
