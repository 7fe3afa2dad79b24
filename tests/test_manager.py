"""The manager end to end: real files, a fake clock, "steps on disk == [...]"."""

import contextlib
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_flax as ofx
from orbax_flax.manager import policy as policy_lib
from orbax_flax.engine import saving
from orbax_flax.format import step_dir


class FakeClock:

  def __init__(self, start=1_000_000.0):
    self.t = start

  def __call__(self):
    return self.t


def hold_commits(monkeypatch):
  """Holds every save after its data is written, just before it commits: (written, go_on)."""
  written, go_on = threading.Event(), threading.Event()
  commit = saving.SaveRun._commit  # pylint: disable=protected-access

  def held_commit(run):
    written.set()
    go_on.wait(60)
    commit(run)

  monkeypatch.setattr(saving.SaveRun, "_commit", held_commit)
  return written, go_on


def on_disk(directory):
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def state(step):
  return {"w": np.full((8, 8), step, np.float32), "step": step}


def run(directory, policy, steps, clock=None, seconds_per_step=1.0, metrics=None):
  clock = clock or FakeClock()
  saved = []
  with ofx.CheckpointManager(directory, policy, clock=clock) as mngr:
    for step in steps:
      clock.t += seconds_per_step
      m = metrics(step) if metrics else None
      if mngr.save(step, {"state": state(step)}, metrics=m):
        saved.append(step)
    mngr.wait()
    assert mngr.all_steps() == on_disk(directory)
  return saved


@pytest.mark.parametrize("kwargs,steps,saved,kept", [
    # every N steps
    (dict(save_interval_steps=10), range(1, 46), [10, 20, 30, 40], [10, 20, 30, 40]),
    # explicit steps and the first step of the run
    (dict(save_on_steps=(3, 17), save_first_step=True), range(1, 21), [1, 3, 17], [1, 3, 17]),
    # keep the last K
    (dict(save_interval_steps=5, max_to_keep=2), range(1, 31), [5, 10, 15, 20, 25, 30], [25, 30]),
    # keep every M-th step forever, on top of the last K
    (dict(save_interval_steps=5, max_to_keep=1, keep_period=10), range(1, 31),
     [5, 10, 15, 20, 25, 30], [10, 20, 30]),
    # synchronous saves behave the same
    (dict(save_interval_steps=5, max_to_keep=2, async_save=False), range(1, 21), [5, 10, 15, 20], [15, 20]),
])
def test_step_policies(tmp_path, kwargs, steps, saved, kept):
  assert run(str(tmp_path), ofx.CheckpointPolicy(**kwargs), steps) == saved
  assert on_disk(tmp_path) == kept


def test_time_policy_with_fake_clock(tmp_path):
  # 7 s per step, save every 30 s: steps 5 (35 s), 10 (70 s), 15, 20.
  saved = run(str(tmp_path), ofx.CheckpointPolicy(save_interval_seconds=30.0), range(1, 21),
              seconds_per_step=7.0)
  assert saved == [5, 10, 15, 20]
  assert on_disk(tmp_path) == [5, 10, 15, 20]


def test_keep_one_per_time_window(tmp_path):
  policy = ofx.CheckpointPolicy(save_interval_steps=1, max_to_keep=1, keep_time_interval_seconds=10.0)
  run(str(tmp_path), policy, range(1, 26), clock=FakeClock(start=0.0), seconds_per_step=3.0)
  # Saved at t = 3, 6, ..., 75: the first of each 10 s window, plus the newest.
  assert on_disk(tmp_path) == [1, 4, 7, 10, 14, 17, 20, 24, 25]


def test_a_wall_clock_stepped_back_does_not_stop_time_based_saves(tmp_path):
  """save_interval_seconds measured the interval as a difference of wall-clock readings: a
  clock stepped back an hour (an NTP correction) made the next save wait an hour and a
  minute (the preemptible config keeps one step: up to an hour of work lost). The interval
  restarts where the clock went back: the next save comes one interval later."""
  clock = FakeClock()
  saved = []
  with ofx.CheckpointManager(str(tmp_path), ofx.CheckpointPolicy(
      save_interval_seconds=60, save_final_step=False), clock=clock) as mngr:
    for step in range(1, 401):
      clock.t += 1.0
      if step == 100:
        clock.t -= 3600.0
      if mngr.save(step, {"state": state(step)}):
        saved.append(step)
    mngr.wait()
  assert saved[:1] == [60]
  after = [s for s in saved if s >= 100]
  assert after and after[0] <= 100 + 60 and len(after) >= 4, saved


def test_keep_one_per_window_keeps_the_first_step_saved_there_after_the_clock_went_back(tmp_path):
  """keep_time_interval_seconds keeps the first step of each window of wall time for ever;
  it ordered steps by their recorded time, so a later step saved after the clock stepped
  back (or by a restarted job on a host whose clock is behind) displaced the step it had
  kept, and the keep rules deleted it. The first step saved in a window is its first step."""
  clock = FakeClock(start=0.0)
  policy = ofx.CheckpointPolicy(max_to_keep=1, keep_time_interval_seconds=100)
  with ofx.CheckpointManager(str(tmp_path), policy, clock=clock) as mngr:
    for step, t in [(1, 1050.0), (2, 1080.0), (3, 1150.0), (4, 1030.0), (5, 1040.0)]:
      clock.t = t
      mngr.save(step, {"state": state(step)}, force=True)
      mngr.wait()
      if step == 3:
        assert mngr.all_steps() == [1, 3]
    assert mngr.all_steps() == [1, 3, 5]


@pytest.mark.parametrize("mode,kept", [("min", [8, 9, 10]), ("max", [1, 2, 10])])
def test_keep_best(tmp_path, mode, kept):
  policy = ofx.CheckpointPolicy(save_interval_steps=1, keep_best=2, best_metric="loss", best_mode=mode)
  run(str(tmp_path), policy, range(1, 11), metrics=lambda s: {"loss": (s - 8.5) ** 2})
  assert on_disk(tmp_path) == kept
  with ofx.CheckpointManager(str(tmp_path), policy) as mngr:
    assert mngr.best_step() == (8 if mode == "min" else 1) or mngr.best_step() == (9 if mode == "min" else 1)


def test_keep_best_with_missing_metrics(tmp_path):
  policy = ofx.CheckpointPolicy(save_interval_steps=1, keep_best=1, best_metric="loss", best_missing="keep")
  run(str(tmp_path), policy, range(1, 7), metrics=lambda s: {"loss": s} if s % 2 else {})
  assert on_disk(tmp_path) == [1, 2, 4, 6]  # best scored (1), plus every unscored


def test_forced_and_reason_recorded(tmp_path):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  x = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P("data", "model")))
  clock = FakeClock(start=123.0)
  with ofx.CheckpointManager(str(tmp_path), ofx.CheckpointPolicy(save_interval_steps=100), clock=clock) as mngr:
    assert not mngr.save(7, {"state": {"x": x}})
    assert mngr.save(7, {"state": {"x": x}}, force=True, metrics={"loss": jax.numpy.float32(0.25)},
                     custom_metadata={"run": "abc"})
    assert mngr.save(9, {"state": {"x": x}}, reason="final")
    assert not mngr.save(9, {"state": {"x": x}})  # being saved: not again
    assert mngr.save(9, {"state": {"x": x}}, force=True)  # forced: replaces it once it is done
    mngr.wait()
    info = mngr.step_info(7)
    assert (info.reason, info.metrics, info.time) == ("forced", {"loss": 0.25}, 123.0)
    meta = mngr.metadata(7)
    assert meta.custom["step"] == 7 and meta.custom["mesh"] == {"data": 2, "model": 4}
    assert meta.custom["user"] == {"run": "abc"}
    assert meta.library_version == ofx.__version__ and meta.process_count == 1
    assert mngr.step_info(9).reason == "forced"
    with pytest.raises(ValueError, match="reason must be one of"):
      mngr.save(10, {"state": {"x": x}}, reason="because")
    with pytest.raises(ValueError, match="non-negative int"):
      mngr.save(-1, {"state": {"x": x}})


def test_restore_latest_and_specific_step_resharded(tmp_path):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  other = jax.make_mesh((8,), ("x",))
  with ofx.CheckpointManager(str(tmp_path), ofx.CheckpointPolicy(save_interval_steps=1)) as mngr:
    with pytest.raises(ofx.CheckpointNotFoundError, match="no committed checkpoint"):
      mngr.restore()
    for step in (1, 2):
      x = jax.device_put(np.full((8, 8), step, np.float32), NamedSharding(mesh, P("data", "model")))
      mngr.save(step, {"state": {"x": x}})
    target = {"state": {"x": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(other, P("x")))}}
    latest = mngr.restore(target=target)["state"]["x"]
    assert dict(latest.sharding.mesh.shape) == {"x": 8} and np.asarray(latest)[0, 0] == 2.0
    assert np.asarray(mngr.restore(1, target)["state"]["x"])[0, 0] == 1.0
    with pytest.raises(ofx.CheckpointNotFoundError, match="step 5 is not a committed"):
      mngr.restore(5)


def test_if_busy_skip_and_wait(tmp_path):
  big = {"w": np.random.default_rng(0).standard_normal((64 << 20) // 4, dtype=np.float32)}
  policy = ofx.CheckpointPolicy(save_interval_steps=1, if_busy="skip")
  with ofx.CheckpointManager(str(tmp_path / "skip"), policy) as mngr:
    assert mngr.save(1, {"state": big})
    assert not mngr.save(2, {"state": big})  # step 1 is still being written
    assert mngr.save(3, {"state": big}, force=True)  # forced saves wait instead
  assert on_disk(tmp_path / "skip") == [1, 3]
  with ofx.CheckpointManager(str(tmp_path / "wait"), ofx.CheckpointPolicy(save_interval_steps=1)) as mngr:
    assert mngr.save(1, {"state": big}) and mngr.save(2, {"state": big})
  assert on_disk(tmp_path / "wait") == [1, 2]


def test_background_error_surfaces_on_next_call(tmp_path):
  from test_async import small_disk  # pylint: disable=g-import-not-at-top
  big = {"w": np.ones((16 << 20) // 4, np.float32)}
  with small_disk(str(tmp_path / "disk")) as disk:
    mngr = ofx.CheckpointManager(disk, ofx.CheckpointPolicy(save_interval_steps=1))
    assert mngr.save(1, {"state": {"x": np.arange(3)}})
    assert mngr.save(2, {"state": big})  # fails in the background: disk full
    with pytest.raises(ofx.StorageError):
      mngr.save(3, {"state": {"x": np.arange(3)}})
    mngr.wait()
    assert mngr.all_steps() == [1] and on_disk(disk) == [1]
    mngr.close()


def test_leftovers_reported_and_removed_at_startup(tmp_path):
  d = str(tmp_path)
  run(d, ofx.CheckpointPolicy(save_interval_steps=5), range(1, 11))
  # Debris: an interrupted save of step 5 (older than the latest, 10) and of
  # step 15 (newer: it could still be written by this job's next save).
  shutil.copytree(os.path.join(d, "5"), os.path.join(d, "5.ofx-tmp-0123456789abcdef"))
  os.makedirs(os.path.join(d, "15.ofx-tmp-fedcba9876543210", "state"))
  os.makedirs(os.path.join(d, "8.ofx-tmp-delete-1234"))
  mngr = ofx.CheckpointManager(d, ofx.CheckpointPolicy(save_interval_steps=5))
  assert sorted(os.listdir(d)) == ["10", "15.ofx-tmp-fedcba9876543210", "5"]
  assert [l.name for l in mngr.leftovers()] == ["15.ofx-tmp-fedcba9876543210"]
  assert mngr.all_steps() == [5, 10]
  # Once step 15 commits, the debris of the old attempt at 15 goes too.
  mngr.save(15, {"state": state(15)})
  mngr.save(20, {"state": state(20)})
  mngr.close()
  assert sorted(os.listdir(d)) == ["10", "15", "20", "5"]


def test_sweep_spares_a_save_below_the_latest_step(tmp_path, monkeypatch):
  """After going back to an older step, its new save is not mistaken for debris by the
  writer's own sweep, which runs after each deletion, here while that save is written.

  The deletion of step 10 (max_to_keep=2 at 30's commit) is held until the rollback's save
  of 25 has written its data: then the deletion's sweep finds 25's temporary directory, a
  step at or below the latest (30) that no save of another job writes, yet this one's. (A
  second manager on the directory sweeps nothing at all: the writer lease; the earlier form
  of this test checked only that, and passed with the writer's own sweep sparing nothing:
  mutation review.)"""
  from orbax_flax.manager import registry  # pylint: disable=g-import-not-at-top
  d = str(tmp_path)
  armed, deleting, go_delete = [False], threading.Event(), threading.Event()
  delete = registry.StepRegistry._delete  # pylint: disable=protected-access

  def held_delete(self, steps):
    if armed[0] and steps:
      armed[0] = False
      deleting.set()
      assert go_delete.wait(60), "the test never let the deletion go on"
    return delete(self, steps)
  monkeypatch.setattr(registry.StepRegistry, "_delete", held_delete)
  swept, sweep = threading.Event(), registry.StepRegistry.sweep

  def sweep_and_say(self):
    sweep(self)
    swept.set()
  monkeypatch.setattr(registry.StepRegistry, "sweep", sweep_and_say)
  mngr = ofx.CheckpointManager(d, ofx.CheckpointPolicy(max_to_keep=2))
  for step in (10, 20):
    mngr.save(step, {"state": state(step)}, force=True)
    mngr.wait()
  armed[0] = True
  mngr.save(30, {"state": state(30)}, force=True)
  assert deleting.wait(60)  # 30 committed; the deletion of 10 waits
  mngr.restore(20)  # a rollback: 30 is abandoned once the new run commits
  written, go_on = hold_commits(monkeypatch)  # step 25's save, just before it commits
  assert mngr.save(25, {"state": state(25)}, force=True)
  assert written.wait(60)
  assert [n for n in os.listdir(d) if n.startswith("25.ofx-tmp")]
  swept.clear()
  go_delete.set()  # deletes 10, then sweeps: 25 is being written
  assert swept.wait(60)
  go_on.set()
  mngr.wait()
  assert mngr.all_steps() == [20, 25] == on_disk(d)
  np.testing.assert_array_equal(mngr.restore(25)["state"]["w"], state(25)["w"])
  mngr.close()


@pytest.mark.parametrize("differential", [False, True])
def test_second_rollback_while_the_first_runs_save_is_in_flight(tmp_path, monkeypatch,
                                                                differential):
  """Back to 20, the new run's save of 25 in flight, then back to 10: 25 belongs to an
  abandoned run too. Its commit ends the first rollback, not the second (it ended the
  second, and a resume continued 25 instead of the newest run's 12)."""
  d = str(tmp_path)
  mngr = ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=differential))
  for step in (10, 20, 30):
    mngr.save(step, {"state": state(step)}, force=True)
  mngr.wait()
  mngr.restore(20)  # rollback 1: 30 is abandoned
  written, go_on = hold_commits(monkeypatch)
  assert mngr.save(25, {"state": state(25)}, force=True)
  assert written.wait(60)  # 25's data is written, its commit held
  mngr.restore(10)  # rollback 2, while 25 is in flight: 20, 25 and 30 are abandoned
  go_on.set()
  mngr.wait()
  # 25's commit ended rollback 1 (30 went), not rollback 2: a crash here resumes 25, the
  # run rollback 2 abandoned, as a crash before a run's first commit does.
  assert mngr.all_steps() == [10, 20, 25] == on_disk(d)
  for step in (11, 12):
    assert mngr.save(step, {"state": state(step)}, force=True)
  mngr.wait()
  assert mngr.all_steps() == [10, 11, 12] == on_disk(d)
  mngr.close()
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=differential)) as again:
    assert again.latest_step() == 12
    np.testing.assert_array_equal(again.restore()["state"]["w"], state(12)["w"])


def test_reload_does_not_bring_back_a_step_being_deleted(tmp_path, monkeypatch):
  d = str(tmp_path)
  go_on = threading.Event()
  delete = step_dir.delete_step
  monkeypatch.setattr(step_dir, "delete_step", lambda *a: (go_on.wait(60), delete(*a)))
  mngr = ofx.CheckpointManager(d, ofx.CheckpointPolicy(max_to_keep=1))
  mngr.save(1, {"state": state(1)}, force=True)
  mngr.save(2, {"state": state(2)}, force=True)
  assert mngr.wait_for_save()  # step 2 committed, 1 doomed
  assert on_disk(d) == [1, 2]  # its deletion is held
  mngr.reload()
  assert mngr.all_steps() == [2]
  go_on.set()
  mngr.close()
  assert on_disk(d) == [2]


def test_unreadable_step_metadata_does_not_stop_retention(tmp_path, caplog):
  d = str(tmp_path)
  policy = ofx.CheckpointPolicy(keep_best=1, best_metric="loss")
  with ofx.CheckpointManager(d, policy) as mngr:
    mngr.save(1, {"state": state(1)}, metrics={"loss": 1.0}, force=True)
  manifest = os.path.join(d, "1", "_CHECKPOINT")
  data = bytearray(open(manifest, "rb").read())
  data[40] ^= 0x01
  open(manifest, "wb").write(bytes(data))
  with ofx.CheckpointManager(d, policy) as mngr:
    for step, loss in ((2, 0.5), (3, 0.7)):
      mngr.save(step, {"state": state(step)}, metrics={"loss": loss}, force=True)
    mngr.wait()
  # Step 1 ranks as having no loss: 2 is the best, 3 the newest.
  assert on_disk(d) == [2, 3]
  assert "cannot read its metadata" in caplog.text


def test_manager_with_a_kvstore_spec_dict(tmp_path):
  spec = {"driver": "file", "path": str(tmp_path / "run")}
  with ofx.CheckpointManager(spec, ofx.CheckpointPolicy(save_interval_steps=1)) as mngr:
    mngr.save(1, {"state": state(1)})
    mngr.wait()
    np.testing.assert_array_equal(mngr.restore()["state"]["w"], state(1)["w"])
    assert mngr.metadata().items["state"].nbytes > 0


def test_a_file_is_not_a_checkpoint_directory(tmp_path):
  f = tmp_path / "file"
  f.write_text("x")
  with pytest.raises(NotADirectoryError, match="is a file; checkpoint steps live in a directory"):
    ofx.CheckpointManager(str(f))


def test_discovery_of_many_steps_reads_no_metadata(tmp_path):
  d = str(tmp_path)
  ofx.save(os.path.join(d, "0"), {"state": state(0)})
  for s in range(1, 1200):
    shutil.copytree(os.path.join(d, "0"), os.path.join(d, str(s)))
  mngr = ofx.CheckpointManager(d, ofx.CheckpointPolicy(save_interval_steps=10))
  assert mngr.all_steps() == list(range(1200)) and mngr.latest_step() == 1199
  assert mngr.registry.cached_infos() == {}  # nothing was read
  mngr.close()


def test_policy_must_be_a_policy(tmp_path):
  with pytest.raises(TypeError, match="CheckpointPolicy.from_config"):
    ofx.CheckpointManager(str(tmp_path), {"save_interval_steps": 1})


def test_step_info_objects_are_policy_inputs():
  # The manager feeds the same StepInfo the pure rules take.
  assert policy_lib.to_delete([policy_lib.StepInfo(1, 0.0), policy_lib.StepInfo(2, 0.0)],
                              [policy_lib.KeepLast(1)]) == [1]


def test_multiprocess_time_policy_with_disagreeing_clocks(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  import jobs  # pylint: disable=g-import-not-at-top
  res = jobs.run("manager_worker.py", [f"--dir={tmp_path}", "--steps=40"], 2, 2).check()
  results = [json.loads(l.split(" ", 1)[1]) for out in res.outputs for l in out.splitlines()
             if l.startswith("RESULT ")]
  assert len(results) == 2
  # Process 0's clock (1 s per step, save every 7 s) decides for everyone.
  expected = list(range(7, 41, 7))
  assert results[0]["saved"] == results[1]["saved"] == expected
  assert results[0]["kept"] == results[1]["kept"] == expected[-3:] == on_disk(tmp_path)


def test_asking_the_policy_leaves_the_users_arrays_as_they_were(tmp_path):
  """Every save() call looks at the state's devices; it must not change them.

  jax.Array.devices() is the sharding's own cached set: popping from it once per step
  emptied it after eight steps on eight devices, and the next call failed.
  """
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  x = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P("data", "model")))
  with ofx.CheckpointManager(str(tmp_path), ofx.CheckpointPolicy(save_interval_steps=100)) as mngr:
    for step in range(1, 20):
      assert not mngr.save(step, {"state": {"x": x}})
  assert len(x.devices()) == 8 and len(x.sharding.device_set) == 8


@pytest.mark.parametrize("shared", ["Checkpointer", "CheckpointManager"])
def test_two_threads_sharing_one_saver_commit_only_their_own_bytes(tmp_path, shared):
  """Two threads saving through one Checkpointer (save_async) or one manager (forced saves):
  the wait for the previous save and the start of the next were not one step, so both ran on
  the shared staging memory, and steps committed with the other thread's values (or failed
  their checksums) with no error anywhere."""
  items = lambda v: {"state": {"w": np.full(20_000, v, np.float32), "b": np.arange(10) + v}}  # noqa: E731
  if shared == "Checkpointer":
    saver = ofx.Checkpointer()
    save = lambda s: saver.save_async(str(tmp_path / str(s)), items(s))  # noqa: E731
    path = lambda s: str(tmp_path / str(s))  # noqa: E731
  else:
    saver = ofx.CheckpointManager(str(tmp_path))
    for s in range(40):  # committed first: the threads re-save them (a new step below the
      saver.save(s, items(-1 - s), force=True)  # newest one would be refused)
    saver.wait()
    save = lambda s: saver.save(s, items(s), force=True)  # noqa: E731
    path = saver.step_path
  raised = []

  def worker(first):
    for s in range(first, 40, 2):
      try:
        save(s)
      except Exception as e:  # pylint: disable=broad-except
        raised.append(e)

  threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  saver.wait()
  saver.close()
  assert not raised, raised
  for s in range(40):
    got = ofx.restore(path(s))["state"]
    assert (got["w"] == s).all() and (got["b"] == np.arange(10) + s).all(), s


def test_a_closed_manager_refuses_a_save_before_taking_the_directory(tmp_path):
  """save() after close() took the writer lease (and started its refresh thread) before
  the checkpointer refused: the lease stayed held, and every later manager of the
  directory was refused as a second writer."""
  with ofx.CheckpointManager(str(tmp_path)) as m:
    m.save(0, {"state": {"w": np.zeros(3)}}, force=True)
  with pytest.raises(RuntimeError, match="CheckpointManager.*is closed; create a new one"):
    m.save(1, {"state": {"w": np.ones(3)}}, force=True)
  m.close()
  assert not any(t.name.startswith("orbax_flax-writer") for t in threading.enumerate())
  with ofx.CheckpointManager(str(tmp_path)) as again:
    again.save(1, {"state": {"w": np.ones(3)}}, force=True)
  assert again.all_steps() == [0, 1]


@contextlib.contextmanager
def _after_step_0_then(d, act):
  """A manager of ``d`` with step 0 committed, whose keep rule (KeepLast(1)) runs ``act()``
  at its next decision: something befalls the disk between the next commit and its
  deletions. Yields the manager and the items of a step."""
  armed = [False]

  class Rule:
    reads_metadata = False

    def keep(self, steps):
      if armed[0]:
        armed[0] = False
        act()
      return {max(s.step for s in steps)}
  items = lambda v: {"state": {"w": np.full(100_000, v, np.float32)}}  # noqa: E731
  with ofx.CheckpointManager(d, keep=[Rule()]) as m:
    m.save(0, items(0), force=True)
    m.wait()
    armed[0] = True
    yield m, items


def test_a_deletion_on_a_full_disk_says_what_little_room_it_needs_and_leaves_nothing(tmp_path):
  """The disk filled between a commit and the deletion of the step it made redundant, and
  stays full. A deletion first writes a small notice for readers (an evaluator may read the
  step without a lease of its own), which failed: the error told the user to keep fewer
  checkpoints (max_to_keep), no help at max_to_keep=1, and the failed notice left an empty
  file behind, which counted as a live notice for an hour. Now the error says the deletion
  needs a few KB and the way out, nothing is deleted (the step restores), no empty file stays,
  and once a little room is freed the next save's deletion gives the step's room back."""
  from disks import small_disk  # pylint: disable=g-import-not-at-top
  with small_disk(str(tmp_path / "disk"), size="4m") as disk:
    filler = os.path.join(disk, "filler")

    def fill():  # another writer fills the disk
      st = os.statvfs(disk)
      with open(filler, "wb") as f:
        try:
          f.write(b"\0" * (st.f_bavail * st.f_frsize))
        except OSError:
          pass
    d = os.path.join(disk, "run")
    with _after_step_0_then(d, fill) as (m, items):
      with pytest.raises(ofx.StorageError, match=r"deleting step 0 .* the disk is full, and a"
                         r" deletion first writes a small notice .* free a little room .*"
                         r"rm -rf .*/run/0"):
        m.save(1, items(1), force=True)
        m.wait()
      assert m.all_steps() == [1]
      readers = os.path.join(d, ".readers")
      assert not os.path.isdir(readers) or not os.listdir(readers), os.listdir(readers)
      assert ofx.restore(os.path.join(d, "0"))["state"]["w"][0] == 0  # nothing deleted
      os.truncate(filler, max(0, os.path.getsize(filler) - (64 << 10)))  # a little room
      m.save(2, items(2), force=True)
      m.wait()
      assert m.all_steps() == [2]
    assert sorted(n for n in os.listdir(d) if not n.startswith(".")) == ["2"]
    assert not os.path.exists(os.path.join(d, ".readers"))  # no notice left behind
    assert ofx.restore(os.path.join(d, "2"))["state"]["w"][0] == 2


def test_a_deletion_that_fails_is_tried_again_at_the_next(tmp_path):
  """The disk turned read-only between a commit and the deletion of the step it made
  redundant: the deletion failed (raised by wait(), as it should), and the next deletion,
  with the disk writable again, tries it again (a step left out of the listing but never
  deleted would hold its room for good)."""
  from disks import small_disk  # pylint: disable=g-import-not-at-top
  with small_disk(str(tmp_path / "disk"), size="4m") as disk:
    d = os.path.join(disk, "run")
    with _after_step_0_then(
        d, lambda: subprocess.run(["mount", "-o", "remount,ro", disk], check=True)) as (m, items):
      with pytest.raises(ofx.StorageError, match="read-only") as raised:
        m.save(1, items(1), force=True)
        m.wait()
      # Raised by the save's wait(), it says what failed: not the save, which committed.
      assert "of the deletion of step(s) [0]" in " ".join(raised.value.__notes__), raised
      assert os.path.isdir(os.path.join(d, "0"))
      subprocess.run(["mount", "-o", "remount,rw", disk], check=True)
      m.save(2, items(2), force=True)
      m.wait()
      assert m.all_steps() == [2]
    assert sorted(n for n in os.listdir(d) if not n.startswith(".")) == ["2"]
    assert ofx.restore(os.path.join(d, "2"))["state"]["w"][0] == 2


def test_a_new_step_below_the_newest_is_refused_before_writing_unless_rolled_back(tmp_path):
  """A run started over in a finished run's directory (no restore) saved steps below the old
  latest: each save returned True and committed, and max_to_keep deleted it at once, with no
  word; a resume then restored the old run."""
  d = str(tmp_path)
  policy = ofx.CheckpointPolicy(save_interval_steps=10, max_to_keep=2)
  run(d, policy, range(1, 51))
  assert on_disk(d) == [40, 50]
  before = sorted(os.listdir(d))
  with ofx.CheckpointManager(d, policy) as mngr:
    assert not any(mngr.save(s, {"state": state(s)}) for s in range(1, 10))  # not due: fine
    with pytest.raises(ValueError, match=r"step 10 is below the newest step 50 of .*no rollback"
                       r".*Nothing was written\. .*restore it first.*a new directory.*delete the"
                       r" newer step\(s\) \[40, 50\] first"):
      mngr.save(10, {"state": state(10)})
    assert sorted(os.listdir(d)) == before  # no lease, no sweep, no step
    assert mngr.save(50, {"state": state(-50)}, force=True)  # a re-save replaces it in place
    mngr.restore(40)  # a rollback: its run saves below the newest, as before
    assert mngr.save(30, {"state": state(30)}, force=True)
    mngr.wait()
    assert mngr.all_steps() == [30, 40] == on_disk(d)


def test_a_forced_save_of_a_step_still_being_saved_replaces_it(tmp_path):
  """save(5, new, force=True) while the async save of step 5 was in flight returned False
  with a warning and kept the old values; the same call after the commit replaced them."""
  d = str(tmp_path)
  old = {"state": {"w": np.random.default_rng(0).standard_normal(1 << 22).astype(np.float32)}}
  new = {"state": {"w": np.random.default_rng(1).standard_normal(1 << 22).astype(np.float32)}}
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(async_save=True)) as mngr:
    assert mngr.save(5, old, force=True) and mngr.inflight_step() == 5
    assert not mngr.save(5, new)  # not forced: the step being saved is not saved again
    assert mngr.save(5, new, force=True)
  with ofx.CheckpointManager(d) as mngr:
    assert mngr.all_steps() == [5]
    assert mngr.restore(5)["state"]["w"].tobytes() == new["state"]["w"].tobytes()


def test_a_manager_built_before_another_run_wrote_refuses_a_step_below_its_newest(tmp_path):
  """The check ran against the listing taken when the manager was built: another run saved
  10, 20, 30 after that, the late manager's save(1) returned True, and max_to_keep deleted
  step 1 at once."""
  d = str(tmp_path)
  policy = ofx.CheckpointPolicy(max_to_keep=2)
  late = ofx.CheckpointManager(d, policy)  # built first, e.g. at the program's start
  run(d, ofx.CheckpointPolicy(save_interval_steps=10, max_to_keep=3), range(1, 31))
  with pytest.raises(ValueError, match=r"step 1 is below the newest step 30 of .*no rollback"):
    late.save(1, {"state": state(1)}, force=True)
  late.close()
  assert on_disk(d) == [10, 20, 30]
  assert ofx.restore(os.path.join(d, "30"))["state"]["w"].tolist() == state(30)["w"].tolist()


def test_save_refuses_a_mistyped_best_metric_with_did_you_mean_before_writing(tmp_path, caplog):
  """best_metric="val_acc" while the loop reports "val_accuracy": only the callback checked,
  so keep_best silently kept the newest steps and deleted the best one."""
  d = str(tmp_path / "run")
  policy = ofx.CheckpointPolicy(save_interval_steps=1, keep_best=1, best_metric="val_acc",
                                best_mode="max")
  with ofx.CheckpointManager(d, policy) as mngr:
    with pytest.raises(ValueError, match=r"best_metric='val_acc' is not among the metrics"
                       r" reported \(loss, val_accuracy\); did you mean 'val_accuracy'\?"):
      mngr.save(1, {"state": state(1)}, metrics={"val_accuracy": 0.95, "loss": 0.1})
  assert not os.path.exists(d) or on_disk(d) == []
  # Reported only on some steps (eval steps): a WARNING, once, and the best step is kept.
  policy = ofx.CheckpointPolicy(save_interval_steps=1, keep_best=1, best_metric="val_accuracy",
                                best_mode="max")
  with ofx.CheckpointManager(d, policy) as mngr:
    for step, m in ((1, {"loss": 1.0}), (2, {"loss": 0.5, "val_accuracy": 0.9}),
                    (3, {"loss": 0.4}), (4, {"loss": 0.3, "val_accuracy": 0.5})):
      assert mngr.save(step, {"state": state(step)}, metrics=m)
    mngr.wait()
    assert mngr.all_steps() == [2, 4]
  said = [r.getMessage() for r in caplog.records if "val_accuracy" in r.getMessage()]
  assert len(said) == 1 and "only on some steps" in said[0], said


def test_should_save_then_save_agree_and_asking_twice_gives_one_answer(tmp_path):
  """The Orbax idiom `if mngr.should_save(step): mngr.save(step, items)` lost the save of
  save_first_step: should_save() consumed the first step, and save() asked again and heard
  None."""
  policy = ofx.CheckpointPolicy(save_first_step=True, save_interval_steps=1000, async_save=False)
  said = []
  with ofx.CheckpointManager(str(tmp_path / "a"), policy) as mngr:
    for step in range(501, 506):  # a resumed run: its first step is 501
      reason = mngr.should_save(step)
      assert mngr.should_save(step) == reason
      if reason:
        said.append((step, reason))
        assert mngr.save(step, {"state": state(step)})
    assert said == [(501, "first")] and mngr.all_steps() == [501]
    assert mngr.step_info(501).reason == "first"
  # A clock that moves between the question and the save does not change the answer.
  clock = FakeClock(start=0.0)
  trigger = ofx.EveryNSeconds(10.0)
  with ofx.CheckpointManager(str(tmp_path / "b"), trigger=trigger, clock=clock) as mngr:
    clock.t = 9.0
    assert mngr.should_save(1) is None
    clock.t = 11.0
    assert not mngr.save(1, {"state": state(1)})  # as it said: not due
    assert mngr.should_save(2) == "time"
    clock.t = 12.0
    assert mngr.should_save(2) == "time" and mngr.save(2, {"state": state(2)})
    mngr.wait()
    assert mngr.all_steps() == [2] and mngr.should_save(3) is None


def test_should_save_is_none_for_a_committed_step_and_yes_for_an_abandoned_one(tmp_path):
  """After a restart, should_save(10) said 'interval' for the committed step 10 and save(10)
  then declined it (returned False): `if should_save(step): save(step, items)` was told of a
  save that never happened. A step a rollback abandoned is still saved over."""
  policy = ofx.CheckpointPolicy(save_interval_steps=10, async_save=False)
  d = str(tmp_path / "c")
  with ofx.CheckpointManager(d, policy) as mngr:
    for step in (10, 20):
      assert mngr.save(step, {"state": state(step)})
  with ofx.CheckpointManager(d, policy) as mngr:  # a restart
    mngr.restore()
    assert mngr.should_save(20) is None and mngr.should_save(30) == "interval"
    assert not mngr.save(20, {"state": state(99)})
    mngr.restore(10)  # a rollback: 20 belongs to the abandoned run
    assert mngr.should_save(10) is None and mngr.should_save(20) == "interval"
    assert mngr.save(20, {"state": state(21)})
    assert mngr.should_save(20) is None
    assert mngr.all_steps() == [10, 20]
    np.testing.assert_array_equal(mngr.restore(20)["state"]["w"], state(21)["w"])


def test_a_manager_that_only_lists_and_restores_writes_nothing_without_write_access(tmp_path,
                                                                                  caplog):
  """Its start-up sweep took the writer lease, so a manager over a directory it may read but
  not write raised StorageError from __init__ (and one over a missing directory created it),
  while ofx.restore read the same step fine."""
  import logging  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  from disks import small_disk  # pylint: disable=g-import-not-at-top
  missing = tmp_path / "not-yet"
  with ofx.CheckpointManager(str(missing)) as reader:
    assert reader.all_steps() == []
  assert not missing.exists()
  with small_disk(str(tmp_path / "disk"), "4m") as disk:
    d = os.path.join(disk, "ckpts")
    with ofx.CheckpointManager(d, ofx.CheckpointPolicy(save_interval_steps=1)) as m:
      for step in (1, 2):
        m.save(step, {"state": state(step)})
    shutil.copytree(os.path.join(d, "1"), os.path.join(d, "1.ofx-tmp-0123456789abcdef"))
    subprocess.run(["mount", "-o", "remount,ro", disk], check=True)
    before = sorted(os.listdir(d))
    with caplog.at_level(logging.INFO, logger="orbax_flax"):
      with ofx.CheckpointManager(d) as reader:
        assert reader.all_steps() == [1, 2]
        np.testing.assert_array_equal(reader.restore(2)["state"]["w"], state(2)["w"])
        np.testing.assert_array_equal(reader.restore(1)["state"]["w"], state(1)["w"])
        with pytest.raises(ofx.StorageError, match=f"{d}.*read-only"):
          reader.save(3, {"state": state(3)}, force=True)  # saving fails, and says why
    assert "may not write here" in caplog.text and "start-up sweep is skipped" in caplog.text
    assert sorted(os.listdir(d)) == before  # the leftover stays: nothing was written


_JOB = """
import os, sys
import numpy as np, orbax_flax as ofx
d, step = sys.argv[1], int(sys.argv[2])
m = ofx.CheckpointManager(d)
m.save(step, {"s": {"w": np.full(4, step)}}, force=True); m.wait()
print("SAVED", step, os.getpid(), flush=True)
if step == 1:
  os._exit(0)  # the job dies (preempted, OOM-killed): no close(), its lease stays behind
m.close()
"""


def test_a_job_restarted_in_a_new_pid_namespace_takes_over_its_dead_predecessors_lease(tmp_path):
  """A Kubernetes container restart: same host name, the trainer is pid 1 again in a fresh pid
  namespace. The dead job's lease named "process id 1" on this host, and the restarted job,
  pid 1 itself, found that pid running and was refused at once as a second writer."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import jobs  # pylint: disable=g-import-not-at-top
  unshare = None
  for prefix in (["unshare", "--pid", "--fork", "--mount-proc"],
                 ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]):
    try:
      if subprocess.run(prefix + ["true"], capture_output=True, check=False).returncode == 0:
        unshare = prefix
        break
    except FileNotFoundError:
      break
  if unshare is None:
    pytest.skip("cannot start a process in a new pid namespace (unshare --pid: needs root or"
                " user namespaces)")
  d = str(tmp_path / "ckpt")
  job = lambda step: subprocess.run(  # noqa: E731
      unshare + [sys.executable, "-c", _JOB, d, str(step)], capture_output=True, text=True,
      env=jobs.env_for(1), timeout=120, check=False)
  first = job(1)
  assert "SAVED 1 1" in first.stdout, first.stdout + first.stderr[-2000:]
  assert os.path.exists(os.path.join(d, ".writer"))  # left behind by the job that died
  second = job(2)  # pid 1 again, in a new pid namespace
  assert "SAVED 2 1" in second.stdout, second.stdout + second.stderr[-2000:]
  assert not os.path.exists(os.path.join(d, ".writer"))  # released by its close()
  with ofx.CheckpointManager(d) as m:
    assert m.all_steps() == [1, 2]


def test_a_lease_left_by_a_process_whose_pid_now_names_another_is_taken_over(tmp_path):
  """A dead job's lease names a pid that now belongs to another process on this host (this
  very process: the restarted container's pid 1 again; or a process that reused it): that pid
  runs, and the job was refused as a second writer. Records as the dead process wrote them:
  an earlier version's (host and pid only) with this process's pid; one naming another boot
  of the host; one naming a running process's pid with an earlier start time."""
  import json  # pylint: disable=g-import-not-at-top
  import socket  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  d = str(tmp_path / "ckpt")
  os.makedirs(d)
  other = subprocess.Popen(["sleep", "60"])
  try:
    with open(f"/proc/{other.pid}/stat") as f:
      started = int(f.read().rpartition(")")[2].split()[19])
    here = {"host": socket.gethostname(), "purpose": "writer"}
    records = [dict(here, owner="earlier-version", pid=os.getpid()),
               dict(here, owner="another-boot", pid=other.pid, boot="0-0-0-0",
                    pidns=os.readlink("/proc/self/ns/pid"), start=started),
               dict(here, owner="reused-pid", pid=other.pid, start=started - 1,
                    pidns=os.readlink("/proc/self/ns/pid"))]
    for step, record in enumerate(records, 1):
      with open(os.path.join(d, ".writer"), "w") as f:
        json.dump(dict(record, time=time.time()), f)
      with ofx.CheckpointManager(d) as m:
        m.save(step, {"state": state(step)}, force=True)
    with open(os.path.join(d, ".writer"), "w") as f:  # the same process, running: refused
      json.dump(dict(records[2], start=started, time=time.time()), f)
    with pytest.raises(ofx.WriterConflictError, match=f"process id {other.pid}"):
      ofx.CheckpointManager(d).save(4, {"state": state(4)}, force=True)
  finally:
    other.kill()
    other.wait()
  with ofx.CheckpointManager(d) as m:
    assert m.all_steps() == [1, 2, 3]


def test_a_forked_childs_exit_leaves_its_parents_writer_lease(tmp_path):
  """A process that holds the writer lease forks a helper, which exits normally: the lease's
  finalizer, inherited by the child, ran at the child's exit and removed the parent's live
  lease, so a second job then saved into the directory the parent was writing."""
  d = str(tmp_path / "ckpts")
  script = textwrap.dedent("""
      import os, sys, numpy as np, orbax_flax as ofx
      m = ofx.CheckpointManager(sys.argv[1])
      m.save(1, {"s": {"w": np.ones(3)}}, force=True)
      m.wait()
      pid = os.fork()
      if pid == 0:
        sys.exit(0)  # a helper process that ends normally (atexit runs)
      os.waitpid(pid, 0)
      print("LEASE", os.path.exists(os.path.join(sys.argv[1], ".writer")), flush=True)
      sys.stdin.readline()  # still the writer while the test tries a second job
      m.close()
  """)
  parent = subprocess.Popen([sys.executable, "-W", "ignore", "-c", script, d],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
  try:
    assert parent.stdout.readline().split() == ["LEASE", "True"]
    with pytest.raises(ofx.WriterConflictError):
      ofx.CheckpointManager(d).save(2, {"s": {"w": np.ones(3)}}, force=True)
  finally:
    parent.communicate("\n", timeout=60)
  assert parent.returncode == 0


def test_a_manager_dropped_without_close_lets_go_of_its_directory(tmp_path):
  """A notebook cell made a manager, saved and never closed it: its lease's refresh thread
  kept the lease alive for the life of the process, and every new manager of the directory
  (the cell re-run) was refused, naming this very process. Dropped, it is released once
  collected; one still open is named as this process's, with the fix."""
  import gc  # pylint: disable=g-import-not-at-top
  d = str(tmp_path / "ckpt")

  def cell(step):  # the manager goes out of scope without close()
    m = ofx.CheckpointManager(d)
    m.save(step, {"state": state(step)}, force=True)
    m.wait()

  cell(1)
  gc.collect()
  cell(2)  # the cell re-run
  gc.collect()
  earlier = ofx.CheckpointManager(d)
  earlier.save(3, {"state": state(3)}, force=True)
  earlier.wait()  # (a save in flight holds its manager until it ends)
  with pytest.raises(ofx.WriterConflictError,
                     match=r"another CheckpointManager of this very process .*close\(\) that"
                     r" earlier manager.*`del` it and gc.collect\(\).*restart the kernel"):
    ofx.CheckpointManager(d).save(4, {"state": state(4)}, force=True)
  del earlier
  gc.collect()
  with ofx.CheckpointManager(d) as m:
    m.save(4, {"state": state(4)}, force=True)
    m.wait()
    assert m.all_steps() == [1, 2, 3, 4]
  assert not os.path.exists(os.path.join(d, ".writer"))
  assert not any(t.name.startswith("orbax_flax-writer") for t in threading.enumerate())


@pytest.mark.parametrize("async_save", [True, False])
def test_on_save_error_warn_logs_a_failed_save_and_the_manager_goes_on(tmp_path, caplog,
                                                                         async_save):
  """CheckpointPolicy(on_save_error="warn") was read by the training callback only: the
  manager's own save() and wait() raised the full disk's StorageError all the same."""
  import logging  # pylint: disable=g-import-not-at-top
  from disks import small_disk  # pylint: disable=g-import-not-at-top
  items = lambda v: {"state": {"w": np.full(250_000, v, np.float32)}}  # noqa: E731  1 MB
  with small_disk(str(tmp_path / "disk"), size="4m") as disk:
    filler = os.path.join(disk, "filler")
    with open(filler, "wb") as f:
      f.write(b"\0" * (3 << 19))  # 1.5 MB: two steps fit beside it, not three
    d = os.path.join(disk, "run")
    policy = ofx.CheckpointPolicy(on_save_error="warn", max_to_keep=2, async_save=async_save)
    with caplog.at_level(logging.ERROR, logger="orbax_flax"):
      with ofx.CheckpointManager(d, policy) as m:
        for step in (1, 2):
          assert m.save(step, items(step), force=True)
          m.wait()
        caplog.clear()
        m.save(3, items(3), force=True)  # the disk is full: logged, nothing raised
        m.wait()
        assert m.all_steps() == [1, 2]
        assert "CHECKPOINT SAVE FAILED" in caplog.text and "the save of step 3" in caplog.text
        assert "no space left" in caplog.text.lower()
        assert "the latest committed is 2" in caplog.text
        os.remove(filler)  # the space comes back: the next save goes through
        assert m.save(4, items(4), force=True)
        m.wait()
        assert m.all_steps() == [2, 4]
    for step in (2, 4):
      assert ofx.restore(os.path.join(d, str(step)))["state"]["w"][0] == step


# ---------------------------------------------------------------------- threads and handlers


def test_an_evaluation_thread_restoring_the_best_step_abandons_nothing(tmp_path):
  """A training thread saves every step; an evaluation thread of the same process loops over
  restore(best_step()), a look at an old step (docs/manager.md: nothing is abandoned, as the
  next save is above every step). A restore landing inside a save's decisions (the rollback
  called off, then, after waiting for the save before, the run recorded) started a rollback
  that save then ran: 133-142 of 150 committed steps were deleted as an abandoned run."""
  steps_saved = 60
  m = ofx.CheckpointManager(str(tmp_path), ofx.CheckpointPolicy(save_interval_steps=1,
                                                                 best_metric="loss"))
  done, looks = threading.Event(), []
  def train():
    try:
      for step in range(1, steps_saved + 1):
        m.save(step, {"state": {"w": np.full(256, step, np.float32)}},
               metrics={"loss": abs(step - 3) + 0.5})  # step 3 stays the best
    finally:
      done.set()
  def evaluate():
    while not done.is_set():
      best = m.best_step()
      if best is not None:
        looks.append(float(m.restore(best)["state"]["w"][0]))
  threads = [threading.Thread(target=train), threading.Thread(target=evaluate)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  m.wait()
  try:
    assert looks and m.all_steps() == list(range(1, steps_saved + 1)), m.all_steps()
  finally:
    m.close()


def test_close_in_a_signal_handler_inside_save_closes_as_that_save_ends(tmp_path):
  """A SIGTERM handler that closes the manager (a loop without the training callback) while
  the main thread is inside save(): close() waited for the save lock the interrupted save()
  held on the same thread, for ever. It returns at once and the manager closes as that
  save() ends; a save() or restore() from such a handler is refused, naming why."""
  script = textwrap.dedent(f"""
      import os, signal, sys, threading
      import numpy as np, orbax_flax as ofx
      from orbax_flax.manager import manager as manager_lib
      m = ofx.CheckpointManager({str(tmp_path)!r}, ofx.CheckpointPolicy(save_interval_steps=1))
      state = {{"s": {{"w": np.ones((16, 1024, 1024), np.float32)}}}}  # 64 MiB
      m.save(1, state)
      said = {{}}
      def on_term(signum, frame):
        try:
          m.restore(1)
        except RuntimeError as e:
          said["restore"] = str(e)
        m.close()
        raise SystemExit(0)
      signal.signal(signal.SIGTERM, on_term)
      save = manager_lib.CheckpointManager._save
      def _save(self, *args, **kwargs):  # the signal, inside save(), every time
        os.kill(os.getpid(), signal.SIGTERM)
        return save(self, *args, **kwargs)
      manager_lib.CheckpointManager._save = _save
      try:
        m.save(2, state)
      except SystemExit:
        pass
      print("REFUSED", said.get("restore", "")[:80])
      print("CLOSED", m._closed, ofx.CheckpointManager({str(tmp_path)!r}).all_steps())
      """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "REFUSED CheckpointManager.restore() called while this thread is inside save()" in (
      out.stdout), out.stdout
  assert "CLOSED True [1]" in out.stdout, out.stdout


def test_close_in_an_atexit_hook_with_a_save_in_flight_applies_the_keep_rules(tmp_path):
  """atexit.register(manager.close), and the script ends with a save in flight: its commit's
  deletion was refused by the interpreter ('cannot schedule new futures after interpreter
  shutdown'), close() raised it, and max_to_keep was not applied. The deletion runs in the
  closing thread then."""
  script = textwrap.dedent(f"""
      import atexit
      import numpy as np, orbax_flax as ofx
      m = ofx.CheckpointManager({str(tmp_path)!r}, ofx.CheckpointPolicy(max_to_keep=2))
      atexit.register(m.close)
      for step in (1, 2, 3):
        m.save(step, {{"s": {{"w": np.full((8, 1024, 1024), step, np.float32)}}}}, force=True)
      """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, check=False)
  assert out.returncode == 0 and "Error" not in out.stderr, out.stderr[-3000:]
  assert ofx.CheckpointManager(str(tmp_path)).all_steps() == [2, 3]


def test_a_directory_named_like_a_step_without_a_manifest_is_no_step_and_never_deleted(tmp_path):
  """<root>/7 without _CHECKPOINT (here another live manager's directory; or someone's files,
  a step being copied in) was listed as committed step 7, and max_to_keep deleted it with
  everything under it (paths review)."""
  root = str(tmp_path / "root")
  child_dir = os.path.join(root, "7")
  with ofx.CheckpointManager(child_dir, ofx.CheckpointPolicy(async_save=False)) as child:
    child.save(1, {"state": state(1)}, force=True)
    os.makedirs(os.path.join(root, "3", "mine"))  # a user's directory of files
    with ofx.CheckpointManager(root, ofx.CheckpointPolicy(max_to_keep=1)) as parent:
      assert parent.all_steps() == []
      for step in (8, 9):
        parent.save(step, {"state": state(step)}, force=True)
      parent.wait()
      assert parent.all_steps() == [9] and parent.latest_step() == 9
    assert child.all_steps() == [1]
    np.testing.assert_array_equal(child.restore(1)["state"]["w"], state(1)["w"])
  assert os.path.isdir(os.path.join(root, "3", "mine"))


def test_a_manager_refuses_a_directory_that_is_one_checkpoint_and_step_queries_check_the_step(
    tmp_path):
  """CheckpointManager('<run>/checkpoints/5') saved its steps inside committed step 5 (which
  the run's keep rules then deleted with them); has_step('5') said False for committed step 5
  and step_path(5.0) named '.../5.0' (paths review)."""
  run = str(tmp_path / "checkpoints")
  with ofx.CheckpointManager(run, ofx.CheckpointPolicy(async_save=False)) as m:
    m.save(5, {"state": state(5)}, force=True)
    for bad in ("5", 5.0, -1):
      for query in (m.has_step, m.step_info, m.metadata, m.step_path):
        with pytest.raises(ValueError, match="step must be a non-negative int"):
          query(bad)
    assert m.has_step(np.int64(5)) and m.step_path(np.int32(5)) == os.path.join(run, "5")
    assert not m.has_step(None)  # has_step(mngr.latest_step()) in an empty directory
  step5 = os.path.join(run, "5")
  before = sorted(os.listdir(step5))
  with pytest.raises(ofx.errors.CheckpointExistsError,
                     match=re.escape(f"{step5} is one checkpoint") + ".*Pass the directory of"
                     " steps that holds it " + re.escape(f"({run})")):
    ofx.CheckpointManager(step5)
  assert sorted(os.listdir(step5)) == before


def _other_hosts_lease(d, owner, skew, stop, refresh_s=0.5):
  """Another host's live training job holding the writer lease of ``d``: it rewrites its record
  every ``refresh_s`` with its own clock, ``skew`` seconds off this host's, until ``stop``."""
  import json  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  path = os.path.join(d, ".writer")
  while True:
    try:
      with open(path) as f:
        if json.load(f).get("owner") != owner:
          return  # taken over
    except (OSError, ValueError):
      pass
    with open(path + ".tmp", "w") as f:
      json.dump({"owner": owner, "host": "trainer-host-b", "pid": 4242,
                 "time": time.time() + skew, "purpose": "writer"}, f)
    os.replace(path + ".tmp", path)
    if stop.wait(refresh_s):
      return


def _saving_job(d):
  """A job's thread that saves step 1 in ``d``; its result dict says what came of it."""
  result = {}

  def job():
    try:
      with ofx.CheckpointManager(d) as m:
        result["saved"] = m.save(1, {"state": state(1)}, force=True)
        m.wait()
    except BaseException as e:  # pylint: disable=broad-except
      result["error"] = e

  return threading.Thread(target=job, daemon=True), result


def test_a_live_writer_on_a_host_whose_clock_is_behind_is_not_taken_for_dead(tmp_path):
  """A holder on another host was judged by its record's time against this host's clock: a
  live writer whose clock is two minutes behind looked unrefreshed for two minutes, and a
  second job's save took the directory over at once (two jobs writing one directory). Another
  host's lease is judged by what this process sees: its record changes at each refresh."""
  d = str(tmp_path / "ckpt")
  os.makedirs(d)
  stop = threading.Event()
  holder = threading.Thread(target=_other_hosts_lease, args=(d, "host-b-job", -120.0, stop))
  holder.start()
  job, result = _saving_job(d)
  try:
    import time  # pylint: disable=g-import-not-at-top
    time.sleep(0.3)
    job.start()
    job.join(2)
    assert job.is_alive() and not result, result  # waits: the holder refreshes its record
  finally:
    stop.set()
    holder.join()
  os.remove(os.path.join(d, ".writer"))  # the other job closes its manager
  job.join(30)
  assert result == {"saved": True}, result


def test_a_dead_writer_on_a_host_whose_clock_was_ahead_is_taken_over(tmp_path, monkeypatch):
  """A dead job's lease from a host whose clock ran ten minutes ahead looked refreshed in the
  future: every save here waited the whole lease wait and was refused, for ten minutes. It
  is taken over once this process has seen the record unchanged for WRITER_SECONDS (shortened
  here to keep the test short; its meaning is the same)."""
  import json  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  from orbax_flax.manager import leases  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(leases, "WRITER_SECONDS", 1.5)
  d = str(tmp_path / "ckpt")
  os.makedirs(d)
  with open(os.path.join(d, ".writer"), "w") as f:
    json.dump({"owner": "dead-job", "host": "trainer-host-b", "pid": 4242,
               "time": time.time() + 600.0, "purpose": "writer"}, f)
  job, result = _saving_job(d)
  job.start()
  job.join(20)
  assert result == {"saved": True}, result
