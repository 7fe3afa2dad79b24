"""A job that resumes, trains a few steps of a jitted step and ends (for tests/test_restart.py).

    python restart_worker.py WORKDIR STEPS [--async]   (or as a job: jobs.start)

Policy: a save every 2 steps, ``compilation_cache=True``. Prints the callback's
restart line (stderr, as a user sees it) and ``RESULT <json>`` on stdout.
"""

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs
import orbax_flax as ofx


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("workdir")
  p.add_argument("steps", type=int)
  p.add_argument("--async", dest="background", action="store_true")
  if any(a.startswith("--coordinator") for a in sys.argv):  # a multi-process job (jobs.start)
    a = jobs.join(p)
  else:
    a = p.parse_args()
  workdir, steps, background = a.workdir, a.steps, a.background
  mesh = jax.make_mesh((jax.device_count(),), ("d",))
  sharding = NamedSharding(mesh, P("d"))
  values = np.arange(512, dtype=np.float32)
  state = {"w": jax.make_array_from_callback((512,), sharding, lambda i: values[i]),
           "step": jnp.int32(0)}

  @jax.jit
  def train_step(s):
    w = s["w"]
    for i in range(20):  # a program worth caching
      w = jnp.sin(w) * 0.5 + jnp.cos(w * (i + 1)) * 0.5
    return {"w": w, "step": s["step"] + 1}

  policy = ofx.CheckpointPolicy(save_interval_steps=2, compilation_cache=True,
                                save_final_step=True)
  with ofx.CheckpointCallback(workdir, policy) as ckpt:
    if background:
      pending = ckpt.restore_or_init_async(state)
      train_step.lower(state).compile()
      state = pending.join()
    else:
      state = ckpt.restore_or_init(state)
    start = int(state["step"])
    for step in range(start, start + steps):
      state = train_step(state)
      ckpt.on_step_end(step + 1, state)
  print("RESULT " + json.dumps({"restored": ckpt.restored_step,
                                "cache_dir": jax.config.jax_compilation_cache_dir}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
