"""format: what a checkpoint is on storage. The manifest and its records with their one
validating decoder (``_manifest``, ``_records``, ``_records_decode``), OCDBT/zarr3 I/O
through tensorstore (``_tsio``), the chunk layout and ownership (``_layout``), where chunk
bytes lie (``_chunk_index``), and a directory of steps (``step_dir``).

May import: ``core`` and ``errors``.
"""
