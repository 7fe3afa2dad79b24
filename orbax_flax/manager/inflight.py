"""A manager's save in flight: its step and handle, waiting for it, abandoning it, its error.

:class:`InFlight` holds the one async save a
:class:`~orbax_flax.CheckpointManager` has running and runs the manager's
commit record as the save's done-callback (:meth:`orbax_flax.AsyncSave.add_done_callback`),
in the save's own thread: no thread of its own waits for it. An error of the
save or of the record is kept and raised by the manager's next call
(:meth:`raise_error`), never swallowed; a save abandoned on purpose (a
preemption grace period that ran out) is only logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from orbax_flax.engine import saving

log = logging.getLogger("orbax_flax")


class InFlight:
  """The save in flight (at most one) and the error a finished one left."""

  def __init__(self):
    self._current: tuple[int, saving.AsyncSave] | None = None
    self._error: BaseException | None = None

  def start(self, step: int, handle: saving.AsyncSave | None,
            record: Callable[[saving.AsyncSave | None], None]) -> None:
    """``handle`` saves ``step``; ``record(handle)`` runs once it has committed or failed.

    ``handle=None``: a blocking save, committed already; ``record(None)`` runs
    now and its error is raised here.
    """
    if handle is None:
      self._run(record, None, step)
      self.raise_error()
      return
    self._current = (step, handle)
    handle.add_done_callback(lambda h: self._run(record, h, step))

  def _run(self, record: Callable, handle: saving.AsyncSave | None, step: int) -> None:
    try:
      record(handle)
    except BaseException as e:  # pylint: disable=broad-except  # raised by the next call
      if handle is not None and handle.cancelled.is_set():
        log.warning("abandoned save of step %d ended without committing: %s", step, e)
      else:
        self._error = e

  def step(self) -> int | None:
    """The step whose save is still being written, if any."""
    current = self._current
    return current[0] if current is not None and not current[1].done() else None

  def started_step(self) -> int | None:
    """The step of the save started last and not abandoned, whether or not it has ended."""
    current = self._current
    return current[0] if current is not None and not current[1].cancelled.is_set() else None

  def saving(self, step: int) -> bool:
    """Whether a save of ``step`` was started and not abandoned (it may have ended)."""
    current = self._current
    return current is not None and current[0] == step and not current[1].cancelled.is_set()

  def join(self, timeout: float | None = None) -> bool:
    """Waits up to ``timeout`` s for the save; True if none is left running. Raises nothing."""
    current = self._current
    return current is None or current[1].join(timeout)

  def abandon(self, wait_s: float = 0.0, started: saving.AsyncSave | None = None) -> None:
    """Cancels the save so that it never commits; waits up to ``wait_s`` s for it to stop.

    Args:
      wait_s: how long to wait for its writing to stop (a cancellable save stops within
        about a second): a process that exits while tensorstore writes may abort.
      started: the checkpointer's save in flight, cancelled too: a save whose caller was
        interrupted (Ctrl-C) before it reached :meth:`start`.
    """
    current = self._current[1] if self._current is not None else None
    for handle in {current, started} - {None}:  # the same save once
      if not handle.done():
        handle.cancel()
        handle.join(wait_s)

  def finish(self) -> None:
    """Waits for the save (not an abandoned one), then raises the error left, if any."""
    current = self._current
    if current is not None and not current[1].cancelled.is_set():
      current[1].join()
    self._current = None  # only once it has ended: a Ctrl-C in the join can still abandon it
    self.raise_error()

  def raise_error(self) -> None:
    """Raises (once) the error of a save or commit record that nobody has seen."""
    if self._error is not None:
      e, self._error = self._error, None
      raise e
