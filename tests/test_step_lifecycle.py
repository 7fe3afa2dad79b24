"""Regression tests of a step's life: rollback, retention, references, sweeps, a second manager.

Each one reproduces a defect of ``../shared/repros/r4`` (named in its docstring)
through the public API; each failed on the code before the registry became the
one owner of a directory's steps (``orbax_flax/registry.py``).
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import disks
import jobs
import orbax_flax as ofx
from orbax_flax.manager import leases

FROZEN = np.random.default_rng(0).standard_normal((4, 256, 1280)).astype(np.float32)


def items(tag, changed=1):
  """Four 1.25 MiB (chunked, not packed) arrays, the first ``changed`` of which carry ``tag`` (the rest borrowable)."""
  return {"state": {**{f"p{i}": FROZEN[i] + (tag if i < changed else 0) for i in range(4)},
                    "b": np.full(8, tag, np.float32)}}


def restores_as(path, want):
  got = ofx.restore(path)["state"]
  return all(np.array_equal(np.asarray(got[k]), v) for k, v in want["state"].items())


def test_a_restore_of_the_latest_step_calls_off_an_earlier_rollback(tmp_path):
  """rollback_not_cancelled: restore(1), restore(3) (the newest), save(4) kept 2 and 3."""
  with ofx.CheckpointManager(str(tmp_path), ofx.CheckpointPolicy(async_save=False)) as m:
    for s in (1, 2, 3):
      m.save(s, items(s), force=True)
    m.restore(1)
    m.restore(3)
    m.save(4, items(4), force=True)
    m.wait()
    assert m.all_steps() == [1, 2, 3, 4]


@pytest.mark.parametrize("how", ["rollback", "force"])
def test_steps_saved_after_a_rollback_or_a_forced_resave_restore(tmp_path, how):
  """diff_rollback_self_reference: the new step 2 borrows the bytes of the old step 2 (moved
  aside to ``2.ofx-base-<gen>``); a text search found that generation in the new step's own
  ``bases`` list, so the reader looked in the new ``2/``: it and every later step failed."""
  d = str(tmp_path)
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=True, async_save=False)) as m:
    m.save(1, items(1), force=True)
    m.save(2, items(2), force=True)
    m.save(3, items(2), force=True)  # 3 borrows all of 2's bytes
    if how == "rollback":
      m.restore(1)
    m.save(2, items(2), force=True)  # the same bytes again: borrowed from the old 2, aside
    m.save(3 if how == "rollback" else 4, items(2), force=True)
    m.save(5, items(2), force=True)
    m.wait()
    listed = m.all_steps()
  assert listed == ([1, 2, 3, 5] if how == "rollback" else [1, 2, 3, 4, 5])
  for s in listed:
    assert restores_as(os.path.join(d, str(s)), items(1 if s == 1 else 2)), s


@pytest.mark.parametrize("differential", [False, True])
def test_a_save_right_after_a_rollback_is_not_undone_by_the_late_deleter(tmp_path, monkeypatch,
                                                                         differential):
  """rollback_abandoned_delete_race: the deleter decided to delete the abandoned 10 and acted
  after the new 10 had committed (differential: the newest step was lost; plain: save(10)
  raised CheckpointExistsError). The deleter is made slow here, as on a loaded machine."""
  slow = leases.leased_steps
  monkeypatch.setattr(leases, "leased_steps", lambda *a, **k: (time.sleep(0.5), slow(*a, **k))[1])
  d = str(tmp_path)
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=differential,
                                                     async_save=False)) as m:
    for s in range(1, 11):
      m.save(s, items(s), force=True)
    m.restore(8)
    m.save(9, items(90), force=True)
    m.save(10, items(100), force=True)
    m.wait()
    assert m.all_steps() == list(range(1, 11))
  assert restores_as(os.path.join(d, "10"), items(100))
  assert restores_as(os.path.join(d, "9"), items(90))


def test_a_save_whose_base_was_deleted_by_hand_writes_in_full(tmp_path):
  """diff_base_deleted_by_hand: after ``rm -rf`` of a base, the next save committed a step
  that borrowed from it and could not be restored."""
  d = str(tmp_path)
  pol = ofx.CheckpointPolicy(differential=True, async_save=False)
  with ofx.CheckpointManager(d, pol) as m:
    for s in range(3):
      m.save(s, items(s), force=True)
  shutil.rmtree(os.path.join(d, "0"))
  with pytest.raises(ofx.CheckpointFormatError, match="step '0'"):
    ofx.restore(os.path.join(d, "2"))  # a step that borrowed from it says so
  listing = subprocess.run([sys.executable, "-m", "orbax_flax", "list", d],
                           capture_output=True, text=True, check=False)
  assert listing.returncode == 1, listing  # `list` names the steps that lost their base
  gone = [l.split()[0] for l in listing.stdout.splitlines()
          if "BASE GONE" in l and "borrows from step 0" in l]
  assert gone == ["1", "2"], listing.stdout
  with ofx.CheckpointManager(d, pol) as m:
    m.save(3, items(3), force=True)
  assert restores_as(os.path.join(d, "3"), items(3))


def test_an_overwrite_of_a_step_others_borrow_from_keeps_their_bytes(tmp_path):
  """diff_convert: ``convert S S --overwrite`` (a save with overwrite=True) removed the old
  generation that later steps borrow from."""
  d = str(tmp_path)
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=True, async_save=False)) as m:
    for s in range(3):
      m.save(s, items(min(s, 1)), force=True)  # 2 borrows all of 1's bytes
  r = subprocess.run([sys.executable, "-m", "orbax_flax", "convert", f"{d}/1", f"{d}/1",
                      "--overwrite"], capture_output=True, text=True, env=jobs.env_for(1))
  assert r.returncode == 0, r.stderr
  assert restores_as(os.path.join(d, "2"), items(1))
  assert restores_as(os.path.join(d, "1"), items(1))
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=True, max_to_keep=1)) as m:
    m.save(3, items(3), force=True)  # retention, then the sweep, runs on the moved-aside data
  assert restores_as(os.path.join(d, "3"), items(3))


@pytest.mark.parametrize("differential", [False, True])
def test_retention_never_changes_a_linked_step_outside_the_directory(tmp_path, differential):
  """symlink_step_retire: retention renamed ``_CHECKPOINT`` through a step linked in from
  another run, which that run's own manager later deleted."""
  other, run = str(tmp_path / "other"), str(tmp_path / "run")
  with ofx.CheckpointManager(other, ofx.CheckpointPolicy(differential=True)) as m:
    m.save(5, items(5, changed=0), force=True)
  os.makedirs(run)
  os.symlink(os.path.join(other, "5"), os.path.join(run, "5"))
  pol = ofx.CheckpointPolicy(max_to_keep=1, differential=differential)
  with ofx.CheckpointManager(run, pol) as m:
    m.restore()
    for s in (6, 7, 8):
      m.save(s, items(s, changed=0), force=True)
  ofx.CheckpointManager(run, pol).close()  # a restart: its start-up sweep
  with ofx.CheckpointManager(other, ofx.CheckpointPolicy(differential=True)) as m:
    assert m.all_steps() == [5]
  assert restores_as(os.path.join(other, "5"), items(5, changed=0))
  assert restores_as(os.path.join(run, "8"), items(8, changed=0))


@pytest.mark.parametrize("differential", [False, True])
def test_a_save_of_a_linked_step_is_refused_and_never_writes_through_the_link(tmp_path,
                                                                              differential):
  """A rollback abandoned a step linked in from another run; the new run's interval save of
  that number wrote through the link, replacing the other run's committed step with this
  run's values (the save follows a link given as its path). A manager's save of a linked step
  is refused on every path (a rollback's run, force=True), naming the link and the way on;
  the rollback still holds, and the other run's step is as it saved it."""
  other, run = str(tmp_path / "other"), str(tmp_path / "run")
  with ofx.CheckpointManager(other) as m:
    m.save(6, items(6, changed=0), force=True)
  pol = ofx.CheckpointPolicy(save_interval_steps=1, async_save=False, differential=differential)
  with ofx.CheckpointManager(run, pol) as m:
    m.save(5, items(5, changed=0))
  os.symlink(os.path.join(other, "6"), os.path.join(run, "6"))
  link = os.path.join(run, "6")
  with ofx.CheckpointManager(run, pol) as m:
    m.save(7, items(7, changed=0))
    with pytest.raises(ValueError, match=r"step 6 of .* is a link to .*other/6.*Nothing was"
                                         r" written. Remove the link"):
      m.save(6, items(66, changed=0), force=True)
    m.restore(5)  # a rollback: 6 and 7 abandoned
    with pytest.raises(ValueError, match=r"step 6 of .* is a link"):
      m.save(6, items(66, changed=0))
    assert restores_as(os.path.join(other, "6"), items(6, changed=0))
    os.remove(link)  # the way the error names
    m.save(6, items(66, changed=0))
    m.save(7, items(77, changed=0))
    assert m.all_steps() == [5, 6, 7]
  assert restores_as(os.path.join(other, "6"), items(6, changed=0))
  assert restores_as(os.path.join(run, "6"), items(66, changed=0))
  assert restores_as(os.path.join(run, "7"), items(77, changed=0))


def test_a_second_manager_sweeps_nothing_a_writer_is_writing(tmp_path):
  """second_manager_sweeps_inflight: an evaluator's manager, started while the trainer's
  rollback save (below the latest step) was in flight, removed it as debris."""
  d = str(tmp_path)
  m = ofx.CheckpointManager(d, ofx.CheckpointPolicy(async_save=True))
  big = lambda v: {"state": {"w": np.full((8, 1 << 20), v, np.float32)}}  # noqa: E731
  m.save(5, big(5), force=True)
  m.save(10, big(10), force=True)
  m.wait()
  m.restore(5)
  m.save(6, big(6), force=True)
  evaluator = ofx.CheckpointManager(d)  # while step 6 is written
  assert evaluator.all_steps() == [5, 10]
  with pytest.raises(ofx.WriterConflictError, match="writer already"):
    evaluator.save(11, big(11), force=True)  # (a step below 10 is refused earlier)
  evaluator.close()
  m.wait()
  assert (np.asarray(ofx.restore(os.path.join(d, "6"))["state"]["w"]) == 6).all()
  m.close()
  with ofx.CheckpointManager(d) as successor:  # the writer has gone: the next one may write
    successor.save(11, big(11), force=True)


def test_a_writer_that_died_leaves_a_lease_the_next_job_takes_over(tmp_path):
  """The lease survives a SIGKILL and is taken over at once on the same host."""
  d = str(tmp_path)
  code = ("import sys, os, numpy as np, orbax_flax as ofx\n"
          "m = ofx.CheckpointManager(sys.argv[1])\n"
          "m.save(1, {'s': {'w': np.ones(4)}}, force=True); m.wait()\n"
          "print('SAVED', flush=True); os.kill(os.getpid(), 9)\n")
  r = subprocess.run([sys.executable, "-c", code, d], capture_output=True, text=True,
                     env=jobs.env_for(1))
  assert "SAVED" in r.stdout and r.returncode == -9
  with open(os.path.join(d, leases.WRITER)) as f:
    assert json.load(f)["purpose"] == "writer"  # left behind by the killed job
  with ofx.CheckpointManager(d) as m:
    m.save(2, {"s": {"w": np.ones(4)}}, force=True)
    m.wait()
    assert m.all_steps() == [1, 2]


def test_the_object_store_index_is_repaired_only_by_the_writer(s3_server):
  """objstore_reindex_race: a second manager rewrote the step index from a listing taken
  before the trainer committed 3 and deleted 1 (3 vanished from listings, 1 came back)."""
  url = s3_server.url(s3_server.new_bucket(), "run")
  m = ofx.CheckpointManager(url, ofx.CheckpointPolicy(max_to_keep=2, async_save=False))
  m.save(1, items(1), force=True)
  m.save(2, items(2), force=True)
  second = ofx.CheckpointManager(url)
  m.save(3, items(3), force=True)
  m.wait()
  second.close()
  assert list(ofx.checkpoints_iterator(url, start_after=2, timeout=0)) == [3]
  assert ofx.CheckpointManager(url).all_steps() == [2, 3]
  m.close()


def test_every_process_applies_the_same_keep_decision(tmp_path):
  """stale_steps_other_process: keep rules that read what differs between processes (a metric
  each host computes, host clocks 40 ms apart) were applied by each process to its own view;
  process 1 listed a step process 0 had deleted. Two real processes."""
  res = jobs.run("keep_worker.py", [str(tmp_path)], 2, 1).check()
  results = [json.loads(l.split(" ", 1)[1]) for out in res.outputs for l in out.splitlines()
             if l.startswith("RESULT")]
  assert len(results) == 2 and results[0] == results[1], res.outputs
  assert results[0] == sorted(int(n) for n in os.listdir(tmp_path) if n.isdigit())


@pytest.mark.parametrize("restarts", [False, True])
def test_a_flipped_bit_in_a_borrowed_chunk_reaches_a_bounded_number_of_saves(tmp_path, caplog,
                                                                             restarts):
  """diff_bitflip_amplified: one flipped bit in a frozen chunk of the first step used to damage
  every later step (each borrows it by its recorded hash, none rewrote it). Each save now reads
  back a rolling quarter of what it borrows: the save whose turn covers the damaged chunk
  writes it again from the live state. The steps saved before are damaged and ``verify``
  of each (reading what it borrows) says so; that save and every later one restore bitwise.
  The turn is recorded in each manifest: a job that restarts before every save (a new
  manager each time) goes on with the next turn, never back to the first."""
  from orbax_flax.differential import differ  # pylint: disable=import-outside-toplevel
  d = str(tmp_path)
  last = differ.SCRUB_SAVES + 1
  policy = ofx.CheckpointPolicy(differential=True, async_save=False)
  m = ofx.CheckpointManager(d, policy)
  m.save(0, items(0, changed=0), force=True)  # the four large arrays never change: borrowed
  disks.flip_a_bit_in_the_largest_data_file(os.path.join(d, "0"))
  healed = []
  for s in range(1, last + 1):
    if restarts:
      m.close()
      m = ofx.CheckpointManager(d, policy)
    caplog.clear()
    with caplog.at_level("WARNING", logger="orbax_flax"):
      m.save(s, items(s, changed=0), force=True)
    if any("failed their read-back" in r.getMessage() and "not the recorded ones" in r.getMessage()
           for r in caplog.records):
      healed.append(s)
  m.close()
  assert len(healed) == 1 and healed[0] <= differ.SCRUB_SAVES, healed
  for s in range(0, healed[0]):
    with pytest.raises(ofx.CheckpointCorruptedError):
      ofx.verify(os.path.join(d, str(s)))
    with pytest.raises(ofx.CheckpointCorruptedError):
      ofx.restore(os.path.join(d, str(s)))
  for s in range(healed[0], last + 1):
    assert restores_as(os.path.join(d, str(s)), items(s, changed=0)), s
    assert ofx.verify(os.path.join(d, str(s))) > 0


def test_a_plain_manager_opened_before_differential_steps_appear_keeps_what_they_borrow(tmp_path):
  """A plain manager built over an empty directory chose the plain deletion once, at
  construction; differential steps another job wrote before its first save were then deleted
  whole while a kept step borrowed from them (restore raised 'references data of step 0')."""
  d = str(tmp_path)
  plain = ofx.CheckpointManager(d, ofx.CheckpointPolicy(max_to_keep=2, async_save=False))
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=True, async_save=False)) as m:
    for s in range(3):
      m.save(s, items(s), force=True)  # 1 and 2 borrow the three unchanged arrays from 0
  with plain:
    plain.save(3, items(3), force=True)  # the keep rules drop 0 and 1
    assert plain.all_steps() == [2, 3]
  assert restores_as(os.path.join(d, "2"), items(2))
  assert restores_as(os.path.join(d, "3"), items(3))


_KILLED_AFTER_ROLLBACK = r"""
import os, signal, sys
import numpy as np, orbax_flax as ofx
d = sys.argv[1]
with ofx.CheckpointManager(d, ofx.CheckpointPolicy(async_save=False)) as m:
  for s in range(1, 41):
    m.save(s, {"state": {"w": np.full(4, s)}}, force=True)
m = ofx.CheckpointManager(d)
m.restore(5)                                     # a loss spike: back to step 5
m.save(6, {"state": {"w": np.full(4, -6)}}, force=True)
m.wait_for_save()                                # step 6 of the new run is committed
os.kill(os.getpid(), signal.SIGKILL)             # and the job dies (OOM, a lost node)
"""


def test_a_rollback_holds_from_its_first_commit_when_the_job_is_killed_right_after(tmp_path):
  """rollback_kill_after_first_commit: the steps a rollback abandons are deleted after the
  new run's first commit, in the background, oldest first; a job killed in between
  restarted on [5, 6, ..., 40] and resumed step 40 of the abandoned run."""
  d = str(tmp_path / "run")
  p = subprocess.run([sys.executable, "-c", _KILLED_AFTER_ROLLBACK, d], env=jobs.env_for(1),
                     capture_output=True, text=True, timeout=300, check=False)
  assert p.returncode == -9, p.stderr[-3000:]
  with ofx.CheckpointManager(d) as m:
    assert m.all_steps() == [1, 2, 3, 4, 5, 6] and m.latest_step() == 6
    assert m.restore()["state"]["w"].tolist() == [-6] * 4
    m.save(7, {"state": {"w": np.full(4, -7)}}, force=True)  # the writer deletes the rest
  assert sorted(int(n) for n in os.listdir(d) if n.isdigit()) == list(range(1, 8))
  assert not os.path.exists(os.path.join(d, ".rollbacks"))


@pytest.mark.parametrize("differential", [False, True])
def test_a_rollback_holds_while_an_evaluator_reads_a_step_it_abandons(tmp_path, differential):
  """rollback_abandoned_step_kept_by_evaluator_lease: an evaluator read step 30 when the run
  rolled back to 10 committed; 30 was kept for it and never deleted, and after the job the
  directory's latest step was the abandoned 30 (a resume continued the abandoned run)."""
  d = str(tmp_path)
  policy = ofx.CheckpointPolicy(differential=differential, async_save=False)
  with ofx.CheckpointManager(d, policy) as m:
    for s in (10, 20, 30):
      m.save(s, items(s), force=True)
  evaluator = ofx.checkpoints_iterator(d, timeout=0)
  assert [next(evaluator) for _ in range(3)] == [10, 20, 30]  # it reads 30 (its reader lease)
  with ofx.CheckpointManager(d, policy) as m:
    m.restore(10)
    m.save(11, items(11), force=True)
    m.save(20, items(200), force=True)  # the new run's own step 20 replaces the abandoned one
    m.wait()
    assert m.all_steps() == [10, 11, 20]
  assert os.path.isdir(os.path.join(d, "30"))  # still there: the evaluator reads it
  with ofx.CheckpointManager(d, policy) as m:  # the job restarts (or any reader)
    assert m.all_steps() == [10, 11, 20] and m.latest_step() == 20
    assert restores_as(m.step_path(20), items(200))
  assert list(ofx.checkpoints_iterator(d, timeout=0)) == [10, 11, 20]  # a new evaluator too
  listing = subprocess.run([sys.executable, "-m", "orbax_flax", "list", d], env=jobs.env_for(1),
                           capture_output=True, text=True, check=False)
  assert listing.returncode == 0, listing.stderr
  assert [l.split()[0] for l in listing.stdout.splitlines()[2:5]] == ["10", "11", "20"]
  assert "3 committed step(s)" in listing.stdout and "abandoned by a rollback, not steps: 30" \
      in listing.stdout, listing.stdout
  evaluator.close()  # done with 30: its lease goes
  with ofx.CheckpointManager(d, policy) as m:  # the next writer deletes it
    m.save(21, items(21), force=True)
  assert sorted(int(n) for n in os.listdir(d) if n.isdigit()) == [10, 11, 20, 21]
  assert not os.path.exists(os.path.join(d, ".rollbacks"))
  for s, tag in ((10, 10), (11, 11), (20, 200), (21, 21)):
    assert restores_as(os.path.join(d, str(s)), items(tag)), s


def _tiered_run(workdir, local, last, **policy):
  """Trains ``w += 1`` to ``last`` through the callback with a local tier (every 5 steps) and
  persistent saves every 20; returns (restored_step, w after the resume)."""
  policy = ofx.CheckpointPolicy(local_directory=local, local_save_interval_steps=5,
                                save_interval_steps=20, save_final_step=False, **policy)
  with ofx.CheckpointCallback(workdir, policy) as ckpt:
    state = ckpt.restore_or_init({"w": np.zeros(1000)})
    resumed = (ckpt.restored_step, float(state["w"][0]))
    for step in range((ckpt.restored_step or 0) + 1, last + 1):
      state = {"w": state["w"] + 1}
      ckpt.on_step_end(step, state)
  return resumed


@pytest.mark.parametrize("on_unreadable", ["raise", "fallback"])
def test_a_damaged_persistent_latest_still_lets_the_newer_local_step_resume(tmp_path,
                                                                            on_unreadable):
  """unreadable_persistent_latest: step 40's manifest damaged, local step 45 intact. Its
  timeline was taken as "" and every local step dropped as "of a timeline a rollback
  abandoned": "raise" could not start, "fallback" rolled back to step 20."""
  workdir, local = str(tmp_path / "wd"), str(tmp_path / "local")
  _tiered_run(workdir, local, 47, on_unreadable_checkpoint=on_unreadable)
  path = os.path.join(workdir, "checkpoints", "40", "_CHECKPOINT")
  with open(path, "r+b") as f:  # one flipped byte in the middle of the manifest
    data = bytearray(f.read())
    data[len(data) // 2] ^= 0xFF
    f.seek(0)
    f.write(data)
  assert _tiered_run(workdir, local, 50, on_unreadable_checkpoint=on_unreadable) == (45, 45.0)


def test_a_run_started_over_after_its_steps_were_deleted_takes_no_local_step_of_the_old(
    tmp_path):
  """deleting_every_persistent_step: ``rm -rf workdir/checkpoints/*`` spares the hidden
  ``.timeline`` key, so the new run took the old run's timeline and resumed its local step 25
  instead of starting from scratch."""
  workdir, local = str(tmp_path / "wd"), str(tmp_path / "local")
  assert _tiered_run(workdir, local, 27) == (None, 0.0)  # local step 25, persistent step 20
  checkpoints = os.path.join(workdir, "checkpoints")
  for name in os.listdir(checkpoints):
    if not name.startswith("."):  # what the shell's glob removes
      shutil.rmtree(os.path.join(checkpoints, name))
  assert _tiered_run(workdir, local, 3) == (None, 0.0)


def test_a_restore_to_look_at_an_older_step_then_training_on_abandons_nothing(tmp_path):
  """restore(best_step()) in the middle of training (to evaluate it), then the next save at
  the loop's own step, above the newest: taken for a rollback, it deleted every step newer
  than the best one (20 and 30 here) with keep-all."""
  d = str(tmp_path)
  policy = ofx.CheckpointPolicy(keep_best=0, best_metric="loss", async_save=False)
  with ofx.CheckpointManager(d, policy) as m:
    for s, loss in ((10, 0.1), (20, 0.5), (30, 0.7)):
      m.save(s, items(s), force=True, metrics={"loss": loss})
    assert m.best_step() == 10
    assert restores_as(m.step_path(10), items(10))
    m.restore(m.best_step())  # evaluate the best step
    m.save(40, items(40), force=True, metrics={"loss": 0.3})  # and train on
    assert m.all_steps() == [10, 20, 30, 40]
  with ofx.CheckpointManager(d, policy) as m:
    assert m.all_steps() == [10, 20, 30, 40] and m.latest_step() == 40
    for s in (10, 20, 30, 40):
      assert restores_as(m.step_path(s), items(s)), s


@pytest.mark.parametrize("refused_for", ["leaf", "dtype"])
@pytest.mark.parametrize("refused_at", ["below", "above"])
def test_a_refused_save_changes_nothing_a_rollback_decides(tmp_path, refused_at, refused_for):
  """A save refused for its input (a leaf it cannot write; a dtype= no one knows), nothing
  written, between a restore of an older step and the next save: below the newest, it counted
  as the new run's first save (its rollback record was written before the refusal), so a save
  above every abandoned step then ended the old run and deleted 2-4 (the long model run found
  it); above, it called the rollback off, and training on from the restored step was refused
  as a save below the newest."""
  with ofx.CheckpointManager(str(tmp_path), ofx.CheckpointPolicy(async_save=False)) as m:
    for s in (1, 2, 3, 4):
      m.save(s, items(s), force=True)
    m.restore(1)
    bad, options = items(99), {"dtype": "bfloat17"}  # (a typo)
    if refused_for == "leaf":
      bad["state"]["bad"], options = object(), {}
    with pytest.raises(ofx.UnsupportedLeafError if refused_for == "leaf" else ValueError):
      m.save(2 if refused_at == "below" else 5, bad, force=True, **options)
    if refused_at == "below":  # the restore was a look: training goes on above the newest
      m.save(5, items(5), force=True)
      want = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5}
    else:  # a rollback: training goes on from the restored step
      m.save(2, items(20), force=True)
      want = {1: 1, 2: 20}
    m.wait()
    assert m.all_steps() == sorted(want)
  with ofx.CheckpointManager(str(tmp_path)) as m:
    assert m.all_steps() == sorted(want)
    for s, tag in want.items():
      assert restores_as(m.step_path(s), items(tag)), s


def _gate_commits(monkeypatch):
  """An event that holds every save's commit until set (set: commits go through): a save is
  kept in flight for as long as a test needs, whatever the machine's speed."""
  from orbax_flax.engine import saving
  gate, commit = threading.Event(), saving.commit
  gate.set()

  def gated(*args, **kwargs):
    assert gate.wait(120), "the test never let the commit through"
    return commit(*args, **kwargs)
  monkeypatch.setattr(saving, "commit", gated)
  return gate


def _rolled_back_with_a_save_held(m, gate):
  """Steps 10-40, then a rollback to 20 whose save of 25 is held in flight at ``gate``."""
  for s in (10, 20, 30, 40):
    m.save(s, items(s), force=True)
    m.wait()
  m.restore(20)
  gate.clear()
  m.save(25, items(25), force=True)


def test_a_second_rollback_to_a_step_the_first_abandoned_keeps_it(tmp_path, monkeypatch):
  """restore(20), a save of 25 in flight, then restore(30) (back to 30 instead): 25's commit
  ended the first rollback and deleted 30, the step restored and trained from, and 25, of
  the run left, stayed a step: [10, 20, 25, 31]."""
  gate, d = _gate_commits(monkeypatch), str(tmp_path)
  with ofx.CheckpointManager(d) as m:
    _rolled_back_with_a_save_held(m, gate)
    assert restores_as(m.step_path(30), items(30)) and m.inflight_step() == 25
    m.restore(30)  # while 25 is in flight
    gate.set()
    m.wait()
    assert 30 in m.all_steps() and 40 not in m.all_steps()
    m.save(31, items(31), force=True)
    m.wait()
    assert m.all_steps() == [10, 20, 30, 31]
  with ofx.CheckpointManager(d) as m:
    assert m.all_steps() == [10, 20, 30, 31]
    for s in (10, 20, 30, 31):
      assert restores_as(m.step_path(s), items(s)), s


def test_rollbacks_called_off_by_restoring_the_latest_abandon_nothing_on_disk(tmp_path,
                                                                              monkeypatch):
  """restore(20), a save of 25 in flight, restore(10), then restore(40), the latest: the
  manager itself kept every step, but the first rollback's record stayed in the directory;
  once 25 committed, every other job listed [10, 20, 25] and the next writer deleted 30
  and 40."""
  gate, d = _gate_commits(monkeypatch), str(tmp_path)
  with ofx.CheckpointManager(d) as m:
    _rolled_back_with_a_save_held(m, gate)
    m.restore(10)
    m.restore(40)  # back where the run was: no rollback
    gate.set()
    m.wait()
    assert m.all_steps() == [10, 20, 25, 30, 40]
  with ofx.CheckpointManager(d) as m:  # another job, then the next writer
    assert m.all_steps() == [10, 20, 25, 30, 40]
    m.save(50, items(50), force=True)
    m.wait()
    assert m.all_steps() == [10, 20, 25, 30, 40, 50]
  for s in (10, 20, 25, 30, 40, 50):
    assert restores_as(os.path.join(d, str(s)), items(s)), s


def test_a_restore_of_an_older_step_on_one_process_of_a_job_is_refused_and_changes_nothing(
    tmp_path):
  """Only process 1 of 2 restores step 1 of 3 (a rank-conditioned look): it waited for process
  0's timeline, then raised a bare coordination timeout whose advice (a longer timeout) was
  wrong, its rollback begun on that process alone. It is refused, naming the fix (every
  process restores together, or ofx.restore of the step's path), before anything changed:
  the job saves on."""
  res = jobs.run("rollback_worker.py", [f"--dir={tmp_path}"], 2, 2, timeout=120).check()
  outs = [json.loads(o.split("RESULT ", 1)[1].splitlines()[0]) for o in res.outputs]
  assert "is a rollback" in outs[1]["restore"] and "ofx.restore(manager.step_path(1))" in (
      outs[1]["restore"]), outs[1]
  for out in outs:
    assert out["steps"] == [1, 2, 3, 4] and all(out["values"]), out


def test_keep_rules_wait_while_a_rollback_waits_for_its_first_commit(tmp_path, monkeypatch):
  """max_to_keep=2, steps 10-30, a save of 40 held in flight, restore(20) (abandoning 30 and
  40), 40 commits after it, then the new run saves 21: [20, 21]. Keep rules that ran at 40's
  late commit (the abandoned steps still listed) deleted the restored step 20 (mutation
  review; the lifecycle model takes either order of that commit and the restore)."""
  gate, d = _gate_commits(monkeypatch), str(tmp_path)
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(max_to_keep=2)) as m:
    for s in (10, 20, 30):
      m.save(s, items(s), force=True)
      m.wait()
    gate.clear()
    m.save(40, items(40), force=True)
    assert m.inflight_step() == 40
    assert restores_as(m.step_path(20), items(20))
    m.restore(20)  # a rollback while 40 is held
    gate.set()
    m.wait_for_save()
    m.save(21, items(21), force=True)
    m.wait()
    assert m.all_steps() == [20, 21]
  for s in (20, 21):
    assert restores_as(os.path.join(d, str(s)), items(s)), s


def test_a_new_step_below_a_step_being_saved_is_refused(tmp_path, monkeypatch):
  """A save of 20 in flight in a fresh directory, then save(10) (a run started over by
  mistake): refused as below a committed step is, nothing written. Counting committed steps
  only (mutation review), it returned True and max_to_keep=1 dropped step 10 at 20's
  commit, with no word."""
  gate, d = _gate_commits(monkeypatch), str(tmp_path)
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(max_to_keep=1)) as m:
    gate.clear()
    m.save(20, items(20), force=True)
    with pytest.raises(ValueError, match=r"step 10 is below the newest step 20"):
      m.save(10, items(10), force=True)
    gate.set()
    m.wait()
    assert m.all_steps() == [20]
  assert sorted(n for n in os.listdir(d) if not n.startswith(".")) == ["20"]
