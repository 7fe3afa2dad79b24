"""A training run that says what it is doing, so that a test can send SIGTERM at awkward times.

    signal_worker.py WORKDIR NUM_STEPS [--interval=N]

Prints ``RESTORE_START`` when the callback starts to restore (its SIGTERM handler in), ``SAVE_STARTED <step>``
right after an async save has started, ``FINAL_SAVE`` just before the final
save, and ``DONE <step> preempted=<bool>`` at the end. The state is 256 MiB, so
that each of those operations is under way for a while after its line.
"""

import argparse
import itertools
import os
import signal
import sys
import threading
import time

import numpy as np

import orbax_flax as ofx

def main():
  p = argparse.ArgumentParser()
  p.add_argument("workdir")
  p.add_argument("num_steps", type=int)
  p.add_argument("--interval", type=int, default=5)
  a = p.parse_args()


  class Markers(ofx.Callback):
    """Runs around the checkpoint callback: before it at start and end, after it at each step."""

    def __init__(self, ckpt):
      self.ckpt = ckpt

    def on_train_start(self, state, data):
      # RESTORE_START once the callback's SIGTERM handler is in (restore_or_init installs
      # it before it reads; a SIGTERM before that ends the process, as SIGTERM does).
      before = signal.getsignal(signal.SIGTERM)

      def announce():
        while signal.getsignal(signal.SIGTERM) is before:
          time.sleep(0.001)
        print("RESTORE_START", flush=True)

      threading.Thread(target=announce, daemon=True).start()
      return state

    def on_step_end(self, step, state, metrics):
      if self.ckpt.manager.inflight_step() == step:
        print(f"SAVE_STARTED {step}", flush=True)
      return False

    def on_train_end(self, step, state):
      print("FINAL_SAVE", flush=True)


  def step_fn(state, batch):
    return {"w": {k: v + 1 for k, v in state["w"].items()}, "step": state["step"] + 1}, {"loss": 1.0}


  ckpt = ofx.CheckpointCallback(a.workdir, {"save_interval_steps": a.interval, "max_to_keep": 3})
  markers = Markers(ckpt)
  state = {"w": {f"w{i}": np.zeros((1 << 23,), np.float32) for i in range(8)}, "step": 0}


  class Ordered(ofx.Callback):
    """The markers before the checkpoint callback at start and end, after it at each step."""

    def on_train_start(self, state, data):
      state = markers.on_train_start(state, data)
      return ckpt.on_train_start(state, data)

    def on_step_end(self, step, state, metrics):
      stop = ckpt.on_step_end(step, state, metrics)
      markers.on_step_end(step, state, metrics)
      return stop

    def on_train_end(self, step, state):
      markers.on_train_end(step, state)
      ckpt.on_train_end(step, state)

    def on_exception(self, step, state, error):
      ckpt.on_exception(step, state, error)


  state = ofx.Trainer(step_fn, [Ordered()]).fit(state, itertools.repeat(None), a.num_steps)
  print(f"DONE {int(state['step'])} preempted={ckpt.preempted}", flush=True)
  sys.stdout.flush()
  os._exit(0)  # pylint: disable=protected-access



if __name__ == "__main__":
  main()
