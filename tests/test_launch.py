"""python -m orbax_flax.launch: environment, prefixed output, signals, failures."""

import ipaddress
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


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def _start(args, **kwargs) -> subprocess.Popen:
  # A session of its own, like a shell's job: the test can signal its process group as a
  # terminal does, and kill it whole (or, with the launcher gone, its processes by their pids).
  return subprocess.Popen([*LAUNCH, *args], stdout=subprocess.PIPE, text=True, cwd=jobs.ROOT,
                          start_new_session=True, **kwargs)


def _read_until(p: subprocess.Popen, word: str, count: int) -> list[str]:
  out = []
  while sum(word in l for l in out) < count:
    line = p.stdout.readline()
    assert line, "".join(out)
    out.append(line)
  return out


def _pids(lines: list[str]) -> list[int]:
  return [int(m.group(1)) for m in (re.search(r"pid=(\d+)", l) for l in lines) if m]


def test_ctrl_c_reaches_every_process_once():
  # A terminal's Ctrl-C is a SIGINT to its foreground process group: the launcher's. The
  # processes get it once, forwarded by the launcher (twice when they were in its group: with
  # preemption_signals=("SIGTERM", "SIGINT"), a second Ctrl-C ends a process without saving;
  # or once from the terminal where the two came at once, as a pending signal is not queued
  # twice: the child names the sender of each).
  p = _start(["-n", "2", "--", CHILD, "sigint"], stderr=subprocess.STDOUT)
  try:
    out = _read_until(p, "ready", 2)
    os.killpg(p.pid, signal.SIGINT)
    rest, _ = p.communicate(timeout=30)
  finally:
    _kill_group(p)
  assert p.returncode == 0, "".join(out) + rest
  assert rest.count("SIGINTs from: the launcher\n") == 2, rest


def _kill_group(p: subprocess.Popen) -> None:
  if p.poll() is None:
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def test_a_closed_stdout_is_said_once_and_the_job_still_ends():
  # `launch ... | head -1`: the launcher's writes fail once the reader is gone; it must go on
  # reading the processes' pipes (or they block in write() and the job never ends).
  r, w = os.pipe()
  p = subprocess.Popen([*LAUNCH, "-n", "2", "--", CHILD, "flood"], stdout=w,
                       stderr=subprocess.PIPE, text=True, cwd=jobs.ROOT, start_new_session=True)
  os.close(w)
  with os.fdopen(r) as f:
    assert f.readline().startswith("[")
  try:
    _, err = p.communicate(timeout=20)
  finally:
    _kill_group(p)
  assert p.returncode == 0, err
  assert err.count("the processes' output is discarded from now on") == 1, err
  assert "Broken pipe" in err and "Traceback" not in err, err


def test_a_killed_launcher_leaves_no_process_running(tmp_path):
  # SIGKILL (the OOM killer, a supervisor's timeout): every process gets SIGTERM, as on a
  # preemption (a training process saves), rather than training on unsupervised.
  p = _start(["-n", "2", "--", CHILD, "term_file", str(tmp_path)])
  pids = []
  try:
    pids = _pids(_read_until(p, "ready", 2))
    assert len(pids) == 2
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    deadline = time.monotonic() + 5
    while any(map(_alive, pids)) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not [q for q in pids if _alive(q)]
    assert sorted(os.listdir(tmp_path)) == sorted(f"term-{q}" for q in pids)
  finally:
    for q in pids:
      if _alive(q):
        os.kill(q, signal.SIGKILL)


def test_stopping_the_others_reaches_a_wrapper_scripts_children(tmp_path):
  # A program that runs the training as its own child (`-- ./run.sh`): when another process
  # fails, the trainer under the wrapper is stopped too, not only the wrapper.
  wrapper = tmp_path / "run.sh"
  wrapper.write_text(f'#!/bin/sh\n"{sys.executable}" "{CHILD}" fail\nexit $?\n')
  wrapper.chmod(0o755)
  p = _start(["-n", "2", "--grace=2", "--", str(wrapper)])
  pids = []
  try:
    out, _ = p.communicate(timeout=30)
    pids = _pids(out.splitlines())
    assert p.returncode == 3, out
    assert len(pids) == 2, out
    deadline = time.monotonic() + 2
    while any(map(_alive, pids)) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not [q for q in pids if _alive(q)], out
  finally:
    _kill_group(p)
    for q in pids:
      if _alive(q):
        os.kill(q, signal.SIGKILL)


def _listening(port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
  """The local addresses of the TCP sockets listening on ``port`` (Linux's /proc/net)."""
  found = []
  for name in ("/proc/net/tcp", "/proc/net/tcp6"):
    with open(name) as f:
      for row in f.read().splitlines()[1:]:
        local, state = row.split()[1], row.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
          raw = bytes.fromhex(address)  # 32-bit words in host order
          found.append(ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))
  return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp6") or sys.byteorder != "little",
                    reason="reads Linux's /proc/net/tcp6 (little-endian words)")
def test_the_coordinator_listens_on_the_loopback_address_only():
  # jax.distributed's coordination service (an unauthenticated key-value store) listens on
  # every interface unless JAX_COORDINATOR_BIND_ADDRESS says otherwise.
  p = _start(["-n", "2", "--", CHILD, "listen"], stderr=subprocess.STDOUT, env=jobs.env_for(1))
  try:
    out = _read_until(p, "ready", 2)
    port = int(re.search(r"at (?:127\.0\.0\.1|\[::1\]):(\d+)", "".join(out)).group(1))
    listening = _listening(port)
    p.send_signal(signal.SIGUSR1)
    rest, _ = p.communicate(timeout=60)
  finally:
    _kill_group(p)
  assert p.returncode == 0, "".join(out) + rest
  assert listening, "".join(out)
  # (gRPC listens on an IPv6 socket at ::ffff:127.0.0.1 where it can: 127.0.0.1 only)
  assert all(a.is_loopback or getattr(a, "ipv4_mapped", None) and a.ipv4_mapped.is_loopback
             for a in listening), listening


def test_everything_after_the_script_is_its_own():
  # Without --, what follows the script is the script's, also what looks like (or abbreviates)
  # an option of the launcher; -m module and -c code take what follows them too.
  for args in (["-n", "2", CHILD, "argv", "--devices=16", "-n", "3", "--lr=0.1"],
               ["-n", "2", "--", CHILD, "argv", "--devices=16", "-n", "3", "--lr=0.1"],
               ["-n", "2", "-m", "launch_child", "argv", "--devices=16", "-n", "3", "--lr=0.1"]):
    r = subprocess.run([*LAUNCH, *args], capture_output=True, text=True, timeout=60,
                       cwd=jobs.ROOT, env=jobs.env_for(1), check=False)
    assert r.returncode == 0, args + [r.stdout + r.stderr]
    lines = [l for l in r.stdout.splitlines() if " argv " in l]
    assert sorted(l[:4] for l in lines) == ["[0] ", "[1] "], r.stdout
    assert all(l.endswith("argv ['--devices=16', '-n', '3', '--lr=0.1']") for l in lines), r.stdout
    assert "count=16" not in r.stdout, r.stdout


def test_a_last_line_without_a_newline_is_ended():
  r = subprocess.run([*LAUNCH, "-n", "2", "--", CHILD, "partial"], capture_output=True,
                     text=True, timeout=60, cwd=jobs.ROOT, check=False)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "[0] saving...\n" in r.stdout and "[1] line from 1\n" in r.stdout, r.stdout
  assert all(re.fullmatch(r"\[\d\] [^[]*", l) for l in r.stdout.splitlines()), r.stdout


def test_initialize_from_env_names_the_missing_variables(monkeypatch):
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
  monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)
  monkeypatch.delenv("JAX_PROCESS_ID", raising=False)
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES and JAX_PROCESS_ID are not"):
    launch.initialize_from_env()
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  with pytest.raises(ValueError, match="but JAX_PROCESS_ID is not"):
    launch.initialize_from_env()
  monkeypatch.setenv("JAX_PROCESS_ID", "first")
  with pytest.raises(ValueError, match="must be integers"):
    launch.initialize_from_env()
