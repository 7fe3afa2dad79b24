"""Reading safetensors files: Hugging Face's layout, read by byte ranges.

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

Writing the same layout is :mod:`orbax_flax.formats.safetensors_export`.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from orbax_flax.core import _location
from orbax_flax.core import _tree
from orbax_flax import errors
from orbax_flax.format import _manifest
from orbax_flax.format._manifest import Array, Item, Manifest
from orbax_flax.formats import _cbytes
from orbax_flax.formats import _checks

FORMAT = "safetensors"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_ITEM = "params"
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


def little_endian(dtype: Any) -> np.dtype:
  """``dtype`` in the byte order safetensors stores, little-endian: a big-endian ``>f4``
  (what FITS, netCDF and HDF5 readers hand back) is stored as ``<f4``, its bytes swapped.

  Example:
    >>> little_endian(">i8"), little_endian(np.float32), little_endian(ml_dtypes.bfloat16)
    (dtype('int64'), dtype('float32'), dtype(bfloat16))
  """
  dtype = np.dtype(dtype)
  return np.dtype(dtype.newbyteorder("<").str) if dtype.byteorder == ">" else dtype


def dtype_name(dtype: Any) -> str:
  """The safetensors name of a numpy dtype, in either byte order (safetensors stores it
  little-endian: :func:`little_endian`); ValueError naming the supported ones.

  Example:
    >>> dtype_name(np.float32), dtype_name(ml_dtypes.bfloat16), dtype_name(">i8")
    ('F32', 'BF16', 'I64')
  """
  name = _NAMES.get(little_endian(dtype))
  if name is None:
    raise ValueError(f"safetensors cannot store {np.dtype(dtype)}; it stores"
                     f" {', '.join(str(d) for d in _NAMES)}. Cast it (dtype=\"bfloat16\" casts"
                     " floating arrays; dtype=lambda name, dt: ... any) or leave it out (select=).")
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
  with _location.open_plain(file, os.path.dirname(file)) as f:
    data = _location.read_at_most(f, limit + 1)
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
  with _location.open_plain(file, os.path.dirname(file) or ".") as f:
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
    problem = _manifest.shape_problem(shape, dtype.itemsize)
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


def open_checkpoint(path: str) -> Manifest:
  """A manifest-like description of a safetensors file or directory (headers only).

  Every file is checked by :func:`read_tensors` (and the index by
  :func:`read_index`) before anything is read; a shard the index names that is
  missing raises CheckpointCorruptedError; a tensor named in two files,
  a tensor the index places in a file that lacks it, and names that make one
  key path both a leaf and a subtree (``a`` and ``a.b``) raise
  CheckpointFormatError.

  Returns:
    A manifest of one item (``params``, read under any item name), each array
    record carrying a ``source`` that reads its boxes.
  """
  found_files = _files_of(path)
  if found_files is None:
    raise errors.CheckpointNotFoundError(f"no safetensors file at {path}")
  files, weight_map = found_files
  leaves: list[Array] = []
  metadata: dict[str, Any] = {}
  found: dict[str, str] = {}  # tensor name -> its file
  for file in files:
    if not os.path.isfile(file):  # the index is there: a shard it names is lost
      raise errors.CheckpointCorruptedError(
          f"{file}, which {INDEX_NAME} names for"
          f" {sum(f == file for f in (weight_map or {}).values())}"
          " tensor(s), does not exist: the checkpoint is incomplete (a shard lost in a copy or"
          " deleted). Copy the shard back from the source of the export.")
    entries, meta, base = read_tensors(file)
    handle = _File(file)
    metadata.update(meta)
    for e in entries:
      if e.name in found:
        raise errors.CheckpointFormatError(f"{path}: tensor {e.name!r} is in both {found[e.name]}"
                                           f" and {file}")
      found[e.name] = file
      nbytes = e.hi - e.lo
      leaves.append(Array(path=tuple(_name_to_path(e.name)), kind="array", name=e.name,
                          shape=tuple(e.shape), dtype=e.dtype.name, nbytes=nbytes,
                          sharding=os.path.basename(file),
                          source=_Tensor(handle, base + e.lo, e.shape, e.dtype)))
  missing = [f"{n!r} (in {f})" for n, f in (weight_map or {}).items() if found.get(n) != f]
  if missing:
    raise errors.CheckpointFormatError(
        f"{os.path.join(path, INDEX_NAME)}: weight_map places tensors in files whose headers do"
        f" not hold them: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
  try:
    structure, order = _tree.structure_from_paths([r.path for r in leaves])
  except errors.TreeMismatchError as e:
    raise errors.CheckpointFormatError(f"{path}: tensor names (split at '.'): {e}") from None
  return Manifest(
      format=FORMAT, any_item=True,
      items={DEFAULT_ITEM: Item(structure, tuple(leaves[i] for i in order))},
      created=max(os.path.getmtime(f) for f in files), process_count=1, device_count=1,
      library_version=f"safetensors ({len(files)} file(s))", custom=metadata)
