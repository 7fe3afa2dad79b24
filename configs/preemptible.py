"""Preemption-friendly variant of the default config.

Saves every 30 s of wall time (decided on process 0 and shared) and keeps only
the newest step, so a preempted job loses at most ~30 s of work and uses the
disk of one checkpoint. SIGTERM and SLURM's SIGUSR1 both count as preemption.
"""

import os
import runpy

# configs/default.py, found next to this file (works from any working directory).
_DEFAULT = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py"))


def get_config():
  config = _DEFAULT["get_config"]()
  config.num_steps = 1000
  c = config.checkpoint
  c.save_interval_steps = 0          # no step-based saves
  c.save_interval_seconds = 30.0     # a save every 30 s of wall time
  c.max_to_keep = 1                  # kept only until the next one commits
  c.preemption_signals = ("SIGTERM", "SIGUSR1")
  c.preemption_grace_seconds = 25.0  # abandon a save that cannot commit in time
  c.if_busy = "skip"                 # never stall training behind a slow save
  return config
