"""format: what a checkpoint is on storage. The manifest: its records, the file and their one
validating decoder (``_manifest``), OCDBT/zarr3 I/O
through tensorstore, with where chunk bytes lie in a database (``_tsio``), the chunk grid
and its geometry (``_layout``), and a directory of steps (``step_dir``). Which process writes
which chunk is not the format's business: the save's plan chooses it (``engine._planning``).

May import: ``core`` and ``errors``.
"""
