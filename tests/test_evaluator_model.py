"""An evaluator beside a training job, driven through random sequences of the job's operations.

The lifecycle model (``test_lifecycle_model.py``) checks what one CheckpointManager lists;
this one checks what :func:`orbax_flax.checkpoints_iterator` promises an evaluator that runs
*at the same time*, on its own thread, while the training job saves, re-saves its newest
step, rolls back, bursts saves without waiting, restarts with other keep rules, and (in the
long run) is SIGKILLed mid-save. The promise (``docs/manager.md``, "An evaluator beside
training"):

* the yielded step stays readable until the next one is yielded: both of the evaluator's
  reads of it (one at once, one after it has worked a while) succeed, and each is a save
  the training job made at that number, whole and bitwise (a save at its number may
  replace it in between: then the newer one, never an older one);
* each committed save is yielded once: no save twice;
* nothing is missed: once the job has finished (``timeout_fn`` says so), every save the
  job's keep rules keep was yielded (with max_to_keep=k, the newest k listed; a step the
  rules dropped may linger until a later save while an evaluator held it).

A few sequences per case run in CI (derandomized); ``ORBAX_FLAX_FAULTS=long`` runs many
more, with kills (``ORBAX_FLAX_MODEL_SCALE`` scales the count).
"""

import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import initialize
from hypothesis.stateful import rule

import orbax_flax as ofx

LONG = os.environ.get("ORBAX_FLAX_FAULTS") == "long"
SCALE = float(os.environ.get("ORBAX_FLAX_MODEL_SCALE", "1"))
pytestmark = [pytest.mark.timeout(int(4 * 3600 * max(1.0, SCALE)))] if LONG else []
PARTS = 4
FROZEN = np.random.default_rng(1).standard_normal((PARTS, 128, 1280)).astype(np.float32)


def _items(tag: int, changed: float) -> dict:
  """Four 640 KiB arrays, the first ``changed`` fraction of which carry ``tag`` (the others
  are the same in every save: a differential save borrows them); ``step`` is the tag."""
  parts = {f"p{i}": FROZEN[i] + (tag if i < round(changed * PARTS) else 0) for i in range(PARTS)}
  return {"state": {**parts, "b": np.full(16, tag, np.float32), "step": tag}}


def _equal(got: dict, want: dict) -> bool:
  g, w = got["state"], want["state"]
  return set(g) == set(w) and all(np.array_equal(np.asarray(g[k]), np.asarray(w[k])) for k in w)


_KILL_WORKER = r"""
import sys, numpy as np, orbax_flax as ofx
d, step, tag, changed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
frozen = np.random.default_rng(1).standard_normal((4, 128, 1280)).astype(np.float32)
parts = {f"p{i}": frozen[i] + (tag if i < round(changed * 4) else 0) for i in range(4)}
m = ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=sys.argv[5] == "1"))
print("READY", flush=True)
m.save(step, {"state": {**parts, "b": np.full(16, tag, np.float32), "step": tag}}, force=True)
m.wait()
print("SAVED", flush=True)
"""


class _Evaluator(threading.Thread):
  """``for step in checkpoints_iterator(...)``: reads the step at once and again after a
  while (its evaluation), checking each read against the saves the job made."""

  def __init__(self, directory: str, made: dict, seed: int):
    super().__init__(daemon=True, name="evaluator")
    self.directory, self.made = directory, made  # made: tag -> (step, changed), before the save
    self.finished = threading.Event()  # the training job is done: no new step will come
    self.rng = random.Random(seed)
    self.yielded: list[tuple[int, int]] = []  # (step, tag of the first read)
    self.failures: list[str] = []
    self.timeline: list[str] = []

  def _check(self, step: int, got: dict, what: str) -> int:
    tag = int(np.asarray(got["state"]["step"]))
    if tag not in self.made or self.made[tag][0] != step:
      self.failures.append(f"step {step} {what}: tag {tag} is no save of step {step}"
                           f" (made: {self.made.get(tag)})")
    elif not _equal(got, _items(tag, self.made[tag][1])):
      self.failures.append(f"step {step} {what}: tag {tag} not bitwise as saved")
    return tag

  def run(self):
    try:
      for step in ofx.checkpoints_iterator(self.directory, poll_interval=0.003, timeout=0.05,
                                           timeout_fn=self.finished.is_set):
        try:
          first = self._check(step, ofx.restore(f"{self.directory}/{step}"), "first read")
          time.sleep(self.rng.choice([0.0, 0.0, 0.01, 0.05, 0.2]))  # the evaluation
          second = self._check(step, ofx.restore(f"{self.directory}/{step}"), "second read")
        except Exception:  # pylint: disable=broad-except  # a held step that cannot be read
          self.failures.append(f"step {step}: {traceback.format_exc()}")
          continue
        if second < first:
          self.failures.append(f"step {step}: read save {first}, then the older save {second}")
        self.yielded.append((step, first))
        self.timeline.append(f"{time.monotonic():.3f} evaluator: yielded {step}, read save"
                             f" {first}, then {second}")
    except Exception:  # pylint: disable=broad-except
      self.failures.append(f"the iterator raised: {traceback.format_exc()}")


class EvaluatorBesideTraining(RuleBasedStateMachine):
  """The training job's operations, in this thread; the evaluator, in its own.

  The model is the run's head: the step its last save started at (after a restore of an
  older step without a save since, that step), so that the next new step is ``head + 1``
  whether or not the save before has committed."""

  directory = ""
  differential = False
  kills = False

  def __init__(self):
    super().__init__()
    self.dir = None
    self.mngr = None
    self.evaluator = None
    self.made: dict[int, tuple[int, float]] = {}  # tag -> (step, changed)
    self.tag = 0
    self.keep: int | None = None
    self.async_save = True
    self.head: int = 0  # 0: nothing saved yet
    self.timeline: list[str] = []  # what the job did, for a failure's message

  @initialize(keep=st.sampled_from([None, 1, 2, 3]), async_save=st.booleans(),
              seed=st.integers(0, 2**16))
  def start(self, keep, async_save, seed):
    self.dir = self.directory + f"/{time.monotonic_ns()}"
    self.keep, self.async_save = keep, async_save
    self._open()
    self.evaluator = _Evaluator(self.dir, self.made, seed)
    self.evaluator.start()

  def _log(self, what: str) -> None:
    self.timeline.append(f"{time.monotonic():.3f} job: {what}")

  def _open(self):
    self.mngr = ofx.CheckpointManager(self.dir, ofx.CheckpointPolicy(
        max_to_keep=self.keep or 0, differential=self.differential, async_save=self.async_save))
    steps = self.mngr.all_steps()
    self.head = steps[-1] if steps else 0
    self._log(f"opened (keep={self.keep}, async={self.async_save}): {steps}")

  def _save(self, step: int, changed: float) -> None:
    self.tag += 1
    self.made[self.tag] = (step, changed)  # before the save: the evaluator may read it first
    self._log(f"save {step} (save {self.tag})")
    assert self.mngr.save(step, _items(self.tag, changed), force=True)
    self.head = step

  def _rollback(self, to: int) -> None:
    got = self.mngr.restore(to)
    tag = int(np.asarray(got["state"]["step"]))
    self._log(f"restored {to} (save {tag})")
    assert self.made[tag][0] == to and _equal(got, _items(tag, self.made[tag][1])), to
    self.head = to

  # ------------------------------------------------------------------ operations

  @rule(changed=st.sampled_from([0.0, 0.25, 1.0]))
  def save(self, changed):
    self._save(self.head + 1, changed)

  @rule(changed=st.sampled_from([0.0, 0.5]))
  def resave_the_head(self, changed):
    """A forced re-save of the run's head (the newest step, or the step a rollback went back
    to): the evaluator holding it reads the old save or the new one, whole, and yields the
    new one."""
    if self.head:
      self._save(self.head, changed)

  @rule(index=st.integers(0, 63), then_save=st.booleans())
  def rollback(self, index, then_save):
    """A restore of an older step, then (perhaps) the next step of the new run: the steps
    above it are abandoned at that save's commit, and the evaluator yields the new run's."""
    self.mngr.wait_for_save()
    steps = [s for s in self.mngr.all_steps() if s < self.head]
    if not steps:
      return
    self._rollback(steps[index % len(steps)])
    if then_save:
      self._save(self.head + 1, 0.25)

  @rule(ops=st.lists(st.sampled_from(["save", "resave", "rollback"]), min_size=2, max_size=5))
  def burst(self, ops):
    """Several operations without waiting: commits, deletions, the evaluator's listings and
    leases interleave."""
    for op in ops:
      if op == "save" or not self.head:
        self._save(self.head + 1, 0.25)
      elif op == "resave":
        self._save(self.head, 0.0)
      else:
        self.mngr.wait_for_save()  # (a restore of a step older than one surely committed)
        steps = [s for s in self.mngr.all_steps() if s < self.head]
        if steps:
          self._rollback(steps[-1])
          self._save(self.head + 1, 0.25)

  @rule(keep=st.sampled_from([None, 1, 2, 3]), async_save=st.booleans())
  def restart(self, keep, async_save):
    """The job restarts (another keep rule, async or not): a restore not followed by a save
    was a look, gone with the process."""
    self.mngr.close()
    self.keep, self.async_save = keep, async_save
    self._open()

  @rule(delay=st.floats(0.0, 1.0))
  def killed_writer(self, delay):
    """The writer is another process, SIGKILLed mid-save (long runs only: each is a
    process); this job then restarts. The evaluator never yields what did not commit."""
    if not self.kills:
      return
    self.mngr.close()
    steps = ofx.CheckpointManager(self.dir).all_steps()  # (the job's head: a look is gone)
    step = steps[-1] + 1 if steps else 1
    self.tag += 1
    self.made[self.tag] = (step, 0.5)
    self._log(f"killed writer saves {step} (save {self.tag})")
    proc = subprocess.Popen([sys.executable, "-c", _KILL_WORKER, self.dir, str(step),
                             str(self.tag), "0.5", "1" if self.differential else "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
      assert proc.stdout.readline().strip() == "READY"
      time.sleep(delay)
    finally:
      proc.send_signal(signal.SIGKILL)
      proc.wait()
      proc.stdout.close()
    self._open()

  # ------------------------------------------------------------------ the promise

  def teardown(self):
    if self.mngr is None:
      return
    self.mngr.close()
    self._log("closed")
    keep = self.keep
    ev = self.evaluator
    ev.finished.set()
    ev.join(120)
    assert not ev.is_alive(), "the evaluator did not end 120 s after the job finished"
    story = "\n".join(sorted(self.timeline + ev.timeline))
    assert not ev.failures, "\n".join(ev.failures) + "\n" + story
    # Each save is yielded once. The evaluator reads a step after it is yielded: when a save
    # at its number replaced the yielded one in between, it reads the new save at that yield
    # and again at the next (the iterator yields the new save): a repeat of the save just
    # read, at the same number, and only of a save that replaced another.
    for (s0, t0), (s1, t1) in zip(ev.yielded, ev.yielded[1:]):
      if t1 == t0:
        assert s1 == s0 and any(st_ == s0 and t < t0 for t, (st_, _) in self.made.items()), (
            f"save {t0} yielded twice: {ev.yielded}\n{story}")
    tags = [t for _, t in ev.yielded]
    assert len({t for t in tags}) == len([t for i, t in enumerate(tags)
                                           if i == 0 or tags[i - 1] != t]), (
        f"a save yielded twice, apart: {ev.yielded}\n{story}")
    reader = ofx.CheckpointManager(self.dir)
    try:
      listed = reader.all_steps()
      kept = listed if keep is None else listed[-keep:]
      for step in kept:
        tag = int(np.asarray(reader.restore(step)["state"]["step"]))
        assert tag in tags, (f"step {step} (save {tag}) kept by the job and never yielded;"
                             f" listed {listed}, yielded {ev.yielded}\n{story}")
    finally:
      reader.close()


def _run(directory: str, differential: bool, examples: int, kills: bool) -> None:
  machine = type("Case", (EvaluatorBesideTraining,), {
      "directory": directory, "differential": differential, "kills": kills})
  hypothesis.stateful.run_state_machine_as_test(machine, settings=hypothesis.settings(
      max_examples=examples, stateful_step_count=10 if not LONG else 16, deadline=None,
      suppress_health_check=list(hypothesis.HealthCheck), derandomize=not LONG,
      database=None))


@pytest.mark.parametrize("differential", [False, True])
def test_evaluator_model_local(tmp_path, differential):
  _run(str(tmp_path), differential, int(400 * SCALE) if LONG else 10, kills=LONG)


def test_evaluator_model_s3(s3_server):
  bucket = s3_server.new_bucket()
  _run(s3_server.url(bucket, "run"), False, int(100 * SCALE) if LONG else 3, kills=False)
