"""One process of a local-tier job: save local steps, or restore the newest and check it."""

import argparse
import os

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import interop_worker
import jobs


RUN = "/persistent/dir/of/the/tier/test"  # the run the local steps belong to


def state(mesh, step):
  base = interop_worker.build(mesh)
  out = {k: v + step if v.dtype != np.int32 else v + np.int32(step) for k, v in base.items()}
  out["key"] = jax.jit(lambda: jax.random.split(jax.random.key(step), jax.device_count()),
                       out_shardings=NamedSharding(mesh, P(("data", "model"))))()
  out["step"] = step
  out["host"] = np.full(3, step, np.int64)
  return out


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--mode", choices=["save", "restore"])
  p.add_argument("--dir")
  p.add_argument("--steps", default="1,2,3")
  p.add_argument("--newer_than", type=int, default=-1)
  p.add_argument("--repeat", type=int, default=1)
  p.add_argument("--hosts", default="", help="the host of each process, comma-separated")
  a = jobs.join(p)
  from orbax_flax.tiers import _exchange, local  # pylint: disable=g-import-not-at-top
  # Small collective rounds, so that every exchange here takes several (as 2 GB states do).
  _exchange._ROUND_BYTES = 4096  # pylint: disable=protected-access
  mesh = interop_worker._mesh()  # pylint: disable=protected-access
  host = a.hosts.split(",")[jax.process_index()] if a.hosts else None
  tier = local.LocalTier(a.dir, run=RUN, replicas=1, max_to_keep=2, coordination_timeout_seconds=60, host=host)
  if a.mode == "save":
    for step in map(int, a.steps.split(",")):
      tier.save(step, {"state": state(mesh, step)})
    print("SAVED", sorted(os.listdir(tier.root)), flush=True)
    return
  like = state(mesh, 0)
  target = {"state": jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      if isinstance(x, jax.Array) else x, like)}
  for _ in range(a.repeat):
    _restore_and_check(tier, target, mesh, a.newer_than)


def _restore_and_check(tier, target, mesh, newer_than):
  got = tier.restore(target, newer_than=None if newer_than < 0 else newer_than)
  if got is None:
    print("NO LOCAL STEP", flush=True)
    return
  step, items, where = got
  want = state(mesh, step)
  for k, v in want.items():
    r = items["state"][k]
    if isinstance(v, jax.Array):
      if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
        v, r = jax.random.key_data(v), jax.random.key_data(r)
      assert r.sharding == v.sharding, k
      for s, t in zip(r.addressable_shards, v.addressable_shards):
        np.testing.assert_array_equal(np.asarray(s.data), np.asarray(t.data), err_msg=k)
    else:
      np.testing.assert_array_equal(r, v, err_msg=k)
  print(f"RESTORED step {step} from {where}", flush=True)


if __name__ == "__main__":
  main()
