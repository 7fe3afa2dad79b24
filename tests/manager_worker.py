"""One process of a multi-process manager job whose clocks disagree.

Each process's fake clock runs at its own speed from its own origin; the
time-based policy must still save the same steps on every process: process
0's clock decides.
"""

import argparse
import json

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs
import orbax_flax as ofx


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--dir")
  p.add_argument("--steps", type=int, default=40)
  a = jobs.join(p)
  mesh = jax.make_mesh((a.num_processes, 2), ("data", "model"))
  # Process i: origin 1000 * i, (1 + 2 i) seconds per step.
  clock_t = [1000.0 * a.process_id]
  rate = 1.0 + 2.0 * a.process_id
  policy = ofx.CheckpointPolicy(save_interval_seconds=7.0, max_to_keep=3, save_final_step=False)
  saved = []
  with ofx.CheckpointManager(a.dir, policy, clock=lambda: clock_t[0]) as mngr:
    for step in range(1, a.steps + 1):
      clock_t[0] += rate
      x = jax.make_array_from_callback((8, 4), NamedSharding(mesh, P("data", "model")),
                                       lambda idx, s=step: np.full((8, 4), s, np.float32)[idx])
      if mngr.save(step, {"state": {"x": x}}):
        saved.append(step)
    mngr.wait()
    print("RESULT " + json.dumps({"saved": saved, "kept": mngr.all_steps()}), flush=True)


if __name__ == "__main__":
  main()
