"""One differential save on one process: which blocks to write, which to reference.

The save's :class:`orbax_flax.engine.saving.SaveRun` calls, in its background phase:

1. :meth:`Differ.agree` once the generation is agreed: process 0 picks the
   base (the step it was given, if it is still committed, a sibling of the
   new checkpoint and named as a reference can name it), pins it and what it references (retention keeps them until
   this save ends), and tells the others; every process then uses that base.
2. :meth:`Differ.select` for every batch about to be written: hashes each
   block (:mod:`.hashing`, on threads, the GIL released) and drops the blocks
   whose hash equals the base's for the same chunk, array, layout and process;
   each process decides for the blocks it writes. A borrowed block is only
   trusted as far as its stored bytes: every :data:`SCRUB_SAVES` saves each one
   is read back once (a rolling quarter each save) and, when its stored bytes
   fail their checks, written again from the live state (see :meth:`Differ.select`).
3. :meth:`Differ.publish` (every process but 0, before reporting its status)
   and :meth:`Differ.complete` (process 0, before the manifest is written):
   the decisions of every process go into the manifest (:mod:`.refs`).

A base that cannot be read (removed, damaged, another layout) only makes the
save a full one; the save itself never fails for it.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import threading
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from orbax_flax.core import _multihost
from orbax_flax import errors
from orbax_flax.engine import _reading
from orbax_flax.engine import restoring
from orbax_flax.format import _layout
from orbax_flax.format import _manifest
from orbax_flax.core._location import Location
from orbax_flax.differential import hashing
from orbax_flax.differential import refs

log = logging.getLogger("orbax_flax")
_SAME = ("path", "shape", "dtype", "stored_dtype", "chunk_shape", "key_impl", "key_shape")
SCRUB_SAVES = 4  # every borrowed block is read back and checked once in this many saves
SCRUB_BATCH_BYTES = 64 << 20  # the read-back's buffers, at most
SCRUB_TURN = "scrub_turn"  # summary: the base's turn + 1 (see Differ.select)


class Pins:
  """Generations that saves in flight reference: retention retires them instead of deleting.

  Owned by a :class:`orbax_flax.Checkpointer`; a manager's deletions take
  ``lock`` too, so that choosing a base and deleting it never interleave. A
  pin lasts while its save runs (``alive()``).

  Args:
    lock: the lock to share (a registry's, when its retention changes to one that keeps
      references, :class:`orbax_flax.differential.retention.Referenced`); default a new one.

  Example:
    >>> pins = Pins()
    >>> pins.add({"0123456789abcdef"}, alive=lambda: True)
    >>> sorted(pins.live())
    ['0123456789abcdef']
  """

  def __init__(self, lock: Any = None):
    self.lock = lock if lock is not None else threading.RLock()
    self._pins: list[tuple[frozenset[str], Any]] = []

  def add(self, generations: set[str], alive: Any) -> None:
    with self.lock:
      self._pins = [(g, a) for g, a in self._pins if a()] + [(frozenset(generations), alive)]

  def live(self) -> set[str]:
    """Generations pinned by saves still running."""
    with self.lock:
      self._pins = [(g, a) for g, a in self._pins if a()]
      return set().union(*(g for g, _ in self._pins))


class Differ:
  """The decisions of one save on one process (see the module docstring).

  Args:
    plan_manifest: the save's planned manifest (records are not changed).
    loc: where the save goes.
    base: the step to compare with (None: a full save that records hashes).
    pins: the checkpointer's :class:`Pins`.
    alive: True while the save runs (its pin lasts that long).
  """

  def __init__(self, plan_manifest: dict[str, Any], loc: Location, base: Location | None,
               pins: Pins, alive: Any):
    self.loc, self.base, self.pins, self.alive = loc, base, pins, alive
    self.turn = 0  # the base's scrub_turn + 1, agreed with the base (see select)
    self._packed_owner: dict[tuple[str, int, int], int] = {}  # a borrowed segment's reader owner
    self.me, self.nproc = _multihost.process_index(), _multihost.process_count()
    self.recs = {(item, r["name"]): r for item, meta in plan_manifest["items"].items()
                 for r in meta["leaves"] if r.get("kind") != "value"}
    self.packed_sizes = {item: meta["packed"].get(str(self.me))
                         for item, meta in plan_manifest["items"].items()}
    self.token: str | None = None     # the agreed base, "<dir>:<generation>:<turn>" or ""
    self.homes: list[tuple[str, str]] = []  # (dir, generation) of the steps referenced
    self.chunks: list[list[Any]] = []  # [item, name, chunk, hash, home or -1]
    self.packed: list[list[Any]] = []  # [item, lo, hi, hash, home or -1]
    self.written = self.reused = 0
    self._base: dict[str, Any] | None = None

  # ------------------------------------------------------------------ the base

  def agree(self, key: str, timeout_s: float) -> None:
    """Agrees on the base: process 0 picks and pins it; the others wait for its word."""
    if self.me == 0:
      self.token = self._pick()
      if self.nproc > 1:
        _multihost.publish(f"{key}/diff-base", self.token, timeout_s=timeout_s)
    else:
      self.token = _multihost.fetch(f"{key}/diff-base", timeout_s, missing=[0],
                                    waiting_for="process 0 to choose the differential base")
    self.turn = int(self.token.rsplit(":", 2)[2]) if self.token else 0

  def _pick(self) -> str:
    base = self.base
    if base is None or base == self.loc or base.sibling(self.loc.name) != self.loc:
      return ""
    if not _manifest.BASE_DIR.match(base.name):
      log.info("differential save to %s: saving in full, not borrowing from %s: a reference"
               " names its base by a plain name (letters, digits, '_', '-'; docs/format.md),"
               " which %r is not", self.loc, base, base.name)
      return ""
    with self.pins.lock:
      try:
        summary = restoring.read_summary(base)  # (its bases checked by the decoder)
        gens = {summary.generation} | {b.generation for b in summary.bases}
        for b in summary.bases:  # what the base borrows must still be there to borrow again
          refs.locate_step(base, b.dir, b.generation)
      except (errors.CheckpointError, errors.StorageError, OSError, ValueError) as e:
        log.warning("differential save to %s: base %s cannot be used (%s); saving in full",
                    self.loc, base, e)
        return ""
      self.pins.add(gens, self.alive)
    return f"{base.name}:{summary.generation}:{summary.scrub_turn + 1}"

  def _load_base(self) -> dict[str, Any] | None:
    """The agreed base: its manifest (references expanded), steps and array records; or None."""
    if not self.token:
      return None
    name, gen, _ = self.token.rsplit(":", 2)
    try:
      at = refs.locate_step(self.loc, name, gen)
      manifest = restoring.read_manifest(at)
    except (errors.CheckpointError, errors.StorageError, OSError, ValueError) as e:
      log.warning("differential save to %s: base %s unreadable (%s); saving in full",
                  self.loc, name, e)
      return None
    if manifest.generation != gen:
      return None
    return {"items": manifest.items, "at": at, "manifest": manifest, "reader": None,
            "homes": [(name, gen)] + [(b.dir, b.generation) for b in manifest.bases],
            "recs": {(item, r.name): r for item, meta in manifest.items.items()
                     for r in meta.leaves if r.kind != "value"}}

  # ------------------------------------------------------------------ deciding

  def select(self, pieces: Sequence[Any]) -> list[Any]:
    """The pieces to write; the others (equal to the base's) get ``data = None``.

    A chunked array's piece is one chunk. A packed piece is decided per segment (whole
    small arrays, about one packed chunk each, :func:`segments`): the segments to write
    go out as pieces of their own, views of the piece's data.

    Borrowing trusts the base's record, not its bytes: one flipped bit in a block
    every later save borrows would make all of them unrestorable. So a rolling
    part of the borrowable blocks, one in :data:`SCRUB_SAVES` (chosen by array,
    chunk or segment, and ``turn``: the base's turn + 1, recorded in each
    manifest as ``scrub_turn``, so it rolls on across restarts and is the same
    on every process), is read back from where it is stored (CRC-32C, then its
    recorded content hash) before it is borrowed. A block that fails, or cannot
    be read, is written again from the live state, whose hash is the recorded
    one: the damage reaches at most the saves before its turn, and the next save
    borrows good bytes. Reading costs about a quarter of the borrowed bytes per
    save (a packed segment reads the whole packed chunks it touches), in
    buffers of at most :data:`SCRUB_BATCH_BYTES`, wherever ``select`` runs (the
    background phase; the caller's thread for the rounds of an async save over
    its host budget); nothing more is written while the bytes are sound.
    """
    if self._base is None:
      self._base = self._load_base() or {}
    blocks = []  # (piece, lo, hi, k) of every block decided on; lo/hi/k: a packed segment
    for p in pieces:
      if p.packed:
        size = self.packed_sizes[p.array.item]
        blocks += [(p, lo, hi, k) for k, (lo, hi) in
                   enumerate(segments(p, _layout.pack_chunk_bytes(size)))]
      else:
        blocks.append((p, None, None, 0))
    hashes = hashing.hash_all([p.data if lo is None else p.data[lo - p.slices[0].start:
                                                                hi - p.slices[0].start]
                               for p, lo, hi, _ in blocks])
    sources = []
    for (p, lo, hi, k), h in zip(blocks, hashes):
      a = p.array
      if lo is not None:
        src = self._packed_source(a.item, lo, hi, h)
        key = (a.item, "", k, lo, hi)
      else:
        c = _chunk_index(p.slices, a.chunk_shape, a.shape)
        src = self._chunk_source(a.item, a.name, c, h)
        key = (a.item, a.name, c, None, None)
      sources.append((src, key))
    bad = self._scrub([(key, h) for (src, key), h in zip(sources, hashes)
                       if src is not None and self._due(*key[:3])])
    out, split = [], {}
    for (p, lo, hi, _), h, (src, key) in zip(blocks, hashes, sources):
      a = p.array
      c = key[2]
      if key in bad:
        src = None
      if lo is not None:
        self.packed.append([a.item, lo, hi, h, self._home(src)])
        split.setdefault(id(p), (p, []))[1].append((lo, hi, src is None))
      else:
        self.chunks.append([a.item, a.name, c, h, self._home(src)])
      n = p.nbytes if lo is None else hi - lo
      if src is None:
        self.written += n
      else:
        self.reused += n
      if lo is None and src is None:
        out.append(p)
    for p, segs in split.values():
      start = p.slices[0].start
      if all(write for _, _, write in segs):
        out.append(p)
        continue
      out += [dataclasses.replace(p, slices=(slice(lo, hi),), shape=(hi - lo,), sources=[],
                                  data=p.data[lo - start:hi - start])
              for lo, hi, write in segs if write]
    for p in pieces:
      if all(q is not p for q in out):
        p.data = None  # reused whole: no longer needed
    return out

  def _due(self, item: str, name: str, index: int) -> bool:
    """Whether this save checks the block (one in :data:`SCRUB_SAVES`, rolling with ``turn``)."""
    return (zlib.crc32(f"{item}/{name}".encode()) + index) % SCRUB_SAVES == self.turn % SCRUB_SAVES

  def _scrub(self, due: list[tuple[tuple[Any, ...], str]]) -> set[tuple[Any, ...]]:
    """The blocks of ``due`` (``(key, hash)``) whose stored bytes fail their checks.

    A key is ``(item, array name, chunk, None, None)`` for a chunk and ``(item, "",
    segment, lo, hi)`` for bytes ``[lo, hi)`` of this process's packed buffer. Any
    failure to read or check a block only makes it written again: the scrub never
    fails a save.
    """
    problems: dict[tuple[Any, ...], str] = {}
    batch: list[tuple[tuple[Any, ...], str, Any]] = []
    used = 0
    for key, h in due:
      try:
        fill = self._fill(key)
      except Exception as e:  # pylint: disable=broad-except  # written again, never fatal
        problems[key] = f"cannot be read: {type(e).__name__}: {e}"
        continue
      batch.append((key, h, fill))
      used += key[4] - key[3] if key[3] is not None else fill.out.nbytes
      if used >= SCRUB_BATCH_BYTES:
        self._check(batch, problems)
        batch, used = [], 0
    if batch:
      self._check(batch, problems)
    if problems:
      shown = "\n  ".join(f"{self._what(k)}: {why}" for k, why in list(problems.items())[:5])
      more = f"\n  and {len(problems) - 5} more" if len(problems) > 5 else ""
      log.warning("differential save to %s: %d block(s) it would borrow from %s failed their"
                  " read-back, so they are written again from the live state and this save and"
                  " the next ones do not borrow them:\n  %s%s\nBytes that are not the recorded"
                  " ones are damage on disk: older steps that borrow them are damaged too"
                  " (ofx.verify says which). A block that could not be read may be a passing"
                  " storage error.", self.loc, len(problems), self._base["at"], shown, more)
    return set(problems)

  def _fill(self, key: tuple[Any, ...]) -> Any:
    """A read of the block ``key`` of the base into a new buffer (see :meth:`_scrub`)."""
    item, name, c, lo, hi = key
    if lo is None:
      rec = self._base["recs"][(item, name)]
      box = _layout.Chunking(rec.shape, rec.chunk_shape).chunk_box(c)
      return _reading.Fill(item, rec, box, np.empty(_layout.box_shape(box), rec.np_stored_dtype))
    out = np.empty(hi - lo, np.uint8)
    return _reading.PackedFill(item, self._packed_owner[(item, lo, hi)], lo, hi,
                               np.dtype(np.uint8), (hi - lo,), [((), out)],
                               f"the packed small arrays [{lo}, {hi})")

  def _check(self, batch: list[tuple[tuple[Any, ...], str, Any]], problems: dict) -> None:
    """Reads ``batch`` and records in ``problems`` each block that fails (one by one if any)."""
    if self._base["reader"] is None:
      self._base["reader"] = _reading.Reader(self._base["at"], self._base["manifest"])
    reader = self._base["reader"]

    def read(fills):
      reader.read([f for f in fills if isinstance(f, _reading.Fill)],
                  [f for f in fills if isinstance(f, _reading.PackedFill)])

    try:
      read([f for _, _, f in batch])
      failed = {}
    except Exception:  # pylint: disable=broad-except  # which ones: one by one
      failed = {key: None for key, _, _ in batch}
    for key, h, f in batch:
      if key in failed:
        try:
          read([f])
        except Exception as e:  # pylint: disable=broad-except  # written again, never fatal
          problems[key] = f"cannot be read: {type(e).__name__}: {e}"
          continue
      out = f.out if isinstance(f, _reading.Fill) else f.dests[0][1]
      if hashing.block_hash(out) != h:
        problems[key] = "its bytes are not the recorded ones"

  def _what(self, key: tuple[Any, ...]) -> str:
    item, name, c, lo, _ = key
    if lo is None:
      return f"item {item!r}, array {self._base['recs'][(item, name)].path_text}, chunk {c}"
    return f"item {item!r}, the packed small arrays from byte {lo}"

  def _home(self, src: tuple[str, str] | None) -> int:
    if src is None:
      return -1
    if src not in self.homes:
      self.homes.append(src)
    return self.homes.index(src)

  def _chunk_source(self, item: str, name: str, c: int, h: str) -> tuple[str, str] | None:
    old = self._base.get("recs", {}).get((item, name))
    new = self.recs[(item, name)]
    if old is None or old.is_packed or any(
        getattr(old, k) != _plain(new.get(k)) for k in _SAME):
      return None
    hashes = old.chunk_hash
    if not hashes or len(hashes) != len(new["owners"]) or hashes[c] != h:
      return None
    home, process = refs.split(old.owners[c])
    return self._base["homes"][home] if process == self.me else None

  def _packed_source(self, item: str, lo: int, hi: int, h: str) -> tuple[str, str] | None:
    meta = self._base.get("items", {}).get(item)
    if meta is None or meta.packed.get(self.me) != self.packed_sizes.get(item):
      return None
    for plo, phi, b, ph in meta.packed_pieces.get(self.me, ()):
      if (plo, phi, ph) == (lo, hi, h):
        self._packed_owner[(item, lo, hi)] = (b + 1) * refs.OWNER_STRIDE + self.me
        return self._base["homes"][b + 1]
    return None

  # ------------------------------------------------------------------ the manifest

  def results(self) -> dict[str, Any]:
    return {"homes": self.homes, "chunks": self.chunks, "packed": self.packed,
            "written": self.written, "reused": self.reused}

  def publish(self, key: str, error: BaseException | None, timeout_s: float) -> None:
    """Hands this process's decisions to process 0 (multi-process saves, before the status)."""
    if self.me != 0 and error is None:
      raw = zlib.compress(json.dumps(self.results()).encode(), 1)
      _multihost.publish(f"{key}/diff/{self.me}", base64.b64encode(raw).decode(),
                         timeout_s=timeout_s)

  def complete(self, manifest: dict[str, Any], key: str, timeout_s: float) -> dict[str, Any]:
    """``manifest`` with every process's hashes and references (process 0, at the commit)."""
    reports = [self.results()] + [
        json.loads(zlib.decompress(base64.b64decode(_multihost.fetch(
            f"{key}/diff/{p}", timeout_s, missing=[p],
            waiting_for=f"process {p}'s differential report"))))
        for p in range(1, self.nproc)]
    items = {name: dict(meta, leaves=[dict(r) for r in meta["leaves"]])
             for name, meta in manifest["items"].items()}
    recs = {(name, r["name"]): r for name, meta in items.items() for r in meta["leaves"]
            if r.get("kind") != "value"}
    homes: list[tuple[str, str]] = []
    for p, report in enumerate(reports):
      index = []
      for h in map(tuple, report["homes"]):
        if h not in homes:
          homes.append(h)
        index.append(homes.index(h))
      for item, name, c, h, b in report["chunks"]:
        rec = recs[(item, name)]
        rec.setdefault(refs.CHUNK_HASH, [None] * len(rec["owners"]))[c] = h
        if b >= 0:
          rec.setdefault(refs.CHUNK_BASE, [-1] * len(rec["owners"]))[c] = index[b]
      for item, lo, hi, h, b in report["packed"]:
        pieces = items[item].setdefault(refs.PACKED_PIECES, {}).setdefault(str(p), [])
        pieces.append([lo, hi, index[b] if b >= 0 else -1, h])
    for meta in items.values():
      for ps in meta.get(refs.PACKED_PIECES, {}).values():
        ps.sort()
    missing = [k for k, r in recs.items() if r["owners"] and "packed_offset" not in r
               and None in r.get(refs.CHUNK_HASH, [None])]
    if missing:
      raise errors.StorageError(f"differential save to {self.loc}: no process reported the"
                                f" chunks of {missing[:3]}; nothing was committed.")
    return dict(manifest, items=items, **{
        refs.BASES: [{"dir": d, "generation": g} for d, g in homes],
        refs.STORED_BYTES: {"own": sum(r["written"] for r in reports),
                            "borrowed": sum(r["reused"] for r in reports)},
        SCRUB_TURN: self.turn})


def segments(piece: Any, chunk: int) -> list[tuple[int, int]]:
  """``[lo, hi)`` of the segments a packed piece is decided in: whole small arrays, a new
  segment at the first array that starts in a later packed chunk (``chunk`` bytes).

  Every array lies in one segment (so it is read from one step), and a segment spans
  little more than one chunk, so a changed array rewrites about one chunk, not the piece.
  """
  start, end = piece.slices[0].start, piece.slices[0].stop
  cuts = [start]
  for b in sorted({start + s.offset for s in piece.sources}):
    if b > cuts[-1] and b // chunk > cuts[-1] // chunk:
      cuts.append(b)
  return list(zip(cuts, cuts[1:] + [end]))


def _plain(v: Any) -> Any:
  """A planned record's JSON value as a decoded record holds it (lists become tuples)."""
  return tuple(v) if isinstance(v, list) else v


def _chunk_index(slices: Sequence[slice], chunk_shape: Sequence[int], shape: Sequence[int]) -> int:
  """The C-order number of the chunk that starts at ``slices``."""
  c = 0
  for s, n, size in zip(slices, chunk_shape, shape):
    c = c * (-(-size // n)) + (s.start or 0) // n
  return c


def check_location(loc: Location) -> None:
  """Differential saves need a local file system: ValueError naming ``loc`` and the fix (a
  manager checks its directory when it is made, before the job trains to its first save)."""
  if not loc.is_local:
    raise ValueError(f"differential=True: {loc} is not on a local file system; differential"
                     " saves (and the retention that keeps their bases) need one for now. Pass"
                     " differential=False (--config.checkpoint.differential=False) for object"
                     " stores.")


class Differential:
  """A checkpointer's differential setting, its pins, and the base of its next save.

  The base is the step :meth:`set_base` named (a manager names its latest
  step before every save), else the previous save of this checkpointer; it
  must be a sibling of the new checkpoint (same parent directory). A
  checkpointer without differential saves has none (its saves use the engine's
  plain hooks, :class:`orbax_flax.engine.saving.SaveHooks`).
  """

  def __init__(self):
    self.pins = Pins()
    self._base: Location | None = None
    self._last: Location | None = None

  def set_base(self, path: Any) -> None:
    """Names the step the next save compares with (None: the previous save of this checkpointer)."""
    self._base = None if path is None else Location.parse(path)

  def differ(self, plan: Any, alive: Any) -> Any:
    """The hooks of one save; ValueError before anything is written."""
    check_location(plan.loc)
    base, self._base, self._last = self._base or self._last, None, plan.loc
    return Differ(plan.manifest, plan.loc, base, self.pins, alive)
