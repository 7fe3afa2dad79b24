"""Noticing preemption and agreeing, across processes, on the step to save.

Two mechanisms, chosen automatically:

* In a job started with ``jax.distributed.initialize`` JAX's own preemption
  sync manager catches SIGTERM in C++ and tells every process;
  ``reached_preemption_sync_point(n)`` then returns True on every process at
  the same call (a sub-microsecond call otherwise). JAX picks the call after the
  highest ``n`` any process had passed when the notice came, and matches it
  exactly, so ``n`` counts this watcher's calls (1, 2, ...; 0 when it is built),
  not the training step: a resumed run's steps start at the restored one, and a
  signal before its first step (during the restore, or the compile) made JAX pick
  1, a number such a run never reaches. JAX keeps one count per process: nothing
  else in the job may call ``reached_preemption_sync_point`` (orbax-checkpoint's
  ``CheckpointManager.should_save`` does, with steps), nor a second watcher
  (one ``CheckpointCallback`` per training loop). A Python SIGTERM handler
  would replace JAX's, so we never install one there. Other configured signals
  (e.g. SIGUSR1) get a Python handler that re-sends SIGTERM to this process,
  which JAX then handles. Only one process needs to receive the signal.
* Without ``jax.distributed`` (a plain single-process run) a Python handler
  sets a flag, and the next step is the one to save.

A handler the user had installed for the signal is chained: it runs after
ours, on the first signal (if it exits the process, no checkpoint is saved).
Python's default SIGINT handler is not chained: with ``"SIGINT"`` among the
signals, Ctrl-C saves and stops like a preemption instead of raising
KeyboardInterrupt (a second Ctrl-C still ends the process at once).
A second signal while the first is being handled restores the default action
and re-sends the signal: the process dies at once. That is safe: a checkpoint
is committed atomically, so a kill leaves no half-written step marked
committed.

:attr:`PreemptionWatcher.signal_time` is when the signal came, on every
process (a grace period counts from it, not from the step the processes agree
on, which may come many seconds later): the time of this process's own
handler, or else the time JAX's notifier recorded in the coordination service
when it caught SIGTERM on whichever process got it (it looks once a second, so
up to about a second after the signal). That time is read on the signalled
host's wall clock, so it is kept within what this process saw itself: no
earlier than its ``reached`` call two before the agreed one, no later than the
agreed one (a host's clock ahead or behind cannot spend or extend the grace
period by more than about two steps' time).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from datetime import datetime

from orbax_flax.core import _multihost

log = logging.getLogger("orbax_flax")

# The key under which JAX's preemption sync manager (XLA's preemption_sync_manager.cc) records
# the time its notifier caught SIGTERM, as RFC 3339 text, for every process to read.
_JAX_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"

# How far (seconds) JAX's notice may fall outside the range this process saw before that is
# logged as a disagreement between the hosts' clocks (it is bounded either way).
_CLOCK_TOLERANCE_S = 1.0


def _jax_sync_manager_active() -> bool:
  try:
    state = _multihost.distributed_state()
  except ImportError:
    return False
  return getattr(state, "preemption_sync_manager", None) is not None


def _pass_on(previous: object, signum: int, frame: object) -> None:
  """What ``previous`` (a signal's handler before ours) would do with the signal."""
  if callable(previous):
    previous(signum, frame)
  elif previous == signal.SIG_DFL or previous is None:  # the default action: re-sent, by it
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


class PreemptionWatcher:
  """Watches for preemption signals; ``reached(step)`` says when to save and stop.

  Call :meth:`reached` on every process once at every step: the processes agree
  on the how-manieth call to stop at. Use as a context manager (or call :meth:`close`) to put the
  previous signal handlers back.

  Args:
    signals: the signal names that mean preemption.
    timeout_s: how long reading the signal's time from the coordination
      service may wait (a multi-process job; the policy's
      ``coordination_timeout_seconds``).

  Example:
    >>> w = PreemptionWatcher(("SIGUSR1",))
    >>> w.reached(1)
    False
    >>> w.close()
  """

  def __init__(self, signals: Sequence[str] = ("SIGTERM",),
               timeout_s: float = _multihost.DEFAULT_TIMEOUT_S):
    self.signal_time: float | None = None  # time.monotonic() of the signal, once known
    self._timeout_s = timeout_s
    self._signals = [signal.Signals[s] for s in signals]
    self._use_jax = _jax_sync_manager_active()
    self._flag = threading.Event()
    self._previous: dict[signal.Signals, object] = {}
    self._received = 0
    self._calls = 0  # reached() calls so far: the count JAX's sync manager is given
    # time.monotonic() of the last three calls, the newest last: the oldest bounds when
    # JAX's notice can have come (_note_signal_time).
    self._call_times: collections.deque[float] = collections.deque(maxlen=3)
    self._closed = False  # closed off the main thread: the handlers pass the signals on
    ours = [s for s in self._signals if not (self._use_jax and s == signal.SIGTERM)]
    if ours and threading.current_thread() is not threading.main_thread():
      names = ", ".join(s.name for s in ours)
      raise RuntimeError(
          f"the checkpoint callback watches for preemption signals ({names}), and Python lets"
          " only the main thread install signal handlers: start the run (restore_or_init, or"
          " the first on_step_end) in the main thread (the steps may then run elsewhere), or"
          " set save_on_preemption=False (a preemption then ends the process without a save;"
          " in a job started with jax.distributed, JAX's own watcher catches SIGTERM from any"
          " thread: preemption_signals=('SIGTERM',) needs no handler of ours).")
    for sig in ours:  # (JAX's C++ notifier owns SIGTERM where it runs.)
      self._previous[sig] = signal.signal(sig, self._handle)
    if self._use_jax:
      # No call yet (an earlier watcher in this process may have left a higher count): a
      # notice from now on makes the first reached() the one to stop at.
      self._reached_jax(0)

  @property
  def mechanism(self) -> str:
    return "jax preemption sync point" if self._use_jax else "signal handler"

  def _handle(self, signum, frame) -> None:  # pylint: disable=unused-argument
    if self._closed:  # closed off the main thread, which alone can put the previous back
      _pass_on(self._previous.get(signal.Signals(signum)), signum, frame)
      return
    self._received += 1
    if self._received > 1:
      log.warning("second signal %s: exiting now; no half-written checkpoint is ever committed",
                  signal.Signals(signum).name)
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
      return
    self.signal_time = time.monotonic()
    log.warning("received %s: will save a checkpoint at the next step and stop",
                signal.Signals(signum).name)
    if self._use_jax:
      os.kill(os.getpid(), signal.SIGTERM)  # JAX's notifier tells every process.
    else:
      self._flag.set()
    previous = self._previous.get(signal.Signals(signum))
    # A handler the user installed before runs too (chained); Python's own SIGINT handler
    # (raise KeyboardInterrupt) does not: SIGINT named as a preemption signal saves and stops.
    if callable(previous) and previous is not signal.default_int_handler:
      previous(signum, frame)

  def reached(self, step: int) -> bool:
    """True at the step every process saves after a preemption signal (``step``: this one,
    for the record; the processes agree on the how-manieth call, see the module docstring)."""
    del step
    if self._use_jax:
      self._calls += 1
      self._call_times.append(time.monotonic())
      hit = self._reached_jax(self._calls)
      if hit:
        self._note_signal_time()
      return hit
    return self._flag.is_set()

  @staticmethod
  def _reached_jax(count: int) -> bool:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return multihost_utils.reached_preemption_sync_point(count)

  def _note_signal_time(self) -> None:
    """Sets :attr:`signal_time` from JAX's notice (or our handler's time, if earlier).

    The notice is the signalled host's wall-clock time, read here against this
    host's wall clock: a difference between the two clocks moves it by as much.
    So it is kept within what this process saw. Every process learns of the
    notice within milliseconds of its being recorded and gives JAX the count of
    the call it had passed; JAX picks one past the highest count. Processes run
    within a step of each other, so this process had passed the call two before
    the agreed one: the notice came no earlier than that call, and no later than
    now, the agreed call. (Processes further apart make the start later, never
    earlier: a grace period is not spent by a clock.) Agreed at the first or
    second call, there is no call two before: the notice may have come before
    this watcher was built (a signal during the job's set-up), and only the upper
    bound holds. Outside that range by more than a second it is logged as the
    hosts' clocks disagreeing.

    Without a readable notice, the sync point is the time (late: a grace period
    then counts from here, as it did before the notice was read).
    """
    now_wall, now = time.time(), time.monotonic()
    at = now
    try:
      notice = None if _multihost.client() is None else _multihost.try_fetch(
          _JAX_NOTICE_KEY, timeout_s=self._timeout_s)
      if notice is not None:
        at = self._plausible(now - (now_wall - datetime.fromisoformat(notice).timestamp()), now)
    except (ValueError, TimeoutError) as e:
      log.warning("preemption: cannot read when the signal came (%s); the grace period counts"
                  " from the step the processes agreed on", e)
    self.signal_time = at if self.signal_time is None else min(self.signal_time, at)

  def _plausible(self, noticed: float, now: float) -> float:
    """``noticed`` (the notice's time on this monotonic clock, through the wall clocks) kept
    between this process's call two before the agreed one, if there was one, and ``now``
    (the agreed one)."""
    earliest = self._call_times[0] if len(self._call_times) == 3 else float("-inf")
    if noticed < earliest - _CLOCK_TOLERANCE_S:
      log.warning(
          "preemption: JAX's notice of the signal is %.2f s older than this process's call"
          " two before the one the processes agreed on, which it had passed when it learned"
          " of the notice: this host's wall clock is at least %.2f s ahead of the signalled"
          " host's; the grace period counts from that call", earliest - noticed,
          earliest - noticed)
    elif noticed > now + _CLOCK_TOLERANCE_S:
      log.warning(
          "preemption: JAX's notice of the signal is %.2f s in this process's future: this"
          " host's wall clock is at least %.2f s behind the signalled host's; the grace"
          " period counts from the step the processes agreed on", noticed - now, noticed - now)
    return min(max(noticed, earliest), now)

  def close(self) -> None:
    """Restores the signal handlers that were there before. Off the main thread, which
    alone may install handlers, ours stay installed but pass every signal on to the
    previous ones, as if they were back."""
    if threading.current_thread() is not threading.main_thread():
      self._closed = True
      return
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous = {}

  def __enter__(self) -> PreemptionWatcher:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
