"""Planning time at 1,024 and 8,192 devices: this checkout against an older one, in one run.

    mkdir -p /tmp/old && git archive 52273f7 orbax_flax benchmarks | tar -x -C /tmp/old
    .venv/bin/python benchmarks/planning_ab.py --old=/tmp/old --reps=3

Each (devices, code) runs ``manifest_scaling.plan_items`` (the engine's own planning
over stand-in devices, see ``manifest_scaling.py``) in a fresh process, alternating old
and new every rep; medians over the reps. The records (chunk shapes, owners, packed
offsets) of both must hash the same: the manifest must not change by a byte.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = r'''
import hashlib, json, sys, time
sys.path[:0] = [sys.argv[2] + "/benchmarks", sys.argv[2]]
import manifest_scaling as ms
n = int(sys.argv[1]); hosts = n // 8
tree = ms.state(hosts)
t0 = time.perf_counter(); items, pieces = ms.plan_items(tree, hosts); dt = time.perf_counter() - t0
digest = hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]
print(json.dumps({"s": dt, "digest": digest, "pieces": pieces}))
'''


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--old", required=True, help="an older checkout's root (orbax_flax/, benchmarks/)")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--devices", default="1024,8192")
  a = p.parse_args()
  counts = [int(x) for x in a.devices.split(",")]
  res: dict = {}
  env = {"JAX_PLATFORMS": "cpu", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
  for _ in range(a.reps):
    for n in counts:
      for name, root in (("old", a.old), ("new", ROOT)):
        out = subprocess.run([sys.executable, "-c", CODE, str(n), root], capture_output=True,
                             text=True, env=env, cwd=root, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        res.setdefault((n, name), []).append(r)
        print(n, name, r, file=sys.stderr, flush=True)
  print("| devices | old | new | old / new | records identical |")
  print("|---:|---:|---:|---:|---|")
  for n in counts:
    old = statistics.median(r["s"] for r in res[(n, "old")])
    new = statistics.median(r["s"] for r in res[(n, "new")])
    same = len({r["digest"] for r in res[(n, "old")] + res[(n, "new")]}) == 1
    print(f"| {n:,} | {old:.2f} s | {new:.2f} s | {old / new:.1f}x | {'yes' if same else 'NO'} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
