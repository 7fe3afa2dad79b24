"""Differential saves against full ones, in the two cases that matter (issue 19).

    python benchmarks/differential.py --size=2gb --reps=5 --json=benchmarks/results/diff-2gb.json
    python benchmarks/differential.py --size=200mb --reps=3            # a quick check

Cases, each with ``differential=False`` (full) and ``differential=True``:

* **frozen90**: 90% of the state's bytes (a frozen base: large matrices, some
  sharded, some replicated, and small packed norms) never change; the other 10%
  (adapters and their Adam moments) change at every save.
* **allchange**: every array changes at every save (plain training): what
  differential saves cost when nothing can be reused (hashing every block).

Every case runs in a fresh process of its own, both modes in it, interleaved:
each mode has a ``Checkpointer`` kept for the run that saves a first full step,
then ``reps`` times (the modes' order alternating from rep to rep, on the same
states): the changing arrays change, a blocking ``save``, then a ``save_async``
(time the caller is blocked, and time to commit), then a warm restore of that
step and (as root) a cold one after dropping the page cache. Each trial waits
``--pause`` seconds first (this VM hands freed memory back within seconds).
Reported: medians, bytes written per save (the step's own bytes, from its
manifest), and the peak extra host memory of one async save (VmHWM after
``clear_refs``, minus the RSS before it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = {"50mb": 50 << 20, "200mb": 200 << 20, "1gb": 1 << 30, "2gb": 2 << 30}
CASES = ("frozen90", "allchange")


def build(total: int, case: str, step: int):
  """The state at ``step``: (frozen arrays, changing arrays), about ``total`` bytes in all."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  frozen_bytes = int(total * 0.9) if case == "frozen90" else 0
  rows = 2048
  def matrices(nbytes, seed, prefix):
    rng = np.random.default_rng(seed)
    out, n, k = {}, nbytes // 4, 0
    while n > 0:
      cols = min(n // rows, 8192) // 8 * 8  # divisible by the mesh's 4 "model" devices
      if not cols:
        break  # a remainder under 64 KiB
      spec = P("data", "model") if k % 3 else P()  # every third one replicated
      x = rng.standard_normal((rows, cols), dtype=np.float32)
      out[f"{prefix}{k}"] = jax.device_put(x, NamedSharding(mesh, spec))
      n -= rows * cols
      k += 1
    return out
  frozen = matrices(frozen_bytes, 0, "w") if frozen_bytes else {}
  rng = np.random.default_rng(1)
  frozen["norms"] = [jax.device_put(rng.standard_normal(2048, dtype=np.float32), NamedSharding(mesh, P()))
                     for _ in range(32)]
  changing = matrices(total - frozen_bytes, 100 + step, "a")
  return {"frozen": frozen, "changing": changing, "step": step}


def _trim() -> None:
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except OSError:
    pass


def _own_bytes(path: str) -> int:
  with open(os.path.join(path, "_CHECKPOINT"), "rb") as f:
    summary = json.loads(f.read().split(b"\n")[1])
  stored = summary.get("stored_bytes")
  return stored["own"] if stored else sum(summary["item_bytes"].values())


def one(case: str, total: int, reps: int, pause: float, root: str) -> list[dict]:
  """Runs one case in this process, full and differential saves interleaved; their medians.

  Each rep does every phase once per mode, the modes' order alternating, on the
  same states: drift of this VM's speed over minutes falls on both modes alike.
  """
  sys.path.insert(0, HERE)
  import hostmem  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import orbax_flax as ofx  # pylint: disable=g-import-not-at-top
  from save_restore import drop_caches  # pylint: disable=g-import-not-at-top
  modes = (False, True)
  ckptrs = {d: ofx.Checkpointer(differential=d) for d in modes}
  dirs = {d: os.path.join(root, "differential" if d else "full") for d in modes}
  state = build(total, case, 0)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
  for d in modes:
    ckptrs[d].save(os.path.join(dirs[d], "0"), {"state": state})
    ckptrs[d].prepare({"state": state})  # as a manager does: no first-save page faults
    ckptrs[d].wait_prepared()
  target = {"state": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                  if isinstance(x, jax.Array) else x, state)}
  times = {d: {"blocking_save": [], "async_blocked": [], "async_total": [], "restore_warm": [],
               "written_blocking": [], "written_async": []} for d in modes}
  peak = {}

  def pause_first() -> None:
    _trim()
    time.sleep(pause)

  for rep in range(reps):
    order = modes if rep % 2 == 0 else modes[::-1]
    step = 2 * rep + 1
    state = build(total, case, step)
    for d in order:
      pause_first()
      t = time.perf_counter()
      ckptrs[d].save(os.path.join(dirs[d], str(step)), {"state": state})
      times[d]["blocking_save"].append(time.perf_counter() - t)
      times[d]["written_blocking"].append(_own_bytes(os.path.join(dirs[d], str(step))))
    state = build(total, case, step + 1)
    for d in order:
      pause_first()
      measure = rep == reps - 1
      before = hostmem.reset_peak() if measure else 0
      t = time.perf_counter()
      handle = ckptrs[d].save_async(os.path.join(dirs[d], str(step + 1)), {"state": state})
      times[d]["async_blocked"].append(time.perf_counter() - t)
      handle.wait()
      times[d]["async_total"].append(time.perf_counter() - t)
      if measure:
        peak[d] = hostmem.status("VmHWM") - before
      times[d]["written_async"].append(_own_bytes(os.path.join(dirs[d], str(step + 1))))
    for d in order:
      pause_first()
      t = time.perf_counter()
      ckptrs[d].restore(os.path.join(dirs[d], str(step + 1)), target)
      times[d]["restore_warm"].append(time.perf_counter() - t)
      if drop_caches():  # cold: both modes read from the disk, whatever else was cached
        t = time.perf_counter()
        ckptrs[d].restore(os.path.join(dirs[d], str(step + 1)), target)
        times[d].setdefault("restore_cold", []).append(time.perf_counter() - t)
    for d in modes:  # room on the disk: steps no later save references (never a base)
      if not d or case == "allchange":
        for old in (step - 2, step - 1):
          if old > 0:
            shutil.rmtree(os.path.join(dirs[d], str(old)), ignore_errors=True)
  out = []
  for d in modes:
    ckptrs[d].close()
    res = {k: statistics.median(v) for k, v in times[d].items()}
    res.update(case=case, differential=d, state_bytes=nbytes, reps=reps,
               async_peak_extra_bytes=peak.get(d))
    out.append(res)
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--size", default="200mb", choices=sorted(SIZES))
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--pause", type=float, default=2.0)
  p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
  p.add_argument("--json", default=None)
  p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a case: one process
  a = p.parse_args(argv)
  total = SIZES[a.size]
  if a.one:
    root = tempfile.mkdtemp(dir=a.dir)
    try:
      print(json.dumps(one(a.one, total, a.reps, a.pause, root)), flush=True)
    finally:
      shutil.rmtree(root, ignore_errors=True)
    return 0
  env = dict(os.environ)
  env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
  results = []
  for case in CASES:
    res = subprocess.run([sys.executable, __file__, f"--one={case}", f"--size={a.size}",
                          f"--reps={a.reps}", f"--pause={a.pause}"] + ([f"--dir={a.dir}"] if a.dir else []),
                         capture_output=True, text=True, env=env, check=False)
    if res.returncode:
      print(res.stdout[-2000:], res.stderr[-4000:], file=sys.stderr)
      return res.returncode
    results += json.loads(res.stdout.strip().splitlines()[-1])
  print(report(results))
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"size": a.size, "reps": a.reps, "results": results}, f, indent=1)
  return 0


def report(results: list[dict]) -> str:
  """A markdown table: every phase, full against differential, per case."""
  cold = all("restore_cold" in r for r in results)
  rows = ["| case | mode | blocking save s | async: blocked s | async: total s | restore warm s |"
          + (" restore cold s |" if cold else "") + " written / save | async peak extra |",
          "|---|---|---:|---:|---:|---:|" + ("---:|" if cold else "") + "---:|---:|"]
  for r in results:
    state = r["state_bytes"]
    written = statistics.median([r["written_blocking"], r["written_async"]])
    rows.append(f"| {r['case']} | {'differential' if r['differential'] else 'full'} |"
                f" {r['blocking_save']:.3f} | {r['async_blocked']:.3f} | {r['async_total']:.3f} |"
                f" {r['restore_warm']:.3f} |" + (f" {r['restore_cold']:.3f} |" if cold else "")
                + f" {100 * written / state:.1f}% | {(r['async_peak_extra_bytes'] or 0) / state:.2f}x |")
  by = {(r["case"], r["differential"]): r for r in results}
  lines = []
  for case in CASES:
    full, diff = by.get((case, False)), by.get((case, True))
    if full and diff:
      lines.append(f"{case}: differential / full: blocking save {diff['blocking_save'] / full['blocking_save']:.2f}x,"
                   f" async blocked {diff['async_blocked'] / full['async_blocked']:.2f}x,"
                   f" async total {diff['async_total'] / full['async_total']:.2f}x,"
                   f" restore {diff['restore_warm'] / full['restore_warm']:.2f}x"
                   + (f", restore cold {diff['restore_cold'] / full['restore_cold']:.2f}x"
                      if cold else ""))
  return "\n".join(rows + [""] + lines)


if __name__ == "__main__":
  sys.exit(main())
