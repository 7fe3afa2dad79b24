"""Run a script as N local processes joined by ``jax.distributed`` (like torchrun).

    python -m orbax_flax.launch -n 4 [--devices_per_process=2] -- examples/train.py --workdir=/tmp/run

Everything after the script (or ``-m module`` / ``-c code``, or a program) is its own
arguments, ``--`` or not: ``-n 4 train.py -n 8`` gives ``-n 8`` to the script. Each process
gets ``JAX_COORDINATOR_ADDRESS=127.0.0.1:<port>`` (``[::1]:<port>`` on a machine without IPv4
sockets, or ``--host``), ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``; the script calls
:func:`initialize_from_env` (``examples/train.py`` does). ``JAX_COORDINATOR_BIND_ADDRESS`` is
set to the same address, so that process 0's coordination service listens there only (jax
would otherwise listen on every interface). On a CPU-only machine ``--devices_per_process``
simulates devices with XLA_FLAGS. Output lines are prefixed with ``[i]`` (a last line without
a newline is ended); if the launcher's own output fails (a closed pipe, as with ``| head``, or
a full disk) it says so once on stderr and discards the rest, and the job goes on.

Each process runs in a session (and process group) of its own: a terminal's Ctrl-C reaches
the launcher only, and SIGTERM, SIGINT, SIGUSR1, SIGUSR2 and SIGHUP sent to the launcher are
forwarded, once, to every process's whole group (a wrapper script's children too), also
those that arrive while the processes are being started. On Linux every process gets
SIGTERM when the launcher dies, even by SIGKILL (as a preemption: a training process saves
and exits). When one process fails the others are stopped (SIGTERM, then SIGKILL after
``--grace`` seconds, 2 by default: without the failed process they cannot save or commit
anything) and the launcher exits with the failing process's code. With the training
callback a failure on one process ends the whole job within about 6 s: 3 s for the others
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

  Raises:
    ValueError: ``JAX_COORDINATOR_ADDRESS`` is set but ``JAX_NUM_PROCESSES`` or
      ``JAX_PROCESS_ID`` is missing or not an integer.
  """
  address = os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not address:
    return False
  names = ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
  missing = [n for n in names if not os.environ.get(n)]
  if missing:
    raise ValueError(f"JAX_COORDINATOR_ADDRESS is set ({address}) but {' and '.join(missing)}"
                     f" {'is' if len(missing) == 1 else 'are'} not: set all three (python -m"
                     " orbax_flax.launch does), or unset JAX_COORDINATOR_ADDRESS to run alone")
  try:
    num_processes, process_id = (int(os.environ[n]) for n in names)
  except ValueError:
    raise ValueError(f"JAX_NUM_PROCESSES={os.environ[names[0]]!r} and JAX_PROCESS_ID="
                     f"{os.environ[names[1]]!r} must be integers") from None
  import jax  # pylint: disable=g-import-not-at-top
  kwargs = {}
  if heartbeat_timeout_seconds is not None:
    kwargs["heartbeat_timeout_seconds"] = heartbeat_timeout_seconds
  jax.distributed.initialize(address, num_processes=num_processes, process_id=process_id,
                             initialization_timeout=initialization_timeout, **kwargs)
  if num_processes > 1:
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


class _Output:
  """The launcher's stdout, which every process's copying thread writes its lines to.

  A failed write (the reader of a pipe went away, as with ``| head``; a full disk) must not
  end the thread: nobody would read that process's pipe any more, the process would block in
  write() once the pipe is full, and the launcher would wait for it forever. The first
  failure is said once on stderr and stdout is pointed at /dev/null (so that the interpreter's
  last flush does not fail too); the lines are read and dropped from then on.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._discarding = False

  def write(self, text: str) -> None:
    with self._lock:
      if self._discarding:
        return
      try:
        sys.stdout.write(text)
        sys.stdout.flush()
      except (OSError, ValueError) as e:  # ValueError: stdout closed
        self._discarding = True
        try:
          devnull = os.open(os.devnull, os.O_WRONLY)
          os.dup2(devnull, sys.stdout.fileno())
          os.close(devnull)
        except (OSError, ValueError):
          pass
        try:
          sys.stderr.write(f"[launch] writing the output failed ({type(e).__name__}: {e}); the"
                           " processes' output is discarded from now on\n")
          sys.stderr.flush()
        except (OSError, ValueError):
          pass


def _pump(i: int, proc: subprocess.Popen, output: _Output) -> None:
  for line in proc.stdout:
    # A last line without a newline (a progress line, a message cut short) is ended here, or
    # the next process's line would be glued to it.
    output.write(f"[{i}] {line}" if line.endswith("\n") else f"[{i}] {line}\n")


def _signal(proc: subprocess.Popen, signum: int) -> None:
  """Sends ``signum`` to ``proc``'s process group: it and whatever it started (a wrapper's
  children), unless ``proc`` has ended (its pid may then be reused)."""
  if proc.poll() is None:
    try:
      os.killpg(proc.pid, signum)
    except ProcessLookupError:  # it ended since poll()
      pass


def _die_with_launcher():
  """A ``preexec_fn`` that makes the child get SIGTERM when the launcher dies (Linux), or None.

  PR_SET_PDEATHSIG can only be set by the child itself, so between fork and exec. That runs
  Python code in the child of a fork, safe only where no other thread could hold a lock the
  code needs: :func:`launch` starts every process before any thread of its own, and the code
  only makes system calls, through a ctypes function resolved here, before the fork. If the
  launcher died before the child set it, the child sends itself the SIGTERM.
  """
  if not sys.platform.startswith("linux"):
    return None
  import ctypes  # pylint: disable=g-import-not-at-top
  prctl = ctypes.CDLL(None, use_errno=True).prctl
  pr_set_pdeathsig, sigterm = ctypes.c_int(1), ctypes.c_ulong(signal.SIGTERM.value)
  launcher = os.getpid()

  def preexec() -> None:
    prctl(pr_set_pdeathsig, sigterm)
    if os.getppid() != launcher:
      os.kill(os.getpid(), signal.SIGTERM)

  return preexec


def launch(argv: list[str], num_processes: int, devices_per_process: int | None = None,
           grace: float = 2.0, host: str | None = None) -> int:
  """Starts the processes and supervises them; returns the exit code.

  ``argv``: the script and its arguments (``-m module ...``, ``-c code ...``, or a program).
  ``host``: the address the processes meet on (None: the first of :data:`LOOPBACKS`
  that this machine can bind). Call it from the main thread of a program that has started
  no other thread (``python -m orbax_flax.launch`` is one): it installs signal handlers, and
  the processes set their parent-death signal between fork and exec.
  """
  address = coordinator_address((host,) if host else LOOPBACKS)
  # A script, or python's own -m module / -c code; anything else is a program.
  cmd = [sys.executable, *argv] if argv[0].endswith(".py") or argv[0] in ("-m", "-c") else argv
  procs: list[subprocess.Popen] = []
  output = _Output()
  pending: list[int] = []  # signals that came while the processes were being started
  started = False

  def forward(signum, frame):  # pylint: disable=unused-argument
    if not started:
      pending.append(signum)
      return
    for p in procs:
      _signal(p, signum)

  # Handlers first: a SIGTERM while the processes start is forwarded to them all once they
  # have, rather than ending the launcher and leaving the started ones behind.
  previous = {s: signal.signal(s, forward) for s in FORWARDED}
  code = 0
  try:
    preexec = _die_with_launcher()
    try:
      for i in range(num_processes):
        env = dict(os.environ, JAX_COORDINATOR_ADDRESS=address,
                   JAX_COORDINATOR_BIND_ADDRESS=address, JAX_NUM_PROCESSES=str(num_processes),
                   JAX_PROCESS_ID=str(i), PYTHONUNBUFFERED="1")
        if devices_per_process:
          env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                              f" --xla_force_host_platform_device_count={devices_per_process}").strip()
        # A session (so a process group) of its own: a terminal's Ctrl-C goes to its foreground
        # group, the launcher's, and reaches the processes once, forwarded (it reached them
        # twice when they shared the launcher's group). A new session rather than only a new
        # group (process_group=0): a background group's read of the terminal would stop the
        # process (SIGTTIN), and the job with it; outside the terminal's session it reads.
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, errors="replace",
                                      start_new_session=True, preexec_fn=preexec))
    except BaseException:
      _stop(procs, grace)
      raise
    started = True
    for signum in pending:
      forward(signum, None)
    pumps = [threading.Thread(target=_pump, args=(i, p, output), daemon=True)
             for i, p in enumerate(procs)]
    for t in pumps:
      t.start()
    while any(p.poll() is None for p in procs):
      failed = [p for p in procs if p.poll() not in (None, 0, PREEMPTED_EXIT_CODE)]
      if failed:
        code = failed[0].returncode
        i = procs.index(failed[0])
        output.write(f"[launch] process {i} exited with {code}; stopping the others\n")
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
    _signal(p, signal.SIGTERM)
  deadline = time.monotonic() + grace
  while time.monotonic() < deadline and any(p.poll() is None for p in procs):
    time.sleep(0.05)
  for p in procs:
    _signal(p, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  # allow_abbrev=False and REMAINDER: everything after the script is the script's own, even
  # what looks like (or abbreviates) an option of the launcher (-n, --devices=...).
  p = argparse.ArgumentParser(prog="python -m orbax_flax.launch", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              allow_abbrev=False)
  p.add_argument("-n", "--num_processes", type=int, required=True)
  p.add_argument("--devices_per_process", type=int, default=None,
                 help="simulated CPU devices per process (sets XLA_FLAGS)")
  p.add_argument("--grace", type=float, default=2.0,
                 help="seconds between SIGTERM and SIGKILL when stopping the others after one"
                      " failed (they cannot save without it: a short grace is enough)")
  p.add_argument("--host", default=None,
                 help="address the processes meet on (default: 127.0.0.1, or ::1 on a machine"
                      " without IPv4 sockets)")
  p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE ARGS",
                 help="run python -m MODULE ARGS")
  p.add_argument("-c", dest="code", nargs=argparse.REMAINDER, metavar="CODE ARGS",
                 help="run python -c CODE ARGS")
  p.add_argument("script", nargs=argparse.REMAINDER,
                 help="[--] the script (a .py file) or program, and its arguments")
  args = p.parse_args(argv)
  script = args.script[1:] if args.script[:1] == ["--"] else args.script
  if args.module is not None:
    script = ["-m", *args.module]
  elif args.code is not None:
    script = ["-c", *args.code]
  if not script or script in (["-m"], ["-c"]):
    p.error("give the script after --, e.g. -- examples/train.py --workdir=/tmp/run")
  if args.num_processes < 1:
    p.error("-n must be >= 1")
  return launch(script, args.num_processes, args.devices_per_process, args.grace, args.host)


if __name__ == "__main__":
  sys.exit(main())
