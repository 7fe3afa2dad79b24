"""Fast checkpoint tiers below the persistent store.

:mod:`.local`: every process saves its own shards to a directory on its own
fast disk (RAM disk or local SSD), sends a copy to ``replicas`` peers with JAX
collectives, and the processes agree on each step through the coordination
service; a restore assembles the newest step every process can get, from its
own copy or a peer's.
"""
