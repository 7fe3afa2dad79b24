"""A job that checkpoints until it is killed; the fault tests kill it at random instants.

    fault_worker.py MODE DIR [--steps=N] [--coordinator=... --num_processes=2 --process_id=i]

Modes:
  manager    async saves every step (max_to_keep=2: retention deletes as it goes);
             with --steps, resumes first (checking the restored step) and stops at N.
  overwrite  one checkpoint DIR/c overwritten again and again.
  sweep      a manager started over and over on a directory full of leftovers.
  mp         like manager, in a 2-process jax.distributed job (coordination timeout 4 s).

Every committed step prints ``COMMITTED <step>`` once the manager knows it is
committed; every array of step s holds ``value(s)``, so a restore can be
checked bitwise.
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

SHAPES = {"w0": (512, 1024), "w1": (1024, 512), "w2": (256, 2048), "b": (1024,), "s": (16, 16)}


def value(name, step):
  """The deterministic contents of array ``name`` at ``step``."""
  shape = SHAPES[name]
  base = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
  return base + np.float32(step * 1000 + sorted(SHAPES).index(name))


def state(step, mesh):
  out = {}
  for name, shape in SHAPES.items():
    spec = P("data", "model") if len(shape) == 2 and shape[0] >= 256 else P()
    v = value(name, step)
    out[name] = jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda i, v=v: v[i])
  out["step"] = step
  return out


def check(restored, step):
  """Raises unless ``restored`` is exactly step ``step``'s state."""
  assert int(restored["step"]) == step, (restored["step"], step)
  for name in SHAPES:
    got = np.asarray(restored[name])
    if not np.array_equal(got, value(name, step)):
      raise AssertionError(f"step {step}: {name} differs from what was saved")


def target(mesh):
  return {name: jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(
      mesh, P("data", "model") if len(shape) == 2 and shape[0] >= 256 else P()))
          for name, shape in SHAPES.items()} | {"step": 0}


def run_manager(directory, steps, mesh, timeout=600.0):
  policy = ofx.CheckpointPolicy(save_interval_steps=1, max_to_keep=2, save_final_step=False,
                                coordination_timeout_seconds=timeout)
  with ofx.CheckpointManager(directory, policy) as mngr:
    start = 0
    latest = mngr.latest_step()
    if latest is not None:
      restored = mngr.restore(latest, {"state": target(mesh)})["state"]
      check(restored, latest)
      print(f"RESUMED {latest}", flush=True)
      start = latest
    save_steps(mngr, start, steps, lambda step: {"state": state(step, mesh)})
    print(f"LEFTOVERS {[l.name for l in mngr.leftovers()]}", flush=True)


def run_overwrite(directory, mesh):
  path = os.path.join(directory, "c")
  step = 0
  while True:
    step += 1
    ofx.save(path, {"state": state(step, mesh)}, overwrite=True)
    print(f"COMMITTED {step}", flush=True)


def run_sweep(directory, mesh):
  """Leftovers of interrupted saves below the latest step, swept by every new manager."""
  ofx.save(os.path.join(directory, "5"), {"state": state(5, mesh)})
  print("COMMITTED 5", flush=True)
  n = 0
  while True:
    for step in (1, 2, 3, 4):
      d = os.path.join(directory, f"{step}.ofx-tmp-{n:08d}")
      os.makedirs(os.path.join(d, "state", "p0-x", "d"), exist_ok=True)
      for k in range(20):
        with open(os.path.join(d, "state", "p0-x", "d", f"f{k}"), "wb") as f:
          f.write(os.urandom(1 << 16))
    n += 1
    ofx.CheckpointManager(directory).close()
    print(f"SWEPT {n}", flush=True)


def save_steps(mngr, step, steps, items):
  """Saves ``items(step)`` after ``step`` until ``steps`` (None: until killed), printing commits."""
  while steps is None or step < steps:
    step += 1
    mngr.save(step, items(step))
    for event in mngr.pop_events():
      print(f"COMMITTED {event.step}", flush=True)
  mngr.wait()
  for event in mngr.pop_events():
    print(f"COMMITTED {event.step}", flush=True)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("mode", choices=["manager", "overwrite", "sweep", "mp"])
  p.add_argument("dir")
  p.add_argument("--steps", type=int, default=None)
  p.add_argument("--coordinator")
  p.add_argument("--num_processes", type=int, default=1)
  p.add_argument("--process_id", type=int, default=0)
  a = p.parse_args()
  if a.mode == "mp":
    jax.distributed.initialize(a.coordinator, num_processes=a.num_processes,
                               process_id=a.process_id, initialization_timeout=60,
                               heartbeat_timeout_seconds=30)
  mesh = jax.make_mesh((2, jax.device_count() // 2), ("data", "model"))
  if a.mode in ("manager", "mp"):
    try:
      run_manager(a.dir, a.steps, mesh, timeout=4.0 if a.mode == "mp" else 600.0)
    except Exception as e:  # pylint: disable=broad-except
      print(f"ERROR {type(e).__name__}: {e}", flush=True)
      os._exit(3)  # pylint: disable=protected-access  # skip jax.distributed's shutdown barrier
  elif a.mode == "overwrite":
    run_overwrite(a.dir, mesh)
  else:
    run_sweep(a.dir, mesh)


if __name__ == "__main__":
  main()
