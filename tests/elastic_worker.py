"""One process of a job started by ``python -m orbax_flax.launch`` that reads an elastic grain
pipeline (filter + shuffle + mix of two sources) and resumes it on any process count.

    python -m orbax_flax.launch -n 2 -- tests/elastic_worker.py --workdir=W --run=0 --steps=N

Each step takes this process's batch from ``orbax_flax.data.ElasticIterator`` and appends
``<step> <record ids...>`` to ``W/ledger/run<run>-p<process>.txt`` before the step's
``on_step_end``; SIGTERM saves and stops (the callback's preemption save). Prints ``RESUMED
<step>``, ``STEP <step>`` and ``PREEMPTED <step>`` or ``DONE <step>``.

``--replicated``: every process reads shard 0 of 1 (the data replicated across processes, as
when the model is split across them).

``--finite``: one pass over ``range(FINITE)`` (no filter) through ``ofx.Trainer.fit``, whose
train step sums the batch over every process (a collective, as a data-parallel step's); the
ledger as above; prints ``DONE <step> <seconds>`` once ``fit`` returns.
"""

import argparse
import collections
import os
import sys
import time

import grain
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from orbax_flax import launch  # noqa: E402

GLOBAL_BATCH = 12
FINITE = 97  # records of --finite's dataset: 2 shards read 49 and 48 positions of it


def keep(record) -> bool:
  """Drops about a third of the records, in runs, so that shards read at different rates."""
  return record["id"] % 7 != 3 and (record["id"] // 5) % 3 != 1


def pipeline():
  """The user's whole dataset: two sources mixed, shuffled, filtered; records carry their id."""
  a = grain.MapDataset.range(0, 3000).map(lambda i: {"id": i})
  b = grain.MapDataset.range(10_000, 12_000).map(lambda i: {"id": i})
  return grain.MapDataset.mix([a, b], weights=[0.6, 0.4]).shuffle(seed=3).filter(keep)


def ahead(batches, n):
  """Reads ``n`` batches ahead of what it yields, as flax's prefetch_to_device does."""
  queue = collections.deque()
  for batch in batches:
    queue.append(batch)
    if len(queue) > n:
      yield queue.popleft()
  yield from queue


def finite(a):
  """One pass of an unfiltered finite dataset through Trainer.fit, with a collective a step."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  import orbax_flax as ofx  # pylint: disable=g-import-not-at-top
  from orbax_flax.data import ElasticIterator  # pylint: disable=g-import-not-at-top

  it = ElasticIterator(grain.MapDataset.range(FINITE), 8)
  os.makedirs(os.path.join(a.workdir, "ledger"), exist_ok=True)
  ledger = open(os.path.join(a.workdir, "ledger", f"run{a.run}-p{jax.process_index()}.txt"), "w")

  def train_step(state, batch):
    ledger.write(f"{state['step'] + 1} {' '.join(map(str, batch.tolist()))}\n")
    ledger.flush()
    total = multihost_utils.process_allgather(np.int64(np.sum(batch)))  # waits for every process
    return {"step": state["step"] + 1, "sum": state["sum"] + np.int64(total.sum())}, {}

  cb = ofx.CheckpointCallback(a.workdir, {"save_interval_steps": 5,
                                          "coordination_timeout_seconds": 20})
  t = time.monotonic()
  state = ofx.Trainer(train_step, [cb]).fit({"step": 0, "sum": np.int64(0)}, it, a.steps)
  print(f"DONE {state['step']} {time.monotonic() - t:.0f}", flush=True)
  it.close()


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--workdir")
  p.add_argument("--run", type=int)
  p.add_argument("--steps", type=int)
  p.add_argument("--pace", type=float, default=0.1, help="seconds a step (time for a SIGTERM)")
  p.add_argument("--prefetched", action="store_true",
                 help="read two batches ahead through ofx.Prefetched, as docs/training.md says")
  p.add_argument("--finite", action="store_true", help="see the module docstring")
  p.add_argument("--replicated", action="store_true", help="see the module docstring")
  a = p.parse_args()
  launch.initialize_from_env(60, heartbeat_timeout_seconds=10)
  if a.finite:
    finite(a)
    return
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import orbax_flax as ofx  # pylint: disable=g-import-not-at-top
  from orbax_flax.data import ElasticIterator  # pylint: disable=g-import-not-at-top

  shard = {"shard_index": 0, "shard_count": 1} if a.replicated else {}
  source = ElasticIterator(pipeline(), GLOBAL_BATCH, read_options=grain.ReadOptions(num_threads=2),
                           **shard)
  it = ofx.Prefetched(source, lambda batches: ahead(batches, 2)) if a.prefetched else source
  cb = ofx.CheckpointCallback(a.workdir, {"save_interval_steps": 5,
                                          "coordination_timeout_seconds": 120})
  state = cb.restore_or_init({"step": jnp.zeros((), jnp.int32)}, data_iterator=it)
  start = cb.restored_step or 0
  assert int(state["step"]) == start, (int(state["step"]), start)
  print(f"RESUMED {start}", flush=True)
  train_step = jax.jit(lambda s: {"step": s["step"] + 1})
  os.makedirs(os.path.join(a.workdir, "ledger"), exist_ok=True)
  ledger = open(os.path.join(a.workdir, "ledger", f"run{a.run}-p{jax.process_index()}.txt"), "w")
  step = start
  for step in range(start + 1, a.steps + 1):
    batch = next(it)
    ledger.write(f"{step} {' '.join(map(str, np.asarray(batch['id']).tolist()))}\n")
    ledger.flush()
    state = train_step(state)
    print(f"STEP {step}", flush=True)
    if cb.on_step_end(step, state):
      print(f"PREEMPTED {step}", flush=True)
      break
    time.sleep(a.pace)
  cb.close()
  source.close()
  if not cb.preempted:
    print(f"DONE {step}", flush=True)


if __name__ == "__main__":
  main()
