"""Selectors: the part of a state ``init_from``, ``convert`` and ``export_*`` take.

A selector is ``<item>/<sub/tree>`` (keys joined by ``/``, as ``python -m
orbax_flax show`` prints them), several joined by ``,``, each optionally
``dst=src``. :func:`selections` parses one, :func:`pick` takes those parts of
a tree (live, or as read from a checkpoint), :func:`put` sets a part of a tree
of dicts (where ``init_from`` puts what it read).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax

from orbax_flax.core import _tree

Path = tuple[str, ...]


def selections(selector: str) -> list[tuple[Path, Path]]:
  """The parts a selector names: ``[(destination, source)]`` key paths.

  A selector is ``<item>/<sub/tree>`` (keys joined by ``/``, as ``python -m
  orbax_flax show`` prints them), several joined by ``,``; ``dst=src`` puts
  the source's ``src`` at ``dst`` (where the names differ, e.g. an
  orbax-checkpoint item ``default/params`` into this run's ``params``).

  Example:
    >>> selections("params, train_state/batch_stats")
    [(('params',), ('params',)), (('train_state', 'batch_stats'), ('train_state', 'batch_stats'))]
    >>> selections("params=default/params")
    [(('params',), ('default', 'params'))]
  """
  out = []
  for part in selector.split(","):
    dst, eq, src = part.strip().partition("=")
    src = src if eq else dst
    d, s = (tuple(k for k in x.strip().split("/") if k) for x in (dst, src))
    if not d or not s:
      raise ValueError(f"selector {selector!r}: {part.strip()!r} names no item; write"
                       " <item>/<sub/tree>, several joined by ',' (e.g. 'params,train_state/"
                       "batch_stats'), or dst=src")
    out.append((d, s))
  return out


def _child(node: Any, key: str) -> Any:
  """The child of a pytree node under ``key`` (a dict key, index or field name), or KeyError."""
  if _tree.is_box(node):
    node = node.value
  for p, child in jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]:
    if p and _tree.key_part(p[0]) == key:
      return child
  raise KeyError(key)


def pick(tree: Any, selector: str, *, keep_paths: bool = False) -> Any:
  """The part of ``tree`` a selector names (:func:`selections`).

  One selection gives its subtree itself (``keep_paths``: nested in dicts at
  its destination path); several give nested dicts with each at its
  destination.

  Raises:
    ValueError: a selection names nothing; the message names the keys there.

  Example:
    >>> state = {"params": {"w": 1}, "opt": (2,), "stats": {"mean": 3}}
    >>> pick(state, "params"), pick(state, "params,stats"), pick(state, "m=opt/0")
    ({'w': 1}, {'params': {'w': 1}, 'stats': {'mean': 3}}, 2)
  """
  sels = selections(selector)
  found = []
  for dst, src in sels:
    node = tree
    for depth, k in enumerate(src):
      try:
        node = _child(node, k)
      except KeyError:
        inner = node.value if _tree.is_box(node) else node
        there = [_tree.key_part(p[0]) for p, _ in jax.tree_util.tree_flatten_with_path(
            inner, is_leaf=lambda x, n=inner: x is not n)[0] if p]
        raise ValueError(f"selector {selector!r}: no {_tree.path_str(src[:depth + 1])!r}; the"
                         f" keys at {_tree.path_str(src[:depth])!r} are {there[:20]}") from None
    found.append((dst, node))
  if len(found) == 1 and not keep_paths:
    return found[0][1]
  return nested(found)


def nested(leaves: list[tuple[Path, Any]]) -> dict[str, Any]:
  """A tree of dicts holding each ``(key path, node)``.

  Example:
    >>> nested([(("bn", "scale"), 1), (("bn", "mean"), 2)])
    {'bn': {'scale': 1, 'mean': 2}}
  """
  out: dict[str, Any] = {}
  for path, node in leaves:
    at = out
    for k in path[:-1]:
      at = at.setdefault(k, {})
    at[path[-1]] = node
  return out


def put(tree: Any, path: Path, value: Any) -> Any:
  """``tree`` with ``value`` at ``path`` (through dicts and Mapping nodes; new dicts, not in place).

  Raises:
    ValueError: a node on the way is not a dict (a dataclass field is set at the item level).

  Example:
    >>> put({"a": {"b": 1, "c": 2}}, ("a", "b"), 9)
    {'a': {'b': 9, 'c': 2}}
  """
  if not path:
    return value
  if not isinstance(tree, Mapping) or path[0] not in tree:
    raise ValueError(f"cannot put a value at {_tree.path_str(path)!r}: the tree there is a"
                     f" {type(tree).__name__}" + (f" with keys {sorted(tree)}" if isinstance(
                         tree, Mapping) else ", not a dict"))
  out = dict(tree)
  out[path[0]] = put(tree[path[0]], path[1:], value)
  return out if type(tree) is dict else type(tree)(out)


def split(text: str) -> tuple[str, str]:
  """``init_from`` as (checkpoint, selector); the selector is "" when none is given.

  ``"<checkpoint>:<item>/<sub/tree>"`` names the item of the checkpoint to take,
  and optionally the subtree inside it (keys joined by ``/`` as ``python -m
  orbax_flax show`` prints them). The selector follows the last ``:`` that
  does not start a URL's ``//``; a local path that exists as written is never
  split (a directory name may contain ``:``).

  Example:
    >>> split("/runs/gemma/checkpoints:model")
    ('/runs/gemma/checkpoints', 'model')
    >>> split("gs://bucket/run/checkpoints/1000:default/params")
    ('gs://bucket/run/checkpoints/1000', 'default/params')
    >>> split("gs://bucket/run")
    ('gs://bucket/run', '')
  """
  head, sep, tail = text.rpartition(":")
  if not sep or not head or not tail.strip("/") or tail.startswith("/") or os.path.exists(text):
    return text, ""
  return head, tail.strip("/")
