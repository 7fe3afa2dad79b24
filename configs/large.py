"""A scaled-up variant of the default config (about 85M parameters, ~1 GB with Adam).

Meant for a machine with accelerators; on a 2-core CPU a step takes seconds.
"""

import os
import runpy

# configs/default.py, found next to this file (works from any working directory).
_DEFAULT = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py"))


def get_config():
  config = _DEFAULT["get_config"]()
  config.num_steps = 2000
  config.batch_size = 32
  config.seq_len = 256
  config.d_model = 768
  config.num_heads = 12
  config.num_layers = 12
  config.d_ff = 3072
  config.learning_rate = 3e-4
  config.checkpoint.save_interval_steps = 200
  config.checkpoint.max_to_keep = 2
  config.checkpoint.keep_period = 1000
  return config
