"""Moving bytes between processes with a JAX collective (gloo on CPU, NCCL on GPU).

No shared file system is assumed: each process's bytes become one row of a
global ``uint8`` array over a mesh of one device per process, and a
``ppermute`` moves every row ``shift`` processes along the ring.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from orbax_flax.core import _multihost


def _ring_mesh(order: tuple[int, ...]) -> jax.sharding.Mesh:
  """A mesh of one device per process, in ring ``order`` (process indices)."""
  firsts = {}
  for d in jax.devices():
    firsts.setdefault(d.process_index, d)
  return jax.sharding.Mesh(np.array([firsts[p] for p in order]), ("p",))


@functools.lru_cache(maxsize=8)
def _shifter(n: int, shift: int, mesh: jax.sharding.Mesh):
  perm = [(i, (i + shift) % n) for i in range(n)]

  def move(x):
    return jax.lax.ppermute(x, "p", perm)
  return jax.jit(jax.shard_map(move, mesh=mesh, in_specs=P("p"), out_specs=P("p")))


_ROUND_BYTES = 64 << 20  # bytes per collective: large messages overflow gloo's int32 sizes


def round_bytes(max_host_bytes: int = 0) -> int:
  """Bytes per collective round: its two host buffers (sent, received) stay within a budget."""
  return _ROUND_BYTES if not max_host_bytes else max(1 << 20, min(_ROUND_BYTES,
                                                                  max_host_bytes // 2))


def _fill(row: np.ndarray, lo: int, parts: list[np.ndarray]) -> None:
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


def shift_parts(parts: Any, shift: int, key: str, timeout_s: float, *,
                order: tuple[int, ...] | None = None, sink=None,
                max_round_bytes: int = 0) -> np.ndarray | int:
  """Sends the concatenation of ``parts`` ``shift`` places along the ring.

  ``parts`` is a list of uint8 arrays, or a reader with ``nbytes`` and
  ``fill(row, offset)`` (a file, sent one round at a time).

  The ring is ``order`` (process indices; default: by index): the process at
  position ``i`` sends to position ``i + shift`` and receives from ``i - shift``.
  Every process must call it with the same ``shift``, ``order`` and ``key``.
  Sizes may differ: they are agreed through the coordination service first,
  with a timeout that names a missing process, then every process passes a
  barrier of the service (:func:`~orbax_flax.core._multihost.barrier`) before
  the collective, which has no timeout: if any process gave up waiting, every
  process raises :class:`~orbax_flax.core._multihost.CoordinationTimeoutError`
  and none enters it. The bytes go in rounds of at
  most ``max_round_bytes`` (default 64 MiB; one ``ppermute`` each), copied once
  into the row each round sends and once out of the row received.

  Returns what was received, as a uint8 array; or, with ``sink(offset,
  chunk)``, hands each round's received bytes to it (streamed: nothing
  larger than a round is held) and returns the number of bytes received.
  """
  n, me = jax.process_count(), jax.process_index()
  order = tuple(range(n)) if order is None else tuple(order)
  fill = parts.fill if hasattr(parts, "fill") else functools.partial(_fill, parts=parts)
  size = parts.nbytes if hasattr(parts, "fill") else sum(p.nbytes for p in parts)
  if n == 1 or shift % n == 0:
    whole = np.empty(size, np.uint8)
    fill(whole, 0)
    if sink is None:
      return whole
    sink(0, whole)
    return whole.nbytes
  sizes = [int(s) for s in _multihost.all_gather(f"{key}/size", str(size), timeout_s,
                                                 what="report the size of its bytes")]
  # The collective has no timeout: a process must never enter it unless every process does.
  # A late process passes the gather above even after another gave up waiting there (every
  # value is published by then); the barrier fails for it instead.
  _multihost.barrier(f"{key}/enter", timeout_s, what="enter the replica exchange")
  largest = max(1, max(sizes))
  limit = max_round_bytes or _ROUND_BYTES
  width = min(limit, 1 << (largest - 1).bit_length())  # few shapes: few compilations
  mesh = _ring_mesh(order)
  sharding = NamedSharding(mesh, P("p"))
  move = _shifter(n, shift, mesh)
  pos = order.index(me)
  incoming = sizes[order[(pos - shift) % n]]
  out = np.empty(incoming, np.uint8) if sink is None else None
  row = np.empty(width, np.uint8)
  for lo in range(0, largest, width):
    fill(row, lo)
    local = jax.device_put(row.reshape(1, width), mesh.devices[pos])
    x = jax.make_array_from_single_device_arrays((n, width), sharding, [local])
    got = np.asarray(move(x).addressable_shards[0].data)[0]
    if lo < incoming:
      chunk = got[:min(incoming, lo + width) - lo]
      if sink is None:
        out[lo:lo + chunk.size] = chunk
      else:
        sink(lo, chunk)
  return out if sink is None else incoming
