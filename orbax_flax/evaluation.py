"""An evaluator beside a training job: each newly committed step, once, kept readable.

:func:`checkpoints_iterator` polls a directory of steps and yields each step
committed since the last one it yielded. While the caller holds a yielded step
(until it asks for the next one), the iterator keeps a *reader lease* on it: a
small file ``<directory>/.readers/<step>-<token>``. A training job's
:class:`~orbax_flax.CheckpointManager` does not delete a leased step; it
deletes it at a later save once the lease is gone. A lease not refreshed for
``LEASE_SECONDS`` is ignored (an evaluator that died holding one); the iterator
refreshes its lease from a background thread while the caller works, so a long
evaluation keeps its step. A step deleted between the listing and the lease
(retention was faster) is skipped with a log line.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from orbax_flax import _location
from orbax_flax import restoring
from orbax_flax import step_dir
from orbax_flax import errors
from orbax_flax._location import Location

log = logging.getLogger("orbax_flax")

READERS = ".readers"
LEASE_SECONDS = 3600.0


def _lease_dir(loc: Location) -> Location:
  return loc.join(READERS)


def leased_steps(loc: Location, now: float | None = None) -> set[int]:
  """Steps under ``loc`` that a live reader lease protects from deletion."""
  now = time.time() if now is None else now
  out: set[int] = set()
  if loc.is_local:
    d = os.path.join(loc.local_path, READERS)
    try:
      names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
      return out
    for name in names:
      head = name.split("-", 1)[0]
      try:
        fresh = now - os.path.getmtime(os.path.join(d, name)) < LEASE_SECONDS
      except FileNotFoundError:
        continue
      if head.isdigit() and fresh:
        out.add(int(head))
    return out
  for key in _location.list_keys(_lease_dir(loc)):
    head, _, rest = key.partition("-")
    data = _location.read_key(_lease_dir(loc), key)
    try:
      fresh = data is not None and now - float(data.decode()) < LEASE_SECONDS
    except ValueError:
      fresh = False
    if head.isdigit() and rest and fresh:
      out.add(int(head))
  return out


class _Lease:
  """One reader lease: taken, refreshed, released."""

  def __init__(self, loc: Location, step: int):
    self._dir = _lease_dir(loc)
    self.key = f"{step}-{uuid.uuid4().hex[:12]}"
    if loc.is_local:
      os.makedirs(self._dir.local_path, exist_ok=True)
    self.refresh()
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._keep_fresh, daemon=True,
                                    name="orbax_flax-reader-lease")
    self._thread.start()

  def refresh(self) -> None:
    _location.write_key(self._dir, self.key, str(time.time()).encode())

  def _keep_fresh(self) -> None:
    while not self._done.wait(LEASE_SECONDS / 4):
      try:
        self.refresh()
      except errors.StorageError as e:
        log.warning("could not refresh reader lease %s: %s", self.key, e)

  def release(self) -> None:
    self._done.set()
    try:
      _location.delete_key(self._dir, self.key)
    except errors.StorageError as e:  # a stale lease only delays a deletion by LEASE_SECONDS
      log.warning("could not remove reader lease %s: %s", self.key, e)


def checkpoints_iterator(directory: Any, *, timeout: float | None = None,
                         min_interval: float = 0.0, poll_interval: float = 1.0,
                         start_after: int | None = None,
                         timeout_fn: Callable[[], bool] | None = None,
                         clock: Callable[[], float] = time.monotonic,
                         sleep: Callable[[float], None] = time.sleep) -> Iterator[int]:
  """Yields each step committed in ``directory``, once, oldest first.

  A step the training job's retention deleted before the iterator reached it is
  skipped with a log line. The yielded step stays readable until the caller
  asks for the next one: restore it with ``orbax_flax.restore(f"{directory}/{step}",
  ...)`` or a manager's ``restore(step)``.

  Args:
    directory: the directory of steps (a manager's directory, e.g.
      ``<workdir>/checkpoints``).
    timeout: stop after this many seconds without a new step (None: never).
    min_interval: at least this many seconds between two yields.
    poll_interval: seconds between listings.
    start_after: yield only steps newer than this one.
    timeout_fn: called at a timeout; return True to keep waiting (e.g. while
      the training job is alive), False to stop.
    clock, sleep: injectable for tests.

  Yields:
    Step numbers.

  Example:
    >>> import numpy as np, orbax_flax as ofx, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> ofx.save(os.path.join(d, "5"), {"s": {"w": np.ones(2)}})
    >>> [step for step in ofx.checkpoints_iterator(d, timeout=0)]
    [5]
  """
  loc = Location.parse(directory)
  last = start_after
  last_yield = None
  while True:
    waited_since = clock()
    step = None
    while step is None:
      steps, _ = step_dir.list_steps(loc)
      newer = [s for s in steps if last is None or s > last]
      if newer:
        step = newer[0]
        break
      if timeout is not None and clock() - waited_since >= timeout:
        if timeout_fn is not None and timeout_fn():
          waited_since = clock()
          continue
        return
      sleep(poll_interval)
    if last_yield is not None and min_interval:
      pause = min_interval - (clock() - last_yield)
      if pause > 0:
        sleep(pause)
    lease = _Lease(loc, step)
    try:
      try:
        restoring.read_summary(loc.join(str(step)))
      except errors.CheckpointNotFoundError:
        log.info("checkpoints_iterator: step %d was deleted before it could be read (the"
                 " training job's retention is faster than this evaluator); skipping it", step)
        last = step
        continue
      last, last_yield = step, clock()
      yield step
    finally:
      lease.release()
