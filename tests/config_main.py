"""A training entry point with a config file (config_flags.DEFINE_config_file), as users write."""

from absl import app
from ml_collections import config_flags

import orbax_flax as ofx

_CONFIG = config_flags.DEFINE_config_file("config")


def main(argv):
  del argv
  policy = ofx.CheckpointPolicy.from_config(_CONFIG.value.checkpoint)
  print(f"POLICY save_interval_steps={policy.save_interval_steps}"
        f" allow_lossy_casts={policy.allow_lossy_casts}")


if __name__ == "__main__":
  app.run(main)
