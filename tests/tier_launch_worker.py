"""One process of a job started by ``python -m orbax_flax.launch``: a CheckpointCallback run
with the local tier (a small sharded state, so that the job costs seconds, not compilations).

    python -m orbax_flax.launch -n 3 --devices_per_process=2 -- tests/tier_launch_worker.py \
        --workdir=W --local=L --steps=N

Prints ``RESUMED <step> <value>`` (the restored step, or 0, and the value of its weights,
which every save sets to the step) and ``DONE <step>``. Log lines carry wall-clock times.
"""

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from orbax_flax import launch  # noqa: E402

launch.initialize_from_env(60, heartbeat_timeout_seconds=10)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_flax as ofx  # noqa: E402


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--workdir")
  p.add_argument("--local")
  p.add_argument("--steps", type=int)
  a = p.parse_args()
  logging.basicConfig(level=logging.INFO, format="%(asctime)s.%(msecs)03d %(message)s",
                      datefmt="%H:%M:%S")
  mesh = jax.make_mesh((jax.device_count(),), ("d",))
  sharding = NamedSharding(mesh, P("d"))
  state = lambda v: {"w": jax.device_put(np.full(jax.device_count() * 4096, v, np.float32),  # noqa: E731
                                         sharding)}
  cb = ofx.CheckpointCallback(a.workdir, {
      "local_directory": a.local, "local_save_interval_steps": 2, "save_interval_steps": 4,
      "save_final_step": False, "coordination_timeout_seconds": 600})
  s = cb.restore_or_init(state(0.0))
  start = cb.restored_step or 0
  value = float(np.asarray(s["w"].addressable_shards[0].data)[0])
  print(f"RESUMED {start} {value}", flush=True)
  for step in range(start + 1, a.steps + 1):
    s = state(float(step))
    cb.on_step_end(step, s)
  cb.close()
  print(f"DONE {a.steps}", flush=True)


if __name__ == "__main__":
  main()
