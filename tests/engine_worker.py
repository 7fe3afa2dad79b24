"""One process of a multi-process save/restore test job.

Builds a deterministic state over a mesh spanning every process's devices,
saves it, or restores it onto this job's mesh and checks every addressable
shard against the expected global values.
"""

import argparse
import zlib
import sys

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs
import orbax_flax as ofx

SPECS = {
    "w2d": ((64, 32), np.float32, P("data", "model")),
    "w_rows": ((32, 16), np.float32, P("data", None)),      # replicated over "model"
    "w_rep": ((16, 8), np.float32, P()),                     # fully replicated
    "big": ((1024, 512), np.float32, P("model", None)),      # chunked path
    "big_rep": ((512, 1024), np.float32, P()),               # chunked, every process holds it
    "bf16": ((64,), "bfloat16", P("data")),
    "i8": ((64, 8), np.int8, P(("data", "model"), None)),
    "c64": ((8, 8), np.complex64, P(None, "model")),
}


def expected(name, shape, dtype):
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  x = rng.standard_normal(shape) * 10
  if np.dtype(dtype) == np.complex64:
    x = x + 1j * rng.standard_normal(shape)
  return x.astype(dtype)


def make_mesh(shape=None):
  """A ("data", "model") mesh of ``shape``; by default of every device there is: (2, n/2), or
  (1, n) for an odd count (8 CPU devices: (2, 4); one TPU chip: (1, 1); conftest.py)."""
  if shape is None:
    n = len(jax.devices())
    shape = (2, n // 2) if n % 2 == 0 else (1, n)
  return jax.make_mesh(shape, ("data", "model"))


def build_state(mesh):
  state = {}
  for name, (shape, dtype, spec) in SPECS.items():
    value = expected(name, shape, dtype)
    state[name] = jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda i, v=value: v[i])
  state["np"] = expected("np", (10, 3), np.float64)
  state["step"] = 1234
  state["name"] = "run-α"
  state["keys"] = jax.jit(lambda: jax.random.split(jax.random.key(7), mesh.size),
                          out_shardings=NamedSharding(mesh, P(("data", "model"))))()
  state["local"] = jax.numpy.float32(1.5)  # process-local on every process
  params = {"a": jax.device_put(expected("pa", (16, 8), np.float32), NamedSharding(mesh, P("data")))}
  state["opt"] = optax.adam(1e-3).init(params)
  return state


def target_for(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                      if isinstance(x, jax.Array) else x, state)


def check_shards(restored, reference):
  n = 0
  for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(restored)[0],
                               jax.tree.leaves(reference)):
    if isinstance(want, jax.Array):
      assert isinstance(got, jax.Array), path
      assert got.sharding == want.sharding, (path, got.sharding, want.sharding)
      if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
        got, want = jax.random.key_data(got), jax.random.key_data(want)
      for gs, ws in zip(sorted(got.addressable_shards, key=lambda s: s.device.id),
                        sorted(want.addressable_shards, key=lambda s: s.device.id)):
        assert gs.index == ws.index, path
        assert np.array_equal(np.asarray(gs.data), np.asarray(ws.data)), (path, gs.index)
        n += 1
    else:
      np.testing.assert_array_equal(got, want, err_msg=str(path))
  return n


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--mode", choices=["save", "restore"])
  p.add_argument("--path")
  p.add_argument("--mesh", default="2,4")
  p.add_argument("--async_save", action="store_true")
  p.add_argument("--transfer", default="auto", help="--async_save: the host_transfer")
  a = jobs.join(p)
  mesh = make_mesh(tuple(int(x) for x in a.mesh.split(",")))
  state = build_state(mesh)
  if a.mode == "save":
    how = None
    if a.async_save:
      with ofx.Checkpointer(host_transfer=a.transfer) as ckptr:
        handle = ckptr.save_async(a.path, {"state": state, "extra": {"epoch": 3}})
        how = handle.transfer
        # The caller may donate its arrays once save_async returns: the snapshot holds (the
        # restores of the test check every value).
        arrays = {name: state[name] for name in SPECS}
        jax.block_until_ready(jax.jit(lambda t: jax.tree.map(lambda x: x * 0, t),
                                      donate_argnums=0)(arrays))
        assert all(x.is_deleted() for x in arrays.values())
        handle.wait()
    else:
      ofx.save(a.path, {"state": state, "extra": {"epoch": 3}})
    print(f"SAVED {jax.process_index()} transfer={how}", flush=True)
    return
  restored = ofx.restore(a.path, {"state": target_for(state)})["state"]
  n = check_shards(restored, state)
  host = ofx.restore(a.path)
  assert host["extra"] == {"epoch": 3}
  for name in SPECS:
    np.testing.assert_array_equal(host["state"][name], expected(name, *SPECS[name][:2]))
  assert host["state"]["step"] == 1234 and host["state"]["name"] == "run-α"
  params = ofx.restore(a.path, {"state": {"opt": target_for(state["opt"])}}, partial=True)
  check_shards(params["state"]["opt"], state["opt"])
  print(f"RESTORED {jax.process_index()} shards={n}", flush=True)


if __name__ == "__main__":
  sys.exit(main())
