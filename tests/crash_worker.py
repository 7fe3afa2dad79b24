"""Saves checkpoints in a loop until killed; the test kills it at random times.

Usage: crash_worker.py DIR MODE where MODE is "fresh" (new paths DIR/c<i>) or
"overwrite" (DIR/c overwritten again and again, version i in every leaf).
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_flax as ofx  # noqa: E402


def state(version):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  out = {f"w{i}": jax.device_put(np.full((1024, 1024), version * 100 + i, np.float32),
                                 NamedSharding(mesh, P("data", "model"))) for i in range(12)}
  out["small"] = np.full((16,), version, np.int64)
  out["version"] = version
  return out


def main():
  directory, mode = sys.argv[1], sys.argv[2]
  version = 0
  while True:
    version += 1
    if mode == "fresh":
      ofx.save_async(os.path.join(directory, f"c{version}"), {"state": state(version)}).wait()
    else:
      ofx.save(os.path.join(directory, "c"), {"state": state(version)}, overwrite=True)
    print(f"COMMITTED {version}", flush=True)


if __name__ == "__main__":
  main()
