"""When the local tier saves: every N steps, and/or at the Young/Daly interval of its own cost.

The decision is a pure function of a :class:`~orbax_flax.policy.SaveState`
(the triggers of :mod:`orbax_flax.policy`); :class:`LocalSchedule` is the thin
shell that keeps the last save's time, the recent local save costs, and, in a
multi-process job, shares process 0's decision so every process saves the same
step (a local save is collective).

Example:
  >>> clock = iter([0.0, 10.0, 50.0, 60.0]).__next__
  >>> s = LocalSchedule(every_steps=0, mtbf_seconds=400.0, clock=clock)
  >>> s.interval_s()           # sqrt(2 x 1 s assumed x 400 s)
  28.28...
  >>> s.due(1), s.due(2)       # 10 s, then 50 s since the start
  (False, True)
  >>> s.record(2, 0.5)         # the local save took 0.5 s: sqrt(2 x 0.5 x 400) = 20 s
  >>> s.interval_s(), s.expected_loss_s()
  (20.0, 10.0)
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable

from orbax_flax import _multihost
from orbax_flax import policy as policy_lib


class LocalSchedule:
  """Which steps the local tier saves; the same answer on every process.

  Args:
    every_steps: save every N steps (0: off).
    mtbf_seconds: with a value, also save once the Young/Daly interval of the
      median of the last 5 local save times has passed (``local_save_interval
      ="auto"``); None: off.
    clock: wall-time source (tests pass a fake).
  """

  def __init__(self, *, every_steps: int = 0, mtbf_seconds: float | None = None,
               clock: Callable[[], float] = time.time):
    self._steps = policy_lib.EveryNSteps(every_steps) if every_steps else None
    self._auto = policy_lib.YoungDaly(mtbf_seconds) if mtbf_seconds else None
    self._clock = clock
    self._costs: collections.deque[float] = collections.deque(maxlen=5)
    self._last_step: int | None = None
    self._last_time = clock()
    self._key = _multihost.namespace("local_schedule") if self._auto is not None else None

  def cost_s(self) -> float | None:
    """The median of the last few local save times (None before the first)."""
    return statistics.median(self._costs) if self._costs else None

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
    if _multihost.process_count() == 1:
      return self._auto(self._state(step)) is not None
    key = f"{self._key}/{step // 1024}/{step}"
    decision = None
    if _multihost.process_index() == 0:
      decision = "1" if self._auto(self._state(step)) else ""
      if step % 1024 == 0 and step >= 2048:
        _multihost.delete(f"{self._key}/{step // 1024 - 2}")
    return bool(_multihost.broadcast(key, decision))

  def record(self, step: int, seconds: float) -> None:
    """A local save of ``step`` committed after ``seconds`` (the whole save blocks)."""
    self._costs.append(seconds)
    self._last_step, self._last_time = step, self._clock()

  def _state(self, step: int) -> policy_lib.SaveState:
    return policy_lib.SaveState(step, self._clock(), self._last_step, self._last_time,
                                first=False, save_cost=self.cost_s())
