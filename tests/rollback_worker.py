"""One process of a 2-process job in which only process 1 restores an older step.

Steps 1-3 are saved by both processes; process 1 alone calls ``restore(1)`` (a rank-
conditioned look at an older step), which is refused with a clear error once process 0 has
not made the same restore within the coordination timeout; then both processes save step 4,
and every step restores as saved.
"""

import argparse
import json

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs
import orbax_flax as ofx


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--dir")
  a = jobs.join(p)
  sharding = NamedSharding(jax.make_mesh((jax.device_count(),), ("data",)), P("data"))
  base = np.arange(16, dtype=np.float32)

  def state(step):
    return {"state": {"w": jax.make_array_from_callback((16,), sharding,
                                                        lambda i: base[i] + step)}}
  policy = ofx.CheckpointPolicy(async_save=False, coordination_timeout_seconds=3)
  out = {}
  with ofx.CheckpointManager(a.dir, policy) as mngr:
    for step in (1, 2, 3):
      mngr.save(step, state(step), force=True)
    if a.process_id == 1:
      try:
        mngr.restore(1)
        out["restore"] = "returned"
      except Exception as e:  # pylint: disable=broad-except
        out["restore"] = f"{type(e).__name__}: {e}"
    multihost_utils.sync_global_devices("restored")
    mngr.save(4, state(4), force=True)
    out["steps"] = mngr.all_steps()
    out["values"] = [bool(np.array_equal(ofx.restore(mngr.step_path(s))["state"]["w"], base + s))
                     for s in mngr.all_steps()]
  print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
