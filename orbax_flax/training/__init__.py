"""training: the plugin for a training loop. ``CheckpointCallback`` (``checkpoint_callback``,
with what a run that ends early checks and says) and the small loop (``callbacks``),
resuming (``resume``, ``state_items``, ``init_from``, ``workdir``, ``restart``), preemption
signals (``preemption``), data positions around prefetching (``prefetching``), and
TensorBoard scalars (``tensorboard``).

May import: everything below it: ``core``, ``format``, ``engine``, ``formats``,
``differential``, ``manager``, ``tiers``, ``data``, ``errors``.
"""
