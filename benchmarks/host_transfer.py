"""How an async save's snapshot crosses to the host on this device, piece by piece.

On a TPU v5e (2026-12-05, ``device.sh``) our async save of the 2 GB state blocked
63 ms but took 10.7 s in all, against 2.9 s for our blocking save and 4.1-4.3 s
for the peers' async saves. This separates the parts of the two ways an async
save brings device arrays to the host (``host_transfer``):

* "pinned_host": one ``jax.device_put`` of every array into pinned host memory
  (dispatch, then ready), then host views of the pinned arrays (``np.asarray``);
* "memcpy": ``copy_to_host_async`` of every array, then ``np.asarray`` each;

then times orbax_flax's async save with each (blocking and total) and a
blocking save, and samples the save threads' stacks during the pinned save to
say where its time goes::

    python benchmarks/host_transfer.py --size=2gb --reps=2
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import orbax_flax as ofx  # noqa: E402
from save_restore import device_random_state, fresh, mesh_for  # noqa: E402


class StackSampler:
  """Counts, every ``period`` seconds, the innermost frame of each thread's stack that
  lies in orbax_flax, jax or tensorstore (a poor man's profiler across threads)."""

  def __init__(self, period=0.02):
    self.period, self.counts, self._stop = period, collections.Counter(), threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    me = threading.get_ident()
    while not self._stop.wait(self.period):
      for ident, frame in sys._current_frames().items():  # pylint: disable=protected-access
        if ident == me:
          continue
        f = frame
        while f is not None:
          name = f.f_code.co_filename
          if "orbax_flax" in name or "/jax/" in name or "tensorstore" in name:
            self.counts[f"{os.path.basename(name)}:{f.f_code.co_name}:{f.f_lineno}"] += 1
            break
          f = f.f_back

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


def timed(fn):
  t0 = time.perf_counter()
  out = fn()
  return time.perf_counter() - t0, out


def profile_blocking(state):
  """cProfile of the caller's side of one memcpy async save, after one to warm the plan."""
  import cProfile  # pylint: disable=g-import-not-at-top
  import pstats  # pylint: disable=g-import-not-at-top
  root = tempfile.mkdtemp(prefix="ofx-transfer-")
  with ofx.Checkpointer(host_transfer="memcpy") as ckptr:
    ckptr.save_async(os.path.join(root, "warm"), {"state": fresh(state)}).wait()
    s = fresh(state)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    h = ckptr.save_async(os.path.join(root, "c"), {"state": s})
    prof.disable()
    print(f"blocked {time.perf_counter() - t0:.3f} s", flush=True)
    h.wait()
  pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
  pstats.Stats(prof).sort_stats("tottime").print_stats(15)
  shutil.rmtree(root, ignore_errors=True)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--size", default="2gb")
  p.add_argument("--reps", type=int, default=2)
  p.add_argument("--profile", action="store_true",
                 help="only profile the blocking phase of one memcpy async save (cProfile)")
  a = p.parse_args()
  mesh = mesh_for()
  state = device_random_state(a.size, mesh)
  if a.profile:
    return profile_blocking(state)
  leaves = jax.tree.leaves(state)
  nbytes = sum(x.nbytes for x in leaves)
  print(f"{a.size}: {nbytes / 1e9:.2f} GB, {len(leaves)} leaves on {jax.devices()[0].platform}",
        flush=True)
  rows = collections.defaultdict(list)
  root = tempfile.mkdtemp(prefix="ofx-transfer-")
  for _ in range(a.reps):
    xs = jax.tree.leaves(fresh(state))
    shardings = [x.sharding.with_memory_kind("pinned_host") for x in xs]
    t_dispatch, pinned = timed(lambda: jax.device_put(xs, shardings, may_alias=False))
    t_ready, _ = timed(lambda: jax.block_until_ready(pinned))
    t_views, views = timed(lambda: [np.asarray(x) for x in pinned])
    t_again, _ = timed(lambda: [np.asarray(x) for x in pinned])
    rows["pinned_host: device_put dispatch"].append(t_dispatch)
    rows["pinned_host: until ready"].append(t_ready)
    rows["pinned_host: np.asarray of every pinned array"].append(t_views)
    rows["pinned_host: np.asarray again"].append(t_again)
    del pinned, views

    xs = jax.tree.leaves(fresh(state))
    t_start, _ = timed(lambda: [x.copy_to_host_async() for x in xs])
    t_get, _ = timed(lambda: [np.asarray(x) for x in xs])
    rows["memcpy: copy_to_host_async of every array"].append(t_start)
    rows["memcpy: np.asarray of every array"].append(t_get)

    for how in ("pinned_host", "memcpy"):
      path = os.path.join(root, how)
      shutil.rmtree(path, ignore_errors=True)
      with ofx.Checkpointer(host_transfer=how) as ckptr:
        s = fresh(state)
        sampler = StackSampler()
        t0 = time.perf_counter()
        with sampler:
          h = ckptr.save_async(path, {"state": s})
          rows[f"ofx save_async ({how}): blocking"].append(time.perf_counter() - t0)
          h.wait()
          rows[f"ofx save_async ({how}): total"].append(time.perf_counter() - t0)
        print(f"where the {how} save spent its time (samples of {sampler.period}s):")
        for where, n in sampler.counts.most_common(20):
          print(f"  {n:5d}  {where}")
    path = os.path.join(root, "blocking")
    shutil.rmtree(path, ignore_errors=True)
    with ofx.Checkpointer() as ckptr:
      s = fresh(state)
      rows["ofx save (blocking)"].append(timed(lambda: ckptr.save(path, {"state": s}))[0])
  shutil.rmtree(root, ignore_errors=True)
  print(f"\n| part ({a.size}, median of {a.reps}) | seconds |\n|---|---:|")
  for k, v in rows.items():
    print(f"| {k} | {statistics.median(v):.3f} |")


if __name__ == "__main__":
  main()
