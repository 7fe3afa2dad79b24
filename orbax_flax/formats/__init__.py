"""Checkpoint formats other than our own: detection, reading, writing.

``restore``, ``metadata``, ``verify``, ``show`` and ``convert`` take any of:

* an orbax_flax checkpoint (``_CHECKPOINT``; specified in ``docs/format.md``),
* an orbax-checkpoint item, step or run directory (:mod:`.orbax_checkpoint`),
* a safetensors file or directory (:mod:`.safetensors`).

The format is detected from the files. A foreign checkpoint is described by a
manifest of the same records as ours (:mod:`orbax_flax.format._manifest`), in memory
only, whose array records carry a ``source`` that reads a box of the array into
a buffer; everything above that (target checks, dtype rules, transforms,
resharding) is shared.

This package sits below the engine: its modules read bytes and describe
checkpoints, and import only the engine's primitives (``_reading``,
``_layout``, ``_tree``, ``errors``, ...), never ``restoring``, the
``Checkpointer`` or the manager. What is built on the engine lives beside it:
:mod:`orbax_flax.engine.transforms` (restore-time renames, stacking, casts) and
:mod:`orbax_flax.engine.converting` (``convert``).

May import: ``core``, ``format``, the engine's primitives, ``errors``; and
:mod:`orbax_flax.differential.refs`, so that an export over one of our checkpoints disposes
of it as every overwrite does (kept while differential steps borrow from it).
"""

from __future__ import annotations

from orbax_flax import errors
from orbax_flax.core._location import Location
from orbax_flax.format._manifest import Manifest
from orbax_flax.formats import orbax_checkpoint
from orbax_flax.formats import safetensors_io as safetensors

OURS = "orbax_flax"
FORMATS = (OURS, orbax_checkpoint.FORMAT, safetensors.FORMAT)


def open_foreign(loc: Location) -> Manifest | None:
  """The in-memory manifest of a foreign checkpoint at ``loc``, or None if it is not one."""
  if loc.is_local and safetensors.detect(loc.local_path):
    return safetensors.open_checkpoint(loc.local_path)
  try:
    found = orbax_checkpoint.detect(loc)
  except errors.StorageError:
    return None
  if found:
    return orbax_checkpoint.open_checkpoint(loc)
  return None
