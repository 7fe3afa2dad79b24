"""One process of a two-process job whose keep rules read what differs between processes.

A metric each host computes on its own eval shard, and host clocks 40 ms apart
(tests/test_step_lifecycle.py): every process must list the same steps.
"""

import argparse
import json

import jobs


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("dir")
  a = jobs.join(parser)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax_flax as ofx  # pylint: disable=g-import-not-at-top

  me = jax.process_index()
  now = [0.0]
  policy = ofx.CheckpointPolicy(save_interval_steps=20, max_to_keep=2, keep_best=1,
                                best_metric="eval_loss", best_mode="min")
  with ofx.CheckpointManager(a.dir, policy, clock=lambda: now[0]) as mngr:
    for step in range(1, 121):
      now[0] = step - 0.02 + 0.04 * me  # this host's wall clock
      eval_loss = 0.1 if step == (80, 40)[me] else 1.0  # measured on this host's eval shard
      mngr.save(step, {"state": {"x": np.full(8, step, np.float32)}},
                metrics={"eval_loss": eval_loss})
    mngr.wait()
    print("RESULT " + json.dumps(mngr.all_steps()), flush=True)


if __name__ == "__main__":
  main()
