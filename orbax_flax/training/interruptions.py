"""Training that ends early (an error, Ctrl-C, a preemption): what the callback checks and says.

What :class:`~orbax_flax.CheckpointCallback`'s exception and preemption saves
do beside saving: decide whether the state at an error is still the last
step's, put the ending into words for the log, agree through the coordination
service that every process failed, wait for a preemption save within its grace
period (cancelling a late one), and abandon the save in flight on a second
Ctrl-C (closing the manager, printing what is committed).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import jax

from orbax_flax.core import _multihost
from orbax_flax import errors
from orbax_flax.training import state_items
from orbax_flax.manager.config import CheckpointPolicy
from orbax_flax.manager.manager import CheckpointManager

log = logging.getLogger("orbax_flax")

# How long an exception save waits for the other processes to fail too (a NaN
# loss fails everywhere at once; a failure of one process alone leaves the
# others inside a collective, and nothing can be saved without them).
FAILED_AGREEMENT_S = 3.0
# How long a second Ctrl-C waits for the abandoned save's writing to stop (about a second).
ABANDON_WAIT_S = 10.0


def stop_saving(manager: CheckpointManager, step: int) -> None:
  """A second Ctrl-C while saving ``step``: abandons the save, closes ``manager``, says so.

  The writing stops before the process exits: one that exits while tensorstore
  writes may abort.
  """
  try:
    manager.abandon_inflight(wait_s=ABANDON_WAIT_S)
    manager.close()  # its threads too (the staging memory's preparation)
  except KeyboardInterrupt:  # a third Ctrl-C: stop waiting
    pass
  except Exception as e:  # pylint: disable=broad-except  # the interruption comes first
    log.error("closing the checkpoint manager after the second interruption failed: %s: %s",
              type(e).__name__, e)
  latest = manager.latest_step()
  outcome = ("its commit was under way and is complete" if latest == step else
             "the save is abandoned (never committed half-written)")
  print(f"orbax_flax: interrupted again while saving step {step}: {outcome}; the last"
        f" committed step is {latest}", file=sys.stderr, flush=True)


def committed_in_grace(manager: CheckpointManager, step: int, grace: float,
                       spent: float) -> bool:
  """Waits for the preemption save of ``step`` (``grace`` seconds, 0: no limit, ``spent`` of
  them gone); True once committed, False (logged; cancelled if late) when not."""
  if grace and not manager.wait_for_save(max(0.0, grace - spent)):
    manager.abandon_inflight()
    log.error("preemption save of step %d did not commit within the %g s grace period;"
              " cancelled: it is not committed unless its commit was already under way"
              " (then it is complete). The last committed step is %s.", step, grace,
              manager.latest_step())
    return False
  try:
    manager.wait()
  except errors.SaveCancelledError as e:
    # Another process ran out of grace period and cancelled the save: the job is
    # still preempted; stop cleanly like that process does.
    log.error("preemption save of step %d was not committed: %s The last committed step"
              " is %s.", step, e, manager.latest_step())
    return False
  return True


def failure(step: int, error: BaseException) -> str:
  """What ended training, in words, for the log."""
  if isinstance(error, KeyboardInterrupt):
    return f"interrupted after step {step} (KeyboardInterrupt: Ctrl-C or SIGINT)"
  return f"training failed after step {step} ({type(error).__name__}: {error})"


def unsaveable(step: int, state: Any, error: BaseException, after: str) -> bool:
  """True (and logged, followed by ``after``) if the state at an error is not step ``step``'s."""
  if state_items.kind(state) == "nnx":
    log.warning("%s; not saving it: NNX objects are updated in place, so the live model and"
                " optimizer may already be ahead of step %d, the last step handed to"
                " on_step_end, and a save labelled %d could hold a later state. %s",
                failure(step, error), step, step, after)
    return True
  if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
    (log.warning if isinstance(error, KeyboardInterrupt) else log.error)(
        "%s; the state of step %d cannot be saved: its buffers were donated to the next"
        " step. %s", failure(step, error), step, after)
    return True
  return False


def sigint_hint(policy: CheckpointPolicy) -> str:
  """How to make Ctrl-C save as a preemption does ("" if it already does)."""
  if "SIGINT" in policy.preemption_signals and policy.save_on_preemption:
    return ""
  return (" To make Ctrl-C save at the next step end and stop cleanly, as a preemption does,"
          " add SIGINT to the policy's preemption_signals, e.g. preemption_signals=('SIGTERM',"
          " 'SIGINT') (on the command line:"
          " --config.checkpoint.preemption_signals=\"('SIGTERM','SIGINT')\").")


def resume_point(manager: CheckpointManager) -> str:
  """Where a resume would start, as a sentence (a save in flight commits before the close)."""
  inflight = manager.inflight_step()
  if inflight is not None:
    return (f"A resume continues from step {inflight}, whose save is still being written (it"
            " commits before the callback closes).")
  latest = manager.latest_step()
  if latest is None:
    return "No step is committed yet: a resume starts from scratch."
  return f"A resume continues from step {latest}, the last committed."


def every_process_failed(manager: CheckpointManager, step: int) -> bool:
  """A save needs every process; one that did not fail is still training."""
  if jax.process_count() == 1:
    return True
  try:
    _multihost.all_gather(f"{manager.coordination_key}/failed/{step}", "1",
                          timeout_s=FAILED_AGREEMENT_S)
    return True
  except TimeoutError:
    log.error("training failed after step %d on this process but not on every process within"
              " %g s; no exception save (it needs all of them)", step, FAILED_AGREEMENT_S)
    return False
