"""BlockManager: allocation, prefix caching, eviction order, KV events, and a state machine."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections import Counter
from dataclasses import FrozenInstanceError, dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.engine.block_manager import BlockManager
from services.engine.kv_blocks import FreeBlockQueue, KVBlock
from services.protocol.block_hash import BlockHash, BlockHasher
from services.protocol.kv_events import KVEvent, KVEventKind

BS = 4
HASHER = BlockHasher("test-model", BS)


def chain(tokens: list[int]) -> list[BlockHash]:
    return HASHER.chain(tokens)


def admit(mgr: BlockManager, rid: str, tokens: list[int]) -> int:
    """What the scheduler does to admit a prompt: look up the cache, allocate. Returns hit."""
    computed, num_hit = mgr.get_computed_blocks(tokens, chain(tokens))
    assert mgr.allocate_slots(rid, len(tokens), computed)
    mgr.record_prefix_lookup(len(tokens), num_hit)
    return num_hit


def prefill(mgr: BlockManager, rid: str, tokens: list[int]) -> int:
    """Admits and computes the whole prompt, caching its full blocks. Returns the hit."""
    num_hit = admit(mgr, rid, tokens)
    mgr.cache_full_blocks(rid, tokens, chain(tokens), len(tokens))
    return num_hit


def free_ids(mgr: BlockManager) -> list[int]:
    return [block.block_id for block in mgr._free]


def fake_hash(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(16, "little"))


# ------------------------------------------------------------------------ construction


@pytest.mark.parametrize(
    ("num_blocks", "block_size"), [(0, 4), (-1, 4), (4, 0), (4, -2), (2.0, 4), (4, "4"), (True, 4)]
)
def test_bad_sizes_raise(num_blocks: object, block_size: object) -> None:
    with pytest.raises(ValueError, match="num_blocks|block_size"):
        BlockManager(num_blocks, block_size)  # type: ignore[arg-type]


def test_bad_enable_caching_raises() -> None:
    with pytest.raises(ValueError, match="enable_caching"):
        BlockManager(4, 4, enable_caching="yes")  # type: ignore[arg-type]


def test_initial_state() -> None:
    mgr = BlockManager(8, BS, record_events=True)
    assert (mgr.num_total_blocks, mgr.num_free_blocks, mgr.num_cached_blocks) == (8, 8, 0)
    assert mgr.usage == 0.0
    assert mgr.take_events() == []
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (0, 0)


def test_module_does_not_import_torch() -> None:
    code = "import sys, services.engine.block_manager; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# -------------------------------------------------------------------------- allocation


def test_allocate_rounds_up_to_blocks_and_grows() -> None:
    mgr = BlockManager(8, BS)
    assert mgr.allocate_slots("a", 9)
    assert mgr.get_block_table("a") == [0, 1, 2]
    assert mgr.allocate_slots("a", 12)  # still fits in three blocks
    assert mgr.get_block_table("a") == [0, 1, 2]
    assert mgr.allocate_slots("a", 13)
    assert mgr.get_block_table("a") == [0, 1, 2, 3]
    assert mgr.allocate_slots("a", 5)  # a table never shrinks
    assert len(mgr.get_block_table("a")) == 4
    assert mgr.num_free_blocks == 4
    assert mgr.usage == pytest.approx(0.5)


def test_block_table_is_a_copy() -> None:
    mgr = BlockManager(8, BS)
    assert mgr.allocate_slots("a", 5)
    table = mgr.get_block_table("a")
    table.append(7)
    assert mgr.get_block_table("a") == [0, 1]
    assert mgr.allocate_slots("a", 9)
    assert table == [0, 1, 7] and mgr.get_block_table("a") == [0, 1, 2]


def test_allocate_zero_tokens_registers_an_empty_table() -> None:
    mgr = BlockManager(2, BS)
    assert mgr.allocate_slots("a", 0)
    assert mgr.get_block_table("a") == []


@pytest.mark.parametrize("num_tokens", [-1, 1.5, None])
def test_allocate_bad_num_tokens_raises(num_tokens: object) -> None:
    # The scheduler's arithmetic, never a client's input: an engine bug fails loudly.
    with pytest.raises((AssertionError, TypeError)):
        BlockManager(2, BS).allocate_slots("a", num_tokens)  # type: ignore[arg-type]


def test_allocate_without_room_changes_nothing() -> None:
    mgr = BlockManager(4, BS, record_events=True)
    prefill(mgr, "a", list(range(12)))
    mgr.take_events()
    assert not mgr.allocate_slots("b", 8)  # needs 2 blocks, 1 free
    assert not mgr.allocate_slots("a", 20)  # a grows by 2 blocks: same
    assert mgr.get_block_table("a") == [0, 1, 2]
    assert mgr.num_free_blocks == 1
    assert mgr.take_events() == []
    with pytest.raises(ValueError, match="unknown request"):
        mgr.get_block_table("b")


def test_get_block_table_unknown_request_raises() -> None:
    with pytest.raises(ValueError, match="unknown request 'x'"):
        BlockManager(2, BS).get_block_table("x")


# ------------------------------------------------------------------------ prefix hits


def test_hit_never_covers_the_last_token() -> None:
    mgr = BlockManager(16, BS)
    prompt = list(range(12))  # exactly three full blocks
    prefill(mgr, "a", prompt)
    # The same prompt again: the last token must be computed for logits, so at most k - 1.
    blocks, num_hit = mgr.get_computed_blocks(prompt, chain(prompt))
    assert (len(blocks), num_hit) == (2, 8)
    # One token more than the cached blocks: all three blocks hit, the extra token is computed.
    longer = prompt + [99]
    blocks, num_hit = mgr.get_computed_blocks(longer, chain(longer))
    assert (len(blocks), num_hit) == (3, 12)
    assert [b.block_id for b in blocks] == mgr.get_block_table("a")[:3]
    # A one-block prompt can never hit.
    assert mgr.get_computed_blocks(prompt[:4], chain(prompt[:4])) == ([], 0)


def test_hit_stops_at_first_miss() -> None:
    mgr = BlockManager(16, BS)
    prefill(mgr, "a", list(range(13)))
    other = list(range(4)) + [50, 51, 52, 53] + list(range(8, 13))
    blocks, num_hit = mgr.get_computed_blocks(other, chain(other))
    assert num_hit == 4 and len(blocks) == 1


def test_hit_stats_count_tokens() -> None:
    mgr = BlockManager(16, BS)
    prefill(mgr, "a", list(range(9)))  # miss: 9 queried, 0 hit
    prefill(mgr, "b", list(range(10)))  # 8 hit of 10
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (19, 8)


def test_get_computed_blocks_takes_no_reference() -> None:
    mgr = BlockManager(8, BS)
    prefill(mgr, "a", list(range(9)))
    mgr.free("a")
    free_before = mgr.num_free_blocks
    blocks, _ = mgr.get_computed_blocks(list(range(9)), chain(list(range(9))))
    assert all(b.ref_cnt == 0 for b in blocks)
    assert mgr.num_free_blocks == free_before


def test_hash_collision_with_different_tokens_is_not_a_hit() -> None:
    mgr = BlockManager(8, BS)
    colliding = [fake_hash(1), fake_hash(2)]
    first = list(range(9))
    assert mgr.allocate_slots("a", len(first))
    mgr.cache_full_blocks("a", first, colliding, len(first))
    second = list(range(100, 109))  # different tokens, same (forged) hashes
    assert mgr.get_computed_blocks(second, colliding) == ([], 0)
    blocks, num_hit = mgr.get_computed_blocks(first, colliding)
    assert num_hit == 8 and len(blocks) == 2


def test_too_many_hashes_raise() -> None:
    mgr = BlockManager(8, BS)
    tokens = list(range(7))  # one full block
    with pytest.raises(ValueError, match="only the 1 full blocks"):
        mgr.get_computed_blocks(tokens, chain(list(range(8))))


def test_shared_prefix_between_live_requests_shares_blocks() -> None:
    mgr = BlockManager(16, BS)
    prefill(mgr, "a", list(range(10)))
    assert prefill(mgr, "b", list(range(8)) + [77, 78, 79]) == 8
    table_a, table_b = mgr.get_block_table("a"), mgr.get_block_table("b")
    assert table_b[:2] == table_a[:2]
    assert table_b[2] != table_a[2]
    assert [mgr._blocks[i].ref_cnt for i in table_a[:2]] == [2, 2]
    assert mgr.num_free_blocks == 16 - 4
    mgr.free("a")  # b still holds the shared blocks: they are not free
    assert [mgr._blocks[i].ref_cnt for i in table_a[:2]] == [1, 1]
    assert mgr.num_free_blocks == 16 - 3  # b: two shared blocks and its own third
    mgr.free("b")
    assert mgr.num_free_blocks == 16


def test_hit_on_free_cached_block_takes_it_out_of_the_middle_of_the_queue() -> None:
    mgr = BlockManager(6, BS)
    prefill(mgr, "a", list(range(9)))  # blocks 0 1 2; 0 and 1 cached
    mgr.free("a")
    assert free_ids(mgr) == [2, 3, 4, 5, 1, 0]
    assert admit(mgr, "b", list(range(5))) == 4  # hits block 0 only
    assert free_ids(mgr)[:2] == [3, 4]
    assert 0 not in free_ids(mgr) and 1 in free_ids(mgr)
    assert mgr.get_block_table("b")[0] == 0


def test_allocation_counts_free_computed_blocks_as_consumed() -> None:
    mgr = BlockManager(4, BS, record_events=True)
    prefill(mgr, "a", list(range(9)))  # caches blocks 0 and 1
    mgr.free("a")
    mgr.take_events()
    long = list(range(17))  # 5 blocks: 2 hit (both free, in the queue) + 3 new = 5 > 4
    computed, num_hit = mgr.get_computed_blocks(long, chain(long))
    assert num_hit == 8
    assert not mgr.allocate_slots("b", len(long), computed)
    assert all(b.ref_cnt == 0 and b.is_free for b in computed)
    assert mgr.num_free_blocks == 4 and mgr.num_cached_blocks == 2
    assert mgr.take_events() == []
    fits = list(range(16))  # 4 blocks: 2 hit + 2 new
    computed, _ = mgr.get_computed_blocks(fits, chain(fits))
    assert mgr.allocate_slots("b", len(fits), computed)
    assert mgr.num_free_blocks == 0


def test_computed_blocks_only_for_a_request_without_blocks() -> None:
    mgr = BlockManager(8, BS)
    prefill(mgr, "a", list(range(9)))
    computed, _ = mgr.get_computed_blocks(list(range(9)), chain(list(range(9))))
    assert mgr.allocate_slots("b", 4)
    with pytest.raises(ValueError, match="before a request's blocks"):
        mgr.allocate_slots("b", 9, computed)
    with pytest.raises(ValueError, match="same block twice"):
        mgr.allocate_slots("c", 9, [computed[0], computed[0]])
    with pytest.raises(ValueError, match="does not belong"):
        mgr.allocate_slots("c", 9, [KVBlock(block_id=0)])


def test_computed_block_evicted_before_allocate_raises() -> None:
    mgr = BlockManager(3, BS)
    prefill(mgr, "a", list(range(9)))
    mgr.free("a")
    computed, _ = mgr.get_computed_blocks(list(range(9)), chain(list(range(9))))
    assert mgr.allocate_slots("other", 12)  # takes every block: the hit blocks are evicted
    with pytest.raises(ValueError, match="no longer cached"):
        mgr.allocate_slots("b", 9, computed)


# ------------------------------------------------------------------- freeing & eviction


def test_free_unknown_request_is_a_noop() -> None:
    mgr = BlockManager(4, BS)
    mgr.free("ghost")
    assert mgr.allocate_slots("a", 4)
    mgr.free("a")
    mgr.free("a")  # twice: still a no-op
    assert mgr.num_free_blocks == 4


def test_uncached_blocks_go_to_the_front_cached_to_the_back() -> None:
    mgr = BlockManager(6, BS)
    prefill(mgr, "a", list(range(10)))  # blocks 0, 1 cached; 2 partial
    mgr.free("a")
    # Uncached block 2 is reused first; cached 1 and 0 wait at the back, tail first.
    assert free_ids(mgr) == [2, 3, 4, 5, 1, 0]
    assert mgr.allocate_slots("b", 1)
    assert mgr.get_block_table("b") == [2]


def test_free_is_tail_first_so_tails_are_evicted_first() -> None:
    mgr = BlockManager(3, BS, record_events=True)
    prompt = list(range(13))  # three full blocks (+1 token, so all three get cached)
    assert mgr.allocate_slots("a", 12)
    mgr.cache_full_blocks("a", prompt, chain(prompt), 12)
    hashes = chain(prompt)
    mgr.free("a")
    mgr.take_events()
    assert free_ids(mgr) == [2, 1, 0]
    assert mgr.allocate_slots("b", 1)
    assert mgr.get_block_table("b") == [2]
    assert mgr.take_events() == [
        KVEvent(kind=KVEventKind.REMOVED, block_hashes=(hashes[2],), block_size=BS)
    ]
    # The head of the prompt is still cached and still hits.
    assert mgr.get_computed_blocks(prompt, hashes)[1] == 8


def test_eviction_is_lru_across_requests() -> None:
    mgr = BlockManager(4, BS, record_events=True)
    a, b = [1] * 8, [2] * 8
    prefill(mgr, "a", a)
    prefill(mgr, "b", b)
    mgr.free("a")  # a's blocks are older in the queue
    mgr.free("b")
    mgr.take_events()
    assert mgr.allocate_slots("c", 8)
    (event,) = mgr.take_events()
    assert event.kind is KVEventKind.REMOVED
    assert set(event.block_hashes) == set(chain(a))
    assert mgr.get_computed_blocks(b + [0], chain(b + [0]))[1] == 8


def test_a_hit_refreshes_recency() -> None:
    mgr = BlockManager(4, BS, record_events=True)
    a, b = [1] * 4, [2] * 4
    prefill(mgr, "a", a)
    prefill(mgr, "b", b)
    mgr.free("a")
    mgr.free("b")
    assert admit(mgr, "a2", a + [9]) == 4  # a's block is used again, so now newer than b's
    mgr.free("a2")
    mgr.take_events()
    assert mgr.allocate_slots("c", 4 * 3)  # 2 uncached + 1 evicted
    (event,) = mgr.take_events()
    assert event.block_hashes == tuple(chain(b))


def test_eviction_is_lazy() -> None:
    mgr = BlockManager(4, BS, record_events=True)
    prompt = list(range(9))
    prefill(mgr, "a", prompt)
    mgr.take_events()
    mgr.free("a")
    # Freed, yet still cached: no removed event, still counted as free, and still a hit.
    assert mgr.take_events() == []
    assert mgr.num_cached_blocks == 2 and mgr.num_free_blocks == 4
    assert admit(mgr, "b", prompt) == 8
    mgr.free("b")
    # Only pressure evicts: four fresh blocks need every slot, so both hashes go.
    assert mgr.allocate_slots("c", 16)
    events = mgr.take_events()
    assert [e.kind for e in events] == [KVEventKind.REMOVED]
    assert set(events[0].block_hashes) == set(chain(prompt))
    assert mgr.num_cached_blocks == 0


# ------------------------------------------------------------------------ cache_full_blocks


def test_stored_event_batches_consecutive_blocks() -> None:
    mgr = BlockManager(8, BS, record_events=True)
    prompt = list(range(10))
    hashes = chain(prompt)
    prefill(mgr, "a", prompt)
    assert mgr.take_events() == [
        KVEvent(
            kind=KVEventKind.STORED,
            block_hashes=tuple(hashes),
            block_size=BS,
            parent_hash=None,
            token_ids=tuple(range(8)),
        )
    ]
    mgr.cache_full_blocks("a", prompt, hashes, len(prompt))  # idempotent
    assert mgr.take_events() == []
    assert mgr.num_cached_blocks == 2


def test_chunked_caching_chains_parent_hashes() -> None:
    mgr = BlockManager(8, BS, record_events=True)
    prompt = list(range(14))
    hashes = chain(prompt)
    assert mgr.allocate_slots("a", len(prompt))
    mgr.cache_full_blocks("a", prompt, hashes, 6)  # block 0 full, block 1 half computed
    mgr.cache_full_blocks("a", prompt, hashes, 14)
    first, second = mgr.take_events()
    assert (first.block_hashes, first.parent_hash) == ((hashes[0],), None)
    assert (second.block_hashes, second.parent_hash) == ((hashes[1], hashes[2]), hashes[0])
    assert second.token_ids == tuple(range(4, 12))


def test_blocks_without_a_given_hash_are_not_cached() -> None:
    mgr = BlockManager(8, BS)
    tokens = list(range(12))
    assert mgr.allocate_slots("a", 12)
    mgr.cache_full_blocks("a", tokens, chain(tokens)[:1], 12)
    assert mgr.num_cached_blocks == 1
    mgr.cache_full_blocks("a", tokens, chain(tokens), 12)  # the rest once hashes arrive
    assert mgr.num_cached_blocks == 3


def test_decode_blocks_are_cached_as_they_fill() -> None:
    mgr = BlockManager(8, BS)
    tokens = [5, 6, 7]
    hashes: list[BlockHash] = []
    admit(mgr, "a", tokens)
    for new_token in range(100, 106):  # one generated token per step
        mgr.cache_full_blocks("a", tokens, HASHER.extend(hashes, tokens), len(tokens))
        tokens = tokens + [new_token]
        assert mgr.allocate_slots("a", len(tokens))
    assert mgr.num_cached_blocks == 2
    follow_up = tokens[:8] + [1]
    assert mgr.get_computed_blocks(follow_up, chain(follow_up))[1] == 8


def test_duplicate_hash_keeps_existing_block() -> None:
    mgr = BlockManager(8, BS, record_events=True)
    prompt = list(range(9))
    admit(mgr, "a", prompt)
    admit(mgr, "b", prompt)  # admitted before a was computed: no hit, separate blocks
    mgr.cache_full_blocks("a", prompt, chain(prompt), 9)
    mgr.take_events()
    mgr.cache_full_blocks("b", prompt, chain(prompt), 9)
    assert mgr.take_events() == []
    assert mgr.num_cached_blocks == 2
    table_a, table_b = mgr.get_block_table("a"), mgr.get_block_table("b")
    assert all(mgr._blocks[i].block_hash is None for i in table_b)
    hits, _ = mgr.get_computed_blocks(prompt, chain(prompt))
    assert [b.block_id for b in hits] == table_a[:2]
    mgr.free("b")  # b's uncached duplicates go to the front, reused first
    assert free_ids(mgr)[:3] == table_b


def test_cache_full_blocks_validates_input() -> None:
    mgr = BlockManager(4, BS)
    tokens = list(range(8))
    with pytest.raises(ValueError, match="unknown request"):
        mgr.cache_full_blocks("a", tokens, chain(tokens), 8)
    assert mgr.allocate_slots("a", 4)
    with pytest.raises(ValueError, match="exceeds"):
        mgr.cache_full_blocks("a", tokens, chain(tokens), 8)  # only one block allocated
    with pytest.raises(ValueError, match="exceeds"):
        mgr.cache_full_blocks("a", tokens[:3], [], 4)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        mgr.cache_full_blocks("a", tokens, chain(tokens), -1)
    with pytest.raises(ValueError, match="full blocks"):
        mgr.cache_full_blocks("a", tokens[:4], chain(tokens), 4)


def test_cache_full_blocks_rejects_a_foreign_chain() -> None:
    mgr = BlockManager(8, BS)
    prompt = list(range(9))
    prefill(mgr, "a", prompt)
    admit(mgr, "b", prompt)
    with pytest.raises(ValueError, match="another hash"):
        mgr.cache_full_blocks("b", prompt, [fake_hash(1), fake_hash(2)], 9)


# -------------------------------------------------------------------- reset & disabled


def test_reset_prefix_cache() -> None:
    mgr = BlockManager(8, BS, record_events=True)
    prompt = list(range(9))
    prefill(mgr, "a", prompt)
    mgr.take_events()
    assert not mgr.reset_prefix_cache()  # a still holds blocks
    assert mgr.num_cached_blocks == 2
    mgr.free("a")
    assert mgr.reset_prefix_cache()
    (event,) = mgr.take_events()
    assert event.kind is KVEventKind.REMOVED and set(event.block_hashes) == set(chain(prompt))
    assert mgr.num_cached_blocks == 0 and mgr.num_free_blocks == 8
    assert mgr.get_computed_blocks(prompt, chain(prompt)) == ([], 0)
    assert mgr.reset_prefix_cache()  # nothing cached: still True, no event
    assert mgr.take_events() == []


def test_events_are_recorded_only_when_asked() -> None:
    """Nobody drains an offline engine's events: by default none are kept, though the cache
    works as ever (and a snapshot still describes it, for a consumer that asks)."""
    mgr = BlockManager(4, BS)
    prompt = list(range(9))
    prefill(mgr, "a", prompt)
    mgr.free("a")
    assert mgr.allocate_slots("b", 16)  # evicts both cached blocks
    mgr.free("b")
    prefill(mgr, "c", prompt)
    mgr.free("c")
    assert mgr.reset_prefix_cache()
    prefill(mgr, "d", prompt)
    assert mgr._events == [] and mgr.take_events() == []
    assert mgr.num_cached_blocks == 2 and admit(mgr, "e", prompt) == 8
    assert mgr.snapshot_events() == [
        KVEvent(KVEventKind.CLEARED, (), BS), KVEvent(KVEventKind.STORED, tuple(chain(prompt)), BS)
    ]


def test_caching_disabled() -> None:
    mgr = BlockManager(4, BS, enable_caching=False, record_events=True)
    prompt = list(range(9))
    assert admit(mgr, "a", prompt) == 0
    mgr.cache_full_blocks("a", prompt, chain(prompt), 9)
    mgr.free("a")
    assert mgr.num_cached_blocks == 0
    assert admit(mgr, "b", prompt) == 0
    assert mgr.take_events() == []
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (0, 0)
    assert free_ids(mgr) == [3]


# ------------------------------------------------------------------- queue & event types


def test_free_block_queue_operations() -> None:
    blocks = [KVBlock(block_id=i) for i in range(5)]
    queue = FreeBlockQueue(blocks[:3])
    queue.append(blocks[3])
    queue.appendleft(blocks[4])
    assert [b.block_id for b in queue] == [4, 0, 1, 2, 3]
    queue.remove(blocks[1])  # middle
    queue.remove(blocks[3])  # tail
    assert [b.block_id for b in queue] == [4, 0, 2] and len(queue) == 3
    assert queue.popleft() is blocks[4]
    assert not blocks[4].is_free and blocks[4].next_free is None
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[0])
    queue.popleft()
    queue.popleft()
    assert len(queue) == 0 and list(queue) == []
    with pytest.raises(IndexError):
        queue.popleft()


def test_kv_event_is_frozen_and_kind_is_a_str() -> None:
    event = KVEvent(kind=KVEventKind.REMOVED, block_hashes=(), block_size=BS)
    with pytest.raises(FrozenInstanceError):
        event.block_size = 8  # type: ignore[misc]
    assert KVEventKind("stored") is KVEventKind.STORED and KVEventKind.STORED == "stored"


# ------------------------------------------------------------------------ state machine


# A three-token vocabulary, so that random prompts share prefixes.
PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=10)


@dataclass(slots=True)
class _Request:
    tokens: list[int]
    num_computed: int
    hashes: list[BlockHash] = field(default_factory=list)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit / compute / append / free / pressure / reset sequences. A tiny vocabulary
    makes prompts share prefixes, so hits, sharing, duplicates and evictions all happen.

    Besides the structural invariants, a shadow KV cache records which token each physical slot
    holds: a hit or a shared block must always hold exactly the tokens of the prompt using it.
    """

    ENABLE_CACHING = True

    def __init__(self) -> None:
        super().__init__()
        self.reqs: dict[str, _Request] = {}
        self.replayed: set[BlockHash] = set()  # the cache as the router sees it, from events
        self.prompts: list[list[int]] = []  # every prompt so far, live or not
        self.next_id = 0

    @initialize(
        num_blocks=st.integers(3, 16),
        block_size=st.integers(1, 3),
        first_prompts=st.lists(PROMPTS, max_size=3),
    )
    def setup(self, num_blocks: int, block_size: int, first_prompts: list[list[int]]) -> None:
        self.bs = block_size
        self.hasher = BlockHasher("m", block_size)
        self.mgr = BlockManager(num_blocks, block_size, enable_caching=self.ENABLE_CACHING,
                                record_events=True)
        self.kv: dict[int, list[int | None]] = {i: [None] * block_size for i in range(num_blocks)}
        # Hypothesis may switch add_request off for a whole run (swarm testing): start with a
        # few requests anyway.
        for tokens in first_prompts:
            self._admit(tokens)

    # -- helpers

    def _pick(self, index: int) -> tuple[str, _Request]:
        rid = sorted(self.reqs)[index % len(self.reqs)]
        return rid, self.reqs[rid]

    def _snapshot(self) -> tuple[object, ...]:
        mgr = self.mgr
        blocks = [(b.ref_cnt, b.block_hash, b.token_ids) for b in mgr._blocks]
        tables = {rid: mgr.get_block_table(rid) for rid in self.reqs}
        return (free_ids(mgr), blocks, tables, dict(mgr._cached), len(mgr._events))

    def _slot_token(self, table: list[int], pos: int) -> int | None:
        return self.kv[table[pos // self.bs]][pos % self.bs]

    # -- rules

    @rule(tokens=PROMPTS)
    def add_request(self, tokens: list[int]) -> None:
        self._admit(tokens)

    @precondition(lambda self: self.prompts)
    @rule(
        index=st.integers(0, 99),
        keep=st.integers(0, 10),
        suffix=st.lists(st.integers(0, 2), min_size=1, max_size=4),
    )
    def add_request_sharing_a_prefix(self, index: int, keep: int, suffix: list[int]) -> None:
        # A prompt that starts like an earlier one (live, freed or evicted): hits are common.
        earlier = self.prompts[index % len(self.prompts)]
        self._admit(earlier[:keep] + suffix)

    def _admit(self, tokens: list[int]) -> None:
        self.prompts.append(tokens)
        rid = f"r{self.next_id}"
        self.next_id += 1
        hashes = self.hasher.chain(tokens)
        before = self._snapshot()
        computed, num_hit = self.mgr.get_computed_blocks(tokens, hashes)
        assert num_hit == len(computed) * self.bs < len(tokens)
        max_blocks = (len(tokens) - 1) // self.bs
        if self.ENABLE_CACHING and len(computed) < max_blocks:
            assert hashes[len(computed)] not in self.replayed  # the hit is the longest
        for i, block in enumerate(computed):
            span = self.kv[block.block_id]
            assert span == tokens[i * self.bs : (i + 1) * self.bs]  # never serves wrong KV
        if self.mgr.allocate_slots(rid, len(tokens), computed):
            self.reqs[rid] = _Request(tokens, num_hit, hashes)
        else:
            assert self._snapshot() == before

    @precondition(lambda self: self.reqs)
    @rule(index=st.integers(0, 99), steps=st.integers(1, 8))
    def compute(self, index: int, steps: int) -> None:
        rid, req = self._pick(index)
        table = self.mgr.get_block_table(rid)
        end = min(len(req.tokens), req.num_computed + steps)
        for pos in range(req.num_computed, end):  # the model writes KV for the new tokens
            block_id = table[pos // self.bs]
            assert self.mgr._blocks[block_id].ref_cnt == 1, "wrote into a shared block"
            self.kv[block_id][pos % self.bs] = req.tokens[pos]
        req.num_computed = end
        self.mgr.cache_full_blocks(rid, req.tokens, req.hashes, end)

    @precondition(lambda self: self.reqs)
    @rule(index=st.integers(0, 99), new=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def append_tokens(self, index: int, new: list[int]) -> None:
        rid, req = self._pick(index)
        before = self._snapshot()
        tokens = req.tokens + new
        if self.mgr.allocate_slots(rid, len(tokens)):
            req.tokens = tokens
            self.hasher.extend(req.hashes, tokens)
        else:
            assert self._snapshot() == before

    @precondition(lambda self: self.reqs)
    @rule(index=st.integers(0, 99))
    def free(self, index: int) -> None:
        rid, _ = self._pick(index)
        table = [self.mgr._blocks[i] for i in self.mgr.get_block_table(rid)]
        released = [block for block in table if block.ref_cnt == 1]
        self.mgr.free(rid)
        del self.reqs[rid]
        # Released uncached blocks now head the queue (in table order, as the tail went in
        # first); released cached ones end it, tail first, so the tail is evicted first.
        queue = free_ids(self.mgr)
        uncached = [b.block_id for b in released if b.block_hash is None]
        cached = [b.block_id for b in reversed(released) if b.block_hash is not None]
        assert queue[: len(uncached)] == uncached
        assert queue[len(queue) - len(cached) :] == cached

    @rule()
    def free_unknown(self) -> None:
        before = self._snapshot()
        self.mgr.free("never-admitted")
        assert self._snapshot() == before

    @rule()
    def pressure(self) -> None:
        # A throwaway request takes every free block: every unheld cached block is evicted.
        num_free = self.mgr.num_free_blocks
        assert self.mgr.allocate_slots("pressure", num_free * self.bs)
        assert self.mgr.num_free_blocks == 0
        assert not self.mgr.allocate_slots("pressure", (num_free + 1) * self.bs)
        assert all(b.ref_cnt > 0 for b in self.mgr._cached.values())
        self.mgr.free("pressure")

    @rule()
    def reset(self) -> None:
        assert self.mgr.reset_prefix_cache() == (not self.reqs)
        if not self.reqs:
            assert self.mgr.num_cached_blocks == 0

    # -- invariants

    @invariant()
    def events_replay_to_the_cache(self) -> None:
        for event in self.mgr.take_events():
            assert event.block_size == self.bs
            if event.kind is KVEventKind.REMOVED:
                assert set(event.block_hashes) <= self.replayed
                self.replayed -= set(event.block_hashes)
                continue
            assert self.replayed.isdisjoint(event.block_hashes)
            assert len(event.token_ids) == len(event.block_hashes) * self.bs
            parent = event.parent_hash or self.hasher.seed
            for i, block_hash in enumerate(event.block_hashes):
                span = event.token_ids[i * self.bs : (i + 1) * self.bs]
                assert self.hasher.hash_block(parent, span) == block_hash
                parent = block_hash
            self.replayed |= set(event.block_hashes)
        assert self.replayed == set(self.mgr._cached)

    @invariant()
    def blocks_are_owned_once_and_counted(self) -> None:
        mgr = self.mgr
        owners: Counter[int] = Counter()
        for rid, req in self.reqs.items():
            table = mgr.get_block_table(rid)
            assert len(set(table)) == len(table)
            assert len(table) == -(-len(req.tokens) // self.bs)
            owners.update(table)
        assert all(b.ref_cnt == owners[b.block_id] for b in mgr._blocks)
        num_used = sum(1 for b in mgr._blocks if b.ref_cnt > 0)
        assert mgr.num_free_blocks + num_used == mgr.num_total_blocks
        assert mgr.usage == pytest.approx(num_used / mgr.num_total_blocks)

    @invariant()
    def free_queue_is_consistent(self) -> None:
        mgr = self.mgr
        queued = list(mgr._free)
        assert len(queued) == len(mgr._free) == mgr.num_free_blocks
        assert {b.block_id for b in queued} == {b.block_id for b in mgr._blocks if b.ref_cnt == 0}
        for prev, nxt in itertools.pairwise(queued):
            assert prev.next_free is nxt and nxt.prev_free is prev
        for block in mgr._blocks:
            assert block.is_free == (block.ref_cnt == 0)
            assert (block.prev_free is None) == (block.next_free is None)
        # Uncached free blocks always come before cached ones: they are reused first.
        kinds = [block.block_hash is not None for block in queued]
        assert kinds == sorted(kinds)

    @invariant()
    def hash_map_matches_blocks(self) -> None:
        mgr = self.mgr
        for block_hash, block in mgr._cached.items():
            assert block.block_hash == block_hash
            assert list(block.token_ids) == self.kv[block.block_id]  # cached KV is what it says
        for block in mgr._blocks:
            if block.block_hash is None:
                assert block.token_ids == ()
            else:
                assert mgr._cached[block.block_hash] is block
        assert mgr.num_cached_blocks == len(mgr._cached)
        if not self.ENABLE_CACHING:
            assert not mgr._cached and mgr.prefix_cache_hits == 0

    @invariant()
    def computed_tokens_are_in_the_request_blocks(self) -> None:
        for rid, req in self.reqs.items():
            table = self.mgr.get_block_table(rid)
            for pos in range(req.num_computed):
                assert self._slot_token(table, pos) == req.tokens[pos]


class BlockManagerNoCachingMachine(BlockManagerMachine):
    ENABLE_CACHING = False


_MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerStateMachine = BlockManagerMachine.TestCase
TestBlockManagerStateMachine.settings = _MACHINE_SETTINGS
TestBlockManagerNoCachingStateMachine = BlockManagerNoCachingMachine.TestCase
TestBlockManagerNoCachingStateMachine.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None
)
