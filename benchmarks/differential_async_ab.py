"""The async blocking phase of full against differential saves, nothing else between them.

    python benchmarks/differential_async_ab.py --size=2gb --reps=8 --dir=/var/tmp/dbench

One process, the frozen90 state of ``differential.py``, a prepared ``Checkpointer``
per mode, ``reps`` async saves per mode alternating (each waits for its commit):
the median time the caller was blocked in each mode. ``differential.py`` runs a
blocking save before every async one, which differs between the modes (2 GB
written against 200 MB); this isolates the blocking phase itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--size", default="200mb")
  p.add_argument("--reps", type=int, default=8)
  p.add_argument("--dir", default=None)
  a = p.parse_args(argv)
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  sys.path[:0] = [HERE, os.path.dirname(HERE)]
  import differential  # pylint: disable=g-import-not-at-top
  import orbax_flax as ofx  # pylint: disable=g-import-not-at-top
  root = tempfile.mkdtemp(dir=a.dir)
  try:
    modes = (False, True)
    ckptrs = {d: ofx.Checkpointer(differential=d) for d in modes}
    state = differential.build(differential.SIZES[a.size], "frozen90", 0)
    for d in modes:
      ckptrs[d].save(os.path.join(root, f"{d}-0"), {"state": state})
      ckptrs[d].prepare({"state": state})
      ckptrs[d].wait_prepared()
    blocked = {d: [] for d in modes}
    for rep in range(a.reps):
      state = differential.build(differential.SIZES[a.size], "frozen90", rep + 1)
      for d in modes if rep % 2 == 0 else modes[::-1]:
        time.sleep(1.0)
        t = time.perf_counter()
        handle = ckptrs[d].save_async(os.path.join(root, f"{d}-{rep + 1}"), {"state": state})
        blocked[d].append(time.perf_counter() - t)
        handle.wait()
        if not d:  # a full step no later save references
          shutil.rmtree(os.path.join(root, f"{d}-{rep}"), ignore_errors=True)
    for d in modes:
      ckptrs[d].close()
      print(f"{'differential' if d else 'full'}: caller blocked, median"
            f" {statistics.median(blocked[d]):.3f} s of {[round(x, 3) for x in blocked[d]]}")
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
