"""Writing safetensors files from a live, possibly sharded, multi-process tree.

:func:`export_safetensors` writes Hugging Face's layout (see
:mod:`orbax_flax.formats.safetensors_io`, which reads it) without gathering
the tree: process 0 lays out the files (headers, sizes), every process writes
the boxes of the arrays it owns (the shards whose ``replica_id`` is 0) with
``pwrite``, and process 0 commits by renaming the finished directory into
place, as our checkpoints do. The target directory must be on a file system
every process can write.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
import struct
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from orbax_flax import errors
from orbax_flax.format import _layout
from orbax_flax.core import _location
from orbax_flax.core import _multihost
from orbax_flax.engine import _selecting
from orbax_flax.core import _tree
from orbax_flax.core._location import Location
from orbax_flax.differential import refs
from orbax_flax.format import _manifest
from orbax_flax.formats import _checks
from orbax_flax.formats import _cbytes
from orbax_flax.formats.safetensors_io import INDEX_NAME, SINGLE_NAME, dtype_name, little_endian

log = logging.getLogger("orbax_flax")
_TMP = ".ofx-tmp-export"



def _default_name(path: tuple[str, ...]) -> str:
  return ".".join(path)


def _file_layout(entries: list[tuple[str, tuple[int, ...], np.dtype]], max_shard_bytes: int
            ) -> list[list[int]]:
  """Entry indices per file: in order, a new file when the next tensor would overflow."""
  return _layout.split_by_size(
      [int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for _, shape, dtype in entries],
      max_shard_bytes)


def _header_bytes(entries, idxs, metadata: Mapping[str, str]) -> tuple[bytes, list[int]]:
  header: dict[str, Any] = {"__metadata__": dict(metadata)}
  offsets, at = [], 0
  for i in idxs:
    name, shape, dtype = entries[i]
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [at, at + n]}
    offsets.append(at)
    at += n
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the package writes it
  return struct.pack("<Q", len(raw)) + raw, offsets


def _as_dtype(x: Any) -> np.dtype:
  return _tree.dtype_from_name(x) if isinstance(x, str) else np.dtype(x)


def _cast_to(dtype: Any, name: str, leaf_dtype: np.dtype) -> np.dtype:
  """The dtype a leaf is written in, from ``export_safetensors``'s ``dtype`` argument."""
  if dtype is None:
    return leaf_dtype
  if callable(dtype) and not isinstance(dtype, (str, np.dtype, type)):
    chosen = dtype(name, leaf_dtype)
    return leaf_dtype if chosen is None else _as_dtype(chosen)
  # One dtype for the tree converts floating arrays only: step counters stay integers.
  return _as_dtype(dtype) if jax.numpy.issubdtype(leaf_dtype, jax.numpy.floating) else leaf_dtype


def name_clash(names: Any) -> str | None:
  """Why tensor ``names`` read back as no tree (one name is also a prefix of another: ``a``
  and ``a.b``), or None.

  Example:
    >>> name_clash(["a", "b.c"]) is None, name_clash(["a", "a.b"]) is None
    (True, False)
  """
  try:
    _tree.structure_from_paths([tuple(n.split(".")) for n in names])
  except errors.TreeMismatchError as e:
    return f"{e} (tensor names split at '.')"
  return None


def export_safetensors(path: str, tree: Any, *, dtype: Any = None, max_shard_bytes: int = 5 << 30,
                       name_fn: Callable[[tuple[str, ...]], str] | None = None,
                       metadata: Mapping[str, str] | None = None, overwrite: bool = False,
                       coordination_timeout_seconds: float = _multihost.DEFAULT_TIMEOUT_S,
                       select: str | None = None) -> list[str]:
  """Writes ``tree`` as safetensors in the Hugging Face layout, committed atomically.

  Every process of a multi-process job calls it with its part of the same
  tree; each writes the array boxes it owns, so nothing is gathered on one
  host. One file is ``model.safetensors``; more are
  ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``.

  Args:
    path: the directory to create (local; shared by all processes).
    tree: a pytree of ``jax.Array``, numpy arrays and numeric scalars.
    dtype: None (keep), one dtype for every floating array (e.g.
      ``"bfloat16"``; integer and bool arrays are kept), or a function
      ``(name, dtype) -> dtype or None``.
    max_shard_bytes: the most tensor bytes per file (a tensor larger than it
      gets a file of its own).
    name_fn: key path tuple -> tensor name; default joins with ``.``
      (``("params", "Dense_0", "kernel")`` -> ``params.Dense_0.kernel``).
    metadata: strings for the header's ``__metadata__`` (default
      ``{"format": "pt"}``, which ``transformers`` loaders require).
    overwrite: replace an existing ``path`` (only after the new one is complete):
      an empty directory, an orbax_flax checkpoint or an earlier safetensors
      export; anything else there is refused.
    coordination_timeout_seconds: how long a process waits for the others.
    select: write only a part of ``tree``, named as ``init_from`` names it:
      ``"params"``, ``"params/decoder"``, several joined by ``,``
      (``"params,batch_stats"``); a TrainState's fields are its keys.

  Returns:
    The file names written, in order.

  Raises:
    ValueError: a leaf safetensors cannot hold, two leaves with one name, a
      name that is empty or not a string,
      ``path`` exists without ``overwrite``, or ``path`` holds something an
      export may not replace even with ``overwrite`` (see
      :func:`check_destination`); raised before anything is written.
    CheckpointCorruptedError: a source array failed its checksum while it was
      read (the export stops; nothing is committed, ``dst`` stays as it was).
    StorageError: writing failed on some process (e.g. the disk is full);
      nothing is committed.

  Example:
    >>> import numpy as np, orbax_flax as ofx, tempfile, os
    >>> from safetensors.numpy import load_file
    >>> d = os.path.join(tempfile.mkdtemp(), "model")
    >>> ofx.export_safetensors(d, {"dense": {"kernel": np.ones((2, 3), np.float32)}})
    ['model.safetensors']
    >>> load_file(os.path.join(d, "model.safetensors"))["dense.kernel"].shape
    (2, 3)
  """
  name_fn = name_fn or _default_name
  if select:
    tree = _selecting.pick(tree, select)
  flat = _tree.flatten(tree)
  entries: list[tuple[str, tuple[int, ...], np.dtype]] = []
  values: list[Any] = []
  problems: list[str] = []
  seen: dict[str, str] = {}
  for p, leaf in flat:
    where = _tree.path_str(p)
    kind = "lazy" if is_lazy(leaf) else _tree.leaf_kind(leaf)
    if kind is None or isinstance(leaf, (str, bytes)):
      problems.append(f"{where}: a {type(leaf).__name__} is not an array")
      continue
    if kind == "value":
      leaf = np.asarray(leaf)
    name = name_fn(p)
    if not isinstance(name, str) or not name:
      # safetensors_io reads a tensor without a name as damage, and no loader maps one to a
      # parameter: refused here rather than accepted there.
      problems.append(f"the leaf at key path {tuple(p)!r}: tensor name {name!r}; a tensor needs"
                      " a non-empty string name (orbax_flax reads an empty one as damage): rename"
                      " the key, or choose names with name_fn=")
      continue
    if name in seen:
      problems.append(f"{where}: tensor name {name!r} is also the name of {seen[name]}")
      continue
    seen[name] = where
    try:  # written little-endian, as safetensors stores it: a '>f4' array's bytes are swapped
      out_dtype = little_endian(_cast_to(dtype, name, np.dtype(leaf.dtype)))
      dtype_name(out_dtype)
    except (ValueError, TypeError) as e:
      problems.append(f"{where}: {e}")
      continue
    entries.append((name, tuple(int(s) for s in leaf.shape), out_dtype))
    values.append(leaf)
  clash = None if problems else name_clash(seen)
  if clash is not None:
    problems.append(f"{clash}; choose other names with name_fn=")
  if problems:
    raise ValueError("cannot export these leaves as safetensors:\n  " + "\n  ".join(problems))
  bad = {k: v for k, v in (metadata or {}).items()
         if not (isinstance(k, str) and isinstance(v, str))}
  if bad:
    raise TypeError(f"metadata must map strings to strings (safetensors' __metadata__), got"
                    f" {bad!r}; pass e.g. {{k: json.dumps(v)}} for other values")
  if max_shard_bytes <= 0:
    raise ValueError(f"max_shard_bytes={max_shard_bytes}; give a positive size such as 5 << 30")
  path = _checks.local_directory(path, "export_safetensors")
  check_destination(path, overwrite, "safetensors", is_safetensors_export)
  metadata = {"format": "pt", **(metadata or {})}
  files = _file_layout(entries, max_shard_bytes)
  n = len(files)
  names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
  tmp = path + _TMP
  key = _multihost.namespace("export", path, coordination_timeout_seconds)
  me = _multihost.process_index()

  def agree(stage: str, error: str) -> None:
    agree_on_stage(key, path, stage, error, coordination_timeout_seconds, tmp)

  where_of: dict[int, tuple[str, int]] = {}
  headers = []
  for f, idxs in zip(names, files):
    head, offsets = _header_bytes(entries, idxs, metadata)
    headers.append(head)
    for i, off in zip(idxs, offsets):
      where_of[i] = (f, len(head) + off)
  error = ""
  if me == 0:
    try:
      shutil.rmtree(tmp, ignore_errors=True)
      os.makedirs(tmp)
      for f, head, idxs in zip(names, headers, files):
        size = len(head) + sum(int(np.prod(entries[i][1], dtype=np.int64)) * entries[i][2].itemsize
                               for i in idxs)
        with open(os.path.join(tmp, f), "wb") as fh:
          fh.write(head)
          fh.truncate(size)
    except OSError as e:
      error = f"{type(e).__name__}: {e}"
  agree("layout", error)
  error = ""
  fds: dict[str, int] = {}
  try:
    for i, value in enumerate(values):
      f, base = where_of[i]
      shape, out_dtype = entries[i][1], entries[i][2]
      for box, data in owned_boxes(value, me):
        fd = fds.get(f)
        if fd is None:
          fd = fds[f] = os.open(os.path.join(tmp, f), os.O_WRONLY)
        _cbytes.pwrite_box(fd, base, shape, box, np.asarray(data).astype(out_dtype, copy=False))
        del data  # before the next array is read: one array in memory at a time
    for fd in fds.values():
      os.fsync(fd)
  except OSError as e:
    error = f"{type(e).__name__}: {e}"
  finally:
    for fd in fds.values():
      os.close(fd)
  agree("write", error)
  error = ""
  if me == 0:
    try:
      if n > 1:
        total = sum(int(np.prod(s, dtype=np.int64)) * d.itemsize for _, s, d in entries)
        index = {"metadata": {"total_size": total},
                 "weight_map": {entries[i][0]: names[k] for k, idxs in enumerate(files) for i in idxs}}
        with open(os.path.join(tmp, INDEX_NAME), "w") as fh:
          json.dump(index, fh, indent=2)
          fh.flush()
          os.fsync(fh.fileno())
      commit_dir(tmp, path)
    except OSError as e:
      error = f"{type(e).__name__}: {e}"
  agree("commit", error)
  return names


def is_lazy(leaf: Any) -> bool:
  """An array read on demand (``convert``'s streaming leaves): ``shape``, ``dtype`` and
  ``slabs(align)``, which yields ``(box, data)`` of whole rows, a multiple of ``align``."""
  return callable(getattr(leaf, "slabs", None)) and hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def owned_boxes(value: Any, me: int, align: int = 1):
  """``(box, host data)`` for the parts of ``value`` this process writes, one at a time (a
  lazy array's slabs are ``align`` rows a multiple: the first dimension of a chunk)."""
  if is_lazy(value):
    if me == 0:
      yield from value.slabs(align)
    return
  if isinstance(value, jax.Array):
    shape = value.shape
    owned = [(_layout.slices_to_box(s.index, shape), s) for s in value.addressable_shards
             if s.replica_id == 0]
    if not owned:
      return
    # The boxes this process owns usually tile one block (all of it on one
    # process): written as one box, the block is a few long runs instead of
    # one short run per row of every shard.
    bound = tuple((min(b[d][0] for b, _ in owned), max(b[d][1] for b, _ in owned))
                  for d in range(len(shape)))
    volume = lambda b: int(np.prod([hi - lo for lo, hi in b], dtype=np.int64))  # noqa: E731
    if len(owned) > 1 and sum(volume(b) for b, _ in owned) == volume(bound):
      block = np.empty(tuple(hi - lo for lo, hi in bound), value.dtype)
      for b, s in owned:
        block[tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(b, bound))] = np.asarray(s.data)
      yield bound, block
      return
    for box, shard in owned:
      yield box, np.asarray(shard.data)
    return
  if me == 0:
    value = _tree.canonical_bool(np.asarray(value))
    yield tuple((0, s) for s in value.shape), value


def agree_on_stage(key: str, where: str, stage: str, error: str, timeout_s: float,
                   tmp: str | None = None) -> None:
  """Every process reports ``stage`` of an export to ``where`` done (``error`` "") or failed;
  raises on every process, naming each failure, if any process failed. Then process 0
  removes the export's unfinished directory ``tmp`` first: every process has reported, so
  none writes there any more."""
  results = _multihost.all_gather(f"{key}/{stage}", error, timeout_s,
                                  what=f"finish export stage {stage!r}")
  failed = [f"process {i}: {e}" for i, e in enumerate(results) if e]
  if failed:
    if tmp is not None and _multihost.process_index() == 0:
      shutil.rmtree(tmp, ignore_errors=True)
    # The failures came as text (``TypeName: message``): a damaged source is corruption
    # (``verify`` names it), anything else the storage's failure.
    damaged = any(e.startswith(("CheckpointCorruptedError", "CheckpointFormatError"))
                  for e in results if e)
    cls = errors.CheckpointCorruptedError if damaged else errors.StorageError
    raise cls(f"export to {where} failed ({stage}); nothing was committed:\n  "
              + "\n  ".join(failed))


def is_safetensors_export(path: str) -> bool:
  """Whether the directory ``path`` holds only what :func:`export_safetensors` writes:
  ``model*.safetensors`` files and ``model.safetensors.index.json`` (no links, nothing else).

  Example:
    >>> import tempfile
    >>> d = tempfile.mkdtemp(); _ = open(os.path.join(d, "model.safetensors"), "wb")
    >>> is_safetensors_export(d)
    True
    >>> _ = open(os.path.join(d, "config.json"), "w"); is_safetensors_export(d)
    False
  """
  names = os.listdir(path)
  return bool(names) and all(
      (name == INDEX_NAME or fnmatch.fnmatchcase(name, "model*.safetensors"))
      and not os.path.islink(os.path.join(path, name)) and os.path.isfile(os.path.join(path, name))
      for name in names)


def check_destination(path: str, overwrite: bool, fmt: str,
                      is_earlier_export: Callable[[str], bool]) -> None:
  """Refuses, before anything is written, an export to ``path`` that would replace
  what it must not.

  An export commits by putting its directory where ``path`` was, and what was there
  goes (:func:`commit_dir`). So ``path`` may be an empty directory (even without
  ``overwrite``, as for :func:`orbax_flax.save`), or hold, with ``overwrite``: an orbax_flax checkpoint (``_CHECKPOINT``; disposed of as every
  overwrite disposes of one, kept while differential steps borrow from it), or an
  earlier export of the same format (``is_earlier_export(path)``). Anything else, a
  file, a symbolic link, a directory of steps or of someone's files, is refused even
  with ``overwrite``, as :func:`orbax_flax.save` refuses it.

  Args:
    path: the absolute path the export is to commit to.
    overwrite: whether replacing an earlier export or checkpoint was asked for.
    fmt: the format written, for messages ("safetensors", "orbax-checkpoint").
    is_earlier_export: directory -> whether it holds only what this export writes.

  Raises:
    ValueError: naming ``path``, what is there and what to do.

  Example:
    >>> import tempfile
    >>> d = tempfile.mkdtemp(); _ = open(os.path.join(d, "notes.txt"), "w")
    >>> try:
    ...   check_destination(d, True, "safetensors", is_safetensors_export)
    ... except ValueError as e:
    ...   print(str(e)[len(d):].split(";")[0])
     exists and is not an earlier safetensors export, an orbax_flax checkpoint or an empty directory: it holds notes.txt
  """
  if not os.path.lexists(path):
    return
  names = None
  if os.path.islink(path):
    there = "is a symbolic link"
  elif not os.path.isdir(path):
    there = "is a file"
  else:
    try:
      names = sorted(os.listdir(path))
      ours = os.path.isfile(os.path.join(path, _manifest.MANIFEST_KEY))
      there = "" if not names or ours or is_earlier_export(path) else (
          f"holds {', '.join(names[:5])}{f' and {len(names) - 5} more' if len(names) > 5 else ''}")
    except OSError as e:
      raise errors.StorageError(f"{path}: cannot look at what is there before exporting to it:"
                                f" {e}. Nothing was written.") from e
  if there:
    raise ValueError(
        f"{path} exists and is not an earlier {fmt} export, an orbax_flax checkpoint or an"
        f" empty directory: it {there}; refusing to replace it (even with overwrite=True), which"
        " would delete what it holds. Nothing was written. Export to a new path (e.g. a"
        " directory inside it), or remove it first if it is to go.")
  if not overwrite and names:  # an empty directory holds nothing to lose (as orbax_flax.save)
    raise ValueError(f"{path} exists; pass overwrite=True to replace it (the old one stays"
                     " until the new one is complete)")


def commit_dir(tmp: str, path: str) -> None:
  """Renames the finished ``tmp`` to ``path``; what was at ``path`` goes as every replaced
  checkpoint goes (:func:`orbax_flax.differential.refs.dispose_replaced`): removed, or kept
  as retired data while later differential steps borrow from it.

  The two are swapped atomically where the file system can, so that a reader of ``path``
  finds the old one or the new one; elsewhere the old one is moved aside first, to
  ``<path>.ofx-old-<random>`` (and back, should the new one not move in).

  Raises:
    OSError: nothing was committed (``tmp`` is still the new one, ``path`` the old one).
    Once committed, a failure (to fsync, or to dispose of the old one) is logged, not raised.
  """
  parent = os.path.dirname(path)
  old = None
  if os.path.lexists(path):
    if _location.exchange(tmp, path):
      old = tmp  # now holds what was at path
    else:
      old = f"{path}.ofx-old-{uuid.uuid4().hex[:8]}"
      os.rename(path, old)
  if old != tmp:
    try:
      os.rename(tmp, path)
    except OSError:
      if old is not None:
        os.rename(old, path)
      raise
  try:  # committed: what follows never makes the export a failure (tmp may be the old one)
    _location.fsync_dir(parent)
    if old:
      refs.dispose_replaced(Location.parse(path), old)
  except OSError as e:
    log.warning("%s: exported; making the rename durable or disposing of what it replaced"
                " (%s) failed: %s", path, os.path.basename(old or path), e)
