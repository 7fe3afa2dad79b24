"""A launcher test child: reports its environment, then behaves as told."""

import os
import signal
import sys
import time


def main():
  mode = sys.argv[1]
  pid = int(os.environ["JAX_PROCESS_ID"])
  print(f"hello from {pid} of {os.environ['JAX_NUM_PROCESSES']} at {os.environ['JAX_COORDINATOR_ADDRESS']}"
        f" devices={os.environ.get('XLA_FLAGS', '')} pid={os.getpid()}", flush=True)
  if mode == "fail" and pid == 1:
    time.sleep(0.5)
    sys.exit(3)
  if mode == "signal":
    got = []
    signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    print("ready", flush=True)
    deadline = time.time() + 60
    while not got and time.time() < deadline:
      time.sleep(0.01)
    print(f"got SIGUSR1: {bool(got)}", flush=True)
    sys.exit(0 if got else 1)
  if mode == "sigint":  # the SIGINTs that reach it in 0.5 s after the first, and who sent them
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    print("ready", flush=True)
    senders = []
    info = signal.sigtimedwait([signal.SIGINT], 60)
    deadline = time.monotonic() + 0.5
    while info:
      senders.append("the launcher" if info.si_pid == os.getppid() else f"pid {info.si_pid}")
      info = signal.sigtimedwait([signal.SIGINT], max(0, deadline - time.monotonic()))
    print(f"SIGINTs from: {', '.join(senders)}", flush=True)
  if mode == "flood":  # 2 MB of output
    for i in range(20000):
      print("x" * 100, i)
  if mode == "term_file":  # on SIGTERM writes <dir>/term-<pid> (its stdout may be gone) and exits
    def on_term(signum, frame):  # pylint: disable=unused-argument
      with open(os.path.join(sys.argv[2], f"term-{os.getpid()}"), "w"):
        pass
      os._exit(0)  # pylint: disable=protected-access
    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    time.sleep(60)
  if mode == "argv":
    print(f"argv {sys.argv[2:]}", flush=True)
  if mode == "partial":  # process 0's last output has no newline
    if pid == 0:
      sys.stdout.write("saving...")
      sys.stdout.flush()
    else:
      time.sleep(0.5)
      print("line from 1", flush=True)
  if mode == "listen":  # joins jax.distributed, then waits for SIGUSR1
    from orbax_flax import launch  # pylint: disable=g-import-not-at-top
    got = []
    signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    launch.initialize_from_env(initialization_timeout=60)
    print("ready", flush=True)
    deadline = time.time() + 60
    while not got and time.time() < deadline:
      time.sleep(0.01)
  if mode == "join":  # joins jax.distributed at that address and gathers every process's id
    from orbax_flax import launch  # pylint: disable=g-import-not-at-top
    launch.initialize_from_env(initialization_timeout=60)
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    ids = multihost_utils.process_allgather(np.int32(jax.process_index()))
    print(f"joined: {jax.process_count()} processes, {jax.device_count()} devices, ids"
          f" {ids.tolist()}", flush=True)
  if mode in ("fail", "sleep"):
    time.sleep(120)  # stopped by the launcher


if __name__ == "__main__":
  main()
