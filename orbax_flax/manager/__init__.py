"""manager: a series of steps under one directory. Pure policies (``policy``) and the policy
as data (``config``), the trigger shell (``schedule``), the one owner of a directory's steps
(``registry``) with its leases (``leases``), rollback (``rollback``), the save in flight
(in ``manager``), events, the evaluator's iterator (``evaluation``), and
``CheckpointManager`` (``manager``), built from its ``components``.

May import: ``core``, ``format``, ``engine``, ``differential``, ``errors``.
"""
