"""The first async save of a process, ours against DCP's, each in a process of its own.

Issue 30, item 5: the first async save of a ``Checkpointer`` that was not
prepared (every ``ofx.save_async`` user; a restarted job whose first save comes
before ``prepare``) against DCP's first ``async_save`` with a fresh
``DefaultStager``. ``save_restore.py`` measures both inside one long process,
after other phases and ``release_memory()``; this measures them the way a job
meets them: a new process builds the state, warms the library up on a tiny
tree (imports, threads), pays the collector's debt (``gc.collect()``), pauses,
and times one first save. Cases alternate (ours, DCP, ours, ...), medians.

    python benchmarks/first_save.py --size=50mb --reps=5
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def case(which, size, root, pause):
  """One first save in this process; returns the seconds the caller was blocked."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import save_restore as sr  # pylint: disable=g-import-not-at-top
  host = sr.host_state(size)
  path = os.path.join(root, which)
  if which == "orbax_flax":
    import orbax_flax as ofx  # pylint: disable=g-import-not-at-top
    state = sr.device_state(host, sr.mesh_for())
    jax.block_until_ready(state)
    with ofx.Checkpointer() as warm:
      warm.save_async(os.path.join(root, "tiny"), {"s": {"w": np.ones(3)}}).wait()
    ckptr = ofx.Checkpointer()
    gc.collect()
    time.sleep(pause)
    t0 = time.perf_counter()
    handle = ckptr.save_async(path, {"state": state})
    blocked = time.perf_counter() - t0
    handle.wait()
    ckptr.close()
    return blocked
  import torch  # pylint: disable=g-import-not-at-top,unused-import
  import torch.distributed.checkpoint as dcp  # pylint: disable=g-import-not-at-top
  from torch.distributed.checkpoint import staging  # pylint: disable=g-import-not-at-top
  sd = sr.torch_state(host)
  options = staging.StagingOptions(False, False, False, False)
  dcp.async_save({"w": torch.ones(3)}, checkpoint_id=os.path.join(root, "tiny"),
                 async_stager=staging.DefaultStager(options)).result()
  stager = staging.DefaultStager(options)
  gc.collect()
  time.sleep(pause)
  t0 = time.perf_counter()
  fut = dcp.async_save(sd, checkpoint_id=path, async_stager=stager)
  blocked = time.perf_counter() - t0
  fut.result()
  return blocked


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--size", default="50mb")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--pause", type=float, default=1.0)
  ap.add_argument("--root", default="/var/tmp")
  ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print JSON
  args = ap.parse_args()
  if args.case:
    root = tempfile.mkdtemp(dir=args.root)
    try:
      print(json.dumps({"blocked": case(args.case, args.size, root, args.pause)}))
    finally:
      shutil.rmtree(root, ignore_errors=True)
    return
  times = {"orbax_flax": [], "DCP": []}
  for _ in range(args.reps):
    for name, which in (("orbax_flax", "orbax_flax"), ("DCP", "dcp")):
      out = subprocess.run([sys.executable, __file__, f"--size={args.size}",
                            f"--pause={args.pause}", f"--root={args.root}", f"--case={which}"],
                           capture_output=True, text=True, check=True).stdout
      times[name].append(json.loads(out.strip().splitlines()[-1])["blocked"])
  ours, theirs = statistics.median(times["orbax_flax"]), statistics.median(times["DCP"])
  print(f"{args.size}: first async save in a fresh process, caller blocked, medians of {args.reps}")
  for name, ts in times.items():
    print(f"  {name:10s} {statistics.median(ts) * 1e3:8.1f} ms   "
          f"({', '.join(f'{t * 1e3:.1f}' for t in ts)})")
  ratios = [a / b for a, b in zip(times["orbax_flax"], times["DCP"])]
  print(f"  ours / DCP's: {ours / theirs:.2f}x (per rep: "
        f"{', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}x)")


if __name__ == "__main__":
  main()
