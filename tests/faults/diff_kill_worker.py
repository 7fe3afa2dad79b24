"""A differential-save job that checkpoints until killed (tests/faults/test_differential_kills.py).

    diff_kill_worker.py DIR [--steps=N]

Resumes from the latest step (checking it bitwise, printing ``RESUMED <step>``
or ``FRESH``), then saves every step asynchronously with ``differential=True``
and ``max_to_keep=2``, so retention deletes the bases newer steps borrow from
as it goes. ``frozen`` changes every 5 steps (old bases become unreferenced and
are swept), ``hot`` and ``small`` every step. Prints ``COMMITTED <step>``.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_flax as ofx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_worker  # noqa: E402  (its save-and-report loop)

SHAPES = {"frozen": (1024, 1024), "frozen_rep": (512, 512), "hot": (256, 512), "small": (64,)}
SPECS = {"frozen": P("data", "model"), "frozen_rep": P(), "hot": P("data"), "small": P()}


def value(name, step):
  """Array ``name`` at ``step``: the frozen ones change every 5 steps, the others every step."""
  shape = SHAPES[name]
  era = step // 5 if name.startswith("frozen") else step
  base = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
  return base + np.float32(era * 1000 + sorted(SHAPES).index(name))


def state(step, mesh):
  out = {n: jax.make_array_from_callback(s, NamedSharding(mesh, SPECS[n]),
                                         lambda i, v=value(n, step): v[i])
         for n, s in SHAPES.items()}
  out["step"] = step
  return out


def target(mesh):
  return {n: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(mesh, SPECS[n]))
          for n, s in SHAPES.items()} | {"step": 0}


def check(restored, step):
  assert int(restored["step"]) == step, (restored["step"], step)
  for name in SHAPES:
    if not np.array_equal(np.asarray(restored[name]), value(name, step)):
      raise AssertionError(f"step {step}: {name} differs from what was saved")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("dir")
  p.add_argument("--steps", type=int, default=None)
  a = p.parse_args()
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  policy = ofx.CheckpointPolicy(save_interval_steps=1, max_to_keep=2, save_final_step=False,
                                differential=True)
  with ofx.CheckpointManager(a.dir, policy) as mngr:
    step = mngr.latest_step() or 0
    if step:
      check(mngr.restore(step, {"state": target(mesh)})["state"], step)
      print(f"RESUMED {step}", flush=True)
    else:
      print("FRESH", flush=True)
    fault_worker.save_steps(mngr, step, a.steps, lambda step: {"state": state(step, mesh)})
  print("DONE", flush=True)


if __name__ == "__main__":
  main()
