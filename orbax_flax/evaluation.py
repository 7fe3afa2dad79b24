"""An evaluator beside a training job: each newly committed step, once, kept readable.

:func:`checkpoints_iterator` polls a directory of steps and yields each step
committed since the last one it yielded. While the caller holds a yielded step
(until it asks for the next one), the iterator keeps a *reader lease* on it: a
small file ``<directory>/.readers/<step>-<token>``. A training job's
:class:`~orbax_flax.CheckpointManager` does not delete a leased step; it
deletes it at a later save once the lease is gone. A lease not refreshed for
``LEASE_SECONDS`` is ignored (an evaluator that died holding one); the iterator
refreshes its lease from a background thread while the caller works, so a long
evaluation keeps its step.

The protocol between a deleting manager and a leasing reader. Each side
announces its intent before it reads the other's, so that whatever the
interleaving, at least one of them sees the other (single-key writes and reads
are linearizable on a local file system, on S3 and on GCS):

* The manager (:func:`announce_deletion`, then :func:`leased_steps`): for the
  steps it wants to delete it first writes a *deletion notice*
  ``.readers/deleting-<step>``, then lists the leases. A leased step is kept (its
  notice removed, :func:`withdraw_deletion`) and retried at a later save. An
  unleased step is uncommitted (``step_dir.delete_step``) and only then is its
  notice removed.
* The reader (:func:`checkpoints_iterator`): it writes its lease first, then
  checks that no deletion notice names the step (:func:`deletion_announced`), and
  only then that the step is still committed. A step with a notice, or no longer
  committed, is skipped with a log line (its lease released); otherwise it is
  yielded.

Why it is safe: if the manager's listing missed the lease, that listing came
before the lease was written, so the notice was written before the reader looks
for it. The reader either sees the notice (and skips), or the notice is gone
already, which happens only after the step was uncommitted (and the reader's
next check, that the step is committed, fails). Both sides seeing each other
is safe too: the step stays, the reader skips it, and the manager deletes it at
a later save.

Notices, like leases, are ignored once older than ``LEASE_SECONDS``: a manager
killed after announcing leaves one behind, and readers skip that step (which
its retention had chosen to delete) until the next deletion of it removes the
notice, or for an hour at most. So that an old notice is never mistaken for a
live one, a manager whose lease listing took longer than a quarter of that
deletes nothing and tries again at a later save. No start-up sweep removes
notices: a second manager on the same directory (an evaluator's) could remove
a live one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from orbax_flax import _location
from orbax_flax import restoring
from orbax_flax import step_dir
from orbax_flax import errors
from orbax_flax._location import Location

log = logging.getLogger("orbax_flax")

READERS = ".readers"
DELETING = "deleting-"  # a deletion notice: .readers/deleting-<step>
LEASE_SECONDS = 3600.0  # leases and notices older than this are ignored


def _lease_dir(loc: Location) -> Location:
  return loc.join(READERS)


def _notice(step: int) -> str:
  return f"{DELETING}{step}"


def _write(loc: Location, key: str) -> None:
  """Writes (or rewrites) a small key under ``<loc>/.readers``, holding the time."""
  data = str(time.time()).encode()
  d = _lease_dir(loc)
  if not loc.is_local:
    _location.write_key(d, key, data)
    return
  # A manager removes an empty .readers directory after its deletions: make it again.
  for attempt in range(5):
    try:
      with open(os.path.join(d.local_path, key), "wb") as f:
        f.write(data)
      return
    except FileNotFoundError as e:
      if attempt == 4:
        raise _location.storage_error(d, f"writing {key!r}", e) from e
      try:
        os.makedirs(d.local_path, exist_ok=True)
      except OSError as e2:
        raise _location.storage_error(d, f"creating {d}", e2) from e2
    except OSError as e:
      raise _location.storage_error(d, f"writing {key!r}", e) from e


def _fresh(loc: Location, key: str, now: float) -> bool:
  """Whether ``<loc>/.readers/<key>`` exists and was written less than LEASE_SECONDS ago."""
  d = _lease_dir(loc)
  if loc.is_local:
    try:
      return now - os.path.getmtime(os.path.join(d.local_path, key)) < LEASE_SECONDS
    except (FileNotFoundError, NotADirectoryError):
      return False
  data = _location.read_key(d, key)
  try:
    return data is not None and now - float(data.decode()) < LEASE_SECONDS
  except (ValueError, UnicodeDecodeError):
    return False


def leased_steps(loc: Location, now: float | None = None) -> set[int]:
  """Steps under ``loc`` that a live reader lease protects from deletion."""
  now = time.time() if now is None else now
  out: set[int] = set()
  if loc.is_local:
    try:
      names = os.listdir(os.path.join(loc.local_path, READERS))
    except (FileNotFoundError, NotADirectoryError):
      return out
  else:
    names = _location.list_keys(_lease_dir(loc))
  for name in names:
    head, _, rest = name.partition("-")
    if head.isdigit() and rest and _fresh(loc, name, now):
      out.add(int(head))
  return out


def announce_deletion(loc: Location, steps: Iterable[int]) -> None:
  """The manager's first move: a deletion notice for each step, before it reads the leases."""
  for step in steps:
    _write(loc, _notice(step))


def withdraw_deletion(loc: Location, steps: Iterable[int]) -> None:
  """Removes the notices of ``steps`` (deleted by now, or kept for a reader).

  On a local file system the ``.readers`` directory goes too once it is
  empty, so that a directory no evaluator ever read looks as before.
  """
  d = _lease_dir(loc)
  for step in steps:
    _location.delete_key(d, _notice(step))
  if loc.is_local:
    try:
      os.rmdir(d.local_path)  # only if empty: a lease written meanwhile stays
    except OSError:
      pass


def deletion_announced(loc: Location, step: int, now: float | None = None) -> bool:
  """Whether a manager has announced that it deletes ``step`` (a live notice)."""
  return _fresh(loc, _notice(step), time.time() if now is None else now)


class _Lease:
  """One reader lease: taken, refreshed, released."""

  def __init__(self, loc: Location, step: int):
    self._loc = loc
    self._dir = _lease_dir(loc)
    self.key = f"{step}-{uuid.uuid4().hex[:12]}"
    self.refresh()
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._keep_fresh, daemon=True,
                                    name="orbax_flax-reader-lease")
    self._thread.start()

  def refresh(self) -> None:
    _write(self._loc, self.key)

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

  A step the training job's retention deleted (or is deleting) before the
  iterator reached it is skipped with a log line. A directory that does not
  exist yet is waited for like an empty one, with a WARNING that says so (once,
  and again if the timeout ends the wait). The yielded step stays readable
  until the caller asks for the next one: restore it with
  ``orbax_flax.restore(f"{directory}/{step}", ...)`` or a manager's
  ``restore(step)``.

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
  warned_absent = False
  while True:
    waited_since = clock()
    step = None
    while step is None:
      steps, leftovers = step_dir.list_steps(loc)
      newer = [s for s in steps if last is None or s > last]
      if newer:
        step = newer[0]
        break
      absent = _absent(loc, steps, leftovers)
      if absent and not warned_absent:
        warned_absent = True
        log.warning("checkpoints_iterator: %s %s; waiting for a training job to save its first"
                    " step there (%s). Pass the directory the manager saves to, e.g."
                    " <workdir>/checkpoints.", loc, absent,
                    "no timeout" if timeout is None else f"timeout {timeout:g} s")
      if timeout is not None and clock() - waited_since >= timeout:
        if timeout_fn is not None and timeout_fn():
          waited_since = clock()
          continue
        if absent:
          log.warning("checkpoints_iterator: stopping after waiting %g s: %s still %s (nothing"
                      " was ever saved there; is it the manager's directory, e.g."
                      " <workdir>/checkpoints?)", timeout, loc, absent)
        else:
          log.info("checkpoints_iterator: stopping: no new step in %s for %g s (the timeout)",
                   loc, timeout)
        return
      sleep(poll_interval)
    if last_yield is not None and min_interval:
      pause = min_interval - (clock() - last_yield)
      if pause > 0:
        sleep(pause)
    # The reader's side of the protocol (module docstring): lease first, then
    # look for a deletion notice, then check that the step is still committed.
    lease = _Lease(loc, step)
    try:
      if deletion_announced(loc, step):
        log.info("checkpoints_iterator: step %d is being deleted by the training job's retention"
                 " (faster than this evaluator); skipping it", step)
        last = step
        continue
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


def _absent(loc: Location, steps: list[int], leftovers: list[Any]) -> str | None:
  """How ``loc`` is missing ("does not exist yet"), or None if it is there."""
  if loc.is_local:
    return None if os.path.isdir(loc.local_path) else "does not exist yet"
  return None if steps or leftovers else "holds no checkpoint yet"
