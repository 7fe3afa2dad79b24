"""Default config: a small transformer language model trained with Adam, checkpointed.

Use with ``--config=configs/default.py`` and override any field from the
command line, e.g. ``--config.num_steps=200 --config.checkpoint.max_to_keep=5``.
"""

import ml_collections


def get_checkpoint_config() -> ml_collections.ConfigDict:
  """The ``checkpoint`` block; every field is documented in orbax_flax.CheckpointPolicy."""
  c = ml_collections.ConfigDict()
  # Where checkpoints go; "" means <workdir>/checkpoints.
  c.directory = ""
  # Save every N steps (0: off).
  c.save_interval_steps = 50
  # Save once this many seconds of wall time passed since the last save (0: off).
  c.save_interval_seconds = 0.0
  # Also save at these steps.
  c.save_on_steps = ()
  # Save the first step of every run.
  c.save_first_step = False
  # Save the last step of the run (num_steps).
  c.save_final_step = True
  # Keep the N most recent steps (0: keep all).
  c.max_to_keep = 3
  # Keep every step that is a multiple of this forever (0: off).
  c.keep_period = 0
  # Keep one step per this many seconds of wall time forever (0: off).
  c.keep_time_interval_seconds = 0.0
  # Metric that ranks steps for keep_best and best_step(), e.g. "loss" ("": none).
  c.best_metric = ""
  # "min" or "max": which direction of best_metric is better.
  c.best_mode = "min"
  # Keep the N best steps by best_metric (0: off).
  c.keep_best = 0
  # Steps saved without best_metric are ranked "worst" or always "keep"-ed.
  c.best_missing = "worst"
  # Write in the background; training blocks only for the copy to host memory.
  c.async_save = True
  # A save requested while the previous one still writes: "wait" or "skip".
  c.if_busy = "wait"
  # On a preemption signal, every process saves the same step and training stops.
  c.save_on_preemption = True
  # Signals that mean preemption (SLURM sends SIGUSR1 before SIGTERM with --signal).
  c.preemption_signals = ("SIGTERM",)
  # Seconds the job has after the signal; a save that cannot commit in time is abandoned (0: no limit).
  c.preemption_grace_seconds = 0.0
  # If the training step raises, save the last good state before re-raising.
  c.save_on_exception = True
  # Initialise params from this checkpoint when there is nothing to resume ("": off).
  c.init_from = ""
  # Budget for host memory of one save or restore, in bytes (0: none); larger saves stage in rounds.
  c.max_host_bytes = 0
  # Keep the host staging copy between async saves (fast blocking phase); False releases it each save.
  c.keep_staging_memory = True
  # Seconds a process waits for the others at each rendezvous of a multi-process save.
  c.coordination_timeout_seconds = 600.0
  # Latest step unreadable on resume: "fallback" to the newest step that restores, or "raise".
  c.on_unreadable_checkpoint = "fallback"
  # A failed save (e.g. disk full): "raise" stops training, "warn" logs it and goes on.
  c.on_save_error = "raise"
  # A save or restore running longer than this logs its phase, bytes, RSS and thread stacks (0: off).
  c.watchdog_seconds = 600.0
  return c


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # Training steps in total; a resumed run continues up to this step.
  config.num_steps = 100
  # Sequences per global batch (divided over the data-parallel devices).
  config.batch_size = 16
  # Tokens per sequence.
  config.seq_len = 64
  # Vocabulary size of the synthetic byte-level corpus.
  config.vocab_size = 256
  # Model width.
  config.d_model = 128
  # Attention heads.
  config.num_heads = 4
  # Transformer blocks.
  config.num_layers = 2
  # Hidden width of each MLP block.
  config.d_ff = 512
  # Adam learning rate.
  config.learning_rate = 3e-3
  # Seed of parameter init, dropout and the data order.
  config.seed = 0
  # Dropout rate (uses the checkpointed RNG key, so resumed runs match).
  config.dropout = 0.1
  # Devices on the "model" axis of the mesh; the rest go to "data" (0: auto).
  config.model_parallel = 0
  # Log loss and speed every N steps.
  config.log_every = 10
  config.checkpoint = get_checkpoint_config()
  return config
