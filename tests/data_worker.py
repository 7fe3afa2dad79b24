"""One process of a 2-process run whose data iterator keeps a per-process position.

Each process reads its own shard of range(64) (``[pid::2]``), as a grain
pipeline sharded by process does: ``get_state()`` is the index *within the
shard*, the same number on both processes. ``--global`` makes the iterator
declare its state global instead (``checkpoint_state_is_global = True``).
"""

import argparse
import itertools

import jax

import jobs
import orbax_flax as ofx


class ShardIterator:
  """range(64)[pid::nproc], one element per step; state = position within the shard."""

  def __init__(self, pid, nproc, is_global=False):
    self.items = list(range(64))[pid::nproc]
    self.next_index = 0
    if is_global:
      self.checkpoint_state_is_global = True

  def __iter__(self):
    return self

  def __next__(self):
    x = self.items[self.next_index]
    self.next_index += 1
    return x

  def get_state(self):
    return {"next_index": self.next_index}

  def set_state(self, s):
    self.next_index = s["next_index"]


def rollback(workdir):
  """Trains steps 1..10 (saving 5 and 10), rolls back to step 5, skips 3 batches (as after a
  loss spike), trains 6..10 again (process 1 a little late to the save of 10), and prints
  where each process's data stands."""
  import time  # pylint: disable=g-import-not-at-top
  me = jax.process_index()
  it = ShardIterator(me, jax.process_count())
  ckpt = ofx.CheckpointCallback(workdir, {"save_interval_steps": 5, "max_to_keep": 5})
  state = ckpt.restore_or_init({"w": 0}, data_iterator=it)
  for step in range(1, 11):
    state = {"w": state["w"] + next(it)}
    ckpt.on_step_end(step, state)
  ckpt.manager.wait_for_save()
  got = ckpt.manager.restore(5, {"state": None, "data": None})
  state = got["state"]
  it.set_state(got["data"]["processes"][me])
  for _ in range(3):
    next(it)
  for step in range(6, 11):
    state = {"w": state["w"] + next(it)}
    if step == 10 and me == 1:
      time.sleep(2)
    ckpt.on_step_end(step, state)
  print("POSITION", me, it.get_state()["next_index"], flush=True)
  ckpt.close()


def uneven(workdir):
  """Process 1 runs one step more than process 0 (its data lasted longer), then closes."""
  ckpt = ofx.CheckpointCallback(workdir, {"save_interval_steps": 100,
                                          "coordination_timeout_seconds": 60})
  state = ckpt.restore_or_init({"w": 0})
  for step in range(1, 4 + jax.process_index() + 1):
    state = {"w": state["w"] + 1}
    ckpt.on_step_end(step, state)
  try:
    ckpt.close()
  except RuntimeError as e:
    print("CLOSE FAILED", e, flush=True)


def mismatched(workdir):
  """Each process saves another step in what is one collective save."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  with ofx.CheckpointManager(workdir, ofx.CheckpointPolicy(coordination_timeout_seconds=60)) as m:
    try:
      m.save(4 + jax.process_index(), {"state": {"w": np.full(3, jax.process_index())}},
             force=True)
      m.wait()
      print("SAVED", m.all_steps(), flush=True)
    except Exception as e:  # pylint: disable=broad-except
      print("SAVE FAILED", type(e).__name__, e, flush=True)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--dir")
  p.add_argument("--global_state", action="store_true")
  p.add_argument("--rollback", action="store_true")
  p.add_argument("--uneven", action="store_true")
  p.add_argument("--mismatched", action="store_true")
  a = jobs.join(p)
  modes = {"rollback": rollback, "uneven": uneven, "mismatched": mismatched}
  for mode, run in modes.items():
    if getattr(a, mode):
      run(a.dir)
      return
  it = ShardIterator(jax.process_index(), jax.process_count(), a.global_state)
  ckpt = ofx.CheckpointCallback(a.dir, {"save_interval_steps": 5, "save_final_step": False})
  step = lambda s, b: ({"step": s["step"] + 1}, {})  # noqa: E731
  ofx.Trainer(step, [ckpt]).fit({"step": 0}, it, num_steps=5)
  print("SAVED", ckpt.manager.all_steps(), flush=True)


if __name__ == "__main__":
  main()
