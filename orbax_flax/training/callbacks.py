"""A small training loop with four hooks, and the hook surface itself.

:class:`Callback` has exactly four hooks, called in this order:

1. ``on_train_start(state, data) -> state``: once, before the first step. May
   return a different state (e.g. restored from a checkpoint).
2. ``on_step_end(step, state, metrics) -> bool``: after every step; ``step``
   counts finished steps (1 after the first). Returning True stops training
   after this step (every callback still sees the step).
3. ``on_train_end(step, state)``: once, after the last step or a stop.
4. ``on_exception(step, state, error)``: instead of ``on_train_end`` when
   the loop raises; ``state`` is the last good state. The error is re-raised.

When an ``on_train_start`` raises, no step has run: that callback and the ones
started before it are told, the later ones never hear of the run. A callback
that is a context manager (:class:`orbax_flax.CheckpointCallback`) is exited
with the error, as a ``with`` block around it would be (the checkpoint callback
then closes and saves nothing); any other gets ``on_exception`` with the step
the run would have started from. When an ``on_train_end`` raises, the later
callbacks still get theirs; then the first such error is raised.

:class:`Trainer` runs ``train_step(state, batch) -> (state, metrics)`` for
``num_steps`` steps and calls the hooks; clu ``PeriodicAction``s (e.g.
``ReportProgress``) can be passed as callbacks directly. A hand-written loop
can call the same hooks (see :class:`orbax_flax.CheckpointCallback`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import jax

from orbax_flax.training import state_items

log = logging.getLogger("orbax_flax")


class Callback:
  """Base class: override the hooks you need; each default does nothing."""

  def on_train_start(self, state: Any, data: Any) -> Any:
    del data
    return state

  def on_step_end(self, step: int, state: Any, metrics: Any) -> bool:
    del step, state, metrics
    return False

  def on_train_end(self, step: int, state: Any) -> None:
    del step, state

  def on_exception(self, step: int, state: Any, error: BaseException) -> None:
    del step, state, error


class PeriodicActionCallback(Callback):
  """Runs a clu ``PeriodicAction`` (``action(step)``) after every step."""

  def __init__(self, action: Callable[..., Any]):
    self.action = action

  def on_step_end(self, step: int, state: Any, metrics: Any) -> bool:
    self.action(step)
    return False


class LogProgress(Callback):
  """Logs steps/s and the metrics every ``every`` steps (fetches metrics then only).

  The clock starts at the end of the run's first step, which holds the compilation:
  the rate counts the steps finished after it. A line at that first step (``every=1``)
  has no rate, and its scalars no ``steps_per_sec``.
  """

  def __init__(self, every: int = 10, writer: Any = None, clock: Callable[[], float] = time.perf_counter):
    self.every, self.writer, self._clock = every, writer, clock
    self._t = None
    self._step = None

  def on_train_start(self, state: Any, data: Any) -> Any:
    self._t, self._step = None, None
    return state

  def on_step_end(self, step: int, state: Any, metrics: Any) -> bool:
    if self._step is None:  # the run's first step: the window starts at its end
      self._step, self._t = step, self._clock()
    if step % self.every:
      return False
    values = {k: float(v) for k, v in jax.device_get(dict(metrics or {})).items()}
    shown = " ".join(f"{k}={v:.4f}" for k, v in sorted(values.items()))
    if step == self._step:  # no step timed yet
      log.info("step %d: %s", step, shown)
      if self.writer is not None and values:
        self.writer.write_scalars(step, values)
      return False
    now = self._clock()
    rate = (step - self._step) / max(now - self._t, 1e-9)
    self._step, self._t = step, now
    log.info("step %d: %s (%.1f steps/s)", step, shown, rate)
    if self.writer is not None:
      self.writer.write_scalars(step, {**values, "steps_per_sec": rate})
    return False


def _as_callback(cb: Any) -> Callback:
  if isinstance(cb, Callback):
    return cb
  try:
    from clu import periodic_actions  # pylint: disable=g-import-not-at-top
    if isinstance(cb, periodic_actions.PeriodicAction):
      return PeriodicActionCallback(cb)
  except ImportError:  # pragma: no cover
    pass
  raise TypeError(f"callbacks must be orbax_flax.Callback or clu PeriodicAction instances, got"
                  f" {type(cb).__name__}")


class Trainer:
  """Runs a train step over a data iterator and calls the callbacks.

  Args:
    train_step: ``(state, batch) -> (state, metrics)``, usually jitted.
    callbacks: :class:`Callback`s or clu ``PeriodicAction``s, called in order.

  Example:
    >>> import numpy as np
    >>> step = lambda s, b: ({"w": s["w"] + b, "step": s["step"] + 1}, {"loss": b})
    >>> data = iter([1.0] * 5)
    >>> Trainer(step).fit({"w": 0.0, "step": 0}, data, num_steps=3)
    {'w': 3.0, 'step': 3}
  """

  def __init__(self, train_step: Callable[[Any, Any], tuple[Any, Any]],
               callbacks: Sequence[Any] = ()):
    self.train_step = train_step
    self.callbacks = [_as_callback(cb) for cb in callbacks]

  def fit(self, state: Any, data: Iterator[Any], num_steps: int) -> Any:
    """Trains from the state's step (after any restore) up to ``num_steps``.

    Returns:
      The final state; training stops early when a callback asks (e.g. after
      a preemption save), or when ``data`` runs out (a WARNING says so; the run
      ends as at ``num_steps``, with its final save).

    Raises:
      BaseException: whatever a hook or ``train_step`` raised, unchanged, after
        every callback that started was told (see the module docstring).
    """
    started = []  # the callbacks whose on_train_start ran, or raised
    step = None   # set once every callback has started
    try:
      for cb in self.callbacks:
        started.append(cb)
        state = cb.on_train_start(state, data)
      step = self._first_step(state)
      while step < num_steps:
        try:
          batch = next(data)
        except StopIteration:  # a finite dataset: its end is no training failure
          log.warning("the data ran out after step %d, before num_steps=%d: training ends"
                      " there", step, num_steps)
          break
        state, metrics = self.train_step(state, batch)
        step += 1
        stop = False
        for cb in self.callbacks:
          stop = bool(cb.on_step_end(step, state, metrics)) or stop
        if stop:
          log.info("training stopped at step %d", step)
          break
    except BaseException as e:
      if step is None:
        self._abort_start(started, state, e)
      else:
        for cb in self.callbacks:
          _tell(cb, step, state, e)
      raise
    failed = None
    for cb in self.callbacks:
      try:
        cb.on_train_end(step, state)
      except BaseException as e:  # the later callbacks still end: their final saves, their closes
        if failed is not None:
          log.exception("%s.on_train_end failed too", type(cb).__name__)
        else:
          failed = e
    if failed is not None:
      raise failed
    return state

  def _first_step(self, state: Any) -> int:
    """The step training starts from: the state's counter, else where a restore left off, else 0."""
    step = state_items.step_of(state)
    if step is None:
      restored = [cb.restored_step for cb in self.callbacks
                  if getattr(cb, "restored_step", None) is not None]
      step = restored[0] if restored else 0
    return step

  def _abort_start(self, started: list[Callback], state: Any, error: BaseException) -> None:
    """Tells the callbacks in ``started`` that the run failed before its first step."""
    step = None
    for cb in started:
      if hasattr(type(cb), "__exit__"):
        try:
          cb.__exit__(type(error), error, error.__traceback__)
        except Exception:  # pylint: disable=broad-except  # The training error comes first.
          log.exception("closing %s failed while handling %s", type(cb).__name__,
                        type(error).__name__)
        continue
      if step is None:
        try:
          step = self._first_step(state)
        except Exception:  # pylint: disable=broad-except  # reading it may be the very failure
          log.exception("the state's step could not be read while handling %s; telling the"
                        " callbacks step 0", type(error).__name__)
          step = 0
      _tell(cb, step, state, error)


def _tell(cb: Callback, step: int, state: Any, error: BaseException) -> None:
  """``cb.on_exception``; its own failure is logged, as the training error comes first."""
  try:
    cb.on_exception(step, state, error)
  except Exception:  # pylint: disable=broad-except  # The training error comes first.
    log.exception("%s.on_exception failed while handling %s", type(cb).__name__,
                  type(error).__name__)
