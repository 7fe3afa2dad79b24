"""What a new user meets in the first hour (one test per point of the first-hour review).

CLI points run the real command in a subprocess.
"""

import dataclasses
import itertools
import logging
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs
import orbax_flax as ofx

ROOT = jobs.ROOT


def cli(*args, env=None):
  return subprocess.run([sys.executable, "-m", "orbax_flax", *args], capture_output=True, text=True,
                        env=env or jobs.env_for(1), cwd=ROOT, timeout=120)


# ------------------------------------------------------------- 1. data position, process count


@pytest.mark.parametrize("is_global", [False, True])
def test_per_process_data_states_never_land_on_another_process_count(tmp_path, is_global):
  extra = ["--global_state"] if is_global else []
  jobs.run("data_worker.py", [f"--dir={tmp_path}", *extra], 2, 4).check()
  sys.path.insert(0, jobs.HERE)
  import data_worker  # pylint: disable=g-import-not-at-top
  it = data_worker.ShardIterator(0, 1, is_global)  # one process now: its shard is everything
  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 5})
  if not is_global:
    with pytest.raises(ValueError, match=r"per-process positions.*Resume with 2 processes.*"
                                         r"checkpoint_state_is_global"):
      ckpt.restore_or_init({"step": 0}, data_iterator=it)
  else:
    state = ckpt.restore_or_init({"step": 0}, data_iterator=it)
    assert state["step"] == 5 and it.next_index == 5  # a global position, taken as one
  ckpt.close()


def test_a_step_saved_again_after_a_rollback_holds_every_process_s_new_position(tmp_path):
  """Two processes roll back from step 10 to 5, skip three batches and save step 10 again:
  its data positions were gathered under the key of the first save of step 10, whose
  rendezvous was complete already, so the late process's *old* position was saved."""
  import re  # pylint: disable=g-import-not-at-top
  r = jobs.run("data_worker.py", [f"--dir={tmp_path}", "--rollback"], 2, 1)
  r.check()
  actual = {int(p): int(i) for p, i in re.findall(r"POSITION (\d+) (\d+)", "".join(r.outputs))}
  assert actual == {0: 13, 1: 13}, r.outputs
  with ofx.CheckpointManager(str(tmp_path / "checkpoints")) as m:
    saved = m.restore(10, {"data": None})["data"]["processes"]
  assert [s["next_index"] for s in saved] == [13, 13]


def test_processes_that_end_at_different_steps_are_told_at_once(tmp_path):
  """A finite data pass that ends one step later on one process (ElasticIterator with a
  filter): each process's close() went to a final save of its own last step and waited
  for the others there until the coordination timeout (600 s by default), with an error
  that said nothing of why."""
  r = jobs.run("data_worker.py", [f"--dir={tmp_path}", "--uneven"], 2, 1, timeout=50)
  r.check()
  for out in r.outputs:
    assert ("CLOSE FAILED the processes ended the run at different steps (process 0: 4,"
            " process 1: 5)") in out and "repeat() the dataset" in out, out[-3000:]
  with ofx.CheckpointManager(str(tmp_path / "checkpoints")) as m:
    assert m.all_steps() == []  # no final step of either length


def test_a_save_where_processes_name_different_steps_commits_nothing(tmp_path):
  """Process 0 saved step 4 and process 1 step 5 in what was one collective save: it
  committed step 4, with process 1's shards of step 5 inside, and no error anywhere."""
  r = jobs.run("data_worker.py", [f"--dir={tmp_path}", "--mismatched"], 2, 1, timeout=100)
  r.check()
  for out in r.outputs:  # each process is told why
    assert "SAVE FAILED" in out and "process 0 saves '4' and process 1 saves '5'" in out, out
  with ofx.CheckpointManager(str(tmp_path)) as m:
    assert m.all_steps() == []


# ------------------------------------------------------------- 2. lossy dtype conversions


def test_lossy_dtype_conversions_need_an_opt_in(tmp_path, caplog):
  path = str(tmp_path / "c")
  ofx.save(path, {"s": {"w": np.linspace(-2, 2, 8, dtype=np.float32), "i": np.arange(8, dtype=np.int8)}})
  for dtype in (np.int8, np.bool_, ml_dtypes.bfloat16, np.float16):
    with pytest.raises(ofx.TreeMismatchError, match=r"s/w: float32 in checkpoint, \w+ in target:"
                                                    r" converting loses information"):
      ofx.restore(path, {"s": {"w": np.zeros(8, dtype)}}, partial=True)
  got = ofx.restore(path, {"s": {"w": np.zeros(8, ml_dtypes.bfloat16)}}, partial=True,
                    allow_lossy_casts=True)["s"]["w"]
  assert got.dtype == ml_dtypes.bfloat16
  exact = ofx.restore(path, {"s": {"i": np.zeros(8, np.float32), "w": np.zeros(8, np.float64)}})["s"]
  np.testing.assert_array_equal(exact["i"], np.arange(8))  # int8 -> float32 is exact: no opt-in

  # A resume logs every dtype change, and refuses a lossy one unless the policy allows it.
  ckpt = ofx.CheckpointCallback(str(tmp_path / "run"), {"save_interval_steps": 1})
  ckpt.restore_or_init({"w": jnp.ones(8, jnp.float32)})
  ckpt.on_step_end(1, {"w": jnp.ones(8, jnp.float32)})
  ckpt.close()
  with pytest.raises(ofx.TreeMismatchError, match="allow_lossy_casts"):
    ofx.CheckpointCallback(str(tmp_path / "run"), {}).restore_or_init({"w": jnp.ones(8, jnp.bfloat16)})
  with caplog.at_level(logging.WARNING, logger="orbax_flax"):
    ofx.CheckpointCallback(str(tmp_path / "run"), {"allow_lossy_casts": True}).restore_or_init(
        {"w": jnp.ones(8, jnp.bfloat16)})
  assert "state/w converted from float32 (checkpoint) to bfloat16" in caplog.text


# ------------------------------------------------------------- 3. forgotten initialize_from_env


def test_forgetting_distributed_initialisation_is_caught_before_writing(tmp_path):
  code = ("import orbax_flax as ofx, numpy as np, sys\n"
          "ckpt = ofx.CheckpointCallback(sys.argv[1], {'save_interval_steps': 1})\n")
  r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                     env=dict(jobs.env_for(1), JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0"), timeout=120)
  assert r.returncode != 0
  assert "JAX_NUM_PROCESSES=2 is set" in r.stderr and "initialize_from_env()" in r.stderr, r.stderr
  assert os.listdir(tmp_path) == []  # nothing written


# ------------------------------------------------------------- 4. an evaluator's view of a save in flight


def test_a_save_in_flight_is_never_called_safe_to_delete(tmp_path, caplog):
  d = tmp_path / "checkpoints"
  ofx.save(str(d / "5"), {"s": {"x": np.arange(3)}})
  os.makedirs(d / "10.ofx-tmp-0123456789abcdef" / "s")  # the trainer's save of step 10, in flight
  with caplog.at_level(logging.WARNING, logger="orbax_flax"):
    ofx.CheckpointManager(str(d)).close()  # an evaluator
  assert "in progress" in caplog.text and "safe to delete" not in caplog.text
  assert (d / "10.ofx-tmp-0123456789abcdef").exists()  # newer than the latest step: untouched
  out = cli("list", str(d)).stdout
  assert "a save in progress or an interrupted save" in out and "safe to delete" not in out, out
  with pytest.raises(ofx.CheckpointNotFoundError, match="in progress, or interrupted"):
    ofx.restore(str(d / "10.ofx-tmp-0123456789abcdef"))
  readme = open(os.path.join(ROOT, "README.md")).read()
  assert "safe to delete" not in readme


# ------------------------------------------------------------- 5, 6. preemption ignored; final metrics


def test_ignoring_the_preemption_answer_saves_once_then_warns(tmp_path, caplog):
  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 0, "preemption_signals": ("SIGUSR1",)})
  state = ckpt.restore_or_init({"w": np.zeros(3), "step": 0})
  os.kill(os.getpid(), signal.SIGUSR1)
  time.sleep(0.05)
  assert ckpt.on_step_end(1, state, {"loss": 1.0}) is True
  assert ckpt.manager.all_steps() == [1]
  with caplog.at_level(logging.WARNING, logger="orbax_flax"):
    for step in (2, 3, 4):  # a loop that ignored the True
      assert ckpt.on_step_end(step, state, {"loss": 1.0}) is True
  assert ckpt.manager.all_steps() == [1]
  assert caplog.text.count("after this job was preempted") == 3
  ckpt.close()


def test_final_and_exception_saves_record_the_last_metrics(tmp_path):
  policy = {"save_interval_steps": 0, "keep_best": 1, "best_metric": "loss"}
  ckpt = ofx.CheckpointCallback(str(tmp_path), policy)
  step = lambda s, b: ({"w": s["w"] + 1, "step": s["step"] + 1}, {"loss": 1.0 / (s["step"] + 1)})  # noqa: E731
  ofx.Trainer(step, [ckpt]).fit({"w": np.zeros(2), "step": 0}, itertools.repeat(None), 4)
  assert ckpt.manager.step_info(4).metrics == {"loss": 0.25}
  assert ckpt.manager.best_step() == 4


# ------------------------------------------------------------- 7. abstract()


def test_abstract_of_an_nnx_eval_shape_with_a_mesh(tmp_path):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  kernel_init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
  make = lambda: nnx.Linear(8, 16, kernel_init=kernel_init, rngs=nnx.Rngs(0))  # noqa: E731
  with jax.set_mesh(mesh):
    model = make()
    abstract_model = nnx.eval_shape(make)
  ofx.save(str(tmp_path / "c"), {"params": nnx.state(model, nnx.Param)})
  target = ofx.abstract(nnx.state(abstract_model, nnx.Param), mesh)  # one call
  restored = ofx.restore(str(tmp_path / "c"), {"params": target})["params"]
  kernel = restored["kernel"]
  kernel = kernel.get_value() if hasattr(kernel, "get_value") else kernel
  assert kernel.sharding.spec == P(None, "model") and kernel.sharding.mesh.shape == mesh.shape
  with pytest.raises(ValueError, match=r"has no sharding; pass the mesh"):
    ofx.abstract(jax.eval_shape(lambda: {"w": jnp.zeros(3)}))


# ------------------------------------------------------------- 8, 12. CLI help and errors


def test_every_subcommand_has_help():
  for sub in ("list", "show", "verify", "plan"):
    r = cli(sub, "--help")
    assert r.returncode == 0 and "usage" in r.stdout.lower(), (sub, r.stdout, r.stderr)
  assert cli("--help").returncode == 0


def test_cli_errors_are_one_readable_line():
  r = cli("plan", "--config=configs/default.py", "--config.checkpoint.max_to_kep=5")
  assert r.returncode == 2
  assert r.stderr.strip() == 'error: max_to_kep: Did you mean "max_to_keep" instead of "max_to_kep"?', r.stderr
  r = cli("plan", "--config=configs/default.py", "--steps=100", "--config.checkpoint.preemption_signals=(15,10)")
  assert r.returncode == 0, r.stderr
  assert ofx.CheckpointPolicy(preemption_signals=(15, 10)).preemption_signals == ("SIGTERM", "SIGUSR1")
  r = cli("plan", "--config=configs/default.py", "--config.checkpoint.keep_best=2")
  assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "best_metric" in r.stderr


# ------------------------------------------------------------- 9. the wrong directory


def test_the_wrong_directory_says_what_it_is_and_what_to_pass(tmp_path):
  run = tmp_path / "run"
  for step in (5, 10):
    ofx.save(str(run / "checkpoints" / str(step)), {"s": {"x": np.arange(3)}})
  with pytest.raises(ofx.CheckpointNotFoundError, match=r"directory of steps, holding step\(s\) \[5, 10\];"
                                                        r" pass one of them, e.g. .*checkpoints/10"):
    ofx.restore(str(run / "checkpoints"))
  with pytest.raises(ofx.CheckpointNotFoundError, match=r"a run's workdir: its checkpoints are in"):
    ofx.metadata(str(run))
  orbax_dir = tmp_path / "orbax"
  os.makedirs(orbax_dir)
  open(orbax_dir / "_CHECKPOINT_METADATA", "w").write("{}")
  with pytest.raises(ofx.CheckpointNotFoundError, match="orbax-checkpoint"):
    ofx.restore(str(orbax_dir))
  r = cli("show", str(run / "checkpoints"))
  assert r.returncode == 2 and "holding step(s) [5, 10]" in r.stderr


# ------------------------------------------------------------- 11. one set of defaults


def test_one_set_of_defaults():
  sys.path.insert(0, ROOT)
  from configs import default  # pylint: disable=g-import-not-at-top
  assert ofx.CheckpointPolicy.from_config(default.get_checkpoint_config()) == ofx.CheckpointPolicy()
  manager_doc = open(os.path.join(ROOT, "docs", "manager.md")).read()
  table = manager_doc[manager_doc.index("<!-- config-table"):manager_doc.index("<!-- /config-table -->")]
  rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, re.M))
  assert set(rows) == {f.name for f in dataclasses.fields(ofx.CheckpointPolicy)}, set(rows) ^ {
      f.name for f in dataclasses.fields(ofx.CheckpointPolicy)}
  for f in dataclasses.fields(ofx.CheckpointPolicy):
    shown = rows[f.name].strip().strip("`")
    value = getattr(ofx.CheckpointPolicy(), f.name)
    assert shown in (repr(value), str(value), f"{value:g}" if isinstance(value, float) else str(value),
                     f'"{value}"', str(value).replace("'", '"')), (f.name, shown, value)


# ------------------------------------------------------------- 13. visible by default


def test_resume_and_preemption_are_visible_without_logging_setup(tmp_path):
  code = ("import numpy as np, orbax_flax as ofx, sys\n"
          "c = ofx.CheckpointCallback(sys.argv[1], {'save_interval_steps': 1})\n"
          "s = c.restore_or_init({'w': np.zeros(2)})\n"
          "c.on_step_end(1, s, {}); c.close()\n")
  env = jobs.env_for(1)
  subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, check=True, timeout=120,
                 capture_output=True)
  r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True,
                     text=True, timeout=120)
  assert "orbax_flax: restored step 1" in r.stderr, r.stderr


# ------------------------------------------------------------- 14. progress on a terminal


def _run_in_pty(args, env):
  """Runs a command with a terminal as its stdout and stderr; returns what it wrote there."""
  master, slave = pty.openpty()
  proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
  os.close(slave)
  out = b""
  while True:
    r, _, _ = select.select([master], [], [], 60)
    if not r:
      break
    try:
      chunk = os.read(master, 4096)
    except OSError:  # the child closed the terminal
      break
    if not chunk:
      break
    out += chunk
  os.close(master)
  proc.wait(timeout=60)
  return out.decode(errors="replace")


def test_long_work_shows_progress_on_a_terminal_only(tmp_path):
  path = str(tmp_path / "c")
  ofx.save(path, {"s": {f"w{i}": np.random.default_rng(i).standard_normal(1 << 22, dtype=np.float32)
                        for i in range(8)}})
  env = dict(jobs.env_for(1), ORBAX_FLAX_PROGRESS_AFTER="0")
  shown = _run_in_pty([sys.executable, "-m", "orbax_flax", "verify", path], env)
  assert "OK:" in shown and re.search(r"verify .*: reading every chunk, .*MiB", shown), shown
  quiet = subprocess.run([sys.executable, "-m", "orbax_flax", "verify", path], capture_output=True,
                         text=True, env=env, timeout=120)
  assert "reading every chunk" not in quiet.stdout + quiet.stderr  # no terminal: no progress line
  shown = _run_in_pty([sys.executable, "-m", "orbax_flax", "convert", path,
                      str(tmp_path / "st"), "--format=safetensors"], env)
  assert "wrote" in shown and re.search(r"convert .*: converting array by array, .*MiB", shown), shown


INIT_FROM_SCRIPT = r"""
import sys
import numpy as np
import orbax_flax as ofx
src, workdir = sys.argv[1], sys.argv[2]
ofx.save(src, {"state": {"w": np.arange(1 << 20, dtype=np.float32)}})
ckpt = ofx.CheckpointCallback(workdir, {"init_from": src})
state = ckpt.restore_or_init({"w": np.zeros(1 << 20, np.float32)})
print("W1", float(state["w"][1]), flush=True)
ckpt.close()
"""


def test_init_from_is_restored_like_any_restore_with_progress_on_a_terminal(tmp_path):
  src = str(tmp_path / "pretrained")
  env = dict(jobs.env_for(1), ORBAX_FLAX_PROGRESS_AFTER="0")
  shown = _run_in_pty([sys.executable, "-c", INIT_FROM_SCRIPT, src, str(tmp_path / "run")], env)
  assert "W1 1.0" in shown and "initialised state from" in shown, shown
  assert re.search(rf"restore of {re.escape(src)}: ", shown), shown  # the Checkpointer's Monitor


# ------------------------------------------------------------- 15. TensorBoard without TensorFlow


def test_checkpoint_timings_reach_tensorboard_without_tensorflow(tmp_path):
  logdir = str(tmp_path / "tb")
  with ofx.TensorBoardWriter(logdir) as writer:
    ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 2}, writer=writer)
    step = lambda s, b: ({"w": s["w"] + 1, "step": s["step"] + 1}, {"loss": 0.5})  # noqa: E731
    ofx.Trainer(step, [ckpt, ofx.LogProgress(2, writer)]).fit({"w": np.zeros(4), "step": 0},
                                                               itertools.repeat(None), 6)
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  ea = event_accumulator.EventAccumulator(logdir)
  ea.Reload()
  tags = ea.Tags()["scalars"]
  assert {"checkpoint/blocking_s", "checkpoint/total_s", "checkpoint/bytes", "loss"} <= set(tags), tags
  assert [e.step for e in ea.Scalars("checkpoint/total_s")] == [2, 4, 6]
  src = open(ofx.training.tensorboard.__file__).read()
  assert "import tensorflow" not in src and "import tensorboard" not in src


# ------------------------------------------------------------- 16, 17. failing fast, Ctrl-C twice


def test_a_failure_on_one_process_ends_the_job_in_seconds(tmp_path):
  start = time.monotonic()
  r = subprocess.run([sys.executable, "-m", "orbax_flax.launch", "-n", "2", "--",
                      os.path.join(jobs.HERE, "exception_worker.py"), str(tmp_path)],
                     capture_output=True, text=True, env=jobs.env_for(2), cwd=ROOT, timeout=300)
  took = time.monotonic() - start
  assert r.returncode != 0 and "boom on process 1" in r.stdout + r.stderr
  assert took < 25, took  # start-up ~5 s + 3 s agreement + 2 s grace (was ~50 s)


CTRL_C_SCRIPT = r"""
import itertools, os, signal, sys, threading, time
import numpy as np
import orbax_flax as ofx
ckpt = ofx.CheckpointCallback(sys.argv[1], {"save_interval_steps": 0})
state = {"w": {f"w{i}": np.zeros(1 << 23, np.float32) for i in range(12)}, "step": 0}
def waiting_for_the_save(frame):
  while frame is not None:
    if frame.f_code.co_name == "join" and frame.f_code.co_filename.endswith("saving.py"):
      return True
    frame = frame.f_back
  return False
def second_ctrl_c_while_the_save_writes():
  main = threading.main_thread().ident
  while not waiting_for_the_save(sys._current_frames().get(main)):
    time.sleep(0.001)  # the training thread waits for the save's thread to end
  signal.pthread_kill(main, signal.SIGINT)  # as a terminal's Ctrl-C reaches it
def step_fn(s, b):
  if s["step"] == 2:
    if sys.argv[2] == "while_writing":
      threading.Thread(target=second_ctrl_c_while_the_save_writes, daemon=True).start()
    print("TRAINING", flush=True)
    time.sleep(60)  # Ctrl-C arrives here
  return {"w": s["w"], "step": s["step"] + 1}, {}
ofx.Trainer(step_fn, [ckpt]).fit(state, itertools.repeat(None), 100)
"""


# "while_writing": the second Ctrl-C interrupts the wait for the save's thread. On Python
# 3.11 that marked the running thread as stopped: the process exited while tensorstore
# wrote, and aborted ("terminate called without an active exception", SIGABRT).
@pytest.mark.parametrize("second", ["at_once", "while_writing"])
def test_ctrl_c_twice_ends_with_one_short_message(tmp_path, second):
  script = tmp_path / "ctrlc.py"
  script.write_text(CTRL_C_SCRIPT)
  proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run"), second],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=jobs.env_for(1))
  assert proc.stdout.readline().strip() == "TRAINING"
  proc.send_signal(signal.SIGINT)  # KeyboardInterrupt: the exception save of step 2 starts
  if second == "at_once":
    proc.send_signal(signal.SIGINT)  # the second Ctrl-C, before or during that save
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == -signal.SIGINT, (proc.returncode, err[-3000:])  # not an abort
  assert "terminate called" not in err and "Fatal Python error" not in err, err[-3000:]
  assert "During handling of the above exception" not in err, err
  assert "threading.py" not in err, err
  assert err.count("Traceback") <= 1, err
  if second == "while_writing":  # cancelled, or committed whole if its commit was under way
    committed = ofx.CheckpointManager(str(tmp_path / "run" / "checkpoints")).all_steps()
    said = ("its commit was under way and is complete; the last committed step is 2"
            if committed == [2] else "the save is abandoned (never committed half-written);"
            " the last committed step is None")
    assert f"interrupted again while saving step 2: {said}" in err, (committed, err[-3000:])
    if committed:  # whole: every array reads back
      restored = ofx.CheckpointManager(str(tmp_path / "run" / "checkpoints")).restore(2)
      assert sorted(restored["state"]["w"]) == sorted(f"w{i}" for i in range(12)), restored.keys()
      assert not any(w.any() for w in restored["state"]["w"].values())


# ------------------------------------------------------------- 18. small things


def test_show_tells_slashes_in_keys_from_nesting(tmp_path):
  path = str(tmp_path / "c")
  ofx.save(path, {"s": {"a/b": np.ones(2), "a": {"b": np.zeros(2)}}})
  out = cli("show", path).stdout
  rows = [l.split()[0] for l in out.splitlines() if l.startswith("    ")]
  assert sorted(rows) == ["a/b", "a\\/b"], out


def test_single_device_arrays_are_not_called_no_mesh(tmp_path, caplog):
  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 1})
  ckpt.restore_or_init({"w": jnp.ones(3)})
  ckpt.on_step_end(1, {"w": jnp.ones(3)})
  ckpt.close()
  with caplog.at_level(logging.INFO, logger="orbax_flax"):
    ofx.CheckpointCallback(str(tmp_path), {}).restore_or_init({"w": jnp.ones(3)})
  assert "no mesh" not in caplog.text and "single device" in caplog.text, caplog.text


def test_a_users_own_signal_handler_is_chained(tmp_path):
  calls = []
  previous = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))
  try:
    ckpt = ofx.CheckpointCallback(str(tmp_path), {"preemption_signals": ("SIGUSR2",)})
    state = ckpt.restore_or_init({"w": np.zeros(2)})
    os.kill(os.getpid(), signal.SIGUSR2)
    time.sleep(0.05)
    assert ckpt.on_step_end(1, state) is True  # ours: saved and stop
    assert calls == [signal.SIGUSR2]           # and theirs ran too
    ckpt.close()
    os.kill(os.getpid(), signal.SIGUSR2)       # after the run: only theirs
    time.sleep(0.05)
    assert calls == [signal.SIGUSR2] * 2
  finally:
    signal.signal(signal.SIGUSR2, previous)
