"""Reader leases and deletion notices: how an evaluator keeps a step a trainer would delete.

Reader leases (the evaluator's side, :func:`orbax_flax.checkpoints_iterator`):
while a reader holds a step it keeps a small file
``<directory>/.readers/<step>-<token>`` fresh. A lease not refreshed for
``LEASE_SECONDS`` is ignored (a reader that died holding one).

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
* The reader (:func:`orbax_flax.checkpoints_iterator`): it writes its lease
  first (:class:`Lease`), then checks that no deletion notice names the step
  (:func:`deletion_announced`), and only then that the step is still
  committed. A step with a notice, or no longer committed, is skipped with a
  log line (its lease released); otherwise it is yielded.

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
from collections.abc import Iterable

from orbax_flax import _location
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


class Lease:
  """One reader lease on ``step`` under ``loc``: taken now, kept fresh from a thread, released."""

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
