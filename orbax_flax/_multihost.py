"""Agreement between the processes of a job through JAX's coordination service.

A single-process job needs none of this: every function short-circuits. In a
job started with ``jax.distributed.initialize`` the key-value store of the
coordination service carries small messages (sub-millisecond on loopback,
no compilation), so the background thread of an async save can use it.

Every wait has a timeout, and a wait that times out names the processes that
did not arrive. The number of round trips of each helper is constant: it does
not grow with the number of processes (the cost of a 1,000-host job is the
cost of a 2-host job plus the service's own fan-in).

Names in the key space: the coordination service is one per job, so every
prefix handed out in it (:func:`namespace`) derives from the directory its
object works on, plus a count of the prefixes of that kind already handed
out for that directory, kept in the service itself. Only the objects and
saves on one directory must come in the same order on every process (as any
collective does); nothing depends on what else a process created first.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence

import jax

# How long a process waits for the others at a rendezvous, unless told otherwise.
DEFAULT_TIMEOUT_S = 600.0

def namespace(kind: str, where: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
  """A key prefix for the next object (or save) of ``kind`` on ``where``, the same on every process.

  ``orbax_flax/<kind>/<digest of where>/<n>``: the ``n``-th prefix of this
  kind for this directory that this process asked for, counted by a key of
  the coordination service (one counter per process and directory, so the
  count survives no object and needs no module state). Every process that
  makes the same objects on ``where`` in the same order gets the same
  prefix. A single-process job shares nothing: its prefix has no count.

  The count is a call to the service, hosted by process 0: it waits at most
  ``timeout_s`` for an answer, then raises :class:`CoordinationTimeoutError`
  (the service's own increment has no timeout, so it runs on a helper thread).

  Example:
    >>> namespace("doc-example", "/tmp/run")  # one process
    'orbax_flax/doc-example/52865a8aedce'
  """
  base = f"orbax_flax/{kind}/{hashlib.sha1(str(where).encode()).hexdigest()[:12]}"
  c = client()
  if c is None:
    return base
  counter = f"{base}/count/{process_index()}"
  answer: list = []
  asked = threading.Thread(target=_call_into, args=(answer, c.key_value_increment, counter, 1),
                           name="orbax_flax-coordination", daemon=True)
  asked.start()
  asked.join(timeout_s)
  if not answer:
    raise CoordinationTimeoutError(
        f"process {process_index()} waited {timeout_s:g} s for the coordination service"
        f" (hosted by process 0) to count {counter!r}; process 0 is stopped or overloaded."
        " Raise coordination_timeout_seconds if it is only slow.", [0])
  if isinstance(answer[0], BaseException):
    raise answer[0]
  return f"{base}/{answer[0]}"


def _call_into(answer: list, call, *args) -> None:
  """Appends ``call(*args)``, or the exception it raised, to ``answer``."""
  try:
    answer.append(call(*args))
  except BaseException as e:  # pylint: disable=broad-except  # re-raised by the caller
    answer.append(e)


def leave(key: str) -> None:
  """Reports that this process is done with every key under ``key``; the last one deletes them.

  For keys unique to one operation (a save): once every process has left,
  nobody reads them any more.
  """
  c = client()
  if c is not None and c.key_value_increment(f"{key}/left", 1) == process_count():
    c.key_value_delete(key)


def check_distributed() -> None:
  """Refuses to run alone when the environment says the job has several processes.

  Under ``orbax_flax.launch`` (or a cluster launcher setting JAX_NUM_PROCESSES)
  a process that forgot ``jax.distributed.initialize`` would train alone and
  write over the others' checkpoints.

  Raises:
    RuntimeError: JAX_NUM_PROCESSES > 1 but jax.distributed is not initialised.
  """
  wanted = os.environ.get("JAX_NUM_PROCESSES", "1")
  if wanted.isdigit() and int(wanted) > 1 and jax.process_count() == 1:
    raise RuntimeError(
        f"JAX_NUM_PROCESSES={wanted} is set (this process was started by orbax_flax.launch or a"
        " cluster launcher), but jax.distributed is not initialised, so this process would train"
        " alone and write over the others' checkpoints. Call"
        " orbax_flax.launch.initialize_from_env() (or jax.distributed.initialize()) at the top of"
        " the script, before touching any device.")


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


class CoordinationTimeoutError(TimeoutError):
  """A process waited longer than the coordination timeout for others.

  Attributes:
    missing: the processes that had not arrived, when known.
  """

  def __init__(self, message: str, missing: Sequence[int] = ()):
    super().__init__(message)
    self.missing = list(missing)


def publish(key: str, value: str) -> None:
  """Sets ``key`` for every process to read."""
  c = client()
  if c is not None:
    c.key_value_set(key, value, allow_overwrite=True)


def claim(key: str, value: str) -> str:
  """Sets ``key`` to ``value`` unless it is set already; returns the value that won.

  The coordination service decides who was first, so every process that
  claims (or later reads) ``key`` sees the same value.
  """
  c = client()
  if c is None:
    return value
  try:
    c.key_value_set(key, value, allow_overwrite=False)
    return value
  except Exception as e:  # The client raises XlaRuntimeError subclasses.  pylint: disable=broad-except
    if "ALREADY_EXISTS" not in str(e):
      raise
    return c.key_value_try_get(key)


def fetch(key: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, waiting_for: str = "the other"
          " processes", missing: Sequence[int] = ()) -> str:
  """Waits for ``key`` to be published and returns its value.

  Raises:
    CoordinationTimeoutError: after ``timeout_s``, naming what was awaited.
  """
  c = client()
  try:
    return c.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
  except Exception as e:  # pylint: disable=broad-except
    if "DEADLINE_EXCEEDED" not in str(e) and "deadline" not in str(e).lower():
      raise
    raise CoordinationTimeoutError(
        f"process {process_index()} waited {timeout_s:g} s for {waiting_for} ({key!r});"
        " raise coordination_timeout_seconds if they are only slow.", missing) from e


def try_fetch(key: str) -> str | None:
  """``key``'s value if published, else None, without waiting."""
  c = client()
  try:
    return c.key_value_try_get(key)
  except Exception as e:  # pylint: disable=broad-except
    if "NOT_FOUND" in str(e):
      return None
    raise


def dir_get(prefix: str) -> dict[str, str]:
  """Every key under ``prefix/`` (relative names) with its value, in one round trip."""
  c = client()
  prefix = prefix.rstrip("/") + "/"
  return {k[len(prefix):] if k.startswith(prefix) else k: v
          for k, v in c.key_value_dir_get(prefix)}


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
  return fetch(key, timeout_s, waiting_for="process 0", missing=[0])


def decide_per_step(prefix: str, step: int, decide) -> str:
  """Process 0's ``decide()`` for ``step``, on every process (a clock-based decision).

  Others do not call ``decide``. One key per step under ``prefix``, in buckets
  of 1024 steps; process 0 deletes the bucket two behind, so the key space
  stays bounded over a long run.
  """
  if client() is None:
    return decide()
  value = None
  if process_index() == 0:
    value = decide()
    if step % 1024 == 0 and step >= 2048:
      delete(f"{prefix}/{step // 1024 - 2}")
  return broadcast(f"{prefix}/{step // 1024}/{step}", value)


def arrive(key: str, value: str = "") -> None:
  """Reports this process at the rendezvous ``key`` (see :func:`gather`)."""
  c = client()
  if c is None:
    return
  c.key_value_set(f"{key}/v/{process_index()}", value, allow_overwrite=True)
  if c.key_value_increment(f"{key}/n", 1) == process_count():
    c.key_value_set(f"{key}/all", "1", allow_overwrite=True)


def gather(key: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, what: str = "report") -> list[str]:
  """Waits until every process :func:`arrive`-d at ``key``; their values in process order.

  Four round trips whatever the number of processes. On timeout the error
  names the processes that have not arrived.
  """
  c = client()
  if c is None:
    raise RuntimeError("gather() needs a multi-process job")
  try:
    fetch(f"{key}/all", timeout_s)
  except CoordinationTimeoutError as e:
    missing = absent(key)
    raise CoordinationTimeoutError(
        f"process {process_index()} waited {timeout_s:g} s for every process to {what};"
        f" process(es) {missing} did not (slow, hung or dead). Raise"
        " coordination_timeout_seconds if they are only slow.", missing) from e
  values = dir_get(f"{key}/v")
  return [values[str(p)] for p in range(process_count())]


def absent(key: str) -> list[int]:
  """The processes that have not arrived at ``key`` yet."""
  present = dir_get(f"{key}/v")
  return [p for p in range(process_count()) if str(p) not in present]


def all_gather(key: str, value: str, timeout_s: float = DEFAULT_TIMEOUT_S,
               *, what: str = "report") -> list[str]:
  """Every process publishes ``value``; returns all values in process order."""
  if client() is None:
    return [value]
  arrive(key, value)
  return gather(key, timeout_s, what=what)
