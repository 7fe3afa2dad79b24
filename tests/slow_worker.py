"""One process of a 2-process save in which process ``--slow`` arrives seconds late.

The slow process stops itself with SIGSTOP just before the save (the test
sends SIGCONT after a few seconds): a real process, really late. The
checkpointer's coordination timeout is 2 s.
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

def main():
  p = argparse.ArgumentParser()
  p.add_argument("--path")
  p.add_argument("--slow", type=int)
  a = jobs.join(p)
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  value = np.arange(8 * (1 << 16), dtype=np.float32).reshape(8, 1 << 16)
  x = jax.make_array_from_callback(value.shape, NamedSharding(mesh, P("x")), lambda i: value[i])
  logging.basicConfig(level=logging.WARNING, format="%(message)s")
  ckptr = ofx.Checkpointer(coordination_timeout_seconds=2, watchdog_seconds=1)
  print(f"P{jax.process_index()} READY pid={os.getpid()}", flush=True)
  if jax.process_index() == a.slow:
    os.kill(os.getpid(), signal.SIGSTOP)  # the test resumes us 5 s later
  try:
    ckptr.save(a.path, {"s": {"x": x}})
    print(f"P{jax.process_index()} RESULT ok", flush=True)
  except Exception as e:  # pylint: disable=broad-except
    print(f"P{jax.process_index()} RESULT {type(e).__name__}: {e}", flush=True)
  from orbax_flax import _multihost  # pylint: disable=g-import-not-at-top
  _multihost.all_gather("slow_worker/done", "1", timeout_s=60)  # the late one is done too
  print(f"P{jax.process_index()} COMMITTED {os.path.exists(os.path.join(a.path, '_CHECKPOINT'))}",
        flush=True)
  _multihost.all_gather("slow_worker/exit", "1", timeout_s=60)
  os._exit(0)  # pylint: disable=protected-access  # skip jax.distributed's shutdown barrier



if __name__ == "__main__":
  main()
