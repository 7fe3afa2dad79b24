"""SIGTERM at awkward times: during a restore, during a save in flight, twice, during the final save.

Each case is a real training process (``signal_worker.py``, 256 MiB of state)
that prints what it is doing; the signal is sent right after the line, while
that work is under way. Afterwards every committed step restores, and a
restart resumes from the newest.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np

import jobs
import orbax_flax as ofx

HERE = os.path.dirname(os.path.abspath(__file__))


def _start(workdir, steps, interval=5):
  return subprocess.Popen([sys.executable, os.path.join(HERE, "signal_worker.py"), str(workdir),
                           str(steps), f"--interval={interval}"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=jobs.env_for(1))


def _until(proc, marker):
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if line.startswith(marker):
      return lines
  raise AssertionError(f"no {marker!r}:\n" + "".join(lines))


def _finish(proc, lines):
  rest, _ = proc.communicate(timeout=240)
  return "".join(lines) + rest


def _check_steps(workdir):
  with ofx.CheckpointManager(os.path.join(workdir, "checkpoints")) as m:
    steps = m.all_steps()
    for step in steps:
      w = m.restore(step)["state"]["w"]["w3"]
      assert w.min() == w.max() == step, (step, w.min(), w.max())  # w counts the steps
  return steps


def test_sigterm_during_a_restore(tmp_path):
  first = _start(tmp_path, 5)
  out = _finish(first, [])
  assert first.returncode == 0 and "DONE 5" in out, out[-3000:]
  proc = _start(tmp_path, 20)
  lines = _until(proc, "RESTORE_START")
  proc.send_signal(signal.SIGTERM)  # arrives while step 5 is being read
  out = _finish(proc, lines)
  assert proc.returncode == 0, out[-3000:]
  assert "DONE 6 preempted=True" in out, out[-3000:]  # resumed, then saved the next step and stopped
  assert 6 in _check_steps(tmp_path)


def test_sigterm_during_a_save_in_flight(tmp_path):
  proc = _start(tmp_path, 50)
  lines = _until(proc, "SAVE_STARTED 5")
  proc.send_signal(signal.SIGTERM)  # step 5's save is still being written
  out = _finish(proc, lines)
  assert proc.returncode == 0 and "DONE 6 preempted=True" in out, out[-3000:]
  assert _check_steps(tmp_path) == [5, 6]  # the save in flight and the preemption save


def test_sigterm_twice_exits_at_once_and_loses_nothing_committed(tmp_path):
  proc = _start(tmp_path, 50)
  lines = _until(proc, "SAVE_STARTED 10")
  proc.send_signal(signal.SIGTERM)
  time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)  # the second one: exit now
  out = _finish(proc, lines)
  assert proc.returncode == -signal.SIGTERM, (proc.returncode, out[-3000:])
  steps = _check_steps(tmp_path)
  assert 5 in steps, steps  # what was committed before stays; nothing half-written is listed
  again = _start(tmp_path, 12)
  out = _finish(again, [])
  assert again.returncode == 0 and "DONE 12" in out, out[-3000:]
  assert max(_check_steps(tmp_path)) == 12


def test_sigterm_during_the_final_save(tmp_path):
  proc = _start(tmp_path, 3, interval=100)
  lines = _until(proc, "FINAL_SAVE")
  proc.send_signal(signal.SIGTERM)
  out = _finish(proc, lines)
  assert proc.returncode == 0 and "DONE 3" in out, out[-3000:]
  assert _check_steps(tmp_path) == [3]  # the final save completed
  w = ofx.restore(os.path.join(tmp_path, "checkpoints", "3"))["state"]["w"]["w0"]
  np.testing.assert_array_equal(w, np.full(1 << 23, 3, np.float32))
