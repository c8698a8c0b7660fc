"""Paged KV block manager with automatic prefix caching (pure Python, no torch).

The engine owns ``num_blocks`` physical KV blocks of ``block_size`` token slots. Each request
holds a block table (a list of blocks, in token order); a block may be shared by several
requests (``ref_cnt`` counts them). Once a block is full and computed it is cached under its
chain hash (``services.protocol.block_hash``), so a later prompt with the same prefix reuses it.

Life of a block::

    free ──allocate──▶ held ──cache_full_blocks──▶ held, cached ──free──▶ free, cached
     ▲ ▲                 │                            ▲                      │   │
     │ └────── free ─────┘                            └──── hit (attach) ────┘   │
     └──────────── popped by allocate_slots: evicted, "removed" event ───────────┘

Eviction is lazy: a freed cached block keeps its hash (and can be hit) until its slot is
needed. The free queue is the eviction order: uncached blocks at the front (reused first),
cached ones at the back in the order they were freed (LRU).

How the scheduler drives it: to admit a request, ``get_computed_blocks`` and then at once
``allocate_slots`` with the hit blocks (nothing else may allocate in between, or a hit block
could be evicted first); each step, ``allocate_slots`` for the tokens to compute, the model
runs, then ``cache_full_blocks``; ``free`` when the request finishes or is preempted.

Sliding-window models (Mistral, Gemma): a request keeps every block until it ends, including
blocks wholly outside every layer's window. Freeing them would save memory on long contexts but
break the prefix cache's chains (a later prompt could hit a block whose predecessors are gone)
and Gemma's global layers read them anyway; the attention only skips reading them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.engine.kv_blocks import FreeBlockQueue, KVBlock
from services.protocol.block_hash import BlockHash
from services.protocol.kv_events import KVEvent, KVEventKind

__all__ = ["BlockManager", "FreeBlockQueue", "KVBlock"]


@dataclass(slots=True)
class _RequestBlocks:
    blocks: list[KVBlock] = field(default_factory=list)
    # The same blocks' ids, kept alongside: the block table is read every step.
    block_ids: list[int] = field(default_factory=list)
    # Leading blocks that cache_full_blocks has already dealt with (cached, or left uncached
    # because another block holds their hash), so each call only looks at new full blocks.
    num_visited: int = 0

    def extend(self, blocks: list[KVBlock]) -> None:
        self.blocks += blocks
        self.block_ids += [block.block_id for block in blocks]  # in place: readers hold it


class BlockManager:
    """Allocates KV blocks to requests and keeps the prefix cache (hash -> block)."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, *,
        record_events: bool = False,
    ) -> None:
        _check_int("num_blocks", num_blocks, minimum=1)
        _check_int("block_size", block_size, minimum=1)
        if not isinstance(enable_caching, bool):
            # A string such as "false" would be truthy: refuse it rather than guess.
            raise ValueError(  # noqa: TRY004 - bad configuration is a ValueError here
                f"enable_caching must be a bool, got {enable_caching!r}"
            )
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self._free = FreeBlockQueue(self._blocks)
        # Invariant: block.block_hash is not None  <=>  self._cached[block.block_hash] is block.
        self._cached: dict[BlockHash, KVBlock] = {}
        self._requests: dict[str, _RequestBlocks] = {}
        # Each request's block ids (its entry's own list, which grows in place), by request id:
        # the scheduler reads it for every running request every step, a dict lookup.
        self.block_tables: dict[str, list[int]] = {}
        # KV events only for a consumer that drains them (the engine server's Redis
        # publisher): recorded and never taken, they would grow without bound.
        self.record_events = record_events
        self._events: list[KVEvent] = []
        # Token counters behind vllm:prefix_cache_queries / vllm:prefix_cache_hits.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # KV connectors that save: blocks cached since the last take_new_cached, to write
        # out; tracked only when a connector drains them.
        self.track_cached = False
        self._new_cached: list[tuple[KVBlock, BlockHash, tuple[int, ...]]] = []

    # ----------------------------------------------------------------------------- queries

    @property
    def num_total_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached or not (a cached free block is reclaimable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, held or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (vllm:kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / len(self._blocks)

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's physical block ids, in token order (a copy)."""
        return self._entry(request_id).block_ids.copy()

    def block_ids(self, request_id: str) -> list[int]:
        """The request's physical block ids, in token order: the manager's own list, which
        only grows while the request holds blocks. Read it, never change it."""
        return self.block_tables[request_id]

    def take_events(self) -> list[KVEvent]:
        """Returns and forgets the KV events since the last call, oldest first (none unless
        ``record_events``)."""
        events, self._events = self._events, []
        return events

    def snapshot_events(self) -> list[KVEvent]:
        """The whole prefix cache as events: "cleared", then every cached hash "stored". For
        re-announcing the cache to an index that lost it (Redis restarted, or this engine
        restarted under the same id and its old entries are stale). Does not touch the
        pending events: queue these after them."""
        bs = self.block_size
        events = [KVEvent(KVEventKind.CLEARED, (), bs)]
        if self._cached:
            events.append(KVEvent(KVEventKind.STORED, tuple(self._cached), bs))
        return events

    # ------------------------------------------------------------------------ prefix cache

    def get_computed_blocks(
        self, token_ids: Sequence[int], block_hashes: Sequence[BlockHash]
    ) -> tuple[list[KVBlock], int]:
        """The longest run of leading blocks of the prompt already in the cache, and the number
        of tokens they cover. Takes no references: pass them to ``allocate_slots`` at once.

        The hit never covers the whole prompt: the last token is always computed, to get its
        logits. So a prompt of exactly k full blocks hits at most k - 1 of them.
        """
        if not self.enable_caching:
            return [], 0
        self._check_hashes(token_ids, block_hashes)
        bs = self.block_size
        max_blocks = min(len(block_hashes), max(len(token_ids) - 1, 0) // bs)
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = self._lookup(block_hashes[i], token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admitted lookup in the stats (a lookup whose allocation failed and is
        retried next step must not be counted twice)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_query_tokens
            self.prefix_cache_hits += num_hit_tokens

    def cache_full_blocks(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        num_computed_tokens: int,
    ) -> None:
        """Caches every block of the request that ``num_computed_tokens`` now fully covers and
        that has a hash in ``block_hashes``, emitting "stored" events. Idempotent.

        A block whose hash another block already holds (two requests computed the same prefix
        at once) stays uncached; the existing mapping is kept.
        """
        if not self.enable_caching:
            return
        entry = self._entry(request_id)
        self._check_hashes(token_ids, block_hashes)
        _check_int("num_computed_tokens", num_computed_tokens, minimum=0)
        if num_computed_tokens > min(len(token_ids), len(entry.blocks) * self.block_size):
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} exceeds the request's "
                f"{len(token_ids)} tokens or its {len(entry.blocks)} blocks"
            )
        end = min(num_computed_tokens // self.block_size, len(block_hashes))
        if end > entry.num_visited:
            self._check_known_hashes(entry.blocks, block_hashes, entry.num_visited, end)
            self._cache_new(entry, token_ids, block_hashes, end)

    def cache_computed_blocks(
        self, request_id: str, token_ids: Sequence[int], block_hashes: Sequence[BlockHash],
        num_computed_tokens: int,
    ) -> None:
        """``cache_full_blocks`` for the scheduler's own step bookkeeping, whose arguments are
        the request's live state (its tokens, their chain, a count within its blocks): asserted,
        not validated, as it runs for every block a step fills."""
        if not self.enable_caching:
            return
        entry = self._requests[request_id]
        end = min(num_computed_tokens // self.block_size, len(block_hashes))
        assert end <= len(entry.blocks), (request_id, num_computed_tokens)
        if end > entry.num_visited:
            self._cache_new(entry, token_ids, block_hashes, end)

    def _cache_new(self, entry: _RequestBlocks, token_ids: Sequence[int],
                   block_hashes: Sequence[BlockHash], end: int) -> None:
        """Caches the request's blocks from ``entry.num_visited`` up to ``end``."""
        start = entry.num_visited
        bs = self.block_size
        run: list[int] = []  # consecutive block indices stored by this call: one event
        for i in range(start, end):
            if self._store(entry.blocks[i], block_hashes[i], token_ids[i * bs : (i + 1) * bs]):
                run.append(i)
            else:
                self._emit_stored(run, token_ids, block_hashes)
                run = []
        if run:
            self._emit_stored(run, token_ids, block_hashes)
        entry.num_visited = end

    def reset_prefix_cache(self) -> bool:
        """Drops every cached hash (one "removed" event) and returns True, or, while any block
        is held by a request, changes nothing and returns False.

        Refusing while requests run (as vLLM does) means that a True return leaves the cache
        truly empty, and live requests never hold blocks that silently lost their hash.
        The prefix_cache_* counters are cumulative and are not reset.
        """
        if len(self._free) < len(self._blocks):
            return False
        if self._cached:
            hashes = tuple(self._cached)
            for block in self._cached.values():
                block.block_hash = None
                block.token_ids = ()
            self._cached.clear()
            if self.record_events:
                self._events.append(self._removed_event(hashes))
        return True

    # -------------------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
    ) -> bool:
        """Grows the request's block table to hold ``num_tokens`` tokens in all, first attaching
        ``new_computed_blocks`` (from ``get_computed_blocks``; only for a request that holds no
        blocks yet). Returns False, changing nothing, when there are not enough free blocks.
        """
        entry = self._requests.get(request_id)
        if entry is not None and not new_computed_blocks:  # a running request grows
            num_new = -(-num_tokens // self.block_size) - len(entry.blocks)
            if num_new <= 0:
                return True  # most decode steps: the last block still has room
            if num_new > len(self._free):
                return False
            entry.extend(self._pop_fresh(num_new))
            return True
        held = 0 if entry is None else len(entry.blocks)
        assert num_tokens >= 0, num_tokens  # the scheduler's arithmetic, never a client's
        computed = list(new_computed_blocks)
        if computed:
            self._check_computed(entry, computed)
        num_held = len(computed) + held
        num_new = max(-(-num_tokens // self.block_size) - num_held, 0)
        # Computed blocks that nobody holds sit in the free queue; attaching them takes them
        # out of it, so they compete with the new blocks for the same free slots.
        num_from_queue = num_new + sum(1 for block in computed if block.ref_cnt == 0)
        if num_from_queue > len(self._free):
            return False
        if entry is None:
            entry = self._requests[request_id] = _RequestBlocks()
            self.block_tables[request_id] = entry.block_ids
        for block in computed:
            self._take_ref(block)
        entry.extend(computed)
        entry.extend(self._pop_fresh(num_new))
        return True

    def trim(self, request_id: str, num_tokens: int) -> int | None:
        """Gives back the request's last blocks past those that hold ``num_tokens`` tokens
        (a verified step: blocks that held only rejected tokens); returns how many blocks
        it keeps, or None when it gave none back. Such blocks were never full of computed
        tokens, so never cached: they go to the front of the queue, to be reused first."""
        entry = self._requests.get(request_id)
        keep = -(-num_tokens // self.block_size)
        if entry is None or len(entry.blocks) <= keep:
            return None
        while len(entry.blocks) > keep:
            block = entry.blocks.pop()
            entry.block_ids.pop()  # in place: the scheduler's step records hold this list
            assert block.block_hash is None and block.ref_cnt == 1, block.block_id
            block.ref_cnt = 0
            self._free.appendleft(block)
        entry.num_visited = min(entry.num_visited, keep)
        return keep

    def take_new_cached(self) -> list[tuple[KVBlock, BlockHash, tuple[int, ...]]]:
        """(block, hash, tokens) of each block cached since the last call (``track_cached``)."""
        cached, self._new_cached = self._new_cached, []
        return cached

    def hold(self, block_ids: list[int]) -> None:
        """An extra reference on each block, for a copy that reads it (a KV connector): while it
        holds, neither a finish, an abort nor a preemption lets the block be reused."""
        for block_id in block_ids:
            self._take_ref(self._blocks[block_id])

    def hold_cached(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Holds (as ``hold``) the leading run of ``block_hashes`` the cache has, and returns
        its block ids: a KV connector reads them for a peer. The chain hash covers the tokens
        (and the salt and adapter), so a run of hits is that prefix's KV."""
        ids = []
        for block_hash in block_hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            ids.append(block.block_id)
        self.hold(ids)
        return ids

    def release(self, block_ids: list[int]) -> None:
        """Ends ``hold``; a block nobody else holds goes back to the queue as ``free`` would."""
        for block_id in block_ids:
            self._drop_ref(self._blocks[block_id])

    def free(self, request_id: str) -> None:
        """Releases the request's blocks; unknown requests are ignored.

        Tail first: a request's last blocks are the least likely to be shared by another
        prompt, so they enter the queue (and are evicted) before its first ones.
        """
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        del self.block_tables[request_id]
        for block in reversed(entry.blocks):
            self._drop_ref(block)

    # ----------------------------------------------------------------------------- helpers

    def _entry(self, request_id: str) -> _RequestBlocks:
        entry = self._requests.get(request_id)
        if entry is None:
            raise ValueError(f"unknown request {request_id!r}: it holds no blocks")
        return entry

    def _lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def _take_ref(self, block: KVBlock) -> None:
        if block.ref_cnt == 0:
            self._free.remove(block)  # a cached block taken back from the queue: O(1)
        block.ref_cnt += 1

    def _drop_ref(self, block: KVBlock) -> None:
        block.ref_cnt -= 1
        assert block.ref_cnt >= 0, block.block_id
        if block.ref_cnt > 0:
            return
        if block.block_hash is None:
            self._free.appendleft(block)  # nothing worth keeping: reuse it first
        else:
            self._free.append(block)  # still a possible hit: evict it last (LRU)

    def _pop_fresh(self, count: int) -> list[KVBlock]:
        """Takes ``count`` blocks from the queue head, evicting the cached ones among them."""
        blocks: list[KVBlock] = []
        evicted: list[BlockHash] = []
        for _ in range(count):
            block = self._free.popleft()
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self._cached[block.block_hash]
                block.block_hash = None
                block.token_ids = ()
            block.ref_cnt = 1
            blocks.append(block)
        if evicted and self.record_events:
            self._events.append(self._removed_event(tuple(evicted)))
        return blocks

    def _store(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Caches ``block`` (holding ``token_ids``) under ``block_hash``; False if it is
        already cached or another block holds that hash."""
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        if self.track_cached:
            self._new_cached.append((block, block_hash, block.token_ids))
        return True

    def _emit_stored(
        self, run: list[int], token_ids: Sequence[int], block_hashes: Sequence[BlockHash]
    ) -> None:
        if not run or not self.record_events:
            return
        first, last = run[0], run[-1]
        bs = self.block_size
        event = KVEvent(
            kind=KVEventKind.STORED,
            block_hashes=tuple(block_hashes[first : last + 1]),
            block_size=bs,
            parent_hash=block_hashes[first - 1] if first > 0 else None,
            token_ids=tuple(token_ids[first * bs : (last + 1) * bs]),
        )
        self._events.append(event)

    def _removed_event(self, hashes: tuple[BlockHash, ...]) -> KVEvent:
        return KVEvent(kind=KVEventKind.REMOVED, block_hashes=hashes, block_size=self.block_size)

    def _check_hashes(self, token_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        num_full = len(token_ids) // self.block_size
        if len(block_hashes) > num_full:
            raise ValueError(
                f"{len(block_hashes)} block hashes for {len(token_ids)} tokens: only the "
                f"{num_full} full blocks of {self.block_size} tokens have a hash"
            )

    def _check_known_hashes(
        self, blocks: list[KVBlock], block_hashes: Sequence[BlockHash], start: int, end: int
    ) -> None:
        # A block that is already cached (attached from a hit) must be the one the caller's
        # chain names; anything else means the caller's hashes belong to another prompt.
        for i in range(start, end):
            known = blocks[i].block_hash
            if known is not None and known != block_hashes[i]:
                raise ValueError(
                    f"block {i} of the request is cached under another hash than the one given"
                )

    def _check_computed(self, entry: _RequestBlocks | None, computed: list[KVBlock]) -> None:
        if entry is not None and entry.blocks:
            raise ValueError("new_computed_blocks can only be attached before a request's blocks")
        if len({id(block) for block in computed}) != len(computed):
            raise ValueError("new_computed_blocks holds the same block twice")
        for block in computed:
            ours = 0 <= block.block_id < len(self._blocks) and self._blocks[block.block_id] is block
            if not ours:
                raise ValueError(f"block {block.block_id} does not belong to this BlockManager")
            if block.block_hash is None or self._cached.get(block.block_hash) is not block:
                raise ValueError(
                    f"block {block.block_id} is no longer cached: call allocate_slots right "
                    "after get_computed_blocks, before anything else allocates"
                )


def _check_int(name: str, value: object, *, minimum: int) -> None:
    # bool is an int subclass, but True blocks is surely a mistake.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
