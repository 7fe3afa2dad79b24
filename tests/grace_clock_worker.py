"""One process of a 2-process training job preempted (SIGTERM, JAX's preemption sync) while a
step takes seconds: the step the processes agree on comes seconds after the signal, and the
grace period must count from the signal.

Process 1 sends itself SIGTERM at the start of step 3, whose train step then
takes 4 s on both processes. Prints the callback's log and ``RESULT ...``.
"""

import argparse
import itertools
import logging
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
  a = jobs.join(p, heartbeat_timeout_seconds=60)
  logging.basicConfig(level=logging.WARNING, format="%(message)s")
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  state = {"w": jax.make_array_from_callback((16 << 20,), NamedSharding(mesh, P("data")),
                                             lambda idx: jnp.ones((16 << 20,))[idx]),
           "step": 0}

  def step_fn(s, batch):
    del batch
    if s["step"] == 2:  # the step that takes 4 s; the signal comes at its start
      if a.process_id == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # caught by JAX's notifier (no Python handler)
      time.sleep(4)
    return {"w": s["w"], "step": s["step"] + 1}, {}

  cfg = {"save_interval_steps": 0, "preemption_grace_seconds": 2.0}
  ckpt = ofx.CheckpointCallback(a.dir, cfg)
  out = ofx.Trainer(step_fn, [ckpt]).fit(state, itertools.repeat(None), num_steps=10_000)
  print(f"RESULT preempted={ckpt.preempted} stopped_at={out['step']}"
        f" committed={ckpt.manager.all_steps()}", flush=True)


if __name__ == "__main__":
  main()
