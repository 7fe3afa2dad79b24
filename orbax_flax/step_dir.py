"""A directory of steps: which are committed, what is debris, how a step is deleted.

``<directory>/<step>/`` is a committed checkpoint (on a file system the name
appears only by the atomic rename of a finished save; on an object store the
step's ``_CHECKPOINT`` manifest exists). Anything else carrying a step number is
a leftover of an interrupted save or delete.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid

from orbax_flax import _location
from orbax_flax import _manifest
from orbax_flax._location import Location
from orbax_flax._planning import TMP_MARKER


@dataclasses.dataclass(frozen=True)
class Leftover:
  """Debris of an interrupted save or delete: safe to remove when nothing writes it."""
  name: str
  step: int | None


def list_steps(loc: Location) -> tuple[list[int], list[Leftover]]:
  """Committed steps and leftovers under ``loc``, from one listing."""
  steps, leftovers = [], []
  if loc.is_local:
    try:
      names = os.listdir(loc.local_path)
    except FileNotFoundError:
      return [], []
    except NotADirectoryError as e:
      if not os.path.isfile(loc.local_path):  # a parent is a file
        raise _location.storage_error(loc, "listing the steps", e) from e
      raise NotADirectoryError(f"{loc} is a file; checkpoint steps live in a directory: pass"
                               " the directory that holds (or will hold) the steps.") from None
    except OSError as e:
      raise _location.storage_error(loc, "listing the steps", e) from e
    for name in names:
      if _is_step(name) and not os.path.exists(os.path.join(loc.local_path, name, "_RETIRED")):
        steps.append(int(name))  # (_RETIRED: a step retention retired, whose data others use)
      elif TMP_MARKER in name:
        head = name.split(".", 1)[0]
        leftovers.append(Leftover(name, int(head) if _is_step(head) else None))
    return sorted(steps), sorted(leftovers, key=lambda l: l.name)
  keys = _location.list_keys(loc)
  committed, prefixes = set(), set()
  for k in keys:
    head, _, rest = k.partition("/")
    if _is_step(head):
      prefixes.add(head)
      if rest == _manifest.MANIFEST_KEY:
        committed.add(head)
  steps = sorted(int(h) for h in committed)
  leftovers = [Leftover(h + "/", int(h)) for h in sorted(prefixes - committed, key=int)]
  return steps, leftovers


def _is_step(name: str) -> bool:
  return name.isascii() and name.isdigit()


def remove(loc: Location, name: str) -> None:
  """Removes a leftover (a directory or a key prefix) entirely.

  On an object store a prefix whose manifest exists by now (its save committed
  since the listing) is left alone.
  """
  if loc.is_local:
    shutil.rmtree(os.path.join(loc.local_path, name), ignore_errors=True)
  elif _location.read_key(loc.join(name.rstrip("/")), _manifest.MANIFEST_KEY,
                          max_bytes=1) is None:
    _location.delete_prefix(loc, name)


def delete_step(loc: Location, step: int) -> None:
  """Uncommits ``step`` atomically first, then removes its data."""
  name = str(step)
  if loc.is_local:
    doomed = f"{name}{TMP_MARKER}delete-{uuid.uuid4().hex[:8]}"
    try:
      os.rename(os.path.join(loc.local_path, name), os.path.join(loc.local_path, doomed))
    except FileNotFoundError:
      return
    except OSError as e:
      raise _location.storage_error(loc, f"deleting step {step}", e) from e
    shutil.rmtree(os.path.join(loc.local_path, doomed), ignore_errors=True)
    return
  _location.delete_key(loc.join(name), _manifest.MANIFEST_KEY)
  _location.delete_prefix(loc, name + "/")
