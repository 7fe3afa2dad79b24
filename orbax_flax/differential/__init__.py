"""Differential saves: a chunk that did not change since the base step is not written again.

With ``differential=True`` (:class:`orbax_flax.CheckpointPolicy`,
:class:`orbax_flax.Checkpointer`) a save hashes every block it would write
(xxh3-128 of the stored bytes, in the background phase) and compares it with
the hash the base step recorded for the same chunk of the same array; an
equal block is not written: the manifest records that the step holding those
bytes holds it (``bases``, ``chunk_base``, ``packed_pieces``; see
``docs/format.md``). Retention keeps a step's data while any committed step
references it: such a step is retired in place, not deleted, and swept once
nothing references it (``docs/guarantees.md``, section 9).

Inside:

* :mod:`.refs`: the manifest fields, their validation, and where a
  referenced step's data is found (used by the reader and by retention);
* :mod:`.hashing`: the content hash, releasing the GIL, over threads;
* :mod:`.differ`: one save's decisions, process by process, merged at the commit;
* :mod:`.retention`: the registry's retention where steps reference each other
  (:class:`.retention.Referenced`): deleting a step keeps what other steps
  reference; the sweep of retired data that nothing references any more.

It plugs into interfaces the engine and the manager own: a
:class:`.differ.Differ` is a save's hooks (the engine's plain default is
:class:`orbax_flax.engine.saving.SaveHooks`), :class:`.retention.Referenced` the
registry's retention (its plain default is
:class:`orbax_flax.manager.registry.Retention`). With differential saves off,
no code here runs in a save or a restore of a plain checkpoint
(``tests/test_differential_off.py``).

May import: ``core``, ``format``, ``engine`` (its low layers: ``_reading``,
``restoring``), ``errors``. Still imported back by the engine, one level with it:
the Checkpointer builds a :class:`.differ.Differential` when asked, the reader
finds a differential checkpoint's bases through :mod:`.refs`, an overwrite of a
step others borrow from keeps its data (``saving``, and the exports of ``formats``: one
function, :func:`.refs.dispose_replaced`), and verify hashes chunks.
"""
