"""The manager as a thin shell (issue 17): a done-callback instead of a waiting thread,
triggers and keep rules composed by hand, one restore/save signature."""

import os
import threading

import numpy as np
import pytest

import orbax_flax as ofx
from disks import small_disk
from test_manager import FakeClock, hold_commits, on_disk  # the manager tests' helpers


def state(step):
  return {"w": np.full((4, 4), step, np.float32)}


# ------------------------------------------------------------------ AsyncSave.add_done_callback


def test_done_callback_runs_once_in_the_save_thread_after_the_commit(tmp_path, monkeypatch):
  path = str(tmp_path / "c")
  written, go_on = hold_commits(monkeypatch)  # so that the callback is added before the end
  seen = []
  with ofx.Checkpointer() as ckptr:
    handle = ckptr.save_async(path, {"state": state(1)})

    def done(h):
      h.wait()  # does not block (nor deadlock) inside the callback: the save has ended
      seen.append((h is handle, threading.current_thread() is not threading.main_thread(),
                   float(ofx.restore(path)["state"]["w"][0, 0])))

    handle.add_done_callback(done)
    assert written.wait(60) and not seen
    go_on.set()
    handle.wait()
    assert seen == [(True, True, 1.0)]  # committed when it ran; before wait() returned
    late = []
    handle.add_done_callback(lambda h: late.append(threading.current_thread()))
    assert late == [threading.current_thread()]  # added after the end: runs at once, here
  assert len(seen) == 1


def test_done_callback_error_is_the_saves_error_never_swallowed(tmp_path):
  with ofx.Checkpointer() as ckptr:
    handle = ckptr.save_async(str(tmp_path / "c"), {"state": state(1)})

    def fails(h):
      raise RuntimeError("recording the commit failed")

    handle.add_done_callback(fails)
    with pytest.raises(RuntimeError, match="recording the commit failed"):
      handle.wait()


def test_done_callback_sees_a_failed_save_and_the_manager_raises_it_next(tmp_path):
  """A real full disk: the save fails in the background; the callback sees it, the manager
  raises it at its next call."""
  big = {"state": {"w": np.ones((1 << 20,), np.float32) * 7}}  # 4 MiB on a 2 MiB disk
  with small_disk(str(tmp_path / "disk"), size="2m") as disk:
    seen = []
    with ofx.Checkpointer() as ckptr:
      handle = ckptr.save_async(os.path.join(disk, "c"), big)

      def done(h):
        try:
          h.wait()
        except ofx.StorageError as e:
          seen.append(e)

      handle.add_done_callback(done)
      with pytest.raises(ofx.StorageError):
        handle.wait()
    assert len(seen) == 1
    mngr = ofx.CheckpointManager(os.path.join(disk, "steps"))
    assert mngr.save(1, big, force=True)  # async: the failure comes from the background
    with pytest.raises(ofx.StorageError):
      mngr.wait()
    assert mngr.all_steps() == []
    mngr.close()


def test_manager_runs_no_thread_that_only_waits_for_a_save(tmp_path, monkeypatch):
  written, go_on = hold_commits(monkeypatch)
  with ofx.CheckpointManager(str(tmp_path), ofx.CheckpointPolicy(max_to_keep=1)) as mngr:
    assert mngr.save(1, {"state": state(1)}, force=True)
    assert written.wait(60)
    names = [t.name for t in threading.enumerate()]
    assert not [n for n in names if n.startswith("orbax_flax-commit")], names
    assert mngr.inflight_step() == 1 and mngr.all_steps() == []
    go_on.set()
    mngr.wait()
    assert mngr.all_steps() == [1] and mngr.inflight_step() is None
    (event,) = mngr.pop_events()
    assert event.step == 1 and event.reason == "forced" and event.nbytes > 0


# ------------------------------------------------------------------ composed by hand


@pytest.mark.parametrize("trigger,keep,saved,kept", [
    (ofx.any_of(ofx.EveryNSteps(4)), [ofx.KeepLast(2)], [4, 8, 12], [8, 12]),
    (ofx.any_of(ofx.EveryNSteps(5), ofx.OnSteps(frozenset({3}))), ofx.KeepLast(1), [3, 5, 10],
     [10]),
    (ofx.any_of(ofx.FirstStep(), ofx.EveryNSteps(6)), [ofx.KeepLast(1), ofx.KeepEvery(6)],
     [1, 6, 12], [6, 12]),
    (ofx.EveryNSteps(7), [], [7], [7]),
])
def test_trigger_and_keep_composed_by_hand(tmp_path, trigger, keep, saved, kept):
  d = str(tmp_path)
  got = []
  with ofx.CheckpointManager(d, trigger=trigger, keep=keep) as mngr:
    for step in range(1, 14):
      if mngr.save(step, {"state": state(step)}):
        got.append(step)
    mngr.wait()
    assert mngr.all_steps() == kept == on_disk(d)
  assert got == saved


def test_a_keep_rule_composed_by_hand_reads_the_metrics_unless_it_says_it_does_not(tmp_path):
  """A user's keep rule without ``reads_metadata`` is taken as reading the steps' metadata
  (documented: policy.KeepRule), so it sees the metrics each step recorded; read as not
  reading it (mutation review), it saw none and deleted the best step."""
  class KeepGoodLoss:  # no reads_metadata attribute
    def keep(self, steps):
      return {s.step for s in steps if s.metrics.get("loss", 1.0) < 0.5}

  with ofx.CheckpointManager(str(tmp_path), keep=[KeepGoodLoss()]) as mngr:
    for step, loss in ((1, 0.9), (2, 0.1), (3, 0.8), (4, 0.7)):
      mngr.save(step, {"state": state(step)}, force=True, metrics={"loss": loss})
    mngr.wait()
    assert mngr.all_steps() == [2, 4]  # the good one, and the newest (never deleted)


def test_time_trigger_composed_by_hand_follows_the_clock(tmp_path):
  clock = FakeClock()
  got = []
  trigger = ofx.any_of(ofx.EveryNSteps(100), ofx.EveryNSeconds(10.0))
  with ofx.CheckpointManager(str(tmp_path), trigger=trigger, clock=clock) as mngr:
    for step in range(1, 30):
      clock.t += 3.0
      if mngr.save(step, {"state": state(step)}):
        mngr.wait()
        got.append((step, mngr.step_info(step).reason))
  assert got == [(4, "time"), (8, "time"), (12, "time"), (16, "time"), (20, "time"),
                 (24, "time"), (28, "time")]


@pytest.mark.parametrize("kwargs,match", [
    (dict(keep=5), r"keep=5: must be keep rules, e\.g\. \[ofx\.KeepLast\(3\)"),
    (dict(keep=["last 3"]), r"keep=\['last 3'\]: must be keep rules"),
    (dict(trigger=100), r"trigger=100: must be a trigger, e\.g\. ofx\.any_of"),
])
def test_bad_hand_composed_setting_is_named_before_anything_is_written(tmp_path, kwargs, match):
  d = tmp_path / "ckpt"
  with pytest.raises(TypeError, match=match):
    ofx.CheckpointManager(str(d), **kwargs)
  assert not d.exists()


def test_a_step_that_is_not_committed_is_named_with_those_that_are(tmp_path):
  with ofx.CheckpointManager(str(tmp_path)) as mngr:
    mngr.save(3, {"state": state(3)}, force=True)
    mngr.wait()
    for call in (mngr.step_info, mngr.restore):
      with pytest.raises(ofx.CheckpointNotFoundError, match=r"step 9 is not a committed checkpoint"
                         r" in .*; committed steps: \[3\]"):
        call(9)


# ------------------------------------------------------------------ one signature per verb


def test_manager_save_takes_dtype_and_restore_takes_transforms_and_a_budget(tmp_path):
  t = ofx.engine.transforms
  with ofx.CheckpointManager(str(tmp_path)) as mngr:
    mngr.save(1, {"state": {"w": np.arange(6, dtype=np.float32)}}, force=True, dtype="bfloat16")
    mngr.wait()
    meta = mngr.metadata(1)
    assert [a.dtype for a in meta.items["state"].arrays] == ["bfloat16"]
    assert meta.casts == {"state/w": "float32"}
    out = mngr.restore(1, {"state": {"v": np.zeros(6, np.float32)}}, allow_lossy_casts=True,
                       transforms=[t.Rename(r"w", "v")], max_host_bytes=8)
    np.testing.assert_array_equal(out["state"]["v"], np.arange(6, dtype=np.float32))
