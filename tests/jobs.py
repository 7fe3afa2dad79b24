"""Runs real multi-process JAX jobs on this machine for tests.

Each job is N Python processes joined by ``jax.distributed.initialize`` on a
loopback address (:func:`orbax_flax.launch.coordinator_address`), each with its own
simulated CPU devices. Tests check return codes: JAX aborts (it does not raise) when a
process never joins.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import threading
import time

from orbax_flax import launch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclasses.dataclass
class Result:
  returncodes: list[int]
  outputs: list[str]

  def check(self) -> "Result":
    if any(self.returncodes):
      report = "\n".join(f"--- process {i} rc={rc}\n{out[-4000:]}"
                         for i, (rc, out) in enumerate(zip(self.returncodes, self.outputs)))
      raise AssertionError(f"job failed: {self.returncodes}\n{report}")
    return self


def env_for(devices_per_process: int, extra: dict[str, str] | None = None) -> dict[str, str]:
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_process}"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + HERE + os.pathsep + env.get("PYTHONPATH", "")
  if env.get("OFX_TEST_COMPILATION_CACHE"):  # set by conftest: shared by the test session
    env.update(JAX_COMPILATION_CACHE_DIR=env["OFX_TEST_COMPILATION_CACHE"],
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  env.update(extra or {})
  return env


def join(parser: argparse.ArgumentParser, heartbeat_timeout_seconds: int = 10) -> argparse.Namespace:
  """In a worker script: parses the flags :func:`start` passes, then joins the job.

  ``parser`` holds the worker's own flags; --coordinator, --num_processes and
  --process_id are added here. A job whose test stops a process (SIGSTOP) for
  seconds raises ``heartbeat_timeout_seconds``: JAX aborts the job when a
  process misses its heartbeats that long.
  """
  import jax  # pylint: disable=g-import-not-at-top  # only worker processes need it
  parser.add_argument("--coordinator")
  parser.add_argument("--num_processes", type=int)
  parser.add_argument("--process_id", type=int)
  a = parser.parse_args()
  jax.distributed.initialize(a.coordinator, num_processes=a.num_processes, process_id=a.process_id,
                             initialization_timeout=60,
                             heartbeat_timeout_seconds=heartbeat_timeout_seconds)
  return a


def exit_together(timeout_s: float = 120) -> None:
  """In a worker script: ends this process once every process of the job is done with the
  coordination service, without jax.distributed's shutdown barrier.

  Process 0 hosts the service: if it exits while another process still reads a key (the
  last values of an ``all_gather``), that process's error poller sees the service gone
  and JAX aborts it (SIGABRT). So the others say they are leaving once their gather has
  returned, and process 0 exits after it has heard every one of them, and a moment more
  for their ``os._exit`` to run.
  """
  import jax  # pylint: disable=g-import-not-at-top  # only worker processes need it
  from orbax_flax.core import _multihost  # pylint: disable=g-import-not-at-top
  _multihost.all_gather("jobs/exit", "1", timeout_s)
  me, n = jax.process_index(), jax.process_count()
  if me != 0:
    _multihost.publish(f"jobs/left/{me}", "1", timeout_s=timeout_s)
  else:
    for p in range(1, n):
      _multihost.fetch(f"jobs/left/{p}", timeout_s)
    time.sleep(0.5)
  os._exit(0)  # pylint: disable=protected-access


def start(script: str, args: list[str], num_processes: int, devices_per_process: int,
          env: dict[str, str] | None = None) -> list[subprocess.Popen]:
  """Starts the processes of one job; ``script`` reads --process_id etc."""
  coordinator = launch.coordinator_address()
  procs = []
  for i in range(num_processes):
    cmd = [sys.executable, os.path.join(HERE, script), f"--coordinator={coordinator}",
           f"--num_processes={num_processes}", f"--process_id={i}", *args]
    procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=env_for(devices_per_process, env)))
  return procs


def wait(procs: list[subprocess.Popen], timeout: float = 240) -> Result:
  """Waits for the job's processes, reading all their outputs at once: a process whose pipe
  is not read blocks once it holds 64 KiB of output, and the others then wait for it in a
  collective (a job that logs much would hang on the test, not on the library)."""
  deadline = time.monotonic() + timeout
  outs = [""] * len(procs)

  def drain(i, p):
    outs[i] = p.stdout.read()

  readers = [threading.Thread(target=drain, args=(i, p), daemon=True) for i, p in enumerate(procs)]
  for r in readers:
    r.start()
  killed = False
  for p in procs:
    try:
      p.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      killed = True
      for q in procs:
        q.kill()
      break
  for p, r in zip(procs, readers):
    p.wait()
    r.join()
    p.stdout.close()
  if killed:
    outs = [out + "\n[killed by test timeout]" for out in outs]
  return Result([p.returncode for p in procs], outs)


def run(script: str, args: list[str], num_processes: int, devices_per_process: int,
        timeout: float = 240, env: dict[str, str] | None = None) -> Result:
  return wait(start(script, args, num_processes, devices_per_process, env), timeout)


def read_until(proc, pattern: str, timeout: float = 240) -> list[str]:
  """Output lines of ``proc`` up to the first one matching ``pattern`` (a regex); raises
  AssertionError with what was read if the output ends or ``timeout`` passes first."""
  lines = []
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    line = proc.stdout.readline()
    if not line:
      break
    lines.append(line)
    if re.search(pattern, line):
      return lines
  raise AssertionError(f"{pattern!r} not seen:\n" + "".join(lines)[-5000:])


class RecordingWriter:
  """A duck-typed clu ``MetricWriter`` that keeps what it is given: ``scalars`` is
  a list of ``(step, {name: value})``."""

  def __init__(self):
    self.scalars = []

  def write_scalars(self, step, scalars):
    self.scalars.append((step, dict(scalars)))

  def flush(self):
    pass
