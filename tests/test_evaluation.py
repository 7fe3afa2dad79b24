"""The evaluator iterator beside a live training job, and the cost-driven save interval."""

import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import jobs
import orbax_flax as ofx
from disks import small_disk
from orbax_flax.manager import policy as policy_lib


def test_iterator_yields_each_step_once_in_order(tmp_path):
  d = str(tmp_path)
  for s in (3, 1, 2):
    ofx.save(os.path.join(d, str(s)), {"s": {"w": np.full(2, s)}})
  seen = []
  for step in ofx.checkpoints_iterator(d, timeout=0):
    seen.append(step)
    if step == 2:
      ofx.save(os.path.join(d, "7"), {"s": {"w": np.full(2, 7)}})  # appears while iterating
  assert seen == [1, 2, 3, 7]
  assert list(ofx.checkpoints_iterator(d, timeout=0, start_after=3)) == [7]


def test_iterator_timeout_fn_keeps_waiting_until_it_says_no_step_will_come(tmp_path):
  """Orbax's and TensorFlow's meaning: True ends the iterator, False waits again (the
  opposite meaning made an evaluator ported from Orbax wait forever once training was done)."""
  t = [0.0]
  calls = []

  def trainer_done():  # done at the third timeout
    calls.append(t[0])
    return len(calls) >= 3

  out = list(ofx.checkpoints_iterator(str(tmp_path), timeout=5, poll_interval=1,
                                      timeout_fn=trainer_done, clock=lambda: t[0],
                                      sleep=lambda s: t.__setitem__(0, t[0] + s)))
  assert out == [] and len(calls) == 3 and calls[-1] >= 15


def test_iterator_timeout_fn_true_ends_after_the_steps_committed_by_then(tmp_path):
  d = str(tmp_path)
  ofx.save(os.path.join(d, "1"), {"s": {"w": np.ones(2)}})
  assert list(ofx.checkpoints_iterator(d, timeout=0, timeout_fn=lambda: True)) == [1]

  def last_step_then_done():  # the trainer's last step commits just before it is done
    if not os.path.exists(os.path.join(d, "2")):
      ofx.save(os.path.join(d, "2"), {"s": {"w": np.ones(2)}})
    return True

  assert list(ofx.checkpoints_iterator(d, timeout=0, start_after=1,
                                       timeout_fn=last_step_then_done)) == [2]


def test_iterator_on_a_directory_that_does_not_exist_yet_says_so(tmp_path, caplog):
  d = str(tmp_path / "run" / "checkpoints")
  t = [0.0]

  def fake_sleep(s):
    t[0] += s

  with caplog.at_level(logging.INFO, logger="orbax_flax"):
    out = list(ofx.checkpoints_iterator(d, timeout=5, poll_interval=1, clock=lambda: t[0],
                                        sleep=fake_sleep))
  assert out == []
  warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warned) == 2, warned  # once when it starts waiting, once when it gives up
  assert f"{d} does not exist yet; waiting" in warned[0] and "timeout 5 s" in warned[0]
  assert f"stopping after waiting 5 s: {d} still does not exist" in warned[1]
  caplog.clear()

  def trainer_starts_at_3_s(s):  # the directory appears while the iterator waits
    fake_sleep(s)
    if t[0] >= 3 and not os.path.exists(d):
      ofx.save(os.path.join(d, "10"), {"s": {"w": np.ones(2)}})

  t[0] = 0.0
  with caplog.at_level(logging.INFO, logger="orbax_flax"):
    out = list(ofx.checkpoints_iterator(d, timeout=5, poll_interval=1, clock=lambda: t[0],
                                        sleep=trainer_starts_at_3_s))
  assert out == [10]
  warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warned) == 1 and "does not exist yet" in warned[0], warned  # and not at the end


def test_iterator_on_a_workdir_names_its_checkpoints_directory(tmp_path, caplog):
  """checkpoints_iterator(workdir) waited forever without a word: the WARNING that names
  <workdir>/checkpoints was given only when the directory did not exist."""
  workdir = str(tmp_path / "run")
  for step in (1, 2):
    ofx.save(os.path.join(workdir, "checkpoints", str(step)), {"s": {"w": np.ones(2)}})
  t = [0.0]
  with caplog.at_level(logging.INFO, logger="orbax_flax"):
    out = list(ofx.checkpoints_iterator(workdir, timeout=5, poll_interval=1, clock=lambda: t[0],
                                        sleep=lambda s: t.__setitem__(0, t[0] + s)))
  assert out == []
  warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  inner = os.path.join(workdir, "checkpoints")
  assert len(warned) == 2, warned  # when it starts waiting (not every poll), and at the end
  assert f"{workdir} holds no step, but {inner} does: is it a workdir?" in warned[0]
  assert f"pass the directory the manager saves to: {inner}." in warned[0]
  assert f"stopping after waiting 5 s: {workdir} still holds no step, but {inner}" in warned[1]
  assert list(ofx.checkpoints_iterator(inner, timeout=0)) == [1, 2]


def test_iterator_on_an_empty_directory_looks_at_its_checkpoints_once_a_minute(
    tmp_path, monkeypatch, caplog):
  """An evaluator waiting on an empty manager directory listed <directory>/checkpoints at
  every poll too (a second request per poll on an object store); it looks once a minute, and
  still names a workdir's checkpoints/ once a job has saved there."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  inner = str(workdir / "checkpoints")
  looked = []
  listdir = os.listdir
  monkeypatch.setattr(os, "listdir", lambda p=".": (looked.append(str(p)), listdir(p))[1])
  t = [0.0]

  def sleep(s):
    t[0] += s
    if t[0] >= 100 and not os.path.isdir(inner):  # a job starts saving into the workdir
      ofx.save(os.path.join(inner, "1"), {"s": {"w": np.ones(2)}})

  with caplog.at_level(logging.INFO, logger="orbax_flax"):
    out = list(ofx.checkpoints_iterator(str(workdir), timeout=200, poll_interval=1,
                                        clock=lambda: t[0], sleep=sleep))
  assert out == []
  own = sum(1 for p in looked if p.rstrip("/") == str(workdir))
  nested = sum(1 for p in looked if p.rstrip("/") == inner)
  assert own >= 190 and nested <= 5, (own, nested)  # at 0, 60, 120 (then it holds steps)
  warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any(f"holds no step, but {inner} does: is it a workdir?" in w for w in warned), warned


def test_a_held_step_is_not_deleted_by_retention(tmp_path, caplog):
  d = str(tmp_path / "ckpts")
  mngr = ofx.CheckpointManager(d, ofx.CheckpointPolicy(save_interval_steps=1, max_to_keep=1,
                                                       async_save=False))
  mngr.save(1, {"s": {"w": np.ones(4)}})
  it = ofx.checkpoints_iterator(d, timeout=0)
  assert next(it) == 1
  with caplog.at_level(logging.INFO, logger="orbax_flax"):
    for step in (2, 3):
      mngr.save(step, {"s": {"w": np.full(4, step)}})
    mngr.wait()
  assert os.path.isdir(os.path.join(d, "1")), "deleted while the evaluator held it"
  assert "an evaluator holds a reader lease" in caplog.text
  np.testing.assert_array_equal(ofx.restore(os.path.join(d, "1"))["s"]["w"], np.ones(4))
  assert next(it) == 3  # released 1; 2 was deleted by retention meanwhile: skipped
  mngr.save(4, {"s": {"w": np.full(4, 4)}})
  mngr.wait()
  assert not os.path.exists(os.path.join(d, "1"))  # the released lease lets the deletion happen
  mngr.close()


def test_after_a_rollback_the_iterator_yields_the_new_runs_steps_at_numbers_it_had_yielded(
    tmp_path):
  """A rollback's new run saves again at step numbers an evaluator already yielded from the run
  it abandoned. The iterator compared numbers only: it yielded 6 and 7, never the new 4 and 5,
  so the evaluator never evaluated two committed steps of the run that went on."""
  d = str(tmp_path / "ckpts")
  policy = ofx.CheckpointPolicy(save_interval_steps=1)
  with ofx.CheckpointManager(d, policy) as trainer:
    for step in range(1, 6):
      trainer.save(step, {"s": {"w": np.full(2, step)}})
  it = ofx.checkpoints_iterator(d, timeout=0)
  seen = [(next(it), None) for _ in range(5)]
  assert [s for s, _ in seen] == [1, 2, 3, 4, 5]
  with ofx.CheckpointManager(d, policy) as trainer:  # the job restarts and rolls back to 3
    trainer.restore(3)
    for step in range(4, 8):
      trainer.save(step, {"s": {"w": np.full(2, -step)}})
  rest = [(step, int(ofx.restore(os.path.join(d, str(step)))["s"]["w"][0])) for step in it]
  assert rest == [(4, -4), (5, -5), (6, -6), (7, -7)]


def test_a_rollback_committed_while_the_iterator_polls_is_yielded_too(tmp_path):
  """The iterator released the last yielded step's lease at every listing, also while it
  waited: a rollback committed then deleted that step at once, the iterator forgot it, and
  the new run's steps at numbers it had yielded (4 and 5 here) were never yielded."""
  d = str(tmp_path / "ckpts")
  policy = ofx.CheckpointPolicy(save_interval_steps=1, async_save=False)
  with ofx.CheckpointManager(d, policy) as trainer:
    for step in range(1, 6):
      trainer.save(step, {"s": {"w": np.full(2, step)}})
  it = ofx.checkpoints_iterator(d, timeout=3, poll_interval=0.05)
  assert [next(it) for _ in range(5)] == [1, 2, 3, 4, 5]

  def train_on():  # while the evaluator waits for step 6
    time.sleep(0.5)
    with ofx.CheckpointManager(d, policy) as trainer:
      trainer.restore(3)
      trainer.save(4, {"s": {"w": np.full(2, -4)}})
      time.sleep(0.5)  # the evaluator lists the directory meanwhile
      for step in (5, 6):
        trainer.save(step, {"s": {"w": np.full(2, -step)}})

  trainer_thread = threading.Thread(target=train_on)
  trainer_thread.start()
  rest = [(step, int(ofx.restore(os.path.join(d, str(step)))["s"]["w"][0])) for step in it]
  trainer_thread.join()
  assert rest == [(4, -4), (5, -5), (6, -6)]


def test_an_evaluators_manager_restoring_a_step_the_trainer_deleted_says_so(tmp_path):
  """A reader's listing is as of its last look: a step listed there, deleted since by the
  training job's keep rule, failed with "the path does not exist" (on S3: "check the bucket
  name"), as if the user had named a wrong directory."""
  d = str(tmp_path / "ckpts")
  evaluator = ofx.CheckpointManager(d)
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(save_interval_steps=1, max_to_keep=2,
                                                     async_save=False)) as trainer:
    for step in (1, 2):
      trainer.save(step, {"s": {"w": np.full(2, step)}})
    evaluator.reload()
    assert evaluator.latest_step() == 2
    for step in (3, 4):
      trainer.save(step, {"s": {"w": np.full(2, step)}})
  with pytest.raises(ofx.CheckpointNotFoundError,
                     match=r"step 2 .* has since been deleted.*keep rules.*committed now: \[3, 4\]"
                           r".*checkpoints_iterator"):
    evaluator.restore(2)
  assert int(evaluator.restore(4)["s"]["w"][0]) == 4
  evaluator.close()


class _RunsOnLogLine(logging.Handler):
  """Runs ``action`` (once) when the orbax_flax logger emits ``message``: a public hook
  into the exact moment a manager logs a decision, from the thread that made it."""

  def __init__(self, message, action):
    super().__init__(logging.INFO)
    self.message, self.action, self.results, self.error = message, action, [], None

  def emit(self, record):
    if record.getMessage() == self.message and not self.results and self.error is None:
      try:
        self.results.append(self.action())
      except Exception as e:  # pylint: disable=broad-except  # re-raised by the test
        self.error = e


@pytest.mark.parametrize("store", ["local", "s3"])
def test_an_evaluator_leasing_while_retention_deletes_never_gets_the_deleted_step(
    tmp_path, caplog, request, store):
  """The window of the reader-lease protocol, forced: the evaluator takes its lease after
  the manager has looked at the leases and before it deletes the step (the manager's log
  line of that deletion runs the evaluator)."""
  if store == "s3":
    server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
    d = f"s3://{bucket}/ckpts"

    def left():  # everything under the directory: steps, leases, notices
      resp = server.client().list_objects_v2(Bucket=bucket, Prefix="ckpts/")
      return sorted({o["Key"].split("/")[1] for o in resp.get("Contents", [])})
  else:
    d = str(tmp_path / "ckpts")

    def left():
      return sorted(os.listdir(d))
  mngr = ofx.CheckpointManager(d, ofx.CheckpointPolicy(max_to_keep=1, async_save=False))
  mngr.save(1, {"s": {"w": np.ones(3)}}, force=True)
  it = ofx.checkpoints_iterator(d, timeout=0)
  hook = _RunsOnLogLine("deleting checkpoint step 1 (no keep rule keeps it)", lambda: next(it))
  logger = logging.getLogger("orbax_flax")
  logger.addHandler(hook)
  try:
    with caplog.at_level(logging.INFO, logger="orbax_flax"):
      mngr.save(2, {"s": {"w": np.full(3, 2.0)}}, force=True)  # retention deletes step 1
      mngr.wait()
  finally:
    logger.removeHandler(hook)
  if hook.error is not None:
    raise hook.error
  assert hook.results, "the manager did not delete step 1"
  step = hook.results[0]
  # The step handed over is readable for as long as the evaluator holds it...
  np.testing.assert_array_equal(ofx.restore(f"{d}/{step}")["s"]["w"], np.full(3, step))
  assert step == 2 and "step 1 is being deleted" in caplog.text  # 1 was skipped, with a word
  mngr.save(3, {"s": {"w": np.full(3, 3.0)}}, force=True)
  mngr.wait()
  np.testing.assert_array_equal(ofx.restore(f"{d}/2")["s"]["w"], np.full(3, 2.0))
  it.close()  # ...and released when it is done
  mngr.save(4, {"s": {"w": np.full(3, 4.0)}}, force=True)
  mngr.close()
  # No lease, no deletion notice, no .readers left behind (an object store keeps its step
  # index, docs/format.md, naming step 4 alone).
  assert left() == (["4", "_steps"] if store == "s3" else ["4"])
  if store == "s3":
    assert server.keys(bucket, "ckpts/_steps/") == ["ckpts/_steps/4"]


def test_evaluator_beside_a_live_training_job_with_max_to_keep_1(tmp_path):
  d = str(tmp_path / "ckpts")
  trainer = textwrap.dedent(f"""
      import time, numpy as np, orbax_flax as ofx
      m = ofx.CheckpointManager({d!r}, ofx.CheckpointPolicy(save_interval_steps=1, max_to_keep=1))
      for step in range(1, 41):
          m.save(step, {{"s": {{"w": np.full((256, 256), step, np.float32)}}}})
          time.sleep(0.05)
      m.close()
      open({d!r} + ".done", "w").close()
  """)
  p = subprocess.Popen([sys.executable, "-c", trainer], env=jobs.env_for(1), cwd=jobs.ROOT)
  evaluated = []
  try:
    for step in ofx.checkpoints_iterator(d, timeout=2, poll_interval=0.02,
                                         timeout_fn=lambda: os.path.exists(d + ".done")):
      time.sleep(0.1)  # a slow evaluation: retention would have deleted the step by now
      w = ofx.restore(os.path.join(d, str(step)))["s"]["w"]
      assert (w == step).all()
      evaluated.append(step)
  finally:
    assert p.wait(timeout=120) == 0
  assert len(evaluated) >= 5 and evaluated == sorted(set(evaluated)), evaluated
  assert evaluated[-1] == 40


def _tree(root):
  """Every path under ``root`` with its size and mtime: what a reader must not change."""
  out = {}
  for where, dirs, files in os.walk(root):
    for name in dirs + files:
      st = os.stat(os.path.join(where, name))
      out[os.path.relpath(os.path.join(where, name), root)] = (st.st_size, st.st_mtime_ns)
  return out


def _read_only_steps(disk):
  """Steps 1 and 2 in ``<disk>/ckpts``, then ``disk`` remounted read-only (chmod would not stop
  root, who runs the tests)."""
  d = os.path.join(disk, "ckpts")
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(save_interval_steps=1)) as m:
    for step in (1, 2):
      m.save(step, {"s": {"w": np.full(2, step)}})
  subprocess.run(["mount", "-o", "remount,ro", disk], check=True)
  return d


def test_an_iterator_that_may_not_write_reads_without_a_lease_after_one_warning(tmp_path, caplog):
  """The reader lease could not be written in a read-only directory (a read-only mount, a
  viewer role on a bucket): the iterator died with StorageError at its first step, while
  ofx.restore read the same step fine."""
  with small_disk(str(tmp_path / "disk"), "4m") as disk:
    d = _read_only_steps(disk)
    before = _tree(disk)
    with caplog.at_level(logging.WARNING, logger="orbax_flax"):
      seen = [(step, int(ofx.restore(os.path.join(d, str(step)))["s"]["w"][0]))
              for step in ofx.checkpoints_iterator(d, timeout=0)]
    assert seen == [(1, 1), (2, 2)]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "cannot write a reader lease" in warned[0], warned
    assert "not protected from the training job's keep rules" in warned[0]
    assert _tree(disk) == before


def test_an_evaluators_manager_built_before_the_steps_restores_each_yielded_step(tmp_path):
  """restore(step) checked the listing taken when the manager was built: every step the
  iterator yielded was 'not a committed checkpoint ... committed steps: []'."""
  d = str(tmp_path / "ckpts")
  evaluator = ofx.CheckpointManager(d)  # built once, before the trainer saves anything
  restored = []
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(save_interval_steps=1)) as trainer:
    for step in (1, 2):
      trainer.save(step, {"s": {"w": np.full(2, step)}})
    trainer.wait()
    for step in ofx.checkpoints_iterator(d, timeout=0):
      restored.append(int(evaluator.restore(step)["s"]["w"][0]))
    trainer.save(3, {"s": {"w": np.full(2, 3)}})
    trainer.wait()
    assert int(evaluator.restore(3)["s"]["w"][0]) == 3
  assert restored == [1, 2]
  with pytest.raises(ofx.CheckpointNotFoundError, match=r"step 7 is not a committed checkpoint"
                     r" .*committed steps: \[1, 2, 3\]"):
    evaluator.restore(7)
  evaluator.close()


# ------------------------------------------------------------------ save_interval="auto"


def test_young_daly_interval_follows_the_measured_cost():
  auto = policy_lib.YoungDaly(mtbf_seconds=3600.0)
  assert auto.interval(None) == pytest.approx((2 * 1.0 * 3600) ** 0.5)  # 1 s assumed
  for cost in (0.5, 2.0, 8.0):
    interval = auto.interval(cost)
    assert interval == pytest.approx((2 * cost * 3600) ** 0.5)
    state = lambda now: policy_lib.SaveState(100, now, 90, 1000.0, save_cost=cost)  # noqa: E731
    assert auto(state(1000.0 + interval - 0.01)) is None
    assert auto(state(1000.0 + interval)) == "auto"


def test_manager_auto_interval_from_its_own_saves(tmp_path):
  t = [0.0]
  policy = ofx.CheckpointPolicy(save_interval="auto", mtbf_seconds=7200.0, async_save=False)
  mngr = ofx.CheckpointManager(str(tmp_path), policy, clock=lambda: t[0])
  saved = []
  for step in range(1, 2000):
    t[0] += 1.0  # one second per step
    if mngr.save(step, {"s": {"w": np.full(8, step)}}):
      saved.append((step, mngr.save_cost()))
  assert len(saved) >= 3
  # The first save comes after the assumed-cost interval; later ones after the
  # interval the measured cost gives (costs are milliseconds here: short intervals).
  assert saved[0][0] == int(np.ceil((2 * 1.0 * 7200) ** 0.5))
  for (prev, cost), (step, _) in zip(saved, saved[1:]):
    assert step - prev == pytest.approx((2 * cost * 7200) ** 0.5, abs=1.0 + 0.2 * (step - prev))
  events = mngr.pop_events()
  assert events and all(e.reason == "auto" and e.expected_loss_s > 0 for e in events)
  mngr.close()


def test_auto_interval_needs_an_mtbf_and_plan_shows_the_choice(tmp_path):
  with pytest.raises(ValueError, match=r"save_interval='auto': needs mtbf_seconds"):
    ofx.CheckpointPolicy(save_interval="auto")
  with pytest.raises(ValueError, match=r"save_interval='every': must be one of '', 'auto'"):
    ofx.CheckpointPolicy(save_interval="every")
  r = subprocess.run([sys.executable, "-m", "orbax_flax", "plan", "--config=configs/default.py",
                      "--steps=1000", "--config.checkpoint.save_interval=auto",
                      "--config.checkpoint.mtbf_seconds=3600",
                      "--config.checkpoint.save_interval_steps=0", "--save_cost_seconds=2"],
                     capture_output=True, text=True, cwd=jobs.ROOT, env=jobs.env_for(1),
                     timeout=120, check=False)
  text = r.stdout + r.stderr
  assert r.returncode == 0, text
  assert "every 120.0 s, about every 120 step(s); a failure loses 60.0 s" in text
  assert re.search(r"auto\s+8\s+120, 240, 360, 480, 600, 720, 840, 960", text), text


def test_a_held_step_a_differential_save_replaces_reads_as_it_was_until_that_save_commits(
    tmp_path, monkeypatch):
  """Differential saves; the evaluator holds step 30, which step 40 borrows from; the trainer
  rolls back to 20 and its new run saves step 30. That save parks the old 30 aside
  (``30.ofx-base-<generation>``) while it writes: the evaluator's restore of the step it holds
  failed with CheckpointNotFoundError for the whole save. It now reads the parked step (still
  the committed one), and after the commit the new save."""
  from orbax_flax.engine import saving  # pylint: disable=g-import-not-at-top
  gate, held = threading.Event(), threading.Event()
  commit = saving.commit
  def gated(*args, **kwargs):
    if not gate.is_set():
      held.set()
      assert gate.wait(60)
    return commit(*args, **kwargs)
  monkeypatch.setattr(saving, "commit", gated)
  frozen = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)
  def items(v):
    return {"state": {"base": frozen + (1.0 if v >= 30 else 0.0), "w": np.full(4, v, np.float32)}}
  d = str(tmp_path)
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=True)) as m:
    gate.set()
    for s in (10, 20, 30, 40):
      m.save(s, items(s), force=True)
    m.wait()
    gate.clear()
    evaluator = ofx.checkpoints_iterator(d, timeout=0, start_after=20)
    assert next(evaluator) == 30
    m.restore(20)
    m.save(30, items(-30), force=True)
    assert held.wait(60)  # the new save of 30 is written, its commit held
    assert [n for n in os.listdir(d) if n.startswith("30.ofx-base-")], os.listdir(d)  # parked
    assert ofx.restore(os.path.join(d, "30"))["state"]["w"][0] == 30.0
    assert ofx.metadata(os.path.join(d, "30")).custom["reason"] is not None
    gate.set()
    m.wait()
    assert ofx.restore(os.path.join(d, "30"))["state"]["w"][0] == -30.0
    assert next(evaluator) == 30  # the new save at that number comes next
    evaluator.close()


def test_the_timeout_is_not_overshot_by_a_long_poll_interval(tmp_path):
  """timeout=0.5 with poll_interval=6 (a costly bucket listing) waited a whole poll
  interval, 6 s, before it looked at the clock again: no sleep now goes past the timeout."""
  now, slept = [0.0], []
  def sleep(s):
    slept.append(s)
    now[0] += s
  assert list(ofx.checkpoints_iterator(str(tmp_path), timeout=0.5, poll_interval=6,
                                       clock=lambda: now[0], sleep=sleep)) == []
  assert now[0] == pytest.approx(0.5) and max(slept) <= 0.5, slept


def test_finished_rollbacks_leave_no_records_behind(tmp_path):
  """A loop that goes back to step 20 after each bad step 30, keep-all: each rollback's new
  run saved step 30 again, nothing was deleted, and the records of the finished rollbacks
  (read by every listing and every poll of an evaluator) were kept for the whole run."""
  d = str(tmp_path)
  with ofx.CheckpointManager(d) as m:
    for s in (10, 20, 30):
      m.save(s, {"state": {"w": np.full(4, s, np.float32)}}, force=True)
    m.wait()
    for k in range(5):
      m.restore(20)
      m.save(30, {"state": {"w": np.full(4, -k, np.float32)}}, force=True)
      m.wait()
    assert not os.path.exists(os.path.join(d, ".rollbacks")), open(os.path.join(d, ".rollbacks")).read()
    assert m.all_steps() == [10, 20, 30]


def test_a_dead_writers_deletion_notice_does_not_hide_a_later_save_of_that_step(tmp_path):
  """A writer SIGKILLed between announcing the deletion of step 3 and withdrawing the notice
  (the lifecycle model's long run found it: a rollback abandoned 3, the job was killed while
  deleting it) left .readers/deleting-3 behind; the next writer saved a new step 3, and every
  evaluator skipped it as 'being deleted' for an hour (LEASE_SECONDS). The next writer
  withdraws a dead writer's notices when it becomes the writer."""
  d = str(tmp_path)
  with ofx.CheckpointManager(d) as m:
    for s in (1, 2):
      m.save(s, {"s": {"w": np.full(2, s)}}, force=True)
  os.makedirs(os.path.join(d, ".readers"), exist_ok=True)
  with open(os.path.join(d, ".readers", "deleting-3"), "w") as f:  # what the kill left
    f.write(str(time.time()))
  with ofx.CheckpointManager(d) as m:
    m.save(3, {"s": {"w": np.full(2, 3)}}, force=True)
  assert list(ofx.checkpoints_iterator(d, timeout=0, start_after=2)) == [3]


def test_the_lease_of_a_killed_evaluator_goes_once_it_is_stale(tmp_path):
  """An evaluator SIGKILLed while it held a step left <dir>/.readers/<step>-<token>: ignored
  after an hour, but never removed, one more per killed evaluator for the life of the
  directory, listed (read, on an object store) at every deletion (soak review)."""
  d = str(tmp_path / "ckpts")
  evaluator = ("import sys, time, orbax_flax as ofx\n"
               "for s in ofx.checkpoints_iterator(sys.argv[1], poll_interval=0.05):\n"
               "  print('holding', s, flush=True); time.sleep(600)\n")
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(max_to_keep=1, async_save=False)) as m:
    m.save(1, {"s": {"w": np.ones(2)}}, force=True)
    p = subprocess.Popen([sys.executable, "-c", evaluator, d], stdout=subprocess.PIPE, text=True)
    try:
      assert p.stdout.readline().split() == ["holding", "1"]
    finally:
      p.kill()
      p.wait()
    readers = os.path.join(d, ".readers")
    (lease,) = os.listdir(readers)
    m.save(2, {"s": {"w": np.ones(2)}}, force=True)  # step 1 is leased: kept on storage
    m.wait()
    assert os.path.isdir(os.path.join(d, "1")) and os.listdir(readers) == [lease]
    old = time.time() - 2 * 3600  # an hour and more later: the lease is stale
    os.utime(os.path.join(readers, lease), (old, old))
    m.save(3, {"s": {"w": np.ones(2)}}, force=True)
    m.wait()
    assert m.all_steps() == [3] and [n for n in os.listdir(d) if n[0] != "."] == ["3"]
    assert not os.path.exists(readers) or os.listdir(readers) == []


def test_a_stale_lease_that_cannot_be_removed_does_not_stop_the_keep_rules(tmp_path, caplog):
  """The writer removes a stale reader lease as it deletes; when that removal fails (here
  the lease is a directory: what a failing delete looks like to a root user, whom
  permissions do not stop) the lease is stale all the same: the deletion goes on, and the
  failure is a WARNING, not a StorageError that kept every later deletion from happening."""
  d = str(tmp_path / "ckpts")
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(max_to_keep=1, async_save=False)) as m:
    m.save(1, {"s": {"w": np.ones(2)}}, force=True)
    stuck = os.path.join(d, ".readers", "1-0123456789ab")
    os.makedirs(os.path.join(stuck, "x"))
    old = time.time() - 2 * 3600
    os.utime(stuck, (old, old))
    with caplog.at_level(logging.WARNING, logger="orbax_flax"):
      m.save(2, {"s": {"w": np.full(2, 2)}}, force=True)
      m.wait()
      m.save(3, {"s": {"w": np.full(2, 3)}}, force=True)
      m.wait()
    assert m.all_steps() == [3]
    assert [n for n in os.listdir(d) if n[0] != "."] == ["3"]
  assert "stale reader lease" in caplog.text and "1-0123456789ab" in caplog.text


def test_a_fresh_lease_of_a_reader_whose_clock_is_behind_keeps_its_step(tmp_path):
  """A reader lease was judged by its time against the writer's clock: an evaluator on a host
  (or writing through a file system) whose clock is an hour behind the trainer's had its
  lease, written a second ago, taken for a dead reader's, and the step it read was deleted
  under it. The writer judges a lease by what it sees: stale once unchanged for an hour of
  its own watching, or older than the lease time plus the clock skew allowed."""
  d = str(tmp_path / "ckpts")
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(max_to_keep=1, async_save=False)) as m:
    m.save(1, {"s": {"w": np.ones(2)}}, force=True)
    lease = os.path.join(d, ".readers", "1-0123456789ab")
    os.makedirs(os.path.dirname(lease))
    with open(lease, "w") as f:
      f.write("lease")
    skewed = time.time() - 3700  # its reader's clock: an hour and 100 s behind
    os.utime(lease, (skewed, skewed))
    m.save(2, {"s": {"w": np.full(2, 2)}}, force=True)
    m.wait()
    assert os.path.isdir(os.path.join(d, "1")) and os.path.exists(lease)
    os.remove(lease)  # the evaluator is done with step 1
    m.save(3, {"s": {"w": np.full(2, 3)}}, force=True)
    m.wait()
    assert m.all_steps() == [3] and [n for n in os.listdir(d) if n[0] != "."] == ["3"]


def test_an_evaluator_whose_clock_is_ahead_skips_a_step_being_deleted(tmp_path):
  """A deletion notice's time is the writer's clock: an evaluator whose clock was an hour
  ahead took a notice written a second ago for a dead writer's and read the step being
  deleted. A reader takes a notice for live unless it is older than the lease time plus the
  clock skew allowed."""
  d = str(tmp_path)
  with ofx.CheckpointManager(d) as m:
    m.save(1, {"s": {"w": np.full(2, 1)}}, force=True)
  os.makedirs(os.path.join(d, ".readers"), exist_ok=True)
  notice = os.path.join(d, ".readers", "deleting-1")
  with open(notice, "w") as f:  # a writer deleting step 1 now, by a clock 3700 s behind
    f.write("notice")
  skewed = time.time() - 3700
  os.utime(notice, (skewed, skewed))
  assert list(ofx.checkpoints_iterator(d, timeout=0)) == []
  os.remove(notice)  # the deletion was withdrawn (the step was kept)
  assert list(ofx.checkpoints_iterator(d, timeout=0)) == [1]
