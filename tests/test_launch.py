"""python -m orbax_flax.launch: environment, prefixed output, signals, failures."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

import jobs
from orbax_flax import launch

CHILD = os.path.join(jobs.HERE, "launch_child.py")
LAUNCH = [sys.executable, "-m", "orbax_flax.launch"]


def test_environment_and_prefixed_output():
  r = subprocess.run([*LAUNCH, "-n", "3", "--devices_per_process=2", "--", CHILD, "ok"],
                     capture_output=True, text=True, timeout=60, cwd=jobs.ROOT, check=False)
  assert r.returncode == 0, r.stdout + r.stderr
  lines = sorted(l for l in r.stdout.splitlines() if "hello" in l)
  assert len(lines) == 3
  for i, line in enumerate(lines):
    assert line.startswith(f"[{i}] hello from {i} of 3 at 127.0.0.1:")
    assert "--xla_force_host_platform_device_count=2" in line


def test_one_failure_stops_the_others_and_sets_the_exit_code():
  start = time.monotonic()
  r = subprocess.run([*LAUNCH, "-n", "3", "--grace=2", "--", CHILD, "fail"],
                     capture_output=True, text=True, timeout=60, cwd=jobs.ROOT, check=False)
  assert r.returncode == 3, r.stdout + r.stderr
  assert "process 1 exited with 3; stopping the others" in r.stdout
  assert time.monotonic() - start < 30  # the sleepers did not run their 120 s


def test_signals_are_forwarded_to_every_process():
  p = subprocess.Popen([*LAUNCH, "-n", "2", "--", CHILD, "signal"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, cwd=jobs.ROOT)
  ready = 0
  out = []
  while ready < 2:
    line = p.stdout.readline()
    assert line, "".join(out)
    out.append(line)
    ready += "ready" in line
  p.send_signal(signal.SIGUSR1)
  rest, _ = p.communicate(timeout=60)
  assert p.returncode == 0, "".join(out) + rest
  assert rest.count("got SIGUSR1: True") == 2


def test_usage_errors():
  r = subprocess.run([*LAUNCH, "-n", "2"], capture_output=True, text=True, timeout=60,
                     cwd=jobs.ROOT, check=False)
  assert r.returncode == 2 and "give the script after --" in r.stderr


def test_the_processes_meet_on_ipv6_loopback_where_asked_or_where_ipv4_is_missing():
  # 192.0.2.1 (TEST-NET-1) is no address of this machine: binding it fails as IPv4 fails on
  # a machine without IPv4 sockets, and the next address is taken.
  assert launch.coordinator_address(("192.0.2.1", "::1")).startswith("[::1]:")
  assert launch.coordinator_address(("[::1]",)).startswith("[::1]:")  # as written in an address
  with pytest.raises(OSError, match=r"192\.0\.2\.1: .*pass --host"):
    launch.coordinator_address(("192.0.2.1",))
  env = jobs.env_for(2)
  env.pop("XLA_FLAGS")
  r = subprocess.run([*LAUNCH, "-n", "2", "--devices_per_process=2", "--host=::1", "--", CHILD,
                      "join"], capture_output=True, text=True, timeout=120, cwd=jobs.ROOT,
                     env=env, check=False)
  assert r.returncode == 0, r.stdout + r.stderr
  for i in range(2):
    assert re.search(rf"\[{i}\] hello from {i} of 2 at \[::1\]:\d+", r.stdout), r.stdout
    # (gloo's C++ writes its "connected" lines in pieces to the same pipe: one may enclose
    # the child's own line, "[0] [Gloo] Rank 0 is connected ... joined: ...ids [0, 1]Expected")
    assert re.search(rf"\[{i}\] .*joined: 2 processes, 4 devices, ids \[0, 1\]", r.stdout), (
        r.stdout + r.stderr)
