"""Agreement between the processes of a job through JAX's coordination service.

A single-process job needs none of this: every function short-circuits. In a
job started with ``jax.distributed.initialize`` the key-value store of the
coordination service carries small messages (sub-millisecond on loopback,
no compilation), so the background thread of an async save can use it.

Every call into the service has a deadline, ``timeout_s``, which every caller
passes (the policy's ``coordination_timeout_seconds``): there is no default
here. The service is hosted by process 0, so a call that gets no answer in time
raises :class:`CoordinationTimeoutError` naming process 0 (stopped, hung or
overloaded); a wait for other processes that times out names the processes
that did not arrive. The client's own calls have no deadline (only its
blocking get has one), so each of the others runs on a short-lived helper
thread that the caller stops waiting for: a call that timed out may still
reach the service once it answers again (callers that decide something from a
call account for that, see :mod:`orbax_flax.engine.saving`).

The number of round trips of each helper is constant: it does not grow with
the number of processes (the cost of a 1,000-host job is the cost of a 2-host
job plus the service's own fan-in).

Names in the key space: the coordination service is one per job, so every
prefix handed out in it (:func:`namespace`) derives from the directory its
object works on, plus a count of the prefixes of that kind already handed
out for that directory, kept in the service itself. Only the objects and
saves on one directory must come in the same order on every process (as any
collective does); nothing depends on what else a process created first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax

from orbax_flax import errors

log = logging.getLogger("orbax_flax")

# The default of the public constructors that take a coordination_timeout_seconds (the
# policy's default too). The functions here take no default: every caller passes its own.
DEFAULT_TIMEOUT_S = 600.0


class CoordinationTimeoutError(TimeoutError):
  """A process waited longer than the coordination timeout for others.

  Attributes:
    missing: the processes that had not arrived (or not answered), when known.
  """

  def __init__(self, message: str, missing: Sequence[int] = ()):
    super().__init__(message)
    self.missing = list(missing)


def _within(timeout_s: float, what: str, call, *args):
  """``call(*args)`` (a call into the coordination service), or an error after ``timeout_s``.

  The call runs on a daemon thread (the client releases the GIL while it
  waits); if it has not answered in time, the caller stops waiting and raises
  :class:`CoordinationTimeoutError` naming process 0, which hosts the service.
  """
  answer: list = []
  asked = threading.Thread(target=_call_into, args=(answer, call, *args),
                           name="orbax_flax-coordination", daemon=True)
  asked.start()
  asked.join(timeout_s)
  if not answer:
    raise CoordinationTimeoutError(
        f"process {process_index()} waited {timeout_s:g} s for the coordination service, hosted"
        f" by process 0, to {what}; process 0 did not answer (stopped, hung or overloaded)."
        " Raise coordination_timeout_seconds if it is only slow.", [0])
  if isinstance(answer[0], BaseException):
    raise answer[0]
  return answer[0]


def _call_into(answer: list, call, *args) -> None:
  """Appends ``call(*args)``, or the exception it raised, to ``answer``."""
  try:
    answer.append(call(*args))
  except BaseException as e:  # pylint: disable=broad-except  # re-raised by the caller
    answer.append(e)


def namespace(kind: str, where: str, timeout_s: float) -> str:
  """A key prefix for the next object (or save) of ``kind`` on ``where``, the same on every process.

  ``orbax_flax/<kind>/<digest of where>/<n>``: the ``n``-th prefix of this
  kind for this directory that this process asked for, counted by a key of
  the coordination service (one counter per process and directory, so the
  count survives no object and needs no module state). Every process that
  makes the same objects on ``where`` in the same order gets the same
  prefix. A single-process job shares nothing: its prefix has no count.

  The count waits at most ``timeout_s`` for the service's answer.

  Raises:
    CoordinationTimeoutError: the service (process 0) did not answer in time.

  Example:
    >>> namespace("doc-example", "/tmp/run", timeout_s=5)  # one process
    'orbax_flax/doc-example/52865a8aedce'
  """
  base = f"orbax_flax/{kind}/{hashlib.sha1(str(where).encode()).hexdigest()[:12]}"
  c = client()
  if c is None:
    return base
  counter = f"{base}/count/{process_index()}"
  n = _within(timeout_s, f"count {counter!r}", c.key_value_increment, counter, 1)
  return f"{base}/{n}"


def leave(key: str, *, timeout_s: float) -> None:
  """Reports that this process is done with every key under ``key``; the last one deletes them.

  For keys unique to one operation (a save): once every process has left,
  nobody reads them any more. Two calls, each within ``timeout_s``.
  """
  c = client()
  if c is not None and _within(timeout_s, f"count who left {key!r}", c.key_value_increment,
                               f"{key}/left", 1) == process_count():
    _within(timeout_s, f"delete {key!r}", c.key_value_delete, key)


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
  return distributed_state().client


# ------------------------------------------------ the private JAX APIs orbax_flax uses
# Every use of a JAX API that is not public is in this section, and
# tests/test_structure.py checks that none is used anywhere else;
# tests/test_structure.py::test_the_private_jax_apis_we_use_still_exist names each one, so
# that a JAX release that changes them fails there, by name.


def distributed_state() -> Any:
  """``jax._src.distributed.global_state``: JAX's coordination client (``.client``) and its
  preemption sync manager (``.preemption_sync_manager``), which JAX makes public nowhere."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state


def addressable_device_assignment(sharding: jax.sharding.Sharding) -> Sequence[Any]:
  """This process's devices of ``sharding``, in the order of its device assignment: the order
  of an array's ``addressable_shards`` (``sharding.addressable_devices`` is a set)."""
  return sharding._addressable_device_assignment  # pylint: disable=protected-access


def weak_typed(x: jax.Array) -> jax.Array:
  """``x`` as a weakly typed array (what ``jnp.asarray(0)`` or ``TrainState.create``'s step
  is): the same buffers, sharding and committed-ness, nothing copied or compiled.
  ``jax._src.array.ArrayImpl`` over ``jax._src.core.ShapedArray(..., weak_type=True)``, which
  JAX makes public nowhere. A restore gives a weakly typed target its weak type back, so that
  a jitted step does not compile again for it."""
  from jax._src import array as array_internal  # pylint: disable=g-import-not-at-top
  from jax._src import core as core_internal  # pylint: disable=g-import-not-at-top
  aval = core_internal.update_aval_with_sharding(
      core_internal.ShapedArray(x.shape, x.dtype, weak_type=True), x.sharding)
  return array_internal.ArrayImpl(aval, x.sharding, [s.data for s in x.addressable_shards],
                                  committed=x.committed)


def reset_compilation_cache() -> None:
  """Makes JAX open its persistent compilation cache again, at ``jax_compilation_cache_dir`` as
  it is then, at its next compile. JAX opens the cache once, at a process's first compile, and
  keeps it whatever the setting says afterwards. ``reset_cache`` of
  ``jax.experimental.compilation_cache.compilation_cache`` (``jax._src.compilation_cache``):
  experimental, outside JAX's compatibility promise."""
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=g-import-not-at-top
  compilation_cache.reset_cache()


def publish(key: str, value: str, *, timeout_s: float) -> None:
  """Sets ``key`` for every process to read (waits at most ``timeout_s`` for the service)."""
  c = client()
  if c is not None:
    _within(timeout_s, f"set {key!r}", c.key_value_set, key, value, True)


def claim(key: str, value: str, *, timeout_s: float) -> str:
  """Sets ``key`` to ``value`` unless it is set already; returns the value that won.

  The coordination service decides who was first, so every process that
  claims (or later reads) ``key`` sees the same value. Two calls at most,
  each within ``timeout_s``.
  """
  c = client()
  if c is None:
    return value
  try:
    _within(timeout_s, f"set {key!r}", c.key_value_set, key, value, False)
    return value
  except CoordinationTimeoutError:
    raise
  except Exception as e:  # The client raises XlaRuntimeError subclasses.  pylint: disable=broad-except
    if "ALREADY_EXISTS" not in str(e):
      raise
    return _within(timeout_s, f"read {key!r}", c.key_value_try_get, key)


def post_claim(key: str, value: str) -> None:
  """Sends a :func:`claim` of ``key`` without waiting for the answer.

  For a process that gives up because the service does not answer: the claim
  reaches the service when it answers again, so the others find this
  process's verdict there unless a decision was taken first (then the claim
  fails, unseen). The call's thread ends with the call.
  """
  c = client()
  if c is not None:
    threading.Thread(target=_call_into, args=([], c.key_value_set, key, value, False),
                     name="orbax_flax-coordination", daemon=True).start()


def fetch(key: str, timeout_s: float, *, waiting_for: str = "the other processes",
          missing: Sequence[int] = ()) -> str:
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
    who = f": process(es) {list(missing)} did not answer" if missing else ""
    raise CoordinationTimeoutError(
        f"process {process_index()} waited {timeout_s:g} s for {waiting_for} ({key!r}){who};"
        " raise coordination_timeout_seconds if they are only slow.", missing) from e


def try_fetch(key: str, *, timeout_s: float) -> str | None:
  """``key``'s value if published, else None, without waiting for anyone but the service."""
  c = client()
  try:
    return _within(timeout_s, f"read {key!r}", c.key_value_try_get, key)
  except CoordinationTimeoutError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    if "NOT_FOUND" in str(e):
      return None
    raise


def dir_get(prefix: str, *, timeout_s: float) -> dict[str, str]:
  """Every key under ``prefix/`` (relative names) with its value, in one round trip."""
  c = client()
  prefix = prefix.rstrip("/") + "/"
  return {k[len(prefix):] if k.startswith(prefix) else k: v
          for k, v in _within(timeout_s, f"list {prefix!r}", c.key_value_dir_get, prefix)}


def delete(prefix: str, *, timeout_s: float) -> None:
  """Deletes a key (and the keys under it, as a directory). Missing is fine."""
  c = client()
  if c is not None:
    _within(timeout_s, f"delete {prefix!r}", c.key_value_delete, prefix)


def broadcast(key: str, value: str | None, timeout_s: float) -> str:
  """Process 0's ``value`` on every process (others pass anything)."""
  if client() is None:
    return value
  if process_index() == 0:
    publish(key, value, timeout_s=timeout_s)
    return value
  return fetch(key, timeout_s, waiting_for="process 0", missing=[0])


def decide_per_step(prefix: str, step: int, decide, *, timeout_s: float,
                    previous: int | None = None) -> str:
  """Process 0's ``decide()`` for ``step``, on every process (a clock-based decision).

  Others do not call ``decide``. One key per step under ``prefix``, in buckets
  of 1024 steps; process 0 deletes the buckets two behind the one it enters, so the key
  space stays bounded over a long run. ``previous``: the step decided last under
  ``prefix`` (None: the steps come one by one, 0, 1, 2, ...); a caller that asks about
  every third step passes it, or the buckets it skips the first step of would stay.
  """
  if client() is None:
    return decide()
  value = None
  if process_index() == 0:
    value = decide()
    bucket = step // 1024
    if previous is None:
      behind = [bucket - 2] if step % 1024 == 0 else []
    else:
      behind = range(previous // 1024 - 1, bucket - 1) if bucket > previous // 1024 else []
    for old in behind:
      if old >= 0:
        delete(f"{prefix}/{old}", timeout_s=timeout_s)
  return broadcast(f"{prefix}/{step // 1024}/{step}", value, timeout_s)


def arrive(key: str, value: str = "", *, timeout_s: float) -> None:
  """Reports this process at the rendezvous ``key`` (see :func:`gather`); three calls at most,
  each within ``timeout_s``."""
  c = client()
  if c is None:
    return
  _within(timeout_s, f"record this process's report at {key!r}", c.key_value_set,
          f"{key}/v/{process_index()}", value, True)
  if _within(timeout_s, f"count the reports at {key!r}", c.key_value_increment,
             f"{key}/n", 1) == process_count():
    _within(timeout_s, f"mark {key!r} complete", c.key_value_set, f"{key}/all", "1", True)


def gather(key: str, timeout_s: float, *, what: str = "report") -> list[str]:
  """Waits until every process :func:`arrive`-d at ``key``; their values in process order.

  A fixed number of calls whatever the number of processes, each within
  ``timeout_s``. On timeout the error names the processes that have not
  arrived (or process 0, if the service itself does not answer).
  """
  c = client()
  if c is None:
    raise RuntimeError("gather() needs a multi-process job")
  try:
    fetch(f"{key}/all", timeout_s)
  except CoordinationTimeoutError as e:
    values = dir_get(f"{key}/v", timeout_s=timeout_s)
    missing = _absent_from(values)
    if not missing:
      # Every report is in, but a process died (or stalled) inside arrive(), after its
      # report and before counting itself in or marking the rendezvous complete. The
      # rendezvous happened: its report stands.
      log.warning("every process reported at %r, but one did not finish arriving (it died"
                  " or stalled inside arrive()); going on with the reports", key)
      return [values[str(p)] for p in range(process_count())]
    raise CoordinationTimeoutError(
        f"process {process_index()} waited {timeout_s:g} s for every process to {what};"
        f" process(es) {missing} did not (slow, hung or dead). Raise"
        " coordination_timeout_seconds if they are only slow.", missing) from e
  values = dir_get(f"{key}/v", timeout_s=timeout_s)
  return [values[str(p)] for p in range(process_count())]


def absent(key: str, *, timeout_s: float) -> list[int]:
  """The processes that have not arrived at ``key`` yet."""
  return _absent_from(dir_get(f"{key}/v", timeout_s=timeout_s))


def _absent_from(reports: dict[str, str]) -> list[int]:
  """The processes without a report among ``reports`` (by process index, as set by arrive)."""
  return [p for p in range(process_count()) if str(p) not in reports]


def barrier(key: str, timeout_s: float, *, what: str = "reach this point") -> None:
  """Waits until every process reached the barrier ``key``, within ``timeout_s`` of the first.

  The coordination service decides once whether the barrier passed, for every
  process: a process that arrives after it failed (another gave up waiting, or
  never came) fails at once or after ``timeout_s``, never passes it alone. So a
  barrier right before a collective that has no timeout of its own (a
  ``ppermute`` over gloo or NCCL) keeps a late process out of it when another
  gave up: a gather through the key-value store does not, since a late process
  finds every value already published. Each process also reports itself under
  ``key`` first, so that the error names who did not arrive.

  Raises:
    CoordinationTimeoutError: on every process, when not all arrived in time; it names
      the processes that never reported (none, if all arrived but not in time: one had
      given up before the last came).
  """
  c = client()
  if c is None:
    return
  _within(timeout_s, f"record this process at {key!r}", c.key_value_set,
          f"{key}/v/{process_index()}", "", True)
  try:  # the service enforces the deadline; _within only guards against a service that is gone
    _within(2 * timeout_s + 10, f"hold the barrier {key!r}", c.wait_at_barrier, key,
            max(1, int(timeout_s * 1000)))
  except CoordinationTimeoutError:
    raise
  except Exception as e:  # The client raises XlaRuntimeError subclasses.  pylint: disable=broad-except
    if "DEADLINE_EXCEEDED" not in str(e) and "deadline" not in str(e).lower():
      raise
    missing = absent(key, timeout_s=timeout_s)
    who = (f"process(es) {missing} did not arrive (slow, hung or dead)" if missing else
           "every process arrived, but not within the timeout of the first: one had given up")
    raise CoordinationTimeoutError(
        f"process {process_index()} waited at most {timeout_s:g} s for every process to {what};"
        f" {who}. Raise coordination_timeout_seconds if they are only slow.", missing) from e
  # Passed: its report names nobody any more (a barrier a save left two keys for good).
  _tidy(delete, f"{key}/v/{process_index()}", timeout_s=timeout_s)


def _tidy(clean, key: str, *, timeout_s: float) -> None:
  """``clean(key)``, the removal of keys nobody reads any more, after a rendezvous passed on
  every process: a failure is logged, never raised, so that no process turns back alone from
  what the others go on to (a collective without a timeout, after a barrier); the keys stay."""
  try:
    clean(key, timeout_s=timeout_s)
  except Exception as e:  # pylint: disable=broad-except  # the service's errors: XlaRuntimeError
    log.warning("could not remove the coordination service's keys under %r (%s: %s); they"
                " stay there", key, type(e).__name__, e)


def together(key: str, fn: Callable[[], Any], timeout_s: float, *, what: str) -> Any:
  """``fn()`` on every process of the job, failing on every process when it fails on one.

  Each process tells the others whether its ``fn`` raised (one gather under ``key``): the one
  that failed raises its own error, the others a :class:`~orbax_flax.errors.StorageError`
  naming that process and its error, at once. For work that reads storage and may fail on
  one process alone (a listing, a lease): a process that went on alone would wait for the
  others at its next collective until the timeout, or pair it with their next one. A single
  process just calls ``fn``.

  Args:
    key: the gather's key, unique to this call in the job.
    fn: the work; its result is returned.
    timeout_s: how long to wait for the other processes' word.
    what: what ``fn`` does, for the others' error ("opening the CheckpointManager of D").

  Example:
    >>> together("doc-example/together", lambda: 3, timeout_s=5, what="counting")
    3
  """
  if client() is None:
    return fn()
  result, failed = None, None
  try:
    result = fn()
  except Exception as e:  # pylint: disable=broad-except  # told to the others, then raised
    failed = e
  said = "" if failed is None else f"{type(failed).__name__}: {failed}"
  reports = all_gather(key, said, timeout_s, what=f"report whether {what} worked")
  others = [(p, r) for p, r in enumerate(reports) if r and p != process_index()]
  if failed is not None:
    raise failed
  if others:
    p, report = others[0]
    raise errors.StorageError(f"{what} failed on process {p} ({report}), so on every process of"
                              f" the job. Fix what process {p} reports, then try again.")
  return result


def all_gather(key: str, value: str, timeout_s: float,
               *, what: str = "report") -> list[str]:
  """Every process publishes ``value``; returns all values in process order.

  The keys under ``key`` go once every process has its values (:func:`leave`): a job that
  gathers at every save (data positions, local saves, ``if_busy``) left a few keys a save in
  the coordination service, for as long as the job ran. A process that gave up waiting never
  leaves: the values stay for one that comes late."""
  if client() is None:
    return [value]
  arrive(key, value, timeout_s=timeout_s)
  values = gather(key, timeout_s, what=what)
  _tidy(leave, key, timeout_s=timeout_s)
  return values
