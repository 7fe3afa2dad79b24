"""One process of a 2-process training job preempted with disagreeing grace periods.

Only process 0 gets the signal, and only process 0 has a grace period too
short for the save: it cancels the save. Process 1 waits without a limit; it
must learn that the save was cancelled and stop as cleanly as process 0.
"""

import argparse
import itertools
import os
import signal
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs
import orbax_flax as ofx


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--dir")
  a = jobs.join(p)
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  sharding = NamedSharding(mesh, P("data"))
  # 64 MB: far more than process 0 can write in its 1 ms grace period.
  state = {"w": jax.make_array_from_callback((16 << 20,), sharding,
                                             lambda idx: jnp.ones((16 << 20,))[idx]),
           "step": 0}

  def step_fn(s, batch):
    del batch
    time.sleep(0.01)  # steps of a real job's length, so the agreed step comes soon
    if s["step"] == 2 and a.process_id == 0:
      os.kill(os.getpid(), signal.SIGUSR1)
    return {"w": s["w"], "step": s["step"] + 1}, {}

  grace = 1e-3 if a.process_id == 0 else 0.0
  cfg = {"save_interval_steps": 0, "preemption_signals": ("SIGUSR1",),
         "preemption_grace_seconds": grace}
  ckpt = ofx.CheckpointCallback(a.dir, cfg)
  out = ofx.Trainer(step_fn, [ckpt]).fit(state, itertools.repeat(None), num_steps=10_000)
  print(f"RESULT preempted={ckpt.preempted} stopped_at={out['step']}"
        f" committed={ckpt.manager.all_steps()}", flush=True)


if __name__ == "__main__":
  main()
