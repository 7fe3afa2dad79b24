"""Converting a checkpoint of any format into ours or into safetensors.

``python -m orbax_flax convert SRC DST [--format orbax_flax|safetensors]
[--dtype bfloat16] [--max_shard_bytes N]``, or :func:`convert`.

To safetensors the conversion streams: each array is read, converted and
written before the next is read, so host memory peaks at about the largest
array (plus its converted copy). Tensor names are the key paths joined by
``.``, prefixed by the item name when the source has several items; strings
go into the header's ``__metadata__``, numeric scalars become 0-d tensors.

To orbax_flax the source is read whole into host memory and saved with one
blocking save (peak: about the state's size), because a save commits every
item at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from orbax_flax import _tree
from orbax_flax import errors
from orbax_flax._records import Array
from orbax_flax.formats import _read
from orbax_flax.formats import safetensors_export


class LazyArray:
  """An array of a checkpoint, read when (and each time) :meth:`read` is called."""

  def __init__(self, reader: Any, item: str, rec: Array, progress: Any = None):
    self._reader, self._item, self._rec, self._progress = reader, item, rec, progress
    self.shape = rec.shape
    self.dtype = rec.np_dtype

  def read(self) -> np.ndarray:
    out = _read.read_whole(self._reader, self._item, self._rec)
    if self._progress is not None:
      self._progress.add(out.nbytes)
    return out


def convert(src: Any, dst: str, *, format: str = "orbax_flax", dtype: Any = None,  # pylint: disable=redefined-builtin
            max_shard_bytes: int = 5 << 30, overwrite: bool = False) -> str:
  """Writes the checkpoint at ``src`` (any format) to ``dst`` in ``format``.

  Args:
    src: a checkpoint of any format ``restore`` reads.
    dst: where to write it.
    format: "orbax_flax" or "safetensors".
    dtype: convert floating arrays to this dtype (e.g. "bfloat16"), or None.
    max_shard_bytes: for safetensors, the most bytes per file.
    overwrite: replace ``dst`` if it exists.

  Returns:
    A one-line summary of what was written.
  """
  from orbax_flax import checkpointer  # pylint: disable=g-import-not-at-top  # cycle
  from orbax_flax import restoring  # pylint: disable=g-import-not-at-top
  if format not in ("orbax_flax", "safetensors"):
    raise ValueError(f"format={format!r}; use 'orbax_flax' or 'safetensors'")
  loc, manifest = restoring.open_manifest(src)
  if format == "orbax_flax":
    items = checkpointer.restore(src)  # shows progress on a terminal, as every restore does
    checkpointer.save(dst, items, overwrite=overwrite, dtype=dtype)
    return f"wrote {dst} (orbax_flax, {len(items)} item(s)) from {manifest.format}"
  from orbax_flax import _progress  # pylint: disable=g-import-not-at-top
  progress = _progress.Progress(f"convert {loc}", sum(
      r.nbytes for i in manifest.items.values() for r in i.leaves))
  progress.phase = "converting array by array"
  reader = restoring.reader_for(loc, manifest)
  flat: dict[str, Any] = {}
  meta: dict[str, str] = {}
  source: dict[str, str] = {}  # tensor name -> the leaf it is made from
  clashes: list[str] = []
  several = len(manifest.items) > 1
  for item, saved in manifest.items.items():
    for rec in saved.leaves:
      name = ".".join(([item] if several else []) + list(rec.path))
      if not isinstance(rec, Array):
        value = rec.decoded()
        if isinstance(value, (str, bytes)):
          meta[name] = value if isinstance(value, str) else value.decode(errors="replace")
          continue
        value = np.asarray(value)
      else:
        value = LazyArray(reader, item, rec, progress)
      leaf = f"{item}/{rec.path_text}"
      if name in source:
        clashes.append(f"{source[name]} and {leaf} are both named {name!r}")
      source[name] = leaf
      flat[name] = value
  _check_names(source, clashes, dst)
  with _progress.Monitor(progress):  # bytes, GB/s and ETA on a terminal; quiet in logs and CI
    names = safetensors_export.export_safetensors(
        dst, flat, dtype=dtype, max_shard_bytes=max_shard_bytes, name_fn=lambda p: p[0],
        metadata=meta, overwrite=overwrite)
  return f"wrote {dst} (safetensors, {len(flat)} tensors in {len(names)} file(s))"


def _check_names(source: dict[str, str], clashes: list[str], dst: str) -> None:
  """ValueError, before anything is written, when two leaves would share a tensor name, or
  when one name is also a prefix of another (``a`` and ``a.b``: the file would not read
  back as a tree)."""
  if not clashes:
    try:
      _tree.structure_from_paths([tuple(n.split(".")) for n in source])
    except errors.TreeMismatchError as e:
      clashes.append(f"{e} (tensor names split at '.')")
  if clashes:
    raise ValueError(
        f"cannot convert to safetensors at {dst}: tensor names are key paths joined by '.', and"
        " here they collide:\n  " + "\n  ".join(clashes) + "\nRestore the checkpoint and write"
        " it with ofx.export_safetensors(..., name_fn=...) to choose other names.")
