"""When a tier saves: the one trigger shell of the persistent tier and the local tier.

The decision is a pure trigger of :mod:`orbax_flax.manager.policy` applied to a
:class:`~orbax_flax.manager.policy.SaveState`; :class:`Schedule` is the thin stateful
shell around it: the clock, the last save, the recent save costs (for the
Young/Daly interval of ``save_interval="auto"``), and, in a multi-process job,
process 0's decision for what depends on the clock, shared through the
coordination service so that every process saves the same step.

It is handed its triggers already apart (``CheckpointPolicy.schedule_triggers``
names which are which): ``steps`` depend on the step alone and are decided on
every process alike (no round trip); ``time`` and ``auto`` read the clock and
are decided by process 0. A trigger composed by hand is given whole to
:meth:`Schedule.of`, which decides it on process 0 if it reads the clock
(``reads_clock``; a trigger that does not say is taken as reading it).

Example:
  >>> from orbax_flax.manager import policy
  >>> clock = iter([0.0, 10.0, 50.0, 60.0]).__next__
  >>> s = Schedule(auto=policy.YoungDaly(400.0), key="doc/schedule", clock=clock)
  >>> s.interval()             # sqrt(2 x 1 s assumed x 400 s)
  28.28...
  >>> s.due(1), s.due(2)       # 10 s, then 50 s since the start
  (None, 'auto')
  >>> s.record(2, 0.5)         # the save took 0.5 s: sqrt(2 x 0.5 x 400) = 20 s
  >>> s.interval(), s.cost()
  (20.0, 0.5)
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading
import time
from collections.abc import Callable

from orbax_flax.core import _multihost
from orbax_flax.core import _progress
from orbax_flax.manager import policy as policy_lib

log = logging.getLogger("orbax_flax")

class Schedule:
  """Which steps a tier saves, and why; the same answer on every process.

  Args:
    steps: triggers of the step alone (every N steps, explicit steps, the
      first step), decided on every process alike; None: none.
    time: triggers of the clock (every N seconds), decided by process 0.
    auto: the Young/Daly trigger (``save_interval="auto"``), decided by
      process 0 and given the median of the last 5 save costs; its interval
      is what :meth:`interval` reports.
    key: a coordination-service prefix for the decisions, the same on every
      process and unique to this schedule.
    clock: wall-time source (tests pass a fake).
    if_busy: a save due while the previous one still writes: "wait" for it,
      or "skip" it (see :meth:`skips`).
    timeout_s: how long a process waits for process 0's decision and for the
      coordination service (the policy's ``coordination_timeout_seconds``).
    shared: decide the clock's triggers on process 0 and share the decision (False:
      on this process alone, as a dry run does, :meth:`CheckpointPolicy.plan`).
    save_cost: the save cost assumed until one is measured (None: the triggers' own).
  """

  def __init__(self, steps: policy_lib.Trigger | None = None,
               time: policy_lib.Trigger | None = None,  # pylint: disable=redefined-outer-name
               auto: policy_lib.YoungDaly | None = None, *, key: str,
               clock: Callable[[], float] = time.time, if_busy: str = "wait",
               timeout_s: float = _multihost.DEFAULT_TIMEOUT_S, shared: bool = True,
               save_cost: float | None = None):
    self._steps = steps
    self._shared = shared
    self._timeout_s = timeout_s
    self._if_busy = if_busy
    self._time = time
    self._auto = auto
    self._key = key
    self._clock = clock
    # The caller's thread asks (due, saved) while a save's completion, on the save's thread,
    # adds its cost (committed): every field below is read and changed under _lock, which
    # is never held across a call to the coordination service.
    self._lock = threading.Lock()
    self._costs = CostWindow()
    if save_cost is not None:
      self._costs.add(save_cost)
    self._last_step: int | None = None
    self._last_time = clock()
    self._last_commit: float | None = None
    self._first = True
    # The steps asked so far go up, except after a rollback: then a step number comes again,
    # and its decisions (keys in the coordination service, complete once) need new keys. Every
    # process asks for the same steps, so each counts the same rounds.
    self._round, self._asked = 0, None
    # The step of the round's last time decision (a step trigger's steps make none): the
    # buckets of its keys that the next decision leaves behind are deleted.
    self._timed_asked: int | None = None
    # (step, reason) of the last question, until a save or restore (saved()) or another step:
    # asking again about that step gives the same answer (should_save(step), then save(step)).
    self._answer: tuple[int, str | None] | None = None

  @classmethod
  def of(cls, trigger: policy_lib.Trigger, *, key: str, clock: Callable[[], float] = time.time,
         if_busy: str = "wait", timeout_s: float = _multihost.DEFAULT_TIMEOUT_S) -> Schedule:
    """A schedule of one trigger composed by hand (e.g. ``any_of(EveryNSteps(100), ...)``).

    Decided on every process alike if it does not read the clock, else by
    process 0.
    """
    if getattr(trigger, "reads_clock", True):
      return cls(time=trigger, key=key, clock=clock, if_busy=if_busy, timeout_s=timeout_s)
    return cls(trigger, key=key, clock=clock, if_busy=if_busy, timeout_s=timeout_s)

  def now(self) -> float:
    """The schedule's clock."""
    return self._clock()

  def cost(self) -> float | None:
    """The median of the last few save costs, seconds (None before the first)."""
    with self._lock:
      return self._costs.median()

  def interval(self) -> float | None:
    """The auto interval now, in seconds (None without an ``auto`` trigger)."""
    return None if self._auto is None else self._auto.interval(self.cost())

  def due(self, step: int) -> str | None:
    """The reason ``step`` is saved, or None. Call it on every process, every step.

    Asking again about the step asked last gives the same answer (the first step stays the
    first, the clock is not read again) until a save or restore of it (:meth:`saved`).
    """
    now = self._clock()
    with self._lock:
      if self._answer is not None and self._answer[0] == step:
        return self._answer[1]
      self._answer = None
      first, self._first = self._first, False
      if self._asked is not None and step <= self._asked:  # again after a save or a rollback
        self._round += 1
        self._timed_asked = None
      self._asked = step
      if now < self._last_time:
        # The wall clock went back (an NTP step, a VM's clock fixed): measured from the last
        # save's reading, the next time-based save would wait the jump as well. The interval
        # restarts here instead (a clock gone forward saves once, at once).
        log.warning("the clock went back %.0f s since the last save; the save interval"
                    " restarts now", self._last_time - now)
        self._last_time = now
      previous = self._timed_asked  # the step of this round's last time decision (its keys)
      state = policy_lib.SaveState(step, now, self._last_step, self._last_time, first,
                                   self._costs.median())
      key = f"{self._key}/{self._round}"
    reason = self._steps(state) if self._steps is not None else None
    if reason is None and (self._time is not None or self._auto is not None):
      if not self._shared:
        reason = self._timed(state)
      else:
        with self._lock:
          self._timed_asked = step
        reason = _multihost.decide_per_step(f"{key}/time", step,
                                            lambda: self._timed(state) or "",
                                            timeout_s=self._timeout_s, previous=previous) or None
    with self._lock:
      if self._asked == step:
        self._answer = (step, reason)
    return reason

  def _timed(self, state: policy_lib.SaveState) -> str | None:
    reason = self._time(state) if self._time is not None else None
    if reason is None and self._auto is not None:
      reason = self._auto(state)
    return reason

  def skips(self, step: int, reason: str, busy: bool) -> bool:
    """Whether a save of ``step`` due for ``reason`` is skipped because the previous one is
    still writing (``busy`` here; with ``if_busy="skip"``, on any process)."""
    if self._if_busy != "skip" or reason in policy_lib.FORCED:
      return False
    if _multihost.process_count() > 1:  # every process must skip the same steps
      with self._lock:
        key = f"{self._key}/{self._round}/busy/{step}"
      busy = "1" in _multihost.all_gather(key, "1" if busy else "0", self._timeout_s)
    if busy:
      log.info("skipping the %s save of step %d: the previous save is still being written",
               reason, step)
    return busy

  def saved(self, step: int, now: float | None = None) -> None:
    """A save (or a restore) of ``step`` at ``now`` (default: the clock now): intervals restart."""
    now = self._clock() if now is None else now
    with self._lock:
      self._last_step, self._last_time = step, now
      self._answer = None  # what is due is asked afresh

  def record(self, step: int, seconds: float) -> None:
    """A save of ``step`` committed after ``seconds``, the whole save blocking (the local tier)."""
    with self._lock:
      self._costs.add(seconds)
    self.saved(step)

  def committed(self, blocking_s: float) -> float | None:
    """A save committed that blocked for ``blocking_s``; returns the interval between saves.

    The auto interval with this cost counted (logged, with the work a failure
    loses on average), or else the time since the previous commit (None for the
    first one).
    """
    now = self._clock()
    with self._lock:
      self._costs.add(blocking_s)
      cost, count, last = self._costs.median(), len(self._costs), self._last_commit
      self._last_commit = now
    if self._auto is None:
      return None if last is None else now - last
    interval = self._auto.interval(cost)
    log.log(_progress.once_per_job_level(), "save_interval=auto: saves cost %.3f s (median of"
            " the last %d), mtbf %.0f s: saving every %.1f s; a failure loses %.1f s of work on"
            " average", cost, count, self._auto.mtbf_seconds, interval, interval / 2)
    return interval


class CostWindow:
  """The median of the last few save costs: what a :class:`YoungDaly` trigger is given.

  Example:
    >>> w = CostWindow()
    >>> w.median() is None
    True
    >>> for c in (1.0, 3.0, 2.0):
    ...   w.add(c)
    >>> w.median(), len(w)
    (2.0, 3)
  """

  def __init__(self, size: int = 5):
    self._costs: collections.deque[float] = collections.deque(maxlen=size)

  def add(self, seconds: float) -> None:
    self._costs.append(seconds)

  def median(self) -> float | None:
    return statistics.median(self._costs) if self._costs else None

  def __len__(self) -> int:
    return len(self._costs)
