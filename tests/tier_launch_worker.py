"""One process of a job started by ``python -m orbax_flax.launch``: a CheckpointCallback run
with the local tier (a small sharded state, so that the job costs seconds, not compilations).

    python -m orbax_flax.launch -n 3 --devices_per_process=2 -- tests/tier_launch_worker.py \
        --workdir=W --local=L --steps=N [--fill_at=S --fill_leave=blob]

Prints ``RESUMED <step> <value>`` (the restored step, or 0, and the value of its weights,
which every save sets to the step) and ``DONE <step>``. Log lines carry wall-clock times.

``--fill_at=S``: process ``--fill_process`` fills the file system of its local directory
(``<local>/run-*/process_<i>``, a small tmpfs the test mounted there) just before step S and
frees it after: a transient full disk. ``--fill_leave=blob`` leaves room for one more copy of
its newest local blob, and for nothing else (its ``COMMITTED`` record).

``--slow_at=S``: process ``--slow_process``'s local disk takes ``--slow_seconds`` to write its
blob of step S (longer than ``--coordination_timeout``: the others give up waiting for it),
and every step ends with a cross-process collective (a training step's all-reduce, which
waits for every process without a timeout).
"""

import argparse
import glob
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from orbax_flax import launch  # noqa: E402

launch.initialize_from_env(60, heartbeat_timeout_seconds=10)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_flax as ofx  # noqa: E402
from orbax_flax.tiers import _blob  # noqa: E402

_PAGE = 4096


def _fill(local: str, leave: str) -> str:
  """Fills the file system of this process's local directory; returns the filler's path."""
  (root,) = glob.glob(os.path.join(local, "run-*", f"process_{jax.process_index()}"))
  room = 0
  if leave == "blob":  # the newest step's own blob, in whole pages
    newest = max((d for d in os.listdir(root) if d.isdigit()), key=int)
    room = -(-os.stat(os.path.join(root, newest, "own.blob")).st_size // _PAGE) * _PAGE
  st = os.statvfs(root)
  filler = os.path.join(root, "filler")
  with open(filler, "wb") as f:
    f.write(b"x" * (st.f_bavail * st.f_frsize - room))
  return filler


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--workdir")
  p.add_argument("--local")
  p.add_argument("--steps", type=int)
  p.add_argument("--replicas", type=int, default=1)
  p.add_argument("--local_max_to_keep", type=int, default=1)
  p.add_argument("--save_interval_steps", type=int, default=4, help="of the persistent tier")
  p.add_argument("--on_save_error", default="raise")
  p.add_argument("--fill_at", type=int, default=0)
  p.add_argument("--fill_process", type=int, default=1)
  p.add_argument("--fill_leave", choices=["nothing", "blob"], default="nothing")
  p.add_argument("--coordination_timeout", type=float, default=600)
  p.add_argument("--slow_at", type=int, default=0)
  p.add_argument("--slow_process", type=int, default=1)
  p.add_argument("--slow_seconds", type=float, default=0)
  a = p.parse_args()
  slow = []  # set while the slow step's local save runs

  def write(*args, _write=_blob.write, **kw):
    if slow:
      time.sleep(a.slow_seconds)
    return _write(*args, **kw)
  _blob.write = write
  logging.basicConfig(level=logging.INFO, format="%(asctime)s.%(msecs)03d %(message)s",
                      datefmt="%H:%M:%S")
  mesh = jax.make_mesh((jax.device_count(),), ("d",))
  sharding = NamedSharding(mesh, P("d"))
  state = lambda v: {"w": jax.device_put(np.full(jax.device_count() * 4096, v, np.float32),  # noqa: E731
                                         sharding)}
  cb = ofx.CheckpointCallback(a.workdir, {
      "local_directory": a.local, "local_save_interval_steps": 2,
      "local_max_to_keep": a.local_max_to_keep,
      "save_interval_steps": a.save_interval_steps, "replicas": a.replicas,
      "on_save_error": a.on_save_error, "save_final_step": False,
      "coordination_timeout_seconds": a.coordination_timeout})
  all_reduce = jax.jit(lambda w: jax.numpy.sum(w))
  s = cb.restore_or_init(state(0.0))
  start = cb.restored_step or 0
  value = float(np.asarray(s["w"].addressable_shards[0].data)[0])
  print(f"RESUMED {start} {value}", flush=True)
  for step in range(start + 1, a.steps + 1):
    s = state(float(step))
    filler = None
    if step == a.fill_at and jax.process_index() == a.fill_process:
      filler = _fill(a.local, a.fill_leave)
    if step == a.slow_at and jax.process_index() == a.slow_process:
      slow.append(step)
    cb.on_step_end(step, s)
    slow.clear()
    if filler:
      os.remove(filler)
    if a.slow_at:
      float(all_reduce(s["w"]))
  cb.close()
  print(f"DONE {a.steps}", flush=True)


if __name__ == "__main__":
  main()
