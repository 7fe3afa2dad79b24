"""Restore targets: :func:`abstract` turns a live state, or an ``eval_shape`` result, into one.

A restore target says what to build for every leaf: a ``jax.ShapeDtypeStruct``
with a sharding (a device array there), a numpy array (a host array), or a
scalar or string (the saved value). :func:`abstract` makes one from what a
training script already has: the state it just initialised (shapes, dtypes
and shardings of its arrays, scalars such as a ``TrainState``'s Python-int
``step`` kept as they are), or the result of ``jax.eval_shape`` /
``nnx.eval_shape`` plus the mesh to place it on.

An array that was never committed to a device (``jnp.zeros(())``, optax's
``count`` beside parameters placed with ``device_put``) becomes an
:class:`UncommittedStruct`, and restores uncommitted on the default device, as
it was: a jitted step may then use it beside arrays on any mesh.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from orbax_flax.core import _tree

try:
  from flax import nnx
except ImportError:  # pragma: no cover
  nnx = None


class UncommittedStruct(jax.ShapeDtypeStruct):
  """A restore target leaf for an array that was not committed to a device.

  A ``jax.Array`` made without a device (``jnp.zeros(())``, ``jax.device_put(x)``)
  is *uncommitted*: a jitted computation moves it to wherever its other
  arguments live. Restoring it committed to its device would make the first
  step after a resume fail with "incompatible devices" once the rest of the
  state lives on a mesh, so such a leaf restores uncommitted on the default
  device. :func:`of_array` (and :func:`abstract`) make one from a live array.

  Example:
    >>> import jax.numpy as jnp, orbax_flax as ofx
    >>> t = ofx.abstract({"count": jnp.zeros((), jnp.int32)})["count"]
    >>> type(t).__name__, t.shape
    ('UncommittedStruct', ())
  """
  __slots__ = ()


def of_array(x: jax.Array) -> jax.ShapeDtypeStruct:
  """The restore target of a live array: its shape, dtype, sharding and committed-ness.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> committed = jax.device_put(jnp.ones(2), jax.devices()[0])
    >>> type(of_array(committed)).__name__, type(of_array(jnp.ones(2))).__name__
    ('ShapeDtypeStruct', 'UncommittedStruct')
  """
  cls = jax.ShapeDtypeStruct if x.committed else UncommittedStruct
  return cls(x.shape, x.dtype, sharding=x.sharding)


def of_arrays(tree: Any) -> Any:
  """``tree`` with every ``jax.Array`` replaced by its :func:`of_array` target, other leaves
  as they are: the target that restores a live state onto its own shardings.

  Example:
    >>> import jax.numpy as jnp
    >>> of_arrays({"w": jnp.ones(2), "step": 3})["w"].shape
    (2,)
  """
  return jax.tree.map(lambda x: of_array(x) if isinstance(x, jax.Array) else x, tree)


def is_uncommitted(leaf: Any) -> bool:
  """True for a target leaf that restores uncommitted: an uncommitted array or its struct.

  Example:
    >>> import jax.numpy as jnp
    >>> is_uncommitted(jnp.ones(2)), is_uncommitted(of_array(jnp.ones(2)))
    (True, True)
  """
  if isinstance(leaf, UncommittedStruct):
    return True
  return isinstance(leaf, jax.Array) and not leaf.committed


def abstract(tree: Any, sharding: Any = None, *, rules: Any = None) -> Any:
  """A restore target with the structure of ``tree``.

  Args:
    tree: a pytree of ``jax.Array``, ``jax.ShapeDtypeStruct`` (from
      ``jax.eval_shape`` or ``nnx.eval_shape``), numpy arrays, scalars,
      strings or None; or an NNX module (its ``nnx.state``).
    sharding: for leaves that have no (concrete) sharding: a
      ``jax.sharding.Sharding`` for all of them; a ``jax.sharding.Mesh`` (each
      leaf gets the partition spec recorded on it: a Linen box's names
      (``nn.Partitioned``, or ``nn.LogicallyPartitioned`` mapped through the
      logical axis rules), the spec of ``nnx.with_partitioning`` under
      ``jax.set_mesh``, or NNX variable metadata; else replicated); a pytree
      of shardings like ``tree`` or any prefix of it, as ``jax.jit`` takes
      (flax's ``nn.logical_to_mesh_sharding(...)`` tree, with a sharding where
      ``tree`` has a box), PartitionSpecs under ``jax.set_mesh`` included; or
      a function ``(key_path, leaf) -> Sharding``.
      Leaves of live arrays keep their own sharding.
    rules: logical axis rules (``(("embed", "data"), ("mlp", "model"))``) for
      ``nn.LogicallyPartitioned`` boxes with a Mesh; default: the box's own,
      else flax's ``nn.logical_axis_rules`` context.

  Returns:
    The same structure, with ``jax.ShapeDtypeStruct`` (with sharding) for
    every array (an :class:`UncommittedStruct` for an uncommitted one), numpy
    arrays for numpy leaves, and every other leaf as is.

  The target keeps ``tree``'s structure, Linen boxes included, so a restore
  into it gives back boxed params with their names.

  Raises:
    ValueError: a leaf has no sharding and ``sharding`` gives none, naming it;
      a logically partitioned leaf and no rules to map its names.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, orbax_flax as ofx
    >>> mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    >>> state = {"w": jnp.ones((4, 2)), "step": 3, "host": np.zeros(2)}
    >>> t = ofx.abstract(state)
    >>> t["w"].shape, t["step"], type(t["host"]).__name__
    ((4, 2), 3, 'ndarray')
    >>> shapes = jax.eval_shape(lambda: {"w": jnp.zeros((8, 2))})
    >>> ofx.abstract(shapes, mesh)["w"].sharding.spec
    P()
  """
  if nnx is not None and isinstance(tree, nnx.Module):
    tree = nnx.state(tree)
  specs = _nnx_specs(tree) if isinstance(sharding, jax.sharding.Mesh) else None
  per_leaf = None
  if isinstance(sharding, P):
    sharding = _on_context_mesh(sharding)
  if sharding is not None and not isinstance(sharding, (jax.sharding.Sharding, jax.sharding.Mesh)) \
      and not callable(sharding):
    per_leaf = {tuple(_tree.key_part(k) for k in p): _on_context_mesh(s) if isinstance(s, P) else s
                for p, s in jax.tree_util.tree_flatten_with_path(
                    sharding, is_leaf=lambda x: isinstance(x, (jax.sharding.Sharding, P)))[0]}

  def one(path, leaf, box=None):
    if isinstance(leaf, jax.Array):
      return of_array(leaf)
    if not isinstance(leaf, jax.ShapeDtypeStruct) or isinstance(leaf, UncommittedStruct):
      return leaf  # numpy arrays, scalars, strings: targets as they are
    own = leaf.sharding
    if own is not None and _concrete(own):
      return leaf
    if box is not None and isinstance(sharding, jax.sharding.Mesh):
      chosen = NamedSharding(sharding, _box_spec(box, rules, jax.tree_util.keystr(path)))
    else:
      chosen = _choose(path, leaf, own, sharding, specs, per_leaf)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=chosen)

  def node(path, x):
    if _tree.is_box(x):  # a Linen box keeps its names; its value gets the spec they give
      inner = path + (jax.tree_util.GetAttrKey("value"),)
      return x.replace_boxed(jax.tree_util.tree_map_with_path(
          lambda p, leaf: one(inner + p, leaf, box=x), x.value))
    return one(path, x)

  return jax.tree_util.tree_map_with_path(node, tree, is_leaf=_tree.is_box)


def _on_context_mesh(spec: P) -> NamedSharding:
  """A PartitionSpec (as ``jax.jit`` takes it under ``jax.set_mesh``) on the context mesh."""
  mesh = jax.sharding.get_mesh()
  if not isinstance(mesh, jax.sharding.Mesh) or mesh.empty:
    raise ValueError(f"abstract(): a PartitionSpec ({spec}) names no devices outside"
                     " `with jax.set_mesh(mesh):`; call it there, or pass NamedShardings (or"
                     " the mesh: ofx.abstract(tree, mesh)).")
  return NamedSharding(mesh, spec)


def _spmd_boxes() -> tuple[type, ...]:
  from flax.linen import spmd  # pylint: disable=g-import-not-at-top
  return (spmd.LogicallyPartitioned,)


def _box_spec(box: Any, rules: Any, where: str) -> P:
  """The mesh PartitionSpec of a Linen box's names (logical ones through the rules)."""
  if not isinstance(box, _spmd_boxes()):
    return box.get_partition_spec() if hasattr(box, "get_partition_spec") else P()
  from flax import linen as nn  # pylint: disable=g-import-not-at-top
  rules = rules if rules is not None else box.rules if box.rules is not None \
      else nn.get_logical_axis_rules()
  names = tuple(box.names)
  if not rules and any(n is not None for n in names):
    raise ValueError(
        f"abstract(): {where} is nn.LogicallyPartitioned with logical axes {names}, and no"
        " logical axis rules map them to the mesh; pass them (ofx.abstract(tree, mesh,"
        " rules=(('embed', 'data'), ...))) or call under `with nn.logical_axis_rules(rules):`.")
  return nn.logical_to_mesh_axes(names, rules)


def _concrete(sharding: Any) -> bool:
  """True for shardings over real devices (not an AbstractMesh of eval_shape)."""
  mesh = getattr(sharding, "mesh", None)
  return mesh is None or isinstance(mesh, jax.sharding.Mesh)


def _choose(path: Any, leaf: Any, own: Any, sharding: Any, specs: dict | None,
            per_leaf: dict | None) -> jax.sharding.Sharding:
  where = jax.tree_util.keystr(path)
  if isinstance(sharding, jax.sharding.Sharding):
    return sharding
  if isinstance(sharding, jax.sharding.Mesh):
    if own is not None and hasattr(own, "spec"):  # eval_shape under jax.set_mesh: the recorded spec
      return NamedSharding(sharding, own.spec)
    return NamedSharding(sharding, (specs or {}).get(path, P()))
  if per_leaf is not None:  # a tree of shardings, or a prefix of the tree (as jax.jit takes)
    parts = tuple(_tree.key_part(k) for k in path)
    for n in range(len(parts), -1, -1):
      if parts[:n] in per_leaf:
        return per_leaf[parts[:n]]
    raise ValueError(f"abstract(): the sharding tree has no sharding for {where} (nor for any"
                     " subtree holding it); give one for every array leaf or subtree, or pass a"
                     " Mesh or a single Sharding.")
  if callable(sharding):
    return sharding(path, leaf)
  raise ValueError(
      f"abstract(): {where} ({leaf.shape}, {leaf.dtype}) has no sharding; pass the mesh to place"
      " it on (ofx.abstract(tree, mesh)), a Sharding, a tree of shardings, or a function"
      " (path, leaf) -> Sharding.")


def _nnx_specs(tree: Any) -> dict | None:
  """Key path -> PartitionSpec from NNX variable metadata, where the tree has any."""
  if nnx is None or not isinstance(tree, nnx.State):
    return None
  try:
    specs = nnx.get_partition_spec(tree)
  except Exception:  # pylint: disable=broad-except  # no partition metadata: replicated
    return None
  flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
  return {p: s for p, s in flat if isinstance(s, P)}

