"""A series of checkpoints, one per step, under one directory.

:class:`CheckpointManager` is the thin stateful shell around the pure policies of
:mod:`orbax_flax.policy`: it remembers the last save and the save in flight, asks the policy
whether a step is due, saves with the engine, and deletes what the keep rules no longer keep once a
newer step has committed.

Layout: ``<directory>/<step>/`` is a checkpoint (see :func:`orbax_flax.save`). A step exists if and
only if it is committed, so listing the directory is discovery; nothing else is read until step
metadata is needed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from orbax_flax import _multihost
from orbax_flax import checkpointer as checkpointer_lib
from orbax_flax import errors
from orbax_flax import describe as metadata_lib
from orbax_flax import policy as policy_lib
from orbax_flax import restoring
from orbax_flax import saving
from orbax_flax import step_dir
from orbax_flax._location import Location
from orbax_flax.config import CheckpointPolicy
from orbax_flax.differential import retention

log = logging.getLogger("orbax_flax")


@dataclasses.dataclass(frozen=True)
class SaveEvent:
  """A committed save, for logs and metric writers.

  ``blocking_s`` is the whole time the caller's thread waited for the save (with the training
  callback: inside ``on_step_end``, from its start); the ``blocking_*_s`` fields are its main
  parts.
  """
  step: int
  reason: str
  blocking_s: float
  total_s: float                        # from the start of blocking_s to the commit
  nbytes: int
  expected_loss_s: float | None = None  # work lost by a failure now, on average (interval / 2)
  blocking_items_s: float = 0.0  # building the items from the state (the caller's, e.g. the callback's)
  blocking_data_s: float = 0.0   # the data iterator's get_state() and the gather of positions
  blocking_wait_s: float = 0.0   # before the save began: the previous save still committing
  blocking_copy_s: float = 0.0   # the engine's blocking phase: plan and snapshot (a blocking save: all)
  bytes_written: int = 0  # array bytes the step holds itself, all processes (differential: the changed)
  bytes_reused: int = 0   # array bytes it references in earlier steps instead (differential saves)


_BEFORE_KEYS = ("total", "items", "data")


@dataclasses.dataclass
class _InFlight:
  step: int
  handle: saving.AsyncSave | None
  thread: threading.Thread
  abandoned: threading.Event = dataclasses.field(default_factory=threading.Event)


class CheckpointManager:
  """Saves steps on a policy, keeps what the policy keeps, restores the latest.

  Example:
    >>> import numpy as np, orbax_flax as ofx, tempfile
    >>> policy = ofx.CheckpointPolicy(save_interval_steps=2, max_to_keep=2)
    >>> with ofx.CheckpointManager(tempfile.mkdtemp(), policy) as mngr:
    ...   for step in range(1, 8):
    ...     _ = mngr.save(step, {"state": {"w": np.full(3, step)}}, metrics={"loss": 1 / step})
    ...   mngr.wait()
    ...   print(mngr.all_steps(), mngr.latest_step())
    ...   print(mngr.restore()["state"]["w"])
    [4, 6] 6
    [6 6 6]

  Args:
    directory: local path, ``s3://``/``gs://`` URL or kvstore spec dict.
    policy: when to save and what to keep (default: save only when asked,
      keep everything).
    clock: wall-time source, ``time.time`` by default; tests pass a fake.
  """

  def __init__(self, directory: Any, policy: CheckpointPolicy | None = None, *,
               clock: Callable[[], float] = time.time):
    self._dir = Location.parse(directory)
    self.policy = policy if policy is not None else CheckpointPolicy()
    if not isinstance(self.policy, CheckpointPolicy):
      raise TypeError(f"policy must be a CheckpointPolicy (use CheckpointPolicy.from_config("
                      f"config.checkpoint)); got {type(self.policy).__name__}")
    self._trigger = self.policy.trigger()
    timed = (policy_lib.EveryNSeconds, policy_lib.YoungDaly)
    self._step_trigger = policy_lib.any_of(
        *(t for t in self._trigger.triggers if not isinstance(t, timed)))
    time_triggers = [t for t in self._trigger.triggers if isinstance(t, timed)]
    self._time_trigger = policy_lib.any_of(*time_triggers) if time_triggers else None
    self._auto = next((t for t in time_triggers if isinstance(t, policy_lib.YoungDaly)), None)
    self._costs = policy_lib.CostWindow()  # recent blocking times
    self._last_commit_time: float | None = None
    self._rules = self.policy.keep_rules()
    self._clock = clock
    self._last_step: int | None = None
    self._last_time = clock()
    self._first = True
    self._prepared = False  # staging memory prepared (or a save made): see prepare()
    self._inflight: _InFlight | None = None
    self._error: BaseException | None = None
    self._lock = threading.Lock()
    self._steps: set[int] = set()
    self._deleting: set[int] = set()  # uncommitted by this manager, deletion pending
    self._reading: dict[int, int] = {}  # steps a restore is reading: never deleted meanwhile
    self._deferred: set[int] = set()    # doomed while being read: deleted once read
    self._leased: set[int] = set()      # doomed, but an evaluator's lease holds them
    # After restore() of a step older than the latest (a rollback), the newer
    # steps belong to the abandoned run: replaced if this run saves them again,
    # removed once this run commits its first save.
    self._rollback_to: int | None = None
    self._abandoned: set[int] = set()
    self._timeline: str | None = None   # see the timeline property
    self._rollbacks = 0                 # rollbacks so far (their coordination keys)
    self._infos: dict[int, policy_lib.StepInfo] = {}
    self._deleter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="orbax_flax-delete")
    self._deletions: list[concurrent.futures.Future] = []
    self._events: list[SaveEvent] = []
    self._closed = False
    self._key = _multihost.namespace("manager", str(self._dir))
    self._ckptr = checkpointer_lib.Checkpointer(
        max_host_bytes=self.policy.max_host_bytes,
        keep_staging_memory=self.policy.keep_staging_memory,
        coordination_timeout_seconds=self.policy.coordination_timeout_seconds,
        coordination_key=f"{self._key}/save", watchdog_seconds=self.policy.watchdog_seconds,
        differential=self.policy.differential)
    self.reload()
    self._startup_cleanup()

  # -------------------------------------------------------------------- discovery

  @property
  def directory(self) -> str:
    return str(self._dir)

  @property
  def timeline(self) -> str:
    """The id of the run's timeline: what this manager's saves continue.

    Recorded with every save (``custom["timeline"]``), so that the local tier
    can tell the steps of this timeline from those of one a rollback
    abandoned. It starts as the timeline of the latest committed step ("" with
    none, or for steps saved before timelines were recorded); a rollback
    (:meth:`restore` of an older step) starts a new one, the same on every
    process.
    """
    if self._timeline is None:
      latest = self.latest_step()
      timeline = ""
      if latest is not None:
        try:
          summary = restoring.read_summary(self._dir.join(str(latest)))
          timeline = str(summary.custom.get("timeline", ""))
        except (errors.CheckpointNotFoundError, errors.CheckpointCorruptedError) as e:
          log.warning("the timeline of step %d cannot be read (%s); taking it as unknown",
                      latest, e)
      self._timeline = timeline
    return self._timeline

  def step_path(self, step: int) -> str:
    """Where ``step`` is (or would be) stored."""
    return str(self._dir.join(str(step)))

  def reload(self) -> None:
    """Re-lists the directory (other jobs may have changed it)."""
    steps, leftovers = step_dir.list_steps(self._dir)
    with self._lock:
      self._steps = set(steps) - self._deleting
      self._infos = {s: i for s, i in self._infos.items() if s in self._steps}
      self._leftovers = leftovers

  def all_steps(self) -> list[int]:
    """Committed steps, ascending. Reads no checkpoint data."""
    self._raise_error()
    return self._committed()

  def _committed(self) -> list[int]:
    with self._lock:
      return sorted(self._steps)

  def has_step(self, step: int) -> bool:
    """True if ``step`` is committed or its save is in flight (so saving it again is moot)."""
    inflight = self._inflight
    if inflight is not None and inflight.step == step and not inflight.abandoned.is_set():
      return True
    with self._lock:
      return step in self._steps and step not in self._abandoned

  def latest_step(self) -> int | None:
    """The newest committed step, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def leftovers(self) -> list[step_dir.Leftover]:
    """Debris of interrupted saves that is still on storage."""
    return list(self._leftovers)

  def step_info(self, step: int) -> policy_lib.StepInfo:
    """Time, metrics and reason recorded with ``step`` (reads a few KB once)."""
    with self._lock:
      if step in self._infos:
        return self._infos[step]
      if step not in self._steps:
        raise errors.CheckpointNotFoundError(
            f"step {step} is not a committed checkpoint in {self._dir}; committed steps:"
            f" {_short(sorted(self._steps))}")
    info = _info_from_summary(step, restoring.read_summary(self._dir.join(str(step))))
    with self._lock:
      self._infos[step] = info
    return info

  def _all_infos(self) -> list[policy_lib.StepInfo]:
    steps = self._committed()
    missing = [s for s in steps if s not in self._infos]
    if missing:
      with concurrent.futures.ThreadPoolExecutor(8 if not self._dir.is_local else 1) as ex:
        list(ex.map(self._info_or_unknown, missing))
    with self._lock:
      return [self._infos[s] for s in steps if s in self._infos]

  def _info_or_unknown(self, step: int) -> None:
    """Loads ``step``'s info; a damaged manifest counts as no metrics (and is logged)."""
    try:
      self.step_info(step)
    except errors.CheckpointNotFoundError:
      pass  # deleted meanwhile
    except (errors.CheckpointCorruptedError, ValueError) as e:
      log.warning("step %d: cannot read its metadata (%s); keep rules treat it as having no"
                  " metrics. `python -m orbax_flax verify %s` checks it.", step, e,
                  self.step_path(step))
      with self._lock:
        self._infos[step] = policy_lib.StepInfo(step, 0.0, {}, "unknown")

  def best_step(self) -> int | None:
    """The committed step with the best ``policy.best_metric``; None if none has it."""
    if not self.policy.best_metric:
      raise ValueError("best_step() needs a metric: set best_metric in the checkpoint policy"
                       " (e.g. CheckpointPolicy(best_metric='loss', best_mode='min')).")
    return policy_lib.best_step(self._all_infos(), self.policy.best_metric, self.policy.best_mode)

  def metadata(self, step: int | None = None) -> metadata_lib.CheckpointMetadata:
    """The engine metadata of ``step`` (default: latest)."""
    return metadata_lib.metadata(self._dir.join(str(self._resolve(step))))

  # -------------------------------------------------------------------- saving

  def should_save(self, step: int) -> str | None:
    """The reason the policy saves ``step``, or None. Call it on every process.

    With a time-based policy in a multi-process job, process 0's clock decides
    and the decision is shared through the coordination service, so every
    process saves the same step.
    """
    first, self._first = self._first, False
    state = policy_lib.SaveState(step, self._clock(), self._last_step, self._last_time, first,
                                 self.save_cost())
    reason = self._step_trigger(state)
    if reason is not None or self._time_trigger is None:
      return reason
    return _multihost.decide_per_step(f"{self._key}/time", step,
                                      lambda: self._time_trigger(state) or "") or None

  def save(self, step: int, items: Mapping[str, Any], *, metrics: Mapping[str, Any] | None = None,
           force: bool = False, reason: str | None = None,
           custom_metadata: Mapping[str, Any] | None = None,
           blocking_before: Mapping[str, float] | None = None) -> bool:
    """Saves ``step`` if the policy says so (or ``force``); returns whether it started.

    With ``async_save`` the call returns once the state is on the host; the commit, and deletion of
    steps the policy no longer keeps, continue in the background. Errors of a background save are
    raised by the next call.

    Args:
      step: the training step (a non-negative int).
      items: item name -> pytree, as for :func:`orbax_flax.save`.
      metrics: scalar metrics to record (jax scalars are fetched only when a save happens).
      force: save even if the policy would not.
      reason: the reason to record ("final", "preemption", ...); implies force.
      custom_metadata: JSON-serialisable data recorded with the step.
      blocking_before: seconds the caller's thread already spent on this save before the call,
        counted in the blocking time reported (:class:`SaveEvent`): ``"items"`` (building them),
        ``"data"`` (the data iterator's state) and ``"total"`` (all of it; default: their sum). The
        training callback passes them.
    """
    entered = time.perf_counter()
    self._raise_error()
    before = _blocking_before(blocking_before)
    step = _as_step(step)
    if reason is not None and reason not in policy_lib.REASONS:
      raise ValueError(f"reason must be one of {policy_lib.REASONS}, got {reason!r}")
    decided = reason or ("forced" if force else None) or self.should_save(step)
    if decided is None:
      if not self._prepared:  # the first call that does not save: the memory of the first that will
        self.prepare(items)
      return False
    self._prepared = True
    with self._lock:
      exists = step in self._steps
      replaces_abandoned = step in self._abandoned
    if self._inflight is not None and self._inflight.step == step and not self._inflight.abandoned.is_set():
      log.warning("step %d is being saved already in %s; not saving it again", step, self._dir)
      return False
    overwrite = False
    if exists and replaces_abandoned:
      log.info("step %d: replacing the abandoned run's checkpoint of this step (rolled back to"
               " step %d)", step, self._rollback_to)
      overwrite = True
    elif exists and decided in ("forced", "final", "preemption", "exception") and reason != "final":
      log.warning("step %d is already committed in %s; replacing it (force=True)", step, self._dir)
      overwrite = True
    elif exists:
      log.warning("step %d is already saved in %s; not saving it again (force=True replaces it)",
                  step, self._dir)
      return False
    if self.policy.if_busy == "skip" and decided not in ("forced", "final", "preemption", "exception"):
      busy = self._inflight is not None and self._inflight.thread.is_alive()
      if _multihost.process_count() > 1:  # every process must skip the same steps
        votes = _multihost.all_gather(f"{self._key}/busy/{step}", "1" if busy else "0")
        busy = "1" in votes
      if busy:
        log.info("skipping the %s save of step %d: the previous save is still being written",
                 decided, step)
        return False
    self._finish_inflight()
    wait_s = time.perf_counter() - entered
    now = self._clock()
    custom = {"step": step, "reason": decided, "time": now, "metrics": _scalars(metrics or {}),
              "mesh": _mesh_of(items), "user": dict(custom_metadata or {}),
              "timeline": self.timeline}
    path = self._dir.join(str(step))
    start = time.perf_counter()
    _set_writing(str(self._dir), step, True)
    try:
      if not self._dir.is_local and _multihost.process_index() == 0:
        # An interrupted save of this very step left data under its prefix; it
        # would stay there, unreferenced, inside the new checkpoint.
        for l in [l for l in self._leftovers if l.step == step]:
          log.info("removing leftover %s of an interrupted save of step %d", l.name, step)
          step_dir.remove(self._dir, l.name)
      overwrite = retention.before_save(self._ckptr.differential, self._dir, step,
                                        self._committed(), overwrite)  # differential: base, room
      if self.policy.async_save:
        # A preemption save with a grace period may be cancelled: it writes in short batches.
        cancellable = decided == "preemption" and self.policy.preemption_grace_seconds > 0
        handle = self._ckptr.save_async(path, items, custom_metadata=custom, overwrite=overwrite,
                                        cancellable=cancellable)
      else:
        self._ckptr.save(path, items, custom_metadata=custom, overwrite=overwrite)
        handle = None
    except BaseException:
      _set_writing(str(self._dir), step, False)
      raise
    returned = time.perf_counter()
    blocking = SaveEvent(step, decided, before["total"] + returned - entered, 0.0, 0,
                         blocking_items_s=before["items"], blocking_data_s=before["data"],
                         blocking_wait_s=wait_s,
                         blocking_copy_s=handle.blocking_s if handle is not None else returned - start)
    info = policy_lib.StepInfo(step, now, custom["metrics"], decided)
    abandoned = threading.Event()
    new_run = self._rollback_to is not None
    thread = threading.Thread(target=self._after_save,
                              args=(info, handle, entered - before["total"], abandoned,
                                    new_run, blocking),
                              name=f"orbax_flax-commit-{step}")
    self._inflight = _InFlight(step, handle, thread, abandoned)
    thread.start()
    self._last_step, self._last_time = step, now
    if handle is None:
      self._finish_inflight()
    return True

  def _after_save(self, info: policy_lib.StepInfo, handle: saving.AsyncSave | None,
                  start: float, abandoned: threading.Event, new_run: bool,
                  blocked: SaveEvent) -> None:
    """Waits for the commit, records it (``blocked``: the blocking times, from save()),
    and deletes what the keep rules drop; ``start``: when the caller's wait began."""
    step = info.step
    try:
      if handle is not None:
        handle.wait()
      gone: set[int] = set()
      with self._lock:
        self._steps.add(step)
        self._infos[step] = info
        if new_run and self._rollback_to is not None:
          # The first commit of the run that rolled back: the abandoned run's
          # newer steps go, so that "latest" and the keep rules see this run only.
          gone = self._abandoned - {step}
          self._steps -= gone
          self._deleting |= gone
          self._rollback_to, self._abandoned = None, set()
        elif self._rollback_to is not None and step > self._rollback_to:
          self._abandoned.add(step)  # a save of the abandoned run that was in flight
      if gone:
        log.info("rolled back: removing step(s) %s of the abandoned run now that step %d of"
                 " this run is committed", sorted(gone), step)
      total = time.perf_counter() - start
      blocking = blocked.blocking_s
      nbytes = handle.nbytes if handle is not None else 0
      log.info("checkpoint step %d (%s) committed to %s: blocking %.3f s (items %.3f, data"
               " iterator %.3f, previous save %.3f, snapshot %.3f), total %.3f s, %s written by"
               " this process", step, info.reason, self.step_path(step), blocking,
               blocked.blocking_items_s, blocked.blocking_data_s, blocked.blocking_wait_s,
               blocked.blocking_copy_s, total, metadata_lib.human_bytes(nbytes))
      self._costs.add(blocking)
      now = self._clock()
      if self._auto is not None:
        interval = self._auto.interval(self.save_cost())
      else:
        interval = None if self._last_commit_time is None else now - self._last_commit_time
      self._last_commit_time = now
      loss = None if interval is None else interval / 2
      if self._auto is not None:
        log.info("save_interval=auto: saves cost %.3f s (median of the last %d), mtbf %.0f s:"
                 " saving every %.1f s; a failure loses %.1f s of work on average", self.save_cost(),
                 len(self._costs), self._auto.mtbf_seconds, interval, loss)
      with self._lock:
        self._events.append(dataclasses.replace(blocked, total_s=total, nbytes=nbytes,
                                                expected_loss_s=loss,
                                                **retention.stored_bytes(self._dir.join(str(step)))))
      doomed = policy_lib.to_delete(self._keep_inputs(), self._rules) if not self._abandoned else []
      with self._lock:
        self._steps -= set(doomed)
        self._deleting |= set(doomed)
      doomed = sorted(set(doomed) | gone)
      if (doomed or self._leftovers or self._leased) and _multihost.process_index() == 0:
        self._deletions.append(self._deleter.submit(self._delete_steps, doomed))
    except BaseException as e:  # pylint: disable=broad-except  # Raised on the next call.
      if abandoned.is_set():
        log.warning("abandoned save of step %d ended without committing: %s", step, e)
      else:
        self._error = e
    finally:
      _set_writing(str(self._dir), step, False)

  def prepare(self, items: Mapping[str, Any]) -> int:
    """Prepares the staging memory of the first async save of ``items``, in the background.

    So that the first save blocks like the later ones (see
    :meth:`Checkpointer.prepare`). :meth:`save` does it by itself at its first
    call that does not save; :class:`orbax_flax.CheckpointCallback` calls it
    when it has the state, at ``restore_or_init``. Returns the bytes being
    prepared (0: none, e.g. with ``async_save=False``).
    """
    self._prepared = True
    if not self.policy.async_save:
      return 0
    return self._ckptr.prepare(items)

  @property
  def staging_bytes(self) -> int:
    """Host memory held now for the snapshots of async saves (prepared or kept)."""
    return self._ckptr.staging_bytes

  def host_snapshot(self, items: Mapping[str, Any]) -> Mapping[str, Any]:
    """``items`` copied to host memory as this manager's async save would (see
    :meth:`Checkpointer.host_snapshot`): a step saved to two tiers shares it."""
    return self._ckptr.host_snapshot(items)

  def save_cost(self) -> float | None:
    """The median blocking time of the last few saves (what ``save_interval="auto"`` uses)."""
    return self._costs.median()

  def pop_events(self) -> list[SaveEvent]:
    """Saves committed since the last call (for metric writers)."""
    if not self._events:
      return []
    with self._lock:
      events, self._events = self._events, []
    return events

  @property
  def coordination_key(self) -> str:
    """A key prefix in the coordination service unique to this manager, same on every process."""
    return self._key

  def _keep_inputs(self) -> list[policy_lib.StepInfo]:
    """What keep rules need: step numbers, plus metadata only if a rule reads it."""
    if not self._rules:
      return []
    if any(isinstance(r, (policy_lib.KeepBest, policy_lib.KeepOnePer)) for r in self._rules):
      return self._all_infos()
    return [policy_lib.StepInfo(s, 0.0) for s in self._committed()]

  def _delete_steps(self, steps: list[int]) -> None:
    """Deletes ``steps`` unless a restore here or an evaluator's lease still reads them.

    The manager's side of the reader-lease protocol (see :mod:`orbax_flax.evaluation`): announce,
    then read the leases, then uncommit, then withdraw the notice.
    """
    from orbax_flax import evaluation  # pylint: disable=g-import-not-at-top  # reader leases
    steps = sorted(set(steps) | self._leased)
    if not steps:
      self._remove_leftovers()
      return
    announced = time.monotonic()
    evaluation.announce_deletion(self._dir, steps)
    try:
      leased = evaluation.leased_steps(self._dir)
      if time.monotonic() - announced > evaluation.LEASE_SECONDS / 4:
        # So slow that a reader could take the notices for stale ones: try again later.
        log.warning("reading the reader leases of %s took %.0f s; deleting steps %s at a later"
                    " save", self._dir, time.monotonic() - announced, steps)
        with self._lock:
          self._leased |= set(steps)
        return
      for step in steps:
        with self._lock:
          if self._reading.get(step):
            self._deferred.add(step)  # a restore is reading it: deleted when it is done
            continue
          if step in leased:  # an evaluator (checkpoints_iterator) is reading it
            if step not in self._leased:
              log.info("step %d: not deleted yet, an evaluator holds a reader lease on it; it is"
                       " deleted at a later save", step)
            self._leased.add(step)
            continue
          self._leased.discard(step)
        log.info("deleting checkpoint step %d (no keep rule keeps it)", step)
        retention.delete_step(self._dir, step, self._ckptr.differential.pins)  # keeps what is referenced
        with self._lock:
          self._deleting.discard(step)
    finally:
      # Deleted (uncommitted) or kept: either way readers may look at it again.
      evaluation.withdraw_deletion(self._dir, steps)
    self._remove_leftovers()

  def inflight_step(self) -> int | None:
    """The step whose save is still being written, if any."""
    inflight = self._inflight
    return inflight.step if inflight is not None and inflight.thread.is_alive() else None

  def wait_for_save(self, timeout: float | None = None) -> bool:
    """Waits up to ``timeout`` seconds for the save in flight; True if none is left running.

    Unlike :meth:`wait` it raises nothing (errors are raised by the next call).
    """
    inflight = self._inflight
    if inflight is None:
      return True
    inflight.thread.join(timeout)
    return not inflight.thread.is_alive()

  def abandon_inflight(self) -> None:
    """Cancels the save in flight so that it never commits, and stops waiting for it.

    Used when a preemption grace period runs out. Its data may still be written; it is left
    as a leftover, never as a committed step.
    """
    inflight = self._inflight
    if inflight is not None and inflight.thread.is_alive() and inflight.handle is not None:
      inflight.abandoned.set()
      inflight.handle.cancel()

  def _finish_inflight(self) -> None:
    if self._inflight is not None:
      if not self._inflight.abandoned.is_set():
        self._inflight.thread.join()
      self._inflight = None
    self._raise_error()

  def _raise_error(self) -> None:
    if self._error is not None:
      e, self._error = self._error, None
      raise e

  def wait(self) -> None:
    """Blocks until the save in flight and pending deletions are done; raises their errors."""
    self._finish_inflight()
    deletions, self._deletions = self._deletions, []
    for f in deletions:
      f.result()

  def close(self) -> None:
    """Waits for everything in flight, then releases the manager's threads."""
    if self._closed:
      return
    try:
      self.wait()
    finally:
      self._closed = True
      self._deleter.shutdown(wait=True)
      self._ckptr.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc is None:
      self.close()
      return
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except
      log.exception("while closing the checkpoint manager after an error")

  # -------------------------------------------------------------------- restoring

  def _resolve(self, step: int | None) -> int:
    if step is None:
      step = self.latest_step()
      if step is None:
        raise errors.CheckpointNotFoundError(f"no committed checkpoint in {self._dir}")
    return step

  def restore(self, step: int | None = None, target: Mapping[str, Any] | None = None, *,
              partial: bool = False, allow_lossy_casts: bool = False,
              casts: list | None = None, read_once: bool | None = None) -> dict[str, Any]:
    """Restores ``step`` (default: the latest committed), resharded onto ``target``.

    With ``step=None`` a save in flight is waited for first, so that the latest step includes it. A
    given ``step`` is read as it is committed now, without waiting for a save of another step, and
    no keep rule deletes it while it is read (so ``restore(latest_step())`` always works).
    Restoring a step older than the latest one is a rollback: this run's next saves replace the
    newer steps of the abandoned run, which are removed once this run commits its first save (see
    the README).

    Raises:
      CheckpointNotFoundError: there is no such step (or no step at all).
    """
    self._raise_error()
    if step is None or (self._inflight is not None and self._inflight.step == step):
      self._finish_inflight()
    step = self._resolve(step if step is None else _as_step(step))
    with self._lock:
      known = step in self._steps
      if known:
        self._reading[step] = self._reading.get(step, 0) + 1
    if not known:
      raise errors.CheckpointNotFoundError(
          f"step {step} is not a committed checkpoint in {self._dir}; committed steps:"
          f" {_short(self.all_steps())}")
    try:
      out = self._ckptr.restore(self._dir.join(str(step)), target, partial=partial,
                                allow_lossy_casts=allow_lossy_casts, casts=casts,
                                read_once=self.policy.read_once_restore if read_once is None
                                else read_once)
    finally:
      with self._lock:
        self._reading[step] -= 1
        late = step in self._deferred and not self._reading[step]
        if late:
          self._deferred.discard(step)
      if late and _multihost.process_index() == 0:
        self._deletions.append(self._deleter.submit(self._delete_steps, [step]))
    self._last_step, self._last_time = step, self._clock()
    with self._lock:
      # A rollback: committed steps newer than this one exist. A save of the
      # abandoned run still in flight belongs to it too.
      newer = {s for s in self._steps if s > step}
      inflight = self._inflight
      if newer and inflight is not None and inflight.step > step and inflight.thread.is_alive():
        newer.add(inflight.step)
      if newer:
        self._rollback_to, self._abandoned = step, newer
    if newer:
      # A new timeline, the same on every process (process 0 draws it).
      self._rollbacks += 1
      self._timeline = _multihost.broadcast(f"{self._key}/timeline/{self._rollbacks}",
                                            uuid.uuid4().hex,
                                            self.policy.coordination_timeout_seconds)
      log.info("rollback to step %d: new timeline %s (local-tier steps of the old one are"
               " not resumed)", step, self._timeline)
      log.info("restored step %d of %s, older than the latest (%d): saves of this run replace"
               " the newer steps, which are removed once this run commits a save", step,
               self._dir, max(newer))
    return out

  # -------------------------------------------------------------------- leftovers

  def _startup_cleanup(self) -> None:
    """Removes debris once every process of this job is here (none is writing)."""
    if _multihost.process_count() > 1:
      _multihost.all_gather(f"{self._key}/start", "ready")
    if self._leftovers:
      log.warning("%s holds %d uncommitted step(s), saves in progress (of another job) or"
                  " interrupted: %s. A save in progress becomes <step> when it commits; a training"
                  " job here removes the interrupted ones (at or below its latest step) itself.",
                  self._dir, len(self._leftovers), ", ".join(l.name for l in self._leftovers[:5]))
    if _multihost.process_index() == 0:
      self._remove_leftovers()

  def _remove_leftovers(self) -> None:
    """Removes leftovers of steps at or below the latest committed step.

    No job saves those any more: a save in flight is newer than the latest committed step,
    including another job's (an evaluator reading this directory must not remove what the trainer
    is writing). Steps whose save a manager of this process has started and not finished are never
    touched (a save below the latest step, after restoring an older one).
    """
    committed = self._committed()  # before listing: a step committing meanwhile is not debris
    latest = committed[-1] if committed else None
    _, leftovers = step_dir.list_steps(self._dir)
    writing = _being_written(str(self._dir))
    for l in leftovers:
      if l.step is None or l.step in writing:
        continue
      if latest is None or l.step > latest:
        continue
      log.info("removing leftover %s of an interrupted save or delete", l.name)
      step_dir.remove(self._dir, l.name)
    retention.sweep(self._dir, self._ckptr.differential.pins)  # retired bases nothing references
    _, self._leftovers = step_dir.list_steps(self._dir)


# Steps whose save has started and not yet ended, per directory, for every
# manager in this process: leftover sweeps never touch them.
_writing: dict[str, set[int]] = {}
_writing_lock = threading.Lock()


def _set_writing(directory: str, step: int, on: bool) -> None:
  with _writing_lock:
    steps = _writing.setdefault(directory, set())
    (steps.add if on else steps.discard)(step)


def _being_written(directory: str) -> set[int]:
  with _writing_lock:
    return set(_writing.get(directory, ()))


def _blocking_before(before: Mapping[str, float] | None) -> dict[str, float]:
  """``save(blocking_before=...)`` checked, with every key ("total" at least the parts)."""
  out = {"items": 0.0, "data": 0.0}
  for k, v in dict(before or {}).items():
    if k not in _BEFORE_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)) \
        or not math.isfinite(v) or v < 0:
      raise ValueError(f"blocking_before[{k!r}]={v!r}: keys must be {_BEFORE_KEYS} and values"
                       " seconds >= 0, e.g. {'items': 0.01, 'data': 0.2}")
    out[k] = float(v)
  out["total"] = max(out.get("total", 0.0), out["items"] + out["data"])
  return out


def _info_from_summary(step: int, summary: restoring.Summary) -> policy_lib.StepInfo:
  custom = summary.custom
  # "time" is the manager's clock (injectable); "created" the engine's wall time.
  return policy_lib.StepInfo(step=step, time=float(custom.get("time", summary.created)),
                             metrics=dict(custom.get("metrics", {})),
                             reason=str(custom.get("reason", "unknown")))


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
  out = {}
  for k, v in metrics.items():
    try:
      f = float(v)
    except (TypeError, ValueError):
      raise TypeError(f"metric {k!r} must be a scalar number, got {type(v).__name__}") from None
    out[str(k)] = f if math.isfinite(f) else str(f)
  return out


def _mesh_of(items: Mapping[str, Any]) -> dict[str, int] | None:
  for leaf in jax.tree.leaves(items):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      return {str(k): int(v) for k, v in sharding.mesh.shape.items()}
  return None


def _as_step(step: Any) -> int:
  """A step number: a non-negative int (numpy integers welcome)."""
  if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
    raise ValueError(f"step must be a non-negative int, got {step!r} ({type(step).__name__})")
  return int(step)


def _short(steps: list[int]) -> str:
  return str(steps) if len(steps) <= 10 else f"[{steps[0]}, ..., {steps[-1]}] ({len(steps)} steps)"
