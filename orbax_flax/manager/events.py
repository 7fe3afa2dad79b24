"""What a manager's save records and reports: its step metadata and its :class:`SaveEvent`.

With every step the manager records why and when it was saved, its scalar
metrics, the mesh and the user's metadata (:func:`step_metadata`, read back as
a :class:`~orbax_flax.manager.policy.StepInfo` by the keep rules). When the save
commits, :class:`EventLog` logs its timings and keeps a :class:`SaveEvent` for
metric writers (``CheckpointManager.pop_events()``).

Example:
  >>> blocking_before({"items": 0.25, "data": 0.5})
  {'items': 0.25, 'data': 0.5, 'total': 0.75}
  >>> step_metadata(7, "interval", 12.0, {"loss": 0.5}, {}, None, "")["metrics"]
  {'loss': 0.5}
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Mapping
from typing import Any

import jax

from orbax_flax.core import _progress
from orbax_flax.engine import describe
from orbax_flax.manager.schedule import Schedule

log = logging.getLogger("orbax_flax")

BEFORE_KEYS = ("total", "items", "data")


@dataclasses.dataclass(frozen=True)
class SaveEvent:
  """A committed save, for logs and metric writers.

  ``blocking_s`` is the whole time the caller's thread waited for the save
  (with the training callback: inside ``on_step_end``, from its start); the
  ``blocking_*_s`` fields are its main parts.
  """
  step: int
  reason: str
  blocking_s: float
  total_s: float                        # from the start of blocking_s to the commit
  nbytes: int
  expected_loss_s: float | None = None  # work lost by a failure now, on average (interval / 2)
  blocking_items_s: float = 0.0  # building the items from the state (the caller's, e.g. the callback's)
  blocking_data_s: float = 0.0   # the data iterator's get_state() and the gather of positions
  blocking_wait_s: float = 0.0   # before the save began: the previous save still committing
  blocking_ready_s: float = 0.0  # the train step still computing what is saved (its metrics too)
  blocking_copy_s: float = 0.0   # the engine's blocking phase: plan and snapshot (a blocking save: all)
  bytes_written: int = 0  # array bytes the step holds itself, all processes (differential: the changed)
  bytes_reused: int = 0   # array bytes it references in earlier steps instead (differential saves)

  def scalars(self) -> dict[str, float]:
    """The event as a metric writer's scalars: ``checkpoint/<field>``, ``nbytes`` as
    ``checkpoint/bytes`` (``expected_loss_s`` when known).

    >>> SaveEvent(7, "interval", 0.25, 1.0, 4096).scalars()["checkpoint/bytes"]
    4096.0
    """
    return {"checkpoint/" + ("bytes" if f.name == "nbytes" else f.name): float(v)
            for f in dataclasses.fields(self) if f.name not in ("step", "reason")
            for v in [getattr(self, f.name)] if v is not None}


KEPT_EVENTS = 32  # events kept until taken (pop_events); older ones are dropped


class EventLog:
  """The saves committed since they were last taken, each logged when it commits.

  At most :data:`KEPT_EVENTS` are kept for a caller that never takes them
  (:meth:`pop`): the oldest go first, so a run that saves every step for a
  million steps holds a bounded record.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._events: collections.deque[SaveEvent] = collections.deque(maxlen=KEPT_EVENTS)

  def committed(self, blocked: SaveEvent, total_s: float, nbytes: int, where: str,
                schedule: Schedule, stored: Mapping[str, int] | None = None) -> None:
    """A save committed: ``blocked`` holds its blocking times, ``schedule`` learns its cost,
    ``stored`` its ``bytes_written`` and ``bytes_reused`` (differential saves)."""
    log.log(_progress.once_per_job_level(),  # process 0's line; the others' at DEBUG
            "checkpoint step %d (%s) committed to %s: blocking %.3f s (items %.3f, data"
            " iterator %.3f, previous save %.3f, train step still computing %.3f, snapshot"
            " %.3f), total %.3f s, %s written by this process", blocked.step, blocked.reason,
            where, blocked.blocking_s, blocked.blocking_items_s, blocked.blocking_data_s,
            blocked.blocking_wait_s, blocked.blocking_ready_s, blocked.blocking_copy_s, total_s,
            describe.human_bytes(nbytes))
    # The cost of a save: what it blocked the loop beyond the train step's own computation.
    interval = schedule.committed(blocked.blocking_s - blocked.blocking_ready_s)
    loss = None if interval is None else interval / 2
    if schedule.auto is not None:
      log.log(_progress.once_per_job_level(), "save_interval=auto: saves cost %.3f s (median of"
              " the last %d), mtbf %.0f s: saving every %.1f s; a failure loses %.1f s of work on"
              " average", schedule.cost(), schedule.cost_count(), schedule.auto.mtbf_seconds,
              interval, loss)
    with self._lock:
      self._events.append(dataclasses.replace(blocked, total_s=total_s, nbytes=nbytes,
                                              expected_loss_s=loss, **(stored or {})))

  def pop(self) -> list[SaveEvent]:
    """The events since the last call."""
    if not self._events:  # the per-step path: no lock
      return []
    with self._lock:
      events = list(self._events)
      self._events.clear()
    return events


def blocked(step: int, reason: str, before: Mapping[str, float], entered: float, wait_s: float,
            ready_s: float, copy_s: float) -> SaveEvent:
  """The blocking times of a save that returned now (``entered``: perf_counter at the call;
  ``before``: :func:`blocking_before`'s; ``wait_s``: for the previous save; ``ready_s``: for
  :func:`wait_ready`; ``copy_s``: the engine's blocking phase)."""
  return SaveEvent(step, reason, before["total"] + time.perf_counter() - entered, 0.0, 0,
                   blocking_items_s=before["items"], blocking_data_s=before["data"],
                   blocking_wait_s=wait_s, blocking_ready_s=ready_s, blocking_copy_s=copy_s)


def wait_ready(items: Mapping[str, Any], metrics: Any) -> float:
  """Waits until the arrays of ``items`` and ``metrics`` are computed; returns the seconds.

  JAX dispatches a train step asynchronously: the loop reaches a save while the
  step's results are still being computed, and any save (its snapshot, the
  metrics it records) waits for them first. That wait is the step's own
  computation, not the checkpoint's, so it is reported as a part of its own.
  """
  start = time.perf_counter()
  leaves = jax.tree.leaves((items, metrics or {}))
  # A deleted (donated) array is left to the save, whose error names it and the fix.
  jax.block_until_ready([x for x in leaves if not (isinstance(x, jax.Array) and x.is_deleted())])
  return time.perf_counter() - start


def blocking_before(before: Mapping[str, float] | None) -> dict[str, float]:
  """``save(blocking_before=...)`` checked, with every key ("total" at least the parts)."""
  out = {"items": 0.0, "data": 0.0}
  for k, v in dict(before or {}).items():
    if k not in BEFORE_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)) \
        or not math.isfinite(v) or v < 0:
      raise ValueError(f"blocking_before[{k!r}]={v!r}: keys must be {BEFORE_KEYS} and values"
                       " seconds >= 0, e.g. {'items': 0.01, 'data': 0.2}")
    out[k] = float(v)
  out["total"] = max(out.get("total", 0.0), out["items"] + out["data"])
  return out


def step_metadata(step: int, reason: str, now: float, metrics: Mapping[str, Any] | None,
                  items: Mapping[str, Any], user: Mapping[str, Any] | None,
                  timeline: str) -> dict[str, Any]:
  """What the manager records with ``step`` (the manifest's ``custom`` block)."""
  return {"step": step, "reason": reason, "time": now, "metrics": _scalars(metrics or {}),
          "mesh": _mesh_of(items), "user": dict(user or {}), "timeline": timeline}


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
  out = {}
  for k, v in metrics.items():
    try:
      f = float(v)
    except (TypeError, ValueError):
      raise TypeError(f"metric {k!r} must be a scalar number, got {type(v).__name__}") from None
    out[str(k)] = f if math.isfinite(f) else str(f)
  return out


def _mesh_of(items: Mapping[str, Any]) -> dict[str, int] | None:
  for leaf in jax.tree.leaves(items):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      return {str(k): int(v) for k, v in sharding.mesh.shape.items()}
  return None
