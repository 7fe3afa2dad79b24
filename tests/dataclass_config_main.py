"""A training entry point whose config is a dataclass (config_flags.DEFINE_config_dataclass)."""

import dataclasses

from absl import app
from ml_collections import config_flags

import orbax_flax as ofx


@dataclasses.dataclass
class CheckpointConfig:
  save_interval_steps: int = 100
  max_to_keep: int = 3
  preemption_signals: tuple[str, ...] = ("SIGTERM",)


@dataclasses.dataclass
class Config:
  num_steps: int = 1000
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)


_CONFIG = config_flags.DEFINE_config_dataclass("config", Config())


def main(argv):
  del argv
  policy = ofx.CheckpointPolicy.from_config(_CONFIG.value.checkpoint)
  print(f"POLICY {policy.save_interval_steps} {policy.max_to_keep} {','.join(policy.preemption_signals)}")


if __name__ == "__main__":
  app.run(main)
