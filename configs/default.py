"""Default config: a small transformer language model trained with Adam, checkpointed.

Use with ``--config=configs/default.py`` and override any field from the
command line, e.g. ``--config.num_steps=200 --config.checkpoint.max_to_keep=5``.
"""

import ml_collections

from orbax_flax import CheckpointPolicy

_DEFAULTS = CheckpointPolicy()


def get_checkpoint_config() -> ml_collections.ConfigDict:
  """The ``checkpoint`` block: every field of orbax_flax.CheckpointPolicy, at its default.

  The defaults are stated once, on CheckpointPolicy; this block lists them
  with a comment each so that they can be overridden from the command line.
  """
  c = ml_collections.ConfigDict()
  # Where checkpoints go; "" means <workdir>/checkpoints.
  c.directory = _DEFAULTS.directory
  # Save every N steps (0: off).
  c.save_interval_steps = _DEFAULTS.save_interval_steps
  # Save once this many seconds of wall time passed since the last save (0: off).
  c.save_interval_seconds = _DEFAULTS.save_interval_seconds
  # "auto": the time between saves from what they cost, sqrt(2 x cost x mtbf_seconds).
  c.save_interval = _DEFAULTS.save_interval
  # The job's mean time between failures, for save_interval="auto" (e.g. 86400).
  c.mtbf_seconds = _DEFAULTS.mtbf_seconds
  # A resume reads each replicated array once and broadcasts it with collectives.
  c.read_once_restore = _DEFAULTS.read_once_restore
  # The local tier: a fast local directory per host ("" : off), e.g. /dev/shm/ckpt.
  c.local_directory = _DEFAULTS.local_directory
  # Save to the local tier every N steps (0: off).
  c.local_save_interval_steps = _DEFAULTS.local_save_interval_steps
  # "auto": also save to the local tier every sqrt(2 x local save time x mtbf_seconds).
  c.local_save_interval = _DEFAULTS.local_save_interval
  # Local steps each process keeps.
  c.local_max_to_keep = _DEFAULTS.local_max_to_keep
  # Other processes holding a copy of each process's local shards (JAX collectives).
  c.replicas = _DEFAULTS.replicas
  # Also save at these steps.
  c.save_on_steps = _DEFAULTS.save_on_steps
  # Save the first step of every run.
  c.save_first_step = _DEFAULTS.save_first_step
  # Save the last step of the run (num_steps).
  c.save_final_step = _DEFAULTS.save_final_step
  # Keep the N most recent steps (0: keep all).
  c.max_to_keep = _DEFAULTS.max_to_keep
  # Keep every step that is a multiple of this forever (0: off).
  c.keep_period = _DEFAULTS.keep_period
  # Keep one step per this many seconds of wall time forever (0: off).
  c.keep_time_interval_seconds = _DEFAULTS.keep_time_interval_seconds
  # Metric that ranks steps for keep_best and best_step(), e.g. "loss" ("": none).
  c.best_metric = _DEFAULTS.best_metric
  # "min" or "max": which direction of best_metric is better.
  c.best_mode = _DEFAULTS.best_mode
  # Keep the N best steps by best_metric (0: off).
  c.keep_best = _DEFAULTS.keep_best
  # Steps saved without best_metric are ranked "worst" or always "keep"-ed.
  c.best_missing = _DEFAULTS.best_missing
  # Write in the background; training blocks only for the copy to host memory.
  c.async_save = _DEFAULTS.async_save
  # A save requested while the previous one still writes: "wait" or "skip".
  c.if_busy = _DEFAULTS.if_busy
  # On a preemption signal, every process saves the same step and training stops.
  c.save_on_preemption = _DEFAULTS.save_on_preemption
  # Signals that mean preemption (SLURM sends SIGUSR1 before SIGTERM with --signal).
  c.preemption_signals = _DEFAULTS.preemption_signals
  # Seconds the job has after the signal; a save that cannot commit in time is abandoned (0: no limit).
  c.preemption_grace_seconds = _DEFAULTS.preemption_grace_seconds
  # If the training step raises, save the last good state before re-raising.
  c.save_on_exception = _DEFAULTS.save_on_exception
  # Initialise params from this checkpoint when there is nothing to resume ("": off).
  c.init_from = _DEFAULTS.init_from
  # Budget for host memory of one save or restore, in bytes (0: none); larger saves stage in rounds.
  c.max_host_bytes = _DEFAULTS.max_host_bytes
  # Keep the host staging copy between async saves (fast blocking phase); False releases it each save.
  c.keep_staging_memory = _DEFAULTS.keep_staging_memory
  # How an async save snapshots device arrays: "device_copy", "memcpy", "pinned_host", "auto"
  # (the platform's).
  c.host_transfer = _DEFAULTS.host_transfer
  # Write only the chunks that changed since the latest step; reference the rest (issue 19).
  c.differential = _DEFAULTS.differential
  # Seconds a process waits for the others at each rendezvous of a multi-process save.
  c.coordination_timeout_seconds = _DEFAULTS.coordination_timeout_seconds
  # Latest step unreadable on resume: "fallback" to the newest step that restores, or "raise".
  c.on_unreadable_checkpoint = _DEFAULTS.on_unreadable_checkpoint
  # A failed save (e.g. disk full): "raise" stops training, "warn" logs it and goes on.
  c.on_save_error = _DEFAULTS.on_save_error
  # A save or restore running longer than this logs its phase, bytes, RSS and thread stacks (0: off).
  c.watchdog_seconds = _DEFAULTS.watchdog_seconds
  # Resume into dtypes that lose information (float32 saved, bfloat16 model) only if True.
  c.allow_lossy_casts = _DEFAULTS.allow_lossy_casts
  # JAX's compilation cache in <workdir>/compilation_cache: a restart loads its train step, not compiles it.
  c.compilation_cache = _DEFAULTS.compilation_cache
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
  # This example's choices, over CheckpointPolicy's defaults (no periodic saves,
  # keep everything): a save every 50 steps, the 3 newest kept.
  config.checkpoint.save_interval_steps = 50
  config.checkpoint.max_to_keep = 3
  return config
