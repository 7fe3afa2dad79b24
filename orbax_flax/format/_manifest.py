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

An array of many chunks (thousands of hosts) stores its chunk owners compactly
(``owners_z``: zlib-compressed little-endian uint32, base64), which makes the
manifest format version 2; :func:`decode` turns them back into the ``owners``
list, so readers see the same manifest either way. A manifest without such an
array is written as version 1, readable by every orbax_flax.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import zlib
from typing import Any

import jax
import numpy as np

from orbax_flax.format import _records
from orbax_flax.format import _records_decode
from orbax_flax import errors

MANIFEST_KEY = "_CHECKPOINT"
PACK_ALIGN = _records_decode.PACK_ALIGN  # for the writer (orbax_flax.engine._planning)
ITEM_NAME = _records_decode.ITEM_NAME
FORMAT = "orbax_flax"
VERSION = 2                 # the newest format version, written only when needed (see encode)
READS = (1, 2)              # the format versions this library reads
COMPACT_OWNERS = 1024       # an array of this many chunks or more stores its owners compactly
_MAX_OWNERS = 1 << 24       # chunks of one array a reader accepts (512 TB at 32 MiB a chunk)
_MAGIC = b"orbax_flax checkpoint v1 "
# The largest manifest read or written. A manifest holds a few hundred bytes a leaf (owners of
# many chunks compacted, ~40 bytes a chunk of a differential save's hashes): 20,000 leaves are
# ~6 MB; a crafted one must not make a reader load gigabytes of JSON.
MAX_MANIFEST_BYTES = 256 << 20
SUMMARY_READ_BYTES = 4 << 10  # enough for the header and a typical summary (else see summary_extent)


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _dumps(obj: Any) -> bytes:
  return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def encode(manifest: dict[str, Any], compact_owners: int = COMPACT_OWNERS) -> bytes:
  """Serialises a manifest: header, summary line, body.

  Owner lists of ``compact_owners`` chunks or more are stored as ``owners_z``
  (format version 2); a manifest without any is version 1. The records of
  ``manifest`` are not changed.
  """
  items, compacted = {}, False
  for name, item in manifest["items"].items():
    leaves = []
    for rec in item["leaves"]:
      owners = rec.get("owners") if isinstance(rec, dict) else None
      if owners is not None and len(owners) >= compact_owners:
        rec = {k: v for k, v in rec.items() if k != "owners"}
        rec["owners_z"] = _pack_owners(owners)
        compacted = True
      leaves.append(rec)
    items[name] = dict(item, leaves=leaves)
  version = 2 if compacted else 1
  summary = {k: v for k, v in manifest.items() if k != "items"}
  summary["version"] = version
  summary["item_bytes"] = {name: sum(r.get("nbytes", 0) for r in item["leaves"])
                           for name, item in manifest["items"].items()}
  summary_line = _dumps(summary)
  body = _dumps({"format": FORMAT, "version": version, "items": items})
  header = _MAGIC + (f"summary_sha256={_sha(summary_line)} sha256={_sha(body)}"
                     f" summary_bytes={len(summary_line)}").encode()
  data = header + b"\n" + summary_line + b"\n" + body
  if len(data) > MAX_MANIFEST_BYTES:
    leaves = sum(len(i["leaves"]) for i in manifest["items"].values())
    raise ValueError(
        f"the checkpoint's manifest would be {len(data) >> 20} MiB, more than the"
        f" {MAX_MANIFEST_BYTES >> 20} MiB a reader accepts ({leaves} leaves): save fewer,"
        " larger arrays (e.g. stack per-layer weights), or less custom metadata.")
  return data


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


def _json(data: bytes, where: str, what: str) -> dict[str, Any]:
  try:
    value = json.loads(data)
  except (ValueError, RecursionError) as e:
    raise errors.CheckpointCorruptedError(f"{where}: the {what} is not valid JSON ({e})") from None
  if not isinstance(value, dict):
    raise errors.CheckpointFormatError(f"{where}: the {what} is a {type(value).__name__}, not a"
                                       " JSON object; not an orbax_flax manifest")
  return value


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


def decode_summary(data: bytes, where: str) -> _records.Summary | None:
  """The verified summary from the first bytes of a manifest; None if cut short."""
  fields, rest = _split_header(data, where)
  line, newline, _ = rest.partition(b"\n")
  if not newline:
    return None
  _verify(line, fields.get("summary_sha256"), where)
  summary = _json(line, where, "summary")
  _check_version(summary, where)
  return _records_decode.decode_summary(summary, where)


def _check_version(parsed: dict[str, Any], where: str) -> int:
  if parsed.get("format") != FORMAT:
    raise errors.CheckpointFormatError(
        f"{where}: format {parsed.get('format')!r}, not {FORMAT!r}; this is not an orbax_flax"
        " checkpoint.")
  version = parsed.get("version")
  if type(version) is not int or version not in READS:
    newer = type(version) is int and version > VERSION
    raise errors.CheckpointFormatError(
        f"{where}: written in orbax_flax checkpoint format version {version!r}"
        f"{' (by a newer orbax_flax)' if newer else ''}; this orbax_flax reads format versions"
        f" {', '.join(map(str, READS))}." + (" Upgrade orbax_flax to read it." if newer else ""))
  return version


def summary_extent(data: bytes) -> int | None:
  """How many leading bytes of a manifest hold its header and summary, if its header says so.

  For a summary longer than :data:`SUMMARY_READ_BYTES`: the reader reads that
  many bytes instead of the whole manifest. None for manifests written before
  the header recorded it (or a header that is not ours: decoding tells why).
  """
  header, newline, _ = data.partition(b"\n")
  if not newline or not header.startswith(_MAGIC):
    return None
  for field in header[len(_MAGIC):].split():
    name, _, value = field.partition(b"=")
    if name == b"summary_bytes" and value.isdigit():
      return len(header) + 1 + int(value) + 1
  return None


def decode(data: bytes, where: str) -> _records.Manifest:
  """Parses, verifies and checks a whole manifest into records (see ``_records_decode``).

  Raises:
    CheckpointCorruptedError: a damaged manifest (CheckpointFormatError: one
      not written by orbax_flax, naming the field and the value).
  """
  fields, rest = _split_header(data, where)
  line, _, body = rest.partition(b"\n")
  _verify(line, fields.get("summary_sha256"), where)
  _verify(body, fields.get("sha256"), where)
  parsed = _json(body, where, "body")
  summary = _json(line, where, "summary")
  version = _check_version(parsed, where)
  _check_version(summary, where)
  items = parsed.get("items")
  if version >= 2:
    _expand_owners(items, where)
  return _records_decode.decode(summary, items, version, where)


def _pack_owners(owners: list[int]) -> str:
  return base64.b64encode(zlib.compress(np.asarray(owners, "<u4").tobytes(), 1)).decode()


def _expand_owners(items: Any, where: str) -> None:
  """Replaces every ``owners_z`` by the ``owners`` list it encodes (checked when decoded next)."""
  def bad(problem: str):
    raise errors.CheckpointCorruptedError(
        f"{where}: {problem}; this manifest was not written by orbax_flax (damaged or crafted).")

  if not isinstance(items, dict):
    return  # the decoder says what is wrong
  for name, item in items.items():
    for rec in item.get("leaves", []) if isinstance(item, dict) else []:
      if not isinstance(rec, dict) or "owners_z" not in rec:
        continue
      shape, chunk, text = rec.get("shape"), rec.get("chunk_shape"), rec.pop("owners_z")
      if (not isinstance(shape, list) or not isinstance(chunk, list) or len(shape) != len(chunk)
          or not all(type(d) is int and d >= 0 for d in shape)
          or not all(type(c) is int and c >= 1 for c in chunk) or "owners" in rec):
        bad(f"item {name!r}: compact owners for shape {shape!r}, chunk shape {chunk!r}")
      count = math.prod(-(-s // c) for s, c in zip(shape, chunk))
      if count > _MAX_OWNERS or not isinstance(text, str):
        bad(f"item {name!r}: {count} chunk owners (at most {_MAX_OWNERS} read)")
      try:
        inflate = zlib.decompressobj()
        raw = inflate.decompress(base64.b64decode(text, validate=True), count * 4 + 1)
        complete = inflate.eof and not inflate.unconsumed_tail
      except (binascii.Error, zlib.error, ValueError) as e:
        bad(f"item {name!r}: compact owners do not decode ({e})")
      if not complete or len(raw) != count * 4:
        bad(f"item {name!r}: compact owners hold {len(raw) // 4} entries for {count} chunks")
      rec["owners"] = np.frombuffer(raw, "<u4").tolist()


def describe_sharding(sharding: Any) -> dict[str, Any]:
  """A JSON description of a sharding, for humans and for metadata() (a new dict each call)."""
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
