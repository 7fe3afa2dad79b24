"""Phase two of a save on one process: write its blocks, agree on the verdict, commit.

:class:`SaveRun` is one save on one process. Its blocks (host data ready, or
made per batch) go into this process's own OCDBT database with tensorstore
(:mod:`orbax_flax.format._tsio`), in batches of about half a second for a save that
may be cancelled, so that a cancellation stops the writing within about a
second; then fsync, then the verdict. With several processes the verdict is
agreed through the coordination service and process 0 commits (:func:`commit`,
below: the manifest written last, made visible atomically; or :func:`discard`);
every process learns the same outcome.

The commit: on a local file system the checkpoint is written to a sibling
``<name>.ofx-tmp-<generation>`` directory (:func:`target`) that is renamed into
place; an overwrite swaps the two directories atomically with ``renameat2``,
or, where paths cannot be swapped (NFS), moves the new databases in and
replaces the manifest. On an object store the manifest ``_CHECKPOINT`` is
written last; data of other generations under the prefix is garbage,
recognisable because the manifest does not name it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence

from orbax_flax.core import _location
from orbax_flax.core import _multihost
from orbax_flax.engine import _planning
from orbax_flax.core import _progress
from orbax_flax.format import _tsio
from orbax_flax import errors
from orbax_flax.core._location import Location
from orbax_flax.engine._planning import Piece
import errno
import shutil
from typing import Any
from orbax_flax.format import _manifest
from orbax_flax.engine._planning import TMP_MARKER
from orbax_flax.differential import refs

log = logging.getLogger("orbax_flax")

# Writes go out in batches of about half a second each (two in flight), so that a
# cancelled save stops writing within about a second.
_FIRST_BATCH_BYTES = 128 << 20
_MIN_BATCH_BYTES = 64 << 20
_MAX_BATCH_BYTES = 4 << 30
_BATCH_SECONDS = 0.5


class SaveHooks:
  """What a save asks, at four points of its background phase, of a plug-in that changes
  what is written; this class is the plain save's answer (write everything, add nothing).

  A differential save plugs in :class:`orbax_flax.differential.differ.Differ`, which has
  the same four methods; :class:`orbax_flax.Checkpointer` chooses, per save.

  * :meth:`agree`: once the generation is agreed (every process);
  * :meth:`select`: per batch about to be written, the pieces to write;
  * :meth:`publish`: every process before it reports its status (several processes);
  * :meth:`complete`: process 0, the manifest before it is written.
  """

  def agree(self, key: str, timeout_s: float) -> None:
    del key, timeout_s

  def select(self, pieces: Sequence[Piece]) -> Sequence[Piece]:
    return pieces

  def publish(self, key: str, error: BaseException | None, timeout_s: float) -> None:
    del key, error, timeout_s

  def complete(self, manifest: dict[str, Any], key: str, timeout_s: float) -> dict[str, Any]:
    del key, timeout_s
    return manifest


PLAIN = SaveHooks()  # the hooks of a plain save (it has no state)


class SaveRun:
  """One save on one process: agree on a generation, write, agree on the verdict, commit.

  The verdict is one key of the coordination service that can be set only
  once (process 0's "commit", or an abort from whichever process gives up
  first), so every process learns the same outcome. A process that stops
  waiting never deletes data another process may still be writing.

  Args:
    plan: the plan of the save.
    key: a coordination-service prefix unique to this save, same on every process.
    timeout_s: the deadline of each call to the coordination service and of each wait
      for another process (coordination_timeout_seconds).
    cancelled: set by ``AsyncSave.cancel()``.

  The keys of a save are deleted by the last process done with them.
  """

  def __init__(self, plan: _planning.Plan, key: str, timeout_s: float,
               cancelled: threading.Event):
    self.plan, self.key, self.timeout_s, self.cancelled = plan, key, timeout_s, cancelled
    self.me, self.nproc = _multihost.process_index(), _multihost.process_count()
    self.gen: str | None = None
    self.target: Location | None = None
    self.writers: dict[str, _tsio.DatabaseWriter] = {}
    self._ctx = None
    self.bytes_written = 0
    self.progress = _progress.Progress(f"save to {plan.loc}", plan.nbytes)
    self.hooks: SaveHooks = PLAIN  # a differential save's Differ, or the plain hooks

  # ---------------------------------------------------------------- writing

  def begin(self) -> None:
    """Agrees on the generation id and creates the temporary directory (process 0)."""
    if self.gen is not None:
      return
    self.progress.phase = "agreeing on the generation" if self.nproc > 1 else "starting"
    final = self.plan.loc
    where = None  # the target, once the generation is known
    if self.me == 0:
      try:
        gen = uuid.uuid4().hex[:16]
        where = target(final, gen)
        if final.is_local:
          try:
            os.makedirs(os.path.dirname(final.local_path), exist_ok=True)
            os.makedirs(where.local_path)
          except OSError as e:
            raise _location.storage_error(final, "creating the checkpoint directory", e) from e
        _multihost.publish(f"{self.key}/gen", gen, timeout_s=self.timeout_s)
      except BaseException as e:
        if not isinstance(e, _multihost.CoordinationTimeoutError):
          _multihost.publish(f"{self.key}/gen", f"error: {e}", timeout_s=self.timeout_s)
        raise
    else:
      gen = _multihost.fetch(f"{self.key}/gen", self.timeout_s,
                             waiting_for=f"process 0 to start the save to {final}", missing=[0])
      if gen.startswith("error: "):
        raise errors.StorageError(f"process 0 could not start the save to {final}: {gen[7:]}")
    self.gen, self.target = gen, where or target(final, gen)
    self._ctx = _tsio.context()
    self.hooks.agree(self.key, self.timeout_s)

  def _writer(self, item: str) -> _tsio.DatabaseWriter:
    db = f"{item}/p{self.me}-{self.gen}"
    if db not in self.writers:
      self.writers[db] = _tsio.DatabaseWriter(self.target, db, self._ctx)
    return self.writers[db]

  def write(self, pieces: Sequence[Piece], materialize: Callable[[Sequence[Piece]], None] | None = None,
            max_batch_bytes: int = 0, cancellable: bool = False) -> None:
    """Writes the pieces (host data ready, or made by ``materialize`` per batch).

    One batch (one commit per database), unless ``max_batch_bytes`` bounds
    it, or ``cancellable``: then batches take about half a second of writing
    each, two in flight, and a cancellation is noticed between them (the
    writing stops within about a second; a little slower overall).
    """
    self.begin()
    self.progress.phase = "writing"
    cap = max_batch_bytes or (_MAX_BATCH_BYTES if cancellable else 1 << 62)
    limit = min(cap, _FIRST_BATCH_BYTES) if cancellable else cap
    pieces = list(pieces)
    sizes = [p.nbytes for p in pieces]
    in_flight: list[tuple[list[Piece], int]] = []  # batches being committed (and their bytes)
    i = 0
    start = time.perf_counter()
    try:
      while i < len(pieces):
        self.check_cancelled()
        batch, size = [], 0
        while i < len(pieces) and (not batch or size + sizes[i] <= limit):
          batch.append(pieces[i])
          size += sizes[i]
          i += 1
        if materialize is not None:
          materialize(batch)
        for p in self.hooks.select(batch):
          a = p.array
          self._writer(a.item).add(a.name, a.shape, a.dtype, a.chunk_shape, p.slices, p.data)
        # Two batches in flight: the next one is issued while this one commits.
        for w in self.writers.values():
          w.flush(depth=2)
        in_flight.append((batch, size))
        if len(in_flight) > 1:  # the oldest batch is committed by now
          self._done(*in_flight.pop(0))
          if cancellable:
            rate = self.bytes_written / max(time.perf_counter() - start, 1e-3)
            limit = int(min(cap, max(_MIN_BATCH_BYTES, rate * _BATCH_SECONDS)))
      for w in self.writers.values():
        w.wait()
    except ValueError as e:
      raise _location.storage_error(self.plan.loc, "writing array data", e) from e
    for batch, size in in_flight:
      self._done(batch, size)

  def _done(self, batch: Sequence[Piece], size: int) -> None:
    """``batch`` (``size`` bytes) is committed: its views or host copies are no longer needed."""
    for p in batch:
      p.data = None
    self.bytes_written += size
    self.progress.add(size)

  def check_cancelled(self) -> None:
    if self.cancelled.is_set():
      raise errors.SaveCancelledError(
          f"save to {self.plan.loc} was cancelled on process {self.me} before it"
          " committed; nothing was committed.")

  def _sync(self) -> None:
    if self.target is None or not self.target.is_local:
      return
    try:
      self._sync_local()
    except OSError as e:
      raise _location.storage_error(self.plan.loc, "syncing the written data to disk", e) from e

  def _sync_local(self) -> None:
    for db in self.writers:
      path = os.path.join(self.target.local_path, db)
      if os.path.isdir(path):
        _location.fsync_tree(path)
    for item in {db.split("/")[0] for db in self.writers}:
      path = os.path.join(self.target.local_path, item)
      if os.path.isdir(path):
        _location.fsync_dir(path)

  # ---------------------------------------------------------------- the verdict

  def finish(self, error: BaseException | None) -> None:
    """Reports this process's result, learns the job's verdict; process 0 commits.

    Raises the local error, or the verdict's error, on every process alike.
    """
    if error is None:
      try:
        self._sync()
      except OSError as e:
        error = e
    if self.nproc == 1:
      if error is None:
        try:
          self.check_cancelled()
          self._commit()
          return
        except BaseException as e:
          error = e
      self._discard()
      raise error
    status = "ok" if error is None else _describe(error)
    self.progress.phase = "waiting for every process to finish writing"
    answered = True
    try:
      self.hooks.publish(self.key, error, self.timeout_s)
      _multihost.arrive(f"{self.key}/status", status, timeout_s=self.timeout_s)
      if self.me != 0:
        self._follow(error)
      else:
        self._lead(error)
    except _multihost.CoordinationTimeoutError as e:
      if e.missing != [0] or self.me == 0:  # only the service's silence is handled here
        raise
      answered = False
      self._unanswered(e, error)
    finally:
      if answered:
        self._leave()

  def _leave(self) -> None:
    """Every key of this save is read: the last process deletes them (cleanup: if the service
    does not answer, they stay, a few bytes, rather than replace the save's outcome)."""
    try:
      _multihost.leave(self.key, timeout_s=self.timeout_s)
    except _multihost.CoordinationTimeoutError as e:
      log.warning("save to %s: its keys stay in the coordination service: %s", self.plan.loc, e)

  def _unanswered(self, e: _multihost.CoordinationTimeoutError,
                  error: BaseException | None) -> None:
    """A call into the coordination service got no answer in time (process 0, its host, is
    stopped or hung): raises this process's verdict without waiting any longer.

    A process that never reported its part written (``error``) knows that
    nothing can commit: process 0 commits only on every process's "ok". One
    that did report it cannot know whether process 0 decided to commit before
    it stopped answering. Either way this process's abort is posted: it reaches
    the service when it answers again, before process 0's decision if that was
    not taken yet, and the others then learn this verdict.
    """
    if error is not None:
      text = (f"save to {self.plan.loc} aborted by process {self.me}: it failed"
              f" ({_describe(error)}) and then {_lower_first(str(e))} Nothing was committed.")
      _multihost.post_claim(f"{self.key}/decision", f"failed: {text}")
      raise errors.StorageError(text) from error
    text = (f"save to {self.plan.loc} aborted by process {self.me}: {_lower_first(str(e))}"
            " This process had written its part: the checkpoint is committed only if process 0"
            " decided so before it stopped answering (`python -m orbax_flax verify"
            f" {self.plan.loc}` tells).")
    _multihost.post_claim(f"{self.key}/decision", f"failed: {text}")
    raise errors.StorageError(text) from e

  def _follow(self, error: BaseException | None) -> None:
    try:
      decision = _multihost.fetch(f"{self.key}/decision", self.timeout_s,
                                  waiting_for="process 0's commit decision", missing=[0])
    except _multihost.CoordinationTimeoutError:
      missing = _multihost.absent(f"{self.key}/status", timeout_s=self.timeout_s)
      who = (f"process(es) {missing} did not finish writing" if missing
             else "process 0 did not decide")
      decision = _multihost.claim(
          f"{self.key}/decision",
          f"failed: save to {self.plan.loc} aborted by process {self.me} after waiting"
          f" {self.timeout_s:g} s (coordination_timeout_seconds): {who}; nothing was committed.",
          timeout_s=self.timeout_s)
    if error is not None:
      if isinstance(error, errors.SaveCancelledError) or decision == "commit":
        raise error
      # The job's verdict, the same on every process; this process's own cause chained.
      raise errors.StorageError(_verdict_text(decision) + f" (on process {self.me}:"
                                f" {type(error).__name__}: {error})") from error
    if decision == "commit":
      try:
        outcome = _multihost.fetch(f"{self.key}/outcome", self.timeout_s,
                                   waiting_for="process 0 to commit", missing=[0])
      except _multihost.CoordinationTimeoutError as e:
        raise errors.StorageError(
            f"process 0 began committing {self.plan.loc} but did not report within"
            f" {self.timeout_s:g} s; the checkpoint may or may not be committed (`python -m"
            " orbax_flax verify` tells).") from e
      if outcome != "ok":
        raise errors.StorageError(outcome)
      return
    _raise_verdict(decision)

  def _lead(self, error: BaseException | None) -> None:
    final = self.plan.loc
    try:
      statuses = _multihost.gather(f"{self.key}/status", self.timeout_s,
                                   what=f"finish writing its part of {final}")
    except _multihost.CoordinationTimeoutError as e:
      decision = _multihost.claim(
          f"{self.key}/decision",
          f"failed: save to {final} aborted by process 0: {e} Nothing was committed; the data"
          " written so far is a leftover, removed by a later save or manager.",
          timeout_s=self.timeout_s)
      # Never delete here: a process that did not report may still be writing.
      if error is not None:
        raise error
      _raise_verdict(decision)
    failed = [(p, s) for p, s in enumerate(statuses) if s != "ok"]
    if not failed and self.cancelled.is_set():  # cancelled after writing, before the decision
      failed = [(0, _CANCELLED)]
    if failed:
      cancelled = [p for p, s in failed if s.startswith(_CANCELLED)]
      if cancelled:
        text = (f"cancelled: save to {final} was cancelled on process"
                f" {', '.join(map(str, cancelled))}; nothing was committed.")
      else:
        text = (f"failed: save to {final} failed, nothing was committed: "
                + "; ".join(f"process {p}: {s}" for p, s in failed))
      decision = _multihost.claim(f"{self.key}/decision", text, timeout_s=self.timeout_s)
    else:
      decision = _multihost.claim(f"{self.key}/decision", "commit", timeout_s=self.timeout_s)
    if decision != "commit":
      self._discard()  # every process reported: nobody writes any more
      if error is not None:
        raise error
      _raise_verdict(decision)
    self.progress.phase = "committing"
    try:
      self._commit()
    except BaseException as e:
      _multihost.publish(f"{self.key}/outcome",
                         f"save to {final} failed on process 0, nothing was committed: {e}",
                         timeout_s=self.timeout_s)
      self._discard()
      raise
    _multihost.publish(f"{self.key}/outcome", "ok", timeout_s=self.timeout_s)

  # ---------------------------------------------------------------- the commit

  def _discard(self) -> None:
    """Removes this save's uncommitted data (only when no process writes any more)."""
    if self.target is not None and self.me == 0:
      discard(self.plan, self.gen, self.nproc)

  def _commit(self) -> None:
    """Process 0: write the manifest last, then make it visible atomically."""
    if self.gen is None:  # nothing to write at all, e.g. only scalars: still a checkpoint
      self.begin()
    commit(self.plan, self.gen, self.nproc,
                       lambda m: self.hooks.complete(m, self.key, self.timeout_s))


_CANCELLED = "cancelled: "  # a status or decision: some process cancelled the save


def _describe(error: BaseException) -> str:
  if isinstance(error, errors.SaveCancelledError):
    return f"{_CANCELLED}{error}"
  return f"error: {type(error).__name__}: {error}"


def _lower_first(text: str) -> str:
  return text[:1].lower() + text[1:]


def _verdict_text(decision: str) -> str:
  return decision.split(": ", 1)[1] if ": " in decision else decision


def _raise_verdict(decision: str) -> None:
  if decision.startswith(_CANCELLED):
    raise errors.SaveCancelledError(decision[len(_CANCELLED):])
  raise errors.StorageError(_verdict_text(decision))


def target(final: Location, gen: str) -> Location:
  """Where data is written: a temporary sibling directory, or in place on object stores."""
  return final.sibling(f"{final.name}{TMP_MARKER}{gen}") if final.is_local else final


def commit(plan: _planning.Plan, gen: str, nproc: int,
           complete: Callable[[dict[str, Any]], dict[str, Any]] = lambda m: m) -> None:
  """Process 0: writes the manifest of generation ``gen`` last, then makes it visible atomically.

  ``complete`` adds what the writing decided (a differential save's references).

  Raises:
    CheckpointExistsError: a checkpoint appeared at the path during the save
      and ``plan.overwrite`` is False (nothing was overwritten).
    StorageError: the storage refused.
  """
  final = plan.loc
  manifest = complete(dict(plan.manifest, generation=gen))
  data = _manifest.encode(manifest)
  if not final.is_local:
    old = _location.read_key(final, _manifest.MANIFEST_KEY)
    if old is not None and not plan.overwrite:
      _delete_generations(final, _databases(manifest["items"], nproc, gen))  # ours
      raise errors.CheckpointExistsError(f"a checkpoint appeared at {final} during the save;"
                                         " nothing was overwritten.")
    _location.write_key(final, _manifest.MANIFEST_KEY, data)
    # Committed. What follows is cleanup: it may fail without undoing the commit.
    if old is not None:
      try:
        previous = _manifest.decode(old, str(final))
        dbs = _databases(previous.items, previous.process_count, previous.generation)
      except (errors.CheckpointCorruptedError, KeyError, ValueError):
        dbs = None  # a damaged old manifest: remove every other generation
      try:
        _delete_generations(final, dbs, keep=gen)
      except errors.StorageError as e:
        log.warning("checkpoint %s committed; removing the previous generation failed: %s",
                    final, e)
    return
  try:
    _commit_local(plan, gen, target(final, gen), data)
  except errors.CheckpointError:
    raise
  except OSError as e:
    raise _location.storage_error(final, "committing the checkpoint", e) from e


def discard(plan: _planning.Plan, gen: str, nproc: int) -> None:
  """Process 0: removes the uncommitted data of generation ``gen`` (only once no process
  writes any more). Never raises: a failure is logged, the data is a leftover."""
  where = target(plan.loc, gen)
  try:
    if where.is_local:
      if os.path.isdir(where.local_path):
        shutil.rmtree(where.local_path, ignore_errors=True)
    else:
      _delete_generations(plan.loc, _databases(plan.manifest["items"], nproc, gen))
  except (OSError, errors.StorageError) as e:
    log.warning("could not remove the data of the failed save to %s: %s", plan.loc, e)


def _commit_local(plan: _planning.Plan, gen: str, target: Location, data: bytes) -> None:
  """The local part of the commit: manifest, fsync, atomic rename (or swap)."""
  final = plan.loc
  # Every writer fsync'd its own files and directories; the manifest and the
  # directory that holds it are the last things made durable before the rename.
  _location.write_local_durably(os.path.join(target.local_path, _manifest.MANIFEST_KEY), data)
  _location.fsync_dir(target.local_path)
  tmp, dst = target.local_path, final.local_path
  committed = os.path.exists(os.path.join(dst, _manifest.MANIFEST_KEY))
  if not committed:
    # Nothing there, or an empty directory (replaced). Whatever appeared at dst
    # since the plan was checked makes the rename fail: it is never replaced.
    try:
      os.rename(tmp, dst)
    except OSError as e:
      if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
        raise
      raise errors.CheckpointExistsError(
          f"{dst} was created by someone else during the save; nothing was overwritten."
          " Choose another path.") from e
    _location.fsync_dir(os.path.dirname(dst))
    return
  if not plan.overwrite:
    raise errors.CheckpointExistsError(f"a checkpoint appeared at {dst} during the save;"
                                       " nothing was overwritten.")
  if _location.exchange(tmp, dst):
    _location.fsync_dir(os.path.dirname(dst))
    _dispose_replaced(final, tmp)  # tmp now holds the old checkpoint
    return
  _replace_in_place(tmp, dst, gen, data)


def _dispose_replaced(final: Location, old: str) -> None:
  """Removes the checkpoint an overwrite replaced, now at ``old``; unless sibling steps
  borrow its data (differential saves): then it is kept as retired data,
  ``<name>.ofx-base-<generation>``, where their references find it (and the manager's
  sweep removes it once nothing borrows from it)."""
  gen = refs.generation_of(old)
  users = refs.borrowers(final, gen) if gen is not None else []
  if not users:
    shutil.rmtree(old, ignore_errors=True)
    return
  aside = os.path.join(os.path.dirname(final.local_path), refs.retired_name(final.name, gen))
  os.rename(os.path.join(old, _manifest.MANIFEST_KEY), os.path.join(old, refs.RETIRED_KEY))
  os.rename(old, aside)
  _location.fsync_dir(os.path.dirname(aside))
  log.info("%s overwritten; its previous data stays as %s: step(s) %s borrow from it",
           final, os.path.basename(aside), ", ".join(users))


def _replace_in_place(tmp: str, dst: str, gen: str, manifest: bytes) -> None:
  """Overwrites a local checkpoint where paths cannot be swapped atomically (NFS).

  The new generation's databases move into the old checkpoint next to the old
  ones (new names: nothing is replaced), then one atomic ``os.replace`` of the
  manifest switches from the old generation to the new. Killed before that, the
  old checkpoint is intact; after it, the new one is complete.
  """
  items = [i for i in os.listdir(tmp) if os.path.isdir(os.path.join(tmp, i))]
  for item in items:
    os.makedirs(os.path.join(dst, item), exist_ok=True)
    for db in os.listdir(os.path.join(tmp, item)):
      os.rename(os.path.join(tmp, item, db), os.path.join(dst, item, db))
    _location.fsync_dir(os.path.join(dst, item))
  staged = os.path.join(dst, f"{_manifest.MANIFEST_KEY}{TMP_MARKER}{gen}")
  _location.write_local_durably(staged, manifest)
  os.replace(staged, os.path.join(dst, _manifest.MANIFEST_KEY))
  _location.fsync_dir(dst)
  # Committed; the rest removes the old generation (and items the new one lacks).
  for item in os.listdir(dst):
    path = os.path.join(dst, item)
    if not os.path.isdir(path):
      continue
    for db in os.listdir(path):
      if not db.endswith(f"-{gen}"):
        shutil.rmtree(os.path.join(path, db), ignore_errors=True)
    if item not in items and not os.listdir(path):
      os.rmdir(path)
  shutil.rmtree(tmp, ignore_errors=True)


def _databases(items: Any, process_count: int, gen: str) -> list[str]:
  """The process databases ``<item>/p<i>-<gen>`` of one generation."""
  return [f"{item}/p{p}-{gen}" for item in items for p in range(process_count)]


def _delete_generations(loc: Location, dbs: Sequence[str] | None, keep: str | None = None) -> None:
  """Deletes the given databases, or (``dbs`` None) every one not of generation ``keep``."""
  if dbs is None:
    found = {"/".join(k.split("/", 2)[:2]) for k in _location.list_keys(loc) if k.count("/") >= 2}
    dbs = [d for d in found if d.split("/")[1].startswith("p") and not d.endswith(f"-{keep}")]
  for db in sorted(dbs):
    _location.delete_prefix(loc, db + "/")
