"""KV tiers below the engine's pool: host memory (tier 1) and a store shared by engines (tier 2).

A block lives in up to three places, each keyed by its chain hash (``services.protocol.
block_hash``, so the tenant salt and the adapter are in every key): the KV pool
(``BlockManager``), this engine's host store (``host_store``: write-through, LRU of its own) and
the shared store (``remote_store``: Redis/Valkey with its own memory cap and allkeys-lru).

Lifecycle (``tiers.KVTiers`` drives it from the engine thread; ``copier.KVCopier`` moves bytes
on its own thread, so no step waits for a copy):

* save: every block the pool caches is, after the step that filled it was applied, held (an
  extra reference, so neither a finish, an abort nor a preemption can hand it to another
  request while it is read) and copied to a host slot, and to the shared store; the hold ends
  when the copy is done.
* load: an admission asks the pool, then the host store, then the shared store for the blocks
  that follow its pool hit (the last prompt token is always computed). On a hit the request
  gets its blocks, waits in ``Scheduler.loading`` (the step goes on without it) while the copy
  thread fills them, and joins the running set with those tokens computed. An abort while it
  loads frees its blocks only once the copy thread is done with them.
"""
