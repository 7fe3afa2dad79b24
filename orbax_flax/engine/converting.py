"""Converting a checkpoint of any format into ours, safetensors or orbax-checkpoint's.

``python -m orbax_flax convert SRC[:SELECTOR] DST [--format orbax_flax|safetensors|orbax]
[--dtype bfloat16] [--max_shard_bytes N]``, or :func:`convert`. A selector
(``:params``, ``:state/params``, ``:params,train_state/batch_stats``, as
``init_from`` takes it) writes only that part: a model without its optimizer
moments, dropout key, data position and config.

To safetensors the conversion streams: each array is read, converted and
written in slabs of whole rows of about 16 MiB (:data:`SLAB_BYTES`) before the
next slab is read, so host memory peaks at about one slab (plus its converted
copy) whatever the largest array's size. Tensor names are the key paths joined by
``.``, prefixed by the item name when the source has several items; strings
go into the header's ``__metadata__`` (``bytes`` too, if they are UTF-8 text; others
are refused), numeric scalars become 0-d tensors.

To orbax-checkpoint (:func:`orbax_flax.export_orbax`) the conversion streams
the same way, in slabs of whole zarr3 chunks (at most about 64 MiB each,
``max_chunk_bytes``), so no chunk is written twice.

To orbax_flax the source is read whole into host memory and saved with one
blocking save (peak: about the state's size), because a save commits every
item at once.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from orbax_flax.core import _progress
from orbax_flax.engine import _reading
from orbax_flax.engine import _selecting
from orbax_flax.core import _tree
from orbax_flax.engine import checkpointer
from orbax_flax.engine import restoring
from orbax_flax.format._manifest import Array
from orbax_flax.formats import orbax_export
from orbax_flax.formats import safetensors_export

FORMATS = ("orbax_flax", "safetensors", "orbax")
SLAB_BYTES = 16 << 20  # what a conversion holds of an array at a time (whole rows)


class LazyArray:
  """An array of a checkpoint, read slab by slab when (and each time) :meth:`slabs` is called."""

  def __init__(self, reader: Any, item: str, rec: Array, progress: Any = None):
    self._reader, self._item, self._rec, self._progress = reader, item, rec, progress
    self.shape = rec.shape
    self.dtype = rec.np_dtype

  def slabs(self, align: int = 1):
    """``(box, data)`` in order: whole rows, about :data:`SLAB_BYTES` each, a multiple of
    ``align`` rows and of the rows of one stored chunk of the source, so that each chunk is
    decoded once (the last slab may be shorter); a 0-d or empty array in one."""
    shape = tuple(int(s) for s in self.shape)
    boxes = [tuple((0, s) for s in shape)]
    rec = self._rec
    chunk = (rec.chunk_shape[0] if rec.chunk_shape else
             getattr(rec.source, "chunk_rows", 1) if rec.source is not None else 1)
    align = math.lcm(align, max(int(chunk), 1))
    if shape and shape[0] > 0:
      row = max(int(np.prod(shape[1:], dtype=np.int64)) * self.dtype.itemsize, 1)
      rows = max(align, SLAB_BYTES // row // align * align)
      boxes = [((lo, min(lo + rows, shape[0])),) + boxes[0][1:] for lo in range(0, shape[0], rows)]
    for box in boxes:
      out = np.empty(tuple(hi - lo for lo, hi in box), self.dtype)
      _reading.read_requests(self._reader, [(self._item, self._rec, box, out)])
      if self._progress is not None:
        self._progress.add(out.nbytes)
      yield box, out
      del out  # the caller's reference is the last: one slab in memory at a time


def convert(src: Any, dst: str, *, format: str = "orbax_flax", dtype: Any = None,  # pylint: disable=redefined-builtin
            max_shard_bytes: int = 5 << 30, overwrite: bool = False) -> str:
  """Writes the checkpoint at ``src`` (any format), or the part a selector names, to ``dst``.

  Args:
    src: a checkpoint of any format ``restore`` reads; ``"<ckpt>:<selector>"``
      takes a part of it, as ``init_from`` does: ``"<ckpt>:params"``, an item's
      subtree ``"<ckpt>:state/params"``, several joined by ``,``
      (``"<ckpt>:params,train_state/batch_stats"``).
    dst: where to write it.
    format: "orbax_flax", "safetensors" or "orbax" (an orbax-checkpoint item
      that ``StandardCheckpointer`` restores; see :func:`export_orbax`).
    dtype: convert floating arrays to this dtype (e.g. "bfloat16"), or None.
    max_shard_bytes: for safetensors, the most bytes per file.
    overwrite: replace ``dst`` if it exists.

  Returns:
    A one-line summary of what was written.

  Raises:
    ValueError: an unknown format, a selector that names nothing (the
      message lists the keys there), or a leaf the format cannot hold (for
      safetensors: a ``bytes`` leaf that is not UTF-8 text); raised before
      anything is written.
    CheckpointCorruptedError: a source array failed its checksum while it was
      read (the export stops; nothing is committed, ``dst`` stays as it was).
    StorageError: writing failed on some process (e.g. the disk is full);
      nothing is committed.
  """
  if format not in FORMATS:
    raise ValueError(f"format={format!r}; use one of {', '.join(map(repr, FORMATS))}")
  path, selector = _selecting.split(str(src))
  loc, manifest = restoring.open_manifest(path)
  several = len(manifest.items) > 1
  if format == "orbax_flax":
    items = checkpointer.restore(path)  # shows progress on a terminal, as every restore does
    if selector:
      items = _selecting.pick(items, selector, keep_paths=True)
    checkpointer.save(dst, items, overwrite=overwrite, dtype=dtype)
    return f"wrote {dst} (orbax_flax, {len(items)} item(s)) from {manifest.format}"
  progress = _progress.Progress(f"convert {loc}", sum(
      r.nbytes for i in manifest.items.values() for r in i.leaves))
  progress.phase = "converting array by array"
  reader = restoring.reader_for(loc, manifest)
  trees = {}
  for item, saved in manifest.items.items():
    leaves = [(_KeyArray(f"{item}/{_tree.path_str(rec.path)}") if rec.key_impl is not None
               else LazyArray(reader, item, rec, progress)) if isinstance(rec, Array)
              else rec.decoded() for rec in saved.leaves]
    trees[item] = _tree.decode_structure(saved.structure, leaves)
  where = ""  # the item a lone item's paths are named under in messages
  if selector:
    tree = _selecting.pick(trees, selector)
    if not isinstance(tree, (dict, list, tuple)):  # one leaf: named by the selector's last key
      tree = {selector.rstrip("/").rsplit("/", 1)[-1]: tree}
  elif several:
    tree = trees
  else:
    (where, tree), = trees.items()
    where = f"{where}/"
  keys = [k.where for _, k in _tree.flatten(tree) if isinstance(k, _KeyArray)]
  if keys:
    raise ValueError(
        f"cannot convert to {format} at {dst}: PRNG key arrays, which {format} cannot hold: "
        + ", ".join(keys) + ". Leave them out with a selector (\"<ckpt>:params\"), or restore"
        " and export jax.random.key_data(key). Nothing was written.")
  if format == "orbax":
    tree = tree if isinstance(tree, dict) else {"value": tree}
    if dtype is not None:
      tree = _cast_lazy(tree, dtype)
    with _progress.Monitor(progress):
      written = orbax_export.export_orbax(dst, tree, overwrite=overwrite)
    return f"wrote {written} (orbax-checkpoint, zarr3) from {manifest.format}"
  flat: dict[str, Any] = {}
  meta: dict[str, str] = {}
  source: dict[str, str] = {}  # tensor name -> the leaf it is made from
  clashes: list[str] = []
  binary: list[str] = []  # bytes leaves that are not UTF-8 text
  for p, value in _tree.flatten(tree):
    name = ".".join(p)
    leaf = where + _tree.path_str(p)
    if not isinstance(value, LazyArray):
      if isinstance(value, bytes):
        try:
          value = value.decode("utf-8")
        except UnicodeDecodeError:
          binary.append(f"{leaf} ({len(value)} bytes)")
          continue
      if isinstance(value, str):
        meta[name] = value
        continue
      value = np.asarray(value)
    if name in source:
      clashes.append(f"{source[name]} and {leaf} are both named {name!r}")
    source[name] = leaf
    flat[name] = value
  if binary:
    raise ValueError(
        f"cannot convert to safetensors at {dst}: these bytes leaves are not UTF-8 text, and"
        " safetensors keeps non-array leaves in its header's __metadata__, which holds text only:"
        " " + ", ".join(binary) + ". Leave them out with a selector (\"<ckpt>:params\"), or"
        " restore the checkpoint and export them encoded (ofx.export_safetensors(...,"
        " metadata={name: base64 text})). Nothing was written.")
  if "" in source:
    raise ValueError(
        f"cannot convert to safetensors at {dst}: the leaf {source['']!r} (its key path is one"
        " empty key, '') would be a tensor named '', which orbax_flax reads as damage and no"
        " model loader maps to a parameter. Leave it out with a selector, or restore the checkpoint and export"
        " it with ofx.export_safetensors(..., name_fn=...) to name it. Nothing was written.")
  _check_names(source, clashes, dst)
  with _progress.Monitor(progress):  # bytes, GB/s and ETA on a terminal; quiet in logs and CI
    names = safetensors_export.export_safetensors(
        dst, flat, dtype=dtype, max_shard_bytes=max_shard_bytes, name_fn=lambda p: p[0],
        metadata=meta, overwrite=overwrite)
  return f"wrote {dst} (safetensors, {len(flat)} tensors in {len(names)} file(s))"


class _Cast:
  """A lazy array read and converted to ``dtype`` (floating arrays only)."""

  def __init__(self, lazy: LazyArray, dtype: np.dtype):
    self._lazy, self.shape, self.dtype = lazy, lazy.shape, dtype

  def slabs(self, align: int = 1):
    for box, data in self._lazy.slabs(align):
      cast = data.astype(self.dtype)
      del data  # not held while the next slab is read
      yield box, cast
      del cast


class _KeyArray:
  """A PRNG key array of the source, which a foreign format cannot hold (refused)."""

  def __init__(self, where: str):
    self.where = where


def _cast_lazy(tree: Any, dtype: Any) -> Any:
  to = _tree.dtype_from_name(dtype) if isinstance(dtype, str) else np.dtype(dtype)

  def one(x):
    if isinstance(x, LazyArray) and jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
      return _Cast(x, to)
    return x
  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, LazyArray))


def _check_names(source: dict[str, str], clashes: list[str], dst: str) -> None:
  """ValueError, before anything is written, when two leaves would share a tensor name, or
  when one name is also a prefix of another (``a`` and ``a.b``: the file would not read
  back as a tree)."""
  clash = None if clashes else safetensors_export.name_clash(source)
  if clash is not None:
    clashes.append(clash)
  if clashes:
    raise ValueError(
        f"cannot convert to safetensors at {dst}: tensor names are key paths joined by '.', and"
        " here they collide:\n  " + "\n  ".join(clashes) + "\nRestore the checkpoint and write"
        " it with ofx.export_safetensors(..., name_fn=...) to choose other names.")
