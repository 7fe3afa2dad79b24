"""The callback that checkpoints a training loop: policy saves, preemption, resume.

One object works in :class:`orbax_flax.Trainer` and in a hand-written loop::

    with ofx.CheckpointCallback(workdir, config.checkpoint) as ckpt:
      state = ckpt.restore_or_init(state, data_iterator=it)  # resumes if it can
      for step in range(int(state.step), config.num_steps):
        state, metrics = train_step(state, next(it))
        if ckpt.on_step_end(step + 1, state, metrics):      # True: preempted, saved
          break

When nothing is saved, a step costs the policy's decision and no
device-to-host transfer, plus: with a data iterator and ``save_on_exception``
(the default), the iterator's ``get_state()`` at every step (the position an
exception save records; its cost is the iterator's); in a multi-process job
with a time-based policy, one coordination-service round trip. Leaving the
``with`` block (or ``on_train_end``) saves the last step if the policy wants
the final step, and waits for every save to commit.

This module is the hooks and the saves they make, and (at its end) what a run
that ends early checks and says: an error, Ctrl-C, a preemption. Where a run
resumes from (and the data iterator's position) is
:mod:`orbax_flax.training.resume`, the local tier's saves
:mod:`orbax_flax.tiers.saves`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import jax

from orbax_flax.core import _multihost
from orbax_flax.core import _progress
from orbax_flax.core import _tree
from orbax_flax.training import callbacks
from orbax_flax import errors
from orbax_flax.manager import policy as policy_lib
from orbax_flax.training import preemption
from orbax_flax.training import resume
from orbax_flax.training import state_items
from orbax_flax.manager.config import CheckpointPolicy
from orbax_flax.manager import manager as manager_lib
from orbax_flax.manager.manager import CheckpointManager
from orbax_flax.tiers import saves

log = logging.getLogger("orbax_flax")

_CURRENT = object()  # _items: take the data iterator's state now


class CheckpointCallback(callbacks.Callback):
  """Saves on the checkpoint policy, on preemption and on errors; resumes on start.

  Args:
    workdir: the run's directory; checkpoints go to ``<workdir>/checkpoints``
      unless the policy's ``directory`` says otherwise.
    config: a :class:`CheckpointPolicy`, or a config block (ConfigDict,
      dataclass, dict) for :meth:`CheckpointPolicy.from_config`.
    metadata: JSON-serialisable data recorded with every step (e.g. the
      config), also saved as the item ``meta``.
    writer: an optional clu ``MetricWriter`` that receives checkpoint timings
      (``checkpoint/blocking_s``: the whole time ``on_step_end`` waited for
      the save, and its parts ``checkpoint/blocking_items_s``,
      ``checkpoint/blocking_data_s`` (the data iterator's ``get_state()``),
      ``checkpoint/blocking_wait_s`` (the previous save still committing),
      ``checkpoint/blocking_ready_s`` (the train step, dispatched
      asynchronously, still computing the state and metrics being saved) and
      ``checkpoint/blocking_copy_s`` (the snapshot); ``checkpoint/total_s``,
      ``checkpoint/bytes``); and at the first step after ``restore_or_init``
      the restart's parts (``restart/startup_s``, ``restart/restore_s``,
      ``restart/first_step_s``, ``restart/total_s``), also logged in one line;
      start-up counts from the process's start for its first callback, from
      the callback's construction for a later one.
    clock: wall-time source for time-based policies (tests pass a fake).
  """

  def __init__(self, workdir: str, config: Any, *, metadata: Mapping[str, Any] | None = None,
               writer: Any = None, clock=time.time):
    self.policy = config if isinstance(config, CheckpointPolicy) else CheckpointPolicy.from_config(config)
    # The restart's clock (its line at the first step), and JAX's compile cache in the workdir
    # if the policy asks (first: an object-store workdir is refused before anything is built).
    self._restart = resume.RestartClock.start(workdir, self.policy.compilation_cache)
    self._pending: resume.PendingRestore | None = None
    directory = self.policy.directory or os.path.join(workdir, "checkpoints")
    self.manager = CheckpointManager(directory, self.policy, clock=clock)
    self._local = saves.LocalSaves.of(self.policy, self.manager.directory,
                                      self.manager.coordination_key, clock)
    self._resume = resume.Resume(self.manager, self.policy, workdir=workdir,
                                 local=None if self._local is None else self._local.tier)
    self.metadata = dict(metadata or {})
    self.writer = writer
    # Installed by the run's first call (restore_or_init or on_step_end), not here: a
    # process that builds the callback and never trains must still die of SIGTERM.
    self._watcher: preemption.PreemptionWatcher | None = None
    self._data: resume.DataPosition | None = None
    self._last: tuple[int, Any] | None = None
    # (step, save id) of this run's last local save: a persistent save of that step records
    # the id, so that a resume takes the local copy only while it is that save's.
    self._local_copy: tuple[int, str] | None = None
    self.preempted = False
    self.restored_step: int | None = None
    self._last_metrics: Any = None   # of the last step seen: recorded by final and exception saves
    self._preempted_at: int | None = None
    self._closed = False
    self._built: tuple[float, float, float] | None = None  # _items: (start, items_s, data_s)
    self._state_checked = False     # the state's leaves, checked once (restore_or_init or step 1)
    self._data_checked = False      # the data position, checked at the first step (see _check_step)
    # restore_or_init's leaf shapes, compared with the first step's state (pmap replication)
    self._template: dict[tuple[str, ...], tuple[int, ...]] | None = None
    # (data_iterator, restore_data) of the last restore_or_init that ended: on_train_start
    # does not restore again for the same iterator.
    self._restore_ran: tuple[Any, bool] | None = None
    self._restore_asked: tuple[Any, bool] | None = None

  def restore_or_init(self, state: Any, *, data_iterator: Any = None,
                      restore_data: bool = True) -> Any:
    """Resumes from the latest committed step, resharded onto ``state``'s shardings.

    ``state`` is the freshly initialised state of this job (its shardings
    define the mesh to restore onto). With nothing to resume, returns it
    unchanged, or with params from ``init_from`` if the policy sets one.
    ``data_iterator`` (anything with ``get_state()``/``set_state()``) is moved
    to where the restored run stopped (unless ``restore_data=False``: it
    starts where it is, e.g. after a change of dataset a resume refuses), and
    saved with every checkpoint.

    Every part of ``state`` is checked first (each member of a tuple such as
    ``(model, optimizer, rngs)`` is saved: see :mod:`orbax_flax.training.state_items`);
    a leaf that cannot be saved raises here, before anything is written. The
    preemption signal handlers are installed here (or by the first
    :meth:`on_step_end`), not when the callback is built.

    The shapes of ``state`` are what the first :meth:`on_step_end` expects:
    a state whose every array has a leading axis of ``jax.local_device_count()``
    more (a ``jax.pmap`` loop's state after ``flax.jax_utils.replicate``) is
    refused there; give this method the replicated state to save it so.

    Raises:
      UnsupportedLeafError: a leaf of the state cannot be saved.
      TypeError: NNX objects nested inside a plain pytree.
    """
    self._begin_restore(state, data_iterator, restore_data)
    return self._restored(self._resume.restore(state, self._data))

  def restore_or_init_async(self, state: Any, *, data_iterator: Any = None,
                            restore_data: bool = True) -> resume.PendingRestore:
    """:meth:`restore_or_init` on a thread, so that a restart costs about max(restore, compile).

    Returns at once: compile the train step against ``state`` (the restored state has its
    shapes and shardings), then ``state = pending.join()`` (docs/training.md). Until then
    ``state`` and ``data_iterator`` belong to the restore: do not run, donate or advance them.
    The checks and signal handlers run here; the restore's errors are raised by ``join()``.
    :meth:`close` waits for a restore not joined yet; its ``join()`` then raises.
    """
    self._begin_restore(state, data_iterator, restore_data, background=True)
    self._pending = resume.PendingRestore(lambda: self._resume.restore(state, self._data),
                                           self._restored, clock=self._restart)
    return self._pending

  def _begin_restore(self, state: Any, data_iterator: Any, restore_data: bool,
                     background: bool = False) -> None:
    if self._pending is not None and not self._pending.done():  # a failed one may be retried
      raise RuntimeError("a restore_or_init_async restore is still pending: join() it first")
    self._check_open()
    self._template = _shapes(state_items.check(state))  # every part can be saved, checked now
    self._state_checked = True
    self._watch()
    self._data = resume.DataPosition.of(data_iterator, self.manager.coordination_key,
                                        self.policy.coordination_timeout_seconds, restore_data)
    self._restore_ran = None  # set when this restore ends (_restored)
    self._restore_asked = (data_iterator, restore_data)
    self._restart.restore_began(background)

  def _restored(self, got: tuple[Any, int | None]) -> Any:
    state, self.restored_step = got
    self._pending = None
    self._restore_ran = self._restore_asked
    if self.restored_step is not None:
      # The last step so far: a run that ends without another (its steps were all done) still
      # gets its final save, if the persistent tier lacks it (restored from the local tier).
      self._last = (self.restored_step, state)
    if self._data is not None and self.policy.save_on_exception:
      # Where the run's data starts, for an exception save of the step it starts from (its
      # first train step failed: that step's batch was taken, and no step was computed):
      # saved where the persistent tier lacks it (a new run; a resume from the local tier
      # or from another library's run).
      start = self.restored_step if self.restored_step is not None else state_items.step_of(
          state)
      self._data.mark(0 if start is None else start)
    self._restart.joined(self.restored_step)
    # The first save's staging memory, prepared in the background from now on.
    self.manager.prepare(state_items.to_items(state))
    return state

  def on_train_start(self, state: Any, data: Any) -> Any:
    """:meth:`restore_or_init` with ``data``, unless this callback restored already.

    A run that called ``state = ckpt.restore_or_init(state, data_iterator=it,
    restore_data=False)`` (a changed dataset, started afresh) before ``Trainer.fit(state, it,
    ...)`` is not restored a second time, which would move ``it`` back. It is, as before, when
    that restore was given no iterator and ``fit`` is (the data's position is restored then),
    or when ``state`` is not at the step restored (``restore_or_init``'s result not passed
    on), with the same ``restore_data``."""
    done = self._restore_ran
    if done is not None and (data is None or data is done[0]):
      step = state_items.step_of(state)
      if step is None or step == (self.restored_step or 0):
        return state
    return self.restore_or_init(state, data_iterator=data,
                                restore_data=True if done is None else done[1])

  def _items(self, step: int, state: Any, data_state: Any = _CURRENT,
             data_s: float = 0.0) -> dict[str, Any]:
    """The items of a save (``data_state``: the data position, taken ``data_s`` seconds ago)."""
    start = time.perf_counter()
    items = state_items.to_items(state)
    data_start = time.perf_counter()
    if data_state is _CURRENT and self._data is not None:
      data_state = self._data.get()
    if data_state is not _CURRENT and data_state is not None:
      items[resume.DATA_ITEM] = self._data.item(step, data_state)  # every process's
    gathered_s = time.perf_counter() - data_start
    if self.metadata:
      items[resume.META_ITEM] = {"json": json.dumps(self.metadata, sort_keys=True)}
    self._built = (start, time.perf_counter() - start - gathered_s, gathered_s + data_s)
    return items

  def _save(self, step: int, state: Any, metrics: Any, reason: str | None,
            data_state: Any = _CURRENT, items: dict[str, Any] | None = None,
            since: float | None = None) -> bool:
    items = self._items(step, state, data_state) if items is None else items
    built, self._built = self._built, None
    start, items_s, data_s = built or (time.perf_counter(), 0.0, 0.0)
    # What the training thread waited for before the manager's part: since
    # on_step_end began (or since the items were built).
    before = {"items": items_s, "data": data_s,
              "total": time.perf_counter() - (start if since is None else since)}
    copy = self._local_copy[1] if self._local_copy and self._local_copy[0] == step else None
    for _ in range(2):  # a failure of the previous (background) save surfaces here first
      try:
        return self.manager.save(step, items, metrics=metrics, reason=reason,
                                 custom_metadata=self.metadata, blocking_before=before,
                                 local_copy=copy)
      except errors.StorageError as e:
        self._save_failed(e)
    return False

  def _save_local(self, step: int, items: dict[str, Any]) -> errors.StorageError | None:
    """Saves ``step`` to the local tier (logged if it failed); the error, if any."""
    # The newest persistent step this job has (or is saving), recorded with the local step:
    # a resume does not take it over a persistent step another run saved after that one.
    # (The registry's listing, not latest_step(): that raises a failed background save's
    # error, which the persistent tier's next save reports, never a local save.)
    committed = self.manager.registry.committed()
    newest = [s for s in (committed[-1] if committed else None, self.manager.inflight_step())
              if s is not None]
    save_id, failed = self._local.save(step, items, timeline=self.manager.recorded_timeline(),
                                       base=max(newest, default=-1), writer=self.writer)
    self._local_copy = None if failed else (step, save_id)
    return failed

  def _save_failed(self, e: errors.StorageError) -> None:
    """A save failed: raise it, or (``on_save_error="warn"``) log it and go on training."""
    if self.policy.on_save_error != "warn":
      raise e
    log.error("CHECKPOINT SAVE FAILED, training goes on (on_save_error='warn'); the last"
              " committed step is %s: %s", self.manager.latest_step(), e)

  def _watch(self) -> None:
    """Starts watching for preemption signals (once, at the run's first call)."""
    if self._watcher is None and self.policy.save_on_preemption:
      self._watcher = preemption.PreemptionWatcher(self.policy.preemption_signals,
                                                   self.policy.coordination_timeout_seconds)

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("this CheckpointCallback is closed (its run ended, so its manager and"
                         " signal handlers are gone); create a new CheckpointCallback for"
                         " another run")

  def on_step_end(self, step: int, state: Any, metrics: Any = None) -> bool:
    """Saves if due; returns True when preempted (saved, committed: stop now)."""
    entered = time.perf_counter()
    if self._closed:
      self._check_open()
    step = policy_lib.as_step(step)
    if self._pending is not None:
      failed = self._pending.error()
      if failed is not None:
        raise RuntimeError(
            "on_step_end after the restore_or_init_async restore failed: nothing was restored,"
            " so there is no state to train on; fix the cause and call restore_or_init again (or"
            " restore_or_init_async, then join()). The restore's error:"
            f" {type(failed).__name__}: {failed}") from failed
      raise RuntimeError("on_step_end before the restore_or_init_async restore was joined: train"
                         " on the state that its join() returns")
    if self._restart.timing_first_step:  # once: its line and scalars, the step computed
      self._restart.first_step_done(step, (state_items.to_items(state), metrics), self.writer)
    if self.preempted:
      log.warning("on_step_end(%d) called after this job was preempted at step %d (its checkpoint"
                  " is committed): training should have stopped when on_step_end returned True."
                  " Not saving again; stop the loop.", step, self._preempted_at)
      return True
    self._check_step(state, metrics)
    self._last = (step, state)
    self._last_metrics = metrics
    data_state, data_s = _CURRENT, 0.0
    if self._data is not None and self.policy.save_on_exception:
      marking = time.perf_counter()
      self._data.mark(step)  # where the data stood after this step, for an exception save
      data_state, data_s = self._data.after(step), time.perf_counter() - marking
      if not self._data_checked:  # (see _check_step)
        self._data_checked = True
        resume.check_data_state(data_state)
    self._flush_events()
    self._watch()  # at the run's first call
    if self._watcher is not None and self._watcher.reached(step):
      self._save_preemption(step, state, metrics, data_state, data_s)
      return True
    earlier = self.manager.take_error()  # a background save failed: said at the next step
    if earlier is not None:
      self._save_failed(earlier)
    local_due = self._local is not None and self._local.due(step)
    reason = self.manager.should_save(step)
    if local_due or reason is not None:
      # One get_state() (the mark's) and one gather of the data positions for both tiers.
      items = self._items(step, state, data_state, data_s)
      if local_due and reason is not None:  # one copy to host memory for both tiers
        items = self.manager.host_snapshot(items)
      failed = self._save_local(step, items) if local_due else None
      if reason is not None:
        self._save(step, state, metrics, reason, items=items, since=entered)
      if failed is not None:  # a failing local tier never costs the persistent save
        self._save_failed(failed)
    return False

  def _check_step(self, state: Any, metrics: Any) -> None:
    """What a save would refuse, refused at the step it is first seen, not at the first save:
    the state's leaves once (unless :meth:`restore_or_init` did), its shapes against
    :meth:`restore_or_init`'s at the first step (:func:`_refuse_replicated`), the metrics at
    every step that passes them (see :func:`orbax_flax.manager.policy.check_step_metrics`),
    the data iterator's position at the first step."""
    if not self._state_checked:
      state_items.check(state)
      self._state_checked = True
    if self._template is not None:
      template, self._template = self._template, None
      _refuse_replicated(template, state_items.to_items(state))
    if metrics is not None:
      self.manager.check_metrics(metrics)
    if not self._data_checked and self._data is not None and not self.policy.save_on_exception:
      # The first step's position, not the first save's a save interval later (once: a
      # large state takes milliseconds to check; a save checks it again). With
      # save_on_exception, the position marked at the step is (on_step_end).
      self._data_checked = True
      resume.check_data_state(self._data.get())

  def _save_preemption(self, step: int, state: Any, metrics: Any, data_state: Any,
                       data_s: float) -> None:
    # An earlier background save's failure does not cost the preemption save: it is raised
    # (or logged, with on_save_error="warn") once this save is committed.
    earlier = self.manager.take_error()
    if earlier is not None:
      log.error("an earlier save failed (%s: %s); saving the preemption step anyway",
                type(earlier).__name__, earlier)
    start = time.monotonic()
    # The grace period counts from the signal (on every process: see PreemptionWatcher), not
    # from this step, which the processes agreed on maybe many seconds later.
    signalled = start - (self._watcher.signal_time or start)  # seconds before start
    grace = self.policy.preemption_grace_seconds
    log.warning("preempted: saving step %d, %.2f s after the signal%s", step, signalled,
                f" ({max(0.0, grace - signalled):.2f} s of the {grace:g} s grace period left)"
                if grace else "")
    items = self._items(step, state, data_state, data_s)  # the mark's get_state(), if any
    if self._local is not None:  # seconds: done first, whatever the grace period
      items = self.manager.host_snapshot(items)
      self._save_local(step, items)  # a failure is logged: the persistent save still runs
    self._save(step, state, metrics, "preemption", items=items)
    self.preempted = True  # the save is under way: the loop stops, nothing else saves
    self._preempted_at = step
    if committed_in_grace(self.manager, step, grace,
                                        time.monotonic() - start + signalled):
      self._flush_events()
      if _progress.once_per_job_level() == logging.INFO:  # process 0 says it for the job
        _progress.say("preempted: step %d is committed; stopping", step)
      else:
        log.debug("preempted: step %d is committed; stopping", step)

  def on_exception(self, step: int, state: Any, error: BaseException) -> None:
    """Saves the last good state (if the policy says so) and closes; never raises.

    ``step`` is the last step handed to :meth:`on_step_end` and ``state`` the
    state after it. A Linen ``TrainState`` or a pytree is immutable, so that
    state is exactly step ``step``'s and is saved (reason ``exception``). NNX
    objects are updated in place: the failing step may already have changed
    them, so they could hold step ``step + 1`` (or half of it) under the label
    ``step``. Their exception save is therefore refused, with a WARNING that
    says so, and a resume continues from the last committed (periodic,
    preemption) step. A KeyboardInterrupt (Ctrl-C) is reported as an interrupt;
    add ``"SIGINT"`` to the policy's ``preemption_signals`` to make Ctrl-C save
    the next step and stop as a preemption does.

    The training error is what the loop raises: a failure of this save, or of
    a background save, is logged and attached to it as a note.
    """
    try:
      try:
        if self.preempted:
          pass
        elif self.policy.save_on_exception:
          self._save_exception(step, state, error)
        elif isinstance(error, KeyboardInterrupt):
          log.warning("%s; nothing saved (save_on_exception is off). %s%s",
                      failure(step, error), resume_point(self.manager),
                      sigint_hint(self.policy))
      except Exception as e:  # pylint: disable=broad-except  # the training error comes first
        log.error("the exception save of step %d failed too: %s: %s", step, type(e).__name__, e)
        error.add_note(f"orbax_flax: saving step {step} after this error failed too:"
                       f" {type(e).__name__}: {e}")
      try:
        self._close(save_final=False)
      except Exception as e:  # pylint: disable=broad-except
        log.error("closing the checkpoint callback after the error failed: %s: %s",
                  type(e).__name__, e)
        error.add_note(f"orbax_flax: closing the checkpoint callback failed too:"
                       f" {type(e).__name__}: {e}")
    except KeyboardInterrupt:
      # Ctrl-C again while saving after an error (or a first Ctrl-C): stop now, in one line,
      # instead of a traceback chained from inside a thread join.
      if self._watcher is not None:
        self._watcher.close()
      self._closed = True
      stop_saving(self.manager, step)

  def _save_exception(self, step: int, state: Any, error: BaseException) -> None:
    interrupted = isinstance(error, KeyboardInterrupt)
    latest = resume_point(self.manager)
    hint = sigint_hint(self.policy) if interrupted else ""
    if unsaveable(step, state, error, latest + hint):
      return
    if self.manager.has_step(step) or not every_process_failed(self.manager, step):
      return
    data_state = None if self._data is None else self._data.after(step)
    if data_state is None and self._data is not None and (self._last is None
                                                          or step > self._last[0]):
      # Step ``step`` was computed but this callback never saw it (a callback before it in a
      # Trainer raised): the iterator has given that step's batch and no other.
      self._data.mark(step)
      data_state = self._data.after(step)
    if self._data is not None and not self._data.marked(step):
      # The mark failed: get_state() raised at this step (perhaps the very error), or gave
      # what cannot be saved. Saved without its data position, a resume would train on the
      # data from its start.
      log.error("%s; not saving it: the data iterator's position after step %d is unknown"
                " (its get_state() failed, or returned what cannot be saved), and a save"
                " without it would make a resume replay the data from its start. %s",
                failure(step, error), step, latest)
      return
    (log.warning if interrupted else log.error)("%s; saving that step.%s",
                                                failure(step, error), hint)
    self._save(step, state, self._last_metrics, "exception", data_state)

  def on_train_end(self, step: int, state: Any) -> None:
    self._last = (step, state)
    self._close(save_final=True)

  def _close(self, save_final: bool) -> None:
    if self._closed:
      return
    self._closed = True
    try:
      self._close_pending()
      try:
        if save_final and self._last is not None and self.policy.save_final_step and not self.preempted:
          step, state = self._last
          if jax.process_count() > 1:  # a final save needs every process at the same step
            same_last_step(self.manager, step, self.policy.coordination_timeout_seconds)
          if not self.manager.has_step(step):
            self._save(step, state, self._last_metrics, "final")
      finally:
        try:
          self.manager.close()  # always: its threads and staging memory go
        except errors.StorageError as e:
          self._save_failed(e)
      self._flush_events()
    finally:
      self._restart.close()
      if self._watcher is not None:
        self._watcher.close()

  def _close_pending(self) -> None:
    """A restore_or_init_async restore not joined yet: waited for (it reads through the manager
    about to close), and its join() then says the callback closed."""
    pending, self._pending = self._pending, None
    if pending is None:
      return
    error = pending.close(
        "the CheckpointCallback was closed while this restore was pending, so its state is not"
        " taken (the callback's manager is gone): join() a restore_or_init_async restore before"
        " close() or the end of the `with` block, or restore again with a new CheckpointCallback")
    if error is not None:
      log.warning("a restore_or_init_async restore pending at close() had failed, and was never"
                  " joined: %s: %s", type(error).__name__, error)

  def close(self) -> None:
    """Saves the final step (if the policy wants it) and waits for every save; a
    :meth:`restore_or_init_async` restore not joined yet is waited for, and its ``join()``
    then raises, saying the callback was closed."""
    self._close(save_final=True)

  def __enter__(self) -> CheckpointCallback:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc is None:
      self.close()
    elif self._last is not None:  # never raises: the training error propagates (plus notes)
      self.on_exception(self._last[0], self._last[1], exc)
    else:
      try:
        self._close(save_final=False)
      except Exception as e:  # pylint: disable=broad-except
        log.error("closing the checkpoint callback failed: %s: %s", type(e).__name__, e)
        exc.add_note(f"orbax_flax: closing the checkpoint callback failed too: {e}")

  def _flush_events(self) -> None:
    events = self.manager.pop_events()
    if self.writer is None or not events:
      return
    for e in events:
      self.writer.write_scalars(e.step, e.scalars())
    self.writer.flush()


# ----------------------------------------------------------------------------
# Training that ends early (an error, Ctrl-C, a preemption): what the callback checks and
# says beside saving. Whether the state at an error is still the last step's, the ending in
# words for the log, the agreement through the coordination service that every process
# failed, the wait for a preemption save within its grace period (cancelling a late one),
# and a second Ctrl-C while saving (the save abandoned, the manager closed).


# How long an exception save waits for the other processes to fail too (a NaN
# loss fails everywhere at once; a failure of one process alone leaves the
# others inside a collective, and nothing can be saved without them).
FAILED_AGREEMENT_S = 3.0


def stop_saving(manager: CheckpointManager, step: int) -> None:
  """A second Ctrl-C while saving ``step``: abandons the save, closes ``manager``, says so.

  The writing stops before the process exits: one that exits while tensorstore
  writes may abort.
  """
  try:
    manager.abandon_inflight(wait_s=manager_lib.ABANDON_WAIT_S)
    manager.close()  # its threads too (the staging memory's preparation)
  except KeyboardInterrupt:  # a third Ctrl-C: stop waiting
    pass
  except Exception as e:  # pylint: disable=broad-except  # the interruption comes first
    log.error("closing the checkpoint manager after the second interruption failed: %s: %s",
              type(e).__name__, e)
  latest = manager.latest_step()
  outcome = ("its commit was under way and is complete" if latest == step else
             "the save is abandoned (never committed half-written)")
  print(f"orbax_flax: interrupted again while saving step {step}: {outcome}; the last"
        f" committed step is {latest}", file=sys.stderr, flush=True)


def committed_in_grace(manager: CheckpointManager, step: int, grace: float,
                       spent: float) -> bool:
  """Waits for the preemption save of ``step`` (``grace`` seconds, 0: no limit, ``spent`` of
  them gone); True once committed, False (logged; cancelled if late) when not."""
  if grace and not manager.wait_for_save(max(0.0, grace - spent)):
    manager.abandon_inflight()
    log.error("preemption save of step %d did not commit within the %g s grace period;"
              " cancelled: it is not committed unless its commit was already under way"
              " (then it is complete). The last committed step is %s.", step, grace,
              manager.latest_step())
    return False
  try:
    manager.wait()
  except errors.SaveCancelledError as e:
    # Another process ran out of grace period and cancelled the save: the job is
    # still preempted; stop cleanly like that process does.
    log.error("preemption save of step %d was not committed: %s The last committed step"
              " is %s.", step, e, manager.latest_step())
    return False
  return True


def failure(step: int, error: BaseException) -> str:
  """What ended training, in words, for the log."""
  if isinstance(error, KeyboardInterrupt):
    return f"interrupted after step {step} (KeyboardInterrupt: Ctrl-C or SIGINT)"
  return f"training failed after step {step} ({type(error).__name__}: {error})"


def unsaveable(step: int, state: Any, error: BaseException, after: str) -> bool:
  """True (and logged, followed by ``after``) if the state at an error is not step ``step``'s."""
  if state_items.kind(state) == "nnx":
    log.warning("%s; not saving it: NNX objects are updated in place, so the live model and"
                " optimizer may already be ahead of step %d, the last step handed to"
                " on_step_end, and a save labelled %d could hold a later state. %s",
                failure(step, error), step, step, after)
    return True
  if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
    (log.warning if isinstance(error, KeyboardInterrupt) else log.error)(
        "%s; the state of step %d cannot be saved: its buffers were donated to the next"
        " step. %s", failure(step, error), step, after)
    return True
  return False


def sigint_hint(policy: CheckpointPolicy) -> str:
  """How to make Ctrl-C save as a preemption does ("" if it already does)."""
  if "SIGINT" in policy.preemption_signals and policy.save_on_preemption:
    return ""
  return (" To make Ctrl-C save at the next step end and stop cleanly, as a preemption does,"
          " add SIGINT to the policy's preemption_signals, e.g. preemption_signals=('SIGTERM',"
          " 'SIGINT') (on the command line:"
          " --config.checkpoint.preemption_signals=\"('SIGTERM','SIGINT')\").")


def _shapes(items: Mapping[str, Any]) -> dict[tuple[str, ...], tuple[int, ...]]:
  """Each leaf's shape by its key path, item first (a number's is ``()``); reads no data."""
  return {(name,) + path: tuple(getattr(leaf, "shape", ())) for name, tree in items.items()
          for path, leaf in _tree.flatten(tree)}


def _refuse_replicated(template: Mapping[tuple[str, ...], tuple[int, ...]],
                       items: Mapping[str, Any]) -> None:
  """Refuses a ``jax.pmap`` loop's replicated state: every array of ``items`` with a leading
  axis of ``jax.local_device_count()`` before its shape in ``template`` (restore_or_init's).

  A template that was itself replicated has the same shapes: it is saved as it is.

  Raises:
    TypeError: naming a leaf, its shapes and ``flax.jax_utils.unreplicate``.

  Example:
    >>> import jax, numpy as np
    >>> n = jax.local_device_count()
    >>> _refuse_replicated({("params", "w"): (4,)}, {"params": {"w": np.ones((4,))}})
    >>> _refuse_replicated({("params", "w"): (4,)}, {"params": {"w": np.ones((n, 4))}})
    Traceback (most recent call last):
    ...
    TypeError: the state passed to on_step_end is replicated: ...
  """
  n = jax.local_device_count()
  arrays = {(name,) + path: tuple(leaf.shape) for name, tree in items.items()
            for path, leaf in _tree.flatten(tree) if hasattr(leaf, "shape")}
  if not arrays or any(p not in template or s != (n,) + template[p] for p, s in arrays.items()):
    return
  path, shape = next(iter(arrays.items()))
  raise TypeError(
      f"the state passed to on_step_end is replicated: every array has a leading axis of {n}"
      f" (jax.local_device_count()) before the shape restore_or_init was given (e.g."
      f" {_tree.path_str(path)}: {shape}, not {template[path]}), as a jax.pmap loop's state"
      f" after flax.jax_utils.replicate. Saved so, it would hold {n} copies that a resume of"
      " the unreplicated state cannot read. Pass flax.jax_utils.unreplicate(state) (device 0's"
      " copy) to on_step_end; to save the replicated state on purpose, give restore_or_init"
      " the replicated state (flax.jax_utils.replicate(state)). Nothing was saved.")


def resume_point(manager: CheckpointManager) -> str:
  """Where a resume would start, as a sentence (a save in flight commits before the close)."""
  inflight = manager.inflight_step()
  if inflight is not None:
    return (f"A resume continues from step {inflight}, whose save is still being written (it"
            " commits before the callback closes).")
  latest = manager.latest_step()
  if latest is None:
    return "No step is committed yet: a resume starts from scratch."
  return f"A resume continues from step {latest}, the last committed."


def same_last_step(manager: CheckpointManager, step: int, timeout_s: float) -> None:
  """Checks that every process ends its run at ``step`` (before a final save, which needs
  them all there).

  Raises:
    RuntimeError: the processes ended at different steps, naming them and the fix.
  """
  ends = [int(s) for s in _multihost.all_gather(f"{manager.coordination_key}/end", str(step),
                                                timeout_s=timeout_s, what="end the run")]
  if len(set(ends)) > 1:
    each = ", ".join(f"process {p}: {s}" for p, s in enumerate(ends))
    raise RuntimeError(
        f"the processes ended the run at different steps ({each}),"
        " so no final step is saved (the last committed is"
        f" {manager.latest_step()}). Every process of a job must run the same steps: a"
        " finite pass over the data that ends at different steps on different processes"
        " does this (orbax_flax.data.ElasticIterator over a dataset with a filter yields"
        " different numbers of batches per process): repeat() the dataset and stop at a"
        " fixed number of steps.")


def every_process_failed(manager: CheckpointManager, step: int) -> bool:
  """A save needs every process; one that did not fail is still training."""
  if jax.process_count() == 1:
    return True
  try:
    _multihost.all_gather(f"{manager.coordination_key}/failed/{step}", "1",
                          timeout_s=FAILED_AGREEMENT_S)
    return True
  except TimeoutError:
    log.error("training failed after step %d on this process, and not every process stopped"
              " at that step within %g s (the others are still training, or stopped at"
              " another step: a Ctrl-C reaches each between steps); no exception save (it"
              " needs all of them at one step)", step, FAILED_AGREEMENT_S)
    return False
