"""An evaluator beside a training job: each newly committed step, once, kept readable.

:func:`checkpoints_iterator` polls a directory of steps and yields each step
committed since the last one it yielded. While the caller holds a yielded step
(until the next one is yielded), the iterator keeps a *reader lease* on it: a
small file ``<directory>/.readers/<step>-<token>``. A training job's
:class:`~orbax_flax.CheckpointManager` does not delete a leased step; it
deletes it at a later save once the lease is gone. A lease not refreshed for
an hour (``leases.LEASE_SECONDS``) is ignored (an evaluator that died holding
one); the iterator refreshes its lease from a background thread while the
caller works, so a long evaluation keeps its step (an iterator that may not
write there reads without leases, after a WARNING). The protocol between the
lease and a manager's deletions, and why it is safe, is in
:mod:`orbax_flax.manager.leases`: this module is its reader's side.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from orbax_flax import errors
from orbax_flax.manager import leases
from orbax_flax.manager import registry
from orbax_flax.engine import restoring
from orbax_flax.format import step_dir
from orbax_flax.core._location import Location

log = logging.getLogger("orbax_flax")


def checkpoints_iterator(directory: Any, *, timeout: float | None = None,
                         min_interval: float = 0.0, poll_interval: float = 1.0,
                         start_after: int | None = None,
                         timeout_fn: Callable[[], bool] | None = None,
                         clock: Callable[[], float] = time.monotonic,
                         sleep: Callable[[float], None] = time.sleep) -> Iterator[int]:
  """Yields each step committed in ``directory``, once, oldest first.

  A step the training job's retention deleted (or is deleting) before the
  iterator reached it is skipped with a log line. A rollback of the training
  job past the step yielded last (or a save over it) makes the new run's steps
  come next, at the numbers they have: each committed save is yielded once
  (a save at the number of the step being held replaces it: the lease keeps a
  step from deletion, not from a new save of its number). A directory that does not
  exist yet is waited for like an empty one, with a WARNING that says so (once,
  and again if the timeout ends the wait); so is one that holds no step while
  its ``checkpoints/`` does (a workdir), the WARNING naming
  ``<directory>/checkpoints``. The yielded step stays readable
  until the next one is yielded: restore it with
  ``orbax_flax.restore(f"{directory}/{step}", ...)`` or a manager's
  ``restore(step)``. That takes a reader lease, written in the directory; with
  read-only access (a read-only mount, a viewer role on a bucket) the iterator
  logs one WARNING and goes on without leases: a step is then not protected
  from the training job's keep rules while it is read.

  Args:
    directory: the directory of steps (a manager's directory, e.g.
      ``<workdir>/checkpoints``).
    timeout: stop after this many seconds without a new step (None: never).
    min_interval: at least this many seconds between two yields.
    poll_interval: seconds between listings.
    start_after: yield only steps newer than this one.
    timeout_fn: called at each timeout (as in Orbax and TensorFlow): True means
      no new step will come (e.g. the training job has finished), and the
      iterator ends once it has yielded the steps committed by then; False
      keeps waiting, for another ``timeout``. None: the first timeout ends it.
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
  yielded: dict[int, str] = {}  # step -> generation of the save yielded as it, while listed
  warned_absent = False
  leasing = True  # False once a lease cannot be written (read-only access)
  finished = False  # timeout_fn() said no new step will come: end once none is left
  nested = False  # the directory holds no step and its checkpoints/ does (a workdir)
  look_nested = clock()  # when to look at <directory>/checkpoints next, while it is empty
  # The lease on the step last yielded, kept while the caller works and while the iterator
  # waits for the next step: a rollback that abandons that step cannot delete it meanwhile,
  # so the listings that follow see that it was abandoned (released at the next yield).
  held = None
  try:
    while True:
      waited_since = clock()
      step = None
      while step is None:
        # (On an object store the steps up to the one yielded last were checked when they
        # were yielded: only newer index entries are read, not one per step every poll.)
        steps, leftovers = step_dir.list_steps(loc, trusted_to=last)
        # Not the steps a committed rollback abandoned. If the save yielded last was taken
        # back (seen while its lease keeps it on storage), the new run's steps come next, at
        # whatever numbers: after the newest step it kept from before.
        steps, taken_back, kept = _visible(loc, steps, last, yielded)
        if taken_back:
          log.info("checkpoints_iterator: step %d was taken back (a rollback of the training"
                   " job, or a save over it); yielding the steps saved after step %s", last,
                   kept)
          last = kept if start_after is None or (kept is not None and kept > start_after) \
              else start_after
          if held is not None:
            held.release()
            held = None
        newer = [s for s in steps if last is None or s > last]
        if newer:
          step = newer[0]
          break
        absent = _absent(loc, steps, leftovers)
        if absent is None and not steps and (nested or (
            clock() >= look_nested and _holds_steps(loc.join("checkpoints")))):
          nested = True  # a workdir: its steps are in checkpoints/
          absent = f"holds no step, but {loc.join('checkpoints')} does"
        elif absent is None and not steps and clock() >= look_nested:
          # Looked at (a listing more) once a minute, not every poll: it only names the
          # directory to pass instead, and a job's first save may take that long to come.
          look_nested = clock() + _NESTED_LOOK_S
        if finished:  # timeout_fn() said no new step will come, and none had come since
          _stopping(loc, absent, "as timeout_fn() says no new step will come",
                    f"timeout_fn() says no new step will come to {loc}")
          return
        if absent and not warned_absent:
          warned_absent = True
          waiting = "no timeout" if timeout is None else f"timeout {timeout:g} s"
          if nested:
            log.warning("checkpoints_iterator: %s %s: is it a workdir? Waiting for steps in %s"
                        " itself (%s); pass the directory the manager saves to: %s.", loc,
                        absent, loc, waiting, loc.join("checkpoints"))
          else:
            log.warning("checkpoints_iterator: %s %s; waiting for a training job to save its"
                        " first step there (%s). Pass the directory the manager saves to, e.g."
                        " <workdir>/checkpoints.", loc, absent, waiting)
        if timeout is not None and clock() - waited_since >= timeout:
          if timeout_fn is not None:
            if timeout_fn():
              finished = True  # listed once more: a step committed just before is yielded
            else:
              waited_since = clock()  # another timeout's wait
            continue
          _stopping(loc, absent, f"after waiting {timeout:g} s",
                    f"no new step in {loc} for {timeout:g} s (the timeout)")
          return
        # Not past the timeout: a listing every poll_interval, and one more at the timeout.
        left = None if timeout is None else timeout - (clock() - waited_since)
        sleep(poll_interval if left is None else max(0.0, min(poll_interval, left)))
      if last_yield is not None and min_interval:
        pause = min_interval - (clock() - last_yield)
        if pause > 0:
          sleep(pause)
      # The reader's side of the protocol (orbax_flax.manager.leases): lease first, then
      # look for a deletion notice, then check that the step is still committed.
      lease = None
      if leasing:
        try:
          lease = leases.Lease(loc, step)
        except errors.StorageError as e:  # read-only access: a reader changes nothing
          leasing = False
          log.warning("checkpoints_iterator: cannot write a reader lease in %s (%s); reading"
                      " without leases from now on, so a step is not protected from the training"
                      " job's keep rules while it is read (a step deleted meanwhile fails its"
                      " restore with CheckpointNotFoundError). Give this job write access to %s"
                      " for leases, or keep more steps there (max_to_keep).", loc, e,
                      loc.join(leases.READERS))
      try:
        if leases.deletion_announced(loc, step):
          log.info("checkpoints_iterator: step %d is being deleted by the training job's retention"
                   " (faster than this evaluator); skipping it", step)
          last = step
          continue
        try:
          summary = restoring.read_summary(loc.join(str(step)))
        except errors.CheckpointNotFoundError:
          log.info("checkpoints_iterator: step %d was deleted before it could be read (the"
                   " training job's retention is faster than this evaluator); skipping it", step)
          last = step
          continue
        last, last_yield = step, clock()
        yielded[step] = summary.generation
        if held is not None:
          held.release()
        held, lease = lease, None  # released when the next step is yielded, or taken back
        yield step
      finally:
        if lease is not None:
          lease.release()
  finally:
    if held is not None:
      held.release()


def _visible(loc: Location, steps: list[int], last: int | None,
             yielded: dict[int, str]) -> tuple[list[int], bool, int | None]:
  """The listed ``steps`` without those a committed rollback abandoned; whether the save
  yielded last as step ``last`` was taken back (a committed rollback abandoned it, or another
  save replaced it at that number: a rollback's new run, an overwrite); and then the step to
  go on after: the newest listed step still the save yielded as it (``yielded``: step ->
  generation, pruned here to the listed steps), None if none is.

  Reads the manifest summary of ``last`` (one read), and of older yielded steps only when
  ``last`` was taken back.
  """
  records = step_dir.read_rollbacks(loc)
  abandoned = registry.abandoned_steps(loc, steps, records)[0] if records else set()
  visible = sorted(s for s in steps if s not in abandoned)
  for s in [s for s in yielded if s not in steps]:
    del yielded[s]
  if last is None or last not in yielded:
    return visible, False, None
  if last not in abandoned and registry.generation_of(loc, last) == yielded[last]:
    return visible, False, None
  for s in sorted((s for s in visible if s < last and s in yielded), reverse=True):
    if registry.generation_of(loc, s) == yielded[s]:
      return visible, True, s
  return visible, True, None


def _stopping(loc: Location, absent: str | None, when: str, why: str) -> None:
  """Logs that the iterator ends (``why``), as a WARNING if nothing was ever saved in ``loc``."""
  if absent:
    log.warning("checkpoints_iterator: stopping %s: %s still %s (nothing was ever saved"
                " there; is it the manager's directory, e.g. <workdir>/checkpoints?)", when, loc,
                absent)
  else:
    log.info("checkpoints_iterator: stopping: %s", why)


# Seconds between two looks at <directory>/checkpoints while the directory holds no step.
_NESTED_LOOK_S = 60.0


def _holds_steps(loc: Location) -> bool:
  """Whether ``loc`` holds a committed step (False where it cannot be listed)."""
  try:
    return bool(step_dir.list_steps(loc)[0])
  except (OSError, errors.StorageError):
    return False


def _absent(loc: Location, steps: list[int], leftovers: list[Any]) -> str | None:
  """How ``loc`` is missing ("does not exist yet"), or None if it is there."""
  if loc.is_local:
    return None if os.path.isdir(loc.local_path) else "does not exist yet"
  return None if steps or leftovers else "holds no checkpoint yet"
