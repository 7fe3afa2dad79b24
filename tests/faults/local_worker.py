"""A local-tier job that resumes, checks what it resumed, then saves until it is killed.

    local_worker.py DIR --coordinator=... --num_processes=4 --process_id=i

Every process first restores the newest local step every process can get (own
copy or peer replica) and checks it bitwise (``CHECKED <step>``, or
``WRONG ...`` and exit 1), then saves steps from there on with ``replicas=1``
and ``max_to_keep=1`` (so every save also deletes the previous step: kills land
in saves, replica exchanges and retention alike), printing ``SAVED <step>``
after each commit. Rounds of 64 KiB make every exchange many collectives.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jobs  # noqa: E402

RUN = "/the/persistent/dir/of/the/local/fault/test"


def state(mesh, step):
  """Every value derives from the step: a restore is checked bitwise."""
  rows = jax.device_count() * 64
  big = np.arange(rows * 256, dtype=np.float32).reshape(rows, 256) + step
  return {"big": jax.device_put(big, NamedSharding(mesh, P("p"))),
          "rep": jax.device_put(np.full(1000, step, np.int32), NamedSharding(mesh, P())),
          "key": jax.random.key(step), "host": np.full(7, step, np.int64), "step": step}


def target(mesh):
  return {"state": jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      if isinstance(x, jax.Array) else x, state(mesh, 0))}


def check(got, mesh, step):
  want = state(mesh, step)
  for k, v in want.items():
    r = got[k]
    if isinstance(v, jax.Array):
      if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
        v, r = jax.random.key_data(v), jax.random.key_data(r)
      for s, t in zip(r.addressable_shards, v.addressable_shards):
        if not np.array_equal(np.asarray(s.data), np.asarray(t.data)):
          return k
    elif not np.array_equal(np.asarray(r), np.asarray(v)):
      return k
  return None


def main():
  p = argparse.ArgumentParser()
  p.add_argument("dir")
  a = jobs.join(p)
  from orbax_flax.tiers import _exchange, local  # pylint: disable=g-import-not-at-top
  _exchange._ROUND_BYTES = 64 << 10  # pylint: disable=protected-access
  mesh = jax.make_mesh((jax.device_count(),), ("p",))
  tier = local.LocalTier(a.dir, run=RUN, replicas=1, max_to_keep=1, coordination_timeout_seconds=20)
  got = tier.restore(target(mesh))
  step = 0
  if got is not None:
    step, items, _ = got
    bad = check(items["state"], mesh, step)
    if bad is not None:
      print(f"WRONG step {step}: {bad}", flush=True)
      sys.exit(1)
    print(f"CHECKED {step}", flush=True)
  else:
    print("NONE", flush=True)
  while True:
    step += 1
    tier.save(step, {"state": state(mesh, step)})
    print(f"SAVED {step}", flush=True)


if __name__ == "__main__":
  main()
