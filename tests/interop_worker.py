"""One process of a multi-process interop job.

Modes:
  ocp_save: every process saves its shards with the real orbax-checkpoint.
  restore: orbax_flax restores that checkpoint onto this job's mesh and checks
    every addressable shard.
  export: orbax_flax exports a sharded state as safetensors; prints the bytes
    this process wrote.
  export_orbax: orbax_flax exports a sharded state as an orbax-checkpoint item
    (each process its own shards).
"""

import argparse
import zlib

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs

SPECS = {
    "w2d": ((64, 32), np.float32, P("data", "model")),
    "rows": ((32, 16), np.float32, P("data", None)),
    "rep": ((16, 8), np.float32, P()),
    "i32": ((64,), np.int32, P(("data", "model"))),
}


def expected_state():
  out = {}
  for name, (shape, dtype, _) in SPECS.items():
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    out[name] = (rng.standard_normal(shape) * 10).astype(dtype)
  return out


def _mesh():
  n = jax.device_count()
  return jax.make_mesh((2, n // 2), ("data", "model"))


def build(mesh):
  values = expected_state()
  return {name: jax.make_array_from_callback(shape, NamedSharding(mesh, spec),
                                             lambda i, v=values[name]: v[i])
          for name, (shape, _, spec) in SPECS.items()}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--mode", choices=["ocp_save", "restore", "export", "export_orbax", "read_once"])
  p.add_argument("--path")
  a = jobs.join(p)
  import orbax_flax as ofx  # pylint: disable=g-import-not-at-top  # after jax.distributed
  mesh = _mesh()
  if a.mode == "ocp_save":
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(a.path, build(mesh))
    ckpt.wait_until_finished()
    print("SAVED", flush=True)
    return
  if a.mode == "read_once":  # each replicated array read once across processes, then gathered
    from orbax_flax.core import _progress  # pylint: disable=g-import-not-at-top
    from orbax_flax.engine import restoring
    rng = np.random.default_rng(0)
    extra = {"big_rep": (rng.standard_normal((1024, 512)).astype(np.float32), P()),
             "cols": (rng.standard_normal((512, 256)).astype(np.float32), P(None, "model"))}
    state = build(mesh)
    state.update({k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, spec),
                                                  lambda i, v=v: v[i]) for k, (v, spec) in extra.items()})
    ofx.save(a.path, {"state": state})
    target = {"state": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                   sharding=x.sharding), state)}
    # The split follows the stored chunks: only where each process's part is whole chunks.
    rep = NamedSharding(mesh, P())
    for chunk in ((512, 512), (1024, 256), (1024, 512)):
      print(f"SPLIT {chunk} {restoring.read_once_spec(rep, (1024, 512), chunk)}", flush=True)
    for once in (False, True):
      progress = _progress.Progress("restore")
      out = restoring.restore(a.path, target, progress=progress, read_once=once)["state"]
      for name, arr in out.items():
        assert arr.sharding == state[name].sharding, name
        for s, t in zip(arr.addressable_shards, state[name].addressable_shards):
          np.testing.assert_array_equal(np.asarray(s.data), np.asarray(t.data), err_msg=name)
      print(f"READ read_once={once} {progress.done} bytes", flush=True)
    return
  if a.mode == "export_orbax":
    print("EXPORTED", ofx.export_orbax(a.path, {"params": build(mesh), "step": 7}), flush=True)
    return
  if a.mode == "export":
    from orbax_flax.formats import _cbytes  # pylint: disable=g-import-not-at-top
    written = [0]
    original = _cbytes.pwrite_box

    def counting(fd, base, shape, box, data):
      n = original(fd, base, shape, box, data)
      written[0] += n
      return n
    _cbytes.pwrite_box = counting
    ofx.export_safetensors(a.path, build(mesh), max_shard_bytes=8 << 10)
    print(f"WROTE {written[0]} bytes", flush=True)
    return
  values = expected_state()
  # Restore onto another layout: every array split over a different axis.
  flip = jax.make_mesh((jax.device_count(),), ("all",))
  target = {"state": {name: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(
      flip, P("all") if shape[0] % jax.device_count() == 0 else P()))
      for name, (shape, dtype, _) in SPECS.items()}}
  restored = ofx.restore(a.path, target)["state"]
  n = 0
  for name, arr in restored.items():
    for shard in arr.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), values[name][shard.index], err_msg=name)
      n += 1
  print(f"CHECKED {n} shards", flush=True)


if __name__ == "__main__":
  main()
