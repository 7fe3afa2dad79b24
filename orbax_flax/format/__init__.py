"""format: what a checkpoint is on storage. The manifest: its records, the file and their one
validating decoder (``_manifest``), OCDBT/zarr3 I/O
through tensorstore, with where chunk bytes lie in a database (``_tsio``), the chunk layout
and ownership (``_layout``), and a directory of steps (``step_dir``).

May import: ``core`` and ``errors``.
"""
