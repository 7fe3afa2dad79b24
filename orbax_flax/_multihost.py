"""Agreement between the processes of a job through JAX's coordination service.

A single-process job needs none of this: every function short-circuits. In a
job started with ``jax.distributed.initialize`` the key-value store of the
coordination service carries small messages (sub-millisecond on loopback,
no compilation), so the background thread of an async save can use it.
"""

from __future__ import annotations

import jax

# How long a process waits for the others at a save's rendezvous points.
DEFAULT_TIMEOUT_S = 600.0


def process_index() -> int:
  return jax.process_index()


def process_count() -> int:
  return jax.process_count()


def client():
  """The coordination service client, or None outside a distributed job."""
  if jax.process_count() == 1:
    return None
  from jax._src.distributed import global_state  # pylint: disable=g-import-not-at-top
  return global_state.client


def publish(key: str, value: str) -> None:
  """Sets ``key`` for every process to read."""
  c = client()
  if c is not None:
    c.key_value_set(key, value, allow_overwrite=True)


def fetch(key: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
  """Waits for ``key`` to be published and returns its value."""
  c = client()
  try:
    return c.blocking_key_value_get(key, int(timeout_s * 1000))
  except Exception as e:  # The client raises XlaRuntimeError subclasses.
    raise TimeoutError(f"process {process_index()} waited {timeout_s:.0f} s for {key!r}"
                       f" from the other processes: {e}") from e


def delete(prefix: str) -> None:
  """Deletes a key (and the keys under it, as a directory). Missing is fine."""
  c = client()
  if c is not None:
    c.key_value_delete(prefix)


def broadcast(key: str, value: str | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
  """Process 0's ``value`` on every process (others pass anything)."""
  if client() is None:
    return value
  if process_index() == 0:
    publish(key, value)
    return value
  return fetch(key, timeout_s)


def all_gather(key: str, value: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str]:
  """Every process publishes ``value``; returns all values in process order."""
  if client() is None:
    return [value]
  publish(f"{key}/{process_index()}", value)
  return [fetch(f"{key}/{p}", timeout_s) for p in range(process_count())]
