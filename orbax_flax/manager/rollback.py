"""A run's timeline, and what a restore of an older step (a rollback) changes.

Users go back to older steps (a loss spike, a bad data shard): restoring a
step older than the latest committed one makes the newer steps belong to an
abandoned run. :class:`Rollback` is the manager's record of that, beside its
:class:`~orbax_flax.manager.registry.StepRegistry`: which steps are abandoned, whether
a save replaces a committed step, and the timeline id recorded with every save.

Example:
  >>> import numpy as np, orbax_flax as ofx, tempfile
  >>> with ofx.CheckpointManager(tempfile.mkdtemp()) as mngr:
  ...   for step in (10, 20, 30):
  ...     _ = mngr.save(step, {"s": {"w": np.full(2, step)}}, force=True)
  ...   _ = mngr.restore(10)                    # a rollback: 20 and 30 are abandoned
  ...   _ = mngr.save(15, {"s": {"w": np.full(2, 15)}}, force=True)
  ...   mngr.wait()
  ...   mngr.all_steps()                        # gone once this run committed 15
  [10, 15]
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

from orbax_flax.core import _multihost
from orbax_flax import errors
from orbax_flax.manager import policy as policy_lib
from orbax_flax.manager import registry as registry_lib
from orbax_flax.engine import restoring
from orbax_flax.core._location import Location

log = logging.getLogger("orbax_flax")


class Rollback:
  """A run's timeline, and what a restore of an older step (a rollback) changes.

  After ``restore()`` of a step older than the latest, the newer steps belong
  to the abandoned run: a save of this run replaces one of them, and they are
  all removed once this run commits its first save, so that "latest" and the
  keep rules see this run only. The timeline id is recorded with every save
  (``custom["timeline"]``), so that the local tier can tell the steps of this
  timeline from those of one a rollback abandoned: it starts as the timeline
  of the latest committed step ("" with none, or for steps saved before
  timelines were recorded); every rollback starts a new one, the same on every
  process (process 0 draws it).
  """

  def __init__(self, directory: Location, registry: registry_lib.StepRegistry, key: str,
               timeout_s: float):
    self._dir, self._registry, self._key, self._timeout_s = directory, registry, key, timeout_s
    self._lock = threading.Lock()  # with the registry's commits: one view of both
    self.to: int | None = None     # the step rolled back to, until this run's first commit
    self._abandoned: set[int] = set()
    self._timeline: str | None = None
    self._count = 0  # rollbacks so far (their coordination keys)

  def active(self) -> bool:
    """Whether a rollback waits for this run's first commit."""
    return self.to is not None

  def knows(self, step: int) -> tuple[bool, bool]:
    """(committed, of the abandoned run) for ``step``, from one view."""
    with self._lock:
      return step in self._registry, step in self._abandoned

  def abandons(self, step: int) -> bool:
    """Whether ``step`` belongs to the run a rollback abandoned (a save of it replaces it)."""
    with self._lock:
      return step in self._abandoned

  def replaces(self, step: int, *, forced: bool) -> bool | None:
    """Whether a save of ``step`` replaces a committed one (one of the abandoned run, or any if
    ``forced``); None: ``step`` is committed and is not saved again (logged)."""
    exists, abandoned = self.knows(step)
    if exists and abandoned:
      log.info("step %d: replacing the abandoned run's checkpoint of this step (rolled back to"
               " step %d)", step, self.to)
      return True
    if exists and forced:
      log.warning("step %d is already committed in %s; replacing it (force=True)", step, self._dir)
      return True
    if exists:
      log.warning("step %d is already saved in %s; not saving it again (force=True replaces it)",
                  step, self._dir)
      return None
    return False

  def timeline(self, latest_step: Callable[[], int | None]) -> str:
    """The timeline id (``latest_step``: the newest committed step, asked the first time)."""
    if self._timeline is None:
      timeline, latest = "", latest_step()
      if latest is not None:
        try:
          summary = restoring.read_summary(self._dir.join(str(latest)))
          timeline = str(summary.custom.get("timeline", ""))
        except (errors.CheckpointNotFoundError, errors.CheckpointCorruptedError) as e:
          log.warning("the timeline of step %d cannot be read (%s); taking it as unknown",
                      latest, e)
      self._timeline = timeline
    return self._timeline

  def restored(self, step: int, inflight: int | None) -> None:
    """``step`` was restored, ``inflight`` was the last save started (ended or not, its
    commit perhaps not recorded yet): a rollback if newer steps exist."""
    with self._lock:
      newer = {s for s in self._registry.committed() if s > step}
      if newer and inflight is not None and inflight > step:
        newer.add(inflight)  # a save of the abandoned run still in flight belongs to it too
      cancelled = not newer and self.to is not None
      # The last restore decides: a restore of the latest step calls off an earlier rollback
      # (looking at an old step, then resuming the newest, abandons nothing).
      self.to, self._abandoned = (step, newer) if newer else (None, set())
    if cancelled:
      self._timeline = None  # the latest step's again (read when next asked)
      log.info("restored step %d, the latest of %s: the earlier rollback is called off, no"
               " step is abandoned", step, self._dir)
    if not newer:
      return
    self._count += 1
    self._timeline = _multihost.broadcast(f"{self._key}/timeline/{self._count}", uuid.uuid4().hex,
                                          self._timeout_s)
    log.info("rollback to step %d: new timeline %s (local-tier steps of the old one are"
             " not resumed)", step, self._timeline)
    log.info("restored step %d of %s, older than the latest (%d): saves of this run replace"
             " the newer steps, which are removed once this run commits a save", step,
             self._dir, max(newer))

  def committed(self, info: policy_lib.StepInfo, new_run: bool) -> set[int]:
    """Commits ``info.step`` to the registry; returns the abandoned steps that go with it."""
    gone: set[int] = set()
    with self._lock:
      if new_run and self.to is not None:  # this run's first commit after the rollback
        gone = self._abandoned - {info.step}
        self.to, self._abandoned = None, set()
      elif self.to is not None and info.step > self.to:
        self._abandoned.add(info.step)  # a save of the abandoned run that was in flight
      self._registry.add(info, dropping=gone)
    if gone:
      log.info("rolled back: removing step(s) %s of the abandoned run now that step %d of"
               " this run is committed", sorted(gone), info.step)
    return gone
