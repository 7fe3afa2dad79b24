"""Deleting a step that other steps reference: retire it, and sweep what nothing references.

Reference scanning, not counting: a step's data is referenced if a committed
step's summary names its generation in ``bases`` (differential saves record
there every step they borrow from), or a save in flight pinned it
(:class:`.differ.Pins`). Nothing is counted or stored, so no count can go
stale in a crash; each decision reads the summaries (a few KB each) again.

* :func:`delete_step`: an unreferenced step is deleted as before
  (:func:`orbax_flax.step_dir.delete_step`); a referenced one is *retired*:
  one atomic rename of ``<step>`` to ``<step>.ofx-base-<generation>``. It is
  no longer a step (listings ignore the name), and its bytes stay where the
  references find them (:func:`.refs.locate_step`).
* :func:`sweep`: removes retired data whose generation nothing references any
  more. A sweep interrupted halfway leaves a retired directory that is still
  unreferenced; the next sweep finishes it. A step whose summary cannot be
  read makes the sweep keep everything (what it references is unknown).

Local directories only (a rename is what keeps a retired step's bytes in
place); on object stores differential saves are refused, and deleting a step
is the plain delete.
"""

from __future__ import annotations

import logging
import os
import shutil

from orbax_flax import errors
from orbax_flax import restoring
from orbax_flax import step_dir
from orbax_flax._location import Location
from orbax_flax.differential import differ
from orbax_flax.differential import refs

log = logging.getLogger("orbax_flax")


def referenced(root: Location, steps: list[int], exclude: int | None = None) -> set[str] | None:
  """Generations the committed ``steps`` (but ``exclude``) borrow from; None if one is unreadable."""
  gens: set[str] = set()
  for step in steps:
    if step == exclude:
      continue
    try:
      summary = restoring.read_summary(root.join(str(step)))
    except errors.CheckpointNotFoundError:
      continue  # deleted meanwhile
    except errors.CheckpointError:
      return None
    bases = summary.get(refs.BASES, [])
    if not all(isinstance(b, dict) and isinstance(b.get("generation"), str) for b in bases):
      return None  # a summary only checks that bases is a list: unknown references, keep all
    gens |= {b["generation"] for b in bases}
  return gens


def delete_step(root: Location, step: int, pins: differ.Pins) -> None:
  """Deletes ``step``, or retires it if a committed step or a save in flight references it."""
  if not root.is_local:
    step_dir.delete_step(root, step)
    return
  with pins.lock:
    steps, _ = step_dir.list_steps(root)
    keep = referenced(root, steps, exclude=step)
    keep = None if keep is None else keep | pins.live()
    path = os.path.join(root.local_path, str(step))
    try:
      gen = restoring.read_summary(root.join(str(step)))["generation"]
    except errors.CheckpointNotFoundError:
      return
    except errors.CheckpointError:  # damaged: retire it under any generation it holds that is used
      gen = next((g for g in sorted(keep or ()) if refs.holds_generation(path, g)), None)
      if gen is None and keep is not None:
        step_dir.delete_step(root, step)
        return
    if keep is not None and gen not in keep:
      step_dir.delete_step(root, step)
      return
    if gen is None:
      log.warning("step %d of %s: not deleted, another step's summary cannot be read (what it"
                  " references is unknown)", step, root)
      return
    log.info("step %d: retired to %s (newer steps reference its data)", step,
             refs.retired_name(str(step), gen))
    try:
      os.rename(path, os.path.join(root.local_path, refs.retired_name(str(step), gen)))
    except FileNotFoundError:
      return
    except OSError as e:
      raise errors.StorageError(f"retiring step {step} of {root}: {e}") from e


def sweep(root: Location, pins: differ.Pins) -> list[str]:
  """Removes retired data that no committed step and no save in flight references.

  Returns:
    The names of the directories removed.
  """
  if not root.is_local:
    return []
  try:
    names = [n for n in os.listdir(root.local_path) if refs.parse_retired(n)]
  except FileNotFoundError:
    return []
  if not names:
    return []
  removed = []
  with pins.lock:
    steps, _ = step_dir.list_steps(root)
    keep = referenced(root, steps)
    if keep is None:
      return []
    keep |= pins.live()
    for name in names:
      if refs.parse_retired(name)[1] not in keep:
        log.info("removing %s: retired data no step references any more", name)
        shutil.rmtree(os.path.join(root.local_path, name), ignore_errors=True)
        removed.append(name)
  return removed


def stored_bytes(step: Location) -> dict[str, int]:
  """``bytes_written`` (held by the step itself) and ``bytes_reused`` (referenced) of a step.

  From its summary; a full save holds all its bytes (``item_bytes``).
  """
  summary = restoring.read_summary(step)
  stored = summary.get(refs.STORED_BYTES) or {"own": sum(summary.get("item_bytes", {}).values())}
  return {"bytes_written": stored["own"], "bytes_reused": stored.get("borrowed", 0)}
