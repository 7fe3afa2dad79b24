"""The objects a checkpoint policy describes, built in one place.

A :class:`~orbax_flax.CheckpointPolicy` is data; :func:`build` turns it, with
the directory of the steps, into what a manager runs: the save :class:`Schedule`,
the keep rules and the engine's options. :class:`~orbax_flax.CheckpointManager`
calls it once and keeps the result (``manager.components``). Triggers and keep
rules composed by hand replace the policy's (``CheckpointManager(directory,
trigger=..., keep=...)``). What the policy describes above the manager is built
above it: the local tier by :meth:`orbax_flax.tiers.saves.LocalSaves.of`, the
preemption watcher by :class:`~orbax_flax.CheckpointCallback`.

Example:
  >>> from orbax_flax import CheckpointPolicy
  >>> parts = build(CheckpointPolicy(save_interval_steps=10, max_to_keep=2), "/tmp/ckpt")
  >>> parts.schedule.due(10), parts.schedule.due(11), parts.keep
  ('interval', None, [KeepLast(n=2)])
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from orbax_flax.core import _multihost
from orbax_flax.manager import policy as policy_lib
from orbax_flax.core._location import Location
from orbax_flax.differential import differ
from orbax_flax.manager.config import CheckpointPolicy
from orbax_flax.manager.schedule import Schedule


class Components(NamedTuple):
  """What a policy builds into (see :func:`build`).

  Attributes:
    key: the coordination-service prefix of the directory's manager, the same
      on every process.
    schedule: when the persistent tier saves.
    keep: the keep rules (empty: keep everything).
    checkpointer: the options of the manager's :class:`~orbax_flax.Checkpointer`.
  """
  key: str
  schedule: Schedule
  keep: list[policy_lib.KeepRule]
  checkpointer: Mapping[str, Any]


def build(policy: CheckpointPolicy, directory: Any, *, clock: Callable[[], float] = time.time,
          trigger: policy_lib.Trigger | None = None,
          keep: policy_lib.KeepRule | Sequence[policy_lib.KeepRule] | None = None) -> Components:
  """Builds what ``policy`` describes for the steps under ``directory``.

  Args:
    policy: the settings.
    directory: where the steps are (path, URL or kvstore spec).
    clock: wall-time source of the schedules (tests pass a fake).
    trigger: a save trigger composed by hand (e.g. ``any_of(EveryNSteps(100),
      EveryNSeconds(600))``), replacing the policy's save triggers.
    keep: keep rules (one, or a list), replacing the policy's.

  Raises:
    TypeError: ``trigger`` or ``keep`` is not a trigger or keep rules.
    ValueError: differential saves asked for on an object store.
  """
  loc = Location.parse(directory)
  if policy.differential:
    differ.check_location(loc)
  key = _multihost.namespace("manager", str(loc), policy.coordination_timeout_seconds)
  if trigger is None:
    schedule = Schedule(*policy.triggers(), key=key, clock=clock, if_busy=policy.if_busy,
                        timeout_s=policy.coordination_timeout_seconds)
  elif callable(trigger):
    schedule = Schedule.of(trigger, key=key, clock=clock, if_busy=policy.if_busy,
                           timeout_s=policy.coordination_timeout_seconds)
  else:
    raise TypeError(f"trigger={trigger!r}: must be a trigger, e.g. ofx.any_of(ofx.EveryNSteps(100),"
                    " ofx.EveryNSeconds(600))")
  rules = policy.keep_rules() if keep is None else _rules(keep)
  options = dict(max_host_bytes=policy.max_host_bytes,
                 keep_staging_memory=policy.keep_staging_memory,
                 host_transfer=policy.host_transfer,
                 coordination_timeout_seconds=policy.coordination_timeout_seconds,
                 coordination_key=f"{key}/save", watchdog_seconds=policy.watchdog_seconds,
                 differential=policy.differential)
  return Components(key, schedule, rules, options)


def _rules(keep: Any) -> list[policy_lib.KeepRule]:
  rules = [keep] if hasattr(keep, "keep") else list(keep) if isinstance(keep, Sequence) else None
  if rules is None or not all(callable(getattr(r, "keep", None)) for r in rules):
    raise TypeError(f"keep={keep!r}: must be keep rules, e.g. [ofx.KeepLast(3),"
                    " ofx.KeepEvery(1000)] (an empty list keeps everything)")
  return rules
