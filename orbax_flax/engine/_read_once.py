"""``read_once``: read each replicated array once across processes, then broadcast it.

An array the target replicates over some mesh axes (data-parallel copies,
often on other hosts) is read split over those axes as well
(:func:`target`), so each byte comes from storage once, and one resharding jit
(:func:`reshard_like`) gathers it with collectives.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from orbax_flax.engine import _matching
from orbax_flax.core import _tree
from orbax_flax.format._records import Array, Manifest


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


def target(target: dict[str, Any], manifest: Manifest | None) -> dict[str, Any]:
  """The target to read with for ``read_once``: leaves split further where that saves bytes.

  ``manifest`` (None: unknown, e.g. under transforms) gives each array's stored
  chunk shape; a packed array (small, stored inside a shared buffer) is read
  as it is.
  """
  out = {}
  for item, tree in target.items():
    if manifest is None:
      out[item] = jax.tree.map(lambda x: _leaf(x, None), tree)
      continue
    saved_item = manifest.items.get(item)
    saved = saved_item.by_path() if saved_item is not None else {}

    def leaf_for(path, x, saved=saved):
      rec = saved.get(path, saved.get(path + ("value",)))  # a Linen box: saved at its own path
      if not isinstance(rec, Array) or rec.is_packed or not rec.chunk_shape:
        return x
      return _leaf(x, rec.chunk_shape)
    out[item] = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree),
                                             [leaf_for(p, x) for p, x in _tree.flatten(tree)])
  return out


def _leaf(leaf: Any, chunk_shape: tuple[int, ...] | None) -> Any:
  sharding = getattr(leaf, "sharding", None)
  if not isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array)) or not isinstance(
      sharding, jax.sharding.NamedSharding) or _matching.is_key_dtype(leaf.dtype):
    return leaf
  if chunk_shape is not None and len(chunk_shape) != len(leaf.shape):
    chunk_shape = None
  spec = read_once_spec(sharding, tuple(leaf.shape), chunk_shape)
  full = lambda sp: tuple(sp) + (None,) * (len(leaf.shape) - len(sp))  # noqa: E731
  if full(spec) == full(sharding.spec):  # P(None, None) is P(): nothing to split, no collective
    return leaf
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                              sharding=jax.sharding.NamedSharding(sharding.mesh, spec))


def reshard_like(out: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
  """Arrays of ``out`` moved onto the target's shardings with one jit (collectives)."""
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
