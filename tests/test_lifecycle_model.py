"""A model of what a CheckpointManager promises, driven through random sequences of operations.

The promise (``docs/guarantees.md``, promise 2): whatever the order of valid
operations, every step the manager lists restores bitwise to what was last
saved under it, the newest save that returned is listed, and with keep-all
retention no step is lost that was not abandoned by a rollback.

Operations: saves (a fresh step, partial changes so that differential saves
borrow), forced re-saves of a listed step (also refused for bad input, and
cancelled at once), rollbacks (restore an older step, then save; also while a
save, perhaps of an earlier rollback's run, is in flight; a second rollback while the
first one's save is held in flight), restores of the
latest step (calling a rollback off), bursts of
those without waiting in between (commits, deletions and the next save
interleave), restarts with other keep rules and async/blocking, a second
manager reading beside the writer, and a writer killed mid-save or right after a
rollback's first commit (SIGKILL of a real process). ``differential`` on and off on a local directory; on S3 off (differential
saves refuse object stores).

A few dozen sequences per case run in CI (fixed, derandomized); ``ORBAX_FLAX_FAULTS=long``
runs 2,400 random ones, longer (``ORBAX_FLAX_MODEL_SCALE`` scales that count; the last run
is in ``docs/guarantees.md``).
"""

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import initialize
from hypothesis.stateful import invariant
from hypothesis.stateful import precondition
from hypothesis.stateful import rule

import orbax_flax as ofx
from orbax_flax.engine import saving

LONG = os.environ.get("ORBAX_FLAX_FAULTS") == "long"
SCALE = float(os.environ.get("ORBAX_FLAX_MODEL_SCALE", "1"))  # the long run's counts, scaled
# The long run's cases take about an hour each: pyproject's 600 s (right for CI) would cut them.
pytestmark = [pytest.mark.timeout(int(6 * 3600 * max(1.0, SCALE)))] if LONG else []
PARTS = 4
FROZEN = np.random.default_rng(0).standard_normal((PARTS, 256, 1280)).astype(np.float32)


def _items(tag: int, changed: float) -> dict:
  """A state of four 1.25 MiB (chunked) arrays, the first ``changed`` fraction of which carry ``tag``;
  the others are the same in every save (a differential save borrows them)."""
  parts = {f"p{i}": FROZEN[i] + (tag if i < round(changed * PARTS) else 0) for i in range(PARTS)}
  return {"state": {**parts, "b": np.full(16, tag, np.float32), "step": tag}}


def _equal(got: dict, want: dict) -> bool:
  g, w = got["state"], want["state"]
  return set(g) == set(w) and all(np.array_equal(np.asarray(g[k]), np.asarray(w[k])) for k in w)


# Every save's commit waits here while it is clear (rollback_again_while_its_save_is_held).
_GATE = threading.Event()
_GATE.set()


_KILL_WORKER = r"""
import sys, numpy as np, orbax_flax as ofx
d, step, tag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
frozen = np.random.default_rng(0).standard_normal((4, 256, 1280)).astype(np.float32)
parts = {f"p{i}": frozen[i] + (tag if i < 2 else 0) for i in range(4)}
m = ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=sys.argv[4] == "1"))
print("READY", flush=True)
m.save(step, {"state": {**parts, "b": np.full(16, tag, np.float32), "step": tag}}, force=True)
m.wait()
print("SAVED", flush=True)
"""


_ROLLBACK_KILL_WORKER = r"""
import os, signal, sys, numpy as np, orbax_flax as ofx
d, to, step, tag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
frozen = np.random.default_rng(0).standard_normal((4, 256, 1280)).astype(np.float32)
parts = {f"p{i}": frozen[i] + (tag if i < 2 else 0) for i in range(4)}
m = ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=sys.argv[5] == "1"))
m.restore(to)
m.save(step, {"state": {**parts, "b": np.full(16, tag, np.float32), "step": tag}}, force=True)
m.wait_for_save()
os.kill(os.getpid(), signal.SIGKILL)
"""


class ManagerModel(RuleBasedStateMachine):
  """The model is ``saved``: step -> the tag and change fraction last saved under it."""

  directory = ""       # set per case by make_machine
  differential = False
  kills = True

  def __init__(self):
    super().__init__()
    self.saved: dict[int, tuple[int, float]] = {}
    self.rolled_to = None  # a rollback waiting for this run's first commit
    self.keep: int | None = None
    self.async_save = True
    self.tag = 0
    self.last_saved: int | None = None
    self.last_started: int | None = None
    self.dropped: dict[int, tuple[int, float]] = {}
    self.dir = None
    self.mngr = None
    # Steps the keep rules dropped while an evaluator held them: still committed on storage
    # until this manager's next commit deletes them, so a manager opened before that lists
    # them again (evaluator_holds_the_newest).
    self.lingering: dict[int, tuple[int, float]] = {}
    self.holding: int | None = None  # the step an evaluator holds now (its lease)
    # Whether the manager open now saves differential steps: a differential case's restarts
    # turn it off and on (a job restarted with another config, over the same steps).
    self.diff_now = self.differential

  @property
  def rolled_to(self) -> int | None:
    return self._rolled_to

  @rolled_to.setter
  def rolled_to(self, step: int | None) -> None:
    # A new rollback (or none): what an earlier one also abandoned, and how high it reached,
    # no longer count (see rollback_again_while_its_save_is_held).
    self._rolled_to, self.also_abandoned, self.ceiling = step, set(), None
    self.run_saving = False  # the rollback's run started a save (committed or not)

  @initialize(async_save=st.booleans())
  def start(self, async_save):
    self.dir = self.directory + f"/{time.monotonic_ns()}"
    self.async_save = async_save
    self._open()

  def _open(self):
    self.writing = False
    self.saved.update(self.lingering)  # a new manager's listing: committed steps, its to keep
    self.lingering = {}
    self.mngr = ofx.CheckpointManager(self.dir, ofx.CheckpointPolicy(
        max_to_keep=self.keep or 0, differential=self.diff_now, async_save=self.async_save))

  def _next_tag(self) -> int:
    self.tag += 1
    return self.tag

  def _commit(self, step: int, tag: int, changed: float, keep: bool = True) -> None:
    """The model's side of a save that returned: what it replaces or abandons, and (``keep``)
    what this manager's keep rules drop at its commit."""
    if (self.rolled_to is not None and self.saved and not self.run_saving
        and step > max(max(self.saved), self.ceiling or 0)):
      self.rolled_to = None  # saved above every newer step: no rollback, nothing abandoned
    if self.rolled_to is not None:
      for s in [s for s in self.saved
                if (s > self.rolled_to or s in self.also_abandoned) and s != step]:
        del self.saved[s]
      self.rolled_to = None
    self.saved[step] = (tag, changed)
    self.last_saved = step
    if keep:
      self._apply_keep()

  def _apply_keep(self):
    self.dropped = {}  # what the keep rules of the last save drop (at its commit)
    if self.keep is not None:  # max_to_keep: the newest ones stay
      for s in sorted(self.saved)[:-self.keep]:
        self.dropped[s] = self.saved.pop(s)

  def _save(self, step: int, changed: float, force: bool) -> None:
    tag = self._next_tag()
    if not self.mngr.save(step, _items(tag, changed), force=force):
      # Documented: a step whose save is still in flight is not saved again, unless forced
      # (then the save in flight is waited for and replaced).
      assert not force and step == self.last_started, (step, self.last_started)
      return
    self.last_started = step
    self.writing = True
    self._commit(step, tag, changed)
    # Deleted at this commit, their leases released before it (not one still held).
    self.lingering = {s: v for s, v in self.lingering.items() if s == self.holding}

  def _new_step(self) -> int:
    return (max(self.saved) if self.saved else 0) + 1

  # ------------------------------------------------------------------ operations

  @rule(changed=st.sampled_from([0.0, 0.25, 1.0]))
  def save(self, changed):
    self._save(self._new_step(), changed, force=True)

  # No rule's precondition or draw depends on what was saved: a kill's outcome and whether
  # a save was still in flight depend on timing, and hypothesis replays a sequence (to
  # shrink it) expecting the same draws. A rule that finds nothing to act on does nothing.

  @rule(index=st.integers(0, 63), changed=st.sampled_from([0.0, 0.5]))
  def force_resave(self, index, changed):
    if not self.saved:
      return
    step = sorted(self.saved)[index % len(self.saved)]
    if self.rolled_to is not None and step > self.rolled_to:
      step = self.rolled_to  # (re-saving an abandoned step is a save of the new run)
    self._save(step, changed, force=True)

  @rule(index=st.integers(0, 63), then_save=st.booleans())
  def rollback(self, index, then_save):
    if len(self.saved) < 2:
      return
    older = sorted(self.saved)[:-1]
    step = older[index % len(older)]
    tag, changed = self.saved[step]
    # A restore of an older step is a rollback once a newer step has committed (a save still
    # in flight alone does not make one: restoring the latest committed step is no rollback).
    self.mngr.wait_for_save()
    assert _equal(self.mngr.restore(step), _items(tag, changed))
    self.rolled_to = step
    if then_save:  # the run goes on from there: the step after it, right away
      self._save(step + 1, 0.25, force=True)

  @rule(index=st.integers(0, 63), in_flight=st.booleans(), then_save=st.booleans())
  def rollback_while_saving(self, index, in_flight, then_save):
    """A rollback without waiting for the save in flight (perhaps of an earlier rollback's
    run). To an older step than one surely committed (not the save in flight), so that it is
    a rollback whatever the timing."""
    if not in_flight and self.async_save and self.saved:
      self._save(self._new_step(), 0.25, force=True)  # most likely still in flight below
    older = [s for s in sorted(self.saved)
             if any(t > s and t != self.last_started for t in self.saved)]
    if not older:
      return
    step = older[index % len(older)]
    tag, changed = self.saved[step]
    assert _equal(self.mngr.restore(step), _items(tag, changed))
    self.rolled_to = step
    if self.dropped:
      # The keep rules of the save that was in flight act at its commit: before the restore
      # they did; after it they wait for the new run's first commit (nothing changes on disk
      # until then). Which came first is timing: what is still listed is still there.
      self.mngr.wait_for_save()
      listed = set(self.mngr.all_steps())
      self.saved.update({s: v for s, v in self.dropped.items() if s in listed})
      self.dropped = {}
    if then_save:
      self._save(step + 1, 0.25, force=True)

  @rule(index=st.integers(0, 63))
  def refused_resave(self, index):
    """A forced re-save of a listed step with a leaf that cannot be saved: refused, and the
    step stays as it was (with differential saves it was moved aside first, and lost)."""
    listed = [s for s in sorted(self.saved) if s != self.last_started]  # (one in flight is
    if not listed:                                  # not saved again: save() returns False)
      return
    step = listed[index % len(listed)]
    bad = _items(self._next_tag(), 0.5)
    bad["state"]["bad"] = object()
    with pytest.raises(ofx.UnsupportedLeafError):
      self.mngr.save(step, bad, force=True)

  @rule(index=st.integers(0, 63), changed=st.sampled_from([0.0, 0.5]))
  def cancelled_resave(self, index, changed):
    """A re-save of a listed step cancelled at once (a second Ctrl-C): it commits, or the step
    stays as it was."""
    if not self.saved:
      return
    step = sorted(self.saved)[index % len(self.saved)]
    if self.rolled_to is not None and step > self.rolled_to:
      step = self.rolled_to
    tag = self._next_tag()
    if not self.mngr.save(step, _items(tag, changed), reason="exception"):
      assert step == self.last_started, (step, self.last_started)
      return
    self.last_started = step
    self.writing = True
    self.mngr.abandon_inflight(wait_s=60)  # (until it stops: wait() does not wait for it)
    self.mngr.wait()
    listed = self.mngr.all_steps()
    # Not listed: it committed, and the keep rules dropped it at once.
    if step not in listed or _equal(ofx.restore(self.mngr.step_path(step)), _items(tag, changed)):
      self._commit(step, tag, changed)
    else:
      assert _equal(ofx.restore(self.mngr.step_path(step)), _items(*self.saved[step])), step
      # Started, then abandoned: it was the rollback's run's first save all the same (a save
      # above every newer step after it is that run going on, not a call-off).
      self.run_saving = self.rolled_to is not None

  @rule(first=st.integers(0, 63), second=st.integers(0, 63))
  def rollback_again_while_its_save_is_held(self, first, second):
    """A rollback whose run's first save is held in flight (its commit waits at a gate), then
    a restore of any committed step (one the first rollback abandoned, or the latest, which
    calls both off), then the commit: the second rollback abandons that save whatever its
    number, and the first one's end removes only what both abandon."""
    if not self.async_save:
      return
    for _ in range(4 - len(self.saved)):  # room for a second rollback between the first and
      self._save(self._new_step(), 0.25, force=True)  # the newest (keep rules may take some)
    self.mngr.wait_for_save()
    if len(self.saved) < 2:
      return
    committed = sorted(self.saved)
    a = committed[:-1][first % (len(committed) - 1)]
    assert _equal(self.mngr.restore(a), _items(*self.saved[a]))
    step, tag = a + 1, self._next_tag()
    others = [s for s in committed if s != step]  # (a restore of the step being saved waits)
    b = others[second % len(others)]
    _GATE.clear()
    try:
      assert self.mngr.save(step, _items(tag, 0.25), force=True)
      assert _equal(self.mngr.restore(b), _items(*self.saved[b]))
    finally:
      _GATE.set()
    self.mngr.wait_for_save()
    self.last_started, self.last_saved, self.writing = step, step, True
    ceiling = max(committed + [step])
    self.saved[step] = (tag, 0.25)
    if b == max(committed):  # the latest: both rollbacks called off, nothing abandoned
      self._apply_keep()  # the keep rules at its commit
      self.rolled_to = None
      return
    for s in [s for s in self.saved if s > max(a, b) and s != step]:
      del self.saved[s]  # what both abandon: gone at the first one's end
    # Its commit came after the second restore: its keep rules wait for the new run's first
    # commit, as in rollback_while_saving (the model applied them here: the long runs on
    # ea2935f and af74269 found it dropping steps the manager rightly keeps until then).
    self.dropped = {}
    self.rolled_to = b
    self.also_abandoned, self.ceiling = {step}, ceiling

  @rule()
  def restore_latest(self):
    if not self.saved:
      return
    latest = max(self.saved)
    tag, changed = self.saved[latest]
    assert _equal(self.mngr.restore(), _items(tag, changed))
    self.rolled_to = None  # the newest resumed: an earlier rollback is called off

  @rule(ops=st.lists(st.sampled_from(["save", "force", "rollback", "latest"]), min_size=2,
                     max_size=4))
  def burst(self, ops):
    """Several operations without waiting in between: commits, the deleter and the next save
    interleave."""
    for op in ops:
      if op == "save" or not self.saved:
        self._save(self._new_step(), 0.25, force=True)
      elif op == "force":
        step = max(self.saved) if self.rolled_to is None else self.rolled_to
        self._save(step, 0.0, force=True)
      elif op == "rollback" and len(self.saved) >= 2:
        step = sorted(self.saved)[-2]
        self.mngr.wait_for_save()  # (see rollback)
        self.mngr.restore(step)
        self.rolled_to = step
        self._save(step + 1, 0.25, force=True)
      elif op == "latest":
        self.mngr.restore()
        self.rolled_to = None

  @rule(keep=st.sampled_from([None, 2, 3]), async_save=st.booleans(), differential=st.booleans())
  def restart(self, keep, async_save, differential=True):
    """The job restarts with another config: the keep rules, async saves, and in a
    differential case differential saves on or off (a plain manager over steps that
    reference each other's bytes keeps what they reference)."""
    self.mngr.close()
    self.keep, self.async_save = keep, async_save
    self.diff_now = self.differential and differential
    self.rolled_to = None  # a restore of the old run is not a rollback of the new one
    self._open()

  @rule()
  def reader_beside_the_writer(self):
    """A second manager on the directory (an evaluator's): it lists, restores, and changes
    nothing, and its save is refused while the writer lives."""
    reader = ofx.CheckpointManager(self.dir)
    try:
      steps = reader.all_steps()
      if steps:
        reader.restore(steps[0])
      if self.writing:  # this manager has saved since it opened: it holds the writer lease
        with pytest.raises(ofx.WriterConflictError, match="writer already"):
          reader.save(10**6, _items(0, 0.0), force=True)
    finally:
      reader.close()

  @rule(ops=st.lists(st.sampled_from(["save", "rollback", "restart"]), min_size=1, max_size=3),
        index=st.integers(0, 63))
  def evaluator_holds_the_newest(self, ops, index):
    """An evaluator (checkpoints_iterator) holds the newest step while this job saves on,
    rolls back and restarts: the held step restores as saved for as long as it is held,
    whatever the keep rules or a rollback drop (documented: "the yielded step stays readable
    until the next one is yielded"); a step a rollback abandoned is never listed again, and
    one the keep rules dropped goes at this manager's next commit after the release. (A save
    of the held step's number, a rollback's run reaching it, replaces it: the evaluator then
    reads the new save, and the iterator yields it again.)"""
    self.mngr.wait()
    listed = self.mngr.all_steps()
    if not listed:
      return
    held = listed[-1]
    want = self.saved[held]
    evaluator = ofx.checkpoints_iterator(self.dir, timeout=0, start_after=held - 1)
    self.holding = held
    try:
      assert next(evaluator) == held
      for op in ops:
        older = sorted(s for s in self.saved if s < held and s + 1 != held)
        if op == "rollback" and older:
          self.rollback(index, then_save=False)  # to an older step; held is newer
          if self.rolled_to + 1 != held:
            self._save(self.rolled_to + 1, 0.25, force=True)
        elif op == "restart":
          self.restart(self.keep, self.async_save, self.diff_now)
        else:
          self._save(self._new_step(), 0.25, force=True)
        self.mngr.wait()
        if held in self.saved:  # (perhaps saved over: a rollback's run reached its number)
          want = self.saved[held]
        elif held in self.dropped:  # the keep rules dropped it
          self.lingering[held] = want
        assert _equal(ofx.restore(f"{self.dir}/{held}"), _items(*want)), (held, op)
    finally:
      evaluator.close()  # its lease released
      self.holding = None

  @precondition(lambda self: self.kills)
  @rule(delay=st.floats(0.0, 1.5))
  def killed_writer(self, delay):
    """The writer is another process, SIGKILLed mid-save; this job then restarts."""
    self.mngr.close()
    step, tag = self._new_step(), self._next_tag()
    proc = subprocess.Popen([sys.executable, "-c", _KILL_WORKER, self.dir, str(step), str(tag),
                             "1" if self.diff_now else "0"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "READY"
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    self.rolled_to = None
    self._open()
    if step in self.mngr.all_steps():  # it committed before the kill
      self.saved[step] = (tag, 0.5)
      self.last_saved = step
      # Not _apply_keep(): the kill may come before the keep rules' deletions, and they act
      # again at the next commit (a step they would drop may stay listed until then).

  @precondition(lambda self: self.kills)
  @rule(index=st.integers(0, 63))
  def killed_after_a_rollback_commits(self, index):
    """The writer is another process: it rolls back, commits the new run's first save, and
    is SIGKILLed at once, before the abandoned steps are deleted; this job then restarts."""
    if len(self.saved) < 2:
      return
    self.mngr.close()
    older = sorted(self.saved)[:-1]
    to = older[index % len(older)]
    tag = self._next_tag()
    proc = subprocess.run([sys.executable, "-c", _ROLLBACK_KILL_WORKER, self.dir, str(to),
                           str(to + 1), str(tag), "1" if self.diff_now else "0"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    self.rolled_to = to
    # The rollback holds from its first commit; the keep rules are this job's (the killed
    # writer keeps every step), and act at its next commit: until then what they would drop
    # stays listed.
    self._commit(to + 1, tag, 0.5, keep=False)
    self._open()

  # ------------------------------------------------------------------ the promise

  @invariant()
  def every_listed_step_restores_as_saved(self):
    if self.mngr is None:
      return
    self.mngr.wait()
    listed = self.mngr.all_steps()
    assert set(listed) <= set(self.saved), (listed, sorted(self.saved))
    if self.last_saved is not None and self.last_saved in self.saved:
      assert self.last_saved in listed, (self.last_saved, listed)
    if self.keep is None:  # keep-all: nothing but a rollback's abandoned steps goes
      assert listed == sorted(self.saved), (listed, sorted(self.saved))
    for step in listed:
      tag, changed = self.saved[step]
      got = ofx.restore(self.mngr.step_path(step))
      assert _equal(got, _items(tag, changed)), step

  def teardown(self):
    if self.mngr is not None:
      self.mngr.close()


def _run(directory: str, differential: bool, examples: int, kills: bool) -> None:
  machine = type("Case", (ManagerModel,), {"directory": directory, "differential": differential,
                                           "kills": kills})
  commit = saving.commit

  def gated(*args, **kwargs):
    assert _GATE.wait(120), "a commit held at the gate for 2 minutes"
    return commit(*args, **kwargs)
  saving.commit = gated  # the real commit, after the gate
  try:
    hypothesis.stateful.run_state_machine_as_test(machine, settings=hypothesis.settings(
        max_examples=examples, stateful_step_count=12 if not LONG else 16, deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck), derandomize=not LONG,
        database=None))
  finally:
    saving.commit = commit
    _GATE.set()


def test_a_rollback_runs_next_save_above_what_it_abandons_does_not_call_it_off(tmp_path):
  """The long run's shortest failure: steps 1-4; restore(1) and a save of 2 held in flight;
  restore(3), which abandons that save and step 4; then saves of 4 and 5 without waiting.
  The save of 5 began while 4, the second rollback's first save, was in flight, and being
  above every step it abandons, it called the rollback off as if the restore had been a
  look: the first rollback's save of 2 stayed listed beside the new run."""
  machine = type("Case", (ManagerModel,), {"directory": str(tmp_path), "differential": False,
                                           "kills": False})
  commit = saving.commit

  def gated(*args, **kwargs):
    assert _GATE.wait(120), "a commit held at the gate for 2 minutes"
    return commit(*args, **kwargs)
  saving.commit = gated
  state = machine()
  try:
    state.start(async_save=True)
    state.burst(ops=["save", "save"])
    state.rollback_again_while_its_save_is_held(first=0, second=1)
    state.every_listed_step_restores_as_saved()
    state.burst(ops=["save", "save"])
    state.every_listed_step_restores_as_saved()
    assert state.mngr.all_steps() == [1, 3, 4, 5]
  finally:
    saving.commit = commit
    _GATE.set()
    state.teardown()


@pytest.mark.parametrize("differential", [False, True])
def test_model_local(tmp_path, differential):
  _run(str(tmp_path), differential, int(1000 * SCALE) if LONG else 25, kills=LONG)


def test_model_local_with_kills(tmp_path):
  """A writer SIGKILLed mid-save, differential on: a few sequences (each kill starts a process)."""
  _run(str(tmp_path), True, int(100 * SCALE) if LONG else 4, kills=True)


def test_model_s3(s3_server):
  bucket = s3_server.new_bucket()
  _run(s3_server.url(bucket, "run"), False, int(300 * SCALE) if LONG else 8, kills=False)
