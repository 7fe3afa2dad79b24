"""A directory of steps: which are committed, what is debris, how a step is deleted.

``<directory>/<step>/`` is a committed checkpoint when its ``_CHECKPOINT`` manifest
exists (on a file system that name appears with it, by the atomic rename of a finished
save; a local directory of that name without it, or without an orbax-checkpoint step's
commit marker, is no step, and nothing here deletes it: someone's files, a step being
copied in, another manager's directory). Retired data is not a step either: a
step that differential saves still borrow from, deleted by retention, keeps its
data with its manifest renamed ``_RETIRED``, or moved aside to
``<step>.ofx-base-<generation>`` (:func:`retired_name`, :func:`retired_dirs`;
local directories only). A committed step that others borrow from and that a
new save of its number replaces is *parked* there for the save, its
``_CHECKPOINT`` kept: retired once the new save commits, moved back if it does
not (:func:`settle_parked` after a crash). Anything else carrying a step number
is a leftover of an interrupted save or delete (on an object store also a generation
of data inside a committed step that its manifest does not name: an interrupted
overwrite of the step, :class:`Leftover`), except another library's steps:
a step prefix holding a key that only another library writes there
(:data:`FOREIGN_MARKERS`: orbax-checkpoint's commit marker, step metadata and
pytree metadata) is never a leftover of ours, on an object store as on a file
system (where a leftover is always an ``.ofx-tmp-`` name): nothing sweeps or
removes it. On an object store it is not a step either (a step has our
manifest); on a file system a manager lists it, to read it. A manager refuses to write
beside it; the callback's resume too
(:func:`orbax_flax.training.resume.refuse_foreign_steps`).

On an object store a listing names every key of every step (tensorstore lists
without a delimiter: thousands of data files a step on a large job), so the
steps are also indexed: an empty key ``<directory>/_steps/<step>``, written by
the manager after the step commits (:func:`index`) and deleted before the step
is uncommitted (:func:`delete_step`). :func:`list_steps` lists the index and
checks that each entry's manifest exists (one small read a step: an entry
whose step has no ``_CHECKPOINT`` is not a step); it falls back to the whole
listing where the index is empty (a directory written before the index, or by
hand). A crash between the commit and the index write leaves a committed step
out of the index until the directory's writer next starts (:func:`reindex`,
run only under the writer lease, from a listing taken under it), like a
hand-made step.

A rollback (a restore of an older step, then saves from it) abandons the steps
above it, and their deletion comes after the new run's first commit, in the
background, and waits for evaluators that read them. So that a committed
rollback holds from the instant of that commit, whatever happens to the
deletions (a kill, an evaluator's lease), the directory records it:
:data:`ROLLBACKS` holds a :class:`RollbackRecord` per rollback whose abandoned
steps may still be on storage, written before the new run's first save
commits; the manager hides the steps it abandons from every listing
(:func:`orbax_flax.manager.registry.abandoned_steps`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Iterable, Sequence

from orbax_flax import errors
from orbax_flax.core import _location
from orbax_flax.format import _manifest
from orbax_flax.core._location import Location

log = logging.getLogger("orbax_flax")


@dataclasses.dataclass(frozen=True)
class Leftover:
  """Debris of an interrupted save or delete: safe to remove when nothing writes it.

  ``name``: a directory (``<step>.ofx-tmp-<gen>``) or a step prefix without a manifest
  (``<step>/``); on an object store, an overwrite of a committed step that did not commit
  leaves its data inside the step, beside the data the manifest names: ``generation`` is
  then that save's, and ``name`` says where its keys are, ``<step>/*/p*-<generation>/``.
  A local directory holding a committed manifest (a replaced checkpoint whose retirement
  did not happen) has that manifest's ``generation``: kept while a step borrows from it.
  """
  name: str
  step: int | None
  generation: str | None = None


TMP_MARKER = ".ofx-tmp-"  # <step>.ofx-tmp-<...>: an uncommitted save or a step being deleted
RETIRED_KEY = "_RETIRED"  # a retired step's manifest (its _CHECKPOINT renamed): not a step
RETIRED = ".ofx-base-"     # <dir>.ofx-base-<generation>: retired data moved aside for a new <dir>
INDEX = "_steps"  # on object stores: one empty key per committed step
TIMELINE = ".timeline"  # the timeline of a directory's run before its first step commits
ROLLBACKS = ".rollbacks"  # JSON: the rollbacks whose abandoned steps may still be on storage
# Key names that orbax-checkpoint writes inside a step and orbax_flax never does (ours are
# _CHECKPOINT, manifest.ocdbt and d/<hash>): its commit marker on object stores, its step
# metadata, and its pytree item's metadata and shardings (an unfinished or half-deleted step of
# it holds these). A step prefix holding one, at any depth, is another library's step.
FOREIGN_MARKERS = frozenset({"commit_success.txt", "_CHECKPOINT_METADATA", "_METADATA",
                             "_sharding"})
# What makes a local directory named like a step a committed one: our manifest, or
# orbax-checkpoint's commit markers (a manager lists and reads those steps).
_COMMIT_RECORDS = (_manifest.MANIFEST_KEY, "_CHECKPOINT_METADATA", "commit_success.txt")


def retired_name(directory: str, generation: str) -> str:
  """The name a retired step's directory gets: ``<dir>.ofx-base-<generation>``.

  Example:
    >>> retired_name("100", "0123456789abcdef")
    '100.ofx-base-0123456789abcdef'
  """
  return f"{directory}{RETIRED}{generation}"


def parse_retired(name: str) -> tuple[str, str] | None:
  """(dir, generation) of a retired directory's name, else None."""
  head, sep, gen = name.rpartition(RETIRED)
  if sep and _manifest.BASE_DIR.match(head) and _manifest._GENERATION.match(gen):
    return head, gen
  return None


def retired_dirs(root: str) -> list[str]:
  """Names of the retired data under the local directory of steps ``root``, sorted.

  Example:
    >>> import tempfile
    >>> retired_dirs(tempfile.mkdtemp())
    []
  """
  try:
    names = os.listdir(root)
  except OSError:
    return []
  return sorted(n for n in names if parse_retired(n) or (
      n.isdigit() and os.path.exists(os.path.join(root, n, RETIRED_KEY))))


def first_timeline(loc: Location) -> str:
  """The timeline of the run in ``loc`` before its first step commits: the one recorded in
  its :data:`TIMELINE` key, else a new one, recorded there (process 0 decides). A restart
  before the first commit keeps it; the key is removed once a step commits
  (:func:`forget_first_timeline`: the steps carry the timeline from then on), so a run
  that starts over in a directory emptied since (``rm -rf checkpoints/*`` spares dot
  files) gets a new timeline and never takes an older run's local-tier steps.

  Example:
    >>> import tempfile
    >>> loc = Location.parse(tempfile.mkdtemp())
    >>> first_timeline(loc) == first_timeline(loc)
    True
  """
  found = _location.read_key(loc, TIMELINE, max_bytes=64)
  text = found.decode("ascii", "replace").strip() if found else ""
  if text.isalnum():
    return text
  timeline = uuid.uuid4().hex
  _location.write_key(loc, TIMELINE, timeline.encode())
  return timeline


@dataclasses.dataclass(frozen=True)
class RollbackRecord:
  """A rollback: the new run's ``timeline`` and the checkpoints of older runs it abandons.

  Written by the directory's writer when the new run starts each save before its
  first commit (``saves``: those steps). It is in force once one of ``saves`` is
  committed with ``timeline`` in its manifest, or once ``committed`` (the writer
  saw that commit and said so, so that the record holds after those saves are
  deleted in turn). While in force, each ``(step, generation)`` of ``abandons``
  still on storage (the manifest of ``step`` has that ``generation``: the very
  save abandoned, "" for one whose manifest could not be read) is no step of the
  directory; a later save of the same step number is. A record not in force is a
  rollback whose run never committed (a crash before its first commit): the
  abandoned run goes on.

  Example:
    >>> import tempfile
    >>> loc = Location.parse(tempfile.mkdtemp())
    >>> write_rollbacks(loc, [RollbackRecord("ab12", saves=(11,), abandons=((20, "9f"),))])
    >>> read_rollbacks(loc)
    [RollbackRecord(timeline='ab12', saves=(11,), abandons=((20, '9f'),), committed=False)]
    >>> write_rollbacks(loc, []); read_rollbacks(loc)
    []
  """
  timeline: str
  saves: tuple[int, ...]
  abandons: tuple[tuple[int, str], ...]
  committed: bool = False


def read_rollbacks(loc: Location) -> list[RollbackRecord]:
  """The :data:`ROLLBACKS` records of the directory ``loc`` (none if it has none).

  A record that cannot be parsed is ignored, with a WARNING: it can only make
  steps of an abandoned run visible again, never hide a step of the run going on.
  """
  data = _location.read_key(loc, ROLLBACKS, max_bytes=8 << 20)
  if not data:
    return []
  try:
    records = [RollbackRecord(str(r["timeline"]), tuple(int(s) for s in r["saves"]),
                              tuple((int(s), str(g)) for s, g in r["abandons"]),
                              bool(r["committed"]))
               for r in json.loads(data)]
  except (ValueError, TypeError, KeyError) as e:
    log.warning(
        "%s/%s cannot be read (%s): ignored; steps of a run a rollback abandoned may be listed"
        " again until they are deleted", loc, ROLLBACKS, e)
    return []
  return records


def write_rollbacks(loc: Location, records: Sequence[RollbackRecord]) -> None:
  """Replaces the :data:`ROLLBACKS` records of ``loc`` atomically (none: removes the key)."""
  if not records:
    _location.delete_key(loc, ROLLBACKS)
    return
  _location.write_key(loc, ROLLBACKS, json.dumps([dataclasses.asdict(r) for r in records],
                                                  sort_keys=True).encode())


def forget_first_timeline(loc: Location) -> None:
  """Removes the :data:`TIMELINE` key of ``loc`` (its directory has a committed step)."""
  _location.delete_key(loc, TIMELINE)


def is_parked(path: str) -> bool:
  """Whether ``path`` (``<step>.ofx-base-<generation>``) is a committed step parked for a
  new save of its number: a directory, not a link, whose ``_CHECKPOINT`` was kept.

  Example:
    >>> import tempfile
    >>> is_parked(os.path.join(tempfile.mkdtemp(), "3.ofx-base-0123456789abcdef"))
    False
  """
  return (parse_retired(os.path.basename(path)) is not None and not os.path.islink(path)
          and os.path.isfile(os.path.join(path, _manifest.MANIFEST_KEY)))


def retire_parked(path: str) -> None:
  """Retires the parked step at ``path`` (its ``_CHECKPOINT`` renamed ``_RETIRED``): the new
  save of its number has committed. Nothing if it is not parked."""
  if not is_parked(path):
    return
  os.rename(os.path.join(path, _manifest.MANIFEST_KEY), os.path.join(path, RETIRED_KEY))
  _location.fsync_dir(path)


def unpark(root: str, path: str) -> bool:
  """Moves the parked step at ``path`` back to ``<root>/<step>``: the save that replaced it
  did not commit. Returns whether it moved (nothing is ever moved over an existing path)."""
  step = parse_retired(os.path.basename(path))[0]
  dst = os.path.join(root, step)
  if not is_parked(path) or os.path.lexists(dst):
    return False
  try:
    os.rename(path, dst)
  except FileNotFoundError:
    return False
  _location.fsync_dir(root)
  return True


def settle_parked(loc: Location) -> list[int]:
  """Settles the parked steps a killed job left (local directories; run by the directory's
  writer before it lists, when none of its saves is in flight): a parked step whose new
  save committed is retired, one whose save did not is moved back, a step again.

  Returns:
    The steps moved back.
  """
  if not loc.is_local:
    return []
  back = []
  for name in retired_dirs(loc.local_path):
    path = os.path.join(loc.local_path, name)
    if not is_parked(path):
      continue
    step = parse_retired(name)[0]
    if not _is_step(step):
      continue
    if os.path.isfile(os.path.join(loc.local_path, step, _manifest.MANIFEST_KEY)):
      retire_parked(path)
    elif unpark(loc.local_path, path):
      back.append(int(step))
  return back


def list_steps(loc: Location, *, full: bool = False,
               trusted_to: int | None = None) -> tuple[list[int], list[Leftover]]:
  """Committed steps and leftovers under ``loc``, from one listing.

  On an object store the step index is listed when it has entries, and then
  no leftovers are reported; ``full=True`` lists every key (to find leftovers).
  An index entry is checked against its manifest (one small read each: an entry
  outlives a step deleted by hand), except entries up to ``trusted_to``: a
  poller that checked those at an earlier listing (a deletion of ours takes the
  entry out first) reads only the new ones.
  A step prefix holding another library's step (:data:`FOREIGN_MARKERS`) and
  no manifest of ours is neither a step nor a leftover there; on a file system a
  step directory without our manifest or orbax-checkpoint's commit marker is neither.

  Example:
    >>> import tempfile
    >>> list_steps(Location.parse(tempfile.mkdtemp()))
    ([], [])
  """
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
      if _is_step(name):
        # A step only with a commit record (one stat for ours): our manifest, or an
        # orbax-checkpoint step's (read, never written: a manager refuses to write beside
        # them). A directory of that name without one is no save (commits rename whole
        # directories into place) but someone's files, a directory being copied in, another
        # manager's directory, or a step retention retired (_RETIRED), whose data other
        # steps use. Keep rules must never delete it.
        if _committed_dir(os.path.join(loc.local_path, name)):
          steps.append(int(name))
      elif TMP_MARKER in name:
        head = name.split(".", 1)[0]
        # One holding a committed manifest is a checkpoint an overwrite replaced whose
        # retirement did not happen (or a step being deleted): its generation, which a
        # differential step may still borrow (references find it there), keeps it while one
        # does. (One small read per such leftover.)
        leftovers.append(Leftover(name, int(head) if _is_step(head) else None,
                                  committed_generation(loc.join(name))))
    return sorted(steps), sorted(leftovers, key=lambda l: l.name)
  if not full:
    indexed = sorted(int(k) for k in _location.list_keys(loc.join(INDEX)) if _is_step(k))
    if indexed:  # an entry is a step only while its manifest exists (one small read each)
      return [s for s in indexed if (trusted_to is not None and s <= trusted_to)
              or _location.read_key(loc.join(str(s)), _manifest.MANIFEST_KEY,
                                    max_bytes=1) is not None], []
  keys = _location.list_keys(loc)
  committed, prefixes, foreign = set(), set(), set()
  generations: dict[str, set[str]] = {}  # step -> the generations its data keys hold
  for k in keys:
    head, _, rest = k.partition("/")
    if _is_step(head):
      prefixes.add(head)
      if rest == _manifest.MANIFEST_KEY:
        committed.add(head)
      elif _is_foreign(rest):
        foreign.add(head)
      elif (gen := _generation_of_key(rest)) is not None:
        generations.setdefault(head, set()).add(gen)
  steps = sorted(int(h) for h in committed)
  leftovers = [Leftover(h + "/", int(h)) for h in sorted(prefixes - committed - foreign, key=int)]
  # A committed step's data of a generation its manifest does not name: an overwrite of it
  # that did not commit (or whose commit could not remove the data it replaced). Only a step
  # holding two generations has its manifest read (one small read): one is the step's own.
  for h in sorted(committed, key=int):
    if len(generations.get(h, ())) > 1:
      current = committed_generation(loc.join(h))
      if current is not None:  # (unreadable: which generation is the step's is not known)
        leftovers += [Leftover(_generation_name(h, g), int(h), g)
                      for g in sorted(generations[h] - {current})]
  return steps, sorted(leftovers, key=lambda l: (l.step, l.name))


def _generation_of_key(key: str) -> str | None:
  """The generation of a data key inside a step (``<item>/p<process>-<generation>/...``)."""
  parts = key.split("/", 2)
  return database_generation(parts[1]) if len(parts) >= 3 else None


def database_generation(name: str) -> str | None:
  """The generation a process database of a step is named for (``p<process>-<generation>``),
  or None if ``name`` is not one.

  Example:
    >>> database_generation("p3-0123456789abcdef"), database_generation("packed")
    ('0123456789abcdef', None)
  """
  process, _, gen = name.partition("-")
  if process[:1] == "p" and process[1:].isdigit() and _manifest._GENERATION.match(gen):
    return gen
  return None


def _generation_name(step: str, generation: str) -> str:
  return f"{step}/*/p*-{generation}/"


def committed_generation(loc: Location) -> str | None:
  """The generation the committed manifest of the checkpoint ``loc`` names (read from its
  summary: a few KB); None where it has none, or it cannot be read.

  Example:
    >>> import tempfile
    >>> committed_generation(Location.parse(tempfile.mkdtemp())) is None
    True
  """
  where = f"{loc}/{_manifest.MANIFEST_KEY}"
  try:
    data = _location.read_key(loc, _manifest.MANIFEST_KEY, max_bytes=_manifest.SUMMARY_READ_BYTES)
    summary = None if data is None else _manifest.decode_summary(data, where)
    extent = None if data is None or summary is not None else _manifest.summary_extent(data)
    if extent is not None and len(data) < extent <= _manifest.MAX_MANIFEST_BYTES:  # long
      data = _location.read_key(loc, _manifest.MANIFEST_KEY, max_bytes=extent)
      summary = None if data is None else _manifest.decode_summary(data, where)
  except errors.CheckpointError:
    return None
  return (summary.generation or None) if summary is not None else None


def _is_foreign(key: str) -> bool:
  """Whether ``key`` (inside a step) is one only another library writes (FOREIGN_MARKERS)."""
  return key.rpartition("/")[2] in FOREIGN_MARKERS


def index(loc: Location, step: int) -> None:
  """Enters the committed ``step`` in the step index (object stores; nothing on a file system)."""
  if not loc.is_local:
    _location.write_key(loc.join(INDEX), str(step), b"")


def reindex(loc: Location, committed: Iterable[int]) -> None:
  """Makes the step index name exactly the ``committed`` steps (object stores).

  ``committed`` comes from a full listing (``list_steps(loc, full=True)``).
  For the steps a crash left out (committed, not yet indexed) or in (index
  entry of a step deleted by hand). Run by the process that deletes, when
  nothing else of its job writes.
  """
  if loc.is_local:
    return
  committed = set(committed)
  marks = _location.list_keys(loc.join(INDEX))
  for step in sorted(committed - {int(m) for m in marks if _is_step(m)}):
    index(loc, step)
  for mark in marks:
    if not (_is_step(mark) and int(mark) in committed):
      _location.delete_key(loc.join(INDEX), mark)


def _committed_dir(path: str) -> bool:
  """Whether the local directory ``path``, named like a step, is a committed one: it holds a
  commit record (:data:`_COMMIT_RECORDS`; one stat for ours)."""
  return any(os.path.exists(os.path.join(path, m)) for m in _COMMIT_RECORDS)


def unlisted_steps(loc: Location) -> list[int]:
  """The numbers of the local directories named like steps that are no step: without a
  commit record, and not retired data (:func:`list_steps` leaves them out; nothing deletes
  them); none on an object store, where a step prefix without a manifest is a leftover.

  Example:
    >>> import tempfile
    >>> d = tempfile.mkdtemp(); os.makedirs(os.path.join(d, "7", "notes"))
    >>> unlisted_steps(Location.parse(d))
    [7]
  """
  if not loc.is_local:
    return []
  try:
    names = os.listdir(loc.local_path)
  except OSError:
    return []
  return sorted(int(n) for n in names if _is_step(n) and (
      os.path.isdir(path := os.path.join(loc.local_path, n)) and not _committed_dir(path)
      and not os.path.exists(os.path.join(path, RETIRED_KEY))))


def _is_step(name: str) -> bool:
  return name.isascii() and name.isdigit()


def remove(loc: Location, leftover: Leftover) -> str | None:
  """Removes a leftover (a directory, a key prefix, or one generation's data in a step).

  On an object store a prefix whose manifest exists by now (its save committed
  since the listing), or that holds another library's step
  (:data:`FOREIGN_MARKERS`), is left alone: it is no leftover of ours. So is a
  generation inside a step unless the step's manifest, read again here, names
  another one (the save that wrote it may have committed since the listing).

  Returns:
    None once removed, else why a local leftover is still there (it is tried again at a
    later sweep).
  """
  name = leftover.name
  if loc.is_local:
    path = os.path.join(loc.local_path, name)
    failed = remove_local(path)
    return (failed or "still there") if os.path.lexists(path) else None
  if leftover.generation is not None:
    step = loc.join(str(leftover.step))
    current = committed_generation(step)
    if current is not None and current != leftover.generation:
      databases = {"/".join(k.split("/", 2)[:2]) for k in _location.list_keys(step)
                   if _generation_of_key(k) == leftover.generation}
      for db in sorted(databases):
        _location.delete_prefix(step, db + "/")
    return None
  prefix = loc.join(name.rstrip("/"))
  if (_location.read_key(prefix, _manifest.MANIFEST_KEY, max_bytes=1) is None
      and not any(_is_foreign(k) for k in _location.list_keys(prefix))):
    _location.delete_prefix(loc, name)
  return None


def remove_local(path: str) -> str | None:
  """Removes a local directory, or only the link if ``path`` is a symlink: nothing is ever
  deleted through a link (it may lead out of the directory of steps). Removes what it can;
  returns what it could not (the count and the first error), or None."""
  if os.path.islink(path):
    try:
      os.unlink(path)
    except FileNotFoundError:
      pass
    except OSError as e:
      return str(e)
    return None
  failed = [e for e in rmtree_errors(path) if not isinstance(e, FileNotFoundError)]
  return f"{len(failed)} error(s), the first: {failed[0]}" if failed else None


def rmtree_errors(path: str) -> list[OSError]:
  """``shutil.rmtree(path)`` that removes what it can and returns what it could not, each
  error naming its file by its whole path."""
  failed: list[OSError] = []

  def collect(_, where, exc):
    e = exc if isinstance(exc, BaseException) else exc[1]
    if isinstance(e, OSError) and e.filename != where:
      e = type(e)(e.errno, e.strerror, where)
    failed.append(e)
  if sys.version_info >= (3, 12):
    shutil.rmtree(path, onexc=collect)  # pylint: disable=unexpected-keyword-arg
  else:
    shutil.rmtree(path, onerror=collect)  # deprecated from 3.12 on
  return failed


def delete_step(loc: Location, step: int) -> None:
  """Uncommits ``step`` atomically first, then removes its data (a linked step: the link)."""
  name = str(step)
  if loc.is_local:
    doomed = f"{name}{TMP_MARKER}delete-{uuid.uuid4().hex[:8]}"
    try:
      os.rename(os.path.join(loc.local_path, name), os.path.join(loc.local_path, doomed))
    except FileNotFoundError:
      return
    except OSError as e:
      raise _location.storage_error(loc, f"deleting step {step}", e) from e
    remove_local(os.path.join(loc.local_path, doomed))  # what stays: a leftover, and the
    return                                             # sweep's (once, naming it)
  _location.delete_key(loc.join(INDEX), name)  # out of the index first: listed means committed
  _location.delete_key(loc.join(name), _manifest.MANIFEST_KEY)
  _location.delete_prefix(loc, name + "/")
