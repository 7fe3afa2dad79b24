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


def shift_parts(parts: list[np.ndarray], shift: int, key: str, timeout_s: float) -> np.ndarray:
  """Sends the concatenation of ``parts`` (uint8 arrays) to process ``(me + shift) % n``.

  Returns what process ``(me - shift) % n`` sent, as a uint8 array. Every
  process must call it with the same ``shift`` and ``key``. Sizes may differ:
  they are agreed through the coordination service and rows padded. The parts
  are copied once, into the row that the collective sends.
  """
  n, me = jax.process_count(), jax.process_index()
  size = sum(p.nbytes for p in parts)
  if n == 1 or shift % n == 0:
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)
  sizes = [int(s) for s in _multihost.all_gather(f"{key}/size", str(size), timeout_s,
                                                 what="report the size of its bytes")]
  width = max(1, max(sizes))
  width = 1 << (width - 1).bit_length()  # fewer distinct shapes: fewer compilations
  mesh = _ring_mesh()
  row = np.empty((1, width), np.uint8)
  at = 0
  for p in parts:
    row[0, at:at + p.nbytes] = p.reshape(-1).view(np.uint8)
    at += p.nbytes
  row[0, at:] = 0
  local = jax.device_put(row, mesh.devices[me])
  x = jax.make_array_from_single_device_arrays((n, width), NamedSharding(mesh, P("p")), [local])
  out = _shifter(n, shift, mesh)(x)
  got = np.asarray(out.addressable_shards[0].data)[0]
  return got[:sizes[(me - shift) % n]]
