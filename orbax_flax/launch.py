"""Run a script as N local processes joined by ``jax.distributed`` (like torchrun).

    python -m orbax_flax.launch -n 4 [--devices_per_process=2] -- examples/train.py --workdir=/tmp/run

Each process gets ``JAX_COORDINATOR_ADDRESS=127.0.0.1:<port>`` (``[::1]:<port>`` on a
machine without IPv4 sockets, or ``--host``), ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``; the script calls
:func:`initialize_from_env` (``examples/train.py`` does). On a CPU-only machine
``--devices_per_process`` simulates devices with XLA_FLAGS. Output lines are
prefixed with ``[i]``. SIGTERM, SIGINT, SIGUSR1, SIGUSR2 and SIGHUP sent to the
launcher are forwarded to every process. When one process fails the others
are stopped (SIGTERM, then SIGKILL after ``--grace`` seconds, 2 by default:
without the failed process they cannot save or commit anything) and the
launcher exits with the failing process's code. With the training callback a
failure on one process ends the whole job within about 6 s: 3 s for the others
to fail too (an exception save needs every process), then the grace.

A process that exits with :data:`PREEMPTED_EXIT_CODE` (preempted, its step
committed) has not failed: the others are left to exit the same way, and the
launcher exits with that code too, so that whatever restarts it restarts the job.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

# The exit status of a job that was preempted and saved: 143 = 128 + SIGTERM, the status a shell
# (and Kubernetes, SLURM, torchelastic) reports for a process the scheduler's SIGTERM ended. Those
# restart on it as on any non-zero status (restartPolicy: OnFailure; `until python train.py; do
# :; done`; torchrun --max-restarts; an sbatch script's `scontrol requeue` on a non-zero status),
# and a Kubernetes podFailurePolicy can match it (onExitCodes: [143], action: Ignore) so that
# preemptions do not count against the Job's backoffLimit. 0 would tell them the job finished.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM.value

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)

# Where the processes meet, in order of preference: IPv4's loopback, then IPv6's (a TPU VM lent
# to this project on 2026-12-06 refused IPv4 sockets: "Address family not supported").
LOOPBACKS = ("127.0.0.1", "::1")


def initialize_from_env(initialization_timeout: int = 300, heartbeat_timeout_seconds: int | None = None) -> bool:
  """Calls ``jax.distributed.initialize`` from JAX_* environment variables, if set.

  Reads ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
  ``JAX_PROCESS_ID`` (as set by this launcher, or by hand). Returns whether it
  initialised. Call it before touching any device.

  With several processes, an uncaught exception then ends the process at once
  (after printing it, exit code 1) instead of waiting in jax.distributed's
  shutdown barrier for processes that are still training: the launcher sees the
  failure and stops the others.
  """
  address = os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not address:
    return False
  import jax  # pylint: disable=g-import-not-at-top
  kwargs = {}
  if heartbeat_timeout_seconds is not None:
    kwargs["heartbeat_timeout_seconds"] = heartbeat_timeout_seconds
  jax.distributed.initialize(address, num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                             process_id=int(os.environ["JAX_PROCESS_ID"]),
                             initialization_timeout=initialization_timeout, **kwargs)
  if int(os.environ["JAX_NUM_PROCESSES"]) > 1:
    sys.excepthook = _exit_on_uncaught
  return True


def _exit_on_uncaught(exc_type, exc, tb) -> None:
  sys.__excepthook__(exc_type, exc, tb)
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(1)  # pylint: disable=protected-access  # skip the shutdown barrier


def coordinator_address(hosts: Sequence[str] = LOOPBACKS) -> str:
  """``host:port`` with a free port on the first of ``hosts`` this machine can bind.

  Args:
    hosts: addresses to try, IPv4 or IPv6 (``::1``), in order.

  Returns:
    ``127.0.0.1:<port>``, or an IPv6 address in brackets (``[::1]:<port>``), as
    ``jax.distributed.initialize`` takes it.

  Raises:
    OSError: no host could be bound; the message names each host and why.

  Example:
    >>> coordinator_address().startswith(("127.0.0.1:", "[::1]:"))
    True
  """
  failed = []
  for host in hosts:
    host = host.strip("[]")  # "[::1]" as in an address, or "::1"
    v6 = ":" in host
    try:
      with socket.socket(socket.AF_INET6 if v6 else socket.AF_INET) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    except OSError as e:
      failed.append(f"{host}: {e.strerror or e}")
      continue
    return f"[{host}]:{port}" if v6 else f"{host}:{port}"
  raise OSError(f"no address to coordinate the processes on ({'; '.join(failed)}); pass"
                " --host with an address this machine can listen on")


def _pump(i: int, proc: subprocess.Popen, lock: threading.Lock) -> None:
  for line in proc.stdout:
    with lock:
      sys.stdout.write(f"[{i}] {line}")
      sys.stdout.flush()


def launch(argv: list[str], num_processes: int, devices_per_process: int | None = None,
           grace: float = 2.0, host: str | None = None) -> int:
  """Starts the processes and supervises them; returns the exit code.

  ``host``: the address the processes meet on (None: the first of :data:`LOOPBACKS`
  that this machine can bind).
  """
  address = coordinator_address((host,) if host else LOOPBACKS)
  procs: list[subprocess.Popen] = []
  lock = threading.Lock()
  for i in range(num_processes):
    env = dict(os.environ, JAX_COORDINATOR_ADDRESS=address,
               JAX_NUM_PROCESSES=str(num_processes), JAX_PROCESS_ID=str(i), PYTHONUNBUFFERED="1")
    if devices_per_process:
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                          f" --xla_force_host_platform_device_count={devices_per_process}").strip()
    # A script, or python's own -m module / -c code; anything else is a program.
    cmd = [sys.executable, *argv] if argv[0].endswith(".py") or argv[0] in ("-m", "-c") else argv
    procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, errors="replace"))
  pumps = [threading.Thread(target=_pump, args=(i, p, lock), daemon=True) for i, p in enumerate(procs)]
  for t in pumps:
    t.start()

  def forward(signum, frame):  # pylint: disable=unused-argument
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)

  previous = {s: signal.signal(s, forward) for s in FORWARDED}
  code = 0
  try:
    while any(p.poll() is None for p in procs):
      failed = [p for p in procs if p.poll() not in (None, 0, PREEMPTED_EXIT_CODE)]
      if failed:
        code = failed[0].returncode
        i = procs.index(failed[0])
        with lock:
          print(f"[launch] process {i} exited with {code}; stopping the others", flush=True)
        _stop(procs, grace)
        break
      time.sleep(0.05)
  finally:
    for s, h in previous.items():
      signal.signal(s, h)
  for t in pumps:
    t.join(timeout=5)
  codes = [p.wait() for p in procs]
  if code == 0:
    code = next((c for c in codes if c != 0), 0)
  return code if code >= 0 else 128 - code


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGTERM)
  deadline = time.monotonic() + grace
  while time.monotonic() < deadline and any(p.poll() is None for p in procs):
    time.sleep(0.05)
  for p in procs:
    if p.poll() is None:
      p.kill()


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  p = argparse.ArgumentParser(prog="python -m orbax_flax.launch", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("-n", "--num_processes", type=int, required=True)
  p.add_argument("--devices_per_process", type=int, default=None,
                 help="simulated CPU devices per process (sets XLA_FLAGS)")
  p.add_argument("--grace", type=float, default=2.0,
                 help="seconds between SIGTERM and SIGKILL when stopping the others after one"
                      " failed (they cannot save without it: a short grace is enough)")
  p.add_argument("--host", default=None,
                 help="address the processes meet on (default: 127.0.0.1, or ::1 on a machine"
                      " without IPv4 sockets)")
  if "--" in argv:
    split = argv.index("--")
    args, script = p.parse_args(argv[:split]), argv[split + 1:]
  else:
    args, script = p.parse_known_args(argv)
  if not script:
    p.error("give the script after --, e.g. -- examples/train.py --workdir=/tmp/run")
  if args.num_processes < 1:
    p.error("-n must be >= 1")
  return launch(script, args.num_processes, args.devices_per_process, args.grace, args.host)


if __name__ == "__main__":
  sys.exit(main())
