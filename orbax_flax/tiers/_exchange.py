"""Moving bytes between processes with a JAX collective (gloo on CPU, NCCL on GPU).

No shared file system is assumed: each process's bytes become one row of a
global ``uint8`` array over a mesh of one device per process, and a
``ppermute`` moves every row ``shift`` processes along the ring.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from orbax_flax import _multihost


def _ring_mesh() -> jax.sharding.Mesh:
  firsts = {}
  for d in jax.devices():
    firsts.setdefault(d.process_index, d)
  devices = [firsts[p] for p in range(jax.process_count())]
  return jax.sharding.Mesh(np.array(devices), ("p",))


@functools.lru_cache(maxsize=8)
def _shifter(n: int, shift: int, mesh: jax.sharding.Mesh):
  perm = [(i, (i + shift) % n) for i in range(n)]

  def move(x):
    return jax.lax.ppermute(x, "p", perm)
  return jax.jit(jax.shard_map(move, mesh=mesh, in_specs=P("p"), out_specs=P("p")))


_ROUND_BYTES = 64 << 20  # bytes per collective: large messages overflow gloo's int32 sizes


def _fill(row: np.ndarray, parts: list[np.ndarray], lo: int) -> None:
  """``row`` = bytes ``[lo, lo + len(row))`` of the concatenated ``parts`` (zero past the end)."""
  at, filled = 0, 0
  for p in parts:
    flat = p.reshape(-1).view(np.uint8)
    start, stop = max(lo, at), min(lo + row.size, at + flat.size)
    if start < stop:
      row[start - lo:stop - lo] = flat[start - at:stop - at]
      filled = max(filled, stop - lo)
    at += flat.size
  row[filled:] = 0


def shift_parts(parts: list[np.ndarray], shift: int, key: str, timeout_s: float) -> np.ndarray:
  """Sends the concatenation of ``parts`` (uint8 arrays) to process ``(me + shift) % n``.

  Returns what process ``(me - shift) % n`` sent, as a uint8 array. Every
  process must call it with the same ``shift`` and ``key``. Sizes may differ:
  they are agreed through the coordination service. The bytes go in rounds of
  at most 64 MiB (one ``ppermute`` each), copied once into the row each round
  sends and once out of the row received.
  """
  n, me = jax.process_count(), jax.process_index()
  size = sum(p.nbytes for p in parts)
  if n == 1 or shift % n == 0:
    return np.concatenate([p.reshape(-1).view(np.uint8) for p in parts]) if parts else np.zeros(
        0, np.uint8)
  sizes = [int(s) for s in _multihost.all_gather(f"{key}/size", str(size), timeout_s,
                                                 what="report the size of its bytes")]
  largest = max(1, max(sizes))
  width = min(_ROUND_BYTES, 1 << (largest - 1).bit_length())  # few shapes: few compilations
  mesh = _ring_mesh()
  sharding = NamedSharding(mesh, P("p"))
  move = _shifter(n, shift, mesh)
  incoming = sizes[(me - shift) % n]
  out = np.empty(incoming, np.uint8)
  row = np.empty(width, np.uint8)
  for lo in range(0, largest, width):
    _fill(row, parts, lo)
    local = jax.device_put(row.reshape(1, width), mesh.devices[me])
    x = jax.make_array_from_single_device_arrays((n, width), sharding, [local])
    got = np.asarray(move(x).addressable_shards[0].data)[0]
    if lo < incoming:
      out[lo:min(incoming, lo + width)] = got[:min(incoming, lo + width) - lo]
  return out
