"""The checkpoint manifest: one JSON file, written last, that commits a save.

``<checkpoint>/_CHECKPOINT`` holds everything needed to read the checkpoint
without touching array data: items, their tree structure, and per array the
key path, shape, dtype, chunk grid, which process's database holds each chunk,
and a description of the sharding it was saved with. Inline values (scalars,
strings) live here too.

Layout: a header line with SHA-256s, a one-line JSON *summary* (commit time,
process and device count, custom metadata, bytes per item), then the JSON
*body* (items). The summary's own hash lets a manager list thousands of steps
by reading a few KB of each manifest; a flipped byte anywhere is detected, not
parsed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any

import jax

from orbax_flax import errors

MANIFEST_KEY = "_CHECKPOINT"
FORMAT = "orbax_flax"
VERSION = 1
_MAGIC = b"orbax_flax checkpoint v1 "
SUMMARY_READ_BYTES = 1 << 16  # enough for the header and a typical summary


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _dumps(obj: Any) -> bytes:
  return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def encode(manifest: dict[str, Any]) -> bytes:
  """Serialises a manifest: header, summary line, body."""
  summary = {k: v for k, v in manifest.items() if k != "items"}
  summary["item_bytes"] = {name: sum(r.get("nbytes", 0) for r in item["leaves"])
                           for name, item in manifest["items"].items()}
  summary_line = _dumps(summary)
  body = _dumps({"format": FORMAT, "version": VERSION, "items": manifest["items"]})
  header = _MAGIC + f"summary_sha256={_sha(summary_line)} sha256={_sha(body)}".encode()
  return header + b"\n" + summary_line + b"\n" + body


def _split_header(data: bytes, where: str) -> tuple[dict[str, str], bytes]:
  header, _, rest = data.partition(b"\n")
  if not header.startswith(_MAGIC):
    raise errors.CheckpointCorruptedError(
        f"{where} is not an orbax_flax manifest (bad header {header[:40]!r}); the file"
        " is damaged or was not written by this version of orbax_flax.")
  fields = dict(f.split("=", 1) for f in header[len(_MAGIC):].decode(errors="replace").split()
                if "=" in f)
  return fields, rest


def _verify(what: bytes, digest: str | None, where: str) -> None:
  actual = _sha(what)
  if digest != actual:
    raise errors.CheckpointCorruptedError(
        f"checksum mismatch in {where}: recorded sha256 {str(digest)[:16]}..., content"
        f" hashes to {actual[:16]}...; the manifest is corrupted. Restore from another"
        " checkpoint.")


def seal(magic: bytes, body: bytes) -> bytes:
  """``body`` behind a header line that names it (``magic``) and holds its SHA-256.

  The digest the manifest uses, for the other small files that must never be
  read damaged (the local tier's index and commit record): see :func:`unseal`.

  Example:
    >>> data = seal(b"example v1", b'{"a": 1}')
    >>> unseal(b"example v1", data, "example")
    b'{"a": 1}'
  """
  return magic + b" sha256=" + _sha(body).encode() + b"\n" + body


def unseal(magic: bytes, data: bytes, where: str) -> bytes:
  """The body of a :func:`seal`-ed file; CheckpointCorruptedError if any byte is damaged."""
  header, newline, body = data.partition(b"\n")
  prefix = magic + b" sha256="
  if not newline or not header.startswith(prefix):
    raise errors.CheckpointCorruptedError(
        f"{where}: damaged or foreign file (its header is {header[:48]!r}, not {magic!r})")
  digest = header[len(prefix):].decode(errors="replace")
  actual = _sha(body)
  if digest != actual:
    raise errors.CheckpointCorruptedError(
        f"checksum mismatch in {where}: recorded sha256 {digest[:16]}..., content hashes to"
        f" {actual[:16]}...; the file is damaged")
  return body


def decode_summary(data: bytes, where: str) -> dict[str, Any] | None:
  """The verified summary from the first bytes of a manifest; None if cut short."""
  fields, rest = _split_header(data, where)
  line, newline, _ = rest.partition(b"\n")
  if not newline:
    return None
  _verify(line, fields.get("summary_sha256"), where)
  return json.loads(line)


def decode(data: bytes, where: str) -> dict[str, Any]:
  """Parses, verifies and validates a whole manifest; raises CheckpointCorruptedError."""
  fields, rest = _split_header(data, where)
  line, _, body = rest.partition(b"\n")
  _verify(line, fields.get("summary_sha256"), where)
  _verify(body, fields.get("sha256"), where)
  try:
    parsed = json.loads(body)
    manifest = json.loads(line)
  except ValueError as e:
    raise errors.CheckpointCorruptedError(f"{where}: not valid JSON ({e})") from None
  if parsed.get("format") != FORMAT:
    raise errors.CheckpointFormatError(
        f"{where}: format {parsed.get('format')!r}, not {FORMAT!r}; this is not an orbax_flax"
        " checkpoint.")
  version = parsed.get("version")
  if version != VERSION:
    newer = isinstance(version, int) and version > VERSION
    raise errors.CheckpointFormatError(
        f"{where}: written in orbax_flax checkpoint format version {version!r}"
        f"{' (by a newer orbax_flax)' if newer else ''}; this orbax_flax reads format version"
        f" {VERSION}." + (" Upgrade orbax_flax to read it." if newer else ""))
  manifest["items"] = parsed["items"]
  validate(manifest, where)
  return manifest


ITEM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_GENERATION = re.compile(r"^[0-9a-f]{16}$")
_ARRAY_NAME = re.compile(r"^a[0-9]+$")
_VALUE_TAGS = frozenset({"np", "bool", "int", "float", "complex", "str", "bytes"})


def validate(manifest: dict[str, Any], where: str) -> None:
  """Checks every name, number and dtype a reader will use; nothing else gets through.

  A manifest's hashes only say it is intact, not that it was written by this
  library: names become paths and dtypes become buffers, so a crafted one must
  not point a read outside the checkpoint or build objects.
  """
  def bad(problem: str):
    raise errors.CheckpointCorruptedError(
        f"{where}: {problem}; this manifest was not written by orbax_flax (damaged or crafted).")

  def count(x, what, lo=0):
    if isinstance(x, bool) or not isinstance(x, int) or x < lo:
      bad(f"{what} is {x!r}, not an integer >= {lo}")
    return x

  nproc = count(manifest.get("process_count"), "process_count", 1)
  gen = manifest.get("generation")
  if not isinstance(gen, str) or not _GENERATION.match(gen):
    bad(f"generation {gen!r} is not 16 hex digits")
  items = manifest.get("items")
  if not isinstance(items, dict):
    bad("it has no items")
  for name, item in items.items():
    if not isinstance(name, str) or not ITEM_NAME.match(name) or name == MANIFEST_KEY:
      bad(f"item name {name!r} is not a plain name")
    if not isinstance(item, dict) or not isinstance(item.get("leaves"), list):
      bad(f"item {name!r} has no leaves")
    packed = item.get("packed", {})
    if not isinstance(packed, dict):
      bad(f"item {name!r}: 'packed' is not a table")
    for owner, size in packed.items():
      if not str(owner).isdigit() or int(owner) >= nproc:
        bad(f"item {name!r}: packed buffer of process {owner!r}")
      count(size, f"item {name!r}: packed size")
    for rec in item["leaves"]:
      if not isinstance(rec, dict) or not isinstance(rec.get("path"), list):
        bad(f"item {name!r}: a leaf without a key path")
      kind = rec.get("kind")
      if kind == "value":
        value = rec.get("value")
        if not isinstance(value, dict) or value.get("t") not in _VALUE_TAGS:
          bad(f"item {name!r}: a value of unknown type")
        if value["t"] == "np":
          _check_dtype(value.get("dtype"), bad)
        continue
      if kind not in ("jax", "numpy"):
        bad(f"item {name!r}: leaf kind {kind!r}")
      if not isinstance(rec.get("name"), str) or not _ARRAY_NAME.match(rec["name"]):
        bad(f"item {name!r}: array name {rec.get('name')!r}")
      for field in ("dtype", "stored_dtype"):
        _check_dtype(rec.get(field), bad)
      shape = rec.get("shape")
      if not isinstance(shape, list):
        bad(f"item {name!r}: shape {shape!r}")
      for d in shape + list(rec.get("chunk_shape", [])):
        count(d, f"item {name!r}: a dimension")
      owners = rec.get("owners", [])
      if not isinstance(owners, list) or any(count(o, "an owner") >= nproc for o in owners):
        bad(f"item {name!r}: owners {owners!r} for {nproc} process(es)")
      if "packed_offset" in rec:
        count(rec["packed_offset"], f"item {name!r}: packed offset")
        if len(owners) != 1 or str(owners[0]) not in packed:
          bad(f"item {name!r}: a packed array of no packed buffer")
      elif owners:
        chunk = rec.get("chunk_shape")
        if not isinstance(chunk, list) or len(chunk) != len(shape) or any(c < 1 for c in chunk):
          bad(f"item {name!r}: chunk shape {chunk!r} for shape {shape!r}")
        grid = 1
        for s, c in zip(shape, chunk):
          grid *= -(-s // c)
        if len(owners) != grid:
          bad(f"item {name!r}: {len(owners)} chunk owners for {grid} chunks")


def _check_dtype(name: Any, bad) -> None:
  from orbax_flax import _tree  # pylint: disable=g-import-not-at-top
  try:
    ok = isinstance(name, str) and _tree.is_supported_dtype(_tree.dtype_from_name(name))
  except (TypeError, AttributeError, ValueError):
    ok = False
  if not ok:
    bad(f"dtype {name!r} is not a numeric dtype")


@functools.lru_cache(maxsize=1024)
def describe_sharding(sharding: Any) -> dict[str, Any]:
  """A JSON description of a sharding, for humans and for metadata() (shared: do not modify)."""
  if sharding is None:
    return {"type": "host", "text": "numpy (host)"}
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
    mesh = sharding.mesh
    return {"type": "NamedSharding",
            "mesh": {"axis_names": list(mesh.axis_names), "shape": [int(mesh.shape[a]) for a in mesh.axis_names]},
            "spec": spec,
            "text": f"mesh{dict(mesh.shape)} spec{tuple(sharding.spec)}"}
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return {"type": "SingleDeviceSharding", "text": "single device"}
  return {"type": type(sharding).__name__, "text": str(sharding)}
