"""training: the plugin for a training loop. ``CheckpointCallback`` (``checkpoint_callback``)
and the small loop (``callbacks``), resuming (``resume``, ``state_items``, ``init_from``,
``workdir``, ``restart``), early ends (``preemption``, ``interruptions``), data positions
around prefetching (``prefetching``), and TensorBoard scalars (``tensorboard``).

May import: everything below it: ``core``, ``format``, ``engine``, ``formats``,
``differential``, ``manager``, ``tiers``, ``data``, ``errors``.
"""
