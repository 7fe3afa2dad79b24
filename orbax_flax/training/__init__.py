"""training: the plugin for a training loop. ``CheckpointCallback`` (``checkpoint_callback``,
with what a run that ends early checks and says) and the small loop (``callbacks``),
resuming (``resume``: with the restart's compile cache and clock, and the workdir's checks;
``state_items``, ``init_from``), preemption
signals (``preemption``), data positions around prefetching (``prefetching``), and
TensorBoard scalars (``tensorboard``).

May import: everything below it: ``core``, ``format``, ``engine``, ``formats``,
``differential``, ``manager``, ``tiers``, ``data``, ``errors``.
"""
