"""When the local tier saves: every N steps, and/or at the Young/Daly interval of its own cost.

The decision is a pure function of a :class:`~orbax_flax.policy.SaveState`
(the triggers of :mod:`orbax_flax.policy`); :class:`LocalSchedule` is the thin
shell that keeps the last save's time, the recent local save costs, and, in a
multi-process job, shares process 0's decision so every process saves the same
step (a local save is collective).

Example:
  >>> from orbax_flax import policy
  >>> clock = iter([0.0, 10.0, 50.0, 60.0]).__next__
  >>> s = LocalSchedule(policy.any_of(policy.YoungDaly(400.0)), clock=clock)
  >>> s.interval_s()           # sqrt(2 x 1 s assumed x 400 s)
  28.28...
  >>> s.due(1), s.due(2)       # 10 s, then 50 s since the start
  (False, True)
  >>> s.record(2, 0.5)         # the local save took 0.5 s: sqrt(2 x 0.5 x 400) = 20 s
  >>> s.interval_s(), s.expected_loss_s()
  (20.0, 10.0)
"""

from __future__ import annotations

import time
from collections.abc import Callable

from orbax_flax import _multihost
from orbax_flax import policy as policy_lib


class LocalSchedule:
  """Which steps the local tier saves; the same answer on every process.

  Args:
    trigger: the local tier's trigger (``CheckpointPolicy.local_trigger()``):
      step-based triggers decide on every process alike; a
      :class:`~orbax_flax.policy.YoungDaly` one (``local_save_interval="auto"``)
      is given the median of the last 5 local save times and decided by
      process 0's clock.
    clock: wall-time source (tests pass a fake).
    directory: the run's directory, which process 0's shared decisions are
      keyed by (the callback passes its manager's).
  """

  def __init__(self, trigger: policy_lib.AnyOf, *, clock: Callable[[], float] = time.time,
               directory: str = ""):
    steps = tuple(t for t in trigger.triggers if not isinstance(t, policy_lib.YoungDaly))
    self._steps = policy_lib.any_of(*steps) if steps else None
    self._auto = next((t for t in trigger.triggers if isinstance(t, policy_lib.YoungDaly)), None)
    self._clock = clock
    self._costs = policy_lib.CostWindow()
    self._last_step: int | None = None
    self._last_time = clock()
    self._key = _multihost.namespace("local_schedule", directory) if self._auto is not None else None

  def cost_s(self) -> float | None:
    """The median of the last few local save times (None before the first)."""
    return self._costs.median()

  def interval_s(self) -> float | None:
    """The auto interval now, in seconds (None without ``mtbf_seconds``)."""
    return None if self._auto is None else self._auto.interval(self.cost_s())

  def expected_loss_s(self) -> float | None:
    """Work a failure loses on average with local saves at the auto interval (half of it)."""
    interval = self.interval_s()
    return None if interval is None else interval / 2

  def due(self, step: int) -> bool:
    """Whether ``step`` is saved to the local tier. Call it on every process, every step."""
    if self._steps is not None and self._steps(self._state(step)):
      return True
    if self._auto is None:
      return False
    return bool(_multihost.decide_per_step(self._key, step,
                                           lambda: "1" if self._auto(self._state(step)) else ""))

  def record(self, step: int, seconds: float) -> None:
    """A local save of ``step`` committed after ``seconds`` (the whole save blocks)."""
    self._costs.add(seconds)
    self._last_step, self._last_time = step, self._clock()

  def _state(self, step: int) -> policy_lib.SaveState:
    return policy_lib.SaveState(step, self._clock(), self._last_step, self._last_time,
                                first=False, save_cost=self.cost_s())
