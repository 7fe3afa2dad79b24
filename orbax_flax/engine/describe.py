"""What a checkpoint holds, read from its manifest without touching array data.

Works on any machine, whatever its device or process count: nothing here
creates jax arrays or reads the array files.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from orbax_flax.core import _tree
from orbax_flax.engine import restoring
from orbax_flax.core._location import Location
from orbax_flax.core._progress import human_bytes  # (the CLI's too)
from orbax_flax.format._manifest import Array, Manifest


@dataclasses.dataclass(frozen=True)
class ArrayMetadata:
  """One saved array.

  Attributes:
    path: key path inside its item, e.g. ``params/Dense_0/kernel``.
    shape: global shape (of the key array, for PRNG keys).
    dtype: dtype name (``key<threefry2x32>`` for PRNG keys).
    sharding: how it was sharded when saved, e.g. ``mesh{'data': 2} spec('data', None)``.
    nbytes: bytes of array data.
    kind: ``"jax"`` or ``"numpy"``.
  """
  path: str
  shape: tuple[int, ...]
  dtype: str
  sharding: str
  nbytes: int
  kind: str


@dataclasses.dataclass(frozen=True)
class ItemMetadata:
  """One saved item.

  Attributes:
    name: the item name.
    tree: the saved structure with :class:`ArrayMetadata` in place of arrays
      and the values themselves for scalars and strings.
    arrays: every array of the item, in tree order.
    nbytes: total bytes of its arrays.
  """
  name: str
  tree: Any
  arrays: tuple[ArrayMetadata, ...]

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.arrays)


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
  """A committed checkpoint's contents.

  Attributes:
    path: where it is.
    items: item name -> :class:`ItemMetadata`.
    created: when the save was planned (its blocking phase), seconds since the epoch.
    process_count: processes of the job that saved it.
    device_count: devices of the job that saved it.
    library_version: orbax_flax version that wrote it.
    custom: the ``custom_metadata`` passed to save (for other formats: what
      they record, e.g. a safetensors header's ``__metadata__``).
    format: "orbax_flax", "orbax-checkpoint" or "safetensors".
    casts: key path -> dtype the array had before ``save(..., dtype=...)``
      stored it in another.
  """
  path: str
  items: dict[str, ItemMetadata]
  created: float
  process_count: int
  device_count: int
  library_version: str
  custom: dict[str, Any]
  format: str = "orbax_flax"
  casts: dict[str, str] = dataclasses.field(default_factory=dict)

  @property
  def nbytes(self) -> int:
    return sum(i.nbytes for i in self.items.values())

  def __str__(self) -> str:
    when = datetime.datetime.fromtimestamp(self.created).isoformat(timespec="seconds")
    if self.format == "orbax_flax":
      lines = [f"checkpoint {self.path}: {len(self.items)} item(s), {human_bytes(self.nbytes)},"
               f" saved {when} by {self.process_count} process(es) / {self.device_count}"
               f" device(s), orbax_flax {self.library_version}"]
    else:
      lines = [f"{self.format} checkpoint {self.path}: {len(self.items)} item(s),"
               f" {human_bytes(self.nbytes)}, written {when} ({self.library_version})"]
    for item in self.items.values():
      lines.append(f"  item {item.name}: {len(item.arrays)} arrays, {human_bytes(item.nbytes)}")
      rows = [(a.path, f"{a.dtype}{list(a.shape)}", a.sharding, human_bytes(a.nbytes))
              for a in item.arrays]
      widths = [max((len(r[i]) for r in rows), default=0) for i in range(3)]
      for r in rows:
        lines.append("    " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3])
    return "\n".join(lines)


def _array_metadata(rec: Array) -> ArrayMetadata:
  key = rec.key_impl
  return ArrayMetadata(
      path=rec.path_text,
      shape=rec.user_shape,
      dtype=f"key<{key}>" if key else rec.dtype,
      sharding=rec.sharding,
      nbytes=int(rec.nbytes),
      kind=rec.kind,
  )


def from_manifest(path: str, manifest: Manifest) -> CheckpointMetadata:
  items = {}
  for name, item in manifest.items.items():
    leaves = []
    arrays = []
    for rec in item.leaves:
      if not isinstance(rec, Array):
        leaves.append(rec.decoded())
      else:
        leaves.append(_array_metadata(rec))
        arrays.append(leaves[-1])
    items[name] = ItemMetadata(name, _tree.decode_structure(item.structure, leaves), tuple(arrays))
  return CheckpointMetadata(
      path=path, items=items, created=manifest.created,
      process_count=manifest.process_count, device_count=manifest.device_count,
      library_version=manifest.library_version, custom=manifest.custom,
      format=manifest.format, casts=dict(manifest.casts))


def metadata(path: Any) -> CheckpointMetadata:
  """Describes a committed checkpoint without reading its array data.

  Works on every format ``restore`` reads; ``.format`` says which it is.

  Args:
    path: the checkpoint (local path, URL or kvstore spec dict).

  Returns:
    A :class:`CheckpointMetadata`.

  Raises:
    CheckpointNotFoundError: no committed checkpoint at ``path``.

  Example:
    >>> import numpy as np, orbax_flax as ofx, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> ofx.save(path, {"state": {"w": np.ones((2, 3), np.float32)}})
    >>> a = ofx.metadata(path).items["state"].arrays[0]
    >>> a.path, a.shape, a.dtype, a.nbytes
    ('w', (2, 3), 'float32', 24)
  """
  loc = Location.parse(path)
  loc, manifest = restoring.open_manifest(loc)
  return from_manifest(str(loc), manifest)
