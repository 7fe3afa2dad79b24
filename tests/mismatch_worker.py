"""One process of a two-process job whose processes do not save alike (tests/test_multiprocess.py).

``--mode=tree``: four saves whose tree differs on process 1 (a renamed key, a missing leaf,
another dtype, another item name), blocking and async; each must be refused on both processes
with a ValueError and leave nothing committed; then a save of the same tree commits.

``--mode=refuse``: saves that one process refuses while the other does not (an unsupported
leaf on process 1, once before and once after process 0 began writing; on process 0;
overwrite=True on process 0 only): each must fail on both processes at once, with the refusing process's error
type and reason, and leave nothing committed; the saves after each commit on both.

``--mode=module``: ofx.save and ofx.save_async of another path on each process: refused on
both at once, naming both paths; then a save of one path commits.

Prints ``CASE <name> <outcome> <seconds> <error type>: <message>`` per save.
"""

import argparse
import os
import time

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs
import orbax_flax as ofx

TIMEOUT_S = 30.0  # coordination_timeout_seconds: a refusal is learned long before it


def _array(mesh, seed, dtype=np.float32):
  """A (64,) array over every device of the job, from this process's own data (no collective:
  each process may build it with another dtype)."""
  v = np.random.default_rng(seed).standard_normal(64).astype(dtype)
  return jax.make_array_from_callback((64,), NamedSharding(mesh, P("d")), lambda i: v[i])


def _case(name, path, fn):
  t = time.monotonic()
  try:
    fn()
    outcome = "saved -"
  except Exception as e:  # pylint: disable=broad-except  # reported to the test
    outcome = f"raised {type(e).__name__}: {' '.join(str(e).split())[:400]}"
  committed = path is not None and os.path.exists(os.path.join(path, "_CHECKPOINT"))
  head, _, rest = outcome.partition(" ")
  print(f"CASE {name} {head}{'+committed' if committed else ''} {time.monotonic() - t:.1f}"
        f" {rest}", flush=True)


def tree(root, mesh, me):
  a, b, c = _array(mesh, 1), _array(mesh, 2), _array(mesh, 3)
  cases = {
      "rename": {"state": {"w": a, ("w2" if me == 1 else "w_"): c if me == 1 else b}},
      "missing": {"state": {"w": a, "w_": b} if me == 0 else {"w": a}},
      "dtype": {"state": {"w": a, "w_": _array(mesh, 2, ml_dtypes.bfloat16 if me else np.float32)}},
      "item": {("state" if me == 0 else "params"): {"w": a, "w_": b}},
  }
  with ofx.Checkpointer(coordination_timeout_seconds=TIMEOUT_S) as ckptr:
    for i, (name, items) in enumerate(cases.items()):
      path = os.path.join(root, name)
      if i % 2:
        _case(name, path, lambda: ckptr.save_async(path, items).wait())
      else:
        _case(name, path, lambda: ckptr.save(path, items))
    path = os.path.join(root, "same")
    _case("same", path, lambda: ckptr.save(path, {"state": {"w": a, "w_": b}}))


def refuse(root, mesh, me):
  a = _array(mesh, 1)
  good = lambda step: {"state": {"w": a, "cfg": step}}  # noqa: E731
  policy = ofx.CheckpointPolicy(save_interval_steps=1, coordination_timeout_seconds=TIMEOUT_S)
  with ofx.CheckpointManager(os.path.join(root, "run"), policy) as mngr:
    def save(step, items, late=False):
      if late and me == 1:
        time.sleep(1.0)  # process 0 has published the generation and written its part
      mngr.save(step, items)
      mngr.wait()
    bad = {"state": {"w": a, "cfg": object() if me == 1 else 3}}
    _case("leaf", os.path.join(root, "run", "1"), lambda: save(1, bad))
    _case("after-leaf", os.path.join(root, "run", "2"), lambda: save(2, good(2)))
    _case("late-leaf", os.path.join(root, "run", "3"), lambda: save(3, bad, late=True))
    _case("after-late-leaf", os.path.join(root, "run", "4"), lambda: save(4, good(4)))
    bad0 = {"state": {"w": a, "cfg": object() if me == 0 else 3}}  # process 0 refuses
    _case("leaf0", os.path.join(root, "run", "5"), lambda: save(5, bad0))
    _case("after-leaf0", os.path.join(root, "run", "6"), lambda: save(6, good(6)))
  with ofx.Checkpointer(coordination_timeout_seconds=TIMEOUT_S) as ckptr:
    path = os.path.join(root, "x")
    _case("first", path, lambda: ckptr.save(path, good(1)))
    def manifest():
      return open(os.path.join(path, "_CHECKPOINT"), "rb").read() if os.path.exists(path) else None
    before = manifest()
    _case("overwrite", None, lambda: ckptr.save(path, good(2), overwrite=me == 0))
    print(f"OVERWRITTEN {manifest() != before}", flush=True)
    path = os.path.join(root, "y")
    _case("after-overwrite", path, lambda: ckptr.save_async(path, good(3)).wait())


def module(root, mesh, me):
  """ofx.save / ofx.save_async, each process naming its own path (a per-process directory):
  their keys were the path's, so they never met and each waited the 600 s timeout."""
  items = {"state": {"w": _array(mesh, 1)}}
  mine = os.path.join(root, f"p{me}")
  _case("paths", None, lambda: ofx.save(mine, items))
  _case("async-paths", None, lambda: ofx.save_async(mine + "-a", items).wait())
  path = os.path.join(root, "same")
  _case("after-paths", path, lambda: ofx.save(path, items))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--mode", choices=["tree", "refuse", "module"])
  parser.add_argument("--path")
  a = jobs.join(parser)
  mesh = jax.make_mesh((jax.device_count(),), ("d",))
  {"tree": tree, "refuse": refuse, "module": module}[a.mode](a.path, mesh, jax.process_index())
  jobs.exit_together()


if __name__ == "__main__":
  main()
