"""One process of a 2-process job that saves a step, or resumes from it with a state that only
process 1 gets wrong (``--mode=resume``: an extra leaf, a TreeMismatchError there alone).

Prints ``RESULT <error type>: <message>`` (or ``RESULT ok``) and how long the
resume took, then waits for the other process so that neither is cut off.
"""

import argparse
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs
import orbax_flax as ofx


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--dir")
  p.add_argument("--mode", choices=["save", "resume"])
  a = jobs.join(p)
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  w = jax.make_array_from_callback((8, 4), NamedSharding(mesh, P("x")),
                                   lambda i: np.arange(32, dtype=np.float32).reshape(8, 4)[i])
  state = {"w": w, "step": np.int64(0)}
  if a.mode == "resume" and a.process_id == 1:
    state["extra"] = np.zeros(3)  # this process's state alone does not match the checkpoint
  # A long coordination timeout: a process left waiting for the other's vote would sit here.
  cfg = {"save_interval_steps": 1, "save_final_step": False, "coordination_timeout_seconds": 120}
  ckpt = ofx.CheckpointCallback(a.dir, cfg)
  start = time.monotonic()
  try:
    state = ckpt.restore_or_init(state)
    if a.mode == "save":
      ckpt.on_step_end(1, dict(state, step=np.int64(1)))
    ckpt.close()
    print("RESULT ok", flush=True)
  except Exception as e:  # pylint: disable=broad-except
    print(f"RESULT {type(e).__name__}: {' '.join(str(e).split())}", flush=True)
  print(f"ELAPSED {time.monotonic() - start:.1f}", flush=True)
  jobs.exit_together(120)


if __name__ == "__main__":
  main()
