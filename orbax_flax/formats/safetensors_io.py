"""safetensors files in and out: Hugging Face's layout, read by byte ranges.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``name -> {"dtype", "shape", "data_offsets"}`` plus an optional
``__metadata__`` of strings) and the tensors' bytes, each C-ordered and
contiguous. A model too large for one file is split into shards
(``model-00001-of-00003.safetensors`` ...) named by
``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map": {name:
file}}``).

**Reading.** :func:`open_checkpoint` reads only the headers. A restore then
reads, for each box its devices need, the byte runs of that box
(:mod:`orbax_flax.formats._cbytes`) straight into the final buffer: a process
holding a quarter of a matrix reads a quarter of its bytes. Tensor names
become key paths by splitting at ``.`` (``model.layers.0.mlp.up_proj.weight``
-> ``model/layers/0/mlp/up_proj/weight``); a checkpoint holds one item, whose
name is whatever the target calls it (``params`` without a target). Only local
files are read (Hugging Face downloads are local).

**Writing.** :func:`export_safetensors` writes the same layout from a live,
possibly sharded, multi-process tree without gathering it: process 0 lays out
the files (headers, sizes), every process writes the boxes of the arrays it
owns (the shards whose ``replica_id`` is 0) with ``pwrite``, and process 0
commits by renaming the finished directory into place, as our checkpoints do.
The target directory must be on a file system every process can write.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np

from orbax_flax import _layout
from orbax_flax import _multihost
from orbax_flax import _tree
from orbax_flax import errors
from orbax_flax.formats import _cbytes
from orbax_flax.formats import _checks

FORMAT = "safetensors"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_ITEM = "params"
_TMP = ".ofx-tmp-export"
_MAX_HEADER = 100 << 20  # the safetensors package's own limit

# safetensors dtype names <-> numpy (ml_dtypes for bfloat16 and float8).
_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: Any) -> str:
  """The safetensors name of a numpy dtype; ValueError naming the supported ones.

  Example:
    >>> dtype_name(np.float32), dtype_name(ml_dtypes.bfloat16)
    ('F32', 'BF16')
  """
  name = _NAMES.get(np.dtype(dtype))
  if name is None:
    raise ValueError(f"safetensors cannot store {np.dtype(dtype)}; it stores"
                     f" {', '.join(str(d) for d in _NAMES)}. Cast it (dtype=...) or leave it out.")
  return name


def _files_of(path: str) -> tuple[list[str], dict[str, str] | None] | None:
  """The safetensors files at ``path`` (a file, or a directory) and the index's weight map
  (None without an index), or None if it is not one."""
  if os.path.isfile(path):
    return ([path], None) if path.endswith(".safetensors") else None
  if not os.path.isdir(path):
    return None
  if os.path.isfile(os.path.join(path, INDEX_NAME)):
    weight_map = read_index(path)
    return list(dict.fromkeys(weight_map.values())), weight_map
  names = sorted(n for n in os.listdir(path)
                 if n.endswith(".safetensors") and os.path.isfile(os.path.join(path, n)))
  return ([os.path.join(path, n) for n in names], None) if names else None


def detect(path: str) -> bool:
  """True if ``path`` is a safetensors file or a directory of them."""
  return _files_of(path) is not None


def _read_prefix(file: str, limit: int) -> bytes:
  with open(file, "rb") as f:
    data = f.read(limit + 1)
  if len(data) > limit:
    raise errors.CheckpointFormatError(f"{file}: larger than {limit} bytes; not an index")
  return data


def read_index(directory: str) -> dict[str, str]:
  """``model.safetensors.index.json``'s weight map, tensor name -> shard path, checked.

  Every shard must be a plain file name inside ``directory`` (see
  :func:`orbax_flax.formats._checks.inside`): an index cannot make a reader
  open a file elsewhere.
  """
  where = os.path.join(directory, INDEX_NAME)
  index = _checks.json_object(_checks.load_json(_read_prefix(where, _MAX_HEADER), where), where)
  weight_map = index.get("weight_map")
  if not isinstance(weight_map, dict) or not weight_map:
    raise errors.CheckpointFormatError(
        f"{where}: weight_map is {_checks.short(weight_map)}, not an object naming each"
        " tensor's file")
  return {name: _checks.inside(directory, file, where, f"weight_map[{name!r}]")
          for name, file in weight_map.items()}


def read_header(file: str) -> tuple[dict[str, Any], int, int]:
  """The JSON header of one file, the offset where its data starts, and the file's size."""
  with open(file, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
      raise errors.CheckpointFormatError(f"{file}: {size} bytes, too short to be a safetensors"
                                         " file")
    (n,) = struct.unpack("<Q", head)
    if n > min(_MAX_HEADER, size - 8):
      raise errors.CheckpointFormatError(
          f"{file}: header length {n} (the first 8 bytes), in a file of {size} bytes; not a"
          " safetensors file, or damaged")
    header = _checks.load_json(f.read(n), f"{file}: header")
  return header, 8 + n, size


class _Entry(NamedTuple):
  name: str
  dtype: np.dtype
  shape: tuple[int, ...]
  lo: int  # data_offsets, relative to the start of the data section
  hi: int


def read_tensors(file: str) -> tuple[list[_Entry], dict[str, str], int]:
  """Every tensor of one file, all of its header checked in one pass.

  Checked: the header is a JSON object of tensors (and an optional
  ``__metadata__`` of strings); each tensor's name is a non-empty string, its
  ``dtype`` one orbax_flax reads, its ``shape`` a list of integers >= 0 whose
  size fits in memory, its ``data_offsets`` exactly two integers ``0 <= begin
  <= end`` inside the data section whose length is the shape's bytes; and the
  tensors tile the data section (no byte shared, none left over: the format's
  rule, which the safetensors package enforces too). Anything else raises
  CheckpointFormatError naming the file, the tensor, the field and its value.

  Returns:
    ``(tensors, metadata, data_start)``: the data section starts at byte
    ``data_start`` of the file.
  """
  header, data_start, size = read_header(file)
  header = _checks.json_object(header, file, "the header")
  data_size = size - data_start

  def bad(problem: str) -> errors.CheckpointFormatError:
    return errors.CheckpointFormatError(f"{file}: {problem}; damaged or crafted (the data"
                                        f" section has {data_size} bytes)")

  metadata = header.pop("__metadata__", None)
  metadata = {} if metadata is None else metadata
  if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
    raise bad(f"__metadata__ is {_checks.short(metadata)}, not an object of strings")
  entries = []
  for name, info in header.items():
    if not name:
      raise bad("a tensor has an empty name")
    if not isinstance(info, dict):
      raise bad(f"tensor {name!r} is {_checks.kind(info)} ({_checks.short(info)}), not an object"
                " with dtype, shape and data_offsets")
    dtype = _DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
    if dtype is None:
      raise bad(f"tensor {name!r} has dtype {_checks.short(info.get('dtype'))}, which orbax_flax"
                f" cannot read (it reads {', '.join(_DTYPES)})")
    shape = info.get("shape")
    problem = _tree.shape_problem(shape, dtype.itemsize)
    if problem:
      raise bad(f"tensor {name!r} has shape {_checks.short(shape)}: {problem}")
    offsets = info.get("data_offsets")
    if (not isinstance(offsets, list) or len(offsets) != 2
        or not all(_checks.is_int(x) for x in offsets)):
      raise bad(f"tensor {name!r} has data_offsets {_checks.short(offsets)}, not two integers")
    lo, hi = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if not 0 <= lo <= hi <= data_size or hi - lo != nbytes:
      raise bad(f"tensor {name!r} ({dtype}{list(shape)}, {nbytes} bytes) has data_offsets"
                f" {offsets}, not {nbytes} bytes inside the data section")
    entries.append(_Entry(name, dtype, tuple(shape), lo, hi))
  # The tensors tile the data section, as the format requires ("no holes", so
  # no byte is two tensors' or none's) and the safetensors package checks.
  at, last = 0, None
  for e in sorted(entries, key=lambda e: (e.lo, e.hi)):
    if e.lo < at:
      raise bad(f"tensors {last.name!r} (data_offsets [{last.lo}, {last.hi}]) and {e.name!r}"
                f" ([{e.lo}, {e.hi}]) share bytes")
    if e.lo > at:
      raise bad(f"no tensor holds bytes [{at}, {e.lo}) of the data section (before {e.name!r})")
    at, last = e.hi, e
  if at != data_size:
    raise bad(f"no tensor holds the last {data_size - at} bytes of the data section")
  return entries, metadata, data_start


class _File:
  """One open file, shared by its tensors; closed when the last of them is gone."""

  def __init__(self, path: str):
    self.path = path
    self._fd: int | None = None

  def fd(self) -> int:
    if self._fd is None:
      self._fd = os.open(self.path, os.O_RDONLY)
    return self._fd

  def __del__(self):
    if self._fd is not None:
      os.close(self._fd)


class _Tensor:
  """One tensor's bytes in one file: reads boxes by byte runs."""

  def __init__(self, file: _File, base: int, shape: tuple[int, ...], dtype: np.dtype):
    self.file, self.base, self.shape, self.dtype = file, base, shape, dtype

  def read(self, box: _cbytes.Box, out: np.ndarray) -> None:
    try:
      _cbytes.pread_box(self.file.fd(), self.base, self.shape, box, out)
    except EOFError as e:
      raise errors.CheckpointCorruptedError(f"{self.file.path}: {e} (truncated?)") from e
    except OSError as e:
      raise errors.StorageError(f"{self.file.path}: cannot read: {e}") from e

  def describe(self) -> str:
    return os.path.basename(self.file.path)


def _name_to_path(name: str) -> list[str]:
  return name.split(".")


def open_checkpoint(path: str) -> dict[str, Any]:
  """A manifest-like description of a safetensors file or directory (headers only).

  Every file is checked by :func:`read_tensors` (and the index by
  :func:`read_index`) before anything is read; a tensor named in two files,
  a tensor the index places in a file that lacks it, and names that make one
  key path both a leaf and a subtree (``a`` and ``a.b``) raise
  CheckpointFormatError.

  Returns:
    ``{"format", "items": {"params": {"leaves", "structure"}}, "any_item": True, ...}``
    in the shape of our own manifests, each array record carrying a ``source``
    that reads its boxes.
  """
  found_files = _files_of(path)
  if found_files is None:
    raise errors.CheckpointNotFoundError(f"no safetensors file at {path}")
  files, weight_map = found_files
  leaves: list[dict[str, Any]] = []
  metadata: dict[str, Any] = {}
  found: dict[str, str] = {}  # tensor name -> its file
  for file in files:
    if not os.path.isfile(file):
      raise errors.CheckpointNotFoundError(f"{file}, named by {INDEX_NAME}, does not exist")
    entries, meta, base = read_tensors(file)
    handle = _File(file)
    metadata.update(meta)
    for e in entries:
      if e.name in found:
        raise errors.CheckpointFormatError(f"{path}: tensor {e.name!r} is in both {found[e.name]}"
                                           f" and {file}")
      found[e.name] = file
      nbytes = e.hi - e.lo
      leaves.append({"kind": "array", "path": _name_to_path(e.name), "name": e.name,
                     "shape": list(e.shape), "dtype": e.dtype.name,
                     "nbytes": nbytes, "sharding": {"text": os.path.basename(file)},
                     "source": _Tensor(handle, base + e.lo, e.shape, e.dtype)})
  missing = [f"{n!r} (in {f})" for n, f in (weight_map or {}).items() if found.get(n) != f]
  if missing:
    raise errors.CheckpointFormatError(
        f"{os.path.join(path, INDEX_NAME)}: weight_map places tensors in files whose headers do"
        f" not hold them: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
  try:
    structure, order = _tree.structure_from_paths([tuple(r["path"]) for r in leaves])
  except errors.TreeMismatchError as e:
    raise errors.CheckpointFormatError(f"{path}: tensor names (split at '.'): {e}") from None
  leaves = [leaves[i] for i in order]
  return {
      "format": FORMAT, "any_item": True, "default_item": DEFAULT_ITEM,
      "items": {DEFAULT_ITEM: {"leaves": leaves, "structure": structure}},
      "created": max(os.path.getmtime(f) for f in files), "process_count": 1, "device_count": 1,
      "library_version": f"safetensors ({len(files)} file(s))", "custom": metadata,
  }


# ---------------------------------------------------------------------------
# Export


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


def export_safetensors(path: str, tree: Any, *, dtype: Any = None, max_shard_bytes: int = 5 << 30,
                       name_fn: Callable[[tuple[str, ...]], str] | None = None,
                       metadata: Mapping[str, str] | None = None, overwrite: bool = False,
                       coordination_timeout_seconds: float = _multihost.DEFAULT_TIMEOUT_S
                       ) -> list[str]:
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
    overwrite: replace an existing ``path`` (only after the new one is complete).
    coordination_timeout_seconds: how long a process waits for the others.

  Returns:
    The file names written, in order.

  Raises:
    ValueError: a leaf safetensors cannot hold, two leaves with one name, or
      ``path`` exists without ``overwrite``; raised before anything is written.

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
  flat = _tree.flatten(tree)
  entries: list[tuple[str, tuple[int, ...], np.dtype]] = []
  values: list[Any] = []
  problems: list[str] = []
  seen: dict[str, str] = {}
  for p, leaf in flat:
    where = _tree.path_str(p)
    kind = "lazy" if _is_lazy(leaf) else _tree.leaf_kind(leaf)
    if kind is None or isinstance(leaf, (str, bytes)):
      problems.append(f"{where}: a {type(leaf).__name__} is not an array")
      continue
    if kind == "value":
      leaf = np.asarray(leaf)
    name = name_fn(p)
    if name in seen:
      problems.append(f"{where}: tensor name {name!r} is also the name of {seen[name]}")
      continue
    seen[name] = where
    try:
      out_dtype = _cast_to(dtype, name, np.dtype(leaf.dtype))
      dtype_name(out_dtype)
    except (ValueError, TypeError) as e:
      problems.append(f"{where}: {e}")
      continue
    entries.append((name, tuple(int(s) for s in leaf.shape), out_dtype))
    values.append(leaf)
  if problems:
    raise ValueError("cannot export these leaves as safetensors:\n  " + "\n  ".join(problems))
  if max_shard_bytes <= 0:
    raise ValueError(f"max_shard_bytes={max_shard_bytes}; give a positive size such as 5 << 30")
  path = os.path.abspath(path)
  if os.path.exists(path) and not overwrite:
    raise ValueError(f"{path} exists; pass overwrite=True to replace it (the old files stay"
                     " until the new ones are complete)")
  metadata = {"format": "pt", **(metadata or {})}
  files = _file_layout(entries, max_shard_bytes)
  n = len(files)
  names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
  tmp = path + _TMP
  key = _multihost.namespace("export", path)
  me = _multihost.process_index()

  def agree(stage: str, error: str) -> None:
    results = _multihost.all_gather(f"{key}/{stage}", error, coordination_timeout_seconds,
                                    what=f"finish export stage {stage!r}")
    failed = [f"process {i}: {e}" for i, e in enumerate(results) if e]
    if failed:
      raise RuntimeError(f"export to {path} failed ({stage}); nothing was committed:\n  "
                         + "\n  ".join(failed))

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
      for box, data in _owned(value, me):
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
      _commit(tmp, path)
    except OSError as e:
      error = f"{type(e).__name__}: {e}"
  agree("commit", error)
  return names


def _is_lazy(leaf: Any) -> bool:
  """An array read on demand (``convert``'s streaming leaves): ``shape``, ``dtype``, ``read()``."""
  return callable(getattr(leaf, "read", None)) and hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def _owned(value: Any, me: int):
  """``(box, host data)`` for the parts of ``value`` this process writes."""
  if _is_lazy(value):
    if me == 0:
      yield tuple((0, s) for s in value.shape), value.read()
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
    value = np.asarray(value)
    yield tuple((0, s) for s in value.shape), value


def _commit(tmp: str, path: str) -> None:
  """Renames ``tmp`` to ``path``; an existing ``path`` is moved aside first, then removed."""
  parent = os.path.dirname(path)
  old = None
  if os.path.exists(path):
    old = path + ".ofx-old"
    shutil.rmtree(old, ignore_errors=True)
    os.rename(path, old)
  os.rename(tmp, path)
  fd = os.open(parent, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
  if old:
    shutil.rmtree(old, ignore_errors=True)
