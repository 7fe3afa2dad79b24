"""A launcher test child: reports its environment, then behaves as told."""

import os
import signal
import sys
import time


def main():
  mode = sys.argv[1]
  pid = int(os.environ["JAX_PROCESS_ID"])
  print(f"hello from {pid} of {os.environ['JAX_NUM_PROCESSES']} at {os.environ['JAX_COORDINATOR_ADDRESS']}"
        f" devices={os.environ.get('XLA_FLAGS', '')}", flush=True)
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
