"""Data pipelines whose position resumes exactly on any number of processes.

:mod:`.order` is pure arithmetic on a global data order: which positions a set
of strided shards has read, and the next order (the holes first, then the
frontier on) when the shard count changes. :mod:`.elastic` is
:class:`ElasticIterator`, a grain pipeline (its datasets, batching, read
options and prefetch threads) reading one shard of that order, with the
elastic checkpoint protocol (``checkpoint_state_is_elastic`` and
``set_state_from_shards``) that :class:`orbax_flax.training.resume.DataPosition` calls.

May import: grain, JAX, numpy and each other, never the rest of orbax_flax: the
checkpoint side knows them only through that protocol.
"""

from orbax_flax.data.elastic import ElasticIterator

__all__ = ["ElasticIterator"]
