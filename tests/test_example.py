"""examples/train.py as users run it: real processes, real signals, real resumes."""

import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

import jobs
import orbax_flax as ofx

TRAIN = os.path.join(jobs.ROOT, "examples", "train.py")
TINY = ["--config=configs/default.py", "--config.num_layers=1", "--config.d_model=64",
        "--config.d_ff=128", "--config.num_heads=2", "--config.seq_len=32", "--config.batch_size=8",
        "--config.log_every=1", "--config.checkpoint.save_interval_steps=10"]


def command(workdir, steps, n=1, devices=8, extra=()):
  args = [TRAIN, f"--workdir={workdir}", *TINY, f"--config.num_steps={steps}", *extra]
  if n == 1:
    return [sys.executable, *args], jobs.env_for(devices)
  launcher = [sys.executable, "-m", "orbax_flax.launch", "-n", str(n),
              f"--devices_per_process={devices}", "--", *args]
  env = jobs.env_for(devices, {"OFX_HEARTBEAT_S": "10"})
  env.pop("XLA_FLAGS")
  return launcher, env


def start(workdir, steps, **kw):
  cmd, env = command(workdir, steps, **kw)
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, cwd=jobs.ROOT)


def run(workdir, steps, **kw):
  p = start(workdir, steps, **kw)
  out, _ = p.communicate(timeout=300)
  assert p.returncode == 0, out[-5000:]
  return out


def read_until(proc, pattern, timeout=240):
  """Reads output lines until one matches; returns everything read."""
  return "".join(jobs.read_until(proc, pattern, timeout))


def done(out):
  return re.findall(r"DONE at step (\d+); params (\w+)", out)


def restored(out):
  return re.findall(r"RESTORED step (\d+); params (\w+)", out)


def commits(out, reason):
  return [int(s) for s in re.findall(rf"checkpoint step (\d+) \({reason}\) committed", out)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The final params fingerprint of an uninterrupted 30-step single-process run."""
  out = run(str(tmp_path_factory.mktemp("ref")), 30)
  (step, digest), = done(out)
  assert step == "30"
  return digest


def test_sigterm_saves_and_resume_is_bitwise(tmp_path, uninterrupted):
  p = start(tmp_path, 30)
  out = read_until(p, r"step 14: loss")
  p.send_signal(signal.SIGTERM)
  rest, _ = p.communicate(timeout=120)
  out += rest
  assert p.returncode == ofx.PREEMPTED_EXIT_CODE == 143, out[-3000:]  # restart me, not 0
  (saved,) = commits(out, "preemption")
  assert 14 <= saved < 30 and f"PREEMPTED at step {saved}" in out
  mngr = ofx.CheckpointManager(str(tmp_path / "checkpoints"))
  assert mngr.latest_step() == saved and mngr.step_info(saved).reason == "preemption"
  assert max(s for s in mngr.all_steps() if s != saved) == 10  # the last periodic save
  out2 = run(tmp_path, 30)
  assert restored(out2)[0][0] == str(saved)
  assert done(out2) == [("30", uninterrupted)]  # bitwise the uninterrupted model


# 4 processes x 2 devices, SIGTERM to one of them: test_tiers.py's tiered preemption run.
@pytest.mark.parametrize("n,devices", [(2, 4)])
def test_sigterm_to_one_process_all_save_the_same_step(tmp_path, n, devices):
  p = start(tmp_path, 1000, n=n, devices=devices)
  read_until(p, rf"\[{n - 1}\] .*step 6: loss")
  children = psutil.Process(p.pid).children()
  last = next(c for c in children if c.environ().get("JAX_PROCESS_ID") == str(n - 1))
  last.send_signal(signal.SIGTERM)  # only the last process is told
  out, _ = p.communicate(timeout=180)
  assert p.returncode == ofx.PREEMPTED_EXIT_CODE, out[-5000:]  # the launcher passes it on
  assert "[launch] process" not in out  # a preempted process is no failure: none is stopped
  # One commit line, process 0's: the others log theirs at DEBUG.
  assert re.findall(r"\[(\d+)\] .*checkpoint step \d+ \(\w+\) committed", out) == ["0"] * len(
      re.findall(r"checkpoint step \d+ \(\w+\) committed", out)), out[-5000:]
  saved = commits(out, "preemption")
  assert len(saved) == 1, saved
  for i in range(n):  # every process saved that one step and stopped
    assert re.search(rf"\[{i}\] .*PREEMPTED at step {saved[0]}", out)
  meta = ofx.metadata(str(tmp_path / "checkpoints" / str(saved[0])))
  assert meta.process_count == n and meta.custom["reason"] == "preemption"


def test_resume_on_other_device_and_process_counts(tmp_path):
  # With a local tier too: it holds the same newest step, but it is tied to the process
  # layout, so each restart with another process count reads the persistent tier, resharded.
  tiered = [f"--config.checkpoint.local_directory={tmp_path / 'local'}",
            "--config.checkpoint.local_save_interval_steps=5"]
  out = run(tmp_path, 10, n=2, devices=4, extra=tiered)              # 2 processes x 4 devices
  (_, digest10), = set(done(out))
  assert "local checkpoint step 10 committed" in out
  out = run(tmp_path, 20, n=1, devices=4, extra=tiered)              # 1 process x 4 devices
  assert restored(out) == [("10", digest10)]           # bitwise what was saved
  assert re.search(r"local tier \(.*\): ignoring step 10: saved by a job of 2 process\(es\),"
                   r" this one has 1 \(a local step is tied to the process layout\)", out)
  assert "saved on mesh {'data': 4, 'model': 2} by 2 process(es), restored onto mesh {'data': 2," in out
  (_, digest20), = done(out)
  out = run(tmp_path, 30, n=4, devices=2, extra=tiered)              # 4 processes x 2 devices
  assert set(restored(out)) == {("20", digest20)}
  for i in range(2):  # (processes 2 and 3 hold no local step: their directories are new)
    assert re.search(rf"\[{i}\] .*local tier \(.*\): ignoring step .*saved by a job of"
                     r" [12] process\(es\), this one has 4", out), i
  (_, digest30), = set(done(out))
  assert len(done(out)) == 4 and done(out)[0][0] == "30"
  # The data followed: ofx.data.ElasticIterator, resumed on 2 -> 1 -> 4 processes, trained on
  # every record exactly once (the example's ledger of record ids, process 0's).
  assert "RECORDS steps 1-30 (3 run(s)): 240 records, ids 0-239, each trained on exactly once" \
      in out, out[-3000:]
  if os.environ.get("ORBAX_FLAX_FAULTS") != "long":
    return  # the fourth run, ~11 s: ORBAX_FLAX_FAULTS=long
  # One device per process: the mesh's "model" axis stays within a process (it crossed them,
  # and each process's rows of the batch did not fit the mesh at the first step).
  out = run(tmp_path, 40, n=2, devices=1, extra=tiered)              # 2 processes x 1 device
  assert set(restored(out)) == {("30", digest30)}
  # The data followed: ofx.data.ElasticIterator, resumed on 2 -> 1 -> 4 -> 2 processes,
  # trained on every record exactly once (the example's ledger of record ids, process 0's).
  assert "RECORDS steps 1-40 (4 run(s)): 320 records, ids 0-319, each trained on exactly once" \
      in out, out[-3000:]
  assert len(done(out)) == 2 and done(out)[0][0] == "40"


def test_sigkill_during_background_save_resumes_from_last_commit(tmp_path, uninterrupted):
  extra = ["--config.checkpoint.save_interval_steps=1", "--config.checkpoint.max_to_keep=2"]
  p = start(tmp_path, 30, extra=extra)
  read_until(p, r"step 12: loss")
  p.send_signal(signal.SIGKILL)  # mid-run: a save of almost every step is in flight
  p.communicate(timeout=60)
  committed = ofx.CheckpointManager(str(tmp_path / "checkpoints")).all_steps()
  assert committed and committed[-1] >= 10
  for step in committed:
    ofx.verify(str(tmp_path / "checkpoints" / str(step)))  # complete and intact
  out = run(tmp_path, 30, extra=extra)
  assert restored(out)[0][0] == str(committed[-1])
  assert done(out) == [("30", uninterrupted)]


def test_second_signal_exits_at_once_without_committing_half(tmp_path, uninterrupted):
  p = start(tmp_path, 30, extra=["--config.checkpoint.save_interval_steps=1"])
  read_until(p, r"step 8: loss")
  p.send_signal(signal.SIGTERM)
  p.send_signal(signal.SIGTERM)
  p.communicate(timeout=60)
  mngr = ofx.CheckpointManager(str(tmp_path / "checkpoints"))
  for step in mngr.all_steps():
    ofx.verify(mngr.step_path(step))
  out = run(tmp_path, 30)
  assert done(out) == [("30", uninterrupted)]


def test_a_warm_restart_loads_the_compiled_init_and_train_step(tmp_path):
  """With compilation_cache=True a restart compiles neither of the example's programs.

  The example builds the callback (which turns the cache on) before its jitted init:
  built after it, init (1.7 s of the example's 5.9 s warm restart on 2 cores) was compiled
  again at every start.
  """
  def go(steps):
    cmd, env = command(tmp_path, steps, extra=["--config.checkpoint.compilation_cache=True"])
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the job's own cache, not the test session's
    env.update(JAX_LOG_COMPILES="1", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")  # the tiny model compiles fast
    p = subprocess.run(cmd, env=env, cwd=jobs.ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    return p.stdout + p.stderr

  hit = "Persistent compilation cache hit for 'jit_{}'"
  first = go(2)
  assert hit.format("init") not in first and "compile cache: 0 hits" in first
  second = go(4)
  assert restored(second)[0][0] == "2"
  for program in ("init", "step"):
    assert hit.format(program) in second, (program, second[-5000:])
  assert re.search(r"restart from step 2: .*compile cache: [1-9]\d* hits?, 0 misses", second)


def test_a_batch_the_processes_cannot_share_is_refused_before_anything_is_written(tmp_path):
  workdir = tmp_path / "run"
  cmd, env = command(workdir, 10, n=2, devices=1, extra=["--config.batch_size=3"])
  p = subprocess.run(cmd, env=env, cwd=jobs.ROOT, capture_output=True, text=True, timeout=300)
  out = p.stdout + p.stderr
  assert p.returncode != 0, out[-3000:]
  assert "batch_size=3 must be a multiple of the 2 processes" in out, out[-3000:]
  assert not workdir.exists() or not any(workdir.iterdir()), sorted(workdir.rglob("*"))
  assert "--config.batch_size=2" in out  # the fix, named
