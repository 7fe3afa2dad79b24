"""Restore targets: making one (:func:`abstract`), and checking one against a checkpoint.

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

Then the check of a target against a checkpoint, the one of every place a
checkpoint lives (the persistent tier, :mod:`orbax_flax.engine.restoring`, and the
local tier): :func:`match_target` compares each target leaf with its saved record
(missing or extra keys, shapes, dtypes and casts, PRNG keys, shardings) and
returns a :class:`Match`: the arrays to read (a :class:`Want` each, with the
boxes this process's devices need) and where each goes. It reads no array data.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from orbax_flax.core import _multihost
from orbax_flax.core import _tree
from orbax_flax.format import _layout
from orbax_flax import errors
from orbax_flax.format._manifest import Array, Manifest, Record


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
  """The restore target of a live array: its shape, dtype, sharding, committed-ness and weak
  type (a ``TrainState``'s step: a jitted step compiled for it takes the restored one as is).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> committed = jax.device_put(jnp.ones(2), jax.devices()[0])
    >>> type(of_array(committed)).__name__, type(of_array(jnp.ones(2))).__name__
    ('ShapeDtypeStruct', 'UncommittedStruct')
  """
  cls = jax.ShapeDtypeStruct if x.committed else UncommittedStruct
  return cls(x.shape, x.dtype, sharding=x.sharding, weak_type=x.aval.weak_type)


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
  nnx = _tree.loaded("flax.nnx")
  if nnx is not None and isinstance(tree, getattr(nnx, "Module", ())):
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
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=chosen,
                                weak_type=getattr(leaf, "weak_type", False))

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
  nnx = _tree.loaded("flax.nnx")
  if nnx is None or not isinstance(tree, getattr(nnx, "State", ())):
    return None
  try:
    specs = nnx.get_partition_spec(tree)
  except Exception:  # pylint: disable=broad-except  # no partition metadata: replicated
    return None
  flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
  return {p: s for p, s in flat if isinstance(s, P)}


# ----------------------------------------------------------------------------
# Checking a target against a checkpoint.


@dataclasses.dataclass
class Want:
  """One array leaf to read: where it comes from and what to build."""
  item: str
  rec: Array
  dtype: np.dtype             # target dtype of the data (key data for PRNG keys)
  sharding: Any               # jax Sharding of the data, or None for host numpy
  shape: tuple[int, ...]      # shape of the data (key data for PRNG keys)
  key_impl: str | None
  boxes: Mapping[_layout.Box, tuple[Any, ...]]  # distinct boxes to read -> devices that get them
  committed: bool = True      # False: placed uncommitted on the default device (as the target was)
  weak: bool = False          # the target was weakly typed (a TrainState's step): so is the result


@dataclasses.dataclass
class Match:
  """A target checked against a checkpoint's items: what to read and where it goes.

  ``results[item]`` is ``(treedef, leaves)`` with values already in place and
  ``None`` where an array of ``wants`` (``(want, item, leaf index)``) goes;
  ``whole`` lists the items the target asks for as saved (``None``).
  """
  results: dict[str, tuple[Any, list[Any]]]
  wants: list[tuple[Want, str, int]]
  whole: list[str]
  as_python: set[tuple[str, int]] = dataclasses.field(default_factory=set)  # Python scalar targets

  def trees(self, arrays: list[Any]) -> dict[str, Any]:
    """The target's items, with ``arrays`` (one per want, in order) in place.

    A Python scalar target leaf read from a 0-d array comes back a Python scalar.
    """
    for (_, item, i), value in zip(self.wants, arrays):
      self.results[item][1][i] = value.item() if (item, i) in self.as_python else value
    return {item: jax.tree_util.tree_unflatten(treedef, leaves)
            for item, (treedef, leaves) in self.results.items()}


def match_target(manifest: Manifest, target: Mapping[str, Any], *, partial: bool = False,
                 allow_lossy_casts: bool = False, casts: list | None = None,
                 from_target: Any = (), source: str = "the checkpoint") -> Match:
  """Checks ``target`` against the saved items of ``manifest``; reads no array data.

  The one target check of every place a checkpoint lives (the persistent
  tier, the local tier): missing or extra keys, shapes, dtypes and casts
  (``allow_lossy_casts``, recorded into ``casts``), PRNG keys, shardings.

  Raises:
    TreeMismatchError: every difference, by key path.
    ValueError: a target sharding cannot hold its array.
  """
  diffs: list[str] = []
  bad_shardings: list[str] = []
  results: dict[str, tuple[Any, list[Any]]] = {}
  wants: list[tuple[Want, str, int]] = []
  as_python: set[tuple[str, int]] = set()  # Python scalar targets read from 0-d arrays
  whole: list[str] = []
  matched = 0
  for item, subtree in target.items():
    saved_item = manifest.items.get(item)
    if saved_item is None:
      diffs.append(f"item {item!r}: in target, not in checkpoint (it has"
                   f" {sorted(manifest.items)})")
      continue
    if subtree is None:
      whole.append(item)
      continue
    saved = saved_item.by_path()
    flat = _tree.flatten(subtree)  # a Linen box's value at the box's own path
    out: list[Any] = [None] * len(flat)
    results[item] = (jax.tree_util.tree_structure(subtree), out)
    seen = set()
    for i, (path_, leaf) in enumerate(flat):
      rec = saved.get(path_)
      if rec is None and path_ + ("value",) in saved:  # a Linen box's array stored at <path>/value
        path_ += ("value",)
        rec = saved[path_]
      seen.add(path_)
      where = _Where(item, path_)
      if rec is None:
        if any(t.matches(_tree.path_str(path_)) for t in from_target):
          if isinstance(leaf, (jax.Array, np.ndarray)) or _tree.leaf_kind(leaf) == "value":
            out[i] = leaf
          else:
            diffs.append(f"{where}: not in checkpoint, and FromTarget needs a concrete value in"
                         f" the target (an array), not a {type(leaf).__name__}")
          continue
        diffs.append(f"{where}: {_IN_TARGET}")
        continue
      matched += 1
      want = _want(item, rec, leaf, where, diffs, bad_shardings, allow_lossy_casts, casts)
      if want is None:
        continue
      if isinstance(want, Value):
        out[i] = want.value
      else:
        wants.append((want, item, i))
        if type(leaf) in (bool, int, float, complex) and want.shape == () and not want.key_impl:
          as_python.add((item, i))
    if not partial:
      for path_ in saved:
        if path_ not in seen:
          diffs.append(f"{item}/{_tree.path_str(path_)}: {_IN_CHECKPOINT}")
  if diffs:
    summary = mismatch_summary(diffs, matched, source)
    raise errors.TreeMismatchError(summary + "\n" + _advice(diffs), diffs,
                                   summary=summary)
  if bad_shardings:
    raise ValueError("target shardings cannot hold these arrays (JAX needs every sharded"
                     " dimension to divide evenly); change the PartitionSpec or mesh:\n  "
                     + "\n  ".join(bad_shardings))
  return Match(results, wants, whole, as_python)


_IN_TARGET = "in target, not in checkpoint"
_IN_CHECKPOINT = "in checkpoint, not in target"
_LOSSY = "converting loses information"
_ALL_SHOWN = 6  # up to this many differences are all shown; more are grouped by kind
_SHOWN = 3      # paths named per kind of difference when grouped


def _kind(diff: str) -> tuple[str, str]:
  """``(kind, where)`` of one difference line: the line less its path."""
  if diff.startswith("item "):
    return diff, ""
  where, _, what = diff.partition(": ")
  return what, where


def _group(kind: str) -> str:
  """Differences that read as one kind: shapes differ whatever the shapes."""
  return "of other shapes" if kind.startswith("shape ") else kind


def _diagnosis(diffs: list[str], matched: int) -> str:
  kinds = [_kind(d)[0] for d in diffs]
  only_target = [w for k, w in map(_kind, diffs) if k == _IN_TARGET]
  only_saved = [w for k, w in map(_kind, diffs) if k == _IN_CHECKPOINT]
  boxed = {w.rsplit("/", 1)[0] for w in only_saved if w.endswith("/value")}
  unboxed = {w.rsplit("/", 1)[0] for w in only_target if w.endswith("/value")}
  if any(d.startswith("item ") for d in diffs):
    return ("the checkpoint holds other items than the target: another kind of state (e.g. a"
            " plain pytree against a TrainState), or another run's checkpoint (a different"
            " workdir)")
  if (boxed & set(only_target)) or (unboxed & set(only_saved)):
    return ("boxed against unboxed: one side keeps its arrays in variables ('.../value', NNX"
            " Variables) where the other has plain arrays (an NNX state against a Linen one, or"
            " the reverse)")
  if matched and all("opt_state" in w.split("/")[:2] for _, w in map(_kind, diffs)):
    return ("a different optimizer: only the optimizer state's keys or shapes differ (e.g."
            " adam's mu and nu against sgd's momentum trace); the rest matches")
  if only_target and only_saved and not matched:
    return ("no key path in common: the target is another model's state, or this is another"
            " run's checkpoint (a different workdir)")
  if only_target and only_saved:
    return (f"a different model: {len(only_target)} key(s) only in the target, {len(only_saved)}"
            f" only in the checkpoint, {matched} in both")
  shapes = sum(k.startswith("shape ") for k in kinds)
  if only_target and shapes:
    return (f"a different model: {len(only_target)} key(s) only in the target, {shapes} of other"
            " shapes")
  if only_saved:
    return f"the target holds a subset of the checkpoint ({len(only_saved)} key(s) left out)"
  if only_target:
    return f"the target has {len(only_target)} key(s) the checkpoint lacks (a newer model?)"
  n = replicated_axis(diffs)
  if n is not None:
    return (f"every array that differs was saved with a leading axis of {n} before the target's"
            " shape: a jax.pmap loop's replicated state (flax.jax_utils.replicate), saved"
            " without flax.jax_utils.unreplicate")
  if any(k.startswith("shape ") for k in kinds):
    return "the same keys with other shapes: a different model configuration"
  if all(_LOSSY in k for k in kinds):
    return "other dtypes, and converting them loses information"
  return f"{len(diffs)} difference(s)"


def replicated_axis(diffs: list[str]) -> int | None:
  """The leading axis every difference adds before the target's shape (a ``jax.pmap``
  loop's replicated state, saved without ``flax.jax_utils.unreplicate``); None when the
  differences are not all such shapes.

  Example:
    >>> replicated_axis(["p/w: shape (8, 4) in checkpoint, (4,) in target",
    ...                  "p/b: shape (8,) in checkpoint, () in target"])
    8
    >>> replicated_axis(["p/w: shape (8, 4) in checkpoint, (4, 4) in target"]) is None
    True
  """
  axes = set()
  for d in diffs:
    saved, _, target = _kind(d)[0].removeprefix("shape ").partition(" in checkpoint, ")
    if not d.endswith(" in target") or not target:
      return None
    saved_shape, target_shape = (tuple(int(x) for x in re.findall(r"\d+", t))
                                 for t in (saved, target))
    if saved_shape[1:] != target_shape or not saved_shape:
      return None
    axes.add(saved_shape[0])
  return axes.pop() if len(axes) == 1 else None


def mismatch_summary(diffs: list[str], matched: int, source: str) -> str:
  """A mismatch in a few lines: a diagnosis, then the differences (one line per kind, with a
  count and its first paths, when there are many; ``TreeMismatchError.differences`` keeps all).

  Example:
    >>> print(mismatch_summary([f"s/{k}: in target, not in checkpoint" for k in "abcdefgh"], 3,
    ...                        "ck"))
    restore target does not match the checkpoint at ck: the target has 8 key(s) the checkpoint lacks (a newer model?)
      s/a: in target, not in checkpoint (and 7 more like it: s/b, s/c, s/d, ...)
  """
  head = f"restore target does not match the checkpoint at {source}: {_diagnosis(diffs, matched)}"
  if len(diffs) <= _ALL_SHOWN:
    return "\n  ".join([head] + diffs)
  groups: dict[str, list[str]] = {}
  for d in diffs:
    groups.setdefault(_group(_kind(d)[0]), []).append(d)
  lines = [head]
  for kind, members in groups.items():
    more = [_kind(d)[1] for d in members[1:]]
    shown = ", ".join(more[:_SHOWN]) + (", ..." if len(more) > _SHOWN else "")
    lines.append(members[0] + (f" (and {len(more)} more {'like it' if kind == _kind(members[0])[0] else kind}:"
                               f" {shown})" if more else ""))
  return "\n  ".join(lines)


def _advice(diffs: list[str]) -> str:
  """What to do, for ``ofx.restore`` (a resume words its own: the callback has no ``partial``)."""
  kinds = {_kind(d)[0] for d in diffs}
  if kinds == {_IN_CHECKPOINT}:
    return "Fix: pass partial=True to restore only the target's keys."
  if _IN_TARGET in kinds or _IN_CHECKPOINT in kinds:
    return ("Fix: check that the checkpoint is this model's (ofx.metadata(path) lists its keys);"
            " to take a part of it, give a target of that part and partial=True.")
  return "Fix: see each difference above (TreeMismatchError.differences lists every one)."


def cast_lines(casts: list) -> list[str]:
  """One line per kind of dtype change in ``casts`` (``(where, saved, target, exact)``),
  with a count and an example path.

  Example:
    >>> cast_lines([("s/a", "float32", "bfloat16", False), ("s/b", "float32", "bfloat16", False)])
    ["s/a converted from float32 (checkpoint) to bfloat16 (this run's state), losing information (allow_lossy_casts) (and 1 more arrays like it)"]
  """
  groups: dict[tuple[str, str, bool], list[str]] = {}
  for where, saved, wanted, exact in casts:
    groups.setdefault((saved, wanted, exact), []).append(where)
  return [f"{w[0]} converted from {s} (checkpoint) to {t} (this run's state)"
          f"{'' if exact else ', losing information (allow_lossy_casts)'}"
          f"{f' (and {len(w) - 1} more arrays like it)' if len(w) > 1 else ''}"
          for (s, t, exact), w in groups.items()]


@dataclasses.dataclass
class Value:
  value: Any


def is_key_dtype(dtype: Any) -> bool:
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_impl_name(dtype: Any) -> str | None:
  """The PRNG implementation a key dtype names (``key<rbg>`` -> "rbg"), if jax says."""
  impl = getattr(dtype, "_impl", None)  # jax has no public accessor on a dtype
  return getattr(impl, "name", None)


def _key_data_sharding(sharding: Any, where: _Where) -> Any:
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec, None),
                                      memory_kind=sharding.memory_kind)
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return sharding
  raise ValueError(f"{where}: restoring PRNG keys onto a {type(sharding).__name__} is not"
                   " supported; use a NamedSharding or SingleDeviceSharding.")


class _Where:
  """A leaf's ``item/key/path`` text, worked out only when a message or a cast names it."""

  def __init__(self, item: str, path: tuple[str, ...]):
    self.item, self.path = item, path

  def __str__(self) -> str:
    return f"{self.item}/{_tree.path_str(self.path)}"


def _want(item: str, rec: Record, leaf: Any, where: _Where, diffs: list[str],
          bad_shardings: list[str], allow_lossy: bool = False,
          casts: list | None = None) -> Want | Value | None:
  """Checks one target leaf against its record; returns what to read."""
  saved_kind = rec.kind
  if isinstance(leaf, jax.ShapeDtypeStruct) or isinstance(leaf, jax.Array):
    sharding = leaf.sharding
    if sharding is None:
      raise ValueError(f"target leaf {where} is a jax.ShapeDtypeStruct without a sharding; give"
                       " it one (jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh,"
                       " P(...)))) or use a numpy array to restore on the host.")
    shape, dtype = tuple(leaf.shape), leaf.dtype
    if not is_key_dtype(dtype) and np.dtype(jax.dtypes.canonicalize_dtype(dtype)) != dtype:
      # jax_enable_x64 is off: a jax.Array of a 64-bit dtype holds 32 bits. Convert to what it
      # will hold, checked like any other conversion (device_put would narrow it silently).
      before, asked, dtype = len(diffs), np.dtype(dtype), np.dtype(jax.dtypes.canonicalize_dtype(dtype))
      found = _want(item, rec, jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), where,
                    diffs, bad_shardings, allow_lossy, casts)
      if len(diffs) > before:
        diffs[-1] += (f" (the target asks for {asked}, but with jax_enable_x64 off a jax.Array"
                      f" holds {dtype}: turn x64 on (jax.config.update('jax_enable_x64', True))"
                      " before building the target, or restore this leaf into a numpy array)")
      return found
  elif isinstance(leaf, np.ndarray):
    sharding, shape, dtype = None, leaf.shape, leaf.dtype
  elif _tree.leaf_kind(leaf) == "value":
    if saved_kind == "value":
      return Value(rec.decoded())
    sharding, shape, dtype = None, rec.user_shape, None
  else:
    raise TypeError(f"target leaf {where} is a {type(leaf).__name__}; use a"
                    " jax.ShapeDtypeStruct with a sharding, a jax.Array, a numpy array or a"
                    " scalar.")

  if saved_kind == "value":
    value = rec.decoded()
    if shape == () and isinstance(value, (bool, int, float, complex, np.generic)) and not is_key_dtype(dtype):
      if dtype is not None and isinstance(value, (bool, int, float, complex)):
        # A Python scalar (a TrainState's step before any jitted step) is weakly typed: its
        # value decides, not the int64/float64 numpy would give it.
        if not _value_cast_ok(value, np.dtype(dtype), where, allow_lossy, diffs, casts):
          return None
      elif dtype is not None:
        source = np.asarray(value).dtype
        if not _cast_ok(source, np.dtype(dtype), where, allow_lossy, diffs, casts):
          return None
      array = np.asarray(value, dtype=dtype)
      if sharding is None:
        return Value(array)
      if is_uncommitted(leaf):
        placed = jax.device_put(array)
      else:
        placed = jax.make_array_from_callback((), sharding, lambda _: array)
      return Value(_multihost.weak_typed(placed) if getattr(leaf, "weak_type", False) else placed)
    diffs.append(f"{where}: checkpoint holds a {type(value).__name__}, target wants an array"
                 f" of shape {shape}")
    return None

  saved_key = rec.key_impl
  if dtype is not None and is_key_dtype(dtype) != (saved_key is not None):
    diffs.append(f"{where}: " + ("checkpoint holds PRNG keys, target is not a key array" if saved_key
                                 else "target is a PRNG key array, checkpoint holds plain data"))
    return None
  wanted_impl = _key_impl_name(dtype) if saved_key and dtype is not None else None
  if wanted_impl is not None and wanted_impl != saved_key:
    diffs.append(f"{where}: checkpoint holds {saved_key} PRNG keys, target asks for {wanted_impl}"
                 f" keys; keys of one implementation cannot be converted exactly into another."
                 f" Restore into {saved_key} keys (e.g. a target built with"
                 f" jax.random.key(0, impl={saved_key!r})), or make new keys.")
    return None
  saved_shape = rec.user_shape
  if tuple(shape) != saved_shape:
    diffs.append(f"{where}: shape {saved_shape} in checkpoint, {tuple(shape)} in target")
    return None
  data_shape = rec.shape
  data_dtype = np.dtype(rec.dtype) if (dtype is None or saved_key) else np.dtype(dtype)
  if not saved_key and not _cast_ok(rec.np_dtype, data_dtype, where, allow_lossy, diffs, casts):
    return None
  if sharding is not None:
    try:
      sharding.shard_shape(tuple(shape))
    except ValueError as e:
      bad_shardings.append(f"{where} (shape {tuple(shape)}): {e}")
      return None
    if saved_key:
      sharding = _key_data_sharding(sharding, where)
  boxes = {tuple((0, s) for s in data_shape): ()} if sharding is None else _boxes(sharding, data_shape)
  committed = not (isinstance(sharding, jax.sharding.SingleDeviceSharding)
                   and is_uncommitted(leaf))
  return Want(item, rec, data_dtype, sharding, data_shape, saved_key, boxes, committed,
              weak=sharding is not None and bool(getattr(leaf, "weak_type", False)))


@functools.lru_cache(maxsize=256)  # a few dtype pairs; asked once per leaf of every restore
def lossless(saved: np.dtype, target: np.dtype) -> bool:
  """True if every value of ``saved`` converts to ``target`` exactly.

  numpy's "safe" casting (which knows the ml_dtypes types) first, then checked
  value by value, because "safe" is not always exact: numpy calls int64 ->
  float64 safe (2**53 + 1 rounds) and ml_dtypes calls int8 -> float8_e4m3fn
  safe (17 rounds to 16). A type of at most 16 bits is checked on every value
  it has (a round trip through ``target``); a wider integer against the
  mantissa of a float ``target``.

  Example:
    >>> import ml_dtypes
    >>> lossless(np.dtype("int8"), np.dtype("float32")), lossless(np.dtype("float32"), np.dtype("int8"))
    (True, False)
    >>> lossless(np.dtype("float32"), np.dtype(ml_dtypes.bfloat16))
    False
    >>> lossless(np.dtype("int64"), np.dtype("float64")), lossless(np.dtype("int32"), np.dtype("float64"))
    (False, True)
    >>> lossless(np.dtype("int8"), np.dtype(ml_dtypes.float8_e4m3fn))
    False
  """
  if saved == target:
    return True
  small_float = _tree.number_kind(saved) == "f" and saved.itemsize <= 2
  try:
    # (ml_dtypes' table lacks some exact widenings, float4_e2m1fn -> float16; between
    # floats, a conversion goes by value, so the check of every value below decides)
    if not np.can_cast(saved, target, casting="safe") and not (
        small_float and _tree.number_kind(target) in "fc"):
      return False
  except TypeError:
    return False
  if saved.kind == "b" or saved.itemsize <= 2:
    values = _every_value(saved)
    with np.errstate(all="ignore"):
      back = values.astype(target).astype(saved)
    if _tree.number_kind(saved) in "biu":
      return bool(np.array_equal(back, values))
    same = back.view(f"u{saved.itemsize}") == values.view(f"u{saved.itemsize}")
    nan = np.isnan(values.astype(np.float32)) & np.isnan(back.astype(np.float32))
    return bool(np.all(same | nan))
  if saved.kind in "iu" and target.kind in "fc":
    bits = 8 * saved.itemsize - (saved.kind == "i")  # the magnitude's bits
    return bits <= ml_dtypes.finfo(target).nmant + 1 if target.kind == "f" else (
        bits <= np.finfo(target).nmant + 1)
  return True


def _every_value(dtype: np.dtype) -> np.ndarray:
  """Every value a dtype of at most 16 bits holds (each bit pattern of a float: of a float
  narrower than its byte, such as float4_e2m1fn, only the patterns it has)."""
  kind = _tree.number_kind(dtype)
  if kind == "b":
    return np.array([False, True])
  if kind in "iu":
    info = ml_dtypes.iinfo(dtype)
    return np.arange(int(info.min), int(info.max) + 1).astype(dtype)
  bits = ml_dtypes.finfo(dtype).bits if kind == "f" else 8 * dtype.itemsize
  return np.arange(1 << bits, dtype=np.uint16).astype(f"u{dtype.itemsize}").view(dtype)


def _cast_ok(saved: np.dtype, target: np.dtype, where: _Where, allow_lossy: bool, diffs: list[str],
             casts: list | None) -> bool:
  """Records a dtype change; refuses (into ``diffs``) one that loses information unless allowed."""
  if saved == target:
    return True
  exact = lossless(saved, target)
  if not exact and not allow_lossy:
    diffs.append(f"{where}: {saved} in checkpoint, {target} in target: {_LOSSY}; pass"
                 " allow_lossy_casts=True (checkpoint.allow_lossy_casts for a resume) to convert"
                 " anyway, rounding or truncating, or restore as the saved dtype and cast yourself")
    return False
  if casts is not None:
    casts.append((str(where), str(saved), str(target), exact))
  return True


def _value_cast_ok(value: bool | int | float | complex, target: np.dtype, where: _Where,
                   allow_lossy: bool, diffs: list[str], casts: list | None) -> bool:
  """Like :func:`_cast_ok` for a saved Python scalar: exact when its value converts exactly."""
  try:
    with np.errstate(all="ignore"):
      back = np.asarray(value, dtype=target).item()
    exact = back == value or (value != value and back != back)  # noqa: PLR0124  (NaN)
  except (OverflowError, ValueError, TypeError):
    exact = False
  saved = type(value).__name__
  if not exact and not allow_lossy:
    diffs.append(f"{where}: the Python {saved} {value!r} in checkpoint, {target} in target:"
                 f" {_LOSSY}; pass allow_lossy_casts=True (checkpoint.allow_lossy_casts for a"
                 " resume) to convert anyway, or restore as saved and cast yourself")
    return False
  if casts is not None:
    casts.append((str(where), saved, str(target), exact))
  return True


@functools.lru_cache(maxsize=1024)
def _boxes(sharding: jax.sharding.Sharding,
           shape: tuple[int, ...]) -> Mapping[_layout.Box, tuple[Any, ...]]:
  """The distinct boxes this process's devices hold, and which devices hold each (read-only:
  every target of this sharding and shape shares it)."""
  boxes: dict[_layout.Box, list[Any]] = {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    boxes.setdefault(_layout.slices_to_box(index, shape), []).append(device)
  return types.MappingProxyType({box: tuple(devices) for box, devices in boxes.items()})
