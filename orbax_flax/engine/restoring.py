"""Restoring a checkpoint onto whatever mesh the caller's target describes.

The target is a dict of items, each a pytree whose leaves say what to build:

* ``jax.ShapeDtypeStruct`` with ``.sharding``, or a ``jax.Array`` (its shape,
  dtype and sharding are used): a ``jax.Array`` with that sharding. Each
  process reads only the chunks its own devices need, so any mesh, device
  count or process count works.
* ``np.ndarray``: a host numpy array of that dtype.
* a Python or numpy scalar, str or bytes: the saved value. A Python scalar
  (e.g. a ``TrainState``'s int ``step``) stays a Python scalar even when the
  checkpoint holds a 0-d array (a step saved after a jitted update).

A target dtype that differs from the saved one is converted with numpy's
``astype`` when that is exact (int8 -> float32); a conversion that loses
information (float32 -> bfloat16 or int8) needs ``allow_lossy_casts=True``.
Everything is checked before any array data is read: missing or extra keys,
shapes, dtypes, and shardings that do not divide the array.

The manifest is read and decoded once per restore (:func:`open_manifest`); the
records it holds become reads in :func:`orbax_flax.engine._reading.read_requests`.
With ``read_once`` (at the end of this module) an array the target replicates
across processes is read split over them, then gathered with collectives.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from orbax_flax.format import _layout
from orbax_flax.core import _location
from orbax_flax.core import _multihost
from orbax_flax.format import _manifest
from orbax_flax.engine import targets
from orbax_flax.engine import _reading
from orbax_flax.core import _staging
from orbax_flax.core import _tree
from orbax_flax import errors
from orbax_flax import formats
from orbax_flax.format import step_dir
from orbax_flax.differential import refs
from orbax_flax.engine import transforms as transforms_lib
from orbax_flax.core._location import Location
from orbax_flax.format._manifest import Array, Manifest, Summary
from orbax_flax.formats import orbax_checkpoint

log = logging.getLogger("orbax_flax")

TMP_MARKER = step_dir.TMP_MARKER


def _not_found(loc: Location) -> errors.CheckpointNotFoundError:
  """No checkpoint at ``loc``: say what is there instead, and what to pass."""
  if TMP_MARKER in loc.name:
    return errors.CheckpointNotFoundError(
        f"{loc} is the directory of a save that has not committed (in progress, or"
        " interrupted), not a checkpoint.")
  if loc.is_local and not os.path.exists(loc.local_path):
    return errors.CheckpointNotFoundError(
        f"no orbax_flax checkpoint at {loc}: the path does not exist.")
  if loc.is_local and os.path.isfile(os.path.join(loc.local_path, step_dir.RETIRED_KEY)):
    gen = refs.generation_of(loc.local_path)
    users = refs.borrowers(loc, gen) if gen is not None else []
    return errors.CheckpointNotFoundError(
        f"{loc} is retired data, not a checkpoint: the step was deleted by a keep rule (or"
        " replaced) while later differential steps borrowed bytes from it, so only those"
        " bytes are kept, for them" + (f" (now: {', '.join(users)})" if users else "") +
        f". Restore a committed step (python -m orbax_flax list"
        f" {os.path.dirname(loc.local_path)}).")
  return errors.CheckpointNotFoundError(f"no orbax_flax checkpoint at {loc}: {_what_is_there(loc)}")


def _what_is_there(loc: Location) -> str:
  ocp_steps = orbax_checkpoint.steps(loc)
  if ocp_steps:
    return (f"it is an orbax-checkpoint run directory holding {_steps_text(ocp_steps)}; pass one"
            f" step, e.g. {loc.join(str(ocp_steps[-1]))} (or one item of it, e.g."
            f" {loc.join(str(ocp_steps[-1])).join('default')})")
  try:
    steps, leftovers = step_dir.list_steps(loc)
  except NotADirectoryError:
    return "it is not a directory."
  except errors.StorageError as e:  # e.g. a bucket that does not exist
    return f"it cannot be listed: {e}"
  if steps:
    return (f"it is a directory of steps, holding {_steps_text(steps)}; pass one of them, e.g."
            f" {loc.join(str(steps[-1]))}")
  try:
    inner, _ = step_dir.list_steps(loc.join("checkpoints"))
  except (NotADirectoryError, errors.StorageError):
    inner = []
  if inner:
    return (f"it looks like a run's workdir: its checkpoints are in {loc.join('checkpoints')},"
            f" holding {_steps_text(inner)}; pass e.g. {loc.join('checkpoints').join(str(inner[-1]))}")
  names = set(os.listdir(loc.local_path)) if loc.is_local else set()
  if names & {"_sharding", "manifest.ocdbt", "commit_success.txt"}:
    return ("it looks like an orbax-checkpoint checkpoint without its _METADATA (an unfinished"
            " save?); nothing here can be read.")
  if leftovers:
    return ("it holds only uncommitted saves (in progress or interrupted): "
            + ", ".join(l.name for l in leftovers[:3]))
  if not loc.is_local and not _location.list_keys(loc):
    return "nothing is stored under this prefix: check the bucket name and the path."
  return "the path exists but holds no committed checkpoint (a save in progress or interrupted?)."


def _steps_text(steps: list[int]) -> str:
  shown = ", ".join(map(str, steps)) if len(steps) <= 6 else (
      f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-2:]))}")
  return f"step(s) [{shown}]"


def _manifest_bytes(loc: Location) -> bytes | None:
  """The manifest file's bytes (None: none), refused beyond ``MAX_MANIFEST_BYTES`` or as a link.

  Raises:
    CheckpointFormatError: a manifest larger than the cap (read no further than the cap), or
      a symbolic link (a checkpoint reads only its own files) or another special file.
  """
  where = f"{loc}/{_manifest.MANIFEST_KEY}"
  if loc.is_local:  # a link would lead anywhere; a FIFO would block the read forever
    _location.refuse_special(os.path.join(loc.local_path, _manifest.MANIFEST_KEY), str(loc))
  data = _location.read_key(loc, _manifest.MANIFEST_KEY, max_bytes=_manifest.MAX_MANIFEST_BYTES + 1)
  if data is not None and len(data) > _manifest.MAX_MANIFEST_BYTES:
    raise errors.CheckpointFormatError(
        f"{where} is larger than {_manifest.MAX_MANIFEST_BYTES >> 20} MiB, the most a manifest"
        " may hold (orbax_flax writes none larger); damaged or crafted, it is not read.")
  return data


def read_manifest(loc: Location) -> Manifest:
  """The committed manifest at ``loc``; CheckpointNotFoundError if none."""
  data = None if TMP_MARKER in loc.name else _manifest_bytes(loc)
  if data is None:
    raise _not_found(loc)
  return _manifest.decode(data, f"{loc}/{_manifest.MANIFEST_KEY}")


def _parked_instead(loc: Location) -> Location | None:
  """Where the committed step ``loc`` (a local ``<root>/<step>`` without a manifest) is
  parked while a differential save of its number runs
  (:func:`orbax_flax.differential.retention.make_room`). None if it is not parked."""
  if not loc.is_local:
    return None
  root, name = os.path.split(loc.local_path)
  for other in step_dir.retired_dirs(root):
    parsed = step_dir.parse_retired(other)
    if parsed is not None and parsed[0] == name and step_dir.is_parked(os.path.join(root, other)):
      return Location.parse(os.path.join(root, other))
  return None


def _committed_manifest(loc: Location, read: Callable[[Location], bytes | None]
                        ) -> tuple[Location, bytes | None]:
  """Where the committed step ``loc`` is, and what ``read`` reads of its manifest there
  (None: no committed manifest). A step parked for a differential save of its number is still
  the committed step until that save commits, read where it is parked; once it is retired
  (that save committed: its bytes stay where they are, so a read under way goes on), or
  moved back (the save failed), it is read at ``loc`` again."""
  if TMP_MARKER in loc.name:
    return loc, None
  data = read(loc)
  if data is None and (parked := _parked_instead(loc)) is not None:
    data = read(parked)
    if data is not None:
      return parked, data
    data = read(loc)  # retired or moved back since
  return loc, data


def open_manifest(path: Any) -> tuple[Location, Manifest]:
  """The manifest of the checkpoint at ``path``, in any format ``restore`` reads.

  Ours is read and verified; an orbax-checkpoint or safetensors checkpoint is
  described by an in-memory manifest of the same shape (see
  :mod:`orbax_flax.formats`). A step parked for a differential save of its number is read
  where it is parked (:func:`_committed_manifest`).
  """
  loc = Location.parse(path)
  if TMP_MARKER not in loc.name:
    loc, data = _committed_manifest(loc, _manifest_bytes)
    if data is not None:
      return loc, _manifest.decode(data, f"{loc}/{_manifest.MANIFEST_KEY}")
    foreign = formats.open_foreign(loc)
    if foreign is not None:
      return loc, foreign
  raise _not_found(loc)


def reader_for(loc: Location, manifest: Manifest, max_host_bytes: int = 0,
               progress: Any = None) -> _reading.Reader | None:
  """The engine's reader for our own format; None for a foreign one (its leaves read themselves)."""
  if manifest.format != _manifest.FORMAT:
    return None
  return _reading.Reader(loc, manifest, max_host_bytes, progress)


def read_summary(loc: Location) -> Summary:
  """The manifest's summary (time, sizes, custom metadata), reading a few KB."""
  loc, data = _committed_manifest(loc, lambda at: _location.read_key(
      at, _manifest.MANIFEST_KEY, max_bytes=_manifest.SUMMARY_READ_BYTES))
  if data is None:
    raise _not_found(loc)
  where = f"{loc}/{_manifest.MANIFEST_KEY}"
  summary = _manifest.decode_summary(data, where)
  extent = _manifest.summary_extent(data) if summary is None else None
  if extent is not None and len(data) < extent <= _manifest.MAX_MANIFEST_BYTES:  # a long summary
    data = _location.read_key(loc, _manifest.MANIFEST_KEY, max_bytes=extent)
    summary = None if data is None else _manifest.decode_summary(data, where)
  if summary is None:  # a long summary of a manifest that does not say its length: read it all
    summary = read_manifest(loc).summary()
  return summary


def referenced_generations(root: Location, exclude: int | None = None) -> set[str] | None:
  """Generations the committed steps under ``root`` (but ``exclude``) borrow from (their
  summaries' ``bases``; see :mod:`orbax_flax.differential.refs`).

  None when a step's summary cannot be read: what it references is unknown.

  Example:
    >>> import tempfile
    >>> referenced_generations(Location.parse(tempfile.mkdtemp()))
    set()
  """
  gens: set[str] = set()
  steps, _ = step_dir.list_steps(root)
  for step in steps:
    if step == exclude:
      continue
    try:
      summary = read_summary(root.join(str(step)))
    except errors.CheckpointNotFoundError:
      continue  # deleted meanwhile
    except errors.CheckpointError:
      return None
    gens |= {b.generation for b in summary.bases}  # (checked by the decoder)
  return gens


def restore(path: Any, target: Mapping[str, Any] | None = None, *, partial: bool = False,
            allow_lossy_casts: bool = False, transforms: Any = None, read_once: bool = False,
            max_host_bytes: int | None = None, progress: Any = None,
            casts: list | None = None) -> dict[str, Any]:
  """Restores a checkpoint of any format, resharded onto the target's shardings.

  Reads our own checkpoints, orbax-checkpoint ones (an item, a step of its
  ``CheckpointManager``) and safetensors files or directories; the format is
  detected from the files (``metadata(path).format``). A checkpoint with one
  unnamed item (safetensors, one orbax pytree item) is read by a target of one
  item, whatever its name.

  Args:
    path: the checkpoint (local path, URL or kvstore spec dict).
    target: item name -> pytree of ``jax.ShapeDtypeStruct`` (with sharding),
      ``jax.Array``, ``np.ndarray`` or scalars, or None to restore that item
      whole as host values in its saved structure. Items not named are not read.
      None restores every item as host numpy arrays in the saved structure
      (namedtuples come back as namedtuples, other custom nodes as dicts, PRNG
      keys as single-device key arrays).
    partial: restore only the leaves the target names. Otherwise a leaf in the
      checkpoint that the target lacks is an error.
    max_host_bytes: a budget for host memory beyond the restored arrays
      (0 or None: none): arrays are read and placed in rounds of at most this many
      bytes, and temporary buffers stay within it (plus one chunk).
    allow_lossy_casts: allow dtype conversions that lose information (float to
      int or bool, a wider type into a narrower one such as float32 to
      bfloat16). Without it they are reported, by key path, before any data is
      read; exact ones (int8 to float32, bfloat16 to float32) always happen.
    progress: an ``orbax_flax.core._progress.Progress`` updated with the bytes read.
    casts: a list that receives ``(key path, saved dtype, target dtype, exact)``
      for every conversion made.
    transforms: a list of :mod:`orbax_flax.engine.transforms` (rename, drop, take
      from the target, stack, unstack, cast), applied in order to what the
      checkpoint holds before the target is checked.
    read_once: read each array once across its replicas, then broadcast:
      an array the target replicates over some mesh axes (data-parallel
      copies, often on other hosts) is read split over those axes as well, so
      each byte comes from storage once, and a resharding jit gathers it with
      collectives (gloo on CPU, NCCL on GPU). Saves storage bandwidth when many
      replicas read one checkpoint; costs a collective.

  Returns:
    item name -> restored pytree, with the target's structure.

  Raises:
    CheckpointNotFoundError: no committed checkpoint at ``path``.
    TreeMismatchError: target and checkpoint disagree; lists every difference.
    CheckpointCorruptedError: a chunk fails its checksum.

  Example:
    >>> import jax, numpy as np, orbax_flax as ofx, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> ofx.save(path, {"state": {"w": np.arange(4, dtype=np.float32), "b": np.zeros(2)}})
    >>> sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> target = {"state": {"w": jax.ShapeDtypeStruct((4,), np.float32, sharding=sharding)}}
    >>> ofx.restore(path, target, partial=True)["state"]["w"]
    Array([0., 1., 2., 3.], dtype=float32)
  """
  loc, manifest = open_manifest(path)
  if target is not None and not isinstance(target, Mapping):
    raise TypeError(f"target must be a dict of item name -> pytree (e.g. {{'state':"
                    f" abstract_state}}) or None; got {type(target).__name__}")
  options = dict(partial=partial, allow_lossy_casts=allow_lossy_casts, transforms=transforms,
                 max_host_bytes=max_host_bytes or 0, progress=progress, casts=casts)
  retries = _REPLACED_RETRIES
  while True:
    try:
      if read_once and target is not None:
        read_target = _read_once_target(dict(target), None if transforms else manifest)
        out = _restore_opened(loc, manifest, read_target, **options)
        return _reshard_like(out, {k: target[k] for k in out})
      return _restore_opened(loc, manifest, target, **options)
    except (errors.CheckpointCorruptedError, errors.StorageError) as e:
      now = _changed_under_read(loc, manifest, e)
      if now is None or not retries:
        raise
      log.info("%s was replaced while it was read (an overwrite); reading the new one", loc)
      manifest, retries = now, retries - 1


# A checkpoint overwritten while it is read is read again, from its new manifest, this often.
_REPLACED_RETRIES = 2


def _changed_under_read(loc: Location, manifest: Manifest, error: BaseException
                        ) -> Manifest | None:
  """After a failed read of our own checkpoint: its new manifest if an overwrite replaced
  it meanwhile (a new generation: read it instead), None if it is the one that was read
  (the failure stands).

  Raises:
    CheckpointNotFoundError: the checkpoint was deleted while it was read (by a keep rule
      of the job that writes there, say): no damage, and nothing read is returned.
  """
  if manifest.format != _manifest.FORMAT:
    return None
  try:
    data = _manifest_bytes(loc)
  except errors.CheckpointError:
    return None
  if data is None:
    raise errors.CheckpointNotFoundError(
        f"{loc} was deleted while it was read (a keep rule of the job that writes there?);"
        " nothing read from it is returned. Restore a step that is still committed.") from error
  try:
    now = _manifest.decode(data, f"{loc}/{_manifest.MANIFEST_KEY}")
  except errors.CheckpointError:
    return None
  return now if now.generation != manifest.generation else None


def _restore_opened(loc: Location, manifest: Manifest, target: Mapping[str, Any] | None, *,
                   partial: bool = False, allow_lossy_casts: bool = False, transforms: Any = None,
                   max_host_bytes: int = 0, progress: Any = None,
                   casts: list | None = None) -> dict[str, Any]:
  """:func:`restore` of the checkpoint at ``loc`` whose manifest is decoded already."""
  if target is not None:
    manifest = _match_items(manifest, list(target))
  from_target = []
  if transforms:
    manifest = transforms_lib.apply(manifest, transforms)
    from_target = transforms_lib.from_target(transforms)
  if target is None:
    return _restore_all(loc, manifest, max_host_bytes=max_host_bytes, progress=progress)

  match = targets.match_target(manifest, target, partial=partial,
                               allow_lossy_casts=allow_lossy_casts, casts=casts,
                               from_target=from_target, source=str(loc))
  wants, whole = match.wants, match.whole
  if progress is not None:
    progress.total = sum(w.rec.nbytes for w, _, _ in wants) + sum(
        r.nbytes for i in whole for r in manifest.items[i].leaves)
    progress.phase = "reading"
  arrays = read_arrays(loc, manifest, [w for w, _, _ in wants], max_host_bytes, progress)
  out = _restore_all(loc, manifest, whole, max_host_bytes, progress) if whole else {}
  out.update(match.trees(arrays))
  return {item: out[item] for item in target if item in out}


def _match_items(manifest: Manifest, wanted: list[str]) -> Manifest:
  """``manifest`` with its one item renamed to the one the target names, where allowed.

  A safetensors checkpoint or a single orbax pytree item has one unnamed item:
  a target ``{"params": ...}`` (any name) reads it.
  """
  if not manifest.any_item or len(manifest.items) != 1 or len(wanted) != 1:
    return manifest
  (only,) = manifest.items.values()
  return dataclasses.replace(manifest, items={wanted[0]: only})


def _restore_all(loc: Location, manifest: Manifest, items: list[str] | None = None,
                 max_host_bytes: int = 0, progress: Any = None) -> dict[str, Any]:
  """Items (default: all) as host numpy arrays, in the saved structure."""
  wants, slots = [], []
  values: dict[str, list[Any]] = {}
  chosen = {k: v for k, v in manifest.items.items() if items is None or k in items}
  for item, saved_item in chosen.items():
    leaves = saved_item.leaves
    values[item] = [None] * len(leaves)
    for i, rec in enumerate(leaves):
      if not isinstance(rec, Array):
        values[item][i] = rec.decoded()
        continue
      shape = rec.shape
      wants.append(targets.Want(item, rec, rec.np_dtype, None, shape, rec.key_impl,
                                {tuple((0, s) for s in shape): ()}))
      slots.append((item, i))
  if progress is not None and not progress.total:
    progress.total, progress.phase = sum(w.rec.nbytes for w in wants), "reading"
  for (item, i), value in zip(slots, read_arrays(loc, manifest, wants, max_host_bytes, progress)):
    values[item][i] = value
  return {item: _tree.decode_structure(saved_item.structure, values[item])
          for item, saved_item in chosen.items()}


def _windows(wants: list[targets.Want], budget: int) -> list[list[int]]:
  """Indices of ``wants`` in rounds of at most ``budget`` bytes of host data (0: one round)."""
  if not budget:
    return [list(range(len(wants)))]
  return _layout.split_by_size(
      [sum(math.prod(_layout.box_shape(b)) for b in w.boxes) * np.dtype(w.dtype).itemsize
       for w in wants], budget)


def read_arrays(loc: Location, manifest: Manifest, wants: list[targets.Want],
                max_host_bytes: int = 0, progress: Any = None) -> list[Any]:
  """Reads the wanted arrays into fresh buffers, then builds host or device arrays.

  Every box is read straight into the memory that becomes the result (one
  mapping per array, so that each array frees its memory on its own), small
  packed arrays included. With a budget, arrays are read and placed in rounds.
  """
  reader = reader_for(loc, manifest, max_host_bytes, progress)
  if reader is not None:  # sizes checked against the stored chunks before any allocation
    problems = reader.stored_problems([(w.item, w.rec) for w in wants if isinstance(w.rec, Array)
                                       and not w.rec.reads_itself])
    if problems:
      raise errors.CheckpointCorruptedError("\n  ".join(problems.values()))
  out: list[Any] = [None] * len(wants)
  for window in _windows(wants, max_host_bytes):
    # With a budget, a converted array is read a chunk at a time into its final dtype
    # (else the whole array would be held in both dtypes at once).
    pieces = {i for i in window if max_host_bytes and _cast_in_pieces(wants[i])}
    # Each array's boxes, 64-byte aligned in one mapping of its own: JAX's CPU client
    # adopts aligned buffers without a copy, and each restored array frees its memory alone.
    shapes = _layout.box_shapes([wants[i].boxes for i in window])
    buffers = _staging.fresh_groups([[(shape, wants[i].dtype if i in pieces else wants[i].rec.np_dtype)
                                      for shape in box_shapes]
                                     for i, box_shapes in zip(window, shapes)])
    datas = {id(wants[i]): bufs for i, bufs in zip(window, buffers)}
    requests = [(wants[i].item, wants[i].rec, b, buf) for i in window if i not in pieces
                for b, buf in zip(wants[i].boxes, datas[id(wants[i])])]
    plain, derived = [], []  # with a budget, transforms' requests are read in blocks
    for r in requests:
      budgeted = max_host_bytes and isinstance(r[1], Array) and r[1].derived is not None
      (derived if budgeted else plain).append(r)
    _reading.read_requests(reader, plain, progress)
    _read_derived_in_blocks(reader, derived, max_host_bytes, progress)
    _read_cast_pieces(reader, [(wants[i], datas[id(wants[i])]) for i in sorted(pieces)],
                      max_host_bytes, progress)
    for i in window:
      w = wants[i]
      with np.errstate(over="ignore", invalid="ignore"):  # a lossy cast was asked for
        datas[id(w)] = [b if b.dtype == w.dtype else b.astype(w.dtype) for b in datas[id(w)]]
    for i, value in zip(window, assemble([wants[i] for i in window], datas)):
      out[i] = value
  return out


def _read_derived_in_blocks(reader: Any, requests: list[tuple], budget: int,
                           progress: Any) -> None:
  """Reads transforms' requests (``transforms=``: a cast, a transpose) in blocks of each box
  whose temporaries (the transform's source box, in the source's dtype) fit ``budget``: a
  transform reads its source into a temporary of its whole box, which for a whole shard was
  that shard again, outside the budget. Leading rows are taken whole where they fit, else
  one at a time and cut along the next axis (a layer of a stacked (L, d, 4d) array)."""
  blocks = []
  for item, rec, box, out in requests:
    for sub in _blocks(tuple(box), max(1, budget // _WIDEST)):
      where = tuple(slice(lo - b[0], hi - b[0]) for (lo, hi), b in zip(sub, box))
      blocks.append((item, rec, sub, out[where]))
  sizes = [math.prod(out.shape) * _WIDEST for _, _, _, out in blocks]
  for batch in _layout.split_by_size(sizes, budget):
    _reading.read_requests(reader, [blocks[j] for j in batch], progress)


_WIDEST = 16  # bytes per element of a transform's temporary, at most (complex128)


def _blocks(box: _layout.Box, limit: int):
  """Sub-boxes of ``box`` in order, each of at most ``limit`` elements where one element of
  the last axis allows: whole leading rows where they fit, else each row cut the same way.

  Example:
    >>> list(_blocks(((0, 4), (0, 3)), 6))
    [((0, 2), (0, 3)), ((2, 4), (0, 3))]
    >>> list(_blocks(((0, 2), (0, 4)), 2))
    [((0, 1), (0, 2)), ((0, 1), (2, 4)), ((1, 2), (0, 2)), ((1, 2), (2, 4))]
  """
  if not box or math.prod(hi - lo for lo, hi in box) <= limit:
    yield box
    return
  (lo, hi), rest = box[0], box[1:]
  inner = math.prod(b - a for a, b in rest)
  if inner <= limit:
    rows = max(1, limit // max(inner, 1))
    for a in range(lo, hi, rows):
      yield ((a, min(a + rows, hi)),) + rest
    return
  for a in range(lo, hi):
    for sub in _blocks(rest, limit):
      yield ((a, a + 1),) + sub


def _cast_in_pieces(w: targets.Want) -> bool:
  """Whether ``w`` converts a stored array of ours read chunk by chunk (not packed, not a
  transform's or a foreign format's)."""
  rec = w.rec
  return (np.dtype(w.dtype) != rec.np_dtype and isinstance(rec, Array) and bool(rec.owners)
          and rec.chunk_shape is not None and not rec.is_packed and not rec.reads_itself)


def _read_cast_pieces(reader: Any, cast: list[tuple[targets.Want, list[np.ndarray]]],
                      budget: int, progress: Any) -> None:
  """Reads converted arrays a stored chunk at a time, each converted into its final buffers.

  What the wanted boxes need of one chunk (its pieces, one per box it meets) is read as
  one region of the stored dtype, where the pieces tile a box: the whole chunk, where the
  boxes hold all of it, which on a local file system is read straight from its file into
  that temporary memory (no copy of the chunk beside it); else piece by piece. The pieces are then converted
  from it into the final buffers. Temporary memory: at most ``budget`` bytes of regions at
  a time, or one region (at most a chunk) where that is larger.
  """
  regions = []  # (want, a region of one chunk, [(final buffer, where in it, where in region)])
  for w, finals in cast:
    grid = _layout.Chunking(w.rec.shape, w.rec.chunk_shape)
    per_chunk: dict[int, list[tuple[np.ndarray, Any, _layout.Box]]] = {}
    for box, final in zip(w.boxes, finals):
      for flat in grid.chunks_in_box(box):
        piece = _layout.intersect(grid.chunk_box(flat), box)
        per_chunk.setdefault(flat, []).append((final, _layout.relative(piece, box), piece))
    for parts in per_chunk.values():
      for region, tiled in _tiles(parts):
        regions.append((w, region, [(final, where, _layout.relative(piece, region))
                                    for final, where, piece in tiled]))
  sizes = [math.prod(_layout.box_shape(r)) * w.rec.np_dtype.itemsize for w, r, _ in regions]
  for batch in _layout.split_by_size(sizes, budget):
    _read_and_convert(reader, [regions[j] for j in batch], progress)


def _read_and_convert(reader: Any, regions: list[tuple[targets.Want, _layout.Box, list]],
                      progress: Any) -> None:
  """One batch of :func:`_read_cast_pieces`, its temporary memory freed on return (a loop
  variable still bound to the previous batch's last temporary held it while the next batch
  allocated its own: two at once)."""
  temps = [np.empty(_layout.box_shape(region), w.rec.np_dtype) for w, region, _ in regions]
  _reading.read_requests(reader, [(w.item, w.rec, region, temp)
                                  for (w, region, _), temp in zip(regions, temps)], progress)
  with np.errstate(over="ignore", invalid="ignore"):  # a lossy cast was asked for
    for (_, _, parts), temp in zip(regions, temps):
      for final, where, within in parts:
        final[where] = temp[within]


def _tiles(parts: list[tuple[np.ndarray, Any, _layout.Box]]
           ) -> list[tuple[_layout.Box, list[tuple[np.ndarray, Any, _layout.Box]]]]:
  """The regions to read for one chunk's ``parts`` (final buffer, where, piece): their
  bounding box once, where the pieces fill it exactly (they never overlap: each is another
  box's), else each piece alone.

  >>> a = np.empty(0)
  >>> [r for r, _ in _tiles([(a, (), ((0, 4), (0, 2))), (a, (), ((0, 4), (2, 8)))])]
  [((0, 4), (0, 8))]
  >>> [r for r, _ in _tiles([(a, (), ((0, 2), (0, 2))), (a, (), ((2, 4), (4, 8)))])]
  [((0, 2), (0, 2)), ((2, 4), (4, 8))]
  """
  pieces = [piece for _, _, piece in parts]
  bound = tuple((min(p[d][0] for p in pieces), max(p[d][1] for p in pieces))
                for d in range(len(pieces[0])))
  if sum(math.prod(_layout.box_shape(p)) for p in pieces) == math.prod(_layout.box_shape(bound)):
    return [(bound, parts)]
  return [(part[2], [part]) for part in parts]


def assemble(wants: list[targets.Want], datas: dict[int, list[np.ndarray]]) -> list[Any]:
  """Host arrays as they are; device arrays placed with one batched device_put.

  The placement of every tier (the local tier's too), PRNG keys wrapped back.

  ``datas`` holds, per want, one array per box of ``want.boxes``. An
  uncommitted want (its target was an uncommitted single-device array) is put
  on the default device without committing it, so that a jitted step may use
  it beside arrays on any mesh, as it could before the save.
  """
  out: list[Any] = [None] * len(wants)
  sharded: list[tuple[int, int]] = []  # (want index, number of shards)
  values, devices_, alias = [], [], []
  for i, w in enumerate(wants):
    boxes = datas[id(w)]
    if w.sharding is None:
      out[i] = boxes[0]
    else:
      n = 0
      kind = w.sharding.memory_kind  # host-offloaded ("pinned_host") targets land there
      for devices, data in zip(w.boxes.values(), boxes):
        for j, device in enumerate(devices):
          # The first device may use the buffer in place (zero-copy on CPU when
          # aligned); the others get copies, so donating one cannot change another.
          values.append(data)
          if not w.committed:
            devices_.append(None)
          elif kind is None or kind == device.default_memory().kind:
            devices_.append(device)
          else:
            devices_.append(jax.sharding.SingleDeviceSharding(device, memory_kind=kind))
          alias.append(j == 0)
          n += 1
      sharded.append((i, n))
  placed = jax.device_put(values, devices_, may_alias=alias) if values else []
  k = 0
  for i, n in sharded:
    w = wants[i]
    out[i] = (jax.make_array_from_single_device_arrays(w.shape, w.sharding, placed[k:k + n])
              if w.committed else placed[k])
    k += n
  for i, w in enumerate(wants):
    if w.key_impl:
      out[i] = jax.random.wrap_key_data(out[i], impl=w.key_impl)
    elif w.weak:
      out[i] = _multihost.weak_typed(out[i])
  return out


# ------------------------------------------------ read_once: each replicated byte read once

def read_once_spec(sharding: jax.sharding.NamedSharding, shape: tuple[int, ...],
                   chunk_shape: tuple[int, ...] | None = None) -> jax.sharding.PartitionSpec:
  """``sharding``'s spec with the mesh axes it replicates over across processes added where
  they divide (so that each process reads a distinct part).

  With the stored ``chunk_shape``, an axis is added only along a dimension
  where each process's part is made of whole chunks: storage is read in whole
  chunks, so any other split would read the same bytes and add a collective.

  Example:
    >>> import numpy as np
    >>> n = len(jax.devices())
    >>> mesh = jax.make_mesh((2, n // 2), ("data", "model")) if n % 2 == 0 else None
    >>> P = jax.sharding.PartitionSpec
    >>> # One process: its replicas are read once already, so nothing changes.
    >>> mesh is None or read_once_spec(jax.sharding.NamedSharding(mesh, P(None, "model")),
    ...                                (8, 4 * n)) == P(None, "model")
    True
  """
  spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  used = {a for p in spec if p is not None for a in ((p,) if isinstance(p, str) else p)}
  sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape))
  procs = np.vectorize(lambda d: d.process_index)(sharding.mesh.devices)
  for k, axis in enumerate(sharding.mesh.axis_names):
    # Replicas within one process are read once already (one read, copies to its devices):
    # only axes along which the processes change are worth a collective.
    crosses = bool((procs != np.take(procs, [0], axis=k)).any())
    if axis in used or sizes[axis] == 1 or not crosses:
      continue
    for d, n in enumerate(shape):
      parts = () if spec[d] is None else ((spec[d],) if isinstance(spec[d], str) else tuple(spec[d]))
      split = math.prod(sizes[a] for a in parts) * sizes[axis]
      whole_chunks = chunk_shape is None or (n % split == 0 and (n // split) % chunk_shape[d] == 0)
      if n % split == 0 and whole_chunks:
        spec[d] = parts + (axis,) if parts else axis
        used.add(axis)
        break
  return jax.sharding.PartitionSpec(*spec)


def _read_once_target(target: dict[str, Any], manifest: Manifest | None) -> dict[str, Any]:
  """The target to read with for ``read_once``: leaves split further where that saves bytes.

  ``manifest`` (None: unknown, e.g. under transforms) gives each array's stored
  chunk shape; a packed array (small, stored inside a shared buffer) is read
  as it is.
  """
  out = {}
  for item, tree in target.items():
    if manifest is None:
      out[item] = jax.tree.map(lambda x: _read_once_leaf(x, None), tree)
      continue
    saved_item = manifest.items.get(item)
    saved = saved_item.by_path() if saved_item is not None else {}

    def leaf_for(path, x, saved=saved):
      rec = saved.get(path, saved.get(path + ("value",)))  # a Linen box: saved at its own path
      if not isinstance(rec, Array) or rec.is_packed or not rec.chunk_shape:
        return x
      return _read_once_leaf(x, rec.chunk_shape)
    out[item] = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree),
                                             [leaf_for(p, x) for p, x in _tree.flatten(tree)])
  return out


def _read_once_leaf(leaf: Any, chunk_shape: tuple[int, ...] | None) -> Any:
  sharding = getattr(leaf, "sharding", None)
  if not isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array)) or not isinstance(
      sharding, jax.sharding.NamedSharding) or targets.is_key_dtype(leaf.dtype):
    return leaf
  if chunk_shape is not None and len(chunk_shape) != len(leaf.shape):
    chunk_shape = None
  spec = read_once_spec(sharding, tuple(leaf.shape), chunk_shape)
  full = lambda sp: tuple(sp) + (None,) * (len(leaf.shape) - len(sp))  # noqa: E731
  if full(spec) == full(sharding.spec):  # P(None, None) is P(): nothing to split, no collective
    return leaf
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                              sharding=jax.sharding.NamedSharding(sharding.mesh, spec),
                              weak_type=getattr(leaf, "weak_type", False))


def _reshard_like(out: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
  """Arrays of ``out`` moved onto the target's shardings with one jit (collectives).

  An item whose target is None (restored as saved, e.g. a data iterator's position)
  is returned as read.
  """
  as_read = {k: v for k, v in out.items() if target.get(k) is None}
  if as_read:
    moved = _reshard_like({k: v for k, v in out.items() if k not in as_read},
                          {k: t for k, t in target.items() if k not in as_read})
    return {k: as_read[k] if k in as_read else moved[k] for k in out}
  flat_out, treedef = jax.tree_util.tree_flatten(out)
  flat_target = treedef.flatten_up_to(target)
  idx = [i for i, (x, t) in enumerate(zip(flat_out, flat_target))
         if isinstance(x, jax.Array) and getattr(t, "sharding", None) is not None
         and x.sharding != t.sharding]
  if idx:
    shardings = tuple(flat_target[i].sharding for i in idx)
    moved = jax.jit(lambda *xs: xs, out_shardings=shardings)(*(flat_out[i] for i in idx))
    for i, x in zip(idx, moved):
      flat_out[i] = x
  return jax.tree_util.tree_unflatten(treedef, flat_out)
