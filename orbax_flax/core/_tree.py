"""Pytrees as data: key paths, leaf kinds, and a JSON encoding of the structure.

A checkpoint stores each item's structure so that ``restore(path)`` without a
target can rebuild it: dicts, lists, tuples and None come back as themselves,
namedtuples (optax states) as namedtuples of the same name and fields, and any
other registered pytree node (flax ``struct.dataclass``, NNX ``State``,
``Variable``) as a dict of its children.

Key paths are tuples of strings: ``("params", "Dense_0", "kernel")``. Dict
keys, attribute names and sequence indices all become strings, so a target
written as nested dicts matches a checkpoint saved from a dataclass.

A Linen partitioning box (``nn.Partitioned``, ``nn.LogicallyPartitioned``, any
``flax.core.meta.AxisMetadata``) is metadata, not structure: its ``value`` is
stored at the box's own path, so a boxed state and its ``nn.unbox`` save the
same checkpoint and either restores into the other.
"""

from __future__ import annotations

import base64
import collections
import functools
import struct
import sys
import types
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from orbax_flax import errors


def loaded(module: str) -> Any | None:
  """``module`` if this process has imported it, else None (no import).

  For isinstance checks against a library's types: a value of a type from
  ``flax.nnx`` or ``flax.core.meta`` can only exist once that module is
  imported, so asking ``sys.modules`` answers the same as importing it,
  without the import (flax costs 0.4 s of start-up, which a process that never
  uses it, such as ``python -m orbax_flax list``, need not pay).

  Example:
    >>> loaded("sys") is sys, loaded("a_module_nobody_imported")
    (True, None)
  """
  return sys.modules.get(module)


Path = tuple[str, ...]

# Python and numpy scalars stored inline in the checkpoint's JSON metadata.
_INLINE_TYPES = (bool, int, float, complex, str, bytes, np.generic)


def path_str(path: Path) -> str:
  """Formats a key path for messages: ``params/Dense_0/kernel``.

  A ``/`` inside a key is escaped, so that ``{"a/b": x}`` and ``{"a": {"b": x}}``
  read differently.

  Example:
    >>> path_str(("params", "Dense_0", "kernel")), path_str(("a/b",))
    ('params/Dense_0/kernel', 'a\\\\/b')
  """
  if not path:
    return "<root>"
  return "/".join(p.replace("\\", "\\\\").replace("/", "\\/") for p in path)


def key_part(entry: Any) -> str:
  """Turns one jax key entry (DictKey, GetAttrKey, ...) into a path part."""
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def is_box(x: Any) -> bool:
  """True for a Linen partitioning box (``nn.Partitioned``, ``nn.LogicallyPartitioned``).

  Any ``flax.core.meta.AxisMetadata`` whose one pytree child is ``value``.
  """
  box = getattr(loaded("flax.core.meta"), "AxisMetadata", None)  # None: not (yet) imported
  if box is None or not isinstance(x, box):
    return False
  keyed = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]
  return len(keyed) == 1 and key_part(keyed[0][0][0]) == "value"


def flatten(tree: Any) -> list[tuple[Path, Any]]:
  """Flattens ``tree`` like ``jax.tree_util`` into ``(path, leaf)`` pairs.

  The leaves come in jax's order; a box's ``value`` has the box's own path.

  Example:
    >>> from flax import linen as nn
    >>> flatten({"w": nn.Partitioned(1.0, ("x",)), "b": [2.0]})
    [(('b', '0'), 2.0), (('w',), 1.0)]
  """
  out: list[tuple[Path, Any]] = []
  for p, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
    path = tuple(key_part(k) for k in p)
    if is_box(leaf):
      out.extend((path + q, x) for q, x in flatten(leaf.value))
    else:
      out.append((path, leaf))
  return out


@functools.lru_cache(maxsize=256)  # a few names; asked once per leaf of every restore
def dtype_from_name(name: str) -> np.dtype:
  """``np.dtype`` that also knows ml_dtypes names (bfloat16, int4, ...).

  Example:
    >>> dtype_from_name("bfloat16").name
    'bfloat16'
    >>> dtype_from_name("bf16")
    Traceback (most recent call last):
    ...
    ValueError: dtype 'bf16' is not a name numpy or ml_dtypes knows; write one such as 'float32', 'bfloat16', 'float16', 'int8' or 'float8_e4m3fn'
  """
  try:
    return np.dtype(name)
  except TypeError:
    pass
  try:
    return np.dtype(getattr(ml_dtypes, name))
  except (AttributeError, TypeError):
    raise ValueError(f"dtype {name!r} is not a name numpy or ml_dtypes knows; write one such as"
                     " 'float32', 'bfloat16', 'float16', 'int8' or 'float8_e4m3fn'") from None


def number_kind(dtype: np.dtype) -> str:
  """numpy's kind of ``dtype``, with ml_dtypes' numbers (kind "V" to numpy, as any opaque
  type) told apart: "i" for int2/int4, "u" for uint2/uint4, "f" for bfloat16, float8_*,
  float4_*; "V" for anything else opaque.

  Example:
    >>> [number_kind(dtype_from_name(n)) for n in ("int4", "uint4", "bfloat16", "complex64")]
    ['i', 'u', 'f', 'c']
  """
  if dtype.kind != "V":
    return dtype.kind
  try:
    return "i" if ml_dtypes.iinfo(dtype).min < 0 else "u"
  except (TypeError, ValueError):
    pass
  try:
    ml_dtypes.finfo(dtype)
    return "f"
  except (TypeError, ValueError):
    return "V"


def is_supported_dtype(dtype: np.dtype) -> bool:
  """True for bool, integer, float and complex dtypes, ml_dtypes included."""
  dtype = np.dtype(dtype)
  if dtype.kind == "f" and dtype.itemsize > 8 or dtype.kind == "c" and dtype.itemsize > 16:
    return False  # long double: neither JAX nor zarr has it
  return dtype.kind in "biufc" or hasattr(ml_dtypes, dtype.name)


def leaf_kind(leaf: Any) -> str | None:
  """Classifies a leaf: "jax", "numpy", "value", or None if unsupported."""
  if isinstance(leaf, jax.Array):
    if isinstance(leaf, jax.core.Tracer):
      return None
    return "jax"
  if isinstance(leaf, np.ma.MaskedArray):  # its mask would not be saved: refused, not dropped
    return None
  if isinstance(leaf, np.ndarray):
    return "numpy" if is_supported_dtype(leaf.dtype) else None
  if isinstance(leaf, (str, bytes)):  # np.str_ and np.bytes_ too
    return "value"
  if isinstance(leaf, np.generic):
    return "value" if is_supported_dtype(leaf.dtype) else None
  if isinstance(leaf, _INLINE_TYPES):
    return "value"
  return None


def unsupported_leaf_error(item: str, path: Path, leaf: Any) -> errors.UnsupportedLeafError:
  what = type(leaf).__name__
  if isinstance(leaf, np.ma.MaskedArray):
    return errors.UnsupportedLeafError(
        f"Cannot save leaf {item}/{path_str(path)}: a numpy masked array, whose mask no"
        " checkpoint format here holds (its values alone would come back unmasked). Save the"
        " values and the mask as two arrays, e.g. {'data': np.ma.getdata(x), 'mask':"
        " np.ma.getmaskarray(x)}, and rebuild it with np.ma.masked_array(data, mask).")
  if isinstance(leaf, (np.ndarray, np.generic)):
    what = f"numpy value of dtype {leaf.dtype}"
  elif isinstance(leaf, jax.core.Tracer):
    what = "a jax tracer (save was called inside jit/grad/vmap)"
  return errors.UnsupportedLeafError(
      f"Cannot save leaf {item}/{path_str(path)}: {what} is not a supported"
      " leaf type. Supported: jax.Array, numpy arrays of bool/int/float/complex"
      " dtypes, Python and numpy scalars, str, bytes and None. Convert it (e.g."
      " np.asarray(x)) or remove it from the tree, or mark it as a static field"
      " if it is not state.")


def canonical_bool(a: np.ndarray) -> np.ndarray:
  """``a``, or, for a bool array whose bytes are not all 0 or 1 (a view of other data:
  ``np.frombuffer(..., bool)``), the booleans it holds stored 0/1: zarr readers
  (tensorstore's, orbax-checkpoint's) refuse other bytes as damage.

  Example:
    >>> canonical_bool(np.frombuffer(bytes([0, 2, 1]), np.bool_)).view(np.uint8).tolist()
    [0, 1, 1]
  """
  if a.dtype == np.bool_ and a.size and a.view(np.uint8).max() > 1:
    return a.view(np.uint8) != 0
  return a


_NAN_BITS = 0x7FF8000000000000  # the NaN float.hex() writes as "nan" (and fromhex reads)


def float_text(x: float) -> str:
  """A Python float as exact text: ``float.hex``, and a NaN whose sign or payload is not the
  plain NaN's as ``nan:<its 64 bits in hex>`` (``float.hex`` writes every NaN as "nan").

  Example:
    >>> float_text(0.5), float_text(float("nan")), float_text(-float("nan"))
    ('0x1.0000000000000p-1', 'nan', 'nan:fff8000000000000')
  """
  bits = struct.unpack("<Q", struct.pack("<d", x))[0]
  return x.hex() if x == x or bits == _NAN_BITS else f"nan:{bits:016x}"


def float_from_text(text: str) -> float:
  """The float :func:`float_text` wrote (ValueError for other text)."""
  if text.startswith("nan:") and len(text) == 20:
    return struct.unpack("<d", struct.pack("<Q", int(text[4:], 16)))[0]
  return float.fromhex(text)


def encode_value(value: Any) -> dict:
  """Encodes an inline scalar exactly as tagged JSON."""
  if isinstance(value, np.str_):
    value = str(value)
  elif isinstance(value, np.bytes_):
    value = bytes(value)
  if isinstance(value, np.generic):
    native = value.astype(value.dtype.newbyteorder("="))  # the bytes are read as native
    return {"t": "np", "dtype": value.dtype.name,
            "b64": base64.b64encode(native.tobytes()).decode()}
  if isinstance(value, bool):
    return {"t": "bool", "v": value}
  if isinstance(value, int):
    return {"t": "int", "v": str(value)}
  if isinstance(value, float):
    return {"t": "float", "v": float_text(value)}
  if isinstance(value, complex):
    return {"t": "complex", "v": [float_text(value.real), float_text(value.imag)]}
  if isinstance(value, str):
    return {"t": "str", "v": value}
  if isinstance(value, bytes):
    return {"t": "bytes", "v": base64.b64encode(value).decode()}
  raise TypeError(f"not an inline value: {type(value).__name__}")


def decode_value(enc: dict) -> Any:
  """Inverse of :func:`encode_value`."""
  t = enc["t"]
  if t == "np":
    dtype = dtype_from_name(enc["dtype"])
    return np.frombuffer(base64.b64decode(enc["b64"]), dtype=dtype)[0]
  if t == "bool":
    return bool(enc["v"])
  if t == "int":
    return int(enc["v"])
  if t == "float":
    return float_from_text(enc["v"])
  if t == "complex":
    return complex(float_from_text(enc["v"][0]), float_from_text(enc["v"][1]))
  if t == "str":
    return str(enc["v"])
  if t == "bytes":
    return base64.b64decode(enc["v"])
  raise ValueError(f"unknown inline value tag {t!r}")


def _is_namedtuple(x: Any) -> bool:
  return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _is_leaf(x: Any) -> bool:
  # treedef_is_leaf is also true for empty containers such as optax.EmptyState().
  treedef = jax.tree_util.tree_structure(x)
  return treedef.num_nodes == 1 and treedef.num_leaves == 1


MAX_DEPTH = 200  # containers within containers: far below Python's recursion limit (1000)


def encode_structure(tree: Any) -> tuple[dict, list[tuple[Path, Any, str | None]]]:
  """Encodes the containers of ``tree`` as JSON and lists its leaves.

  Returns:
    ``(structure, leaves)``: ``leaves`` holds ``(path, leaf, kind)`` in the order
    the structure refers to them (``{"t": "leaf", "i": index}``), ``kind`` as
    :func:`leaf_kind` says. None is kept as structure, as in jax.
  """
  leaves: list[tuple[Path, Any, str | None]] = []

  def walk(node: Any, path: Path) -> dict:
    if node is None:
      return {"t": "none"}
    if len(path) > MAX_DEPTH:
      raise ValueError(
          f"the tree is nested more than {MAX_DEPTH} containers deep (at"
          f" {path_str(path[:3])}/.../{path_str(path[-2:])}); a checkpoint's structure is"
          " encoded and read back by recursion, which Python bounds. Fix: keep deep chains as a"
          " list (layers = [layer0, layer1, ...], not {'next': {'next': ...}}).")
    if is_box(node):  # metadata, not structure: stored as its value
      return walk(node.value, path)
    if _is_leaf(node):
      leaves.append((path, node, leaf_kind(node)))
      return {"t": "leaf", "i": len(leaves) - 1}
    if type(node) is dict:
      raw = sorted(node)
      children = [walk(node[k], path + (str(k),)) for k in raw]
      if raw and all(isinstance(k, int) and not isinstance(k, bool) for k in raw):
        # (bool keys are named like any other key: the manifest's int keys are never bools)
        return {"t": "dict", "int_keys": True, "k": raw, "c": children}
      return {"t": "dict", "k": [str(k) for k in raw], "c": children}
    if type(node) in (list, tuple):
      children = [walk(c, path + (str(i),)) for i, c in enumerate(node)]
      return {"t": type(node).__name__, "c": children}
    if _is_namedtuple(node):
      fields = list(type(node)._fields)
      children = [walk(c, path + (f,)) for f, c in zip(fields, node)]
      return {"t": "namedtuple", "name": type(node).__name__, "k": fields, "c": children}
    # Any other registered node: its direct children with their keys. (We do
    # not use flatten_one_level_with_keys: it mislabels namedtuple fields.)
    keyed, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    keys = [key_part(p[0]) for p, _ in keyed]
    children = [walk(c, path + (k,)) for k, (_, c) in zip(keys, keyed)]
    t = type(node)
    return {"t": "node", "type": f"{t.__module__}.{t.__qualname__}", "k": keys, "c": children}

  return walk(tree, ()), leaves


@functools.lru_cache(maxsize=None)
def _namedtuple_type(name: str, fields: tuple[str, ...]) -> type:
  # rename=True: a namedtuple made with it has fields "_<index>", which it gives back as they are
  return collections.namedtuple(name, fields, rename=True)


def decode_structure(enc: dict, leaves: list[Any]) -> Any:
  """Rebuilds a tree from :func:`encode_structure` output and leaf values."""
  t = enc["t"]
  if t == "none":
    return None
  if t == "leaf":
    return leaves[enc["i"]]
  children = [decode_structure(c, leaves) for c in enc["c"]]
  if t == "list":
    return children
  if t == "tuple":
    return tuple(children)
  if t == "namedtuple":
    return _namedtuple_type(enc["name"], tuple(enc["k"]))(*children)
  return dict(zip(enc["k"], children))


class _Slot:
  """A placeholder leaf in a skeleton tree (not a container, so a pytree leaf)."""

  def __init__(self, i: int):
    self.i = i


def _collision(name: Path, leaf: Path, inner: Path) -> errors.TreeMismatchError:
  return errors.TreeMismatchError(
      f"{path_str(name)} is both a leaf ({path_str(leaf)}) and a subtree (holding"
      f" {path_str(inner)})", [path_str(leaf), path_str(inner)])


def _first_leaf(node: dict[str, Any], paths: list[Path]) -> Path:
  while not isinstance(node, _Slot):
    node = next(iter(node.values()))
  return paths[node.i]


def structure_from_paths(paths: list[Path], sequences: frozenset[Path] = frozenset(),
                         empty: Mapping[Path, Any] = types.MappingProxyType({})
                         ) -> tuple[dict, list[int]]:
  """The structure of nested dicts (lists at ``sequences``) holding leaves at ``paths``, and
  the empty nodes ``empty`` (path -> ``{}``, ``[]``, ``()`` or None).

  Returns:
    ``(structure, order)``: ``order[j]`` is the index into ``paths`` of the
    structure's ``j``-th leaf.

  Example:
    >>> structure_from_paths([("b",), ("a", "x")])[1]
    [1, 0]
  """
  root: dict[str, Any] = {}
  for i, path in enumerate(paths):
    if not path:
      if len(paths) != 1:
        raise errors.TreeMismatchError(
            f"the root is a leaf and also holds {len(paths) - 1} other leaves", ["<root>"])
      return {"t": "leaf", "i": 0}, [0]
    node = root
    for d, k in enumerate(path[:-1]):
      child = node.setdefault(k, {})
      if isinstance(child, _Slot):
        raise _collision(path[:d + 1], paths[child.i], path)
      node = child
    there = node.get(path[-1])
    if isinstance(there, _Slot):
      raise errors.TreeMismatchError(f"{path_str(path)} is named twice", [path_str(path)])
    if there is not None:  # a subtree already: some earlier path goes through this one
      raise _collision(path, path, _first_leaf(there, paths))
    node[path[-1]] = _Slot(i)
  for path, container in empty.items():
    node = root
    for k in path[:-1]:
      node = node.setdefault(k, {})
      if not isinstance(node, dict):
        raise errors.TreeMismatchError(f"{path_str(path)}: an empty container inside a leaf",
                                       [path_str(path)])
    if path and path[-1] not in node:
      node[path[-1]] = None if container is None else type(container)()

  def build(node: Any, prefix: Path) -> Any:
    if node is None or isinstance(node, (_Slot, list, tuple)):  # (an empty list or tuple)
      return node
    children = {k: build(v, prefix + (k,)) for k, v in node.items()}
    if prefix in sequences and sorted(children) == sorted(str(j) for j in range(len(children))):
      return [children[str(j)] for j in range(len(children))]
    return children

  structure, leaves = encode_structure(build(root, ()))
  return structure, [slot.i for _, slot, _ in leaves]
