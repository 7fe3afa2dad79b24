"""The async save's blocking phase inside a training loop, ours against DCP's, at 50 MB.

Issue 30, item 5. ``save_restore.py`` times one save per phase and frees memory between
phases (``malloc_trim``), so each of our device copies there lands in fresh pages; a
training job does not trim its heap between saves. This measures what a job meets: one
process per case, a loop of train steps (a jitted update that donates the state, or
torch's in-place update for DCP) with an async save every other step, each save's caller
blocked time; the save's background runs beside the next step, and the previous save is
waited for before the next one is timed (on both sides). Cases:

* ``ours``: ``Checkpointer.save_async`` with the default transfer (at 50 MB on CPU,
  "device_copy": XLA copies every array in one call);
* ``ours_memcpy``: the same with ``host_transfer="memcpy"`` (the kept staging arena);
* ``dcp``: ``torch.distributed.checkpoint.async_save`` of CPU tensors with one
  ``DefaultStager`` kept across saves (it caches its staging copy).

Every case runs ``--saves`` saves; the first is reported apart, the median is over the
rest. Cases alternate (ours, ours_memcpy, dcp, ours, ...), ``--reps`` of each; the
table gives the median of the per-process medians, and ours / DCP's per rep.

    python benchmarks/async_loop.py --reps=3
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

HERE = os.path.dirname(os.path.abspath(__file__))


def case(which: str, size: str, saves: int, root: str) -> dict:
  """One process's loop; returns the blocked seconds of every save."""
  sys.path.insert(0, HERE)
  import jax  # pylint: disable=g-import-not-at-top
  import save_restore as sr  # pylint: disable=g-import-not-at-top
  host = sr.host_state(size)
  blocked = []
  if which == "dcp":
    import torch  # pylint: disable=g-import-not-at-top
    import torch.distributed.checkpoint as dcp  # pylint: disable=g-import-not-at-top
    from torch.distributed.checkpoint import staging  # pylint: disable=g-import-not-at-top
    sd = sr.torch_state(host)
    stager = staging.DefaultStager(staging.StagingOptions(False, False, False, False))
    fut = None
    gc.collect()
    for i in range(2 * saves):
      with torch.no_grad():
        for t in sd.values():
          if t.is_floating_point():
            t.mul_(0.999).add_(1e-3)
      if i % 2:
        if fut is not None:
          fut.result()
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=os.path.join(root, str(i)), async_stager=stager)
        blocked.append(time.perf_counter() - t0)
    fut.result()
    getattr(stager, "close", lambda: None)()
    return {"blocked": blocked, "transfer": "dcp"}
  import orbax_flax as ofx  # pylint: disable=g-import-not-at-top
  state = sr.device_state(host, sr.mesh_for())
  step = jax.jit(lambda s: jax.tree.map(lambda x: x * 0.999 + 1e-3 if x.dtype.kind == "f" else x, s),
                 donate_argnums=0)
  transfer = "memcpy" if which == "ours_memcpy" else "auto"
  how = None
  gc.collect()
  with ofx.Checkpointer(host_transfer=transfer) as ckptr:
    for i in range(2 * saves):
      state = jax.block_until_ready(step(state))
      if i % 2:
        ckptr.wait()  # the previous save, as DCP's loop waits for its future: not timed
        t0 = time.perf_counter()
        handle = ckptr.save_async(os.path.join(root, str(i)), {"state": state})
        blocked.append(time.perf_counter() - t0)
        how = handle.transfer
    ckptr.wait()
  return {"blocked": blocked, "transfer": how}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--size", default="50mb")
  ap.add_argument("--saves", type=int, default=16)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--root", default="/var/tmp")
  ap.add_argument("--json", default=None)
  a = ap.parse_args()
  if a.case:
    root = tempfile.mkdtemp(dir=a.root, prefix="ofx-loop-")
    try:
      print("RESULT " + json.dumps(case(a.case, a.size, a.saves, root)), flush=True)
    finally:
      shutil.rmtree(root, ignore_errors=True)
    return 0
  cases = ("ours", "ours_memcpy", "dcp")
  rows = {c: [] for c in cases}
  for rep in range(a.reps):
    for c in cases:
      time.sleep(1.0)
      r = subprocess.run([sys.executable, os.path.abspath(__file__), f"--case={c}", f"--size={a.size}",
                          f"--saves={a.saves}", f"--root={a.root}"],
                         capture_output=True, text=True, check=False, timeout=900)
      lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
      if r.returncode or not lines:
        raise RuntimeError(f"{c}: rc={r.returncode}\n{r.stderr[-3000:]}")
      out = json.loads(lines[-1][len("RESULT "):])
      rows[c].append(out)
      steady = statistics.median(out["blocked"][1:])
      print(f"rep {rep} {c} ({out['transfer']}): first {out['blocked'][0] * 1e3:.1f} ms, steady median"
            f" {steady * 1e3:.1f} ms", file=sys.stderr, flush=True)
  med = {c: statistics.median(statistics.median(r["blocked"][1:]) for r in rows[c]) for c in cases}
  first = {c: statistics.median(r["blocked"][0] for r in rows[c]) for c in cases}
  print(f"| {a.size}, async save in a training loop, caller blocked | first save | steady (median of"
        f" {a.saves - 1} saves) | steady / DCP's (per rep) |")
  print("|---|---:|---:|---:|")
  for c in cases:
    ratios = [statistics.median(x["blocked"][1:]) / statistics.median(d["blocked"][1:])
              for x, d in zip(rows[c], rows["dcp"])]
    print(f"| {c} ({rows[c][0]['transfer']}) | {first[c] * 1e3:.1f} ms | {med[c] * 1e3:.1f} ms |"
          f" {statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)}) |")
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"size": a.size, "saves": a.saves, "reps": a.reps, "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
