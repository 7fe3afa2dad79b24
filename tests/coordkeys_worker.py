"""One process of a two-process job that counts the coordination service's keys over a run.

Each phase grows by a fixed count of keys a save (or a decision) where its keys are left
behind (tests/test_multiprocess.py): a time trigger asked every third step, ``if_busy="skip"``,
the training callback with a data iterator, the local tier.
"""

import argparse
import json
import os

import jobs
from test_resume import Positions  # a resumable iterator: get_state()/set_state()


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("dir")
  a = jobs.join(parser)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax_flax as ofx  # pylint: disable=g-import-not-at-top
  from orbax_flax.core import _multihost  # pylint: disable=g-import-not-at-top

  def keys():  # but the keep decisions' (one a commit, in buckets of 1024: bounded)
    return {k for k, _ in _multihost.client().key_value_dir_get("orbax_flax")
            if "/retain/" not in k}

  def count():
    return len(keys())

  grown = {}
  tree = {"state": {"b": np.zeros(4, np.float32)}}
  # A time trigger asked every third step: its buckets of 1024 steps go two behind.
  with ofx.CheckpointManager(os.path.join(a.dir, "time"),
                             ofx.CheckpointPolicy(save_interval_seconds=3600)) as m:
    m.save(3, tree, force=True)
    m.wait()
    for s in range(6, 3 * 700, 3):
      m.should_save(s)
      if s == 3 * 100:
        before = count()
    grown["time"] = count() - before
  # With a step trigger too, whose steps make no time decision (512 fires at every 1024th).
  with ofx.CheckpointManager(os.path.join(a.dir, "time2"), ofx.CheckpointPolicy(
      save_interval_seconds=3600, save_interval_steps=512)) as m:
    m.save(3, tree, force=True)
    m.wait()
    for s in range(4, 2600):
      m.should_save(s)
      if s == 1100:
        before = count()
    grown["time_and_steps"] = count() - before
  # if_busy="skip": every process skips the same steps (a gather a due step).
  with ofx.CheckpointManager(os.path.join(a.dir, "busy"), ofx.CheckpointPolicy(
      save_interval_steps=1, max_to_keep=1, if_busy="skip")) as m:
    for s in range(1, 61):
      m.save(s, tree)
      if s == 20:
        m.wait()
        before = count()
    m.wait()
    grown["busy"] = count() - before
  # The callback with a data iterator (a gather of the positions a save) and the local tier
  # (its own gathers and a barrier a local save).
  policy = ofx.CheckpointPolicy(save_interval_steps=2, max_to_keep=1, save_final_step=False,
                                local_directory=os.path.join(a.dir, "local"),
                                local_save_interval_steps=1)
  data = Positions()
  with ofx.CheckpointCallback(os.path.join(a.dir, "run"), policy) as ckpt:
    state = ckpt.restore_or_init({"b": np.zeros(4, np.float32)}, data_iterator=data)
    for s in range(1, 61):
      next(data)
      state = {"b": state["b"] + 1}
      ckpt.on_step_end(s, state, None)
      if s == 20:
        ckpt.manager.wait()
        before, seen = count(), keys()
    ckpt.manager.wait()
    grown["callback"] = count() - before
    grown["new"] = sorted(keys() - seen)
  print("RESULT " + json.dumps(grown), flush=True)


if __name__ == "__main__":
  main()
