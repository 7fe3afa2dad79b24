"""engine: one checkpoint, saved and restored. Planning (``_planning``), the save
(``saving``: top to bottom, the blocking phase, the background phase and the atomic
commit), the restore (``restoring``, with ``read_once``; ``_reading``, with its buffers),
targets (``targets``: making one, and matching it against a checkpoint) and ``transforms``, the
``Checkpointer`` object, ``describe``/``verifying``, selectors and ``converting``.

May import: ``core``, ``format``, ``formats`` (foreign formats), ``errors``; and, until the
engine owns the interfaces differential saves plug into, ``differential`` (a known debt).
"""
