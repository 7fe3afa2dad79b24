"""manager: a series of steps under one directory. Pure triggers and keep rules (``policy``)
and the policy as data (``config``), the trigger shell (``schedule``), the one owner of a
directory's steps and of the run's timeline (``registry``, with its rollback) with its leases
(``leases``), the evaluator's iterator (``evaluation``), and ``CheckpointManager``
(``manager``: the save in flight, its completion and its events), built from its
``components``.

May import: ``core``, ``format``, ``engine``, ``differential``, ``errors``.
"""
