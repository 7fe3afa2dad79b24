"""Deleting a step that other steps reference: retire it, and sweep what nothing references.

Reference scanning, not counting: a step's data is referenced if a committed
step's summary names its generation in ``bases`` (differential saves record
there every step they borrow from), or a save in flight pinned it
(:class:`.differ.Pins`). Nothing is counted or stored, so no count can go
stale in a crash; each decision reads the summaries (a few KB each) again.

* :func:`delete_step`: an unreferenced step is deleted as before
  (:func:`orbax_flax.format.step_dir.delete_step`); a referenced one is *retired* in
  place: one atomic rename of its ``_CHECKPOINT`` to ``_RETIRED``. It is no
  longer a step (listings skip it), and its bytes never move, so a restore of
  a step that borrows them, running meanwhile, reads on undisturbed.
* :func:`make_room`: before a new save of a step number whose directory holds
  retired data (after a rollback), or replaces a committed step others
  reference, that directory moves aside to ``<step>.ofx-base-<generation>``
  (one rename; references find it there, :func:`.refs.locate_step`). A
  committed step moves aside *parked*, its ``_CHECKPOINT`` kept
  (:func:`orbax_flax.format.step_dir.is_parked`): :meth:`Referenced.after_save`
  retires it once the new save commits, and moves it back if the save fails or
  is cancelled, so that a failed save removes nothing; after a crash the
  directory's next writer does either (:func:`orbax_flax.format.step_dir.settle_parked`).
  In a job of several processes, process 0 moves it only once every process has come to
  the save (none still restores the step or plans its save), and tells them where it went.
* :func:`sweep`: removes retired data whose generation nothing references any
  more (a retired step directory is deleted like a step: renamed to a
  leftover first, so a sweep killed halfway leaves debris the manager removes).
  A step whose summary cannot be read makes the sweep keep everything.

Local directories only; on object stores differential saves are refused, and
deleting a step is the plain delete.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from orbax_flax.core import _location
from orbax_flax.core import _multihost
from orbax_flax import errors
from orbax_flax.engine import restoring
from orbax_flax.format import step_dir
from orbax_flax.core._location import Location
from orbax_flax.differential import differ
from orbax_flax.differential import refs

log = logging.getLogger("orbax_flax")
_FAILED = "failed: "  # process 0's word when it could not make room


def delete_step(root: Location, step: int, pins: differ.Pins) -> None:
  """Deletes ``step``, or retires it if a committed step or a save in flight references it."""
  if not root.is_local:
    step_dir.delete_step(root, step)
    return
  with pins.lock:
    keep = restoring.referenced_generations(root, exclude=step)
    path = os.path.join(root.local_path, str(step))
    gen = refs.generation_of(path) if not os.path.exists(
        os.path.join(path, step_dir.RETIRED_KEY)) else None
    if keep is not None:
      keep |= pins.live()
      if gen is None:  # damaged or gone: keep it only if it holds data something uses
        gen = next((g for g in sorted(keep) if refs.holds_generation(path, g)), None)
      if gen is None or gen not in keep:
        step_dir.delete_step(root, step)
        return
    log.info("step %d of %s: retired, not deleted (%s)", step, root,
             "newer steps reference its data" if keep is not None else
             "another step's summary cannot be read, so what it references is unknown")
    _retire(root, step)


def _retire(root: Location, step: int) -> None:
  """Retires ``step`` in place (its manifest renamed ``_RETIRED``); a step that is a link
  (to a checkpoint outside the directory) is never changed through it: the link itself
  moves aside to ``<step>.ofx-base-<generation>``, where references find it."""
  path = os.path.join(root.local_path, str(step))
  if os.path.islink(path):
    gen = refs.generation_of(path)
    try:
      if gen is None:
        os.unlink(path)
      else:
        os.rename(path, os.path.join(root.local_path, step_dir.retired_name(str(step), gen)))
      _location.fsync_dir(root.local_path)
    except FileNotFoundError:
      return
    except OSError as e:
      raise _location.storage_error(root, f"retiring the linked step {step}", e) from e
    return
  try:
    os.rename(os.path.join(path, "_CHECKPOINT"), os.path.join(path, step_dir.RETIRED_KEY))
    _location.fsync_dir(path)
  except FileNotFoundError:
    return
  except OSError as e:
    raise _location.storage_error(root, f"retiring step {step}", e) from e


class Referenced:
  """The registry's retention where steps may reference each other's bytes.

  The same methods as the plain :class:`orbax_flax.manager.registry.Retention`:
  a referenced step is retired, not deleted (:func:`delete_step`), room is made
  before a save of a step number others reference (:func:`make_room`), and
  :meth:`sweep` removes retired data nothing references any more.

  In a job of several processes, process 0 alone moves a step's directory aside, and only
  once every process has come to the save (a rendezvous through the coordination service,
  each wait within ``timeout_s``): none is still restoring the step or planning the save
  when it moves, and every process then learns where it went before it plans.

  Args:
    setting: the checkpointer's differential setting (its pins, and the base it
      names before each save); None for a manager whose saves are plain, over a
      directory that holds differential steps
      (:func:`orbax_flax.manager.registry.holds_references`).
    lock: with ``setting`` None, the lock to use (the registry's, whose plain
      retention this one replaces).
    key: a prefix in the coordination service for the rendezvous before each save, the
      same on every process (the manager's key and a suffix).
    timeout_s: how long a process waits for the others there (the policy's
      ``coordination_timeout_seconds``).
  """

  def __init__(self, setting: differ.Differential | None, lock: Any = None, *, key: str,
               timeout_s: float):
    self._setting = setting
    self._pins = setting.pins if setting is not None else differ.Pins(lock)
    self.lock = self._pins.lock  # with the pins: choosing a base and deleting never interleave
    self._parked: dict[int, str] = {}  # step -> where it is parked for the save in flight
    self._key, self._timeout_s = key, timeout_s
    self._saves = 0  # rendezvous so far: each save's keys are its own

  def before_save(self, root: Location, step: int, committed: list[int], overwrite: bool) -> bool:
    """Names the base (the latest other committed step) and makes room (:func:`make_room`).
    Returns whether the save still overwrites a committed step."""
    if self._setting is not None:
      base = max((s for s in committed if s != step), default=None)
      self._setting.set_base(None if base is None else root.join(str(base)))
    with self.lock:
      if _multihost.process_count() == 1 or not root.is_local:
        aside = make_room(root, step, self._pins)
      else:
        aside = self._make_room_together(root, step)
      if _multihost.process_index() != 0:
        return overwrite  # process 0 commits; a plan here accepts the path either way
      if aside is not None and step_dir.is_parked(aside):
        self._parked[step] = aside
    return aside is None and overwrite

  def _make_room_together(self, root: Location, step: int) -> str | None:
    """:func:`make_room` in a job of several processes: every process comes to the save of
    ``step`` first; then process 0 makes room and tells the others where the directory went
    (or why it could not move it: then every process raises)."""
    self._saves += 1
    key, timeout_s = f"{self._key}/{self._saves}", self._timeout_s
    _multihost.all_gather(f"{key}/here", "", timeout_s,
                          what=f"come to the save of step {step} (none reads or plans it any"
                               " more, so that process 0 may move its directory aside)")
    aside, word = None, ""
    if _multihost.process_index() == 0:
      try:
        aside = make_room(root, step, self._pins)
      except BaseException as e:
        try:  # the others wait for a word: they raise too
          _multihost.publish(f"{key}/room", f"{_FAILED}{type(e).__name__}: {e}",
                             timeout_s=timeout_s)
        except Exception as told:  # pylint: disable=broad-except  # e is what is raised
          log.warning("could not tell the other processes that the save of step %d did not"
                      " start (%s); they give up after the coordination timeout", step, told)
        raise
      word = aside or ""
    try:
      word = _multihost.broadcast(f"{key}/room", word, timeout_s)
    except BaseException:
      if aside is not None and step_dir.is_parked(aside):  # nobody saves: put the step back
        step_dir.unpark(root.local_path, aside)
      raise
    _multihost.leave(key, timeout_s=timeout_s)
    if word.startswith(_FAILED):
      raise errors.StorageError(f"the save of step {step} of {root} did not start: process 0"
                                f" could not make room for it ({word[len(_FAILED):]}); nothing"
                                " was written.")
    return word or None

  def after_save(self, root: Location, step: int, committed: bool) -> None:
    """The manager's save of ``step`` ended: a step parked for it (:func:`make_room`) is
    retired if the save ``committed``, else moved back, committed as it was before.

    Never raises (the save's own outcome is what the caller reports): should storage refuse,
    the step stays parked, is never swept, and the directory's next writer settles it
    (:func:`orbax_flax.format.step_dir.settle_parked`).
    """
    with self.lock:
      aside = self._parked.pop(step, None)
      if aside is None:
        return
      try:
        if committed:
          step_dir.retire_parked(aside)
        elif step_dir.unpark(root.local_path, aside):
          log.info("the save of step %d of %s did not commit: the step it was to replace is"
                   " back as it was", step, root)
      except OSError as e:
        log.warning("step %d of %s stays parked at %s (%s); the directory's next writer settles"
                    " it", step, root, os.path.basename(aside), e)

  def delete_step(self, root: Location, step: int) -> None:
    delete_step(root, step, self._pins)

  def sweep(self, root: Location) -> None:
    sweep(root, self._pins)


def make_room(root: Location, step: int, pins: differ.Pins) -> str | None:
  """Moves referenced data out of ``<root>/<step>`` before a new save of that step.

  A committed step others reference is *parked*: moved aside whole, its
  ``_CHECKPOINT`` kept, so that it can come back should the new save not commit
  (:meth:`Referenced.after_save`); retired data there moves aside as it is. A
  step that is a link is retired (the link moved aside; nothing is changed through it).
  In a job of several processes only process 0 calls it, once every process has come to
  the save (:meth:`Referenced.before_save`).

  Returns:
    Where the directory went, if it was moved aside (the new save then overwrites
    nothing); None if it stays.
  """
  if not root.is_local:
    return None
  path = os.path.join(root.local_path, str(step))
  with pins.lock:
    committed = os.path.exists(os.path.join(path, "_CHECKPOINT"))
    if committed:
      keep = restoring.referenced_generations(root, exclude=step)
      gen = refs.generation_of_data(path)  # (a damaged manifest: its databases' names say)
      if gen is None or (keep is not None and gen not in keep | pins.live()):
        return None  # nothing references it: the save replaces it as before
      if os.path.islink(path):
        _retire(root, step)  # the link moves aside whole
        return os.path.join(root.local_path, step_dir.retired_name(str(step), gen))
    elif not os.path.exists(os.path.join(path, step_dir.RETIRED_KEY)):
      return None
    gen = refs.generation_of_data(path)
    if gen is None:
      return None
    aside = os.path.join(root.local_path, step_dir.retired_name(str(step), gen))
    log.info("step %d of %s: its %s moves aside to %s for the new save", step, root,
             "checkpoint (others borrow from it)" if committed else "retired data",
             os.path.basename(aside))
    try:
      os.rename(path, aside)
      _location.fsync_dir(root.local_path)
    except OSError as e:
      raise _location.storage_error(root, f"moving the data of step {step} aside", e) from e
    return aside


def sweep(root: Location, pins: differ.Pins) -> list[str]:
  """Removes retired data that no committed step and no save in flight references.

  Returns:
    The names of the directories removed.
  """
  if not root.is_local:
    return []
  retired = {n: (step_dir.parse_retired(n) or (None, None))[1]
             for n in step_dir.retired_dirs(root.local_path)}
  if not retired:
    return []
  removed = []
  with pins.lock:
    keep = restoring.referenced_generations(root)
    if keep is None:
      return []
    keep |= pins.live()
    for name, gen in retired.items():
      path = os.path.join(root.local_path, name)
      if step_dir.is_parked(path):
        continue  # a committed step, parked while a save of its number runs: never swept
      gen = gen or refs.generation_of(path)
      if gen in keep or (gen is None and any(refs.holds_generation(path, g) for g in keep)):
        continue  # (unreadable: kept while it holds data of a generation something uses)
      log.info("removing %s: retired data no step references any more", name)
      if name.isdigit():
        step_dir.delete_step(root, int(name))
      else:
        step_dir.remove_local(path)
      removed.append(name)
  return removed


