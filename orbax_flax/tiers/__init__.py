"""Fast checkpoint tiers below the persistent store.

:mod:`.local`: every process saves its own shards to a directory on its own
fast disk (RAM disk or local SSD), sends a copy to ``replicas`` peers on other
hosts with JAX collectives, and the processes agree on each step through the
coordination service; a restore assembles the newest step every process can
get, from its own copy or a peer's. :mod:`._blob` is its file format (the
engine's leaf records, target check and placement, in one file per process),
:mod:`.placement` the pure choice of where copies go and which to read,
:mod:`._exchange` the collective that moves bytes, :mod:`.saves` the training
loop's side (is a step due, one local save); when the tier saves is
:class:`orbax_flax.manager.schedule.Schedule`, the persistent tier's shell too. May import:
``core``, ``format``, ``engine``, ``formats``, ``manager`` (its schedule), ``errors``; the
engine never imports them.
"""
