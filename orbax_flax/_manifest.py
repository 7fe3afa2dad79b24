"""The checkpoint manifest: one JSON file, written last, that commits a save.

``<checkpoint>/_CHECKPOINT`` holds everything needed to read the checkpoint
without touching array data: items, their tree structure, and per array the
key path, shape, dtype, chunk grid, which process's database holds each chunk,
and a description of the sharding it was saved with. Inline values (scalars,
strings) live here too. The file starts with a header line carrying the
SHA-256 of the JSON body, so a flipped byte is detected, not parsed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax

from orbax_flax import errors

MANIFEST_KEY = "_CHECKPOINT"
FORMAT = "orbax_flax"
VERSION = 1
_MAGIC = b"orbax_flax checkpoint v1 sha256="


def encode(manifest: dict[str, Any]) -> bytes:
  body = json.dumps(manifest, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
  return _MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def decode(data: bytes, where: str) -> dict[str, Any]:
  """Parses and verifies a manifest; raises CheckpointCorruptedError."""
  header, _, body = data.partition(b"\n")
  if not header.startswith(_MAGIC):
    raise errors.CheckpointCorruptedError(
        f"{where} is not an orbax_flax manifest (bad header {header[:40]!r}); the file"
        " is damaged or was not written by orbax_flax.")
  digest = header[len(_MAGIC):].decode(errors="replace")
  actual = hashlib.sha256(body).hexdigest()
  if digest != actual:
    raise errors.CheckpointCorruptedError(
        f"checksum mismatch in {where}: recorded sha256 {digest[:16]}..., content"
        f" hashes to {actual[:16]}...; the manifest is corrupted. Restore from another"
        " checkpoint.")
  manifest = json.loads(body)
  if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
    raise errors.CheckpointCorruptedError(
        f"{where}: unsupported format {manifest.get('format')!r} version"
        f" {manifest.get('version')!r}; this orbax_flax reads {FORMAT} v{VERSION}.")
  return manifest


def describe_sharding(sharding: Any) -> dict[str, Any]:
  """A JSON description of a sharding, for humans and for metadata()."""
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
