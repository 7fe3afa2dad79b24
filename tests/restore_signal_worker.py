"""One process of a 2-process job resumed from step 3 gets SIGTERM while the restore runs
(before the run's first step; JAX's preemption sync catches it): every process must save the
next step and stop.

``--mode=first`` trains 3 steps (the final save commits step 3). ``--mode=sync`` / ``async``
resume with ``restore_or_init`` / ``restore_or_init_async`` + ``join()``, the data iterator's
``set_state`` taking 2 s, and process 1 signals itself 0.5 s into the restore. Prints
``RESULT preempted=... stopped_at=... committed=...``.
"""

import argparse
import os
import signal
import threading
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs
import orbax_flax as ofx


class Data:
  """A global position whose seek (set_state) takes 2 s at a resume: the restore takes that."""
  checkpoint_state_is_global = True

  def __init__(self, seek_s):
    self.i, self.seek_s = 0, seek_s

  def get_state(self):
    return {"i": self.i}

  def set_state(self, state):
    time.sleep(self.seek_s)
    self.i = state["i"]


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--dir")
  p.add_argument("--mode")
  a = jobs.join(p, heartbeat_timeout_seconds=30)
  mesh = jax.make_mesh((jax.device_count(),), ("d",))
  state = {"w": jax.device_put(np.zeros(8, np.float32), NamedSharding(mesh, P()))}
  step_fn = jax.jit(lambda s: {"w": s["w"] + 1})
  data = Data(0.0 if a.mode == "first" else 2.0)
  with ofx.CheckpointCallback(a.dir, {"save_interval_steps": 1000}) as ckpt:
    if a.mode != "first" and a.process_id == 1:  # the scheduler's SIGTERM, mid-restore
      threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    if a.mode == "async":
      state = ckpt.restore_or_init_async(state, data_iterator=data).join()
    else:
      state = ckpt.restore_or_init(state, data_iterator=data)
    start = ckpt.restored_step or 0
    step = start
    for step in range(start + 1, start + (4 if a.mode == "first" else 60)):
      time.sleep(0.05)
      state = step_fn(state)
      data.i += 1
      if ckpt.on_step_end(step, state):
        break
  print(f"RESULT preempted={ckpt.preempted} stopped_at={step}"
        f" committed={ckpt.manager.all_steps()}", flush=True)
  jobs.exit_together()


if __name__ == "__main__":
  main()
