"""Several processes save one checkpoint together; other jobs restore it."""

import os
import re

import numpy as np
import pytest

import jobs
import orbax_flax as ofx


def _save(path, n, devices, mesh, async_save=False):
  """``async_save``: False, or the host_transfer of an async save (checked on every process)."""
  args = ["--mode=save", f"--path={path}", f"--mesh={mesh}"] + (
      [f"--async_save", f"--transfer={async_save}"] if async_save else [])
  res = jobs.run("engine_worker.py", args, n, devices)
  res.check()
  if async_save and async_save != "auto":
    assert all(f"transfer={async_save}" in out for out in res.outputs), res.outputs


def _restore(path, n, devices, mesh):
  res = jobs.run("engine_worker.py", ["--mode=restore", f"--path={path}", f"--mesh={mesh}"], n, devices)
  res.check()
  assert all("RESTORED" in out for out in res.outputs), res.outputs


@pytest.mark.parametrize("n,devices,mesh,async_save", [
    (2, 4, "2,4", False), (4, 2, "4,2", "auto"),
    pytest.param(2, 4, "2,4", "device_copy", marks=pytest.mark.skipif(
        os.environ.get("ORBAX_FLAX_FAULTS") != "long",
        reason="long run: ORBAX_FLAX_FAULTS=long (~9 s; the device_copy snapshot of global"
               " arrays is also test_async.py's, in one process)"))])
def test_multiprocess_save_then_restore_elsewhere(tmp_path, n, devices, mesh, async_save):
  """Blocking, async (the default transfer) and async through XLA's copy of the global arrays;
  each async save's caller zeroes its arrays as soon as save_async returns."""
  path = str(tmp_path / "ckpt")
  _save(path, n, devices, mesh, async_save)
  meta = ofx.metadata(path)
  assert meta.process_count == n and meta.device_count == 8
  # Each process wrote its own database; replicated data was written once.
  dbs = sorted(os.listdir(os.path.join(path, "state")))
  assert [d.split("-")[0] for d in dbs] == [f"p{i}" for i in range(n)]
  # Restore with other process counts and meshes, checking every shard.
  _restore(path, 1, 8, "8,1")
  _restore(path, 4 if n == 2 else 2, 2 if n == 2 else 4, "2,4")


def test_replicated_writes_are_balanced(tmp_path):
  path = str(tmp_path / "ckpt")
  _save(path, 2, 4, "2,4")
  # Bytes written per process (data files of each process's database).
  sizes = []
  for db in sorted(os.listdir(os.path.join(path, "state"))):
    total = 0
    for root, _, files in os.walk(os.path.join(path, "state", db)):
      total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    sizes.append(total)
  assert len(sizes) == 2
  assert max(sizes) / min(sizes) < 1.3, sizes
  # Restore on one process: every value matches.
  restored = ofx.restore(path)
  np.testing.assert_array_equal(restored["state"]["big_rep"].shape, (512, 1024))


def test_a_rollback_resave_of_a_borrowed_step_waits_for_every_process(tmp_path):
  """Two processes, differential saves, the rollback (every process restores step 1, then saves
  it again; step 2 borrows from 1): process 0 moved step 1 aside as soon as its save began,
  while process 1, a second behind, still restored it ("does not exist") or planned its save
  (a raw FileNotFoundError). Process 0 now moves it once every process has come to the save."""
  res = jobs.run("diff_worker.py", ["--mode=rollback", f"--path={tmp_path / 'ckpt'}"], 2, 2,
                 timeout=120).check()
  assert all(f"ROLLBACK {i} OK" in out for i, out in enumerate(res.outputs)), res.outputs


def _cases(res):
  """``{case: [(outcome, seconds, message) per process]}`` of a mismatch_worker.py job."""
  cases = {}
  for out in res.outputs:
    for line in out.splitlines():
      if line.startswith("CASE "):
        _, name, outcome, seconds, message = line.split(" ", 4)
        cases.setdefault(name, []).append((outcome, float(seconds), message))
  return cases


def test_a_tree_that_differs_between_processes_is_refused_everywhere(tmp_path):
  """Process 1 saves a renamed key, lacks a leaf, has another dtype, names its item otherwise:
  each was committed (process 0's manifest over process 1's data: a renamed key restored half
  of one array and half of another, and ``verify`` said OK). Now every process raises a
  ValueError that names the first difference, and nothing is committed; the next save of the
  same tree commits (the processes' saves stay in step)."""
  res = jobs.run("mismatch_worker.py", ["--mode=tree", f"--path={tmp_path}"], 2, 2,
                 timeout=120).check()
  cases = _cases(res)
  differs = {"rename": "leaf state/w2", "missing": "leaf state/w_", "dtype": "bfloat16", "item": "params"}
  for name, shown in differs.items():
    assert [o for o, _, _ in cases[name]] == ["raised", "raised"], (name, res.outputs)
    for _, seconds, message in cases[name]:
      assert message.startswith("ValueError:") and shown in message, (name, message)
      assert "every process of a job must save the same tree" in message.lower(), message
      assert seconds < 10, (name, seconds)  # long before the coordination timeout (30 s)
    assert not os.path.exists(tmp_path / name), name  # nothing committed, nothing left
  assert [o for o, _, _ in cases["same"]] == ["saved+committed"] * 2, res.outputs


def test_a_save_refused_on_one_process_fails_at_once_everywhere(tmp_path):
  """A save one process refuses (an unsupported leaf, on process 1 or 0; a checkpoint there
  and overwrite=True on the other process only) made the others wait the whole coordination timeout and blame
  a process that "did not finish writing", and desynchronised every later save ("process 0
  saves '1' and process 1 saves '2'"): the refusing process had not used up its save. Now
  every process raises the refusing process's error type with its reason at once, also when
  process 0 had begun writing, nothing is committed, and the next saves commit."""
  res = jobs.run("mismatch_worker.py", ["--mode=refuse", f"--path={tmp_path}"], 2, 2,
                 timeout=120).check()
  cases = _cases(res)
  refused = {"leaf": "UnsupportedLeafError", "late-leaf": "UnsupportedLeafError",
             "leaf0": "UnsupportedLeafError", "overwrite": "CheckpointExistsError"}
  for name, error in refused.items():
    assert [o for o, _, _ in cases[name]] == ["raised", "raised"], (name, res.outputs)
    for p, (_, seconds, message) in enumerate(cases[name]):
      assert message.startswith(f"{error}:"), (name, p, message)
      assert seconds < 10, (name, p, seconds)  # long before the coordination timeout (30 s)
    refuser = 0 if name == "leaf0" else 1
    assert f"process {refuser} refused" in cases[name][1 - refuser][2], cases[name]  # who, why
    assert "Cannot save leaf state/cfg" in cases[name][1 - refuser][2] or name == "overwrite"
  assert not any(os.path.exists(tmp_path / "run" / s) for s in ("1", "3", "5"))
  assert all("OVERWRITTEN False" in out for out in res.outputs), res.outputs
  for name in ("after-leaf", "after-late-leaf", "after-leaf0", "after-overwrite"):
    assert [o for o, _, _ in cases[name]] == ["saved+committed"] * 2, (name, res.outputs)


def test_module_saves_of_other_paths_on_each_process_are_refused_at_once(tmp_path):
  """ofx.save with a per-process path (a tempfile.mkdtemp() on each host): the module
  functions keyed their rendezvous on the path, so the processes never met, and each waited
  the whole 600 s timeout, then blamed the other as hung. Their n-th saves meet now: both
  raise at once, naming both paths, nothing is committed, and the next save commits."""
  res = jobs.run("mismatch_worker.py", ["--mode=module", f"--path={tmp_path}"], 2, 2,
                 timeout=120).check()
  cases = _cases(res)
  for name in ("paths", "async-paths"):
    assert [o for o, _, _ in cases[name]] == ["raised", "raised"], (name, res.outputs)
    for p, (_, seconds, message) in enumerate(cases[name]):
      assert seconds < 10, (name, p, seconds)
      assert "p0" in message and "p1" in message, (name, p, message)
  assert not any(os.path.exists(tmp_path / d / "_CHECKPOINT") for d in ("p0", "p1", "p0-a", "p1-a"))
  assert [o for o, _, _ in cases["after-paths"]] == ["saved+committed"] * 2, res.outputs


def _donor(root):
  """A pretraining run's workdir holding step 10 (kernel 10.0); its step 20 (kernel 20.0)
  committed beside it, then moved out to ``<root>/staged20`` (moved back by the worker)."""
  import jax, jax.numpy as jnp, optax  # pylint: disable=g-import-not-at-top,multiple-statements
  from flax import linen as nn  # pylint: disable=g-import-not-at-top
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  params = nn.Dense(16).init(jax.random.key(0), jnp.ones((1, 8)))
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
  with ofx.CheckpointCallback(os.path.join(root, "donor"), {"save_interval_steps": 10}) as ck:
    ck.restore_or_init(state)
    for step in (10, 20):
      ck.on_step_end(step, state.replace(
          step=step, params=jax.tree.map(lambda a, s=step: jnp.full_like(a, s), params)))
  os.rename(os.path.join(root, "donor", "checkpoints", "20"), os.path.join(root, "staged20"))


def test_init_from_a_run_takes_one_step_on_every_process(tmp_path):
  """A 2-process fine-tune from a pretraining run's workdir (its latest step) while that run
  commits step 20 beside step 10: each process resolved "the latest step" on its own, and
  the params mixed shards of both (kernel values 10.0 and 20.0), without a word. Process 0
  resolves it for every process now."""
  _donor(str(tmp_path))
  res = jobs.run("init_from_worker.py", [f"--root={tmp_path}", "--case=race"], 2, 2).check()
  for out in res.outputs:
    assert "VALUES [10.0]" in out, out[-3000:]


def test_init_from_refused_on_one_process_stops_every_process_at_once(tmp_path):
  """init_from fails on process 1 only (its config names a part the checkpoint lacks; a
  per-host download one host lacks is the same): process 0 trained on into its first
  collective and was aborted about 100 s later with no word of init_from. Every process
  now raises at once, process 0 naming process 1's error."""
  _donor(str(tmp_path))
  res = jobs.run("init_from_worker.py", [f"--root={tmp_path}", "--case=refused"], 2, 2).check()
  assert "REFUSED TreeMismatchError" in res.outputs[1], res.outputs[1][-3000:]
  assert re.search(r"REFUSED TreeMismatchError: init_from=.* failed on another process, so every"
                   r" process stops here: process 1: TreeMismatchError", res.outputs[0]), (
                       res.outputs[0][-3000:])
  for out in res.outputs:
    assert float(re.search(r"TOOK ([\d.]+)", out).group(1)) < 30, out[-2000:]


def test_a_long_job_leaves_no_coordination_keys_behind_per_save(tmp_path):
  """The coordination service (process 0's) grew with every save, for as long as a job ran:
  two or more keys a save from each all_gather (the data positions, if_busy="skip", the local
  tier's verdicts), two a local save from its barrier, one a time decision whose bucket of
  1024 steps a loop asking every third step entered past its first step, or whose first step
  a step trigger saved (soak review, then the review of the fix)."""
  r = jobs.run("coordkeys_worker.py", [str(tmp_path)], num_processes=2, devices_per_process=1,
               timeout=240).check()
  import json  # pylint: disable=g-import-not-at-top
  grown = json.loads(r.outputs[0].split("RESULT ", 1)[1].splitlines()[0])
  # 600 time decisions, 40 due steps, 40 steps with 20 saves and 40 local saves: bounded
  # (the buckets in use, a few keys of the manager), not per save.
  assert grown["time"] <= 2 * 1024 // 3 + 10 and grown["busy"] <= 10, grown
  assert grown["time_and_steps"] <= 1100, grown  # bucket 0 goes: 2600 - 1100 steps - 1024
  assert grown["callback"] <= 10, grown
