"""The commit of a save: the manifest written last, made visible atomically; or the discard.

On a local file system the checkpoint is written to a sibling
``<name>.ofx-tmp-<generation>`` directory (:func:`target`) that is renamed
into place; an overwrite swaps the two directories atomically with
``renameat2``, or, where paths cannot be swapped (NFS), moves the new
databases in and replaces the manifest. On an object store the manifest
``_CHECKPOINT`` is written last; data of other generations under the prefix is
garbage, recognisable because the manifest does not name it. Process 0 calls
these once every process has written its part (:mod:`orbax_flax.engine._save_run`).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from orbax_flax.core import _location
from orbax_flax.format import _manifest
from orbax_flax.engine import _planning
from orbax_flax import errors
from orbax_flax.core._location import Location
from orbax_flax.engine._planning import TMP_MARKER
from orbax_flax.differential import refs

log = logging.getLogger("orbax_flax")


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
