"""The rules every reader of a foreign file applies: JSON, names, and paths confined.

A file of another format names offsets, shapes and files that a bug or an
attacker chose. Each reader checks all of them in one function before it uses
any (:func:`orbax_flax.formats.safetensors_io.read_tensors`,
:func:`orbax_flax.formats.orbax_checkpoint.read_tree_metadata` and
``read_step_metadata``); the pieces they share are here, and all raise
:class:`~orbax_flax.errors.CheckpointFormatError` naming the file, the field
and the value.
"""

from __future__ import annotations

import json
import os
from typing import Any

from orbax_flax import errors
from orbax_flax.core import _location


class _DuplicateKey(ValueError):

  def __init__(self, key: str):
    super().__init__(key)
    self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for k, v in pairs:
    if k in out:
      raise _DuplicateKey(k)
    out[k] = v
  return out


def load_json(data: bytes | str, where: str) -> Any:
  """``data`` parsed as JSON; a key given twice in one object is refused.

  Example:
    >>> load_json(b'{"a": [1, 2]}', "f")
    {'a': [1, 2]}
    >>> load_json(b'{"a": 1, "a": 2}', "f")
    Traceback (most recent call last):
    ...
    orbax_flax.errors.CheckpointFormatError: f: key 'a' appears twice in one JSON object; damaged or crafted
  """
  try:
    return json.loads(data, object_pairs_hook=_no_duplicates)
  except _DuplicateKey as e:
    raise errors.CheckpointFormatError(
        f"{where}: key {e.key!r} appears twice in one JSON object; damaged or crafted") from None
  except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
    raise errors.CheckpointFormatError(f"{where}: not valid JSON ({str(e)[:200]}); damaged?") from None


def kind(x: Any) -> str:
  """How a message names the JSON type of ``x``."""
  return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
          int: "an integer", float: "a number", type(None): "null"}.get(type(x), type(x).__name__)


def json_object(x: Any, where: str, field: str = "the file") -> dict[str, Any]:
  if not isinstance(x, dict):
    raise errors.CheckpointFormatError(f"{where}: {field} is {kind(x)} ({short(x)}), not a"
                                       " JSON object")
  return x


def plain_name(name: Any, where: str, field: str) -> str:
  """``name`` if it names an entry directly inside a directory (no ``/``, ``\\``, NUL,
  ``.`` or ``..``, not empty); CheckpointFormatError otherwise.

  Example:
    >>> plain_name("model-00001-of-00002.safetensors", "index.json", "weight_map['w']")
    'model-00001-of-00002.safetensors'
    >>> plain_name("../private/x", "index.json", "weight_map['w']")
    Traceback (most recent call last):
    ...
    orbax_flax.errors.CheckpointFormatError: index.json: weight_map['w'] is '../private/x', not a plain name inside the checkpoint directory (no '/', '..', backslash or absolute path): a checkpoint cannot point outside itself
  """
  if not (isinstance(name, str) and _plain(name)):
    raise errors.CheckpointFormatError(
        f"{where}: {field} is {short(name)}, not a plain name inside the checkpoint directory"
        " (no '/', '..', backslash or absolute path): a checkpoint cannot point outside itself")
  return name


def _plain(name: str) -> bool:
  """Whether ``name`` names an entry directly inside a directory."""
  return name not in ("", ".", "..") and not any(c in name for c in ("/", "\\", "\0"))


def relative_name(name: Any, where: str, field: str) -> str:
  """``name`` if it is a relative path that stays inside a directory: ``/``-separated
  plain names (:func:`plain_name`); CheckpointFormatError otherwise.

  For names that a format nests on purpose, e.g. orbax-checkpoint's array
  names, which join a leaf's keys with ``.`` and keep a ``/`` inside a key.

  Example:
    >>> relative_name("mu.layer_00/attn/wk", "_METADATA", "the array name")
    'mu.layer_00/attn/wk'
    >>> relative_name("mu/../../x", "_METADATA", "the array name")
    Traceback (most recent call last):
    ...
    orbax_flax.errors.CheckpointFormatError: _METADATA: the array name is 'mu/../../x', not a relative path inside the checkpoint directory (names without '..', '.', backslash or an empty part, joined by '/'): a checkpoint cannot point outside itself
  """
  if not (isinstance(name, str) and all(_plain(part) for part in name.split("/"))):
    raise errors.CheckpointFormatError(
        f"{where}: {field} is {short(name)}, not a relative path inside the checkpoint directory"
        " (names without '..', '.', backslash or an empty part, joined by '/'): a checkpoint"
        " cannot point outside itself")
  return name


def inside(directory: str, name: Any, where: str, field: str) -> str:
  """The path of the file ``name`` inside ``directory``, checked to stay there.

  The name must be a :func:`plain_name`; the joined path, normalised, must have
  ``directory`` (its real path) as its parent. A symbolic link that is itself
  an entry of the directory is followed when the file is opened: the Hugging
  Face cache's snapshot directories are made of links into its ``blobs/``, and
  whoever made the directory placed them.
  """
  plain_name(name, where, field)
  home = os.path.realpath(directory)
  full = os.path.normpath(os.path.join(home, name))
  if os.path.dirname(full) != home:
    raise errors.CheckpointFormatError(f"{where}: {field} {name!r} resolves to {full}, outside"
                                       f" {home}")
  return full


def local_directory(path: Any, what: str) -> str:
  """``path`` made absolute, if it is a directory on a file system (local, or a shared
  mount), spelled as a save takes it: ``~`` is the home directory, and a ``file://`` URL
  is the path it names; an object-store URL or a kvstore spec is refused (``what``
  writes files).

  Raises:
    ValueError: ``path`` is not a file-system path, naming it and the fix.

  Example:
    >>> local_directory("file:///tmp/my%20model", "export_safetensors")
    '/tmp/my model'
    >>> local_directory("s3://bucket/model", "export_safetensors")
    Traceback (most recent call last):
    ...
    ValueError: export_safetensors writes files to a file system (local, or a shared mount): 's3://bucket/model' is not one. Export to a local directory, then copy it to the store (with the store's own tools).
  """
  text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
  if isinstance(text, str) and ("://" not in text or text.startswith("file://")):
    return _location.Location.parse(text).local_path  # the rules of ofx.save's paths
  raise ValueError(f"{what} writes files to a file system (local, or a shared mount):"
                   f" {path!r} is not one. Export to a local directory, then copy it to the"
                   " store (with the store's own tools).")


def is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def short(x: Any) -> str:
  text = repr(x)
  return text if len(text) <= 120 else text[:117] + "..."

