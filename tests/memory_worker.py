"""Measures the peak host memory of one save or restore, in a fresh process.

    python memory_worker.py MODE --dir=DIR [--mb=256] [--budget_mb=0]

Prints one line ``RESULT {json}`` with ``extra`` (VmHWM after resetting it with
``/proc/self/clear_refs``, minus VmRSS just before the call), the state's
bytes and, for restores, the restored bytes. A fresh process per case: freed
memory that the allocator keeps would make a later case look cheaper.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_flax as ofx  # noqa: E402


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from hostmem import measure  # noqa: E402  (the one copy of the VmHWM measurement)


def state(mb: int, mesh):
  """``mb`` MiB of float32 in 8 arrays sharded over the mesh, plus small ones."""
  rng = np.random.default_rng(0)
  rows = mb * (1 << 20) // 8 // 4 // 1024
  s = {f"w{i}": jax.device_put(rng.standard_normal((rows, 1024), dtype=np.float32),
                               NamedSharding(mesh, P("data", "model"))) for i in range(8)}
  s.update({f"b{i}": jax.device_put(rng.standard_normal((1024,), dtype=np.float32),
                                    NamedSharding(mesh, P())) for i in range(16)})
  return s


def nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def restored_bytes(tree) -> int:
  """Bytes of the restored arrays' distinct shards (replicas share host memory on CPU)."""
  total = 0
  for x in jax.tree.leaves(tree):
    if isinstance(x, np.ndarray):  # a host target's
      total += x.nbytes
      continue
    seen = set()
    for s in x.addressable_shards:
      start = tuple(i.start for i in s.index)
      if start not in seen:
        seen.add(start)
        total += s.data.nbytes
  return total


def largest_chunk(path) -> int:
  from orbax_flax.engine import restoring  # pylint: disable=g-import-not-at-top
  manifest = restoring.read_manifest(ofx.core._location.Location.parse(path))  # pylint: disable=protected-access
  return max(int(np.prod(r.chunk_shape)) * r.np_dtype.itemsize
             for item in manifest.items.values() for r in item.leaves
             if getattr(r, "chunk_shape", None) is not None)


def _minor_faults() -> int:
  import resource  # pylint: disable=g-import-not-at-top
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def first_save(a, mesh, budget, path, result) -> None:
  """Page faults of the first save_async's blocking phase, and peak memory from prepare to commit.

  Transparent huge pages are turned off for this process (prctl), so that
  every fresh 4 KiB page the copy touches counts as one minor fault.
  """
  import ctypes  # pylint: disable=g-import-not-at-top
  ctypes.CDLL("libc.so.6").prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
  s = {"s": state(a.mb, mesh)}
  result["state"] = nbytes(s)
  ckptr = ofx.Checkpointer(max_host_bytes=budget, host_transfer=a.transfer)
  out = {}

  def run():
    if a.prepare:
      out["prepared"] = ckptr.prepare(s)
      out["prepared_in_time"] = ckptr.wait_prepared(240)
    faults = _minor_faults()
    handle = ckptr.save_async(path, s)
    out["faults"] = _minor_faults() - faults
    out["blocking_s"] = handle.blocking_s
    handle.wait()

  result["extra"], _ = measure(run)
  result.update(out, mappings=ckptr.staging_stats().mappings, staging=ckptr.staging_bytes)
  ckptr.close()
  restored = ofx.restore(path)["s"]
  np.testing.assert_array_equal(restored["w3"], np.asarray(s["s"]["w3"]))
  print("RESULT " + json.dumps(result), flush=True)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("mode", choices=["save", "save_async", "restore", "restore_other_mesh",
                                  "restore_cast", "restore_transform", "write_orbax", "convert",
                                  "first_save"])
  p.add_argument("--prepare", action="store_true", help="first_save: Checkpointer.prepare first")
  p.add_argument("--transfer", default="auto", help="first_save: the Checkpointer's host_transfer")
  p.add_argument("--src", default="")
  p.add_argument("--dir", required=True)
  p.add_argument("--mb", type=int, default=256)
  p.add_argument("--budget_mb", type=int, default=0)
  a = p.parse_args()
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  budget = a.budget_mb << 20
  path = os.path.join(a.dir, "ckpt")
  result = {"mode": a.mode, "budget": budget}
  # Warm up: the first call of a process initialises tensorstore and JAX
  # (tens of MB, once); that is not memory of the call being measured.
  warm = os.path.join(a.dir, "warmup")
  if not os.path.exists(warm):
    ofx.save(warm, {"s": {"w": np.ones((4096, 64), np.float32), "b": np.ones(3)}})
  ofx.restore(warm, {"s": {"w": jax.ShapeDtypeStruct(
      (4096, 64), np.float32, sharding=NamedSharding(mesh, P("data", "model"))),
      "b": np.zeros(3)}})
  if a.mode == "write_orbax":  # a checkpoint written by orbax-checkpoint itself
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    with ocp.StandardCheckpointer() as c:
      c.save(path + "-orbax", {"s": state(a.mb, mesh)})
      c.save(warm + "-orbax", {"s": {"w": np.ones((4096, 64), np.float32)}})  # for the warm-up
      c.wait_until_finished()
    print("RESULT {}", flush=True)
    return
  if a.mode == "convert":  # streams: a slab of rows at a time
    src = a.src or path
    if src.endswith("-orbax"):  # warm up tensorstore's zarr and OCDBT readers, as above for ours
      ofx.convert(warm + "-orbax", os.path.join(a.dir, f"warm-export-{os.getpid()}"),
                  format="safetensors")
    meta = ofx.metadata(src)
    result["state"] = meta.nbytes
    result["largest"] = max(x.nbytes for i in meta.items.values() for x in i.arrays)
    dst = os.path.join(a.dir, f"export-{os.getpid()}")
    result["extra"], _ = measure(lambda: ofx.convert(src, dst, format="safetensors",
                                                     dtype="bfloat16"))
    from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
    import ml_dtypes  # pylint: disable=g-import-not-at-top
    got = {}
    for f in os.listdir(dst):
      if f.endswith(".safetensors"):
        got.update(load_file(os.path.join(dst, f)))
    name = "s.w3" if "s.w3" in got else "w3"
    want = state(a.mb, mesh)["w3"]
    np.testing.assert_array_equal(got[name].view(ml_dtypes.bfloat16),
                                  np.asarray(want).astype(ml_dtypes.bfloat16))
    print("RESULT " + json.dumps(result), flush=True)
    return
  if a.mode == "first_save":  # the first async save of a process, prepared or not
    first_save(a, mesh, budget, path, result)
    return
  if a.mode.startswith("save"):
    s = state(a.mb, mesh)
    result["state"] = nbytes(s)
    ckptr = ofx.Checkpointer(max_host_bytes=budget)
    ckptr.save_async(os.path.join(a.dir, f"warmup-{os.getpid()}"), {"s": {"w": np.ones((4096, 64), np.float32)}}).wait()
    ckptr.close()
    ckptr = ofx.Checkpointer(max_host_bytes=budget)
    if a.mode == "save":
      extra, _ = measure(lambda: ckptr.save(path, {"s": s}))
    else:
      extra, _ = measure(lambda: ckptr.save_async(path, {"s": s}).wait())
    result["extra"] = extra
  else:
    if a.mode == "restore_cast":  # float32 saved, float64 host arrays wanted (exact)
      meta = ofx.metadata(path).items["s"]
      target = {"s": {m.path: np.zeros(m.shape, np.float64) for m in meta.arrays}}  # untouched
      extra, out = measure(lambda: ofx.restore(path, target, max_host_bytes=budget))
      result.update(state=meta.nbytes, restored=restored_bytes(out), extra=extra,
                    largest_chunk=largest_chunk(path))
      np.testing.assert_array_equal(out["s"]["w3"], np.asarray(state(a.mb, mesh)["w3"], np.float64))
      print("RESULT " + json.dumps(result), flush=True)
      return
    if a.mode == "restore_transform":  # transforms= Cast to bfloat16 and a Transpose
      t = ofx.transforms
      ofx.restore(warm, transforms=[t.Cast(".*", "bfloat16"), t.Transpose("w", (1, 0))])
      meta = ofx.metadata(path).items["s"]
      extra, out = measure(lambda: ofx.restore(
          path, max_host_bytes=budget,
          transforms=[t.Cast(".*", "bfloat16"), t.Transpose("w3", (1, 0))]))
      result.update(state=meta.nbytes, restored=restored_bytes(out), extra=extra,
                    largest_chunk=largest_chunk(path))
      import ml_dtypes  # pylint: disable=g-import-not-at-top
      np.testing.assert_array_equal(
          np.asarray(out["s"]["w3"]),
          np.asarray(state(a.mb, mesh)["w3"]).astype(ml_dtypes.bfloat16).T)
      print("RESULT " + json.dumps(result), flush=True)
      return
    if a.mode == "restore":  # the saved layout
      target_mesh, spec = mesh, P("data", "model")
    else:  # another mesh: every chunk is needed in part by two devices
      target_mesh, spec = jax.make_mesh((4,), ("model",), devices=jax.devices()[:4]), P("model")
    meta = ofx.metadata(path).items["s"]
    target = {"s": {m.path: jax.ShapeDtypeStruct(
        m.shape, np.dtype(m.dtype), sharding=NamedSharding(target_mesh, spec if len(m.shape) == 2 else P()))
        for m in meta.arrays}}
    extra, out = measure(lambda: jax.block_until_ready(
        ofx.restore(path, target, max_host_bytes=budget)))
    result.update(state=meta.nbytes, restored=restored_bytes(out), extra=extra,
                  largest_chunk=largest_chunk(path))
    np.testing.assert_array_equal(np.asarray(out["s"]["w3"]), state(a.mb, mesh)["w3"])
  print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  sys.exit(main())
