"""The callback that checkpoints a training loop: policy saves, preemption, resume.

One object works in :class:`orbax_flax.Trainer` and in a hand-written loop::

    with ofx.CheckpointCallback(workdir, config.checkpoint) as ckpt:
      state = ckpt.restore_or_init(state, data_iterator=it)  # resumes if it can
      for step in range(int(state.step), config.num_steps):
        state, metrics = train_step(state, next(it))
        if ckpt.on_step_end(step + 1, state, metrics):      # True: preempted, saved
          break

The per-step cost when nothing is saved is a few microseconds and no
device-to-host transfer (a multi-process job with a time-based policy adds one
coordination-service round trip per step). Leaving the ``with`` block (or
``on_train_end``) saves the last step if the policy wants the final step, and
waits for every save to commit.
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
import numpy as np

from orbax_flax import _multihost
from orbax_flax import _progress
from orbax_flax import _tree
from orbax_flax import callbacks
from orbax_flax import errors
from orbax_flax import init_from
from orbax_flax import preemption
from orbax_flax import restoring
from orbax_flax import state_items
from orbax_flax import targets
from orbax_flax._location import Location
from orbax_flax.config import CheckpointPolicy
from orbax_flax.manager import CheckpointManager

log = logging.getLogger("orbax_flax")

DATA_ITEM = "data"
META_ITEM = "meta"


def _mesh_text(tree: Any) -> str:
  """Where the arrays of ``tree`` live, in words."""
  kinds = set()
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      return f"mesh {dict(sharding.mesh.shape)}"
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
      kinds.add("a single device")
    elif isinstance(leaf, np.ndarray):
      kinds.add("the host (numpy)")
  return " and ".join(sorted(kinds)) or "the host"


def _saved_mesh_text(mesh: Any) -> str:
  return f"mesh {mesh}" if mesh else "a single device or the host"


def _targets(items: Mapping[str, Any]) -> dict[str, Any]:
  """Restore targets: the shapes, dtypes and shardings of the live state."""
  def abstract(x):
    return targets.of_array(x) if isinstance(x, jax.Array) else x
  return {k: jax.tree.map(abstract, v) for k, v in items.items()}


_CURRENT = object()  # _items: take the data iterator's state now
# How long an exception save waits for the other processes to fail too (a NaN
# loss fails everywhere at once; a failure of one process alone leaves the
# others inside a collective, and nothing can be saved without them).
_FAILED_AGREEMENT_S = 3.0


def _log_casts(casts: list) -> None:
  for where, saved, wanted, exact in casts:
    log.warning("resume: %s converted from %s (checkpoint) to %s (this run's state)%s", where,
                saved, wanted, "" if exact else ", losing information (allow_lossy_casts)")


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
      ``checkpoint/blocking_wait_s`` (the previous save still committing) and
      ``checkpoint/blocking_copy_s`` (the snapshot); ``checkpoint/total_s``,
      ``checkpoint/bytes``).
    clock: wall-time source for time-based policies (tests pass a fake).
  """

  def __init__(self, workdir: str, config: Any, *, metadata: Mapping[str, Any] | None = None,
               writer: Any = None, clock=time.time):
    self.policy = config if isinstance(config, CheckpointPolicy) else CheckpointPolicy.from_config(config)
    directory = self.policy.directory or os.path.join(workdir, "checkpoints")
    self.manager = CheckpointManager(directory, self.policy, clock=clock)
    parts = self.manager.components  # what the policy describes, built once (orbax_flax.components)
    self._local, self._local_schedule = parts.local, parts.local_schedule
    self.metadata = dict(metadata or {})
    self.writer = writer
    # Installed by the run's first call (restore_or_init or on_step_end), not here: a
    # process that builds the callback and never trains must still die of SIGTERM.
    self._watcher: preemption.PreemptionWatcher | None = None
    self._data = None
    self._last: tuple[int, Any] | None = None
    self.preempted = False
    self.restored_step: int | None = None
    self._data_after_last: tuple[int, Any] | None = None
    self._last_metrics: Any = None   # of the last step seen: recorded by final and exception saves
    self._preempted_at: int | None = None
    self._closed = False
    self._built: tuple[float, float, float] | None = None  # _items: (start, items_s, data_s)

  # ------------------------------------------------------------------ resume

  def restore_or_init(self, state: Any, *, data_iterator: Any = None) -> Any:
    """Resumes from the latest committed step, resharded onto ``state``'s shardings.

    ``state`` is the freshly initialised state of this job (its shardings
    define the mesh to restore onto). With nothing to resume, returns it
    unchanged, or with params from ``init_from`` if the policy sets one.
    ``data_iterator`` (anything with ``get_state()``/``set_state()``) is moved
    to where the restored run stopped, and saved with every checkpoint.

    Every part of ``state`` is checked first (each member of a tuple such as
    ``(model, optimizer, rngs)`` is saved: see :mod:`orbax_flax.state_items`);
    a leaf that cannot be saved raises here, before anything is written. The
    preemption signal handlers are installed here (or by the first
    :meth:`on_step_end`), not when the callback is built.

    Raises:
      UnsupportedLeafError: a leaf of the state cannot be saved.
      TypeError: NNX objects nested inside a plain pytree.
    """
    self._check_open()
    state_items.check(state)  # every part of the state can be saved, before anything runs
    self._watch()
    self._data = data_iterator if hasattr(data_iterator, "get_state") else None
    if data_iterator is not None and self._data is None:
      log.warning("the data iterator (%s) has no get_state()/set_state(): its position is not"
                  " checkpointed, so a resumed run restarts it (grain iterators have both)",
                  type(data_iterator).__name__)

    state = self._resume(state)
    # The first save's staging memory, prepared in the background from now on.
    self.manager.prepare(state_items.to_items(state))
    return state

  def _resume(self, state: Any) -> Any:
    steps = self.manager.all_steps()
    if self._local is not None:
      resumed = self._restore_local(state, steps[-1] if steps else None)
      if resumed is not None:
        return resumed
    if not steps:
      if self.policy.init_from:
        return self._init_from(state)
      _progress.say("no checkpoint in %s: starting from scratch", self.manager.directory)
      return state
    items = state_items.to_items(state)
    step, summary, restored = self._restore_newest(steps, _targets(items))
    state = state_items.from_items(state, restored)
    if self._data is not None:
      self._restore_data(step)
    self.restored_step = step
    saved_mesh = summary.custom.get("mesh")
    _progress.say("restored step %d (%s) from %s: saved on %s by %d process(es), restored onto %s"
                  " with %d process(es)", step, summary.custom.get("reason"),
                  self.manager.step_path(step), _saved_mesh_text(saved_mesh),
                  summary.process_count, _mesh_text(items), jax.process_count())
    return state

  def _restore_local(self, state: Any, persistent_latest: int | None) -> Any:
    """Resumes from the local tier when it holds a step at least as new as the persistent one."""
    items = state_items.to_items(state)
    target = _targets(items)
    if self._data is not None:
      target[DATA_ITEM] = None
    newer_than = None if persistent_latest is None else persistent_latest - 1
    # The target is checked as the persistent tier checks it: a TreeMismatchError is raised.
    options = dict(newer_than=newer_than, timeline=self.manager.timeline,
                   allow_lossy_casts=self.policy.allow_lossy_casts)
    casts: list = []
    try:  # a step saved without a data position restores without one
      got = self._local.restore(target, casts=casts, optional=(DATA_ITEM,), **options)
    except (errors.StorageError, TimeoutError) as e:  # the local tier never stops a start
      log.error("local tier: cannot resume from %s (%s); reading the persistent tier",
                self.policy.local_directory, e)
      got = None
    if got is None:
      return None
    _log_casts(casts)
    step, restored, where = got
    data = restored.pop(DATA_ITEM, None)
    state = state_items.from_items(state, restored)
    if self._data is not None and data is not None:
      self._set_data_state(step, data)
    self.restored_step = step
    _progress.say("restored step %d from the local tier (%s; process %d read %s; the persistent"
                  " tier's latest is %s)", step, self.policy.local_directory,
                  jax.process_index(), where, persistent_latest)
    return state

  def _restore_newest(self, steps: list[int], target: dict[str, Any]):
    """(step, summary, items) of the newest step that restores; never silently starts fresh.

    A step whose bytes are damaged or missing is reported loudly; with
    ``on_unreadable_checkpoint="fallback"`` the next older step is tried. If
    committed steps exist but none restores, this raises.
    """
    failures = []
    for step in reversed(steps):
      try:
        summary = restoring.read_summary(Location.parse(self.manager.step_path(step)))
        casts: list = []
        restored = self.manager.restore(step, target, allow_lossy_casts=self.policy.allow_lossy_casts,
                                        casts=casts)
        _log_casts(casts)
        error = None
      except (errors.CheckpointCorruptedError, errors.CheckpointNotFoundError) as e:
        error = e
      if jax.process_count() > 1:  # every process resumes from the same step, or none does
        votes = _multihost.all_gather(f"{self.manager.coordination_key}/resume/{step}",
                                      "ok" if error is None else f"{type(error).__name__}: {error}",
                                      timeout_s=self.policy.coordination_timeout_seconds,
                                      what=f"restore step {step}")
        bad = [f"process {p}: {v}" for p, v in enumerate(votes) if v != "ok"]
        if bad and error is None:
          error = errors.CheckpointCorruptedError("; ".join(bad))
      if error is None:
        return step, summary, restored
      failures.append(f"step {step}: {error}")
      log.error("CANNOT RESUME FROM STEP %d of %s: %s", step, self.manager.directory, error)
      if self.policy.on_unreadable_checkpoint == "raise":
        raise error
      older = [s for s in steps if s < step]
      if older:
        log.error("falling back to the next older committed step, %d; `python -m orbax_flax"
                  " verify %s` tells what is damaged", older[-1], self.manager.step_path(step))
    raise errors.CheckpointCorruptedError(
        f"{len(steps)} committed step(s) in {self.manager.directory}, and none of them restores;"
        " refusing to start from scratch over them. Move the directory away to start fresh, or"
        " repair it:\n  " + "\n  ".join(failures))

  def _init_from(self, state: Any) -> Any:
    items = state_items.to_items(state)
    name = "params" if "params" in items else "state"
    target = _targets({name: items[name]})[name]
    items[name], source = init_from.load(self.policy.init_from, name, target)
    _progress.say("initialised %s from %s (fine-tuning; nothing to resume in %s)", name, source,
                  self.manager.directory)
    return state_items.from_items(state, items)

  def _restore_data(self, step: int) -> None:
    try:
      data = self.manager.restore(step, {DATA_ITEM: None})[DATA_ITEM]
    except errors.TreeMismatchError:
      log.warning("step %d holds no data iterator position (it was saved without one); the"
                  " iterator starts where it is", step)
      return
    self._set_data_state(step, data)

  def _set_data_state(self, step: int, data: Any) -> None:
    states = data.get("processes", [])
    me, n = jax.process_index(), jax.process_count()
    is_global = bool(data.get("global")) or _says_global(self._data)
    if len(states) == n:
      mine = states[me]
    elif is_global and states and all(s == states[0] for s in states):
      mine = states[0]  # a global position: valid for any process count
    else:
      what = ("differ" if is_global else "are per-process positions (the iterator did not say its"
              " state is global)")
      raise ValueError(
          f"step {step} holds {len(states)} data iterator states that {what}, and this job has {n}"
          f" process(es): a position within one process's shard of the data (e.g. grain's"
          f" ShardByJaxProcess) cannot be moved onto another process count. Resume with"
          f" {len(states)} processes; or restart the data pipeline (pass data_iterator=None) and"
          " accept a new data order; or, if get_state() is a position in the global data order"
          " that is the same on every process, set `checkpoint_state_is_global = True` on the"
          " iterator (see the README).")
    self._data.set_state(mine)
    log.info("data iterator restored to where step %d stopped", step)

  def on_train_start(self, state: Any, data: Any) -> Any:
    return self.restore_or_init(state, data_iterator=data)

  # ------------------------------------------------------------------ saving

  def _items(self, step: int, state: Any, data_state: Any = _CURRENT) -> dict[str, Any]:
    start = time.perf_counter()
    items = state_items.to_items(state)
    data_start = time.perf_counter()
    if data_state is _CURRENT and self._data is not None:
      data_state = self._data.get_state()
    if data_state is not _CURRENT and data_state is not None:
      # One iterator state per process, gathered so that every process saves all.
      key = f"{self.manager.coordination_key}/data/{step}"
      states = _multihost.all_gather(key, _encode(data_state))
      items[DATA_ITEM] = {"processes": [_decode(s) for s in states],
                          "global": _says_global(self._data)}
    data_s = time.perf_counter() - data_start
    if self.metadata:
      items[META_ITEM] = {"json": json.dumps(self.metadata, sort_keys=True)}
    self._built = (start, time.perf_counter() - start - data_s, data_s)
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
    for _ in range(2):  # a failure of the previous (background) save surfaces here first
      try:
        return self.manager.save(step, items, metrics=metrics, reason=reason,
                                 custom_metadata=self.metadata, blocking_before=before)
      except errors.StorageError as e:
        self._save_failed(e)
    return False

  def _save_failed(self, e: errors.StorageError) -> None:
    """A save failed: raise it, or (``on_save_error="warn"``) log it and go on training."""
    if self.policy.on_save_error != "warn":
      raise e
    log.error("CHECKPOINT SAVE FAILED, training goes on (on_save_error='warn'); the last"
              " committed step is %s: %s", self.manager.latest_step(), e)

  def _watch(self) -> None:
    """Starts watching for preemption signals (once, at the run's first call)."""
    if self._watcher is None and self.manager.components.watcher is not None:
      self._watcher = self.manager.components.watcher()

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
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
      raise TypeError(f"on_step_end needs the step as a Python int (your loop counter), got"
                      f" {type(step).__name__}; reading a jax.Array step would force a"
                      " device-to-host sync every step")
    step = int(step)
    if self.preempted:
      log.warning("on_step_end(%d) called after this job was preempted at step %d (its checkpoint"
                  " is committed): training should have stopped when on_step_end returned True."
                  " Not saving again; stop the loop.", step, self._preempted_at)
      return True
    self._last = (step, state)
    self._last_metrics = metrics
    if self._data is not None and self.policy.save_on_exception:
      # Where the data stood after this step: an exception save must not record
      # the batch the failing step had already taken.
      self._data_after_last = (step, self._data.get_state())
    self._flush_events()
    if self._watcher is None:
      self._watch()
    if self._watcher is not None and self._watcher.reached(step):
      self._save_preemption(step, state, metrics)
      return True
    local_due = self._local_schedule is not None and self._local_schedule.due(step) is not None
    reason = self.manager.should_save(step)
    if local_due or reason is not None:
      items = self._items(step, state)  # one gather of the data positions for both tiers
      if local_due and reason is not None:  # one copy to host memory for both tiers
        items = self.manager.host_snapshot(items)
      failed = self._save_local(step, items) if local_due else None
      if reason is not None:
        self._save(step, state, metrics, reason, items=items, since=entered)
      if failed is not None:  # a failing local tier never costs the persistent save
        self._save_failed(failed)
    return False

  def _save_local(self, step: int, items: dict[str, Any]) -> errors.StorageError | None:
    """A local-tier save: this process's shards to its own disk and its replicas' (collective).

    Returns the error of a failed local save (logged here) instead of raising
    it, so that the persistent save of the same step runs first; the caller
    then handles it like a persistent failure (``on_save_error``).
    """
    try:
      seconds = self._local.save(step, items, timeline=self.manager.timeline)
    except (errors.StorageError, TimeoutError) as e:
      log.error("local checkpoint of step %d failed (%s); the persistent tier is not affected: %s",
                step, self.policy.local_directory, e)
      return e if isinstance(e, errors.StorageError) else errors.StorageError(str(e))
    self._local_schedule.record(step, seconds)
    interval = self._local_schedule.interval()
    log.info("local checkpoint step %d committed in %.3f s (%s, %d replica(s))%s", step, seconds,
             self.policy.local_directory, self._local.replicas,
             "" if interval is None else f"; local_save_interval=auto: next in {interval:.1f} s,"
             f" a failure loses {interval / 2:.1f} s of work on average")
    if self.writer is not None:
      scalars = {"checkpoint/local_s": seconds}
      if interval is not None:
        scalars["checkpoint/local_expected_loss_s"] = interval / 2
      self.writer.write_scalars(step, scalars)
    return None

  def _save_preemption(self, step: int, state: Any, metrics: Any) -> None:
    self.preempted = True
    self._preempted_at = step
    start = time.monotonic()
    items = self._items(step, state)
    if self._local is not None:  # seconds: done first, whatever the grace period
      items = self.manager.host_snapshot(items)
      self._save_local(step, items)  # a failure is logged: the persistent save still runs
    self._save(step, state, metrics, "preemption", items=items)
    grace = self.policy.preemption_grace_seconds
    if grace:
      since = start - (self._watcher.signal_time or start)
      left = max(0.0, grace - since - (time.monotonic() - start))
      if not self.manager.wait_for_save(left):
        self.manager.abandon_inflight()
        log.error("preemption save of step %d did not commit within the %g s grace period;"
                  " cancelled: it is not committed unless its commit was already under way"
                  " (then it is complete). The last committed step is %s.", step, grace,
                  self.manager.latest_step())
        return
    try:
      self.manager.wait()
    except errors.SaveCancelledError as e:
      # Another process ran out of grace period and cancelled the save: the
      # job is still preempted; stop cleanly like that process does.
      log.error("preemption save of step %d was not committed: %s The last committed step"
                " is %s.", step, e, self.manager.latest_step())
      return
    self._flush_events()
    _progress.say("preempted: step %d is committed; stopping", step)

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
          log.warning("%s; nothing saved (save_on_exception is off). %s%s", _failure(step, error),
                      self._resume_point(), self._sigint_hint())
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
      self.manager.abandon_inflight()
      if self._watcher is not None:
        self._watcher.close()
      self._closed = True
      print(f"orbax_flax: interrupted again while saving step {step}: the save is abandoned (never"
            f" committed half-written); the last committed step is {self.manager.latest_step()}",
            file=sys.stderr, flush=True)

  def _sigint_hint(self) -> str:
    if "SIGINT" in self.policy.preemption_signals and self.policy.save_on_preemption:
      return ""
    return (" To make Ctrl-C save at the next step end and stop cleanly, as a preemption does,"
            " add SIGINT to the policy's preemption_signals, e.g. preemption_signals=('SIGTERM',"
            " 'SIGINT') (on the command line:"
            " --config.checkpoint.preemption_signals=\"('SIGTERM','SIGINT')\").")

  def _resume_point(self) -> str:
    """Where a resume would start, as a sentence (a save in flight commits before the close)."""
    inflight = self.manager.inflight_step()
    if inflight is not None:
      return (f"A resume continues from step {inflight}, whose save is still being written (it"
              " commits before the callback closes).")
    latest = self.manager.latest_step()
    if latest is None:
      return "No step is committed yet: a resume starts from scratch."
    return f"A resume continues from step {latest}, the last committed."

  def _save_exception(self, step: int, state: Any, error: BaseException) -> None:
    interrupted = isinstance(error, KeyboardInterrupt)
    latest = self._resume_point()
    hint = self._sigint_hint() if interrupted else ""
    if state_items.kind(state) == "nnx":
      log.warning("%s; not saving it: NNX objects are updated in place, so the live model and"
                  " optimizer may already be ahead of step %d, the last step handed to"
                  " on_step_end, and a save labelled %d could hold a later state. %s%s",
                  _failure(step, error), step, step, latest, hint)
    elif any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
      (log.warning if interrupted else log.error)(
          "%s; the state of step %d cannot be saved: its buffers were donated to the next"
          " step. %s%s", _failure(step, error), step, latest, hint)
    elif not self.manager.has_step(step) and self._every_process_failed(step):
      (log.warning if interrupted else log.error)("%s; saving that step.%s",
                                                  _failure(step, error), hint)
      data_state = None  # no position known for this step: saved without one
      if self._data_after_last is not None and self._data_after_last[0] == step:
        data_state = self._data_after_last[1]
      self._save(step, state, self._last_metrics, "exception", data_state)

  def _every_process_failed(self, step: int) -> bool:
    """A save needs every process; one that did not fail is still training."""
    if jax.process_count() == 1:
      return True
    try:
      _multihost.all_gather(f"{self.manager.coordination_key}/failed/{step}", "1",
                            timeout_s=_FAILED_AGREEMENT_S)
      return True
    except TimeoutError:
      log.error("training failed after step %d on this process but not on every process within"
                " %g s; no exception save (it needs all of them)", step, _FAILED_AGREEMENT_S)
      return False

  def on_train_end(self, step: int, state: Any) -> None:
    self._last = (step, state)
    self._close(save_final=True)

  def _close(self, save_final: bool) -> None:
    if self._closed:
      return
    self._closed = True
    try:
      try:
        if save_final and self._last is not None and self.policy.save_final_step and not self.preempted:
          step, state = self._last
          if not self.manager.has_step(step):
            self._save(step, state, self._last_metrics, "final")
      finally:
        try:
          self.manager.close()  # always: its threads and staging memory go
        except errors.StorageError as e:
          self._save_failed(e)
      self._flush_events()
    finally:
      if self._watcher is not None:
        self._watcher.close()

  def close(self) -> None:
    """Saves the final step (if the policy wants it) and waits for every save."""
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
      scalars = {"checkpoint/blocking_s": e.blocking_s, "checkpoint/total_s": e.total_s,
                 "checkpoint/bytes": float(e.nbytes),
                 "checkpoint/blocking_items_s": e.blocking_items_s,
                 "checkpoint/blocking_data_s": e.blocking_data_s,
                 "checkpoint/blocking_wait_s": e.blocking_wait_s,
                 "checkpoint/blocking_copy_s": e.blocking_copy_s}
      if e.expected_loss_s is not None:
        scalars["checkpoint/expected_loss_s"] = e.expected_loss_s
      self.writer.write_scalars(e.step, scalars)
    self.writer.flush()


def _failure(step: int, error: BaseException) -> str:
  """What ended training, in words, for the log."""
  if isinstance(error, KeyboardInterrupt):
    return f"interrupted after step {step} (KeyboardInterrupt: Ctrl-C or SIGINT)"
  return f"training failed after step {step} ({type(error).__name__}: {error})"


def _says_global(iterator: Any) -> bool:
  """True if a data iterator declares its state a global position (the documented protocol).

  An iterator whose ``get_state()`` is the same on every process and means a
  position in the global data order sets ``checkpoint_state_is_global = True``
  (an attribute or a property); its state then resumes on any process count.
  Anything else is taken as a per-process position.
  """
  return getattr(iterator, "checkpoint_state_is_global", False) is True


def _encode(value: Any) -> str:
  """A data iterator state (dicts, lists, str, bytes, numbers) as one JSON string."""
  structure, leaves = _tree.encode_structure(value)
  for path, leaf in leaves:
    if _tree.leaf_kind(leaf) != "value":
      raise TypeError(f"data iterator state leaf {_tree.path_str(path)} is a {type(leaf).__name__};"
                      " get_state() must return dicts, lists, str, bytes and numbers")
  return json.dumps({"s": structure, "v": [_tree.encode_value(l) for _, l in leaves]})


def _decode(text: str) -> Any:
  d = json.loads(text)
  return _tree.decode_structure(d["s"], [_tree.decode_value(v) for v in d["v"]])
