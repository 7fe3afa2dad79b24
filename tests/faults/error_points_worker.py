"""One process of a 2-process job running test_error_points.py's fixed manager run.

    error_points_worker.py --dir=D --out=F [--points=P --faulty=I] --coordinator=...

Without --points: the run once, fault-free, in D/reference, every process recording the call
sites of its file-system calls; writes ``{"counts": [[function, site, calls], ...]}`` to
F.<process>. With --points (a JSON list of [function, site, nth]): for each point i the run in
D/run<i>, process --faulty failing that site's nth call, the others fault-free; after each,
appends one line to F.<process>: ``{"point": i, "failed": did the fault fire, "saves": {step:
[[tag, returned], ...]}, "foreign": errors that are not ours, "errors": every error raised,
"seconds": the run's time}``.

The state: three 1 MiB float32 arrays sharded over both processes (each process writes its
own rows), one of which changes with the tag, and the tag itself (numpy).
"""

import argparse
import collections
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jobs  # noqa: E402
import orbax_flax as ofx  # noqa: E402
import test_error_points as points_lib  # noqa: E402  (tests/faults is this script's directory)

_FROZEN = np.random.default_rng(1).standard_normal((3, 256, 1024)).astype(np.float32)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--dir")
  p.add_argument("--out")
  p.add_argument("--points")
  p.add_argument("--faulty", type=int, default=0)
  p.add_argument("--differential", type=int, default=1)
  p.add_argument("--timeout", type=float, default=20.0)
  p.add_argument("--fail", help="FUNCTION:SITE: the loop, this site's first call failing")
  p.add_argument("--tier", type=int, default=0, help="the local tier's run (tier_run)")
  a = jobs.join(p)
  from orbax_flax.core import _multihost  # pylint: disable=g-import-not-at-top
  me = jax.process_index()
  sharding = NamedSharding(jax.make_mesh((jax.device_count(),), ("rows",)), P("rows"))

  def items(tag):
    def put(x):
      return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
    return {"state": {"a": put(_FROZEN[0] + tag), "b": put(_FROZEN[1]), "c": put(_FROZEN[2]),
                      "tag": np.full(4, tag, np.int64)}}

  def run(directory, faults):
    with pytest.MonkeyPatch.context() as mp, faults.installed(mp):
      return points_lib._run(directory, bool(a.differential), True, items,  # pylint: disable=protected-access
                             coordination_timeout_seconds=a.timeout)

  out = f"{a.out}.{me}"
  if a.tier:
    tier_points(a, sharding, _multihost)
  elif a.fail:
    loop(a, items)
  elif not a.points:
    faults = points_lib._Faults(os.path.join(a.dir, "reference"))  # pylint: disable=protected-access
    _, raised = run(os.path.join(a.dir, "reference"), faults)
    assert not raised, raised
    counts = collections.Counter(faults.calls)
    with open(out, "w") as f:
      json.dump({"counts": [[n, s, c] for (n, s), c in counts.items()]}, f)
  else:
    with open(a.points) as f:
      todo = json.load(f)
    for i, (name, site, nth) in enumerate(todo):
      _multihost.barrier(f"error_points/{i}", 600)
      d = os.path.join(a.dir, f"run{i}")
      target = (name, site) if me == a.faulty else None
      faults = points_lib._Faults(d, target, nth)  # pylint: disable=protected-access
      t0 = time.monotonic()
      saves, raised = run(d, faults)
      line = {"point": i, "failed": faults.failed is not None, "saves": saves,
              "foreign": points_lib._foreign(raised),  # pylint: disable=protected-access
              "errors": [f"{type(e).__name__}: {e}"[:300] for e in raised],
              "seconds": round(time.monotonic() - t0, 2)}
      with open(out, "a") as f:
        f.write(json.dumps(line) + "\n")
  print(f"P{me} DONE", flush=True)
  jobs.exit_together()


def loop(a, items):
  """A training loop's saves (steps 1-6, async, ``max_to_keep=1``, ``on_save_error="warn"``,
  no wait() between them), process --faulty failing the first call of --fail. Prints
  ``P<i> OPEN <error type>`` for a manager that could not be created (then a second one is),
  ``P<i> SAVED <step> <started>`` for each save() and ``P<i> KEPT <steps>`` at the end."""
  me = jax.process_index()
  name, site = a.fail.split(":", 1)
  d = os.path.join(a.dir, "loop")
  faults = points_lib._Faults(d, (name, site) if me == a.faulty else None)  # pylint: disable=protected-access
  policy = ofx.CheckpointPolicy(max_to_keep=1, differential=bool(a.differential),
                                on_save_error="warn", coordination_timeout_seconds=a.timeout)
  t0 = time.monotonic()
  with pytest.MonkeyPatch.context() as mp, faults.installed(mp):
    for _ in range(2):
      try:
        m = ofx.CheckpointManager(d, policy)
        break
      except ofx.CheckpointError as e:
        print(f"P{me} OPEN {type(e).__name__}", flush=True)
    with m:
      for step in range(1, 7):
        started = m.save(step, items(step), force=True)
        print(f"P{me} SAVED {step} {int(started)}", flush=True)
      m.wait()
  with ofx.CheckpointManager(d) as m:
    kept = m.all_steps()
  print(f"P{me} FAILED {faults.failed is not None}", flush=True)
  print(f"P{me} KEPT {json.dumps(kept, separators=(',', ':'))} {time.monotonic() - t0:.1f}",
        flush=True)


def tier_run(root, sharding, faults):
  """The training callback with the local tier (every step local, every third persistent,
  ``on_save_error="warn"``) saving steps 1-7 under ``faults``, then a restart without
  faults. Returns (the step it resumed, whether the state is that step's bitwise, the errors
  raised)."""
  policy = ofx.CheckpointPolicy(save_interval_steps=3, max_to_keep=2, local_directory=f"{root}/local",
                                local_save_interval_steps=1, local_max_to_keep=2,
                                on_save_error="warn", save_final_step=False,
                                coordination_timeout_seconds=_TIER_TIMEOUT_S)
  host = np.arange(4 * 1024, dtype=np.float32).reshape(4, 1024)

  def state(step):
    return {"w": jax.make_array_from_callback(host.shape, sharding,
                                              lambda idx: (host + step)[idx]),
            "step": np.full(2, step, np.int64)}

  raised = []
  os.makedirs(f"{root}/work", exist_ok=True)  # (it holds the run's logs: a resume looks in it)
  try:
    with pytest.MonkeyPatch.context() as mp, faults.installed(mp):
      with ofx.CheckpointCallback(f"{root}/work", policy) as ckpt:
        ckpt.restore_or_init(state(0))
        for step in range(1, 8):
          ckpt.on_step_end(step, state(step))
  except Exception as e:  # pylint: disable=broad-except  # judged by the test
    raised.append(e)
  with ofx.CheckpointCallback(f"{root}/work", policy) as ckpt:
    got = ckpt.restore_or_init(state(0))
    step = ckpt.restored_step
    want = state(step or 0)
    exact = all(_same(x, y) for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  return step, exact, raised


_TIER_TIMEOUT_S = 20


def _same(x, y) -> bool:
  """Bitwise equal, on this process's shards of a global array."""
  if isinstance(x, jax.Array) and isinstance(y, jax.Array):
    return all(a.index == b.index and np.array_equal(np.asarray(a.data), np.asarray(b.data))
               for a, b in zip(x.addressable_shards, y.addressable_shards))
  return np.array_equal(np.asarray(x), np.asarray(y))


def tier_points(a, sharding, multihost):
  """--tier: like the manager's run, recorded (no --points) or swept (--points)."""
  me = jax.process_index()
  out = f"{a.out}.{me}"
  if not a.points:
    root = os.path.join(a.dir, "reference")
    faults = points_lib._Faults(root)  # pylint: disable=protected-access
    step, exact, raised = tier_run(root, sharding, faults)
    assert not raised and exact and step == 7, (step, exact, raised)
    counts = collections.Counter(faults.calls)
    with open(out, "w") as f:
      json.dump({"counts": [[n, s, c] for (n, s), c in counts.items()]}, f)
    return
  with open(a.points) as f:
    todo = json.load(f)
  for i, (name, site, nth) in enumerate(todo):
    multihost.barrier(f"error_points/tier/{i}", 600)
    root = os.path.join(a.dir, f"run{i}")
    faults = points_lib._Faults(root, (name, site) if me == a.faulty else None, nth)  # pylint: disable=protected-access
    t0 = time.monotonic()
    try:
      step, exact, raised = tier_run(root, sharding, faults)
    except Exception as e:  # pylint: disable=broad-except  # the restart itself failed
      step, exact, raised = None, False, [e]
    line = {"point": i, "failed": faults.failed is not None, "step": step, "exact": exact,
            "foreign": points_lib._foreign(raised),  # pylint: disable=protected-access
            "errors": [f"{type(e).__name__}: {e}"[:300] for e in raised],
            "seconds": round(time.monotonic() - t0, 2)}
    with open(out, "a") as f:
      f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
  main()
