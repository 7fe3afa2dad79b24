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
of the same number is saved does it move aside, to ``<dir>.ofx-base-<generation>``.

After validation, :func:`expand` folds each reference into the owner number
the reader uses (``home * OWNER_STRIDE + process``), so the reader finds the
database of any chunk from its owner alone (:func:`db_name`, :func:`home`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from orbax_flax import errors
from orbax_flax._location import Location

BASES = "bases"
CHUNK_HASH = "chunk_hash"
CHUNK_BASE = "chunk_base"
PACKED_PIECES = "packed_pieces"
STORED_BYTES = "stored_bytes"
RETIRED_KEY = "_RETIRED"  # a retired step's manifest (its _CHECKPOINT renamed): not a step
RETIRED = ".ofx-base-"     # <dir>.ofx-base-<generation>: retired data moved aside for a new <dir>
OWNER_STRIDE = 1 << 24     # expanded owners: home * OWNER_STRIDE + process (home 0: this one)
_AT = "_at"                # a base's resolved directory name (set by resolve, never stored)
_DIR = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]*$")
_GEN = re.compile(r"^[0-9a-f]{16}$")
_HASH = re.compile(r"^[0-9a-f]{32}$")


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
  return (head, gen) if sep and _DIR.match(head) and _GEN.match(gen) else None


def check_items(manifest: dict[str, Any], bad: Callable[[str], Any]) -> None:
  """Checks ``bases``, ``stored_bytes`` and every reference of the (validated) items.

  ``bad(problem)`` raises (the manifest's own checker).
  """
  for k, b in enumerate(manifest.get(BASES, [])):
    if (not isinstance(b, dict) or not isinstance(b.get("dir"), str) or not _DIR.match(b["dir"])
        or not isinstance(b.get("generation"), str) or not _GEN.match(b["generation"])):
      bad(f"bases[{k}] is {_short(b)}: a reference must name a sibling step directory (a plain"
          " name, inside the checkpoint's parent) and a generation of 16 hex digits")
    if b["generation"] == manifest.get("generation"):
      bad(f"bases[{k}] names this checkpoint's own generation")
  stored = manifest.get(STORED_BYTES, {"own": 0, "borrowed": 0})
  if not isinstance(stored, dict) or not all(
      type(stored.get(k)) is int and stored[k] >= 0 for k in ("own", "borrowed")):
    bad(f"stored_bytes is {_short(stored)}, not {{'own': n, 'borrowed': m}}")
  nbases = len(manifest.get(BASES, []))
  for name, item in manifest["items"].items():
    pieces = item.get(PACKED_PIECES, {})
    if not isinstance(pieces, dict) or set(pieces) - set(item.get("packed", {})):
      bad(f"item {name!r}: packed_pieces {_short(pieces)} for packed buffers"
          f" {sorted(item.get('packed', {}))}")
    for owner, ps in pieces.items():
      at = 0
      for p in ps if isinstance(ps, list) else [None]:
        if (not isinstance(p, list) or len(p) != 4 or not all(type(x) is int for x in p[:3])
            or p[0] != at or p[1] <= p[0] or not -1 <= p[2] < nbases
            or not isinstance(p[3], str) or not _HASH.match(p[3])):
          bad(f"item {name!r}: packed piece {_short(p)} of process {owner} (pieces tile the"
              f" buffer from byte {at}; a base is -1 or one of {nbases})")
        at = p[1]
      if at != item["packed"][owner]:
        bad(f"item {name!r}: the packed pieces of process {owner} cover {at} of"
            f" {item['packed'][owner]} bytes")
    for rec in item["leaves"]:
      if rec.get("kind") == "value":
        continue
      n = len(rec["owners"])
      where = f"item {name!r}, leaf {'/'.join(rec['path'])!r}"
      hashes, homes = rec.get(CHUNK_HASH), rec.get(CHUNK_BASE)
      if hashes is not None and (not isinstance(hashes, list) or len(hashes) != n or not all(
          isinstance(h, str) and _HASH.match(h) for h in hashes) or "packed_offset" in rec):
        bad(f"{where}: chunk_hash {_short(hashes)} for {n} chunk(s)")
      if homes is not None and (not isinstance(homes, list) or len(homes) != n or not all(
          type(b) is int and -1 <= b < nbases for b in homes) or "packed_offset" in rec):
        bad(f"{where}: chunk_base {_short(homes)}: per chunk -1 or one of {nbases} base(s)")


def expand(manifest: dict[str, Any]) -> None:
  """Folds references into owners (``home * OWNER_STRIDE + process``); validated manifests only."""
  for item in manifest["items"].values():
    pieces = item.get(PACKED_PIECES, {})
    for rec in item["leaves"]:
      if rec.get("kind") == "value" or not rec["owners"]:
        continue
      if CHUNK_BASE in rec:
        rec["owners"] = [o + (b + 1) * OWNER_STRIDE for o, b in zip(rec["owners"], rec[CHUNK_BASE])]
      elif "packed_offset" in rec and str(rec["owners"][0]) in pieces:
        owner = rec["owners"][0]
        base = next(p[2] for p in pieces[str(owner)] if p[0] <= rec["packed_offset"] < p[1])
        if base >= 0:
          rec["owners"] = [owner + (base + 1) * OWNER_STRIDE]
          item["packed"][str(rec["owners"][0])] = item["packed"][str(owner)]


def split(owner: int) -> tuple[int, int]:
  """(home, process) of an expanded owner: home 0 is the checkpoint itself, k is bases[k-1]."""
  return divmod(owner, OWNER_STRIDE)


def resolve(loc: Location, manifest: dict[str, Any]) -> None:
  """Finds every base's directory (the step itself, or its retired data); checks it exists.

  Raises:
    CheckpointFormatError: a base is neither a step of that generation nor retired data of it.
  """
  for b in manifest.get(BASES, []):
    if _AT in b:
      continue
    b[_AT] = locate_step(loc, b["dir"], b["generation"]).name


def locate_step(loc: Location, directory: str, generation: str) -> Location:
  """Where the data of sibling step ``directory`` of ``generation`` is: the step, or retired.

  Raises:
    CheckpointFormatError: neither holds that generation.
  """
  if not loc.is_local:
    return loc.sibling(directory)
  for name in (directory, retired_name(directory, generation)):
    if holds_generation(loc.sibling(name).local_path, generation):
      return loc.sibling(name)
  raise errors.CheckpointFormatError(
      f"{loc}: references data of step {directory!r} (generation {generation}), which is not"
      f" next to it: neither that step nor its retired data ({retired_name(directory, generation)})"
      " exists. The referenced step was removed by hand, or the manifest was crafted; restore"
      " another step.")


def holds_generation(path: str, generation: str) -> bool:
  """True if the local checkpoint directory ``path`` is of ``generation`` (its data or manifest).

  A quick look to find a directory, not a check: its manifest is decoded and verified next.
  """
  for key in ("_CHECKPOINT", RETIRED_KEY):
    try:
      with open(os.path.join(path, key), "rb") as f:
        if f'"generation":"{generation}"'.encode() in f.read(1 << 16):
          return True
    except OSError:
      pass
  try:
    return any(d.endswith(f"-{generation}") for item in os.scandir(path) if item.is_dir()
               for d in os.listdir(item.path))
  except OSError:
    return False


def db_name(loc: Location, manifest: dict[str, Any], item: str, owner: int) -> str:
  """The database holding the chunks of (expanded) ``owner``, relative to the checkpoint ``loc``.

  Raises:
    CheckpointFormatError: the step holding them does not exist (see :func:`locate_step`).
  """
  home, process = split(owner)
  if not home:
    return f"{item}/p{process}-{manifest['generation']}"
  resolve(loc, manifest)
  b = manifest[BASES][home - 1]
  return f"../{b[_AT]}/{item}/p{process}-{b['generation']}"


def home(loc: Location, manifest: dict[str, Any], item: str, owner: int) -> tuple[Location, str]:
  """(checkpoint location, database name) of the chunks of (expanded) ``owner``."""
  h, process = split(owner)
  if not h:
    return loc, db_name(loc, manifest, item, owner)
  resolve(loc, manifest)
  b = manifest[BASES][h - 1]
  return loc.sibling(b[_AT]), f"{item}/p{process}-{b['generation']}"


def _short(x: Any) -> str:
  text = repr(x)
  return text if len(text) <= 120 else text[:117] + "..."


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
