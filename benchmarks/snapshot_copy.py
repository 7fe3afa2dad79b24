"""The blocking phase of a steady async save on CPU: our staging copy against one XLA copy.

Issue 30, item 5: at 50 MB our async save blocks longer than DCP's because it
copies 2,140 shard sources, each with a few microseconds of Python (JAX's
per-device arrays, a host view) before its copy. This measures what one jitted
copy of the whole tree by XLA would block instead (no Python per shard: the
buffers are copied on XLA's threads), beside ours, in one process, interleaved:

* ``ours``: ``Checkpointer.save_async`` of fresh arrays (as a training step
  makes them) with a checkpointer kept across saves, time until it returns:
  the default transfer ("device_copy" up to 256 MiB on CPU, since 2026-12-06);
* ``ours, memcpy``: the same with ``host_transfer="memcpy"``, the copy into the
  kept staging arena (the default before);
* ``xla_copy``: ``jax.jit`` of a copy of every leaf with the same shardings,
  time until the copies are ready (``dispatch``: until the call returns);
* ``device_put``: ``jax.device_put(leaves, shardings, may_alias=False)``, a
  copy of every leaf into new buffers of the same shardings, in one call and
  with nothing to compile, time until the copies are ready (``dispatch``: until
  the call returns);
* ``ours, binding``: of our blocking phase, the part that binds the cached
  layout to the new arrays (one ``addressable_data`` per shard), which a
  whole-leaf copy would leave to the background.

Before each timed call: fresh arrays, a full garbage collection, a pause. The
first ``--warmup`` saves of each are not counted (our staging memory is mapped
and touched, the copy is compiled; the compile time is printed).

    python benchmarks/snapshot_copy.py --size=50mb --reps=8
"""

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import save_restore as sr  # noqa: E402

import orbax_flax as ofx  # noqa: E402


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--size", default="50mb", choices=sorted(sr.SIZES))
  ap.add_argument("--reps", type=int, default=8)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--pause", type=float, default=0.5)
  ap.add_argument("--root", default="/var/tmp")
  args = ap.parse_args()

  mesh = sr.mesh_for()
  state = sr.device_state(sr.host_state(args.size), mesh)
  leaves, treedef = jax.tree.flatten(state)
  shardings = [x.sharding for x in leaves]
  copy = jax.jit(lambda xs: [jnp.copy(x) for x in xs], out_shardings=shardings)
  t0 = time.perf_counter()
  copy.lower(leaves).compile()
  compile_s = time.perf_counter() - t0

  root = tempfile.mkdtemp(dir=args.root)
  times = {"ours": [], "ours, memcpy": [], "ours, binding": [], "xla_copy": [],
           "xla_copy, dispatch": [], "device_put": [], "device_put, dispatch": []}
  try:
    with ofx.Checkpointer() as ckptr, ofx.Checkpointer(host_transfer="memcpy") as staged:
      planner = ckptr._planner  # pylint: disable=protected-access
      for rep in range(args.warmup + args.reps):
        blocked = {}
        for name, c in (("ours", ckptr), ("ours, memcpy", staged)):
          path = os.path.join(root, "ckpt")
          shutil.rmtree(path, ignore_errors=True)
          fresh = sr.fresh(state)
          gc.collect()
          time.sleep(args.pause)
          t0 = time.perf_counter()
          handle = c.save_async(path, {"state": fresh})
          blocked[name] = time.perf_counter() - t0
          handle.wait()
          del fresh

        fresh = sr.fresh(state)  # arrays whose shards nobody has asked for yet, as a save meets them
        template, flat = planner._template({"state": fresh}, jax.process_index(),  # pylint: disable=protected-access
                                           jax.process_count())
        gc.collect()
        time.sleep(args.pause)
        t0 = time.perf_counter()
        template.bind_pieces({item: leaves for item, (leaves, _) in flat.items()})
        binding = time.perf_counter() - t0
        del fresh, flat

        fresh = jax.tree.leaves(sr.fresh(state))
        gc.collect()
        time.sleep(args.pause)
        t0 = time.perf_counter()
        out = copy(fresh)
        dispatched = time.perf_counter() - t0
        jax.block_until_ready(out)
        ready = time.perf_counter() - t0
        assert all(a.sharding == s for a, s in zip(out, shardings))
        del out, fresh

        fresh = jax.tree.leaves(sr.fresh(state))
        gc.collect()
        time.sleep(args.pause)
        t0 = time.perf_counter()
        out = jax.device_put(fresh, shardings, may_alias=False)
        put_dispatched = time.perf_counter() - t0
        jax.block_until_ready(out)
        put_ready = time.perf_counter() - t0
        assert all(a.sharding == s for a, s in zip(out, shardings))
        assert all(a.addressable_data(0).unsafe_buffer_pointer()
                   != b.addressable_data(0).unsafe_buffer_pointer() for a, b in zip(out, fresh))
        del out, fresh
        if rep >= args.warmup:
          times["ours"].append(blocked["ours"])
          times["ours, memcpy"].append(blocked["ours, memcpy"])
          times["ours, binding"].append(binding)
          times["device_put"].append(put_ready)
          times["device_put, dispatch"].append(put_dispatched)
          times["xla_copy"].append(ready)
          times["xla_copy, dispatch"].append(dispatched)
  finally:
    shutil.rmtree(root, ignore_errors=True)

  nbytes = sum(x.nbytes for x in leaves)
  print(f"{args.size}: {nbytes / 1e6:.1f} MB, {len(leaves)} leaves on {jax.device_count()} "
        f"devices; compiling the copy {compile_s:.3f} s; medians of {args.reps}")
  for name, ts in times.items():
    print(f"  {name:22s} {statistics.median(ts) * 1e3:8.1f} ms   "
          f"({', '.join(f'{t * 1e3:.1f}' for t in ts)})")


if __name__ == "__main__":
  main()
