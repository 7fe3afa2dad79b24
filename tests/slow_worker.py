"""One process of a 2-process save in which process ``--slow`` arrives seconds late.

Both processes print READY once their last call into the coordination service
has returned, then wait for the file ``--go``. The test stops the slow process
(SIGSTOP) there, creates the file, and resumes the slow process (SIGCONT) once
the other has printed its result, having given up: a real process, really
late, stopped where no call of either process is in flight (a process stopped
while the service it hosts answers another's call would hold that call). The
checkpointer's coordination timeout is 2 s.
"""

import argparse
import logging
import os
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs
import orbax_flax as ofx
from orbax_flax.core import _multihost

def wait_for(go: str) -> None:
  while not os.path.exists(go):
    time.sleep(0.02)


def make_while_process_0_is_stopped(go: str):
  """Process 0 is stopped; process 1 makes a Checkpointer and prints what happened, and when."""
  print(f"P{jax.process_index()} READY pid={os.getpid()}", flush=True)
  wait_for(go)  # the test stops process 0 first
  if jax.process_index() == 1:
    start = time.monotonic()
    try:
      ofx.Checkpointer(coordination_timeout_seconds=2)
      print("P1 MADE ok", flush=True)
    except Exception as e:  # pylint: disable=broad-except
      print(f"P1 MADE {type(e).__name__} after {time.monotonic() - start:.1f} s: {e}", flush=True)
  os._exit(0)  # pylint: disable=protected-access


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--path")
  p.add_argument("--slow", type=int)
  p.add_argument("--stop_before_making", type=int, default=0)
  p.add_argument("--go")
  a = jobs.join(p, heartbeat_timeout_seconds=60)  # the test stops a process for seconds
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  value = np.arange(8 * (1 << 16), dtype=np.float32).reshape(8, 1 << 16)
  x = jax.make_array_from_callback(value.shape, NamedSharding(mesh, P("x")), lambda i: value[i])
  logging.basicConfig(level=logging.WARNING, format="%(message)s")
  if a.stop_before_making:
    make_while_process_0_is_stopped(a.go)
  ckptr = ofx.Checkpointer(coordination_timeout_seconds=2, watchdog_seconds=1)
  # Making a Checkpointer talks to the coordination service (hosted by process
  # 0): both are made before the slow process is stopped, so the other's next
  # coordination call is the save's own, which times out.
  print(f"P{jax.process_index()} READY pid={os.getpid()}", flush=True)
  wait_for(a.go)  # the test stops the slow process first
  try:
    ckptr.save(a.path, {"s": {"x": x}})
    print(f"P{jax.process_index()} RESULT ok", flush=True)
  except Exception as e:  # pylint: disable=broad-except
    print(f"P{jax.process_index()} RESULT {type(e).__name__}: {e}", flush=True)
  _multihost.all_gather("slow_worker/done", "1", timeout_s=60)  # the late one is done too
  print(f"P{jax.process_index()} COMMITTED {os.path.exists(os.path.join(a.path, '_CHECKPOINT'))}",
        flush=True)
  jobs.exit_together(60)



if __name__ == "__main__":
  main()
