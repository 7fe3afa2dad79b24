"""Restore-time transforms: map what a checkpoint holds onto what the target wants.

``restore(path, target, transforms=[...])`` applies each transform, in order,
to the list of leaves the checkpoint holds (any format), before the target is
checked; so every remaining mismatch is still reported by key path before any
data is read. Key paths are written ``a/b/c`` (``/`` between keys) and patterns
are regular expressions matched against the whole path.

* :class:`Rename` ``(pattern, to)``: ``re.sub``-style renaming, or a function.
* :class:`Drop` ``(pattern)``: ignore saved leaves (an old optimizer's state).
* :class:`FromTarget` ``(pattern)``: a target leaf the checkpoint lacks takes
  the target's own value (the target leaf must be a concrete array): a new
  head when fine-tuning.
* :class:`Stack` ``(pattern, to)``: per-layer arrays ``layers_0 .. layers_N-1``
  become one array with a leading axis of N (``nn.scan``'d layers).
  ``pattern`` has a group named ``i``, the layer number.
* :class:`Unstack` ``(pattern, to)``: the reverse; ``to`` has ``{i}`` where the
  layer number goes.
* :class:`Cast` ``(pattern, dtype)``: convert the matching leaves to ``dtype``,
  even where that loses precision (asking is the opt-in).
* :class:`Transpose` ``(pattern, axes=None)``: permute the axes of the
  matching arrays (default: reverse them), e.g. a PyTorch/Hugging Face
  ``Linear`` weight ``(out, in)`` into a Flax ``Dense`` kernel ``(in, out)``.

Stacking, unstacking, casting and transposing read each source array's box
straight into the result's buffer (a cast or a transpose through a temporary
of the box's size; with ``max_host_bytes``, of slabs of the box's rows within
it): no leaf is ever materialised whole when only a shard of it is needed.

Example:
  >>> import numpy as np, orbax_flax as ofx, tempfile, os
  >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
  >>> ofx.save(path, {"p": {"layers_0": {"w": np.zeros(3, np.float32)},
  ...                        "layers_1": {"w": np.ones(3, np.float32)}}})
  >>> t = ofx.transforms
  >>> out = ofx.restore(path, {"p": {"layers": {"w": np.zeros((2, 3), np.float32)}}},
  ...                   transforms=[t.Stack(r"layers_(?P<i>\\d+)/(.*)", r"layers/\\2")])
  >>> out["p"]["layers"]["w"].tolist()
  [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from orbax_flax.core import _tree
from orbax_flax import errors
from orbax_flax.format._manifest import Array, Item, Manifest, Record


def _text(rec: Record) -> str:
  return "/".join(rec.path)


def _split(path: str) -> tuple[str, ...]:
  return tuple(p for p in path.split("/") if p != "")


def _arrays_only(recs: list[Record], what: str) -> None:
  values = [_text(r) for r in recs if not isinstance(r, Array) or r.key_impl]
  if values:
    raise errors.TreeMismatchError(f"{what} applies to arrays (not PRNG keys); these are not:"
                                   f" {values}", values)


class Transform:
  """Base class: ``apply`` maps one item's saved leaf records to new ones."""

  def apply(self, item: str, recs: list[Record]) -> list[Record]:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Rename(Transform):
  """Renames saved leaves: ``Rename(r"model/(.*)", r"params/\\1")`` or ``Rename(fn)``.

  A function gets the path text and returns the new text (or the same).
  """
  pattern: str | Callable[[str], str]
  to: str = ""

  def apply(self, item, recs):
    out = []
    for r in recs:
      old = _text(r)
      if callable(self.pattern):
        new = self.pattern(old)
      else:
        new = re.sub(f"^(?:{self.pattern})$", self.to, old)
      out.append(r if new == old else dataclasses.replace(r, path=_split(new)))
    return out


@dataclasses.dataclass(frozen=True)
class Drop(Transform):
  """Ignores the saved leaves whose path matches ``pattern``."""
  pattern: str

  def apply(self, item, recs):
    return [r for r in recs if not re.fullmatch(self.pattern, _text(r))]


@dataclasses.dataclass(frozen=True)
class FromTarget(Transform):
  """Target leaves matching ``pattern`` that the checkpoint lacks keep the target's value."""
  pattern: str

  def apply(self, item, recs):
    return recs

  def matches(self, path: str) -> bool:
    return re.fullmatch(self.pattern, path) is not None


@dataclasses.dataclass(frozen=True)
class Cast(Transform):
  """Converts the matching saved arrays to ``dtype`` (lossy conversions included)."""
  pattern: str
  dtype: Any

  def apply(self, item, recs):
    dtype = np.dtype(_tree.dtype_from_name(self.dtype) if isinstance(self.dtype, str) else self.dtype)
    out = []
    for r in recs:
      if (not isinstance(r, Array) or r.key_impl or not re.fullmatch(self.pattern, _text(r))
          or r.dtype == dtype.name):
        out.append(r)
        continue
      out.append(Array(path=r.path, kind="array", shape=r.shape, dtype=dtype.name,
                       nbytes=r.nbytes // r.np_dtype.itemsize * dtype.itemsize,
                       sharding=r.sharding, derived=_Cast(item, r, dtype)))
    return out


@dataclasses.dataclass(frozen=True)
class Stack(Transform):
  """Stacks per-layer arrays into one with a leading layer axis.

  ``Stack(r"layers_(?P<i>\\d+)/(.*)", r"layers/\\2")`` makes
  ``layers/mlp/kernel`` of shape ``(N, ...)`` from ``layers_0/mlp/kernel`` ..
  ``layers_{N-1}/mlp/kernel``, which must all be present and alike.
  """
  pattern: str
  to: str

  def apply(self, item, recs):
    regex = re.compile(self.pattern)
    if "i" not in regex.groupindex:
      raise ValueError(f"Stack pattern {self.pattern!r} needs a group named i for the layer"
                       r" number, e.g. r'layers_(?P<i>\d+)/(.*)'")
    groups: dict[str, dict[int, Array]] = {}
    out, first = [], {}
    for r in recs:
      m = regex.fullmatch(_text(r))
      if not m:
        out.append(r)
        continue
      new = m.expand(self.to)
      groups.setdefault(new, {})[int(m.group("i"))] = r
      if new not in first:
        first[new] = len(out)
        out.append(None)
    problems = []
    for new, parts in groups.items():
      _arrays_only(list(parts.values()), "Stack")
      n = len(parts)
      if sorted(parts) != list(range(n)):
        problems.append(f"{new}: layers {sorted(parts)} are not 0..{n - 1}")
        continue
      ordered = [parts[k] for k in range(n)]
      kinds = {(p.shape, p.dtype) for p in ordered}
      if len(kinds) != 1:
        problems.append(f"{new}: the layers differ in shape or dtype: {sorted(kinds)}")
        continue
      (shape, dtype), = kinds
      out[first[new]] = Array(path=_split(new), kind="array", shape=(n, *shape), dtype=dtype,
                              nbytes=sum(p.nbytes for p in ordered),
                              sharding=f"stacked from {n} arrays", derived=_Stacked(item, ordered))
    if problems:
      raise errors.TreeMismatchError("cannot stack:\n  " + "\n  ".join(problems), problems)
    return out


@dataclasses.dataclass(frozen=True)
class Unstack(Transform):
  """Splits arrays along their leading axis: ``Unstack(r"layers/(.*)", r"layers_{i}/\\1")``."""
  pattern: str
  to: str

  def apply(self, item, recs):
    if "{i}" not in self.to:
      raise ValueError(f"Unstack target {self.to!r} needs {{i}} where the layer number goes")
    out = []
    for r in recs:
      m = re.fullmatch(self.pattern, _text(r))
      if not m:
        out.append(r)
        continue
      _arrays_only([r], "Unstack")
      if not r.shape:
        raise errors.TreeMismatchError(f"{_text(r)}: a scalar cannot be unstacked", [_text(r)])
      n, rest = r.shape[0], r.shape[1:]
      template = m.expand(self.to.replace("{i}", "\0"))
      for k in range(n):
        out.append(Array(path=_split(template.replace("\0", str(k))), kind="array",
                         shape=rest, dtype=r.dtype, nbytes=r.nbytes // max(n, 1),
                         sharding=f"layer {k} of {_text(r)}", derived=_Slice(item, r, k)))
    return out


@dataclasses.dataclass(frozen=True)
class Transpose(Transform):
  """Permutes the axes of the matching saved arrays (default: reverses them).

  A PyTorch/Hugging Face ``Linear`` weight is ``(out, in)``, a Flax ``Dense``
  kernel ``(in, out)``: ``[Rename(r"(.*)/weight", r"\\1/kernel"),
  Transpose(r".*/kernel")]`` turns one into the other. ``axes`` is a
  permutation as for ``numpy.transpose``: axis ``j`` of the result is axis
  ``axes[j]`` of the saved array.

  The read stays sharded: a box of the result is read as the matching box of
  the saved array (each process reads only the region its devices hold; a
  column block of the kernel is a block of whole rows of the weight, a few long
  runs of the file). What it costs: each box passes through a temporary buffer
  of its own size and is copied once, transposed, into place.

  Example:
    >>> import numpy as np, orbax_flax as ofx, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> ofx.save(path, {"m": {"up": {"weight": np.arange(6.0).reshape(2, 3)}}})
    >>> t = ofx.transforms
    >>> out = ofx.restore(path, {"m": {"up": {"kernel": np.zeros((3, 2))}}}, transforms=[
    ...     t.Rename(r"(.*)/weight", r"\\1/kernel"), t.Transpose(r".*/kernel")])
    >>> out["m"]["up"]["kernel"].tolist()
    [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
  """
  pattern: str
  axes: tuple[int, ...] | None = None

  def apply(self, item, recs):
    out = []
    for r in recs:
      if not re.fullmatch(self.pattern, _text(r)):
        out.append(r)
        continue
      _arrays_only([r], "Transpose")
      shape = list(r.shape)
      n = len(shape)
      axes = tuple(range(n - 1, -1, -1)) if self.axes is None else tuple(self.axes)
      if (not all(isinstance(a, int) and -n <= a < n for a in axes)
          or sorted(a % n for a in axes) != list(range(n))):
        raise errors.TreeMismatchError(
            f"{_text(r)}: Transpose axes {axes} are not a permutation of the {n} axes of"
            f" shape {shape}", [_text(r)])
      axes = tuple(a % n for a in axes)
      if axes == tuple(range(n)):
        out.append(r)
        continue
      out.append(Array(path=r.path, kind="array", shape=tuple(shape[a] for a in axes),
                       dtype=r.dtype, nbytes=r.nbytes,
                       sharding=f"transposed {list(axes)} of {r.sharding}",
                       derived=_Transposed(item, r, axes)))
    return out


# Derived records: each expands a request for one box into requests on the records it comes from.
Request = tuple[str, Record, tuple[tuple[int, int], ...], np.ndarray]


@dataclasses.dataclass(frozen=True)
class _Stacked:
  item: str
  parts: list[Array]

  def expand(self, box, out) -> tuple[list[Request], Callable[[], None] | None]:
    (lo, hi), rest = box[0], box[1:]
    return [(self.item, self.parts[k], rest, out[k - lo]) for k in range(lo, hi)], None


@dataclasses.dataclass(frozen=True)
class _Slice:
  item: str
  base: Array
  index: int

  def expand(self, box, out):
    return [(self.item, self.base, ((self.index, self.index + 1),) + tuple(box),
             out.reshape((1,) + out.shape))], None


@dataclasses.dataclass(frozen=True)
class _Cast:
  item: str
  base: Array
  dtype: np.dtype

  def expand(self, box, out):
    tmp = np.empty(out.shape, self.base.np_dtype)

    def finish():
      out[...] = tmp.astype(out.dtype)
    return [(self.item, self.base, box, tmp)], finish


@dataclasses.dataclass(frozen=True)
class _Transposed:
  item: str
  base: Array
  axes: tuple[int, ...]

  def expand(self, box, out):
    # Axis j of the result is axis axes[j] of the saved array.
    src = [None] * len(self.axes)
    for j, a in enumerate(self.axes):
      src[a] = box[j]
    tmp = np.empty(tuple(hi - lo for lo, hi in src), out.dtype)

    def finish():
      out[...] = tmp.transpose(self.axes)
    return [(self.item, self.base, tuple(src), tmp)], finish


def apply(manifest: Manifest, transforms: Sequence[Transform]) -> Manifest:
  """``manifest`` with every item's leaves transformed (a new manifest; the input is kept)."""
  if not transforms:
    return manifest
  for t in transforms:
    if not isinstance(t, Transform):
      raise TypeError(f"transforms must be orbax_flax.engine.transforms objects (Rename, Drop,"
                      f" FromTarget, Stack, Unstack, Cast, Transpose); got {t!r}")
  items = {}
  for name, item in manifest.items.items():
    recs = list(item.leaves)
    for t in transforms:
      recs = t.apply(name, recs)
    seen: dict[str, int] = {}
    clashes = []
    for r in recs:
      text = _text(r)
      seen[text] = seen.get(text, 0) + 1
      if seen[text] == 2:
        clashes.append(f"{name}/{text}")
    if clashes:
      raise errors.TreeMismatchError("transforms give several leaves one path:\n  "
                                     + "\n  ".join(clashes), clashes)
    structure, order = _tree.structure_from_paths([r.path for r in recs])
    items[name] = Item(structure, tuple(recs[i] for i in order), item.packed)
  return dataclasses.replace(manifest, items=items)


def from_target(transforms: Sequence[Transform] | None) -> list[FromTarget]:
  return [t for t in transforms or () if isinstance(t, FromTarget)]
