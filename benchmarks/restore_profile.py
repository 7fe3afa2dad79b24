"""Where a 2 GB warm restore's time goes (issue 18 item 2), in one process after one save.

    .venv/bin/python benchmarks/restore_profile.py [--dir=/var/tmp]

Beside the restore (time and minor page faults), the costs it could contain: faulting
in 2 GB of fresh memory, one CRC-32C pass over 2 GB, and placing 2,672 host buffers on
the devices with ``jax.device_put`` (what a reader that does not adopt its buffers pays).
Medians of 3.
"""
import gc
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import numpy as np, jax
import save_restore as sr
import orbax_flax as ofx
from orbax_flax.core import _crc

def flt(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
root = os.path.join(next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--dir=")),
                         "/var/tmp"), "ofx-restore-profile")
os.makedirs(root, exist_ok=True)
path = os.path.join(root, "ck")
host = sr.host_state("2gb"); mesh = sr.mesh_for()
state = sr.device_state(host, mesh); nbytes = sum(x.nbytes for x in jax.tree.leaves(host))
shards = sum(len(x.addressable_shards) for x in jax.tree.leaves(state))
if not os.path.exists(path): ofx.save(path, {"state": state})
target = {"state": sr.abstract(state)}
del host; gc.collect()
rows = {}
def rec(k, v): rows.setdefault(k, []).append(v)
for rep in range(3):
  sr.release_memory(); time.sleep(1)
  f0, t0 = flt(), time.perf_counter()
  out = ofx.restore(path, target); jax.block_until_ready(out)
  rec("restore warm (s)", time.perf_counter() - t0); rec("restore minor faults", flt() - f0)
  del out; sr.release_memory(); time.sleep(1)
  # Faulting in the result memory: fresh 2 GB, one write per 4 KiB page.
  f0, t0 = flt(), time.perf_counter()
  buf = np.empty(nbytes, np.uint8); buf[::4096] = 1
  rec("fault in 2 GB of fresh memory (s)", time.perf_counter() - t0); rec("its minor faults", flt() - f0)
  t0 = time.perf_counter(); _crc.value(buf); rec("CRC-32C of 2 GB, one thread (s)", time.perf_counter() - t0)
  del buf; sr.release_memory()
  # Placement: make device arrays from host buffers already in memory (what follows the reads).
  hosts = [np.ones(s.data.shape, np.float32) for x in jax.tree.leaves(state) for s in x.addressable_shards]
  t0 = time.perf_counter()
  i = 0
  arrs = []
  for x in jax.tree.leaves(state):
    bufs = []
    for s in x.addressable_shards:
      bufs.append(jax.device_put(hosts[i], s.device)); i += 1
    arrs.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding, bufs))
  jax.block_until_ready(arrs)
  rec(f"device_put + assembly of {shards} shards from host buffers (s)", time.perf_counter() - t0)
  del arrs, hosts; sr.release_memory()
print(f"state {nbytes/1e9:.2f} GB, {shards} shards, median of 3:")
for k, v in rows.items():
  m = statistics.median(v)
  print(f"| {k} | {m:.3f} |" if isinstance(m, float) else f"| {k} | {m:,} |")
