"""The local tier's promises that its mutation review found untested (orbax_flax/tiers/): each
test here fails with one mutant of the tier applied (a checksum over part of a shard, a copy
not fsynced before its record, a replica write error ignored, a shard of another box read
after a change of mesh, prune by step number after a rollback, a lineage bound off by one,
a killed save's leftover kept, a plan mixing one save's own copy with another's replica).
(The review's defect, a layout hidden by an older one's step, is in test_tiers.py.)
"""
import glob
import logging
import os

import numpy as np
import pytest

import disks
import orbax_flax as ofx
from orbax_flax.tiers import local
from orbax_flax.tiers import placement

HERE = os.path.dirname(os.path.abspath(__file__))


def _proc_dir(local_dir, run, p=0):
  return os.path.join(local_dir, local.run_dir(run), f"process_{p}")


def _flip(path, at_from_end):
  with open(path, "r+b") as f:
    f.seek(-at_from_end, 2)
    b = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([b[0] ^ 0x10]))


def test_damage_past_the_first_16_mib_of_a_shard_is_detected(tmp_path, caplog):
  """A shard larger than one CRC segment (16 MiB): a flipped bit in its second segment must
  send the resume to the persistent tier, not restore the damaged bytes."""
  shm, workdir = str(tmp_path / "shm"), str(tmp_path / "run")
  policy = ofx.CheckpointPolicy(local_directory=shm, local_save_interval_steps=5,
                                save_interval_steps=10, save_final_step=False)
  big = lambda v: {"w": np.full(5 << 20, v, np.float32)}  # noqa: E731  # 20 MiB, 2 segments
  with ofx.CheckpointCallback(workdir, policy) as ckpt:
    ckpt.restore_or_init(big(0.0))
    for step in range(1, 16):
      ckpt.on_step_end(step, big(float(step)))
  root = _proc_dir(shm, os.path.join(workdir, "checkpoints"))
  assert sorted(os.listdir(root)) == ["15"]
  with ofx.CheckpointCallback(workdir, policy) as ckpt:  # intact: every segment's CRC matches
    got = ckpt.restore_or_init(big(0.0))
  assert ckpt.restored_step == 15 and np.all(got["w"] == 15.0)
  _flip(os.path.join(root, "15", local.OWN), 100)  # in the shard's last (second) segment
  with caplog.at_level(logging.WARNING, logger="orbax_flax"):
    with ofx.CheckpointCallback(workdir, policy) as ckpt:
      got = ckpt.restore_or_init(big(0.0))
  assert "checksum mismatch" in caplog.text, caplog.text
  assert ckpt.restored_step == 10 and np.all(got["w"] == 10.0), (ckpt.restored_step, got["w"][-5:])


def _job(workdir, policy, last, tag, n, devices):
  import json  # pylint: disable=g-import-not-at-top
  import jobs  # pylint: disable=g-import-not-at-top
  res = jobs.run(os.path.join(HERE, "tier_holes_worker.py"),
                 [f"--workdir={workdir}", f"--policy={json.dumps(policy)}", f"--last={last}",
                  f"--tag={tag}"], n, devices).check()
  return res.outputs


def _run_here(workdir, policy, last, tag):
  with ofx.CheckpointCallback(workdir, ofx.CheckpointPolicy(**policy)) as ckpt:
    state = ckpt.restore_or_init({"w": np.zeros(3), "run": np.zeros(1)})
    got = (ckpt.restored_step, float(state["run"][0]))
    for step in range((ckpt.restored_step or 0) + 1, last + 1):
      ckpt.on_step_end(step, {"w": np.full(3, float(step)), "run": np.full(1, float(tag))})
  return got


def test_a_replica_of_another_save_is_never_read_beside_an_own_copy():
  """Three processes (ring 0 -> 1 -> 2 -> 0, replicas=1); two runs each died between the
  commits of step 6: run X's save on process 0 (and on 1, whose disk is then lost), run Y's
  on process 2. Process 1's replica on process 2 is Y's, process 0's own copy X's: no plan
  may assemble step 6 from both."""
  H = placement.Holdings
  h = [H([6], {2: [6]}, 3, {6: "x"}), H([], {}, 3, {}), H([6], {1: [6]}, 3, {6: "y"})]
  assert placement.plan_restore(h, None) is None
  h = [H([4, 6], {2: [4, 6]}, 3, {4: "o", 6: "x"}), H([4], {0: [4]}, 3, {4: "o"}),
       H([4, 6], {1: [4, 6]}, 3, {4: "o", 6: "y"})]
  assert placement.plan_restore(h, None) == placement.RestorePlan(4, (0, 1, 2), "o")


def test_a_local_step_is_durable_before_its_record_says_it_is_committed(tmp_path, monkeypatch):
  """The order of a local save's system calls (no crash is simulated): the blob fsynced, its
  directory renamed into place and the parent fsynced, the record written beside its name,
  fsynced, renamed over it, the step directory fsynced. Without it a power loss after the
  save can leave a COMMITTED record over a blob of zeros (the checksums then refuse it: the
  step is lost) or a torn record."""
  shm = str(tmp_path / "shm")
  events = []
  policy = ofx.CheckpointPolicy(local_directory=shm, local_save_interval_steps=2,
                                save_interval_steps=1000, save_final_step=False)
  with ofx.CheckpointCallback(str(tmp_path / "run"), policy) as ckpt:
    ckpt.restore_or_init({"w": np.zeros(3)})
    for name, spy in disks.durability_spies(events).items():
      monkeypatch.setattr(os, name, spy)
    ckpt.on_step_end(2, {"w": np.ones(3)})
    monkeypatch.undo()
  root = os.path.realpath(_proc_dir(shm, str(tmp_path / "run" / "checkpoints")))
  step, tmp = os.path.join(root, "2"), os.path.join(root, "2") + local.TMP
  record = os.path.join(step, local.COMMITTED)

  def at(event):
    assert event in events, (event, events)
    return events.index(event)
  blob_synced = at(("fsync", os.path.join(tmp, local.OWN)))
  moved = at(("rename", tmp, step))
  record_synced = at(("fsync", record + local.TMP))
  record_in_place = at(("replace", record + local.TMP, record))
  assert blob_synced < moved < record_synced < record_in_place, events
  assert any(e == ("fsync", step) for e in events[record_in_place:]), events  # the record's name
  assert any(e == ("fsync", root) for e in events[moved:]), events  # the step directory's name


def test_a_resume_onto_another_mesh_never_reads_a_local_shard_of_another_box(tmp_path):
  """Saved on a (2, 4) mesh, P("data", "model"): shards of 4x2. Resumed on a (4, 2) mesh with
  the same spec: shards of 2x4, the same number of bytes, none of which the local copy holds.
  The resume must give the saved values (from the persistent tier), never another box's
  bytes reshaped."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  policy = ofx.CheckpointPolicy(local_directory=str(tmp_path / "shm"), local_save_interval_steps=2,
                                save_interval_steps=2, save_final_step=False)
  values = np.arange(64, dtype=np.float32).reshape(8, 8)

  def state(shape, v):
    mesh = jax.make_mesh(shape, ("data", "model"))
    return {"w": jax.device_put(v, NamedSharding(mesh, P("data", "model")))}
  with ofx.CheckpointCallback(str(tmp_path / "run"), policy) as ckpt:
    ckpt.restore_or_init(state((2, 4), np.zeros((8, 8), np.float32)))
    ckpt.on_step_end(2, state((2, 4), values))
  with ofx.CheckpointCallback(str(tmp_path / "run"), policy) as ckpt:
    got = ckpt.restore_or_init(state((4, 2), np.zeros((8, 8), np.float32)))
  assert ckpt.restored_step == 2
  np.testing.assert_array_equal(np.asarray(got["w"]), values)


def test_after_a_rollback_the_new_timeline_s_lower_numbered_local_step_is_kept(tmp_path):
  """local_max_to_keep=1. The old run holds local step 12; after a rollback to 4 the new run
  saves persistent 8 and local 10, then dies at 11. Retention keeps the newest commit (10),
  not the highest number (12, of the abandoned timeline): the restart resumes 10."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  pol = ofx.CheckpointPolicy(local_directory=str(tmp_path / "shm"), local_save_interval_steps=2,
                             save_interval_steps=4, max_to_keep=10, local_max_to_keep=1,
                             save_final_step=False, save_on_preemption=False,
                             save_on_exception=False)
  cb = ofx.CheckpointCallback(str(tmp_path / "run"), pol)
  state = cb.restore_or_init({"w": jnp.zeros(2), "step": 0})
  for step in range(1, 13):  # the old run: w = step
    state = {"w": jnp.full(2, float(step)), "step": step}
    cb.on_step_end(step, state)
  cb.manager.wait()
  state = cb.manager.restore(4, {"state": state})["state"]  # a loss spike: roll back
  for step in range(5, 12):  # the new run: w = -step; persistent 8, local 10
    state = {"w": jnp.full(2, -float(step)), "step": step}
    cb.on_step_end(step, state)
  cb.manager.wait()
  cb.manager.close()  # the job dies at step 11
  again = ofx.CheckpointCallback(str(tmp_path / "run"), pol)
  got = again.restore_or_init({"w": jnp.zeros(2), "step": 0})
  again.close()
  assert (again.restored_step, float(got["w"][0])) == (10, -10.0)


def test_each_process_s_replica_is_durable_before_the_step_is_committed(tmp_path):
  """Two processes, replicas=1: the peer's replica each receives is fsynced before the step
  directory is renamed into place (then COMMITTED): a power loss must not leave a committed
  step whose replica (the copy a replaced host reads) is zeros."""
  import json  # pylint: disable=g-import-not-at-top
  import jobs  # pylint: disable=g-import-not-at-top
  shm = str(tmp_path / "shm")
  policy = dict(local_directory=shm, local_save_interval_steps=2, save_interval_steps=1000,
                save_final_step=False, replicas=1)
  res = jobs.run(os.path.join(HERE, "tier_holes_worker.py"),
                 [f"--workdir={tmp_path / 'run'}", f"--policy={json.dumps(policy)}", "--last=2",
                  "--tag=1", "--spy"], 2, 1).check()
  for p, out in enumerate(res.outputs):
    events = [tuple(e) for e in json.loads(out.split("SPY ", 1)[1].splitlines()[0])]
    root = os.path.realpath(_proc_dir(shm, str(tmp_path / "run" / "checkpoints"), p))
    tmp, step = os.path.join(root, "2") + local.TMP, os.path.join(root, "2")
    moved = events.index(("rename", tmp, step))
    for name in (local.OWN, f"replica-{1 - p}.blob"):
      synced = ("fsync", os.path.join(tmp, name))
      assert synced in events[:moved], (p, name, events)


def test_a_local_step_one_above_another_run_s_persistent_step_is_not_resumed(tmp_path):
  """As test_a_local_step_of_a_run_another_run_replaced_is_not_resumed, with run B saving only
  step 24, one below A's local 25: B's 24 lies between 25's base (20) and 25 all the same."""
  w, local_dir = str(tmp_path / "run"), str(tmp_path / "local")
  tiered = {"local_directory": local_dir, "local_save_interval_steps": 5,
            "save_interval_steps": 20, "save_final_step": False}
  assert _run_here(w, tiered, 27, 1) == (None, 0.0)
  assert _run_here(w, {"save_interval_steps": 4, "save_final_step": False}, 25, 2) == (20, 1.0)
  assert _run_here(w, tiered, 31, 3) == (24, 2.0)  # B's 24, not A's local 25


def test_a_replica_that_cannot_be_written_fails_the_local_save_everywhere(tmp_path):
  """Two processes, replicas=1: process 1's own blob is written, the replica it receives
  is not (EIO). The step must not count on either process (it was committed with a replica
  the replaced host would then find damaged: a local step silently without its copy)."""
  import json  # pylint: disable=g-import-not-at-top
  import jobs  # pylint: disable=g-import-not-at-top
  shm = str(tmp_path / "shm")
  policy = dict(local_directory=shm, local_save_interval_steps=2, save_interval_steps=1000,
                save_final_step=False, replicas=1, on_save_error="warn")
  res = jobs.run(os.path.join(HERE, "tier_holes_worker.py"),
                 [f"--workdir={tmp_path / 'run'}", f"--policy={json.dumps(policy)}", "--last=2",
                  "--tag=1", "--fail_replica_on=1"], 2, 1).check()
  assert all("local checkpoint of step 2 failed" in o for o in res.outputs), res.outputs
  for p in (0, 1):
    root = _proc_dir(shm, str(tmp_path / "run" / "checkpoints"), p)
    assert not os.path.exists(os.path.join(root, "2", local.COMMITTED)), (p, os.listdir(root))


def test_a_restart_removes_what_a_killed_local_save_left_before_it_saves(tmp_path):
  """A job SIGKILLed while writing local step 6 leaves ``6.ofx-tmp-local`` (a step's room on a
  RAM disk sized for local_max_to_keep + 1 steps). docs/tiers.md: each save and restore first
  removes what a save that died left uncommitted: the restart's restore must remove it, so that
  its first save has the room."""
  import shutil  # pylint: disable=g-import-not-at-top
  shm, workdir = str(tmp_path / "shm"), str(tmp_path / "run")
  policy = ofx.CheckpointPolicy(local_directory=shm, local_save_interval_steps=2,
                                save_interval_steps=1000, save_final_step=False)
  with ofx.CheckpointCallback(workdir, policy) as ckpt:
    ckpt.restore_or_init({"w": np.zeros(3)})
    for step in range(1, 5):
      ckpt.on_step_end(step, {"w": np.full(3, float(step))})
  root = _proc_dir(shm, os.path.join(workdir, "checkpoints"))
  left = os.path.join(root, "6" + local.TMP)  # what the killed save of step 6 wrote
  shutil.copytree(os.path.join(root, "4"), left)
  os.remove(os.path.join(left, local.COMMITTED))
  with ofx.CheckpointCallback(workdir, policy) as ckpt:
    ckpt.restore_or_init({"w": np.zeros(3)})
    assert ckpt.restored_step == 4
    assert not os.path.exists(left), os.listdir(root)
