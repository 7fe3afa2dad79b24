"""References to another step's bytes in a manifest: fields, checks, and where the bytes are.

A differential save records (see ``docs/format.md``, "Differential saves"):

* ``bases`` (summary): the steps whose data it references, each
  ``{"dir": <sibling directory name>, "generation": <16 hex>}``;
* ``chunk_hash`` (chunked array): the xxh3-128 of every chunk, 32 hex digits;
* ``chunk_base`` (chunked array, when some chunk is borrowed): per chunk -1
  (this checkpoint) or an index into ``bases``;
* ``packed_pieces`` (item): per process ``[[lo, hi, base, hash], ...]``, the
  segments its packed buffer was decided in (:func:`.differ.segments`), tiling it;
* ``stored_bytes`` (summary): ``{"own": n, "borrowed": m}``.

Every reference names the step that holds the bytes itself (never a step that
borrowed them in turn), in the same parent directory, and the chunk lives in
that step's database of the same process, under the same array name and chunk
coordinates. A retired step (deleted by retention while referenced) keeps its
data in place, its ``_CHECKPOINT`` renamed ``_RETIRED``; only when a new step
of the same number is saved does it move aside, to ``<dir>.ofx-base-<generation>``,
as does a checkpoint others borrow from that an overwrite replaces
(:func:`dispose_replaced`).

The one decoder (:mod:`orbax_flax.format._manifest`) checks these fields and
folds each reference into the owner number the reader uses (``home *
OWNER_STRIDE + process``), so the reader finds the database of any chunk from
its owner alone (:class:`Homes`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from orbax_flax.core import _location
from orbax_flax.format import _manifest
from orbax_flax.format import _tsio
from orbax_flax.format import step_dir
from orbax_flax import errors
from orbax_flax.core._location import Location

log = logging.getLogger("orbax_flax")
BASES = "bases"
CHUNK_HASH = "chunk_hash"
CHUNK_BASE = "chunk_base"
PACKED_PIECES = "packed_pieces"
STORED_BYTES = "stored_bytes"
OWNER_STRIDE = _manifest.OWNER_STRIDE  # expanded owners: home * it + process
MAX_SUMMARY_BYTES = 16 << 20  # a summary longer than this is not read to find a generation


def split(owner: int) -> tuple[int, int]:
  """(home, process) of an expanded owner: home 0 is the checkpoint itself, k is bases[k-1]."""
  return divmod(owner, OWNER_STRIDE)


def locate_step(loc: Location, directory: str, generation: str) -> Location:
  """Where the data of sibling step ``directory`` of ``generation`` is: the step, or retired.

  Raises:
    CheckpointFormatError: neither holds that generation.
  """
  if not loc.is_local:
    return loc.sibling(directory)
  retired = step_dir.retired_name(directory, generation)
  for name in (directory, retired):
    if holds_generation(loc.sibling(name).local_path, generation):
      return loc.sibling(name)
  # An overwrite committed by an exchange, whose retirement of what it replaced did not
  # happen (a kill in that instant, a rename that failed): the data is still whole, its
  # manifest kept, under the overwrite's temporary name.
  prefix = f"{directory}{step_dir.TMP_MARKER}"
  try:
    names = sorted(n for n in os.listdir(os.path.dirname(loc.local_path)) if n.startswith(prefix))
  except OSError:
    names = []
  for name in names:
    if step_dir.committed_generation(loc.sibling(name)) == generation:
      return loc.sibling(name)
  raise errors.CheckpointFormatError(
      f"{loc}: references data of step {directory!r} (generation {generation}), which is not"
      f" next to it: neither that step nor its retired data ({retired}) exists. The referenced"
      " step was removed by hand, or the manifest was crafted; restore another step.")


def summary_of(path: str) -> Any:
  """The decoded, verified summary of the local checkpoint data in ``path``: of its
  ``_CHECKPOINT`` manifest or, retired, its ``_RETIRED`` one; None if neither decodes."""
  for key in (_manifest.MANIFEST_KEY, step_dir.RETIRED_KEY):
    try:
      with _location.open_plain(os.path.join(path, key), path) as f:
        data = f.read(_manifest.SUMMARY_READ_BYTES)
        summary = _manifest.decode_summary(data, os.path.join(path, key))
        if summary is None:  # a long summary: read as far as its header says, then all
          extent = _manifest.summary_extent(data)
          f.seek(0)
          data = _location.read_at_most(f, extent if extent is not None else MAX_SUMMARY_BYTES)
          summary = _manifest.decode_summary(data, os.path.join(path, key))
    except (OSError, errors.CheckpointError):
      continue
    if summary is not None:
      return summary
  return None


def generation_of(path: str) -> str | None:
  """The generation of the local checkpoint data in ``path`` (the decoded ``generation``
  field of its manifest, :func:`summary_of`); None if missing or damaged.

  Example:
    >>> import tempfile
    >>> generation_of(tempfile.mkdtemp()) is None
    True
  """
  summary = summary_of(path)
  return None if summary is None else summary.generation


def generation_of_data(path: str) -> str | None:
  """The generation whose data the local checkpoint directory ``path`` holds, for a decision
  to dispose of it: :func:`generation_of`, else, where a manifest is there but does not
  decode (damaged), the one generation its databases are named for
  (``<item>/p<i>-<generation>``). None only where neither says one: nothing of ours.

  Raises:
    OSError: the directory cannot be listed (say, no file descriptor left): nothing is
      disposed of on a guess.
  """
  found = generation_of(path)
  if found is not None or not any(
      os.path.isfile(os.path.join(path, k)) for k in (_manifest.MANIFEST_KEY, step_dir.RETIRED_KEY)):
    return found
  gens = {step_dir.database_generation(d) for item in os.scandir(path)
          if item.is_dir(follow_symlinks=False) for d in os.listdir(item.path)} - {None}
  return gens.pop() if len(gens) == 1 else None


def borrowers(loc: Location, generation: str) -> list[str]:
  """The checkpoints beside the local checkpoint ``loc``, and ``loc`` itself, whose committed
  manifests borrow data of ``generation`` (decoded ``bases``), by name.

  Every sibling holding a ``_CHECKPOINT`` counts, whatever its name (a
  :class:`orbax_flax.Checkpointer` names its checkpoints freely; a step parked for a
  re-save counts too), and so does the checkpoint at ``loc`` (after an overwrite, the
  new one: it may borrow what the one it replaced held, through its base). One whose
  manifest cannot be decoded counts too, named ``"<name> (unreadable)"``: what it
  references is unknown, so the data is kept.

  Example:
    >>> import tempfile
    >>> borrowers(Location.parse(tempfile.mkdtemp() + "/3"), "0123456789abcdef")
    []
  """
  root = os.path.dirname(loc.local_path)
  try:
    names = sorted(os.listdir(root))
  except FileNotFoundError:
    return []
  except OSError as e:  # who borrows is unknown: the data is kept
    return [f"(the checkpoints beside it, which could not be listed: {e})"]
  out = []
  for name in names:
    if not os.path.isfile(os.path.join(root, name, _manifest.MANIFEST_KEY)):
      continue  # no checkpoint of ours, a retired one, or gone meanwhile
    summary = summary_of(os.path.join(root, name))
    if summary is None:
      if os.path.isfile(os.path.join(root, name, _manifest.MANIFEST_KEY)):
        out.append(f"{name} (unreadable)")
    elif any(b.generation == generation for b in summary.bases):
      out.append(name)
  return out


def dispose_replaced(final: Location, old: str) -> None:
  """Disposes of the data of the local checkpoint that a save, a conversion or an export to
  ``final`` replaced, now a directory of its own at ``old`` beside it (its manifest still
  ``_CHECKPOINT``).

  The one way every overwrite disposes of what it replaced (the engine's commit, with or
  without an atomic exchange, and the exports of :mod:`orbax_flax.formats`): removed, unless
  a checkpoint beside it, or the new one at ``final``, borrows its data (:func:`borrowers`);
  then it is *retired* where their references look for it, ``<final>.ofx-base-<generation>``
  (:func:`locate_step`): moved there whole first (a crash then leaves it parked, its
  manifest kept, which the directory's next writer retires:
  :func:`orbax_flax.format.step_dir.settle_parked`), then its manifest renamed ``_RETIRED``. A
  manager's sweep removes it once nothing borrows from it. Something that is not a
  checkpoint of ours (no generation) is removed; a link is never followed.

  Raises:
    OSError: the storage refused to move it (the new checkpoint is committed regardless).
  """
  gen = generation_of_data(old)  # (a damaged manifest: its databases' names say)
  users = borrowers(final, gen) if gen is not None else []
  if not users:
    step_dir.remove_local(old)
    return
  parent = os.path.dirname(final.local_path)
  aside = os.path.join(parent, step_dir.retired_name(final.name, gen))
  if os.path.abspath(old) != os.path.abspath(aside):
    os.rename(old, aside)
    _location.fsync_dir(parent)
  if not os.path.islink(aside):  # (a link is retired by its name alone)
    try:
      os.rename(os.path.join(aside, _manifest.MANIFEST_KEY),
                os.path.join(aside, step_dir.RETIRED_KEY))
      _location.fsync_dir(aside)
    except FileNotFoundError:
      pass  # retired already
  log.info("%s overwritten; its previous data stays as %s: %s borrow from it", final,
           os.path.basename(aside), ", ".join(users))


def holds_generation(path: str, generation: str) -> bool:
  """True if the local checkpoint directory ``path`` holds the data of ``generation``.

  Decided by the decoded ``generation`` field of its manifest (never by text
  found in it: a manifest also names the generations it borrows from). Only
  when no manifest decodes (damaged) do its database names
  (``<item>/p<i>-<generation>``) decide.
  """
  found = generation_of(path)
  if found is not None:
    return found == generation
  try:
    return any(d.endswith(f"-{generation}") for item in os.scandir(path) if item.is_dir()
               for d in os.listdir(item.path))
  except OSError:
    return False


class Homes:
  """Where the chunks of a checkpoint's (expanded) owners are; the bases' directories cached.

  A base is found (the step itself, or its retired data, :func:`locate_step`)
  on first use and remembered for the reader's lifetime; the manifest is not
  changed.

  Example:
    >>> homes = Homes(Location.parse("/tmp/ckpt/7"), "0123456789abcdef", ())
    >>> homes.db_name("params", 1)
    'params/p1-0123456789abcdef'
  """

  def __init__(self, loc: Location, generation: str, bases: Sequence[Any]):
    self.loc, self.generation, self.bases = loc, generation, tuple(bases)
    self._at: dict[int, str] = {}
    self._lock = threading.Lock()

  def _dir(self, k: int) -> str:
    with self._lock:
      if k not in self._at:
        b = self.bases[k]
        self._at[k] = locate_step(self.loc, b.dir, b.generation).name
      return self._at[k]

  def db_name(self, item: str, owner: int) -> str:
    """The database holding the chunks of ``owner``, relative to the checkpoint.

    Raises:
      CheckpointFormatError: the step holding them does not exist (see :func:`locate_step`).
    """
    h, process = split(owner)
    if not h:
      return _tsio.db_name(item, process, self.generation)
    return f"../{self._dir(h - 1)}/{_tsio.db_name(item, process, self.bases[h - 1].generation)}"

  def home(self, item: str, owner: int) -> tuple[Location, str]:
    """(checkpoint location, database name) of the chunks of ``owner``."""
    h, process = split(owner)
    if not h:
      return self.loc, self.db_name(item, owner)
    return (self.loc.sibling(self._dir(h - 1)),
            _tsio.db_name(item, process, self.bases[h - 1].generation))
