"""The one owner of a directory's steps in a process: what exists, and every change to it.

:class:`StepRegistry` holds what :class:`~orbax_flax.CheckpointManager` knows
about its directory's steps and is the only code that changes them: commits
are recorded here, and every decision that moves, retires or deletes a step
(keep rules, a rollback's abandoned steps, leftover sweeps, the object-store
step index) is applied here, in one order, under one lock (:attr:`lock`, its
:class:`Retention`'s: with differential saves, shared with the checkpointer's
pins, so that choosing a base and deleting it never interleave). The invariant:

  A decision taken earlier (a step doomed by a keep rule or a rollback) is
  re-checked under the lock when it is carried out: a step that a new save
  claimed meanwhile (:meth:`claim`) is not deleted, whatever the deleter
  thread decided before.

The registry changes storage only while its process is the directory's one
writer (:class:`~orbax_flax.manager.leases.WriterLease`): from the first save on, or
for the few seconds of a start-up sweep when no writer is there (none where the
directory does not exist, or where this process may not write: a reader with
read-only access writes nothing). A manager
that only restores and lists (an evaluator's) saves and deletes no step: its
start-up sweep removes only leftovers of interrupted saves. Where steps are
(committed, deleted, their state on disk) is recorded on storage itself by
atomic renames (``<step>`` -> ``<step>.ofx-tmp-delete-...``, ``_CHECKPOINT``
-> ``_RETIRED``): every change is one such step, so a kill at any point leaves
a state the next writer reads back (see :mod:`orbax_flax.format.step_dir`).

A step an evaluator holds a reader lease on is not deleted either: the
deletion follows the protocol of :mod:`orbax_flax.manager.leases`.

:class:`Rollback` (below the registry) is what a restore of an older step
changes: the newer steps belong to an abandoned run, removed through the
registry once this run commits; and the run's timeline id.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence

from orbax_flax.core import _location
from orbax_flax.core import _multihost
from orbax_flax.core import _threads
from orbax_flax import errors
from orbax_flax.manager import leases
from orbax_flax.manager import policy as policy_lib
from orbax_flax.engine import restoring
from orbax_flax.format import step_dir
from orbax_flax.core._location import Location

log = logging.getLogger("orbax_flax")


class Retention:
  """How the registry removes steps; this class is the plain way: a step is deleted whole.

  A strategy has a :attr:`lock` (the registry takes it around every change to the
  steps) and four methods. Where steps may reference each other's bytes (differential
  saves), the manager plugs in :class:`orbax_flax.differential.retention.Referenced`
  instead, which retires a referenced step rather than deleting it.
  """

  def __init__(self):
    self.lock = threading.RLock()

  def before_save(self, root: Location, step: int, committed: list[int], overwrite: bool) -> bool:
    """A manager's save of ``step`` begins (``committed``: the steps now); returns whether it
    still overwrites a committed step."""
    del root, step, committed
    return overwrite

  def after_save(self, root: Location, step: int, committed: bool) -> None:
    """A manager's save of ``step`` ended, ``committed`` or not (nothing to settle, here)."""
    del root, step, committed

  def delete_step(self, root: Location, step: int) -> None:
    """Removes ``step`` (doomed, no longer read)."""
    step_dir.delete_step(root, step)

  def sweep(self, root: Location) -> None:
    """Removes what earlier deletions left on purpose (nothing, here)."""
    del root

def holds_references(root: Location) -> bool:
  """Whether the local directory of steps ``root`` holds differential data: retired data, or
  a committed step that references another (or one whose summary cannot be read, so that
  what it references is unknown). Object stores hold none (differential saves are refused
  there). A plain manager asks when it becomes the writer: from then on only it adds steps.

  Example:
    >>> import tempfile
    >>> holds_references(Location.parse(tempfile.mkdtemp()))
    False
  """
  if not root.is_local:
    return False
  if step_dir.retired_dirs(root.local_path):
    return True
  borrowed = restoring.referenced_generations(root)
  return borrowed is None or bool(borrowed)


class Writes:
  """The steps whose save has started and not yet ended, under one directory.

  Leftover sweeps never touch them (a save below the latest step, after a
  rollback, looks like debris until it commits). Saves of other jobs are never
  swept: only the directory's one writer sweeps (:mod:`orbax_flax.manager.leases`).
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._steps: set[int] = set()

  def start(self, step: int) -> None:
    with self._lock:
      self._steps.add(step)

  def end(self, step: int) -> None:
    with self._lock:
      self._steps.discard(step)

  def steps(self) -> set[int]:
    with self._lock:
      return set(self._steps)


class StepRegistry:
  """The committed steps of ``directory`` and what may happen to them.

  Args:
    directory: the manager's directory.
    deletes: whether this process deletes (process 0 of a job, which holds the
      writer lease); the others only keep their view of the steps.
    retention: how a step is removed (default: :class:`Retention`, the plain delete).
  """

  def __init__(self, directory: Location, *, deletes: bool = True,
               retention: Retention | None = None):
    self._dir = directory
    self.retention = retention if retention is not None else Retention()
    self.lock = self.retention.lock  # every change to the steps (and a differential base's choice)
    self.writes = Writes()
    self._deletes = deletes
    self._lease = leases.WriterLease(directory) if deletes else None
    self._writer = False  # this process writes (process 0: holds the lease)
    self._lock = threading.Lock()
    self._steps: set[int] = set()
    self._deleting: set[int] = set()  # doomed here, deletion pending (re-checked when done)
    self._reading: dict[int, int] = {}  # steps a restore is reading: never deleted meanwhile
    self._deferred: set[int] = set()    # doomed while being read: deleted once read
    # Doomed, not deleted yet: an evaluator's lease holds them, or deleting them failed (a
    # full disk) or was put off; tried again at the next deletion.
    self._later: set[int] = set()
    self._full = False  # the last deletion failed on a full disk (delete_before_saving)
    # Each reader lease's last written time and when this process first saw it so
    # (leases.leased_steps), under its lock: deletions run one at a time on the deletion
    # thread, but one at the interpreter's exit runs on the caller's.
    self._leases_lock = threading.Lock()
    self._leases_seen: dict[str, tuple[float, float]] = {}
    self._infos: dict[int, policy_lib.StepInfo] = {}
    self._leftovers: list[step_dir.Leftover] = []
    self._unremovable: set[str] = set()  # leftovers a sweep could not remove, said once
    # The directory's rollback records (step_dir.ROLLBACKS), as last read or written here;
    # and, from the last listing, those records as they stand (settled) and the listed steps
    # they abandon. Written only by the writer, under _records_lock.
    self._records_lock = threading.Lock()
    self._records: list[step_dir.RollbackRecord] = []
    self._settled: list[step_dir.RollbackRecord] = []
    self._abandoned: set[int] = set()
    self._deleter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="orbax_flax-delete")
    self._stopping = threading.Event()  # closing after the store stopped answering
    self._deletions: list[concurrent.futures.Future] = []
    self.reload(full=True)  # a step committed but not yet indexed is this job's newest

  def start(self) -> None:
    """At a manager's start, every process of its job there (none writing): reports the
    leftovers and, where this process deletes and no other writer holds the directory,
    sweeps them and repairs the step index (holding the writer lease for that long)."""
    if self._leftovers:
      log.warning("%s holds %d uncommitted save(s), in progress (of another job) or"
                  " interrupted: %s. A save in progress becomes <step> when it commits; a training"
                  " job here removes the interrupted ones (at or below its latest step) itself.",
                  self._dir, len(self._leftovers), ", ".join(l.name for l in self._leftovers[:5]))
    if not self._deletes or self._writer:
      return
    if self._dir.is_local and not os.path.isdir(self._dir.local_path):
      return  # nothing to sweep; and a reader creates nothing
    lease = leases.WriterLease(self._dir, purpose="sweep")
    try:
      lease.acquire(wait_s=0)
    except errors.WriterConflictError:
      log.info("%s: another job writes here; this manager reads and sweeps nothing until it"
               " saves", self._dir)
      return
    except errors.StorageError as e:  # read-only access: a reader changes nothing
      log.info("%s: this process may not write here (%s); the start-up sweep is skipped. This"
               " manager lists and restores; a save would fail the same way.", self._dir, e)
      return
    try:
      self._tidy()
    finally:
      lease.release()

  def use_retention(self, retention: Retention) -> None:
    """Removes steps with ``retention`` from now on; it must share :attr:`lock`."""
    if retention.lock is not self.lock:
      raise ValueError("a registry's retention keeps its lock: build it with registry.lock")
    with self.lock:
      self.retention = retention

  def become_writer(self, *, check_references: bool = False) -> bool:
    """Makes this process the directory's writer (process 0 takes the writer lease), then
    sweeps leftovers and repairs the step index from a full listing taken under the lease.
    The steps a committed rollback abandoned are deleted by :meth:`delete_abandoned`, once the
    caller has chosen the retention that deletes them (:meth:`use_retention`): what is here now
    may reference them.

    Returns whether the directory holds steps that borrow each other's bytes
    (:func:`holds_references`), when ``check_references`` is set on the process that takes
    the lease, read under it (only the writer adds steps); else False. Should anything here
    fail, this process is not the writer (the lease is released).

    Raises:
      WriterConflictError: another live job (or manager) writes the directory.
      StorageError: the storage failed.
    """
    if self._writer:
      if self._lease is not None:
        self._lease.check()
      return False
    referenced = False
    if self._lease is not None:
      self._lease.acquire()
      try:
        self._tidy()
        self._settle_rollbacks()
        referenced = check_references and holds_references(self._dir)
      except BaseException:
        self._lease.release()
        raise
    self._writer = True
    return referenced

  def delete_abandoned(self) -> None:
    """The writer, once its retention is chosen: deletes (through it) the steps a rollback
    abandoned whose run has committed, left by a job stopped before it deleted them."""
    with self._lock:
      abandoned = self._abandoned & self._deleting
    if abandoned:
      log.info("%s: deleting step(s) %s, abandoned by a rollback whose run has committed",
               self._dir, short(sorted(abandoned)))
      self.delete(abandoned)

  @property
  def is_writer(self) -> bool:
    return self._writer

  def _tidy(self) -> None:
    """Under a writer lease: parked steps settled (a killed job's save that was replacing a
    step others borrow from), a dead writer's deletion notices withdrawn, the full listing,
    the sweep, the index made to match."""
    with self.lock:
      back = step_dir.settle_parked(self._dir)
      if back:
        log.warning("%s: step(s) %s are back: a save that was replacing them did not commit"
                    " (the job was stopped)", self._dir, short(back))
      stale = leases.withdraw_stale_notices(self._dir)
      if stale:
        log.info("%s: withdrew the deletion notices of step(s) %s, left by a writer stopped"
                 " while it deleted them", self._dir, short(stale))
      self.reload(full=True)
      self.sweep()
      step_dir.reindex(self._dir, self.committed())
      if self.committed():
        self._forget_first_timeline()

  def _forget_first_timeline(self) -> None:
    """The directory has a committed step: its run's timeline is the steps' from now on
    (:func:`~orbax_flax.format.step_dir.forget_first_timeline`)."""
    try:
      step_dir.forget_first_timeline(self._dir)
    except errors.StorageError as e:  # it only costs a later run its own timeline
      log.warning("%s: removing its first-run timeline key failed (%s); a run started over"
                  " in this directory after its steps are deleted may take this run's"
                  " local-tier steps", self._dir, e)

  # ------------------------------------------------------------------ what there is

  def reload(self, *, full: bool = False) -> None:
    """Re-lists the directory (other jobs may have changed it); ``full``: every key of an
    object store, not its step index (see :mod:`orbax_flax.format.step_dir`). Steps that a
    committed rollback abandoned are not listed (:func:`abandoned_steps`): they are doomed,
    deleted by the directory's writer."""
    steps, leftovers = step_dir.list_steps(self._dir, full=full)
    records = step_dir.read_rollbacks(self._dir)
    abandoned, settled = abandoned_steps(self._dir, steps, records)
    with self._records_lock:
      self._records, self._settled = records, settled
    with self._lock:
      self._abandoned = abandoned
      self._deleting |= abandoned
      self._steps = set(steps) - self._deleting
      self._infos = {s: i for s, i in self._infos.items() if s in self._steps}
      if full or self._dir.is_local:  # an object store's step index names no leftovers
        self._leftovers = leftovers
      self._later &= self._steps | self._deleting

  def committed(self) -> list[int]:
    """Committed steps, ascending."""
    with self._lock:
      return sorted(self._steps)

  def __contains__(self, step: int) -> bool:
    with self._lock:
      return step in self._steps

  def leftovers(self) -> list[step_dir.Leftover]:
    """Debris of interrupted saves still on storage, as last listed."""
    return list(self._leftovers)

  def cached_infos(self) -> dict[int, policy_lib.StepInfo]:
    """The step metadata read so far (nothing is read to answer)."""
    with self._lock:
      return dict(self._infos)

  def info(self, step: int) -> policy_lib.StepInfo:
    """Time, metrics and reason recorded with ``step`` (reads a few KB once)."""
    with self._lock:
      info, known = self._infos.get(step), step in self._steps
    if info is not None:
      return info
    if not known:
      raise self.not_found(step)
    info = info_from_summary(step, restoring.read_summary(self._dir.join(str(step))))
    with self._lock:
      self._infos[step] = info
    return info

  def infos(self) -> list[policy_lib.StepInfo]:
    """The metadata of every committed step (a damaged manifest counts as no metrics)."""
    steps = self.committed()
    missing = [s for s in steps if s not in self._infos]
    if missing:
      _threads.parallel_map(self._info_or_unknown, missing, 1 if self._dir.is_local else 8,
                            name="orbax_flax-infos")
    with self._lock:
      return [self._infos[s] for s in steps if s in self._infos]

  def _info_or_unknown(self, step: int) -> None:
    try:
      self.info(step)
    except errors.CheckpointNotFoundError:
      pass  # deleted meanwhile
    except (errors.CheckpointCorruptedError, ValueError) as e:
      log.warning("step %d: cannot read its metadata (%s); keep rules treat it as having no"
                  " metrics. `python -m orbax_flax verify %s` checks it.", step, e,
                  self._dir.join(str(step)))
      with self._lock:
        self._infos[step] = policy_lib.StepInfo(step, 0.0, {}, "unknown")

  def not_found(self, step: int) -> errors.CheckpointNotFoundError:
    """The error for a step that is not committed here, naming those that are."""
    return errors.CheckpointNotFoundError(
        f"step {step} is not a committed checkpoint in {self._dir}; committed steps:"
        f" {short(self.committed())}")

  # ------------------------------------------------------------------ rollback records

  def _settle_rollbacks(self) -> None:
    """The writer, at its start (under its lease, from the listing taken under it, none of
    its saves started): the records in force are marked committed, those of a run that never
    committed are dropped (its rollback did not happen)."""
    with self._records_lock:
      if self._settled != self._records:
        step_dir.write_rollbacks(self._dir, self._settled)
        self._records = list(self._settled)

  def record_rollback(self, timeline: str, step: int, abandons: Iterable[int]) -> None:
    """A save of ``step`` starts in the run of a rollback (``timeline``) that has not
    committed yet: recorded before anything of it is written, so that its commit alone
    makes the rollback hold (:class:`~orbax_flax.format.step_dir.RollbackRecord`). Only
    where this process deletes (the writer's process 0)."""
    if not self._deletes:
      return
    with self._records_lock:
      old = next((r for r in self._records if r.timeline == timeline), None)
      known = dict(old.abandons) if old else {}
      for s in sorted(set(abandons) - set(known)):  # which save of it: its generation
        generation = generation_of(self._dir, s)
        if generation is not None:
          known[s] = generation
      record = step_dir.RollbackRecord(
          timeline, tuple(sorted({*(old.saves if old else ()), step})), tuple(sorted(known.items())))
      records = [r for r in self._records if r.timeline != timeline] + [record]
      step_dir.write_rollbacks(self._dir, records)
      self._records = records

  def end_rollback(self, timeline: str, *, committed: bool) -> None:
    """The run of the rollback ``timeline`` committed (its record then holds whatever
    happens to its saves), or the rollback was called off (its record goes)."""
    if not self._deletes:
      return
    with self._records_lock:
      records = [dataclasses.replace(r, committed=True) if r.timeline == timeline else r
                 for r in self._records if committed or r.timeline != timeline]
      if records != self._records:
        step_dir.write_rollbacks(self._dir, records)
        self._records = records

  def _prune_rollbacks(self) -> None:
    """Drops the committed records none of whose abandoned steps is still to be deleted
    here or being saved again (then it is on storage as it was until that save commits)."""
    with self._lock:
      pending = self._deleting | self._later | self._deferred | self.writes.steps()
    with self._records_lock:
      records = [r for r in self._records
                 if not r.committed or pending & {s for s, _ in r.abandons}]
      if records != self._records:
        step_dir.write_rollbacks(self._dir, records)
        self._records = records

  # ------------------------------------------------------------------ changes

  def add(self, info: policy_lib.StepInfo, *, dropping: Iterable[int] = ()) -> None:
    """``info.step`` committed; the steps ``dropping`` are uncommitted at the same moment."""
    dropping = set(dropping) - {info.step}
    with self._lock:
      first = not self._steps
      self._steps.add(info.step)
      self._deleting.discard(info.step)
      self._infos[info.step] = info
      self._steps -= dropping
      self._deleting |= dropping
      for step in dropping:
        self._infos.pop(step, None)
    if first and self._deletes:
      self._forget_first_timeline()
    if self._deletes and not self._dir.is_local:
      try:
        step_dir.index(self._dir, info.step)
      except errors.StorageError as e:  # committed all the same: the next start-up indexes it
        log.warning("step %d committed, but entering it in the step index of %s failed: %s."
                    " Listings of other processes miss it until this directory's next manager"
                    " starts.", info.step, self._dir, e)

  @contextlib.contextmanager
  def reading(self, step: int) -> Iterator[None]:
    """Keeps ``step`` from being deleted while the block reads it.

    Raises:
      CheckpointNotFoundError: ``step`` is not committed.
    """
    with self._lock:
      known = step in self._steps
      if known:
        self._reading[step] = self._reading.get(step, 0) + 1
    if not known:
      raise self.not_found(step)
    try:
      yield
    finally:
      with self._lock:
        self._reading[step] -= 1
        late = step in self._deferred and not self._reading[step]
        if late:
          self._deferred.discard(step)
      if late:
        self.delete([step])

  def retain(self, rules: Sequence[policy_lib.KeepRule]) -> list[int]:
    """The committed steps no rule keeps (see :func:`orbax_flax.manager.policy.to_delete`): a
    decision, carried out by :meth:`doom` and :meth:`delete` once the job agrees on it."""
    if not rules:
      return []
    if any(getattr(r, "reads_metadata", True) for r in rules):
      steps = self.infos()
    else:
      steps = [policy_lib.StepInfo(s, 0.0) for s in self.committed()]
    return policy_lib.to_delete(steps, rules)

  def doom(self, steps: Iterable[int]) -> None:
    """Uncommits ``steps`` (the job's decision: the same on every process); deleted by
    :meth:`delete`. A step a save claims meanwhile (:meth:`claim`) is spared."""
    steps = set(steps)
    with self._lock:
      self._steps -= steps
      self._deleting |= steps
      for step in steps:
        self._infos.pop(step, None)

  def claim(self, step: int) -> bool:
    """A save of ``step`` starts: a pending deletion of it is called off (the save replaces
    it). Returns whether storage may hold a checkpoint of ``step`` that the save replaces
    (committed, or doomed and not yet deleted)."""
    with self.lock, self._lock:
      doomed = step in self._deleting
      self._deleting.discard(step)
      self._deferred.discard(step)
      self._later.discard(step)
      return doomed

  def delete(self, steps: Iterable[int]) -> None:
    """Deletes ``steps`` (doomed already) in the background, with the leased ones left
    from earlier, and sweeps leftovers; only where this process deletes.

    Finished deletions are forgotten here (their errors kept for :meth:`wait`), so
    that a long run holds no record per save.
    """
    steps = sorted(steps)
    self._deletions = [f for f in self._deletions if not f.done() or f.exception() is not None]
    with self._records_lock:  # (a committed rollback's record, perhaps to drop now)
      settled = any(r.committed for r in self._records)
    if self._deletes and self._writer and (steps or self._leftovers or self._later or settled):
      try:
        self._deletions.append(self._deleter.submit(self._delete, steps))
      except RuntimeError:  # the interpreter is shutting down (a save ending in an atexit
        done = concurrent.futures.Future()  # hook): no new thread, so here, now
        try:
          self._delete(steps)
          done.set_result(None)
        except Exception as e:  # pylint: disable=broad-except  # raised by wait(), as above
          done.set_exception(e)
        self._deletions.append(done)

  def _delete(self, steps: list[int]) -> None:
    """Deletes ``steps`` unless a restore here or an evaluator's lease still reads them.

    The manager's side of the reader-lease protocol (:mod:`orbax_flax.manager.leases`):
    announce, then read the leases, then uncommit, then withdraw the notice.
    """
    steps = sorted(set(steps) | self._later)
    if self._stopping.is_set():
      return
    if not steps:  # (a rollback whose new run saved every step it abandoned again)
      self._prune_rollbacks()
      self.sweep()
      return
    try:
      self._delete_now(steps)
      self._full = False
    except BaseException as e:
      with self._lock:  # what is still doomed is tried again at the next deletion
        self._later |= set(steps) & self._deleting
      # On a full disk, before the next save (which needs the room these steps hold).
      self._full = leases.disk_full(e)
      e.add_note(f"(of the deletion of step(s) {short(steps)} of {self._dir}, which no keep rule"
                 " keeps: the saves before it committed; the deletion is tried again at the"
                 " next one)")
      raise
    if not self._stopping.is_set():
      self._prune_rollbacks()
      self.sweep()

  def _delete_now(self, steps: list[int]) -> None:
    """One attempt of :meth:`_delete`; a failure leaves no notice behind (nor, where the
    notice could not be written, a half-written one)."""
    announced = time.monotonic()
    try:
      leases.announce_deletion(self._dir, steps)
      with self._leases_lock:
        leased = leases.leased_steps(self._dir, self._leases_seen)
      if time.monotonic() - announced > leases.LEASE_SECONDS / 4:
        # So slow that a reader could take the notices for stale ones: try again later.
        log.warning("reading the reader leases of %s took %.0f s; deleting steps %s at a later"
                    " save", self._dir, time.monotonic() - announced, steps)
        with self._lock:
          self._later |= set(steps)
        return
      for step in steps:
        if self._stopping.is_set():  # closing, the store not answering: the next writer's
          break                      # keep rules delete what is left
        with self.lock:  # the decision is re-checked where it is carried out
          with self._lock:
            if step not in self._deleting:
              continue  # a save of this step claimed it since: it replaces the old one
            if self._reading.get(step):
              self._deferred.add(step)  # a restore is reading it: deleted when it is done
              continue
            if step in leased:  # an evaluator (checkpoints_iterator) is reading it
              if step not in self._later:
                log.info("step %d: not deleted yet, an evaluator holds a reader lease on it; it"
                         " is deleted at a later save", step)
              self._later.add(step)
              continue
            self._later.discard(step)
          if self._lease is not None:
            self._lease.check()
          log.info("deleting checkpoint step %d (no keep rule keeps it)", step)
          self.retention.delete_step(self._dir, step)
          with self._lock:
            self._deleting.discard(step)
    finally:
      # Deleted (uncommitted) or kept: either way readers may look at it again.
      leases.withdraw_deletion(_location.without_retries(self._dir)
                               if self._stopping.is_set() else self._dir, steps)

  # ------------------------------------------------------------------ leftovers

  def sweep(self) -> None:
    """Removes leftovers of steps at or below the latest committed step.

    No job saves those any more: a save in flight is newer than the latest
    committed step, including another job's (an evaluator reading this
    directory must not remove what the trainer is writing). Steps in
    :attr:`writes` are never touched (a save below the latest step, after
    restoring an older one).
    """
    with self.lock:
      committed = self.committed()  # before listing: a step committing meanwhile is not debris
      latest = committed[-1] if committed else None
      _, leftovers = step_dir.list_steps(self._dir, full=True)
      writing = self.writes.steps()
      borrowed = self._borrowed(leftovers)
      kept = []
      for l in leftovers:
        if (l.step is None or l.step in writing or latest is None or l.step > latest
            or not _unborrowed(l, borrowed)):
          kept.append(l)
          continue
        log.info("removing leftover %s of an interrupted save or delete", l.name)
        failed = step_dir.remove(self._dir, l)
        if failed is not None:
          kept.append(l)  # still there: tried again at the next sweep (said once)
          if l.name not in self._unremovable:
            self._unremovable.add(l.name)
            log.warning("could not remove the leftover %s of %s (%s); tried again at each"
                        " sweep. Fix: remove it as its owner (the user who saved it, if"
                        " another), or give this job the permission to.", l.name, self._dir,
                        failed)
      # Retired data only; should its removal fail, what stays is found by the next sweep.
      self.retention.sweep(self._dir)
      # What is left, from the one listing: on an object store a listing reads every key.
      self._leftovers = kept

  def _borrowed(self, leftovers: Sequence[step_dir.Leftover]) -> set[str] | None:
    """The generations that committed steps borrow from (differential bases), read only
    where ``leftovers`` hold a generation inside a committed step; None: not known."""
    if not any(l.generation is not None for l in leftovers):
      return set()
    return restoring.referenced_generations(self._dir)

  @contextlib.contextmanager
  def saving(self, step: int) -> Iterator[None]:
    """Around the start of a save of ``step``: from here on it is in :attr:`writes` (sweeps
    spare it) until ``writes.end(step)``, or until the block raises.

    On an object store, where this process deletes, the leftovers of an
    interrupted save of this very step go first: they lie under its prefix and
    would stay there, unreferenced, inside the new checkpoint.
    """
    self.writes.start(step)
    try:
      if not self._dir.is_local and self._deletes:
        mine = [l for l in self._leftovers if l.step == step]
        borrowed = self._borrowed(mine)
        for l in mine:
          if _unborrowed(l, borrowed):
            log.info("removing leftover %s of an interrupted save of step %d", l.name, step)
            step_dir.remove(self._dir, l)
      yield
    except BaseException:
      self.writes.end(step)
      raise

  def delete_before_saving(self) -> None:
    """Tries the deletions a full disk stopped again, before a save that needs their room
    (after the user freed a little: a deletion needs a few KB). Their error, should they
    fail again, is logged here: the save's own tells the user what it needs."""
    if not self._full:
      return
    self.delete([])
    try:
      self.wait()
    except errors.StorageError as e:
      log.warning("%s", e)

  def wait(self) -> None:
    """Blocks until the deletions asked for so far are done; raises their errors."""
    deletions, self._deletions = self._deletions, []
    for f in deletions:
      f.result()

  def close(self, *, retries: bool = True) -> None:
    """Releases the deleting thread (after the deletions in progress) and the writer lease.

    ``retries=False``: the store stopped answering (the caller's last call at it ran through
    its retries). Deletions not yet begun are dropped (the steps stay, committed, for the
    next writer's keep rules), one in progress stops before its next step, and the lease is
    released with one attempt per request.
    """
    if not retries:
      self._stopping.set()
    self._deleter.shutdown(wait=True, cancel_futures=not retries)
    if self._lease is not None:
      self._lease.release(retries=retries)
    self._writer = False


def _unborrowed(leftover: step_dir.Leftover, borrowed: set[str] | None) -> bool:
  """Whether no committed step may reference the data of ``leftover``: a generation inside a
  committed step stays while one does, or while what they reference is not known (None).
  (Differential saves are refused on object stores, where such generations lie, so a base
  there is a step's own committed generation; this holds whatever wrote the steps.)"""
  return leftover.generation is None or (borrowed is not None
                                         and leftover.generation not in borrowed)


class Rollback:
  """A run's timeline, and what a restore of an older step (a rollback) changes.

  After ``restore()`` of a step older than the latest, the newer steps belong
  to the abandoned run: a save of this run replaces one of them, and they are
  all removed once this run commits its first save, so that "latest" and the
  keep rules see this run only (the directory records that before the commit:
  :meth:`record`). A save above every newer step before that commit calls it off
  (:meth:`call_off_above`: the restore was a look at an older step). The timeline id is recorded with every save
  (``custom["timeline"]``), so that the local tier can tell the steps of this
  timeline from those of one a rollback abandoned: it starts as the timeline
  of the latest committed step ("" with none, or when its summary has no
  timeline); every rollback starts a new one, the same on every
  process (process 0 draws it).

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

  def __init__(self, directory: Location, registry: StepRegistry, key: str,
               timeout_s: float):
    self._dir, self._registry, self._key, self._timeout_s = directory, registry, key, timeout_s
    self._lock = threading.Lock()  # with the registry's commits: one view of both
    self.to: int | None = None     # the step rolled back to, until this run's first commit
    self._abandoned: set[int] = set()
    self._ceiling: int | None = None  # the newest step the waiting rollback abandons (ever)
    self._timeline: str | None = None
    self._count = 0  # rollbacks so far (their coordination keys)
    # Earlier rollbacks whose run still has a save in flight: id -> the steps they abandoned.
    self._earlier: dict[int, set[int]] = {}
    self._timelines: dict[int, str] = {}  # rollback id -> the timeline of its run
    self._saving: int | None = None  # the rollback whose run has started a save

  def active(self) -> bool:
    """Whether a rollback waits for this run's first commit."""
    return self.to is not None

  def run(self) -> int | None:
    """The rollback whose run a save started now belongs to (None: no rollback waits).

    A save records it when it starts; its commit is that run's first only while the same
    rollback still waits (:meth:`committed`). A second rollback while the first run's save is
    in flight abandons that save too, and its commit must not end the second one.
    """
    with self._lock:
      return self._count if self.to is not None else None

  def call_off_above(self, step: int) -> None:
    """A save of a ``step`` above every step the waiting rollback would abandon is about to
    start, the first since the restore (its run has started no save): the restore was no
    rollback but a look at an older step (to evaluate it), and training went on from where
    the run was. The rollback is called off, nothing is abandoned, and the timeline is the
    latest step's again. A save above them after one of its run's own (still in flight) is
    that run going on."""
    with self._lock:
      if (self.to is None or self._ceiling is None or step <= self._ceiling
          or self._saving == self._count):  # its run saves already: this is its next save
        return
      to, newer = self.to, sorted(self._abandoned)
      called_off = self._timelines.get(self._count)
      self.to, self._abandoned = None, set()
      self._timeline = None  # the latest step's again (read when next asked)
    if called_off is not None:
      self._registry.end_rollback(called_off, committed=False)
    log.info("step %d is saved above every step newer than the restored step %d (%s): that"
             " restore was no rollback, nothing is abandoned", step, to, short(newer))

  def record(self, step: int, run: int) -> None:
    """A save of ``step`` starts in the run of rollback ``run`` (:meth:`run`): recorded in the
    directory before anything of it is written (:meth:`StepRegistry.record_rollback`), so
    that its commit alone ends the abandoned run, even if the job is killed before the
    abandoned steps are deleted."""
    with self._lock:
      if run == self._count:
        self._saving = run  # a later save above every abandoned step is this run's next
      abandoned = set(self._abandoned if run == self._count else self._earlier.get(run, ()))
      timeline = self._timelines[run]
    self._registry.record_rollback(timeline, step, abandoned)

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

  def timeline(self, latest_step: Callable[[], int | None], *, recorded: bool = False) -> str:
    """The timeline id (``latest_step``: the newest committed step, asked the first time).

    With ``recorded`` (the local tier asks so), a directory with no committed step has its
    run's timeline in a key of its own (:func:`orbax_flax.format.step_dir.first_timeline`,
    process 0's; every process asks at the same point, a resume): a job that starts over in
    a directory emptied since (``rm -rf workdir``) never takes the local tier's steps of the
    run that was there. Without, it is "" (nothing but the local tier tells timelines apart).
    """
    if self._timeline is None:
      timeline, latest = "", latest_step()
      if latest is None:
        if recorded:
          timeline = _multihost.broadcast(
              f"{self._key}/timeline/0",
              step_dir.first_timeline(self._dir) if _multihost.process_index() == 0 else None,
              self._timeout_s)
      else:
        # The latest step's; if its manifest cannot be read, that of the newest step whose
        # can (the same run's, unless the damaged one was a rollback's first commit).
        older = [s for s in reversed(self._registry.committed()) if s < latest]
        for step in [latest, *older]:
          try:
            summary = restoring.read_summary(self._dir.join(str(step)))
          except (errors.CheckpointNotFoundError, errors.CheckpointCorruptedError) as e:
            log.warning("the timeline of step %d cannot be read (%s); taking that of an older"
                        " step", step, e)
            continue
          timeline = str(summary.custom.get("timeline", ""))
          break
      self._timeline = timeline
    return self._timeline

  def restored(self, step: int, inflight: int | None) -> None:
    """``step`` was restored, ``inflight`` was the last save started (ended or not, its
    commit perhaps not recorded yet): a rollback if newer steps exist.

    A rollback's new timeline is process 0's, so in a multi-process job every process makes
    it (as every process saves); it is agreed on before anything here changes.
    """
    with self._lock:
      drawn = None
      if any(s > step for s in self._registry.committed()):
        drawn = self._count + 1, None
    if drawn is not None:
      drawn = drawn[0], self._draw_timeline(drawn[0], step)
    with self._lock:
      newer = {s for s in self._registry.committed() if s > step}
      # A save of the abandoned run still in flight belongs to it too; so does one of an
      # earlier rollback's run, whatever its number: that run is left as well.
      if newer and inflight is not None and (inflight > step or self.to is not None):
        newer.add(inflight)
      cancelled = not newer and self.to is not None
      # Rollbacks whose run is left before it committed: their records go (:meth:`record`).
      left = [self._count] if self.to is not None else []
      if not newer:
        left += list(self._earlier)
      left = [self._timelines[r] for r in left if r in self._timelines]
      if newer and self.to is not None and inflight is not None:
        # The earlier rollback's run may commit its save in flight after this: that commit
        # still ends the earlier rollback, removing what both abandon (never a step this one
        # keeps: it may have gone back to a step the earlier one abandoned).
        self._earlier[self._count] = self._abandoned & newer
      elif not newer:
        self._earlier.clear()
      # The last restore decides: a restore of the latest step calls off an earlier rollback
      # (looking at an old step, then resuming the newest, abandons nothing).
      self.to, self._abandoned = (step, newer) if newer else (None, set())
      self._ceiling = max(newer) if newer else None
      if newer:
        self._count += 1  # a new run (:meth:`run`), under the lock a save's start reads it by
      count = self._count
    if not newer and inflight is not None and inflight > step:
      log.info("restored step %d, the latest committed in %s; the save of step %d, started"
               " last, has not committed (yet) and becomes the latest if it does: this is no"
               " rollback (to go back, wait_for_save() first, then restore)", step, self._dir,
               inflight)
    for timeline in left:
      self._registry.end_rollback(timeline, committed=False)
    if cancelled:
      self._timeline = None  # the latest step's again (read when next asked)
      log.info("restored step %d, the latest of %s: the earlier rollback is called off, no"
               " step is abandoned", step, self._dir)
    if not newer:
      return
    # (Drawn above unless a save committed a newer step meanwhile.)
    self._timeline = drawn[1] if drawn and drawn[0] == count else self._draw_timeline(count, step)
    with self._lock:
      self._timelines[count] = self._timeline
    log.info("rollback to step %d: new timeline %s (local-tier steps of the old one are"
             " not resumed)", step, self._timeline)
    log.info("restored step %d of %s, older than the latest (%d): saves of this run replace"
             " the newer steps, which are removed once this run commits a save", step,
             self._dir, max(newer))

  def _draw_timeline(self, count: int, step: int) -> str:
    """The timeline of rollback ``count``: process 0's draw, on every process."""
    try:
      return _multihost.broadcast(f"{self._key}/timeline/{count}", uuid.uuid4().hex,
                                  self._timeout_s)
    except _multihost.CoordinationTimeoutError as e:
      raise _multihost.CoordinationTimeoutError(
          f"restore({step}) of {self._dir}, older than its latest step, is a rollback: its new"
          " run's timeline is process 0's, and process 0 did not make the same restore. In a"
          " job of several processes every process restores an older step together (as every"
          " process saves); to look at it on one process, read it without the manager:"
          f" ofx.restore(manager.step_path({step})). Nothing was restored. ({e})",
          e.missing) from e

  def committed(self, info: policy_lib.StepInfo, run: int | None) -> set[int]:
    """Commits ``info.step`` (a save started in ``run``, :meth:`run`) to the registry; returns
    the abandoned steps that go with it."""
    gone: set[int] = set()
    ended = None  # the timeline of the rollback this commit ends
    with self._lock:
      if run is not None and run == self._count and self.to is not None:
        # this run's first commit after the rollback it started in
        gone = self._abandoned - {info.step}
        self.to, self._abandoned = None, set()
        self._earlier.clear()
        ended = self._timelines.get(run)
      else:
        if run is not None and run in self._earlier:  # an earlier rollback's run: its end
          gone = self._earlier.pop(run) - {info.step}
          self._abandoned -= gone
          ended = self._timelines.get(run)
        if self.to is not None and info.step > self.to:
          self._abandoned.add(info.step)  # a save of an abandoned run that was in flight
          self._ceiling = max(self._ceiling or info.step, info.step)
      self._registry.add(info, dropping=gone)
    if ended is not None:
      self._registry.end_rollback(ended, committed=True)
    if gone:
      log.info("rolled back: removing step(s) %s of the abandoned run now that step %d of"
               " this run is committed", sorted(gone), info.step)
    return gone


def abandoned_steps(directory: Location, steps: Iterable[int],
                    records: Sequence[step_dir.RollbackRecord],
                    ) -> tuple[set[int], list[step_dir.RollbackRecord]]:
  """The listed ``steps`` of ``directory`` that a committed rollback abandoned, and the
  rollback ``records`` as they stand.

  Such a step is still on storage (its deletion comes after the rollback's commit, and
  waits for evaluators that read it) but is no step of the directory: "latest", the keep
  rules and a resume follow the new run from the instant it commits. The records as they
  stand: those in force marked ``committed``; those whose run never committed, and those
  none of whose abandoned checkpoints is still on storage, dropped. Reads the manifest
  summary of the records' steps only (none without records).

  Example:
    >>> import tempfile
    >>> abandoned_steps(Location.parse(tempfile.mkdtemp()), [10, 20], [])
    (set(), [])
  """
  steps = set(steps)
  summaries: dict[int, restoring.Summary | None] = {}

  def summary_of(step: int) -> restoring.Summary | None:
    if step not in summaries:
      try:
        summaries[step] = restoring.read_summary(directory.join(str(step)))
      except (errors.CheckpointError, OSError):
        summaries[step] = None  # unreadable
    return summaries[step]

  abandoned, settled = set(), []
  for r in records:
    if not r.committed and not any(
        s in steps and summary_of(s) is not None
        and str(summary_of(s).custom.get("timeline", "")) == r.timeline for s in r.saves):
      continue  # the rollback's run never committed: the run it would abandon goes on
    hidden = {s for s, generation in r.abandons if s in steps and generation == (
        "" if summary_of(s) is None else summary_of(s).generation)}
    if hidden:
      settled.append(dataclasses.replace(r, committed=True))
      abandoned |= hidden
  return abandoned, settled


def visible_steps(directory: Location, steps: Iterable[int]) -> list[int]:
  """``steps`` listed in ``directory`` (by :func:`~orbax_flax.format.step_dir.list_steps`) as
  its manager lists them: without those a committed rollback abandoned. What a reader
  that lists the directory itself (an evaluator, ``init_from``) takes for its steps.

  Example:
    >>> import tempfile
    >>> visible_steps(Location.parse(tempfile.mkdtemp()), [10, 20])
    [10, 20]
  """
  steps = sorted(steps)
  records = step_dir.read_rollbacks(directory)
  if not records:
    return steps
  abandoned, _ = abandoned_steps(directory, steps, records)
  return [s for s in steps if s not in abandoned]


def generation_of(directory: Location, step: int) -> str | None:
  """The generation of the save committed as ``step`` (None: there is none; "": its manifest
  cannot be read)."""
  try:
    return restoring.read_summary(directory.join(str(step))).generation
  except errors.CheckpointNotFoundError:
    return None
  except (errors.CheckpointError, OSError):
    return ""


def info_from_summary(step: int, summary: restoring.Summary) -> policy_lib.StepInfo:
  """A step's :class:`~orbax_flax.manager.policy.StepInfo` from its manifest summary."""
  custom = summary.custom
  # "time" is the manager's clock (injectable); "created" the engine's wall time.
  return policy_lib.StepInfo(step=step, time=float(custom.get("time", summary.created)),
                             metrics=dict(custom.get("metrics", {})),
                             reason=str(custom.get("reason", "unknown")))


def short(steps: list[int]) -> str:
  """A list of steps for a message: whole up to ten, else its ends and length."""
  return str(steps) if len(steps) <= 10 else f"[{steps[0]}, ..., {steps[-1]}] ({len(steps)} steps)"
