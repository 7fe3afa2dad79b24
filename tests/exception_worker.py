"""A launcher child whose training step raises on process 1 only.

Process 0 keeps training (its step needs no other process), so an exception
save, which needs every process, cannot happen: process 1 must give up on it
quickly and re-raise its own error, and the launcher then stops process 0.
"""

import itertools
import os
import sys
import time

import jax.numpy as jnp

import orbax_flax as ofx
from orbax_flax import launch


def main():
  launch.initialize_from_env(heartbeat_timeout_seconds=10)
  me = int(os.environ["JAX_PROCESS_ID"])

  def step_fn(s, batch):
    del batch
    time.sleep(0.01)
    if me == 1 and s["step"] == 3:
      raise RuntimeError("boom on process 1")
    return {"w": s["w"] + 1, "step": s["step"] + 1}, {}

  ckpt = ofx.CheckpointCallback(sys.argv[1], {"save_interval_steps": 0})
  ofx.Trainer(step_fn, [ckpt]).fit({"w": jnp.zeros(4), "step": 0}, itertools.repeat(None),
                                   num_steps=100_000)


if __name__ == "__main__":
  main()
