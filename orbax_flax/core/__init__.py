"""core: what every layer stands on. Locations and storage calls (``_location``), pytrees as
data (``_tree``), coordination between processes (``_multihost``), host memory for
snapshots (``_staging``), progress and watchdogs (``_progress``), CRC-32C (``_crc``),
work spread over threads, done in the calling thread at interpreter exit (``_threads``).

May import: ``orbax_flax.errors`` and third-party libraries only.
"""
