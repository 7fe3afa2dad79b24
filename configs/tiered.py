"""Two checkpoint tiers: frequent local saves replicated to a peer, rarer persistent saves.

Use with ``--config=configs/tiered.py``. Every 50 steps each process writes its
own shards to ``/dev/shm/ckpt`` (RAM: seconds even for a large state) and
sends a copy to one other process with JAX collectives; every 1000 steps the
state goes to the persistent store (``<workdir>/checkpoints``, or an object
store). A resume takes the newest step it can assemble: own local copies, a
peer's replica for a replaced host, else the persistent tier (always after a
change of process count: the local tier is tied to the process layout).

To let the cost of a local save choose its interval instead, set
``--config.checkpoint.local_save_interval=auto --config.checkpoint.mtbf_seconds=3600``
(every ``sqrt(2 x local save time x mtbf_seconds)`` seconds; ``python -m orbax_flax plan
--config=configs/tiered.py ...`` shows the choice).
"""

import os
import runpy

# configs/default.py, found next to this file (works from any working directory).
_DEFAULT = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py"))


def get_config():
  config = _DEFAULT["get_config"]()
  c = config.checkpoint
  c.local_directory = "/dev/shm/ckpt"
  c.local_save_interval_steps = 50
  c.local_max_to_keep = 1
  c.replicas = 1
  c.save_interval_steps = 1000  # persistent
  c.max_to_keep = 2             # persistent
  return config
