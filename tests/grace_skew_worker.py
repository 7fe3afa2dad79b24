"""One process of a 2-process training job preempted (SIGTERM, JAX's preemption sync) while
process 0's wall clock is 60 s ahead of process 1's, which gets the signal; or, with
``--setup_signal``, one clock and the signal during the job's set-up (before the callback
is built: 2 s of set-up follow it).

JAX's notice carries the signalled host's wall-clock time; process 0 must not count the
difference between the hosts' clocks as grace period spent. Process 1 sends itself SIGTERM
during step 3 (steps of 0.2 s); the grace period is 20 s, and the save needs well under a
second. Prints the callback's log and ``RESULT ...``.
"""

import argparse
import itertools
import logging
import os
import signal
import time

import numpy as np

import jobs
import orbax_flax as ofx

SKEW_S = 60.0


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--dir")
  p.add_argument("--setup_signal", action="store_true")
  a = jobs.join(p)
  if a.setup_signal:
    if a.process_id == 1:
      os.kill(os.getpid(), signal.SIGTERM)  # caught by JAX's notifier, before any callback
    time.sleep(2.0)  # building the model, the data pipeline...
  elif a.process_id == 0:  # this host's wall clock is ahead; its monotonic clock is untouched
    real = time.time
    time.time = lambda: real() + SKEW_S
  logging.basicConfig(level=logging.INFO, format="%(message)s")

  def step_fn(s, batch):
    del batch
    if s["step"] == 2 and a.process_id == 1 and not a.setup_signal:
      os.kill(os.getpid(), signal.SIGTERM)  # caught by JAX's notifier (no Python handler)
    time.sleep(0.2)
    return {"w": s["w"], "step": s["step"] + 1}, {}

  cfg = {"save_interval_steps": 0, "preemption_grace_seconds": 20.0}
  ckpt = ofx.CheckpointCallback(a.dir, cfg)
  state = {"w": np.ones(1024, np.float32), "step": 0}
  out = ofx.Trainer(step_fn, [ckpt]).fit(state, itertools.repeat(None), num_steps=200)
  print(f"RESULT preempted={ckpt.preempted} stopped_at={out['step']}"
        f" committed={ckpt.manager.all_steps()}", flush=True)
  jobs.exit_together()


if __name__ == "__main__":
  main()
