"""The training loop's side of the local tier: which steps it saves, and one local save.

:class:`LocalSaves` pairs the tier (:class:`~orbax_flax.tiers.local.LocalTier`:
where the bytes go, who holds copies) with its schedule
(:class:`~orbax_flax.manager.schedule.Schedule`: when). A save that fails
is logged and handed back, not raised, so that the persistent save of the same
step still runs; the callback then treats it as it treats any failed save
(``on_save_error``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from orbax_flax.core import _progress
from orbax_flax import errors
from orbax_flax.manager import schedule
from orbax_flax.manager.config import CheckpointPolicy
from orbax_flax.tiers import local

log = logging.getLogger("orbax_flax")


class LocalSaves:
  """The local tier of a run and when it saves.

  Args:
    tier: where local saves go.
    when: which steps are saved (the same answer on every process).
    directory: the tier's directory, for the log.
  """

  def __init__(self, tier: local.LocalTier, when: schedule.Schedule, directory: str):
    self.tier, self._when, self._directory = tier, when, directory

  @classmethod
  def of(cls, policy: CheckpointPolicy, run: str, key: str,
         clock: Callable[[], float]) -> LocalSaves | None:
    """The local tier ``policy`` describes for the run whose steps are in ``run``, or None.

    ``key`` is the run's manager's coordination key (``manager.coordination_key``): the
    tier's schedule agrees under it; ``clock`` is the schedule's wall time.
    """
    if not policy.local_tier:
      return None
    tier = local.LocalTier(policy.local_directory, run=run, replicas=policy.replicas,
                           max_to_keep=policy.local_max_to_keep,
                           coordination_timeout_seconds=policy.coordination_timeout_seconds,
                           max_host_bytes=policy.max_host_bytes)
    when = schedule.Schedule(*policy.triggers(local=True), key=f"{key}/local", clock=clock,
                             timeout_s=policy.coordination_timeout_seconds)
    return cls(tier, when, policy.local_directory)

  def due(self, step: int) -> bool:
    """True if the local tier saves ``step``. Call it on every process at every step."""
    return self._when.due(step) is not None

  def save(self, step: int, items: Mapping[str, Any], *, timeline: str, base: int,
           writer: Any = None) -> tuple[str, errors.StorageError | None]:
    """Saves ``items`` as ``step`` (collective: every process calls it).

    This process's shards go to its own disk and its replicas'. The time it
    took feeds the schedule (``local_save_interval="auto"``), and a clu
    ``writer`` gets ``checkpoint/local_s`` (and, with an auto interval,
    ``checkpoint/local_expected_loss_s``).

    Returns:
      ``(save_id, None)``, where a persistent save of the same items passes ``save_id``
      as ``local_copy`` (see :meth:`~orbax_flax.tiers.local.LocalTier.save`), or
      ``("", error)`` if it failed.
    """
    start = time.perf_counter()
    try:
      save_id = self.tier.save(step, items, timeline=timeline, base=base)
    except (errors.StorageError, TimeoutError) as e:
      log.error("local checkpoint of step %d failed (%s): %s. The persistent tier's save of"
                " this step, if due, still runs; then on_save_error decides whether training"
                " goes on.", step, self._directory, e)
      return "", e if isinstance(e, errors.StorageError) else errors.StorageError(str(e))
    seconds = time.perf_counter() - start
    self._when.record(step, seconds)
    interval = self._when.interval()
    log.log(_progress.once_per_job_level(),  # process 0's line; the others' at DEBUG
            "local checkpoint step %d committed in %.3f s (%s, %d replica(s))%s", step, seconds,
            self._directory, self.tier.replicas,
            "" if interval is None else f"; local_save_interval=auto: next in {interval:.1f} s,"
            f" a failure loses {interval / 2:.1f} s of work on average")
    if writer is not None:
      scalars = {"checkpoint/local_s": seconds}
      if interval is not None:
        scalars["checkpoint/local_expected_loss_s"] = interval / 2
      writer.write_scalars(step, scalars)
    return save_id, None
