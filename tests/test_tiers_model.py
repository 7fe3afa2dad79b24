"""A model of what the training callback promises across runs, with and without the local tier.

The promise (``docs/guarantees.md`` sections 5 and 8, ``docs/tiers.md``): a run that
starts resumes from the newest step it may take, whichever tier holds it, with the
state and the data iterator's position that step was saved with; the local tier's step is
taken when it is at least as new as the persistent tier's latest, intact, and of this
lineage (not a copy of a step another save replaced in the persistent tier, nor saved
before a run without the local tier went on from an older persistent step); a damaged
local copy gives way to the next older one, then to the persistent tier.

Operations: runs that start with other settings (the local tier on or off, its interval and
keep count, the persistent interval and keep count, the final save on or off), train some
steps, and end by leaving the ``with`` block, by a preemption signal (SIGTERM, to this
process) or by an exception in the loop; between runs, a local disk lost (a replaced host)
or the newest local copy damaged. Every run's start is checked against the model, and
its first train step runs the user's jitted step on what was restored.

The model: what each tier holds (step -> the state and data position saved, and for the
local tier the persistent step it was saved over, its ``base``), with each tier's keep
rule; which local copies are damaged. One process: the replica exchange and agreement
across processes are tests/test_tiers.py's, with real processes.

A few dozen sequences run in CI (derandomized); ``ORBAX_FLAX_FAULTS=long`` runs more
(``ORBAX_FLAX_MODEL_SCALE`` scales them; the last run is in ``docs/guarantees.md``).
"""

import collections
import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import initialize
from hypothesis.stateful import rule
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_flax as ofx

import jobs

LONG = os.environ.get("ORBAX_FLAX_FAULTS") == "long"
SCALE = float(os.environ.get("ORBAX_FLAX_MODEL_SCALE", "1"))
pytestmark = [pytest.mark.timeout(int(4 * 3600 * max(1.0, SCALE)))] if LONG else []


EVENTS = collections.Counter()  # what the sequences met (printed by the long run)


class Batches:
  """A data iterator: the position is the number of batches taken."""

  def __init__(self):
    self.pos = 0

  def __next__(self):
    self.pos += 1
    return self.pos

  def get_state(self):
    return {"pos": self.pos}

  def set_state(self, s):
    self.pos = int(s["pos"])


@jax.jit
def train_step(state, batch, salt):
  """The user's jitted step: every leaf depends on the whole history (and the run's salt)."""
  return {"w": state["w"] * 3 + batch * salt, "n": state["n"] + salt,
          "step": state["step"] + 1}


def _fresh(mesh) -> dict:
  return jax.jit(lambda: {"w": jnp.zeros((8, 16), jnp.int32), "n": jnp.zeros(3, jnp.int32),
                          "step": jnp.zeros((), jnp.int32)},
                 out_shardings={"w": NamedSharding(mesh, P("x")), "n": NamedSharding(mesh, P()),
                                "step": NamedSharding(mesh, P())})()


@dataclasses.dataclass(frozen=True)
class Saved:
  """What a tier holds of a step: the state's values, the data position, and who saved it."""
  w: bytes
  n: bytes
  pos: int
  save: tuple[int, int]      # (run, step): one save call of one run
  base: int = -1             # local: the newest persistent step (saved or saving) then


def _snap(state, pos: int, save: tuple[int, int], base: int = -1) -> Saved:
  return Saved(np.asarray(state["w"]).tobytes(), np.asarray(state["n"]).tobytes(), pos, save,
               base)


def _step_np(state: dict, batch: int, salt: int) -> dict:
  """:func:`train_step` in numpy (int32 wraps alike): the states a killed run saved."""
  with np.errstate(over="ignore"):
    return {"w": state["w"] * np.int32(3) + np.int32(batch) * np.int32(salt),
            "n": state["n"] + np.int32(salt), "step": np.int32(state["step"] + 1)}


def _newest(steps: set[int], keep: int) -> set[int]:
  return set(sorted(steps)[-keep:]) if keep else set(steps)


def _committed_steps(directory: str, marker: str) -> set[int]:
  """The steps committed in ``directory`` (docs/format.md: a step is committed by its
  ``_CHECKPOINT``, a local step by its ``COMMITTED``)."""
  try:
    names = os.listdir(directory)
  except FileNotFoundError:
    return set()
  return {int(n) for n in names if n.isdigit()
          and os.path.exists(os.path.join(directory, n, marker))}


_KILL_WORKER = r"""
import json, sys, time
args = json.loads(sys.argv[1])
sys.path.insert(0, args["tests"])
import jax, jax.numpy as jnp, numpy as np
import orbax_flax as ofx
import test_tiers_model as m
mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
data = m.Batches()
ckpt = ofx.CheckpointCallback(args["dir"], ofx.CheckpointPolicy(**args["policy"]))
state = ckpt.restore_or_init(m._fresh(mesh), data_iterator=data)
print("RESTORED", json.dumps({"step": ckpt.restored_step, "w": np.asarray(state["w"]).tolist(),
                              "n": np.asarray(state["n"]).tolist(), "s": int(state["step"]),
                              "pos": data.pos}), flush=True)
step = ckpt.restored_step or 0
for _ in range(args["steps"]):
  step += 1
  state = m.train_step(state, jnp.int32(next(data)), jnp.int32(args["salt"]))
  ckpt.on_step_end(step, state)
  print("STEP", step, flush=True)
  sys.stdin.readline()  # the test's go: it reads each step before the next one runs
print("DONE", flush=True)
time.sleep(600)  # killed
"""


class TiersModel(RuleBasedStateMachine):
  """The model: ``persistent`` and ``local`` (step -> :class:`Saved`), ``damaged`` local steps."""

  workdir = ""  # set per case
  kills = False  # whether runs may be SIGKILLed (each starts a process)

  def __init__(self):
    super().__init__()
    self.persistent: dict[int, Saved] = {}
    self.local: dict[int, Saved] = {}
    self.damaged: set[int] = set()
    # Every save made (the newest of each step number): what a killed run's listing may hold.
    self.persistent_all: dict[int, Saved] = {}
    self.local_all: dict[int, Saved] = {}
    self.ckpt = None
    self.runs = 0
    self.mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

  # ------------------------------------------------------------------ the model's answers

  def _expected(self, local_on: bool) -> tuple[int | None, bool]:
    got = self._choose(local_on)
    newest = max(self.persistent, default=None)
    EVENTS["resumed from the local tier" if got[1] else "resumed from the persistent tier"
           if got[0] is not None else "started from scratch"] += 1
    if got[1] and got[0] != newest:
      EVENTS["a local step newer than the persistent tier's"] += 1
    return got

  def _choose(self, local_on: bool) -> tuple[int | None, bool]:
    """The step a run resumes, and whether from the local tier: a local step of this lineage
    at least as new as the persistent tier's newest (of the same save, if of its number), the
    newest intact one; else the persistent tier's newest."""
    newest = max(self.persistent, default=None)
    if local_on:
      for s in sorted(self.local, reverse=True):
        rec = self.local[s]
        if newest is not None and s < newest:
          continue
        if s in self.damaged:
          EVENTS["a damaged local step passed over"] += 1
          continue
        if s == newest and rec.save != self.persistent[s].save:
          EVENTS["a local copy of another save of the persistent step passed over"] += 1
          continue  # the persistent tier holds another save of that step number
        if any(rec.base < p < s for p in self.persistent):
          EVENTS["a local step of another lineage passed over"] += 1
          continue  # saved before a run without the local tier went on from its base
        return s, True
    return newest, False

  # ------------------------------------------------------------------ runs

  @initialize()
  def first(self):
    self.dir = tempfile.mkdtemp(prefix="run-", dir=self.workdir)  # a new one per sequence
    self.local_dir = self.dir + "-local"

  @rule(local_every=st.sampled_from([0, 1, 2, 3]), local_keep=st.sampled_from([1, 2]),
        every=st.sampled_from([2, 3, 5, 8]), keep=st.sampled_from([1, 2, 0]),
        final=st.booleans(), steps=st.integers(0, 12),
        end=st.sampled_from(["stop", "stop", "preempted", "exception", "killed"]),
        kill_after=st.integers(0, 12),
        then=st.sampled_from(["", "", "", "local_disk_lost", "newest_local_copy_damaged"]))
  def run(self, local_every, local_keep, every, keep, final, steps, end, kill_after, then):
    """A run: starts with these settings (checked against the model), trains ``steps`` steps
    through the callback and ends as ``end`` says; a killed run is a process of its own,
    SIGKILLed once it reported ``kill_after`` steps. Then, perhaps, what befalls a disk.
    (One rule: hypothesis chooses among rules evenly, and runs are what the model is about.)"""
    self._run(local_every, local_keep, every, keep, final, steps, end, kill_after)
    if then:
      getattr(self, then)()

  def _run(self, local_every, local_keep, every, keep, final, steps, end, kill_after):
    self.runs += 1
    self.salt = self.runs
    self.local_on = local_every > 0
    self.local_every, self.local_keep = local_every, local_keep
    self.every, self.keep, self.final = every, keep, final
    if end == "killed" and self.kills:
      self._killed(steps, min(kill_after, steps))
      return
    end = "stop" if end == "killed" else end  # (a case without kills)
    self.data = Batches()
    self.ckpt = ofx.CheckpointCallback(self.dir, self._policy())
    try:
      self.state = self.ckpt.restore_or_init(_fresh(self.mesh), data_iterator=self.data)
      self._check_restored(self.ckpt.restored_step, self.state, self.data.pos)
      for _ in range(steps):
        assert not self._train_one(), "a preemption nobody signalled"
      getattr(self, "_" + end)()
    finally:
      self.ckpt = None

  def _policy(self) -> ofx.CheckpointPolicy:
    return ofx.CheckpointPolicy(**self._policy_args())

  def _policy_args(self) -> dict:
    return dict(save_interval_steps=self.every, max_to_keep=self.keep, save_final_step=self.final,
                local_directory=self.local_dir if self.local_on else "",
                local_save_interval_steps=self.local_every, local_max_to_keep=self.local_keep)

  def _killed(self, steps: int, kill_after: int) -> None:
    """The run in a process of its own, SIGKILLed after its ``kill_after``-th step: the save
    in flight then (persistent, or the next step's, local or persistent) may have committed
    or not; every other step the model holds must still be there, and the listing then is
    what the next run must resume from."""
    args = dict(tests=os.path.dirname(os.path.abspath(__file__)), dir=self.dir,
                policy=self._policy_args(), steps=steps, salt=self.salt)
    # The process waits for a go after each step: at the kill it is in the step after the
    # last one read, or before it, never further (it ran on unread under load: CI saw a
    # local step three steps past the model's, which the model took for a lost one).
    proc = subprocess.Popen([sys.executable, "-c", _KILL_WORKER, json.dumps(args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=jobs.env_for(8))
    try:
      kind, _, payload = proc.stdout.readline().partition(" ")
      assert kind == "RESTORED", f"the killed run's process ended: {kind}{payload}"
      r = json.loads(payload)
      state = {"w": np.array(r["w"], np.int32), "n": np.array(r["n"], np.int32),
               "step": np.int32(r["s"])}
      self._check_restored(r["step"], state, r["pos"])
      pos = r["pos"]
      before_last = dict(self.persistent)  # without the newest persistent save: in flight?
      for _ in range(kill_after):
        line = proc.stdout.readline()
        assert line.split() == ["STEP", str(self.step + 1)], line
        proc.stdin.write("go\n")
        proc.stdin.flush()
        self.step, pos = self.step + 1, pos + 1
        state = _step_np(state, pos, self.salt)
        if self.step % self.every == 0:
          before_last = dict(self.persistent)
        self._record(state, pos, max(self.persistent, default=-1))
      proc.send_signal(signal.SIGKILL)
    finally:
      proc.kill()
      proc.wait()
      proc.stdout.close()
      proc.stdin.close()
    # What storage may hold: the newest persistent save committed or not; the next step's
    # saves (the one on_step_end was in when the process died) begun, or not.
    persistent_models = [set(before_last), set(self.persistent)]
    local_models = [set(self.local)]
    if kill_after < steps:
      self.step, pos = self.step + 1, pos + 1
      state = _step_np(state, pos, self.salt)
      save = (self.runs, self.step)
      if self.local_on and self.step % self.local_every == 0:
        self.local_all[self.step] = _snap(state, pos, save, max(self.persistent, default=-1))
        local_models.append(_newest(set(self.local) | {self.step}, self.local_keep))
      if self.step % self.every == 0:
        self.persistent_all[self.step] = _snap(state, pos, save)
        persistent_models.append(_newest(set(self.persistent) | {self.step}, self.keep))
    listed = _committed_steps(os.path.join(self.dir, "checkpoints"), "_CHECKPOINT")
    self._reconcile("persistent", listed, persistent_models, set(self.persistent_all))
    self.persistent = {s: self.persistent_all[s] for s in listed}
    if self.local_on:
      runs = glob.glob(os.path.join(self.local_dir, "run-*", "process_0"))
      listed = _committed_steps(runs[0], "COMMITTED") if runs else set()
      self._reconcile("local", listed, local_models, set(self.local_all))
      self.local = {s: self.local_all[s] for s in listed}
      self.damaged &= listed

  @staticmethod
  def _reconcile(tier: str, listed: set[int], models: list[set[int]], made: set[int]) -> None:
    """No step lost, none made up: some outcome of the kill's is all listed (with steps its
    keep rules had not deleted yet beside it), and nothing listed that no save made."""
    assert any(m <= listed for m in models), (
        f"after the kill the {tier} tier lists {sorted(listed)}; it must hold one of"
        f" {[sorted(m) for m in models]}: a committed step was lost")
    assert listed <= made, f"the {tier} tier lists steps no save made: {sorted(listed - made)}"
    EVENTS[f"killed: the {tier} tier holds outcome"
           f" {max(i for i, m in enumerate(models) if m <= listed) + 1} of {len(models)}"] += 1

  def _check_restored(self, got: int | None, state, pos: int) -> None:
    """A run's start: the step resumed, its state and data position, against the model."""
    want, from_local = self._expected(self.local_on)
    assert got == want, (f"resumed step {got}, the model says {want}: persistent"
                         f" {sorted(self.persistent)}, local {sorted(self.local)} (damaged"
                         f" {sorted(self.damaged)}), local tier {'on' if self.local_on else 'off'}")
    self.step = 0 if want is None else want
    if want is not None:
      saved = self.local[want] if from_local else self.persistent[want]
      assert np.asarray(state["w"]).tobytes() == saved.w, f"step {want}'s w"
      assert np.asarray(state["n"]).tobytes() == saved.n, f"step {want}'s n"
      assert pos == saved.pos, (pos, saved.pos)
      assert int(state["step"]) == want
      # What no restore can take any more is removed: the local steps above the one resumed
      # (from the local tier), or from the persistent tier's newest up (when it is resumed).
      if self.local_on:
        for s in [s for s in self.local if s > want or (s == want and not from_local)]:
          del self.local[s]
          self.damaged.discard(s)

  def _train_one(self) -> bool:
    """One step through the callback (the user's jitted step on what was restored first);
    True if it was the preemption's."""
    self.step += 1
    base = max(self.persistent, default=-1)  # the local step's, saved before the persistent
    self.state = train_step(self.state, jnp.int32(next(self.data)), jnp.int32(self.salt))
    preempted = self.ckpt.on_step_end(self.step, self.state)
    self._record(self.state, self.data.pos, base, preempted)
    return preempted

  def _record(self, state, pos: int, base: int, preempted: bool = False) -> None:
    """The model's side of ``on_step_end(self.step, state)`` returning."""
    save = (self.runs, self.step)
    if self.local_on and (preempted or self.step % self.local_every == 0):
      self.local[self.step] = self.local_all[self.step] = _snap(state, pos, save, base)
      self.damaged.discard(self.step)
      for s in sorted(self.local)[:-self.local_keep]:  # each keeps its newest
        del self.local[s]
        self.damaged.discard(s)
    if preempted or self.step % self.every == 0:
      self._persistent(save, state, pos)

  def _persistent(self, save: tuple[int, int], state=None, pos=None) -> None:
    state, pos = (self.state, self.data.pos) if state is None else (state, pos)
    self.persistent[self.step] = self.persistent_all[self.step] = _snap(state, pos, save)
    if self.keep:
      for s in sorted(self.persistent)[:-self.keep]:
        del self.persistent[s]

  def _final_save(self) -> tuple[int, int]:
    """The save of the run's last step at its end (final or exception): it records this run's
    local copy of the same step, if there is one (a resume may take either: the same save)."""
    local = self.local.get(self.step)
    if local is not None and local.save[0] == self.runs:
      return local.save
    return (self.runs, self.step)

  def _stop(self):
    """The loop ends: leaving the ``with`` block saves the last step if the policy wants it."""
    self.ckpt.close()
    if self.final and self.step and self.step not in self.persistent:
      self._persistent(self._final_save())

  def _preempted(self):
    """SIGTERM: the next step saves (local tier first, then the persistent one) and stops."""
    os.kill(os.getpid(), signal.SIGTERM)
    assert self._train_one(), "on_step_end did not report the preemption"
    self.ckpt.close()

  def _exception(self):
    """An error in the loop: the ``with`` block's exit saves the last step (save_on_exception)."""
    with pytest.raises(ZeroDivisionError):
      with self.ckpt:
        raise ZeroDivisionError("the user's loop")
    if self.step and self.step not in self.persistent:
      self._persistent(self._final_save())

  def local_disk_lost(self):
    """The host was replaced: its local directory is gone."""
    shutil.rmtree(self.local_dir, ignore_errors=True)
    self.local.clear()
    self.damaged.clear()

  def newest_local_copy_damaged(self):
    """A byte of the newest local copy's data flipped (a bad disk, a bad DIMM)."""
    if not self.local or max(self.local) in self.damaged:
      return  # (a second flip of the same byte would mend it)
    s = max(self.local)
    (run,) = os.listdir(self.local_dir)
    path = os.path.join(self.local_dir, run, "process_0", str(s), "own.blob")
    assert os.path.exists(path), f"local step {s}, which the model holds, is gone: {path}"
    with open(path, "r+b") as f:
      size = f.seek(0, os.SEEK_END)
      f.seek(size - 64)  # in the data, past the sealed index at the start
      b = f.read(1)
      f.seek(size - 64)
      f.write(bytes([b[0] ^ 0x40]))
    self.damaged.add(s)

  def teardown(self):
    try:
      if self.ckpt is not None:
        self.ckpt.close()
    finally:
      signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run(workdir: str, examples: int, kills: bool) -> None:
  machine = type("Case", (TiersModel,), {"workdir": workdir, "kills": kills})
  hypothesis.stateful.run_state_machine_as_test(machine, settings=hypothesis.settings(
      max_examples=examples, stateful_step_count=10 if not LONG else 14, deadline=None,
      suppress_health_check=list(hypothesis.HealthCheck), derandomize=not LONG,
      database=None))


def _met(before: collections.Counter, *what: str) -> None:
  """The sequences met what the test is about (derandomized CI sequences could stay short)."""
  met = EVENTS - before
  if LONG:
    print(dict(met))
  for w in what:
    assert any(k.startswith(w) for k in met), (w, dict(met))


def test_model_tiers(tmp_path):
  before = EVENTS.copy()
  _run(str(tmp_path), int(400 * SCALE) if LONG else 15, kills=False)
  _met(before, "resumed from the local tier", "a local step newer", "a damaged local step")


def test_model_tiers_with_kills(tmp_path):
  """Runs SIGKILLed at any step too: fewer sequences in CI (each kill starts a process)."""
  before = EVENTS.copy()
  _run(str(tmp_path), int(100 * SCALE) if LONG else 5, kills=True)
  _met(before, "killed: the persistent tier", "killed: the local tier")
