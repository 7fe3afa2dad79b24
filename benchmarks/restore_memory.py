"""What a small restore's peak host memory is made of (issue 30 item 5: the 50 MB row).

    .venv/bin/python benchmarks/restore_memory.py [--size=50mb] [--reps=3] [--dir=/var/tmp]

The peak (VmHWM after resetting it with ``clear_refs``, minus VmRSS before) of a restore
of ``save_restore.py``'s LLaMA-like state, each case in a fresh process, against the
state's bytes:

* ``jax_buffer``: what JAX's CPU runtime keeps per device buffer (``device_put`` of
  3,000 four-byte arrays: the bytes are nothing, the buffers are all);
* ``host``: a restore into host (numpy) arrays, no devices: our reader alone, with its
  reading threads (``host_1_thread``: the same with one);
* ``device``: the restore onto the 8-device target, as ``save_restore.py --memory`` does.

The state on 8 simulated devices is ``leaves x 8`` device buffers (every leaf is
sharded over the 8 devices or replicated on them), so JAX's own floor for any restore
that builds it is ``buffers x jax_buffer``. Prints a table; medians of ``--reps``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

_CASE = r"""
import os, sys, json
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, {here!r})
import numpy as np, jax
import save_restore as sr, hostmem
import orbax_flax as ofx
from orbax_flax.engine import _reading
case, size, path = sys.argv[1], sys.argv[2], sys.argv[3]
host = sr.host_state(size)
nbytes = sum(x.nbytes for x in jax.tree.leaves(host))
leaves = len(jax.tree.leaves(host))
mesh = sr.mesh_for()
if case == "save":
  ofx.save(path, {{"state": sr.device_state(host, mesh)}}, overwrite=True)
  peak = 0
elif case == "jax_buffer":
  bufs = [np.ones(1, np.float32) for _ in range(3000)]
  devs = jax.devices()
  jax.block_until_ready(jax.device_put([np.ones(1, np.float32)] * 8, devs))
  peak = hostmem.measure(lambda: jax.block_until_ready(
      jax.device_put(bufs, [devs[i % 8] for i in range(3000)])))[0] / 3000
else:
  if case == "host_1_thread":
    _reading._THREADS = 1
  ckptr = ofx.Checkpointer()
  target = {{"state": sr.abstract(sr.device_state(host, mesh))}} if case == "device" else None
  del host
  sr.release_memory()
  if target is None:
    peak = hostmem.measure(lambda: ckptr.restore(path))[0]
  else:
    peak = hostmem.measure(lambda: jax.block_until_ready(ckptr.restore(path, target)))[0]
print("RESULT", json.dumps({{"peak": peak, "nbytes": nbytes, "leaves": leaves}}))
"""


def run(case: str, size: str, path: str) -> dict:
  out = subprocess.run([sys.executable, "-c", _CASE.format(here=HERE), case, size, path],
                       capture_output=True, text=True, check=True).stdout
  return json.loads(next(l for l in out.splitlines() if l.startswith("RESULT"))[len("RESULT"):])


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--size", default="50mb")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--dir", default="/var/tmp")
  a = p.parse_args()
  path = os.path.join(a.dir, f"ofx-restore-memory-{a.size}")
  run("save", a.size, path)
  cases = ("jax_buffer", "host", "host_1_thread", "device")
  got = {c: [run(c, a.size, path) for _ in range(a.reps)] for c in cases}
  nbytes, leaves = got["host"][0]["nbytes"], got["host"][0]["leaves"]
  per_buffer = statistics.median(r["peak"] for r in got["jax_buffer"])
  floor = leaves * 8 * per_buffer
  print(f"state {nbytes / 2**20:.1f} MiB, {leaves} leaves, {leaves * 8} device buffers;"
        f" JAX keeps {per_buffer:.0f} B per buffer: {floor / 2**20:.1f} MiB"
        f" ({floor / nbytes:.2f}x the state) for any restore that builds them")
  print("| case | peak (MiB) | peak / state |")
  print("|---|---:|---:|")
  for c in cases[1:]:
    peak = statistics.median(r["peak"] for r in got[c])
    print(f"| {c} | {peak / 2**20:.1f} | {peak / nbytes:.3f}x |")


if __name__ == "__main__":
  main()
