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


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--dir")
  p.add_argument("--global_state", action="store_true")
  a = jobs.join(p)
  it = ShardIterator(jax.process_index(), jax.process_count(), a.global_state)
  ckpt = ofx.CheckpointCallback(a.dir, {"save_interval_steps": 5, "save_final_step": False})
  step = lambda s, b: ({"step": s["step"] + 1}, {})  # noqa: E731
  ofx.Trainer(step, [ckpt]).fit({"step": 0}, it, num_steps=5)
  print("SAVED", ckpt.manager.all_steps(), flush=True)


if __name__ == "__main__":
  main()
