"""A series of checkpoints, one per step, under one directory: save, restore, roll back.

:class:`CheckpointManager` is the stateful shell around the pure triggers and
keep rules of :mod:`orbax_flax.manager.policy`. What a policy describes is
built in one place (:mod:`orbax_flax.manager.components`): the
:class:`~orbax_flax.manager.schedule.Schedule` says whether a step is due, the
:class:`~orbax_flax.manager.registry.StepRegistry` knows the committed steps
(and, with its :class:`~orbax_flax.manager.registry.Rollback`, the run's
timeline) and carries out deletions, the :class:`~orbax_flax.Checkpointer`
writes.

Read top to bottom: :meth:`CheckpointManager.save` decides, claims the step and
hands the items to the checkpointer; the end of the save comes back through
one path, :meth:`CheckpointManager._completed` (the async save's done-callback,
on its thread): the commit is recorded, the :class:`SaveEvent` logged, and
what the keep rules drop handed to the registry. :class:`InFlight` holds the
one save in flight and the error it left; the end of the module is what a
save records with its step and reports once committed.

Layout: ``<directory>/<step>/`` is a checkpoint (see :func:`orbax_flax.save`).
A step exists if and only if it is committed, so listing the directory is
discovery; nothing else is read until step metadata is needed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import jax

from orbax_flax.core import _multihost
from orbax_flax.core import _progress
from orbax_flax.engine import checkpointer as checkpointer_lib
from orbax_flax.manager import components as components_lib
from orbax_flax.engine import describe as metadata_lib
from orbax_flax import errors
from orbax_flax.manager import policy as policy_lib
from orbax_flax.manager import registry as registry_lib
from orbax_flax.engine import restoring
from orbax_flax.engine import saving
from orbax_flax.formats import orbax_checkpoint
from orbax_flax.core import _location
from orbax_flax.core._location import Location
from orbax_flax.format import _manifest
from orbax_flax.manager.config import CheckpointPolicy
from orbax_flax.manager.schedule import Schedule
from orbax_flax.differential import retention as referenced

log = logging.getLogger("orbax_flax")

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
    policy: when to save, what to keep and how (default: save when asked, keep all).
    trigger: a save trigger composed by hand (``ofx.any_of(ofx.EveryNSteps(100), ...)``),
      replacing the policy's.
    keep: keep rules composed by hand (``[ofx.KeepLast(3), ...]``), replacing the policy's.
    clock: wall-time source, ``time.time`` by default; tests pass a fake.

  A directory has one writer: the first save takes its writer lease
  (:mod:`orbax_flax.manager.leases`), and a save while another live job or manager
  holds it raises :class:`~orbax_flax.errors.WriterConflictError` naming it. A
  manager that only restores and lists (an evaluator's) saves and deletes no
  step; at its start, on process 0 and when no writer holds the directory, it
  sweeps the leftovers of interrupted saves under a short writer lease. Over a
  directory that does not exist, or that this process may not write (a
  read-only mount, a viewer role on a bucket), it creates and writes nothing
  (the sweep is skipped, at INFO); a save there fails with
  :class:`~orbax_flax.errors.StorageError` naming the directory.
  """

  def __init__(self, directory: Any, policy: CheckpointPolicy | None = None, *,
               trigger: policy_lib.Trigger | None = None, keep: Any = None,
               clock: Callable[[], float] = time.time):
    self._dir = Location.parse(directory)
    self.policy = policy if policy is not None else CheckpointPolicy()
    if not isinstance(self.policy, CheckpointPolicy):
      raise TypeError(f"policy must be a CheckpointPolicy (use CheckpointPolicy.from_config("
                      f"config.checkpoint)); got {type(self.policy).__name__}")
    self._clock = clock  # the schedule's too
    # First the job's key for this manager (a count per directory, the same on every process
    # that gets here: what follows may fail on one process alone, and every process then
    # raises with it, its count kept in step with the others').
    self.components = components_lib.build(self.policy, self._dir, clock=clock, trigger=trigger,
                                           keep=keep)
    self._key, self._schedule = self.components.key, self.components.schedule
    self._prepared = False  # staging memory prepared (or a save made): see prepare()
    self._inflight = InFlight()  # the save in flight, and the error it left
    self._completing = threading.Lock()  # held by _completed: one completion at a time
    # Held by save(), close() and a restore's rollback bookkeeping: one caller at a time.
    # Reentrant for a signal handler that runs as save() ends, its work done (see _turn).
    self._one_save = threading.RLock()
    self._saving_thread: int | None = None  # the thread inside save() (see _turn)
    self._close_requested = False  # close() from inside save() on its thread: at its end
    self._events = EventLog()
    self._metric_names: frozenset | None = None  # the metric names last checked for best_metric
    self._closed = False
    # A save failed because the store stopped answering (_location.unanswered), and none has
    # committed since: close() cleans up with one attempt per request.
    self._store_silent = False
    self._commits = 0       # commits recorded: each one's keep decision has its own key
    self._writer_tries = 0  # attempts to become the directory's writer (their keys)
    self._ckptr = self.registry = None  # (made by _open)
    try:
      self._together("open", self._open)  # after it, every process of the job is here: none writes
      self._together("sweep", self.registry.start)
    except BaseException:
      if self.registry is not None:
        self._release()
      elif self._ckptr is not None:
        self._ckptr.close()
      raise

  def _open(self) -> None:
    """The constructor's reads of the directory (its listing, its rollback records) and the
    objects they fill."""
    if _location.read_key(self._dir, _manifest.MANIFEST_KEY, max_bytes=1) is not None:
      parent = self._dir.sibling("")
      raise errors.CheckpointExistsError(
          f"{self._dir} is one checkpoint (it holds {_manifest.MANIFEST_KEY}), not a directory"
          " of steps: a manager there would save its steps inside it, and the run that owns it"
          f" would delete them with it. Nothing was written. Pass the directory of steps that"
          f" holds it ({str(parent).rstrip('/')}), or restore this one with"
          f" ofx.restore({str(self._dir)!r}).")
    self._ckptr = checkpointer_lib.Checkpointer(**self.components.checkpointer)
    self.registry = registry_lib.StepRegistry(self._dir, deletes=_multihost.process_index() == 0,
                                              retention=self._retention())
    self._rollback = registry_lib.Rollback(self._dir, self.registry, self._key,
                                           self.policy.coordination_timeout_seconds)

  def _together(self, what: str, fn: Callable[[], Any]) -> None:
    """``fn()``, failing on every process of the job if it fails on one
    (:func:`~orbax_flax.core._multihost.together`); after it every process got here."""
    _multihost.together(f"{self._key}/{what}", fn, self.policy.coordination_timeout_seconds,
                        what=f"opening the CheckpointManager of {self._dir}")

  def _retention(self) -> Any:
    """How the registry removes steps: with differential saves a referenced step is retired,
    never deleted; else the plain delete, until this manager becomes the writer of a
    directory that holds differential data already (:meth:`_become_writer`)."""
    if self._ckptr.differential is not None:
      return referenced.Referenced(self._ckptr.differential, key=f"{self._key}/room",
                                   timeout_s=self.policy.coordination_timeout_seconds)
    return registry_lib.Retention()

  @property
  def directory(self) -> str:
    return str(self._dir)

  @property
  def coordination_key(self) -> str:
    """A key prefix in the coordination service unique to this manager, same on every process."""
    return self._key

  @property
  def timeline(self) -> str:
    """The id of the run's timeline, recorded with every save (see :class:`~orbax_flax.manager.registry.Rollback`)."""
    return self._rollback.timeline(self.latest_step)

  def recorded_timeline(self) -> str:
    """:attr:`timeline`, recorded in the directory while it has no committed step, so that a
    run restarted before its first commit finds it and one in an emptied directory does not:
    what the local tier ties its steps to. Every process calls it at the same point."""
    return self._rollback.timeline(self.latest_step, recorded=True)

  def step_path(self, step: int) -> str:
    """Where ``step`` is (or would be) stored."""
    return str(self._dir.join(str(policy_lib.as_step(step))))

  def reload(self) -> None:
    """Re-lists the directory (other jobs may have changed it)."""
    self.registry.reload()

  def all_steps(self) -> list[int]:
    """Committed steps, ascending. Reads no checkpoint data."""
    self._inflight.raise_error()
    return self.registry.committed()

  def has_step(self, step: int) -> bool:
    """True if ``step`` is committed or its save is in flight (so saving it again is moot);
    False for None (``has_step(mngr.latest_step())`` in an empty directory)."""
    if step is None:
      return False
    step = policy_lib.as_step(step)
    committed, abandoned = self._rollback.knows(step)
    return self._inflight.saving(step) or (committed and not abandoned)

  def latest_step(self) -> int | None:
    """The newest committed step, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def leftovers(self) -> list[Any]:
    """Debris of interrupted saves still on storage (``step_dir.Leftover``)."""
    return self.registry.leftovers()

  def step_info(self, step: int) -> policy_lib.StepInfo:
    """Time, metrics and reason recorded with ``step`` (reads a few KB once)."""
    return self.registry.info(policy_lib.as_step(step))

  def best_step(self) -> int | None:
    """The committed step with the best ``policy.best_metric``; None if none has it."""
    if not self.policy.best_metric:
      raise ValueError("best_step() needs a metric: set best_metric in the checkpoint policy"
                       " (e.g. CheckpointPolicy(best_metric='loss', best_mode='min')).")
    return policy_lib.best_step(self.registry.infos(), self.policy.best_metric,
                                self.policy.best_mode)

  def metadata(self, step: int | None = None) -> metadata_lib.CheckpointMetadata:
    """The engine metadata of ``step`` (default: latest)."""
    step = None if step is None else policy_lib.as_step(step)
    return metadata_lib.metadata(self._dir.join(str(self._resolve(step))))

  # -------------------------------------------------------------------- saving

  def check_metrics(self, metrics: Mapping[str, Any]) -> None:
    """Checks one step's metrics as :meth:`save` does, whether or not the step is saved.

    Each is a scalar number; the policy's ``best_metric`` among them, or a
    ValueError where a reported name is close to it (a typo: "did you mean"),
    or one WARNING for this manager where none is (eval metrics reported only
    on eval steps are legitimate). The training callback calls it at every
    step that reports metrics (:func:`~orbax_flax.manager.policy.check_step_metrics`).

    Raises:
      TypeError: a metric that is not a scalar number.
      ValueError: ``best_metric`` is not reported and a reported name is close to it.
    """
    self._metric_names, warning = policy_lib.check_step_metrics(
        metrics, self.policy.best_metric, self._metric_names)
    if warning:
      log.warning("%s", warning)

  def should_save(self, step: int) -> str | None:
    """The reason the policy saves ``step``, or None. Call it on every process: a time-based
    decision is process 0's, shared (see :class:`~orbax_flax.manager.schedule.Schedule`).

    None also for a step committed here or being saved, which :meth:`save` would decline
    (unless forced): a loop that restarts at the restored step is not told it saved it again.
    A step of a run a rollback abandoned is saved over (its reason is given)."""
    reason = self._schedule.due(step)  # first, on every process (a time-based one is shared)
    if reason is None:
      return None
    committed, abandoned = self._rollback.knows(step)
    if abandoned or not (committed or self._inflight.saving(step)):
      return reason
    log.warning("step %d is %s in %s: the policy's save of it (%s) is declined (force=True"
                " replaces it)", step, "already saved" if committed else "being saved",
                self._dir, reason)
    return None

  def save(self, step: int, items: Mapping[str, Any], *, force: bool = False,
           custom_metadata: Mapping[str, Any] | None = None, dtype: Any = None,
           metrics: Mapping[str, Any] | None = None, reason: str | None = None,
           blocking_before: Mapping[str, float] | None = None,
           local_copy: str | None = None) -> bool:
    """Saves ``step`` if the policy says so (or ``force``); returns whether it started.

    With ``async_save`` the call returns once the state is on the host; the
    commit, and deletion of steps the policy no longer keeps, continue in the
    background. Errors of a background save are raised by the next call. With the policy's
    ``on_save_error="warn"`` a :class:`~orbax_flax.errors.StorageError` (a full disk, a store
    that does not answer) is logged with its step instead, when the save fails (in the
    background, or here: this call then returns False), and nothing raises it: the steps
    saved before are intact, and the next save tries again.

    Args:
      step: the training step (a non-negative int).
      items: item name -> pytree, as for :func:`orbax_flax.save`.
      force: save even if the policy would not.
      custom_metadata: JSON-serialisable data recorded with the step.
      dtype: convert arrays before writing, as for :func:`orbax_flax.save`.
      metrics: scalar metrics to record (jax scalars are fetched only when a save happens),
        checked at every call as the training callback checks them
        (:func:`~orbax_flax.manager.policy.check_step_metrics`): without the policy's
        ``best_metric`` while a reported name is close to it, the call raises; with nothing
        close, a WARNING says so once.
      reason: the reason to record ("final", "preemption", ...); implies force, except that
        "final" leaves a committed step of that number as it is (returns False).
      blocking_before: seconds the caller's thread already spent on this save, counted in
        the reported blocking time (:class:`SaveEvent`): ``"items"`` (building them),
        ``"data"`` (the data iterator's state), ``"total"`` (default: their sum).
      local_copy: the save id of the local tier's copy of these very items
        (:meth:`orbax_flax.tiers.local.LocalTier.save`'s), recorded with the step: a
        resume takes that local copy of the step only while this save is the step here.

    Raises:
      RuntimeError: the manager is closed (nothing is written).
      StorageError: this save, or an earlier one in the background, failed (unless
        ``on_save_error="warn"``).
      TypeError: a metric is not a scalar number.
      ValueError: ``metrics`` lack the policy's ``best_metric`` and name one close to it (a
        typo: "did you mean"); nothing is written.
      ValueError: ``step`` is a new step below the newest step here while this manager has
        not restored an older one (no rollback); nothing is written.
    """
    # One save at a time, also when threads share the manager: its staging memory, the save
    # in flight and the step bookkeeping are one save's until it returns. close() waits too.
    with self._turn("save()"):
      self._saving_thread = threading.get_ident()
      try:
        self._check_open()
        started = self._save(step, items, force=force, custom_metadata=custom_metadata,
                             dtype=dtype, metrics=metrics, reason=reason,
                             blocking_before=blocking_before, local_copy=local_copy)
      except BaseException as e:
        self._saving_thread = None
        if isinstance(e, errors.StorageError):
          self._store_silent = _location.unanswered(e)
        self._close_if_asked(raising=e)
        if not isinstance(e, errors.StorageError) or self.policy.on_save_error != "warn":
          raise
        self._save_failed(e, step)
        return False
      self._saving_thread = None
      self._close_if_asked()
      return started

  def _close_if_asked(self, raising: BaseException | None = None) -> None:
    """Closes the manager if a signal handler asked to inside the save() now ending (see
    :meth:`close`); with ``raising`` (that save's error), a failing close is logged, not
    raised over it."""
    if not self._close_requested:
      return
    self._close_requested = False
    if raising is None:
      self._close_now()
      return
    try:
      self._close_now()
    except BaseException:  # pylint: disable=broad-except  # the save's error is the one raised
      log.exception("closing %s after save() raised %s", self._dir, type(raising).__name__)

  @contextlib.contextmanager
  def _turn(self, what: str) -> Iterator[None]:
    """This thread's turn at the manager (``_one_save``), after another thread's save().

    A signal handler runs on the thread it interrupts: one that calls ``what`` while this
    thread is inside save() would wait for the lock this thread holds, for ever. It is
    refused instead, naming what to do (close() is not: see :meth:`close`)."""
    if self._saving_thread == threading.get_ident():
      raise RuntimeError(
          f"CheckpointManager.{what} called while this thread is inside save() (from a signal"
          " handler?): it would wait for that save() for ever. Set a flag in the handler and"
          f" call {what} after the step; for preemption, CheckpointCallback saves the next step"
          " on every process (save_on_preemption).")
    with self._one_save:
      yield

  def _save_failed(self, error: errors.StorageError, step: int | None) -> None:
    """With ``on_save_error="warn"``: a failed save (or a deletion it made due) is logged
    and the run goes on; earlier steps are intact and the next save tries again."""
    committed = self.registry.committed()
    notes = " ".join(getattr(error, "__notes__", ()))
    log.error("CHECKPOINT SAVE FAILED, training goes on (on_save_error='warn'): %s; the steps"
              " saved before are intact (the latest committed is %s) and the next save tries"
              " again. %s: %s%s", "a deletion" if step is None else f"the save of step {step}",
              committed[-1] if committed else None, type(error).__name__, error,
              f" {notes}" if notes else "")

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError(f"this CheckpointManager of {self._dir} is closed; create a new one")

  def _save(self, step: int, items: Mapping[str, Any], *, force: bool,
            custom_metadata: Mapping[str, Any] | None, dtype: Any,
            metrics: Mapping[str, Any] | None, reason: str | None,
            blocking_before: Mapping[str, float] | None, local_copy: str | None) -> bool:
    entered = time.perf_counter()
    self._inflight.raise_error()
    self._join_abandoned()
    before = checked_before(blocking_before)
    step = policy_lib.as_step(step)
    if metrics is not None:  # a mistyped best_metric raises here, before anything is written
      self.check_metrics(metrics)
    if reason is not None and reason not in policy_lib.REASONS:
      raise ValueError(f"reason must be one of {policy_lib.REASONS}, got {reason!r}")
    # (the schedule alone: a committed step is declined below, saying why)
    decided = reason or ("forced" if force else None) or self._schedule.due(step)
    if decided is None:
      if not self._prepared:  # the first call that does not save: the memory of the first that will
        self.prepare(items)
      return False
    self._prepared = True
    if self._rollback.active():
      # What the save refuses is refused before the rollback's bookkeeping: a refused save
      # is not the new run's first (it neither calls the rollback off nor records its run).
      self._ckptr.check(items, custom_metadata, dtype)
    self._refuse_below_newest(step)  # before anything is written, like a second writer
    if self._become_writer():  # before anything is written: a second writer is refused here
      # Again against the listing the writer took under its lease: another job may have
      # saved newer steps since this manager listed the directory (a writer already holds
      # the directory: its listing is its own).
      self._refuse_below_newest(step)
    if self._inflight.saving(step):
      if not self._rollback.abandons(step) and decided != "forced":
        log.warning("step %d is being saved already in %s; not saving it again", step, self._dir)
        return False
      # The abandoned run's save of this step, or one that force=True replaces (with what
      # it is given now, as it replaces a committed step): replaced once it ends.
      self._inflight.finish()
    overwrite = self._rollback.replaces(step, forced=decided in policy_lib.FORCED
                                        and reason != "final")
    if overwrite is None or self._schedule.skips(step, decided, self.inflight_step() is not None):
      return False
    self._refuse_linked(step)  # before the rollback's bookkeeping, as every refusal
    self.registry.delete_before_saving()  # the room a full disk kept from the last deletion
    self._rollback.call_off_above(step)  # a restore to look at an older step, then training on
    self._inflight.finish()
    wait_s = time.perf_counter() - entered
    ready_s = wait_ready(items, metrics)  # the train step's computation, not ours
    now = self._clock()
    run = self._rollback.run()  # a save after a rollback: its commit ends the old run
    custom = step_metadata(step, decided, now, metrics, items, custom_metadata, self.timeline)
    if run is not None:
      self._rollback.record(step, run)
    if local_copy:
      custom["local_copy"] = str(local_copy)
    start, handle = time.perf_counter(), None
    path = self._dir.join(str(step))
    where = str(path)  # (its commit's log line)
    options = dict(custom_metadata=custom, overwrite=overwrite, dtype=dtype)
    with self.registry.saving(step):  # a write in progress until _completed ends it
      with self.registry.lock:  # one order with deletions: claim the step, then make room
        overwrite = self.registry.claim(step) or overwrite  # a pending deletion is called off
        options["overwrite"] = self.registry.retention.before_save(
            self._dir, step, self.registry.committed(), overwrite)
      try:
        if self.policy.async_save:
          cancellable = decided == "exception" or (  # a second Ctrl-C, a grace period ran out
              decided == "preemption" and self.policy.preemption_grace_seconds > 0)
          handle = self._ckptr.save_async(path, items, cancellable=cancellable, **options)
        else:
          self._ckptr.save(path, items, **options)
      except BaseException:  # refused or failed: nothing of it committed
        self.registry.retention.after_save(self._dir, step, committed=False)
        raise
    returned = time.perf_counter()
    blocked = blocking_event(step, decided, before, entered, wait_s, ready_s,
                             handle.blocking_s if handle is not None else returned - start)
    save = _Save(policy_lib.StepInfo(step, now, custom["metrics"], decided), handle,
                 entered - before["total"], run, blocked, where)
    self._schedule.saved(step, now)
    self._inflight.start(save)
    if handle is None:  # a blocking save: committed already
      self._completed(save)
      self._inflight.raise_error()
    else:
      handle.add_done_callback(functools.partial(self._completed, save))
    return True

  def _refuse_linked(self, step: int) -> None:
    """Raises if ``<directory>/<step>`` is a link: a save there would write into what it points
    to (another run's checkpoint, linked in), where retention and rollback only ever move or
    remove the link itself. Every process sees the same link, so every process raises."""
    if not self._dir.is_local:
      return
    path = self._dir.join(str(step)).local_path
    if os.path.islink(path):
      raise ValueError(
          f"step {step} of {self._dir} is a link to {os.readlink(path)!r}: a save of step {step}"
          " would write into what it points to (another run's checkpoint, perhaps). Nothing was"
          f" written. Remove the link (os.remove({path!r}); what it points to stays) and save"
          " again, or save another step number.")

  def _refuse_below_newest(self, step: int) -> None:
    """Raises unless a save of ``step`` keeps the directory's order: a new step number below
    the newest step (committed, or being saved) is a rollback's save only after a restore of
    an older step (:class:`~orbax_flax.manager.registry.Rollback`). A forced re-save of a
    committed step replaces it where it is."""
    if self._rollback.active() or step in self.registry:
      return
    newer = {s for s in (*self.registry.committed(), self._inflight.started_step())
             if s is not None and s > step}
    if not newer:
      return
    newest = max(newer)
    raise ValueError(
        f"step {step} is below the newest step {newest} of {self._dir}, and this manager has"
        f" not restored an older step (no rollback): its keep rules would rank step {step} as"
        f" older than {newest} (max_to_keep deletes it first) and a resume would restore"
        f" {newest}, not it. Nothing was written. To go back to an earlier step, restore it"
        " first (manager.restore(step), which starts a new run from it) and save from there;"
        " to start a new run from scratch, give it a new directory; or delete the newer"
        f" step(s) {registry_lib.short(sorted(newer))} first.")

  def _completed(self, save: _Save, handle: saving.AsyncSave | None = None) -> None:
    """The one path by which the end of a save comes back to the manager, once per save.

    Where it runs: for an async save on the save's own thread, as the done-callback
    :meth:`save` gave its handle (before the handle's ``wait()`` and ``join()`` return), or
    on the caller's thread inside :meth:`save` if the save had ended already; for a
    blocking save in :meth:`save`. What it changes is each guarded by its owner's lock,
    never by the thread: the commit goes to the rollback and the registry (under the
    rollback's lock), the event to the :class:`EventLog` and the
    save's cost to the :class:`~orbax_flax.manager.schedule.Schedule` (each under its own
    lock), then the keep rules' decision (process 0's, shared) to the registry (under its
    lock). Completions run one at a time (``self._completing``). An error is kept by
    :class:`InFlight` and raised by the manager's next call.
    """
    step = save.info.step
    committed = False
    try:
      with self._completing:
        if handle is not None:
          try:
            handle.wait()  # in the save's own thread: returns, or raises its error, at once
          except BaseException:
            self.registry.retention.after_save(self._dir, step, committed=False)
            raise
        committed = True
        self.registry.retention.after_save(self._dir, step, committed=True)
        self._store_silent = False
        gone = self._rollback.committed(save.info, save.run)
        self._events.committed(save.blocked, time.perf_counter() - save.start,
                               handle.nbytes if handle is not None else 0,
                               save.where, self._schedule, self._stored(step, handle))
        doomed = self._agree_on_retention()
        self.registry.doom(doomed)
        self.registry.delete(set(doomed) | gone)
    except BaseException as e:  # pylint: disable=broad-except  # raised by the next call
      if committed:  # what failed is the bookkeeping after it (a deletion, an event)
        e.add_note(f"(step {step} is committed: this error is of what follows its commit)")
      cancelled = save.handle is not None and save.handle.cancelled.is_set()
      if isinstance(e, errors.StorageError) and self.policy.on_save_error == "warn" \
          and not cancelled:
        self._store_silent = _location.unanswered(e)
        self._save_failed(e, step)  # logged now, on the save's thread; nothing to raise
      else:
        self._inflight.failed(save, e)
    finally:
      self.registry.writes.end(step)

  def _stored(self, step: int, handle: saving.AsyncSave | None) -> dict[str, int] | None:
    """The bytes written and reused by ``step``'s save: known to a plain async save's handle,
    else read back from its manifest; None (logged) if that read fails: the step committed
    all the same."""
    if handle is not None and handle.stored_bytes is not None:
      return handle.stored_bytes
    try:
      summary = restoring.read_summary(self._dir.join(str(step)))
      stored = summary.stored_bytes or {"own": sum(summary.item_bytes.values())}
      return {"bytes_written": stored["own"], "bytes_reused": stored.get("borrowed", 0)}
    except (errors.CheckpointError, OSError) as e:
      log.warning("step %d committed; reading back its stored bytes failed (%s), so its event"
                  " reports none", step, e)
      return None

  def _agree_on_retention(self) -> list[int]:
    """What the keep rules drop after a commit: process 0 decides, every process applies the
    same decision (rules may read what differs between processes: metrics, clocks)."""
    n, self._commits = self._commits, self._commits + 1
    rules = self.components.keep
    decide = lambda: json.dumps([] if self._rollback.active() else  # noqa: E731
                                self.registry.retain(rules))
    if not rules:
      return []
    return json.loads(_multihost.decide_per_step(
        f"{self._key}/retain", n, decide, timeout_s=self.policy.coordination_timeout_seconds))

  def _become_writer(self) -> bool:
    """Makes this job the directory's one writer (process 0 takes the lease; every process
    learns the outcome), or raises :class:`~orbax_flax.errors.WriterConflictError`. Returns
    whether it became the writer now (False: it was already)."""
    if self.registry.is_writer:
      self.registry.become_writer()  # raises if the lease was lost meanwhile
      return False
    problem, failed = "", None
    if _multihost.process_index() == 0:
      try:
        problem = _foreign_steps(self._dir)
        # Only the writer adds steps: what is here once it holds the lease is all a plain
        # manager's deletions must respect. Another job (or a run with differential saves on)
        # may have left steps that reference each other's bytes; then a referenced step is
        # retired, never deleted (every process uses the retention process 0 chose: each
        # takes part in making room). Chosen before the first deletion: the steps a killed
        # job's rollback abandoned (which a kept step may borrow from) are deleted only now,
        # through it.
        if not problem and self.registry.become_writer(
            check_references=self._ckptr.differential is None):
          problem = _REFERENCED
      except errors.WriterConflictError as e:
        problem = str(e)
      except Exception as e:  # pylint: disable=broad-except  # storage failed: told, then raised
        # Every process hears of it and raises too: one that went on alone would pair this
        # save's collectives with process 0's next save, and every later save would fail.
        failed, problem = e, f"{_FAILED}{type(e).__name__}: {e}"
    if _multihost.process_count() > 1:
      self._writer_tries += 1
      problem = _multihost.broadcast(f"{self._key}/writer/{self._writer_tries}", problem,
                                     self.policy.coordination_timeout_seconds)
      if problem in ("", _REFERENCED) and _multihost.process_index() != 0:
        self.registry.become_writer()  # (no lease of its own: process 0 holds the job's)
    if failed is not None:
      raise failed
    if problem.startswith(_FOREIGN):
      raise errors.CheckpointExistsError(problem[len(_FOREIGN):])
    if problem.startswith(_FAILED):
      raise errors.StorageError(
          f"the save did not start: process 0 could not take the writer lease of {self._dir}"
          f" ({problem[len(_FAILED):]}); nothing was written, on any process. The next save"
          " tries again.")
    if problem and problem != _REFERENCED:
      raise errors.WriterConflictError(problem)
    if problem == _REFERENCED:
      self.registry.use_retention(referenced.Referenced(
          None, lock=self.registry.lock, key=f"{self._key}/room",
          timeout_s=self.policy.coordination_timeout_seconds))
    self.registry.delete_abandoned()
    return True

  def prepare(self, items: Mapping[str, Any]) -> int:
    """Prepares in the background the staging memory of the first async save of ``items`` (see
    :meth:`Checkpointer.prepare`); returns its bytes. :meth:`save` does it by itself."""
    self._prepared = True
    return self._ckptr.prepare(items) if self.policy.async_save else 0

  @property
  def staging_bytes(self) -> int:
    """Host memory held now for the snapshots of async saves (prepared or kept)."""
    return self._ckptr.staging_bytes

  def host_snapshot(self, items: Mapping[str, Any]) -> Mapping[str, Any]:
    """``items`` on the host as an async save would copy them, to share (two tiers, one step)."""
    return self._ckptr.host_snapshot(items)

  def save_cost(self) -> float | None:
    """The median cost of recent saves (``save_interval="auto"``'s): blocking less ``blocking_ready_s``."""
    return self._schedule.cost()

  def pop_events(self) -> list[SaveEvent]:
    """Saves committed since the last call (for metric writers)."""
    return self._events.pop()

  def inflight_step(self) -> int | None:
    """The step whose save is still being written, if any."""
    return self._inflight.step()

  def wait_for_save(self, timeout: float | None = None) -> bool:
    """Waits up to ``timeout`` s for the save in flight; True if none is left. Never raises."""
    return self._inflight.join(timeout)

  def take_error(self) -> BaseException | None:
    """The error of an earlier (background) save that no call has raised yet, now cleared;
    None if there is none. For a caller that must go on regardless (a preemption save) and
    reports the error itself; every other call raises it."""
    return self._inflight.take_error()

  def abandon_inflight(self, wait_s: float = 0.0) -> None:
    """Cancels the save in flight (it never commits); waits ``wait_s`` s for it. See InFlight."""
    self._inflight.abandon(wait_s, started=self._ckptr.inflight)

  def _join_abandoned(self) -> None:
    """Waits for an abandoned save still stopping (``wait()`` does not: it never holds a
    process's exit): until it ends, a step it was to replace may be moved aside, and the
    next save would wait for it anyway."""
    prev = self._ckptr.inflight
    if prev is not None and prev.cancelled.is_set():
      prev.join()

  def wait(self) -> None:
    """Blocks until the save in flight and pending deletions are done; raises their errors
    (a :class:`~orbax_flax.errors.StorageError` only logged, with ``on_save_error="warn"``)."""
    try:
      self._inflight.finish()
      self.registry.wait()
    except errors.StorageError as e:
      self._store_silent = _location.unanswered(e)
      if self.policy.on_save_error != "warn":
        raise
      self._save_failed(e, None)

  def close(self) -> None:
    """Waits for everything in flight, then releases the manager's threads and its writer
    lease. A save another thread is starting is waited for first.

    Interrupted (Ctrl-C) while a save writes, it abandons that save (it never commits, as
    :meth:`abandon_inflight`), waits up to ``ABANDON_WAIT_S`` seconds for its writing to stop,
    and raises the interrupt; the lease and the threads are released once the save has ended,
    never before (a second Ctrl-C stops the wait, not that order).

    After a save that failed because the store stopped answering (its retries ran out, and
    no save committed since), the cleanup makes one attempt per request: what it cannot
    remove is left to the next writer (docs/guarantees.md, section 5, gives the bound).

    Called from a signal handler while the thread it interrupted is inside :meth:`save`
    (the handler of a loop without the training callback), it returns at once, and the
    manager closes as that save() call ends, returning or raising (the handler's
    ``SystemExit``, say): waiting here for that save() would wait for ever.
    """
    if self._saving_thread == threading.get_ident():
      log.warning("close() called inside save() on the same thread (a signal handler?): the"
                  " manager closes as that save() call ends")
      self._close_requested = True
      return
    with self._one_save:
      self._close_now()

  def _close_now(self) -> None:
    """:meth:`close`, on this thread's turn."""
    if self._closed:
      return
    try:
      self.wait()
    except BaseException as e:
      self._closed = True
      running = self._ckptr.inflight  # (also one whose save() call was interrupted)
      if isinstance(e, Exception) or running is None or running.done():
        self._release()
      else:
        # Interrupted (Ctrl-C) while a save writes: it is abandoned (it never commits), and
        # the lease and the threads are released once it has ended, never before: a manager
        # opened next (a notebook cell run again) would sweep the data it still writes.
        self._inflight.abandon(started=running)
        running.add_done_callback(lambda _: self._release())
        running.join(ABANDON_WAIT_S)  # its writing stops (a second Ctrl-C: it goes on alone)
      raise
    self._closed = True
    self._release()

  def _release(self) -> None:
    """The end of :meth:`close`: the registry's threads and writer lease, the checkpointer's."""
    try:
      self.registry.close(retries=not self._store_silent)
    finally:
      self._ckptr.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except
      if exc is None:
        raise
      log.exception("while closing the checkpoint manager after an error")

  # -------------------------------------------------------------------- restoring

  def _resolve(self, step: int | None) -> int:
    """``step`` (default: the latest), listed here: a step another job committed since the
    last listing (an evaluator's manager, built before the trainer's saves) is found by
    listing the directory again, once."""
    known = self.latest_step() if step is None else step if step in self.registry else None
    if known is None:
      self.registry.reload()
      known = self.latest_step() if step is None else step
    if known is None:
      raise errors.CheckpointNotFoundError(f"no committed checkpoint in {self._dir}")
    return known

  def restore(self, step: int | None = None, target: Mapping[str, Any] | None = None, *,
              partial: bool = False, allow_lossy_casts: bool = False, transforms: Any = None,
              read_once: bool | None = None, max_host_bytes: int | None = None,
              progress: Any = None, casts: list | None = None) -> dict[str, Any]:
    """Restores ``step`` (default: the latest committed), resharded onto ``target``.

    With ``step=None`` a save in flight is waited for first, so that the
    latest step includes it. A given ``step`` is read as it is committed now,
    without waiting for a save of another step, and no keep rule deletes it
    while it is read (so ``restore(latest_step())`` always works).
    Restoring an older step is a rollback (:class:`~orbax_flax.manager.registry.Rollback`).
    Arguments as for :func:`orbax_flax.restore`, and ``None`` is the setting of
    what is called: ``max_host_bytes=None``: the budget of what is called, the
    manager's checkpointer's, which is the policy's ``max_host_bytes`` (0: no
    budget); ``read_once=None``: the policy's ``read_once_restore``.

    Raises:
      CheckpointNotFoundError: there is no such step (or no step at all), also once the
        directory is listed again (a step committed since the last listing, by another
        job, is found); or a step listed here was deleted since by the job that writes
        there (the message says so, with the steps committed now).
    """
    self._inflight.raise_error()
    self._join_abandoned()
    if step is None or self._inflight.saving(step):
      self._inflight.finish()
    step = self._resolve(step if step is None else policy_lib.as_step(step))
    options = dict(partial=partial, allow_lossy_casts=allow_lossy_casts, transforms=transforms,
                   max_host_bytes=max_host_bytes, progress=progress, casts=casts,
                   read_once=self.policy.read_once_restore if read_once is None else read_once)
    with self.registry.reading(step):  # raises if the step is not listed here
      try:
        out = self._ckptr.restore(self._dir.join(str(step)), target, **options)
      except errors.CheckpointNotFoundError as e:
        gone = e
      else:
        gone = None
    if gone is not None:
      self.registry.reload()
      if step in self.registry:
        raise gone
      raise errors.CheckpointNotFoundError(
          f"step {step} of {self._dir} was listed by this manager but has since been deleted,"
          " by the keep rules of the job that writes there (a manager that does not write"
          " reads the directory as of its last listing); committed now:"
          f" {registry_lib.short(self.all_steps())}. Restore a step still committed"
          " (latest_step() lists again), or evaluate beside training with"
          " ofx.checkpoints_iterator, whose reader lease keeps each yielded step until it is"
          " read.") from gone
    # Between two saves, never inside one: a save decides in steps (a rollback called off,
    # then, after waiting for the save before it, the run it belongs to), and a restore from
    # another thread (an evaluation loop) in between started a rollback that save then ran,
    # deleting every newer step at its commit.
    with self._turn("restore()"):
      self._schedule.saved(step)
      # The save started last counts as newer even if its commit is not recorded yet.
      self._rollback.restored(step, self._inflight.started_step())
    return out


@dataclasses.dataclass(frozen=True)
class _Save:
  """A save the manager started, and what its commit records (see ``_completed``)."""
  info: policy_lib.StepInfo
  handle: saving.AsyncSave | None  # None: a blocking save, committed when save() returns
  start: float                     # perf_counter() when the caller's wait for it began
  run: int | None                  # the rollback it started after (Rollback.run): its
                                   # commit ends that rollback's old run
  blocked: SaveEvent               # its blocking times
  where: str                       # the step's path (its commit's log line)

  @property
  def step(self) -> int:
    return self.info.step


class InFlight:
  """The async save in flight (at most one) and the error a finished one left."""

  def __init__(self):
    self._current: _Save | None = None
    self._error: BaseException | None = None

  def start(self, save: _Save) -> None:
    """``save`` started (a blocking one has ended already: none is in flight)."""
    self._current = save if save.handle is not None else None

  def failed(self, save: _Save, error: BaseException) -> None:
    """``save`` (or the record of its commit) failed: raised by the next call, or logged if
    the save was abandoned (cancelled on purpose)."""
    if save.handle is not None and save.handle.cancelled.is_set():
      log.warning("abandoned save of step %d ended without committing: %s", save.step, error)
    else:
      self._error = error

  def step(self) -> int | None:
    """The step whose save is still being written, if any."""
    current = self._current
    return current.step if current is not None and not current.handle.done() else None

  def started_step(self) -> int | None:
    """The step of the save started last and not abandoned, whether or not it has ended."""
    current = self._current
    return current.step if current is not None and not current.handle.cancelled.is_set() else None

  def saving(self, step: int) -> bool:
    """Whether a save of ``step`` was started and not abandoned (it may have ended)."""
    current = self._current
    return current is not None and current.step == step and not current.handle.cancelled.is_set()

  def join(self, timeout: float | None = None) -> bool:
    """Waits up to ``timeout`` s for the save; True if none is left running. Raises nothing."""
    current = self._current
    return current is None or current.handle.join(timeout)

  def abandon(self, wait_s: float = 0.0, started: saving.AsyncSave | None = None) -> None:
    """Cancels the save so that it never commits; waits up to ``wait_s`` s for it to stop.

    Args:
      wait_s: how long to wait for its writing to stop (a cancellable save stops within
        about a second): a process that exits while tensorstore writes may abort.
      started: the checkpointer's save in flight, cancelled too: a save whose caller was
        interrupted (Ctrl-C) before it reached :meth:`start`.
    """
    current = self._current.handle if self._current is not None else None
    for handle in {current, started} - {None}:  # the same save once
      if not handle.done():
        handle.cancel()
        handle.join(wait_s)

  def finish(self) -> None:
    """Waits for the save (not an abandoned one), then raises the error left, if any."""
    current = self._current
    if current is not None and not current.handle.cancelled.is_set():
      current.handle.join()
    self._current = None  # only once it has ended: a Ctrl-C in the join can still abandon it
    self.raise_error()

  def raise_error(self) -> None:
    """Raises (once) the error of a save or commit record that nobody has seen."""
    error = self.take_error()
    if error is not None:
      raise error

  def take_error(self) -> BaseException | None:
    """The error of a save or commit record that nobody has seen (cleared), or None."""
    e, self._error = self._error, None
    return e


# ----------------------------------------------------------------------------
# What a save records with its step and reports once committed.


BEFORE_KEYS = ("total", "items", "data")
# How long an interrupted close() (or the callback's second Ctrl-C) waits for the abandoned
# save's writing to stop: about a second when it is cancellable, what it was handed otherwise.
ABANDON_WAIT_S = 10.0


@dataclasses.dataclass(frozen=True)
class SaveEvent:
  """A committed save, for logs and metric writers.

  ``blocking_s`` is the whole time the caller's thread waited for the save
  (with the training callback: inside ``on_step_end``, from its start); the
  ``blocking_*_s`` fields are its main parts.
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
  blocking_ready_s: float = 0.0  # the train step still computing what is saved (its metrics too)
  blocking_copy_s: float = 0.0   # the engine's blocking phase: plan and snapshot (a blocking save: all)
  bytes_written: int = 0  # array bytes the step holds itself, all processes (differential: the changed)
  bytes_reused: int = 0   # array bytes it references in earlier steps instead (differential saves)

  def scalars(self) -> dict[str, float]:
    """The event as a metric writer's scalars: ``checkpoint/<field>``, ``nbytes`` as
    ``checkpoint/bytes`` (``expected_loss_s`` when known).

    >>> SaveEvent(7, "interval", 0.25, 1.0, 4096).scalars()["checkpoint/bytes"]
    4096.0
    """
    return {"checkpoint/" + ("bytes" if f.name == "nbytes" else f.name): float(v)
            for f in dataclasses.fields(self) if f.name not in ("step", "reason")
            for v in [getattr(self, f.name)] if v is not None}


KEPT_EVENTS = 32  # events kept until taken (pop_events); older ones are dropped


class EventLog:
  """The saves committed since they were last taken, each logged when it commits.

  At most :data:`KEPT_EVENTS` are kept for a caller that never takes them
  (:meth:`pop`): the oldest go first, so a run that saves every step for a
  million steps holds a bounded record.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._events: collections.deque[SaveEvent] = collections.deque(maxlen=KEPT_EVENTS)

  def committed(self, blocked: SaveEvent, total_s: float, nbytes: int, where: str,
                schedule: Schedule, stored: Mapping[str, int] | None = None) -> None:
    """A save committed: ``blocked`` holds its blocking times, ``schedule`` learns its cost,
    ``stored`` its ``bytes_written`` and ``bytes_reused`` (differential saves)."""
    log.log(_progress.once_per_job_level(),  # process 0's line; the others' at DEBUG
            "checkpoint step %d (%s) committed to %s: blocking %.3f s (items %.3f, data"
            " iterator %.3f, previous save %.3f, train step still computing %.3f, snapshot"
            " %.3f), total %.3f s, %s written by this process", blocked.step, blocked.reason,
            where, blocked.blocking_s, blocked.blocking_items_s, blocked.blocking_data_s,
            blocked.blocking_wait_s, blocked.blocking_ready_s, blocked.blocking_copy_s, total_s,
            _progress.human_bytes(nbytes))
    # The cost of a save: what it blocked the loop beyond the train step's own computation.
    interval = schedule.committed(blocked.blocking_s - blocked.blocking_ready_s)
    loss = None if interval is None else interval / 2
    with self._lock:
      self._events.append(dataclasses.replace(blocked, total_s=total_s, nbytes=nbytes,
                                              expected_loss_s=loss, **(stored or {})))

  def pop(self) -> list[SaveEvent]:
    """The events since the last call."""
    if not self._events:  # the per-step path: no lock
      return []
    with self._lock:
      events = list(self._events)
      self._events.clear()
    return events


def blocking_event(step: int, reason: str, before: Mapping[str, float], entered: float, wait_s: float,
            ready_s: float, copy_s: float) -> SaveEvent:
  """The blocking times of a save that returned now (``entered``: perf_counter at the call;
  ``before``: :func:`checked_before`'s; ``wait_s``: for the previous save; ``ready_s``: for
  :func:`wait_ready`; ``copy_s``: the engine's blocking phase)."""
  return SaveEvent(step, reason, before["total"] + time.perf_counter() - entered, 0.0, 0,
                   blocking_items_s=before["items"], blocking_data_s=before["data"],
                   blocking_wait_s=wait_s, blocking_ready_s=ready_s, blocking_copy_s=copy_s)


def wait_ready(items: Mapping[str, Any], metrics: Any) -> float:
  """Waits until the arrays of ``items`` and ``metrics`` are computed; returns the seconds.

  JAX dispatches a train step asynchronously: the loop reaches a save while the
  step's results are still being computed, and any save (its snapshot, the
  metrics it records) waits for them first. That wait is the step's own
  computation, not the checkpoint's, so it is reported as a part of its own.
  """
  start = time.perf_counter()
  leaves = jax.tree.leaves((items, metrics or {}))
  # A deleted (donated) array is left to the save, whose error names it and the fix.
  jax.block_until_ready([x for x in leaves if not (isinstance(x, jax.Array) and x.is_deleted())])
  return time.perf_counter() - start


def checked_before(before: Mapping[str, float] | None) -> dict[str, float]:
  """``save(blocking_before=...)`` checked, with every key ("total" at least the parts).

  >>> checked_before({"items": 0.25, "data": 0.5})
  {'items': 0.25, 'data': 0.5, 'total': 0.75}
  """
  out = {"items": 0.0, "data": 0.0}
  for k, v in dict(before or {}).items():
    if k not in BEFORE_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)) \
        or not math.isfinite(v) or v < 0:
      raise ValueError(f"blocking_before[{k!r}]={v!r}: keys must be {BEFORE_KEYS} and values"
                       " seconds >= 0, e.g. {'items': 0.01, 'data': 0.2}")
    out[k] = float(v)
  out["total"] = max(out.get("total", 0.0), out["items"] + out["data"])
  return out


def step_metadata(step: int, reason: str, now: float, metrics: Mapping[str, Any] | None,
                  items: Mapping[str, Any], user: Mapping[str, Any] | None,
                  timeline: str) -> dict[str, Any]:
  """What the manager records with ``step`` (the manifest's ``custom`` block).

  >>> step_metadata(7, "interval", 12.0, {"loss": 0.5}, {}, None, "")["metrics"]
  {'loss': 0.5}
  """
  return {"step": step, "reason": reason, "time": now, "metrics": _scalars(metrics or {}),
          "mesh": _mesh_of(items), "user": dict(user or {}), "timeline": timeline}


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


_FOREIGN = "foreign: "  # how process 0's refusal of another library's steps reaches the others
_FAILED = "failed: "  # how process 0's failure to take the writer lease reaches the others
_REFERENCED = "referenced"  # process 0's word: the directory holds steps that borrow bytes


def _foreign_steps(directory: Location) -> str:
  """Why a manager may not write ``directory`` (prefixed :data:`_FOREIGN`), or "": it holds
  orbax-checkpoint steps, which a listing of steps counts as ours (a file system) or whose
  prefix a save of the same number would write into (an object store), and which keep
  rules would then delete."""
  foreign = orbax_checkpoint.steps(directory)
  if not foreign:
    return ""
  newest = directory.join(str(foreign[-1]))
  return (f"{_FOREIGN}{directory} holds orbax-checkpoint steps {registry_lib.short(foreign)}:"
          " a manager writing here would take them for steps of its own, and its keep rules"
          " would delete them. Nothing was written. Save to a directory of your own; to"
          f" continue that run there, restore its newest step (ofx.restore({str(newest)!r},"
          " target)) and save it as the new directory's first step (the training callback"
          " continues such a run by itself: docs/training.md).")
