"""One process of a 2-process save in which process ``--slow`` arrives seconds late.

The slow process stops itself with SIGSTOP just before the save (the test
sends SIGCONT once the other process has printed its result, having given
up): a real process, really late. The checkpointer's coordination timeout is
2 s.
"""

import argparse
import logging
import os
import signal
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs
import orbax_flax as ofx
from orbax_flax import _multihost

def make_while_process_0_is_stopped():
  """Process 0 stops; process 1 makes a Checkpointer and prints what happened, and when."""
  if jax.process_index() == 0:
    _multihost.fetch("slow_worker/asking", 60, waiting_for="process 1")
    print(f"P0 READY pid={os.getpid()}", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
  else:
    _multihost.publish("slow_worker/asking", "1", timeout_s=60)
    time.sleep(1)  # process 0 is stopped by now
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
  a = jobs.join(p, heartbeat_timeout_seconds=60)  # the test stops a process for seconds
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  value = np.arange(8 * (1 << 16), dtype=np.float32).reshape(8, 1 << 16)
  x = jax.make_array_from_callback(value.shape, NamedSharding(mesh, P("x")), lambda i: value[i])
  logging.basicConfig(level=logging.WARNING, format="%(message)s")
  if a.stop_before_making:
    make_while_process_0_is_stopped()
  ckptr = ofx.Checkpointer(coordination_timeout_seconds=2, watchdog_seconds=1)
  # Making a Checkpointer talks to the coordination service (hosted by process
  # 0), and such a call waits while process 0 is stopped. So the slow process
  # stops only once the other one has made its Checkpointer: from then on, the
  # other's next coordination call is the save's own, which times out.
  if jax.process_index() == a.slow:
    _multihost.fetch("slow_worker/made", 60, waiting_for="the other process's Checkpointer")
  else:
    _multihost.publish("slow_worker/made", "1", timeout_s=60)
  print(f"P{jax.process_index()} READY pid={os.getpid()}", flush=True)
  if jax.process_index() == a.slow:
    os.kill(os.getpid(), signal.SIGSTOP)  # the test resumes us once the other has its result
  try:
    ckptr.save(a.path, {"s": {"x": x}})
    print(f"P{jax.process_index()} RESULT ok", flush=True)
  except Exception as e:  # pylint: disable=broad-except
    print(f"P{jax.process_index()} RESULT {type(e).__name__}: {e}", flush=True)
  _multihost.all_gather("slow_worker/done", "1", timeout_s=60)  # the late one is done too
  print(f"P{jax.process_index()} COMMITTED {os.path.exists(os.path.join(a.path, '_CHECKPOINT'))}",
        flush=True)
  _multihost.all_gather("slow_worker/exit", "1", timeout_s=60)
  os._exit(0)  # pylint: disable=protected-access  # skip jax.distributed's shutdown barrier



if __name__ == "__main__":
  main()
