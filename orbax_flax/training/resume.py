"""Resuming a run: which step it continues from, putting that step back, the restart's time.

:class:`Resume` is what :meth:`orbax_flax.CheckpointCallback.restore_or_init`
runs at the start of every run, in this order:

1. the local tier (if the policy has one), when it holds a step at least as
   new as the persistent tier's latest: the fast path after a preemption;
2. the persistent tier's newest committed step that restores on every
   process: each process votes, and a step damaged on any of them is reported
   loudly; with ``on_unreadable_checkpoint="fallback"`` the next older step is
   tried. Committed steps none of which restores raise: a run never starts
   from scratch over them;
3. nothing committed: a run of another library found in the workdir (an
   orbax-checkpoint ``CheckpointManager`` directory, or flax's legacy
   ``checkpoint_<N>`` checkpoints) is continued, the whole state restored from
   its newest step (:class:`PreviousRun`, at the end of this module); else the policy's ``init_from``
   (fine-tuning: see :mod:`orbax_flax.training.init_from`), else the fresh state as it
   is. A run never starts fresh silently beside checkpoints it could have
   continued: a workdir that is itself a run's checkpoints directory, or an
   orbax-checkpoint run in the very directory orbax_flax would write to,
   raises with the line to write.

Every restore of the persistent tier goes through the run's
:class:`CheckpointManager` (its steps) or a :class:`Checkpointer` with the run's
options (``init_from``), so each has the watchdog, progress output and
host-memory budget of any restore. The local tier restores through its own
reader (:mod:`orbax_flax.tiers.local`).

:class:`DataPosition` is the data-position protocol: a data iterator with
``get_state()``/``set_state()`` is saved as the item ``data``, one state per
process, and moved back to where the restored step stopped.

Two more parts of a resume close the module: the restart (JAX's compile cache in the
workdir, a restore in the background while the train step compiles, the restart's clock),
and what else the workdir holds (another library's run to continue, slips to refuse).
"""

from __future__ import annotations

import builtins
import copy
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from orbax_flax.core import _location
from orbax_flax.format import _manifest
from orbax_flax.core import _multihost
from orbax_flax.core import _progress
from orbax_flax.engine import _selecting
from orbax_flax.core import _tree
from orbax_flax.engine import checkpointer
from orbax_flax import errors
from orbax_flax.training import init_from
from orbax_flax.engine import restoring
from orbax_flax.training import state_items
from orbax_flax.engine import targets
from orbax_flax.format import step_dir
from orbax_flax.formats import orbax_checkpoint
from orbax_flax.core._location import Location
from orbax_flax.manager.config import CheckpointPolicy
from orbax_flax.manager.manager import CheckpointManager
from orbax_flax.tiers.local import LocalTier

log = logging.getLogger("orbax_flax")

DATA_ITEM = "data"  # the item that holds the data iterator's position
META_ITEM = "meta"  # the item that holds the callback's metadata (not state)
# The keys of an orbax_flax.data.ElasticIterator state (named in errors; not imported here).
_ELASTIC_KEYS = ("shard_index", "shard_count", "position", "order", "length")
# How to start the data afresh and keep checkpointing its position, named by the refusals.
RESTART_DATA = "restore_or_init(state, data_iterator=it, restore_data=False)"
# Iterators whose state is a position in the global order, the same on every process (module and
# class name, so that grain is not imported here): grain's ElasticIterator and its iterator.
_GLOBAL_STATE_TYPES = frozenset({
    ("grain._src.python.dataset.elastic_iterator", "ElasticIterator"),
    ("grain._src.python.dataset.elastic_iterator", "_ElasticMapDatasetIterator"),
})


def state_is_global(iterator: Any) -> bool:
  """Whether ``iterator``'s state is a position in the global data order, one for every
  process: it says so (``checkpoint_state_is_global = True``), or it is grain's
  ``ElasticIterator``."""
  return (getattr(iterator, "checkpoint_state_is_global", False) is True
          or any((c.__module__, c.__name__) in _GLOBAL_STATE_TYPES
                 for c in type(iterator).__mro__))


def state_is_elastic(iterator: Any) -> bool:
  """Whether ``iterator`` resumes from every old process's state on any process count
  (``checkpoint_state_is_elastic = True`` and ``set_state_from_shards(states)``)."""
  return getattr(iterator, "checkpoint_state_is_elastic", False) is True


class DataPosition:
  """A data iterator's position, saved with every step and restored on resume.

  The item :data:`DATA_ITEM` holds ``{"processes": [the state of process 0,
  ...], "global": bool}``: every process saves every process's state (one
  small all-gather per save). At a resume:

  * an iterator that sets ``checkpoint_state_is_elastic = True`` (an
    attribute or a property) gets the saved states of *all* old processes, in
    process order, through ``set_state_from_shards(states)``, on any process
    count (same count included): it decides where this process continues
    (:class:`orbax_flax.data.ElasticIterator` does so exactly);
  * an iterator whose ``get_state()`` is the same on every process and means
    a position in the global data order sets ``checkpoint_state_is_global =
    True``; grain's ``grain.experimental.ElasticIterator`` is recognised as
    one. Its state resumes on any process count;
  * any other iterator (a per-process position, e.g. grain's
    ``ShardByJaxProcess``) resumes only on the same process count, and gets
    its own state through ``set_state(state)``.

  With ``restore=False`` (``restore_or_init(..., restore_data=False)``) a
  resume leaves the iterator where it is, so the data starts afresh (after a
  change of dataset that a resume refuses), and its position is still saved
  with every checkpoint: the next resume continues it.

  Args:
    iterator: anything with ``get_state()`` and ``set_state(state)``; the
      state is made of dicts, lists, str, bytes and numbers.
    coordination_key: the run's coordination-service prefix (the manager's).
    timeout_s: how long a save's gathering of every process's state waits
      (the policy's ``coordination_timeout_seconds``).
    restore: whether a resume moves the iterator to the saved position.

  Example:
    >>> class It:
    ...   pos = 3
    ...   def get_state(self): return {"pos": self.pos}
    ...   def set_state(self, s): self.pos = s["pos"]
    >>> data = DataPosition(It(), "doc")
    >>> saved = data.item(7, data.get())
    >>> saved
    {'processes': [{'pos': 3}], 'global': False}
    >>> data.iterator.pos = 0
    >>> data.set(7, saved)
    >>> data.iterator.pos
    3
  """

  def __init__(self, iterator: Any, coordination_key: str,
               timeout_s: float = _multihost.DEFAULT_TIMEOUT_S, restore: bool = True):
    self.iterator, self.restore = iterator, restore
    self._key, self._timeout_s = coordination_key, timeout_s
    self._after: tuple[int, Any] | None = None  # see mark()
    # Gathers so far (every process makes the same): each has a key of its own, since a step
    # may be saved twice in one job (after a rollback), and a rendezvous is complete once.
    self._gathers = 0

  @classmethod
  def of(cls, iterator: Any, coordination_key: str,
         timeout_s: float = _multihost.DEFAULT_TIMEOUT_S,
         restore: bool = True) -> DataPosition | None:
    """The position of ``iterator``; None (with a warning) if it cannot say where it is, or
    cannot be moved back there (``get_state()`` without ``set_state()``, or an elastic one
    without ``set_state_from_shards()``): saved, such a position could not be resumed."""
    if iterator is None:
      return None
    setter = "set_state_from_shards" if state_is_elastic(iterator) else "set_state"
    if callable(getattr(iterator, "get_state", None)) and callable(getattr(iterator, setter,
                                                                           None)):
      return cls(iterator, coordination_key, timeout_s, restore)
    missing = "/".join(f"{m}()" for m in ("get_state", setter)
                       if not callable(getattr(iterator, m, None)))
    log.warning("the data iterator (%s) has no %s: its position is not checkpointed, so a"
                " resumed run restarts it (grain iterators, orbax_flax.data.ElasticIterator"
                " and orbax_flax.Prefetched have get_state()/set_state())",
                type(iterator).__name__, missing)
    return None

  @property
  def is_global(self) -> bool:
    """True if the iterator's state is a global position (see the class docstring)."""
    return state_is_global(self.iterator)

  @property
  def is_elastic(self) -> bool:
    """True if the iterator takes every old process's state (``set_state_from_shards``)."""
    return state_is_elastic(self.iterator)

  def get(self) -> Any:
    """The iterator's state now (the position after the last batch it gave)."""
    return self.iterator.get_state()

  def mark(self, step: int) -> None:
    """Records the position now as where step ``step`` left the data (see :meth:`after`).

    A copy of it: the iterator's next batch must not change it (``get_state()`` may hand
    out its own live dict). Not checked here (see :func:`check_data_state`: milliseconds
    for a large state, every step).
    """
    self._after = None
    self._after = (step, copy.deepcopy(self.get()))

  def marked(self, step: int) -> bool:
    """Whether :meth:`mark` recorded where step ``step`` left the data."""
    return self._after is not None and self._after[0] == step

  def after(self, step: int) -> Any:
    """The position :meth:`mark` recorded for ``step`` (a copy of its own), or None.

    A save after a training error takes it, not :meth:`get`: the failing step
    had already taken its batch, and a resume must not skip that batch.
    """
    return self._after[1] if self.marked(step) else None

  def item(self, step: int, state: Any) -> dict[str, Any]:
    """The item that saves ``state`` (this process's) at ``step``, gathered from every process.

    Raises:
      TypeError: the state holds something other than dicts, lists, str,
        bytes and numbers.
    """
    self._gathers += 1
    states = _multihost.all_gather(f"{self._key}/data/{self._gathers}-{step}", _encode(state),
                                   timeout_s=self._timeout_s, what="gather the data positions")
    return {"processes": [_decode(s) for s in states], "global": self.is_global}

  def set(self, step: int, data: dict[str, Any]) -> None:
    """Moves the iterator to this process's position in ``data`` (step ``step``'s item).

    An elastic iterator gets every process's state (``set_state_from_shards``).
    With ``restore=False`` the iterator stays where it is.

    Raises:
      ValueError: per-process positions saved by another process count, or
        the iterator's ``set_state``/``set_state_from_shards`` raised (chained):
        the error names the step, the item, what saved it and the options.
      TypeError: an elastic iterator without ``set_state_from_shards``.
    """
    if not self.restore:
      log.info("data iterator not restored (restore_data=False): it starts where it is, and its"
               " position is saved with every checkpoint from now on (step %d's is left)", step)
      return
    states = data.get("processes", [])
    me, n = jax.process_index(), jax.process_count()
    if self.is_elastic:
      if not callable(getattr(self.iterator, "set_state_from_shards", None)):
        raise TypeError(f"the data iterator ({type(self.iterator).__name__}) sets"
                        " checkpoint_state_is_elastic = True but has no"
                        " set_state_from_shards(states) method to take every process's state")
      try:
        self.iterator.set_state_from_shards(list(states))
      except Exception as e:  # re-raised, chained, saying what was saved and what to do
        raise self._unrestorable(step, states, e) from e
      log.info("data iterator restored to where step %d stopped (%d saved process state(s) handed"
               " to it on %d process(es))", step, len(states), n)
      return
    is_global = bool(data.get("global")) or self.is_global
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
          f" {len(states)} processes; or start the data afresh, a new data order, and keep"
          f" saving its position: {RESTART_DATA}; or, if get_state() is a position in the global"
          " data order"
          " that is the same on every process, set `checkpoint_state_is_global = True` on the"
          " iterator; or read the data through orbax_flax.data.ElasticIterator, which resumes"
          " exactly on any process count (see docs/training.md).")
    try:
      self.iterator.set_state(mine)
    except Exception as e:  # re-raised, chained, saying what was saved and what to do
      raise self._unrestorable(step, states, e) from e
    log.info("data iterator restored to where step %d stopped", step)

  def _unrestorable(self, step: int, states: list[Any], error: Exception) -> ValueError:
    """The error for saved states that the iterator's ``set_state``/``set_state_from_shards``
    raised ``error`` on: the step, the item, the kind of iterator that saved them, the options."""
    if states and all(isinstance(s, dict) for s in states):
      keys = sorted({str(k) for s in states for k in s})
      elastic = all(all(k in s for k in _ELASTIC_KEYS) for s in states)
      kind = (f"{'an' if elastic else 'another kind of iterator than'}"
              f" orbax_flax.data.ElasticIterator (keys {keys})")
    else:
      kind = f"an iterator whose state is {type(states[0]).__name__ if states else 'missing'}"
    return ValueError(
        f"step {step}'s data position (the checkpoint's item {DATA_ITEM!r}) cannot be restored"
        f" into the data iterator ({type(self.iterator).__name__}): {type(error).__name__}:"
        f" {error}. It was saved by {kind}. Resume with the same kind of iterator; or start the"
        f" data afresh and keep saving its position: {RESTART_DATA}; or pass data_iterator=None"
        " (its position is then not saved).")


class Resume:
  """Finds the step a run continues from and restores it onto the live state.

  Args:
    manager: the run's :class:`CheckpointManager`: its committed steps, the
      restores of them and its coordination key.
    policy: the :class:`CheckpointPolicy` (``allow_lossy_casts``,
      ``on_unreadable_checkpoint``, ``init_from``, ``local_directory``,
      ``coordination_timeout_seconds``).
    local: the run's local tier, or None.
    workdir: the run's workdir, where a run of another library (or the slip
      of a workdir that is a checkpoints directory) is looked for; None: only
      the manager's directory is looked at.
  """

  def __init__(self, manager: CheckpointManager, policy: CheckpointPolicy, *,
               local: LocalTier | None = None, workdir: str | None = None):
    self._manager, self._policy, self._local = manager, policy, local
    self._workdir = workdir
    self._inits = 0  # init_from agreements so far (each has keys of its own)
    self._looks = 0  # resumes looked for so far (each agrees under keys of its own)

  def restore(self, state: Any, data: DataPosition | None = None) -> tuple[Any, int | None]:
    """``(state, step)``: ``state`` restored from the step the run continues from.

    ``state`` is this job's freshly initialised state: its shardings are the
    mesh the step is restored onto. With nothing to resume the step is None
    and the state is returned as it is (or with ``init_from``'s params).
    ``data`` is moved to where the restored step stopped.

    Raises:
      CheckpointCorruptedError: committed steps exist and none restores (or,
        with ``on_unreadable_checkpoint="raise"``, the newest does not).
      TreeMismatchError: the state does not match the checkpoint.
    """
    steps = self._manager.all_steps()

    def look() -> PreviousRun | None:
      """What is refused or continued before anything is read: each process reads the
      directories itself, and one whose storage fails fails the resume on every process."""
      refuse_foreign_steps(self._manager.directory, steps)
      if steps or self._workdir is None:
        return None
      return PreviousRun.find(self._workdir, self._manager.directory,
                              fine_tuning=bool(self._policy.init_from))
    self._looks += 1
    previous = _multihost.together(
        f"{self._manager.coordination_key}/resume-look/{self._looks}", look,
        self._policy.coordination_timeout_seconds,
        what=f"looking for the run to resume in {self._manager.directory}")
    if self._local is not None:
      resumed = self._restore_local(state, data, steps[-1] if steps else None)
      if resumed[1] is not None:
        return resumed
    if not steps:
      if self._policy.init_from:
        if previous is not None:
          log.warning("%s; init_from=%r is set, so this run starts from that instead",
                      previous.description(), self._policy.init_from)
        return self._init_from_together(state), None
      if previous is not None:
        return self._continue(previous, state, data)
      _progress.say("no checkpoint in %s: starting from scratch", self._manager.directory)
      return state, None
    items = state_items.to_items(state)
    step, summary, restored = self._restore_newest(steps, _targets(items), data is not None)
    saved_data = restored.pop(DATA_ITEM, None)
    state = state_items.from_items(state, restored)
    if data is not None:
      if saved_data is None:
        log.warning("step %d holds no data iterator position (it was saved without one); the"
                    " iterator starts where it is", step)
      else:
        data.set(step, saved_data)
    saved_mesh = summary.custom.get("mesh")
    _progress.say("restored step %d (%s) from %s: saved on %s by %d process(es), restored onto %s"
                  " with %d process(es)", step, summary.custom.get("reason"),
                  self._manager.step_path(step), _saved_mesh_text(saved_mesh),
                  summary.process_count, _mesh_text(items), jax.process_count())
    return state, step

  def _restore_local(self, state: Any, data: DataPosition | None,
                     persistent_latest: int | None) -> tuple[Any, int | None]:
    """Resumes from the local tier when it holds a step at least as new as the persistent one."""
    target = _targets(state_items.to_items(state))
    if data is not None:
      target[DATA_ITEM] = None
    newer_than = persistent = None
    if persistent_latest is not None:
      newer_than = persistent_latest - 1
      try:  # a local copy of that step counts only while the step there is the save it copied
        persistent = (persistent_latest, str(self._manager.metadata(persistent_latest).custom
                                             .get("local_copy", "")))
      except (errors.CheckpointNotFoundError, errors.CheckpointCorruptedError) as e:
        log.warning("step %d of the persistent tier cannot be read (%s); its local copy, if"
                    " any, is taken", persistent_latest, e)
    # The target is checked as the persistent tier checks it: a TreeMismatchError is raised.
    options = dict(newer_than=newer_than, timeline=self._manager.recorded_timeline(),
                   persistent=persistent, allow_lossy_casts=self._policy.allow_lossy_casts,
                   persistent_steps=self._manager.all_steps())
    casts: list = []
    try:  # a step saved without a data position restores without one
      got = self._local.restore(target, casts=casts, optional=(DATA_ITEM,), **options)
    except errors.TreeMismatchError as e:
      raise _resume_mismatch(e, self._policy.local_directory) from None
    except (errors.StorageError, TimeoutError) as e:  # the local tier never stops a start
      log.error("local tier: cannot resume from %s (%s); reading the persistent tier",
                self._policy.local_directory, e)
      got = None
    if got is None:
      return state, None
    _log_casts(casts)
    step, restored, where = got
    saved_data = restored.pop(DATA_ITEM, None)
    state = state_items.from_items(state, restored)
    if data is not None and saved_data is not None:
      data.set(step, saved_data)
    _progress.say("restored step %d from the local tier (%s; process %d read %s; the persistent"
                  " tier's latest is %s)", step, self._policy.local_directory,
                  jax.process_index(), where, persistent_latest)
    return state, step

  def _restore_newest(self, steps: list[int], target: dict[str, Any], with_data: bool):
    """(step, summary, items) of the newest step that restores; never silently starts fresh.

    With ``with_data`` the step's :data:`DATA_ITEM` (when it has one) is
    restored in the same restore, as saved. A step whose bytes are damaged or
    missing is reported loudly; with ``on_unreadable_checkpoint="fallback"``
    the next older step is tried. If committed steps exist but none restores,
    this raises.
    """
    manager, failures = self._manager, []
    for step in reversed(steps):
      try:
        # The summary (a few KB at the manifest's start) says which items the step holds;
        # the restore then reads and decodes the whole manifest once.
        summary = restoring.read_summary(Location.parse(manager.step_path(step)))
        recorded = summary.custom.get("step")
        if isinstance(recorded, int) and recorded != step:
          raise errors.CheckpointCorruptedError(
              f"{manager.step_path(step)}: its manifest records step {recorded}, not {step}: a"
              f" copy of step {recorded} under another name (copied or renamed by hand), whose"
              f" state would resume as step {step}. Give it its own name back, or remove it")
        wanted = target
        if with_data and DATA_ITEM in summary.item_bytes:
          wanted = {**target, DATA_ITEM: None}
        casts: list = []
        try:
          restored = manager.restore(step, wanted,
                                     allow_lossy_casts=self._policy.allow_lossy_casts, casts=casts)
        except errors.TreeMismatchError as e:
          raise _resume_mismatch(e, manager.directory,
                                 _weights(manager.step_path(step), target)) from None
        _log_casts(casts)
        error = None
      except (errors.CheckpointCorruptedError, errors.CheckpointNotFoundError) as e:
        error = e
      except BaseException as e:  # pylint: disable=broad-except  # every process learns it first
        if jax.process_count() > 1:
          self._tell_the_others(step, e)
        raise
      if jax.process_count() > 1:  # every process resumes from the same step, or none does
        votes = _multihost.all_gather(f"{manager.coordination_key}/resume/{step}",
                                      "ok" if error is None else f"{type(error).__name__}: {error}",
                                      timeout_s=self._policy.coordination_timeout_seconds,
                                      what=f"restore step {step}")
        stopped = [(p, v[len(_STOPPED):]) for p, v in enumerate(votes) if v.startswith(_STOPPED)]
        if stopped:
          raise _failed_elsewhere(f"resuming from step {step} of {manager.directory}", stopped)
        bad = [f"process {p}: {v}" for p, v in enumerate(votes) if v != "ok"]
        if bad and error is None:
          error = errors.CheckpointCorruptedError("; ".join(bad))
      if error is None:
        _warn_left_out(step, set(summary.item_bytes) - set(wanted) - {DATA_ITEM, META_ITEM})
        return step, summary, restored
      failures.append(f"step {step}: {error}")
      log.error("CANNOT RESUME FROM STEP %d of %s: %s", step, manager.directory, error)
      if self._policy.on_unreadable_checkpoint == "raise":
        raise error
      older = [s for s in steps if s < step]
      if older:
        log.error("falling back to the next older committed step, %d; `python -m orbax_flax"
                  " verify %s` tells what is damaged", older[-1], manager.step_path(step))
    raise errors.CheckpointCorruptedError(
        f"{len(steps)} committed step(s) in {manager.directory}, and none of them restores;"
        " refusing to start from scratch over them. Move the directory away to start fresh, or"
        " repair it:\n  " + "\n  ".join(failures))

  def _tell_the_others(self, step: int, error: BaseException) -> None:
    """Votes ``error`` (not damage: it stops the resume) without waiting for the others' votes.

    Every other process finds it at the vote and raises the same kind of error
    (:func:`_failed_elsewhere`), rather than wait there for this process until
    the coordination timeout.
    """
    try:
      _multihost.arrive(f"{self._manager.coordination_key}/resume/{step}",
                        f"{_STOPPED}{type(error).__name__}: {error}",
                        timeout_s=self._policy.coordination_timeout_seconds)
    except _multihost.CoordinationTimeoutError as e:
      error.add_note(f"orbax_flax: the other processes could not be told: {e}")

  def _init_from_together(self, state: Any) -> Any:
    """:meth:`_init_from` on every process of the job from one checkpoint, or on none.

    Process 0 resolves ``init_from`` (a run's latest step may change while the processes
    look: each would take another step, and the params would mix two checkpoints), and
    the processes then vote: one that failed (the checkpoint missing on its host, a
    mismatch) makes every process raise at once, instead of the others training on into
    their first collective, to be aborted minutes later by the coordination service.
    """
    if jax.process_count() == 1:
      return self._init_from(state, None)
    self._inits += 1
    key = f"{self._manager.coordination_key}/init_from/{self._inits}"
    timeout_s, text = self._policy.coordination_timeout_seconds, self._policy.init_from
    word, failed = None, None
    if jax.process_index() == 0:
      try:
        word = str(init_from.source_of(text))
      except Exception as e:  # pylint: disable=broad-except  # raised once the others know
        failed, word = e, f"{_STOPPED}{type(e).__name__}: {e}"
    word = _multihost.broadcast(f"{key}/source", word, timeout_s)
    if failed is not None:
      raise failed
    what = f"init_from={text!r}"
    if word.startswith(_STOPPED):
      raise _failed_elsewhere(what, [(0, word[len(_STOPPED):])])
    try:
      state = self._init_from(state, Location.parse(word))
    except BaseException as e:
      try:  # the others learn it at the vote, at once
        _multihost.arrive(f"{key}/taken", f"{_STOPPED}{type(e).__name__}: {e}",
                          timeout_s=timeout_s)
      except _multihost.CoordinationTimeoutError as told:
        e.add_note(f"orbax_flax: the other processes could not be told: {told}")
      raise
    votes = _multihost.all_gather(f"{key}/taken", "ok", timeout_s, what=f"take {what}")
    stopped = [(p, v[len(_STOPPED):]) for p, v in enumerate(votes) if v.startswith(_STOPPED)]
    if stopped:
      raise _failed_elsewhere(what, stopped)
    return state

  def _init_from(self, state: Any, source: Location | None) -> Any:
    items = state_items.to_items(state)
    text = self._policy.init_from
    if init_from.several(text):
      return self._init_parts(state, items, source, text)
    name = "params" if "params" in items else "state"
    if name == "state" and isinstance(items["state"], Mapping) and "params" in items["state"]:
      # A plain pytree with params (and an optimizer state, a step): its params are taken,
      # as from a TrainState, not the donor's optimizer state and step counter too.
      source = source or init_from.source_of(text)  # (resolved once: read below as well)
      params = init_from.params_part(text, source)
      if params is not None:
        return self._init_parts(state, items, source, params)
    target = _targets({name: items[name]})[name]
    # An NNX model's other variables (batch stats): taken too from a model saved whole.
    nnx_vars = state_items.kind(state) == "nnx" and jax.tree.leaves(items.get("train_state"))
    variables = _targets({"v": items["train_state"]})["v"] if nnx_vars else None
    p = self._policy  # a restore like any other: the run's watchdog, progress and memory budget
    casts: list = []  # the dtype changes made (allow_lossy_casts), logged as a resume logs them
    with checkpointer.Checkpointer(max_host_bytes=p.max_host_bytes,
                                   coordination_timeout_seconds=p.coordination_timeout_seconds,
                                   coordination_key=f"{self._manager.coordination_key}/init_from",
                                   watchdog_seconds=p.watchdog_seconds) as ckptr:
      items[name], taken, source = init_from.load(
          p.init_from, name, target, ckptr, allow_lossy_casts=p.allow_lossy_casts, casts=casts,
          variables=variables, source=source)
    if taken is not None:
      items["train_state"] = taken
      name += " and the model's other non-RNG variables"
    _log_casts(casts, "init_from")
    _progress.say("initialised %s from %s (fine-tuning; nothing to resume in %s)", name, source,
                  self._manager.directory)
    return state_items.from_items(state, items)

  def _init_parts(self, state: Any, items: dict[str, Any], source: Location | None,
                  text: str) -> Any:
    """``init_from=text`` naming several parts (params and batch_stats), or one put elsewhere
    (``dst=src``): each into its place."""
    p, casts = self._policy, []
    with checkpointer.Checkpointer(max_host_bytes=p.max_host_bytes,
                                   coordination_timeout_seconds=p.coordination_timeout_seconds,
                                   coordination_key=f"{self._manager.coordination_key}/init_from",
                                   watchdog_seconds=p.watchdog_seconds) as ckptr:
      parts, source = init_from.load_parts(text, _targets(items), ckptr,
                                           allow_lossy_casts=p.allow_lossy_casts, casts=casts,
                                           source=source)
    _log_casts(casts, "init_from")
    for dst, value in parts.items():
      items[dst[0]] = _selecting.put(items[dst[0]], dst[1:], value)
    _progress.say("initialised %s from %s (fine-tuning; nothing to resume in %s)",
                  ", ".join("/".join(d) for d in parts), source, self._manager.directory)
    return state_items.from_items(state, items)

  def _continue(self, previous: PreviousRun, state: Any,
                data: DataPosition | None) -> tuple[Any, int]:
    """Continues another library's run: its newest step, the whole state, onto this mesh."""
    if state_items.kind(state) == "nnx":
      raise previous.refusal("this job's state is made of NNX objects, which orbax_flax does"
                             " not map onto another library's layout")
    target = targets.of_arrays(state)
    p = self._policy
    with checkpointer.Checkpointer(max_host_bytes=p.max_host_bytes,
                                   coordination_timeout_seconds=p.coordination_timeout_seconds,
                                   coordination_key=f"{self._manager.coordination_key}/previous",
                                   watchdog_seconds=p.watchdog_seconds) as ckptr:
      try:
        item = previous.item()
        casts: list = []
        restored = ckptr.restore(previous.path, {item: target}, casts=casts,
                                 allow_lossy_casts=p.allow_lossy_casts)[item]
      except errors.TreeMismatchError as e:
        raise previous.refusal("its state does not match this job's:\n  " + "\n  ".join(
            e.differences[:8]) + ("\n  ..." if len(e.differences) > 8 else "")) from None
    _log_casts(casts)
    log.warning("%s: continuing it from step %d (the whole state: params, optimizer state and step"
                " alike), restored onto %s; this run's checkpoints go to %s%s",
                previous.description(), previous.step, _mesh_text(target), self._manager.directory,
                "" if data is None else "; the data iterator starts where it is (that run saved"
                " no position orbax_flax reads)")
    return restored, previous.step


_STOPPED = "stopped: "  # a resume vote: this process raised (not damage that falls back)


def _failed_elsewhere(what: str, stopped: list[tuple[int, str]]) -> Exception:
  """What a process raises when others raised doing ``what`` (restoring a step, taking
  ``init_from``): the kind of the first one's error (an orbax_flax error or a builtin; else
  RuntimeError), naming each process."""
  text = (f"{what} failed on another process, so every process stops here: "
          + "; ".join(f"process {p}: {v}" for p, v in stopped))
  kind = stopped[0][1].split(":", 1)[0]
  cls = getattr(errors, kind, None) or getattr(builtins, kind, None)
  if cls is errors.TreeMismatchError:
    return errors.TreeMismatchError(text, [])
  if isinstance(cls, type) and issubclass(cls, Exception):
    try:
      return cls(text)
    except Exception:  # pylint: disable=broad-except  # a constructor that wants more
      pass
  return RuntimeError(text)


def _warn_left_out(step: int, items: set[str]) -> None:
  """Says which saved parts of the state a resume did not restore (the state has none of them)."""
  if not items:
    return
  what = ", ".join(sorted(items))
  log.warning(
      "resume: step %d holds state item(s) %s, which the state passed to restore_or_init has no"
      " part for, so they are not restored (e.g. a tuple state saved with more members, or a"
      " TrainState saved with an rng field). If the run still needs them, pass the state as it"
      " was saved; `python -m orbax_flax show <step dir>` lists what each item holds.", step, what)


def _targets(items: dict[str, Any]) -> dict[str, Any]:
  """Restore targets: the shapes, dtypes and shardings of the live state."""
  return {k: targets.of_arrays(v) for k, v in items.items()}


def _log_casts(casts: list, what: str = "resume") -> None:
  for line in targets.cast_lines(casts):  # one line per kind of change, not one per leaf
    log.warning("%s: %s", what, line)


def _weights(step_path: str, target: Mapping[str, Any]) -> str:
  """The ``init_from`` that takes a step's parameters into this state (``target``: its items):
  the item ``params`` (a TrainState, NNX), or a plain state's ``params`` subtree."""
  if "params" in target:
    return f"{step_path}:params"
  state = target.get("state")
  if isinstance(state, Mapping) and "params" in state:
    return f"{step_path}:state/params=state/params"
  return f"{step_path}:state/<the subtree to keep>"


def _resume_mismatch(e: errors.TreeMismatchError, directory: Any,
                     weights: str = "<step dir>:params") -> errors.TreeMismatchError:
  """The mismatch, with the advice a resume can follow (the callback has no ``partial``);
  ``weights``: the ``init_from`` of the step's parameters, where the step is known."""
  kinds = " ".join(e.differences)
  n = targets.replicated_axis(e.differences)
  if n is not None:
    return errors.TreeMismatchError(
        f"{e.summary}\nFix: restore them into the replicated state,"
        f" restore_or_init(flax.jax_utils.replicate(state)) (every array with its leading axis"
        f" of {n}), and pass flax.jax_utils.unreplicate(state) to on_step_end from then on.",
        e.differences, summary=e.summary)
  advice = []
  if "loses information" in kinds:
    advice.append("to convert anyway, set CheckpointPolicy(allow_lossy_casts=True)"
                  " (--config.checkpoint.allow_lossy_casts=True); or keep the saved dtypes")
  if "not in target" in kinds or "not in checkpoint" in kinds or "shape" in kinds:
    advice.append(f"if {directory} belongs to another run or model, give this run its own"
                  " --workdir; to start a changed model or optimizer from this run's weights,"
                  f" use a new workdir with CheckpointPolicy(init_from={weights!r})"
                  f" (--config.checkpoint.init_from={weights})")
  text = "Fix: " + "; ".join(advice) if advice else ""
  return errors.TreeMismatchError(f"{e.summary}\n{text}".rstrip(), e.differences, summary=e.summary)


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


def _encode(value: Any) -> str:
  """A data iterator state (dicts, lists, str, bytes, numbers) as one JSON string."""
  try:
    structure, leaves = _tree.encode_structure(value)
  except ValueError as e:  # jax sorts each dict's keys: mixed kinds (str and int) do not sort
    mixed = _mixed_keys(value)
    if mixed is None:
      raise
    raise TypeError(f"data iterator state dict {mixed} has keys of several types"
                    " (e.g. str and int), which cannot be ordered; get_state() must return"
                    " dicts whose keys are all str or all int") from e
  for path, leaf, kind in leaves:
    if kind != "value":
      raise TypeError(f"data iterator state leaf {_tree.path_str(path)} is a {type(leaf).__name__};"
                      " get_state() must return dicts, lists, str, bytes and numbers")
  return json.dumps({"s": structure, "v": [_tree.encode_value(l) for _, l, _ in leaves]})


def _mixed_keys(value: Any, where: str = "at the top") -> str | None:
  """Where in ``value`` a dict's keys are of several types, or None."""
  if isinstance(value, dict):
    if len({type(k) for k in value}) > 1:
      return where
    items = value.items()
  elif isinstance(value, (list, tuple)):
    items = enumerate(value)
  else:
    return None
  for k, v in items:
    found = _mixed_keys(v, f"at {k}" if where == "at the top" else f"{where}/{k}")
    if found is not None:
      return found
  return None


def check_data_state(value: Any) -> None:
  """Raises the TypeError a save of the data iterator state ``value`` would raise.

  Example:
    >>> check_data_state({"pos": 3, "files": ["a", "b"]})
    >>> import numpy as np
    >>> check_data_state({"rng": np.zeros(2)})
    Traceback (most recent call last):
    ...
    TypeError: data iterator state leaf rng is a ndarray; get_state() must return dicts, lists, str, bytes and numbers
    >>> check_data_state({"shards": {"a": 1, 2: 3}})
    Traceback (most recent call last):
    ...
    TypeError: data iterator state dict at shards has keys of several types (e.g. str and int), which cannot be ordered; get_state() must return dicts whose keys are all str or all int
  """
  _encode(value)


def _decode(text: str) -> Any:
  d = json.loads(text)
  return _tree.decode_structure(d["s"], [_tree.decode_value(v) for v in d["v"]])


# ---------------------------------------------------------------- the restart
# A restart in the least time. What a preempted job loses is the whole restart, from process
# start to its first train step done on the restored state, and the restore is often the
# smallest part of it (start-up and compiling the train step again are the rest). Three pieces
# shorten and measure it; CheckpointCallback uses them:
#
# * enable_compilation_cache points JAX's persistent compilation cache at
#   <workdir>/compilation_cache/<key>/, the key naming the JAX version, the backend, the device
#   kind and the device and process counts, so that a restarted job loads its compiled train
#   step instead of compiling it, and a run on another mesh or JAX version never reads
#   another's programs (JAX's own cache key also covers the program and its shardings).
# * PendingRestore runs a restore on a thread while the caller compiles its train step, so a
#   cold restart costs about max(restore, compile).
# * RestartClock times the restart's parts: process start to the restore's start (imports,
#   JAX start-up, model init), the restore, and the first train step (compile and run), with
#   the compile cache's hits.

CACHE_DIR = "compilation_cache"  # under the workdir


def compilation_cache_dir(workdir: str) -> str:
  """Where :func:`enable_compilation_cache` puts this job's cache under ``workdir``.

  One directory per JAX version, backend, device kind and device and process
  count: programs compiled by one never meet another (JAX would miss on them
  anyway, but its cache directory is also pruned by size, and a run on another
  mesh would evict this one's).

  Example:
    >>> compilation_cache_dir("/runs/a").startswith("/runs/a/compilation_cache/jax-")
    True
  """
  kind = re.sub(r"[^A-Za-z0-9.]+", "_", jax.devices()[0].device_kind).strip("_")
  key = (f"jax-{jax.__version__}-{jax.default_backend()}-{kind}"
         f"-{jax.device_count()}dev-{jax.process_count()}proc")
  return os.path.join(workdir, CACHE_DIR, key)


def enable_compilation_cache(workdir: str) -> str:
  """Points JAX's persistent compilation cache at this job's directory under ``workdir``.

  The setting is process-wide: every program compiled from now on is looked up
  there (and written there, by process 0 only, as JAX does, if it took at least
  ``jax_persistent_cache_min_compile_time_secs`` to compile, 1 s by default).
  A cache directory the user set already (``JAX_COMPILATION_CACHE_DIR`` or
  ``jax.config``) is kept, with a WARNING, and returned; one that an earlier
  run in this process set here (:func:`_set_for_a_run`) is replaced (JAX's
  cache, opened once a process, is reopened at the next compile).

  Returns:
    The cache directory in use.

  Raises:
    ValueError: ``workdir`` is not on a filesystem (an object store URL) and
      the user set no cache directory: JAX's cache is a directory of files.
  """
  loc = Location.parse(workdir)
  path = os.path.abspath(compilation_cache_dir(loc.local_path)) if loc.is_local else None
  current = jax.config.jax_compilation_cache_dir
  if current and os.path.abspath(current) == path:
    return path
  if current and not _set_for_a_run(current):  # the user's: kept, first
    log.warning(
        "compilation_cache=True: JAX's compilation cache is already set to %s (by"
        " JAX_COMPILATION_CACHE_DIR or jax.config); keeping it, not using %s", current,
        path or f"the workdir {workdir} (not on a filesystem)")
    return current
  if path is None:
    raise ValueError(
        f"compilation_cache=True needs a workdir on a filesystem (local, or a shared mount such"
        f" as NFS or GCSFuse), not {workdir!r}: JAX's compilation cache is a directory of files"
        f" that every process reads. Set compilation_cache=False, or point JAX at a filesystem"
        f" cache yourself with the JAX_COMPILATION_CACHE_DIR environment variable (kept, with"
        f" compilation_cache=True or False).")
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  if current:  # an earlier run's, set here: JAX would keep writing there
    _multihost.reset_compilation_cache()
  return path


def _set_for_a_run(current: str) -> bool:
  """Whether JAX's cache directory ``current`` is one :func:`enable_compilation_cache` set for
  a run (an earlier one in this process: a sweep, a notebook), not the user's. JAX's setting
  itself says so, with no record kept here: it is the directory of this process's JAX, backend
  and devices under some workdir, and not the one JAX_COMPILATION_CACHE_DIR names.

  Example:
    >>> _set_for_a_run(compilation_cache_dir("/runs/a")), _set_for_a_run("/my/jax/cache")
    (True, False)
  """
  current = os.path.abspath(current)
  named = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  workdir = os.path.dirname(os.path.dirname(current))
  return (current == os.path.abspath(compilation_cache_dir(workdir))
          and not (named and os.path.abspath(named) == current))


class PendingRestore:
  """A restore running on a thread; :meth:`join` returns its result or raises its error.

  Built by :meth:`orbax_flax.CheckpointCallback.restore_or_init_async`. Until
  :meth:`join` returns, the state and the data iterator passed in belong to
  the restore: compile against their shapes (``train_step.lower(state,
  batch).compile()``), but do not run or donate them.

  Example:
    >>> pending = PendingRestore(lambda: 41 + 1)
    >>> pending.join()
    42
  """

  def __init__(self, run: Callable[[], Any], on_done: Callable[[Any], Any] | None = None,
               clock: RestartClock | None = None):
    self._run, self._on_done, self._clock = run, on_done, clock
    self._result: Any = None
    self._error: BaseException | None = None
    self._joined = False
    self._closed: str | None = None  # why join() raises (its owner closed before it was joined)
    # Set when the restore has ended: waited on instead of the thread, whose join() a Ctrl-C
    # can leave looking ended while it runs (CPython 3.11/3.12: is_alive() False after a
    # KeyboardInterrupt inside join()), and a retry would then run beside it.
    self._finished = threading.Event()
    self._thread = threading.Thread(target=self._work, name="ofx-restore", daemon=True)
    self._thread.start()

  def _work(self) -> None:
    try:
      self._result = self._run()
      if self._clock is not None:  # when the bytes landed, not when the caller joins
        self._clock.restored()
    except BaseException as e:  # pylint: disable=broad-except  # re-raised by join()
      self._error = e
    finally:
      self._finished.set()

  def done(self) -> bool:
    """Whether the restore has finished (successfully or not)."""
    return self._finished.is_set()

  def error(self) -> BaseException | None:
    """The restore's error, once it has failed (:meth:`join` raises it); else None."""
    return self._error if self._finished.is_set() else None

  def join(self, timeout: float | None = None) -> Any:
    """Waits for the restore and returns the state (the restored one, or the one passed in).

    Args:
      timeout: seconds to wait (None: as long as it takes).

    Raises:
      TimeoutError: the restore did not finish within ``timeout``.
      Exception: the restore's own error, re-raised here.
    """
    if not self._finished.wait(timeout):
      raise TimeoutError(f"the restore is still running after {timeout} s")
    if self._closed is not None:
      raise RuntimeError(self._closed) from self._error
    if self._error is not None:
      self._joined = True  # (its caller has the error)
      raise self._error
    if not self._joined:
      if self._on_done is not None:  # (raises: join() again runs it again)
        self._result = self._on_done(self._result)
      self._joined = True
    return self._result

  def close(self, why: str) -> BaseException | None:
    """Waits for the restore to end (as long as the restore itself takes), then, unless it was
    joined, makes :meth:`join` raise ``RuntimeError(why)``: its owner is closing. Returns the
    restore's error, if it failed and was never joined."""
    self._finished.wait()
    if self._joined:
      return None
    self._closed = why
    return self._error


_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hits",
                 "/jax/compilation_cache/compile_requests_use_cache": "requests"}


# Taken (never released) by the process's first RestartClock.start: only that clock counts
# from the process's start. A later run in the same process (a sweep, a notebook) started long
# after it; its clock counts from its callback's construction. Process-wide, as the start is.
_PROCESS_START = threading.Lock()


class RestartClock:
  """The parts of a start or restart: start-up, restore, first train step.

  ``started`` is where start-up began: the process's start (from ``/proc``;
  None where unknown) for the process's first callback, else that callback's
  construction (``from_process_start`` False: a later run in the same
  process), :meth:`restore_began` and :meth:`restored` bracket the restore, and
  :meth:`first_step_done` ends the clock (the first train step computed).
  The compile cache's hits and misses in between are counted from JAX's
  monitoring events (every compile that asks the cache, and every hit).

  Example:
    >>> clock = RestartClock(started=None, clock=iter([1.0, 3.0, 10.0]).__next__)
    >>> clock.restore_began(); clock.joined(5); clock.first_step_done()
    >>> clock.line()
    'restart from step 5: restore 2.00 s, first train step 7.00 s (compile and run); process start to restore not measured'
    >>> sorted(clock.scalars())
    ['restart/first_step_s', 'restart/restore_s', 'restart/total_s']
  """

  def __init__(self, started: float | None = None, clock: Callable[[], float] = time.time,
               from_process_start: bool = True):
    self._clock = clock
    self.started = started
    self.from_process_start = from_process_start
    self.began: float | None = None
    self.restored_at: float | None = None
    self.joined_at: float | None = None
    self.background = False
    self.step: int | None = None
    self.finished_at: float | None = None
    # Whether the next train step ends the clock (a restore returned, no step seen yet): a
    # plain field, read at every step.
    self.timing_first_step = False
    self.cache_dir: str | None = None
    self.counts = {"hits": 0, "requests": 0}  # misses: requests - hits
    self._listening = False

  @classmethod
  def start(cls, workdir: str, compilation_cache: bool) -> RestartClock:
    """The clock of a callback built now, with the compile cache on if asked: from the
    process's start for the process's first, else from now."""
    if _PROCESS_START.acquire(blocking=False):
      clock = cls(started=process_start_time())
    else:
      clock = cls(started=time.time(), from_process_start=False)
    if compilation_cache:
      clock.cache_dir = enable_compilation_cache(workdir)
    return clock

  def restore_began(self, background: bool = False) -> None:
    """The restore starts (``background``: on a thread, joined later by the caller); a restore
    begun again (a retry) starts the measurement of the restore and first step over."""
    self.began, self.background = self._clock(), background
    self.restored_at = self.joined_at = self.finished_at = self.step = None
    self.timing_first_step = False
    if self.cache_dir is not None and not self._listening:
      jax.monitoring.register_event_listener(self._on_event)
      self._listening = True

  def restored(self) -> None:
    """The restore's bytes landed (a background restore; otherwise :meth:`joined` says it)."""
    self.restored_at = self._clock()

  def joined(self, step: int | None) -> None:
    """The caller has the state, restored from ``step`` (None: nothing to resume)."""
    self.joined_at, self.step = self._clock(), step
    if self.restored_at is None:
      self.restored_at = self.joined_at
    self.timing_first_step = self.finished_at is None

  def first_step_done(self, step: int | None = None, wait_for: Any = None,
                      writer: Any = None) -> None:
    """Ends the clock once ``wait_for`` (the first step's state and metrics) is computed; logs
    :meth:`line` and gives ``writer`` (a clu ``MetricWriter``) the :meth:`scalars` at ``step``."""
    jax.block_until_ready(wait_for)
    self.finished_at = self._clock()
    self.timing_first_step = False
    self._stop_listening()
    if step is None:
      return
    _progress.say("%s", self.line())
    if writer is not None:
      writer.write_scalars(step, self.scalars())

  def _on_event(self, event: str, **kwargs: Any) -> None:
    del kwargs
    name = _CACHE_EVENTS.get(event)
    if name is not None:
      self.counts[name] += 1

  def _stop_listening(self) -> None:
    if self._listening:
      self._listening = False
      try:
        jax.monitoring.unregister_event_listener(self._on_event)
      except (AssertionError, ValueError):  # already gone
        pass

  def close(self) -> None:
    self._stop_listening()

  @property
  def complete(self) -> bool:
    return None not in (self.began, self.restored_at, self.finished_at)

  def parts(self) -> dict[str, float]:
    """Seconds of each part measured: ``startup`` (process start, or for a later run in the
    process its callback's construction, to the restore's start),
    ``restore``, ``joined`` (a background restore: its start to the caller's ``join()``
    returning), ``first_step`` (the caller had the state to the first step computed) and
    ``total``."""
    out = {}
    if self.started is not None and self.began is not None:
      out["startup"] = self.began - self.started
    if self.began is not None and self.restored_at is not None:
      out["restore"] = self.restored_at - self.began
    if self.background and self.joined_at is not None:
      out["joined"] = self.joined_at - self.began  # a background restore: the caller's wait
    if self.joined_at is not None and self.finished_at is not None:
      out["first_step"] = self.finished_at - self.joined_at
    if self.finished_at is not None:
      out["total"] = self.finished_at - (self.started if self.started is not None else self.began)
    return out

  def line(self) -> str:
    """One line for the log, e.g. ``restart from step 50: process start to restore 4.1 s
    (imports, JAX, model init), restore 0.02 s, first train step 3.2 s (compile and run;
    compile cache: 1 hit), 7.3 s in all``."""
    p = self.parts()
    what = f"restart from step {self.step}" if self.step is not None else "start (nothing to resume)"
    bits = []
    if "startup" in p and self.from_process_start:
      bits.append(f"process start to restore {p['startup']:.2f} s (imports, JAX, model init)")
    elif "startup" in p:
      bits.append(f"callback built to restore {p['startup']:.2f} s (a later run in this process:"
                  " timed from its CheckpointCallback, not from process start)")
    bits.append(f"restore {p.get('restore', 0.0):.2f} s" + (
        f" (in the background, joined after {p['joined']:.2f} s)" if "joined" in p else ""))
    cache = ""
    if self.cache_dir is not None:
      hits = self.counts["hits"]
      misses = max(0, self.counts["requests"] - hits)
      cache = (f"; compile cache: {hits} hit{'s' * (hits != 1)}, {misses}"
               f" miss{'es' * (misses != 1)}")
    bits.append(f"first train step {p.get('first_step', 0.0):.2f} s (compile and run{cache})")
    tail = f", {p['total']:.2f} s in all" if "startup" in p else (
        "; process start to restore not measured")
    return f"{what}: " + ", ".join(bits) + tail

  def scalars(self) -> dict[str, float]:
    """The parts as TensorBoard scalars (``restart/startup_s``, ``restart/restore_s``, ...)."""
    out = {f"restart/{k}_s": v for k, v in self.parts().items()}
    if self.cache_dir is not None:
      out["restart/compile_cache_hits"] = float(self.counts["hits"])
    return out


def process_start_time() -> float | None:
  """This process's start, in ``time.time()`` seconds (10 ms resolution); None off Linux.

  Example:
    >>> t = process_start_time()
    >>> t is None or 0 <= time.time() - t < 10 ** 6
    True
  """
  try:
    with open("/proc/self/stat", "rb") as f:
      fields = f.read().rsplit(b")", 1)[1].split()
    with open("/proc/uptime", "rb") as f:
      uptime = float(f.read().split()[0])
    ticks = os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError):
    return None
  age = uptime - int(fields[19]) / ticks  # field 22 (starttime); fields[0] is field 3
  return time.time() - age


# ---------------------------------------------------------------- the workdir
# What a run's workdir holds besides the run's own steps, found before a run starts fresh:
# a new run with nothing of its own to resume must not start from scratch beside checkpoints it
# could have continued (Resume asks here).
#
# * PreviousRun: another library's run in the workdir (an orbax-checkpoint CheckpointManager
#   directory, flax's legacy checkpoint_<N>), which the resume continues;
# * refuse_checkpoints_dir: the slip of passing a run's <workdir>/checkpoints as the workdir;
# * refuse_foreign_steps: an orbax-checkpoint run in the very directory this run's steps
#   would go to.


class PreviousRun(NamedTuple):
  """A run of another library found where a new orbax_flax run starts.

  ``kind`` is ``"orbax-checkpoint"`` (a ``CheckpointManager`` directory of
  numbered steps) or ``"flax"`` (``flax.training.checkpoints``' legacy
  ``checkpoint_<N>``: an orbax pytree directory, or a msgpack file that
  orbax_flax does not read).

  Example:
    >>> import tempfile
    >>> PreviousRun.find(tempfile.mkdtemp(), "/nonexistent/checkpoints") is None
    True
  """
  kind: str
  directory: str   # the directory that holds the steps
  steps: tuple[int, ...]
  path: str        # the newest step's checkpoint

  @property
  def step(self) -> int:
    return self.steps[-1]

  @classmethod
  def find(cls, workdir: str, directory: str, *, fine_tuning: bool = False
           ) -> PreviousRun | None:
    """The other library's run in ``workdir``, ``workdir/checkpoints`` or ``directory``, if any.

    Raises:
      ValueError: ``workdir`` is itself an orbax_flax checkpoints directory (a
        run's ``<workdir>/checkpoints`` passed as the workdir), or, unless
        ``fine_tuning`` (``init_from`` is set: the run starts from that), its
        ``checkpoints`` holds our steps while ``directory`` is elsewhere.
    """
    loc = Location.parse(workdir)
    seen = []
    for candidate in (loc, loc.join("checkpoints"), Location.parse(directory)):
      if candidate in seen or (candidate.is_local and not os.path.isdir(candidate.local_path)):
        continue
      seen.append(candidate)  # (on an object store: one listing of each)
      ocp = orbax_checkpoint.steps(candidate)
      if ocp:
        return cls("orbax-checkpoint", str(candidate), tuple(ocp),
                   str(candidate.join(str(ocp[-1]))))
      legacy = orbax_checkpoint.legacy_steps(candidate)
      if legacy:
        return cls("flax", str(candidate), tuple(s for s, _ in legacy),
                   str(candidate.join(legacy[-1][1])))
    refuse_checkpoints_dir(loc, directory, moved=not fine_tuning)
    return None

  def description(self) -> str:
    what = ("an orbax-checkpoint run" if self.kind == "orbax-checkpoint"
            else "flax.training.checkpoints checkpoints")
    return (f"{self.directory} holds {what} (step(s) {_steps_text(self.steps)}), and nothing"
            " of orbax_flax's")

  def item(self) -> str:
    """The item of the newest step that holds the training state.

    Raises:
      CheckpointFormatError: a flax msgpack file, which orbax_flax does not read.
      TreeMismatchError: a step of several items, none of them ``default`` or ``state``.
    """
    if self._is_file():
      raise self.refusal("its newest step is a flax msgpack file, which orbax_flax does not"
                         " read; restore it with flax.training.checkpoints.restore_checkpoint"
                         " and save that state with ofx.save(..., {'state': state})",
                         errors.CheckpointFormatError)
    names = sorted(orbax_checkpoint.open_checkpoint(Location.parse(self.path)).items)
    item = names[0] if len(names) == 1 else next(
        (n for n in ("default", "state") if n in names), None)
    if item is None:
      raise self.refusal(f"its steps hold the items {names}, and none is 'default' or 'state',"
                         " so the one holding the training state is not known")
    return item

  def _is_file(self) -> bool:
    """Whether the newest step is one file (a flax msgpack checkpoint), not a directory."""
    loc = Location.parse(self.path)
    if loc.is_local:
      return os.path.isfile(loc.local_path)
    return _location.read_key(Location.parse(self.directory), loc.name, max_bytes=1) is not None

  def refusal(self, problem: str, kind: type = errors.TreeMismatchError) -> Exception:
    """The error that refuses to continue this run, with the lines to write instead."""
    text = (f"{self.description()}; it cannot be continued as this job's state: {problem}.\n"
            f"Start from its params instead with --config.checkpoint.init_from={self.path}"
            f" (CheckpointPolicy(init_from={self.path!r}); add :<item>/<sub/tree> to name"
            " another part), or move it away to start from scratch.")
    return kind(text, []) if kind is errors.TreeMismatchError else kind(text)


def _our_steps(loc: Location) -> list[int]:
  """The committed orbax_flax steps directly under ``loc`` (none where it is no directory)."""
  try:
    steps, _ = step_dir.list_steps(loc)
  except (NotADirectoryError, errors.StorageError):
    return []
  return [s for s in steps
          if _location.read_key(loc.join(str(s)), _manifest.MANIFEST_KEY, max_bytes=1) is not None]


def refuse_checkpoints_dir(workdir: Location, directory: str, *, moved: bool = True) -> None:
  """Raises if ``workdir`` itself holds orbax_flax steps (a run's checkpoints directory), or
  (with ``moved``) if ``<workdir>/checkpoints`` does while this run's ``directory`` is
  elsewhere."""
  if Location.parse(directory) == workdir:
    return
  default = workdir.join("checkpoints")
  left = _our_steps(default) if moved and Location.parse(directory) != default else []
  if left:
    raise ValueError(
        f"{default} holds this workdir's run (orbax_flax step(s) {_steps_text(left)}), and"
        f" this run's checkpoint directory is {directory}, which holds none: it would start from"
        f" scratch beside it. To resume step {left[-1]}, keep the directory"
        f" (--config.checkpoint.directory={default}), or move that directory, whole, to"
        f" {directory} first; to start another run, give it its own --workdir.")
  ours = _our_steps(workdir)
  if ours:
    parent = os.path.dirname(str(workdir).rstrip("/"))
    raise ValueError(
        f"workdir={str(workdir)!r} holds orbax_flax checkpoints itself (step(s)"
        f" {_steps_text(ours)}): it is a run's checkpoints directory, and this run would look for"
        f" its steps in {directory}, find none and start from scratch. Pass the run's workdir,"
        f" {parent!r} (--workdir={parent}), to resume step {ours[-1]}; or, to keep the steps"
        f" where they are, set the policy's directory={str(workdir)!r}"
        f" (--config.checkpoint.directory={workdir}).")


def refuse_foreign_steps(directory: str, steps: list[int]) -> None:
  """Raises if ``directory`` holds an orbax-checkpoint run and none of its listed ``steps``
  is ours (a local listing counts that run's steps and any stray step directory beside them;
  an object store's lists only ours, so it is looked at for that run's steps itself)."""
  loc = Location.parse(directory)
  if any(_location.read_key(loc.join(str(s)), _manifest.MANIFEST_KEY, max_bytes=1) is not None
         for s in reversed(steps)):
    return  # (one small read when the newest step is ours, as it is at every resume)
  foreign = orbax_checkpoint.steps(loc)
  if not foreign:
    return  # (a stray step directory beside that run's steps changes nothing)
  elsewhere = loc.sibling("checkpoints_orbax_flax")
  newest = loc.join(str(foreign[-1]))
  raise errors.CheckpointExistsError(
      f"{loc} holds an orbax-checkpoint run (step(s) {_steps_text(foreign)}), and orbax_flax"
      " would write its own steps among that library's. Give this run's checkpoints a directory"
      f" of their own with --config.checkpoint.directory={elsewhere}"
      f" (CheckpointPolicy(directory={str(elsewhere)!r})): the run then continues the"
      f" orbax-checkpoint run from step {foreign[-1]} (the whole state), and leaves its steps as"
      " they are. To take only its params instead:"
      f" --config.checkpoint.directory={elsewhere} --config.checkpoint.init_from={newest}"
      f" (CheckpointPolicy(directory={str(elsewhere)!r}, init_from={str(newest)!r}); both:"
      " init_from alone would still write among that run's steps).")


def _steps_text(steps: Any) -> str:
  steps = list(steps)
  return ", ".join(map(str, steps)) if len(steps) <= 6 else (
      f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-2:]))}")
