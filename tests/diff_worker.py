"""One process of a multi-process differential save test job (tests/test_differential.py,
tests/test_multiprocess.py).

``--mode=run``: saves steps 0..3 of the engine worker's state with a differential manager
(max_to_keep=2) where only ``w_rep`` and a small ``lora`` change, then
restores every kept step onto this job's mesh and checks every shard.

``--mode=rollback``: saves steps 0..2 (2 borrows from 1), then every process restores step 1
(process 1 a second late, a slower host) and saves it again: the documented rollback.
"""

import argparse
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import engine_worker
import jobs
import orbax_flax as ofx


def state_at(mesh, step):
  state = engine_worker.build_state(mesh)
  del state["local"]  # process-local: its bytes are this process's own
  lora = np.full((4, 4), step, np.float32)
  state["lora"] = jax.device_put(lora, NamedSharding(mesh, P()))
  rep = engine_worker.expected("w_rep", (16, 8), np.float32) + step
  state["w_rep"] = jax.device_put(rep, NamedSharding(mesh, P()))
  big = engine_worker.expected("big", (1024, 512), np.float32).copy()
  big[0, 0] += step  # one element of one chunk changes
  state["big"] = jax.make_array_from_callback(big.shape, NamedSharding(mesh, P("model", None)),
                                              lambda i: big[i])
  return state


def rollback(path):
  """Steps 0, 1, 2 (each changes one shard of ``w``; 2 borrows from 1), then the rollback:
  every process restores step 1 and saves it again, process 1 a second behind."""
  mesh = jax.make_mesh((jax.device_count(),), ("d",))
  sharding = NamedSharding(mesh, P("d"))
  big = engine_worker.expected("big", (1024, 512), np.float32)

  def state(step, run=0):
    b = big.copy()
    b[(step % 4) * 256, :] = step + 1000 * run  # step s changes shard s % 4 only
    return {"state": {"w": jax.make_array_from_callback(b.shape, sharding, lambda i: b[i])}}

  target = {"state": {"w": jax.ShapeDtypeStruct(big.shape, big.dtype, sharding=sharding)}}
  policy = ofx.CheckpointPolicy(differential=True, async_save=False,
                                coordination_timeout_seconds=30)
  with ofx.CheckpointManager(path, policy) as mngr:
    for step in range(3):
      mngr.save(step, state(step), force=True)
    if jax.process_index() == 1:
      time.sleep(1.0)  # a slower host: still restoring step 1 when process 0 saves it
    engine_worker.check_shards(mngr.restore(1, target)["state"], state(1)["state"])
    mngr.save(1, state(1, run=1), force=True)
    assert mngr.all_steps() == [0, 1], mngr.all_steps()  # 2, of the abandoned run, is gone
    engine_worker.check_shards(mngr.restore(1, target)["state"], state(1, run=1)["state"])
  print(f"ROLLBACK {jax.process_index()} OK", flush=True)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--path")
  p.add_argument("--mesh", default="2,4")
  p.add_argument("--mode", default="run", choices=["run", "rollback"])
  a = jobs.join(p)
  if a.mode == "rollback":
    return rollback(a.path)
  mesh = engine_worker.make_mesh(tuple(int(x) for x in a.mesh.split(",")))
  policy = ofx.CheckpointPolicy(max_to_keep=2, differential=True)
  with ofx.CheckpointManager(a.path, policy) as mngr:
    for step in range(4):
      mngr.save(step, {"state": state_at(mesh, step)}, force=True)
      mngr.wait()
    events = mngr.pop_events()
    assert mngr.all_steps() == [2, 3], mngr.all_steps()
    for step in mngr.all_steps():
      want = state_at(mesh, step)
      got = mngr.restore(step, {"state": engine_worker.target_for(want)})["state"]
      engine_worker.check_shards(got, want)
  reused = [e.bytes_reused for e in events]
  written = [e.bytes_written for e in events]
  print(f"DIFF {jax.process_index()} written={written} reused={reused}", flush=True)


if __name__ == "__main__":
  sys.exit(main())
