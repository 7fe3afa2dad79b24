"""A restart in the least time (issue 30): its clock, the compile cache, the background restore.

* The callback logs the restart's parts in one line at the first step after
  ``restore_or_init`` and writes them to the metric writer beside the save timings.
* ``compilation_cache=True``: a second process of the same job loads its train
  step from ``<workdir>/compilation_cache/<jax, backend, devices>/`` (JAX's cache
  hit events, as the restart line reports them); a job on another device count
  gets another directory; an object-store workdir is refused before anything runs.
* ``restore_or_init_async``: the values are bitwise those saved, the user's
  jitted step runs on them, and the restore's errors surface at ``join()``.
"""

import json
import logging
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs
import orbax_flax as ofx

_QUIET = dict(save_final_step=False, save_on_preemption=False, save_on_exception=False)
HERE = os.path.dirname(os.path.abspath(__file__))


def _state(seed=0):
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  rng = np.random.default_rng(seed)
  return {"w": jax.device_put(rng.standard_normal((64, 32), dtype=np.float32),
                              NamedSharding(mesh, P("data", "model"))),
          "b": jax.device_put(rng.standard_normal(32, dtype=np.float32), NamedSharding(mesh, P())),
          "step": jnp.int32(0)}


@jax.jit
def _train_step(s):
  return {"w": s["w"] * 0.5 + 1.0, "b": s["b"] - s["w"].sum(0), "step": s["step"] + 1}


def _save_steps(workdir, steps=4):
  state = _state()
  with ofx.CheckpointCallback(workdir, dict(save_interval_steps=2, **_QUIET)) as ckpt:
    state = ckpt.restore_or_init(state)
    for step in range(steps):
      state = _train_step(state)
      ckpt.on_step_end(step + 1, state)
  return jax.tree.map(np.asarray, state)


def test_the_restart_is_logged_in_one_line_and_written_beside_the_save_timings(tmp_path, caplog):
  saved = _save_steps(str(tmp_path))
  writer = jobs.RecordingWriter()
  with caplog.at_level(logging.INFO, logger="orbax_flax"):
    with ofx.CheckpointCallback(str(tmp_path), dict(save_interval_steps=2, **_QUIET),
                                writer=writer) as ckpt:
      state = ckpt.restore_or_init(_state(seed=1))
      assert ckpt.restored_step == 4
      np.testing.assert_array_equal(np.asarray(state["w"]), saved["w"])
      state = _train_step(state)
      ckpt.on_step_end(5, state)
      ckpt.on_step_end(6, _train_step(state))
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restart from")]
  assert len(lines) == 1, lines  # once, at the first step
  # (Not the process's first callback: its start-up counts from its construction. A process's
  # first counts from the process's start: _run's workers.)
  assert re.match(r"restart from step 4: callback built to restore [\d.]+ s \([^)]*\), restore"
                  r" [\d.]+ s, first train step [\d.]+ s \(compile and run\),"
                  r" [\d.]+ s in all$", lines[0]), lines[0]
  restart = [s for step, s in writer.scalars if "restart/restore_s" in s]
  assert len(restart) == 1 and writer.scalars[0][0] == 5
  parts = restart[0]
  assert set(parts) == {"restart/startup_s", "restart/restore_s", "restart/first_step_s",
                        "restart/total_s"}
  assert all(v >= 0 for v in parts.values())
  assert parts["restart/total_s"] >= parts["restart/restore_s"] + parts["restart/first_step_s"]
  saves = [s for _, s in writer.scalars if "checkpoint/blocking_s" in s]
  assert saves  # the save timings go to the same writer


def test_restore_or_init_called_again_times_the_last_restore(tmp_path):
  """A second restore_or_init (a retry) times its own restore: before, the first call's end was
  kept, so restart/restore_s came out negative by the time between the calls."""
  import time  # pylint: disable=g-import-not-at-top
  _save_steps(str(tmp_path))
  writer = jobs.RecordingWriter()
  with ofx.CheckpointCallback(str(tmp_path), dict(save_interval_steps=2, **_QUIET),
                              writer=writer) as ckpt:
    ckpt.restore_or_init(_state(seed=1))
    time.sleep(0.5)
    state = ckpt.restore_or_init(_state(seed=1))
    ckpt.on_step_end(5, _train_step(state))
  (parts,) = [s for _, s in writer.scalars if "restart/restore_s" in s]
  assert parts["restart/restore_s"] >= 0 and parts["restart/first_step_s"] >= 0, parts
  assert parts["restart/startup_s"] >= 0.5, parts  # the time between the calls is start-up


def test_a_later_run_in_the_process_times_its_start_from_its_callback(tmp_path, caplog):
  """Only a process's first callback counts from the process's start: a later run (a sweep, a
  notebook) counted the runs before it as its start-up; it counts from its construction, and its
  line says so."""
  import time  # pylint: disable=g-import-not-at-top
  _save_steps(str(tmp_path))  # an earlier run in this process
  writer, template = jobs.RecordingWriter(), _state(seed=1)
  built = time.time()
  with caplog.at_level(logging.INFO, logger="orbax_flax"):
    with ofx.CheckpointCallback(str(tmp_path), dict(save_interval_steps=2, **_QUIET),
                                writer=writer) as ckpt:
      ckpt.on_step_end(5, _train_step(ckpt.restore_or_init(template)))
      lived = time.time() - built
  (parts,) = [s for _, s in writer.scalars if "restart/startup_s" in s]
  assert 0 <= parts["restart/startup_s"] <= parts["restart/total_s"] <= lived, (parts, lived)
  (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restart from")]
  assert re.match(r"restart from step 4: callback built to restore [\d.]+ s \(a later run in this"
                  r" process: timed from its CheckpointCallback, not from process start\)", line), line


def test_a_background_restore_gives_the_saved_values_and_trains(tmp_path, caplog):
  saved = _save_steps(str(tmp_path))
  template = _state(seed=1)
  with caplog.at_level(logging.INFO, logger="orbax_flax"):
    with ofx.CheckpointCallback(str(tmp_path), dict(save_interval_steps=2, **_QUIET)) as ckpt:
      pending = ckpt.restore_or_init_async(template)
      compiled = _train_step.lower(template).compile()  # while the bytes land
      with pytest.raises(RuntimeError, match="join"):
        ckpt.on_step_end(5, template)
      state = pending.join()
      assert pending.join() is state  # joining again returns the same state
      assert ckpt.restored_step == 4
      for k in saved:
        got = np.asarray(state[k])
        assert got.dtype == saved[k].dtype and got.tobytes() == saved[k].tobytes(), k
      assert state["w"].sharding == template["w"].sharding
      state = compiled(state)  # the step compiled against the template runs on the restored state
      again = _train_step(jax.tree.map(jnp.asarray, saved))
      np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(again["w"]))
      ckpt.on_step_end(5, state)
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restart from")]
  assert len(lines) == 1 and "(in the background, joined after" in lines[0], lines


def test_a_background_restore_raises_its_error_at_join(tmp_path):
  _save_steps(str(tmp_path))
  wrong = dict(_state(), w=jnp.zeros((64, 16), jnp.float32))  # another shape than saved
  with ofx.CheckpointCallback(str(tmp_path), dict(save_interval_steps=2, **_QUIET)) as ckpt:
    pending = ckpt.restore_or_init_async(wrong)
    with pytest.raises(ValueError, match="shape"):
      pending.join()
    state = ckpt.restore_or_init(_state())  # the failed restore does not block another
    assert ckpt.restored_step == 4 and int(state["step"]) == 4


def test_on_step_end_after_a_failed_background_restore_says_it_failed(tmp_path):
  """After join() raised the restore's error, on_step_end said the restore "was not joined"; it
  still refuses (nothing was restored), naming the failure and what to call."""
  _save_steps(str(tmp_path))
  wrong = dict(_state(), w=jnp.zeros((64, 16), jnp.float32))  # another shape than saved
  with ofx.CheckpointCallback(str(tmp_path), dict(save_interval_steps=2, **_QUIET)) as ckpt:
    pending = ckpt.restore_or_init_async(wrong)
    with pytest.raises(ValueError, match="shape") as failed:
      pending.join()
    with pytest.raises(RuntimeError, match=r"(?s)restore_or_init_async restore failed: nothing was"
                       r" restored.*call restore_or_init again.*TreeMismatchError: .*shape") as e:
      ckpt.on_step_end(1, wrong)
    assert e.value.__cause__ is failed.value
    state = ckpt.restore_or_init(_state())  # as it says
    ckpt.on_step_end(5, _train_step(state))


def test_close_waits_for_a_pending_restore_and_join_then_says_the_callback_closed(tmp_path):
  """close() with a restore_or_init_async restore pending returned at once, the restore read on
  through the closed manager, and join() raised "this Checkpointer is closed" (a Checkpointer
  the user never made). close() waits for it; join() says what happened."""
  _save_steps(str(tmp_path))
  ckpt = ofx.CheckpointCallback(str(tmp_path), dict(save_interval_steps=2, **_QUIET))
  pending = ckpt.restore_or_init_async(_state(seed=1))
  ckpt.close()
  assert pending.done()
  with pytest.raises(RuntimeError, match=r"the CheckpointCallback was closed while this restore"
                     r" was pending.*restore_or_init_async"):
    pending.join()


def test_nothing_to_resume_joins_the_state_passed_in(tmp_path):
  template = _state()
  with ofx.CheckpointCallback(str(tmp_path), dict(save_interval_steps=2, **_QUIET)) as ckpt:
    state = ckpt.restore_or_init_async(template).join()
    assert ckpt.restored_step is None and state["w"] is template["w"]


def test_the_compilation_cache_refuses_an_object_store_workdir():
  with pytest.raises(ValueError, match="compilation_cache=True needs a workdir on a filesystem"):
    ofx.CheckpointCallback("s3://bucket/run", dict(compilation_cache=True))


def test_an_object_store_workdir_keeps_a_cache_directory_the_user_set(tmp_path):
  """The refusal above says to point JAX_COMPILATION_CACHE_DIR at a filesystem; done so, with
  compilation_cache=True kept, the same refusal came again. That directory is kept (a WARNING
  says so), as on a filesystem workdir."""
  cache = str(tmp_path / "cache")
  code = ("import jax, orbax_flax as ofx\n"
          "ofx.CheckpointCallback('memory://run', dict(compilation_cache=True)).close()\n"
          "print('CACHE', jax.config.jax_compilation_cache_dir)\n")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                     env=jobs.env_for(1, {"JAX_COMPILATION_CACHE_DIR": cache}), check=False)
  assert r.returncode == 0, r.stderr[-4000:]
  assert f"CACHE {cache}" in r.stdout and f"already set to {cache}" in r.stderr, r.stderr[-4000:]


_TWO_RUNS = r"""
import shutil, sys
import jax, jax.numpy as jnp, orbax_flax as ofx
policy = ofx.CheckpointPolicy(save_interval_steps=1, compilation_cache=True)
for workdir, n in zip(sys.argv[1:], (4, 5)):   # a sweep: one run after another, own workdirs
  with ofx.CheckpointCallback(workdir, policy) as ckpt:
    s = ckpt.restore_or_init({"w": jnp.zeros((n,)), "step": jnp.int32(0)})
    ckpt.on_step_end(1, jax.jit(lambda s: {"w": jnp.sin(s["w"]) + n, "step": s["step"] + 1})(s))
  print("CACHE", jax.config.jax_compilation_cache_dir, flush=True)
  if n == 4:
    shutil.rmtree(workdir)   # the first run's workdir gone, as a sweep's temporary ones go
"""


def test_a_second_run_in_one_process_caches_in_its_own_workdir(tmp_path):
  """compilation_cache=True in two runs of one process (a sweep): JAX opens its cache once, so
  the second run's programs went to the first run's workdir (gone here: JAX warned at every
  compile) with a WARNING blaming a cache directory the user never set. The cache orbax_flax set
  itself follows the run."""
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  env = jobs.env_for(1)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the test session's shared cache: not this one
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # cache even these small programs
  r = subprocess.run([sys.executable, "-c", _TWO_RUNS, a, b], env=env, capture_output=True,
                     text=True, timeout=240, check=False)
  assert r.returncode == 0, r.stderr[-4000:]
  dirs = [l.split(" ", 1)[1] for l in r.stdout.splitlines() if l.startswith("CACHE ")]
  assert [d.startswith(os.path.join(w, "compilation_cache", "jax-")) for d, w in zip(dirs, (a, b))
          ] == [True, True], dirs
  assert os.listdir(dirs[1]), "the second run cached nothing in its own workdir"
  assert "already set" not in r.stderr and "Error writing persistent compilation cache" not in (
      r.stderr), r.stderr[-4000:]


def _run(workdir, steps, devices, *flags):
  env = jobs.env_for(devices)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the test session's shared cache: not this one
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # cache even this small step
  r = subprocess.run([sys.executable, os.path.join(HERE, "restart_worker.py"), workdir,
                      str(steps), *flags], env=env, capture_output=True, text=True, timeout=240)
  assert r.returncode == 0, r.stderr[-4000:]
  result = json.loads(r.stdout.split("RESULT ", 1)[1])
  line = [l for l in r.stderr.splitlines() if "first train step" in l]
  assert len(line) == 1, r.stderr[-4000:]
  assert re.search(r"process start to restore [\d.]+ s \(imports, JAX, model init\)", line[0])
  hits = re.search(r"compile cache: (\d+) hits?, (\d+) miss", line[0])
  assert hits, line[0]
  return result, int(hits.group(1)), int(hits.group(2))


def test_a_second_process_loads_its_train_step_from_the_compilation_cache(tmp_path):
  workdir = str(tmp_path / "run")
  first, hits, misses = _run(workdir, 2, 4)
  assert first["restored"] is None and hits == 0 and misses >= 1
  cache = first["cache_dir"]
  assert cache.startswith(os.path.join(workdir, "compilation_cache", f"jax-{jax.__version__}-cpu-"))
  assert cache.endswith("-4dev-1proc") and os.listdir(cache)
  entries = set(os.listdir(cache))
  second, hits, misses = _run(workdir, 2, 4, "--async")  # a restart, compiling while restoring
  assert second["restored"] == 2 and second["cache_dir"] == cache
  assert hits >= 1 and misses == 0, (hits, misses)
  assert set(os.listdir(cache)) == entries  # nothing compiled again
  # Another mesh (8 devices) never reads the 4-device programs: its own directory.
  third, hits, _ = _run(workdir, 2, 8)
  assert third["restored"] == 4 and third["cache_dir"].endswith("-8dev-1proc") and hits == 0


def test_a_job_of_two_processes_shares_one_cache_directory_and_process_0_hits(tmp_path):
  # JAX writes cache entries from process 0 only and every process reads them. On this
  # CPU backend the other processes' programs have keys of their own (their local
  # devices are part of the key), so they compile again (on accelerator hosts JAX means
  # every host to read process 0's entries). Either way the job runs, on one directory, and its
  # process 0 loads its step on a restart.
  workdir = str(tmp_path / "run")
  env = {"JAX_COMPILATION_CACHE_DIR": "", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  counts = []
  for _ in range(2):
    r = jobs.run("restart_worker.py", [workdir, "2"], num_processes=2, devices_per_process=2,
                 env=env).check()
    lines = [re.search(r"compile cache: (\d+) hits?, (\d+) miss", out) for out in r.outputs]
    assert all(lines), r.outputs
    counts.append([(int(m.group(1)), int(m.group(2))) for m in lines])
    dirs = {json.loads(out.split("RESULT ", 1)[1].splitlines()[0])["cache_dir"] for out in r.outputs}
    assert len(dirs) == 1 and dirs.pop().endswith("-4dev-2proc")
  assert all(hits == 0 and misses >= 1 for hits, misses in counts[0]), counts
  assert counts[1][0][0] >= 1 and counts[1][0][1] == 0, counts  # process 0: loaded, not compiled
