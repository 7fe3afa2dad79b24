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


def decode_summary(data: bytes, where: str) -> dict[str, Any] | None:
  """The verified summary from the first bytes of a manifest; None if cut short."""
  fields, rest = _split_header(data, where)
  line, newline, _ = rest.partition(b"\n")
  if not newline:
    return None
  _verify(line, fields.get("summary_sha256"), where)
  return json.loads(line)


def decode(data: bytes, where: str) -> dict[str, Any]:
  """Parses and verifies a whole manifest; raises CheckpointCorruptedError."""
  fields, rest = _split_header(data, where)
  line, _, body = rest.partition(b"\n")
  _verify(line, fields.get("summary_sha256"), where)
  _verify(body, fields.get("sha256"), where)
  parsed = json.loads(body)
  if parsed.get("format") != FORMAT or parsed.get("version") != VERSION:
    raise errors.CheckpointCorruptedError(
        f"{where}: unsupported format {parsed.get('format')!r} version"
        f" {parsed.get('version')!r}; this orbax_flax reads {FORMAT} v{VERSION}.")
  manifest = json.loads(line)
  manifest["items"] = parsed["items"]
  return manifest


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
