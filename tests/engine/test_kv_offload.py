"""KV tier 1 (host memory): a prefix the pool evicted comes back from the host store, with the
same output as computed, counted where it came from; copies never lose blocks under them, and
closing never frees the caches under a copy."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
import torch

from services.engine import LLM, SamplingParams
from services.engine.config import EngineConfig
from services.engine.kv_offload.block_value import BlockCodec
from services.engine.kv_offload.copier import KVCopier, LoadDone, LoadJob
from services.engine.kv_offload.remote_store import RemoteKVStore, StoreLayout
from services.protocol.block_hash import BlockHash
from tests.support.redis_server import RedisServer

BS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _prompt(base: int, n: int) -> list[int]:
    return [base + (i * 7) % 900 for i in range(n)]


@pytest.fixture(scope="module")
def offload_llm(fast_model_dir: Path):
    llm = LLM(str(fast_model_dir), num_blocks=24, block_size=BS, max_num_seqs=4,
              kv_offloading_size=0.01)
    yield llm
    llm.shutdown()


def test_a_prefix_evicted_from_the_pool_comes_back_from_host_memory(
        offload_llm: LLM, fast_model_dir: Path) -> None:
    llm, engine = offload_llm, offload_llm.engine
    a = _prompt(1000, 6 * BS + 5)  # six full blocks, and a tail
    first = llm.generate([a], GREEDY, use_tqdm=False)[0]
    for k in range(4):  # 4 x 7 blocks through a 24-block pool: A's blocks are evicted
        llm.generate([_prompt(3000 + 1000 * k, 6 * BS + 9)], GREEDY, use_tqdm=False)
    bm = engine.block_manager
    assert bm.get_computed_blocks(a, engine.hasher().chain(a))[1] == 0  # not in the pool
    before = engine.stats().kv_tiers
    again = llm.generate([a], GREEDY, use_tqdm=False)[0]
    after = engine.stats().kv_tiers
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == 6 * BS  # every full block of A, from the host tier
    assert after.host_hit_tokens - before.host_hit_tokens == 6 * BS
    assert after.external_hits - before.external_hits == 6 * BS
    assert after.external_queries - before.external_queries == len(a)
    assert after.external_kv_transfer - before.external_kv_transfer == 6 * BS
    assert after.local_compute - before.local_compute == len(a) - 6 * BS
    assert after.host_blocks > 0 and after.host_evictions == 0

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(fast_model_dir), dtype=torch.float32)
    ids = torch.tensor([a])
    ref = hf.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert again.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()


def test_the_last_prompt_token_is_computed_and_holds_end_with_the_copies(
        offload_llm: LLM) -> None:
    llm, engine = offload_llm, offload_llm.engine
    exact = _prompt(5000, 4 * BS)  # exactly four full blocks: at most three may be hits
    first = llm.generate([exact], GREEDY, use_tqdm=False)[0]
    for k in range(4):
        llm.generate([_prompt(6000 + 1000 * k, 6 * BS + 9)], GREEDY, use_tqdm=False)
    again = llm.generate([exact], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 3 * BS
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # Every hold a save took is released once the copies are done: the pool is whole again.
    tiers = engine.tiers
    while tiers.busy:
        engine.scheduler._admit_loaded(tiers.poll(timeout=0.05))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_an_abort_while_loading_frees_the_blocks_only_after_the_copy(
        offload_llm: LLM) -> None:
    llm, engine = offload_llm, offload_llm.engine
    a = _prompt(7000, 6 * BS + 3)
    llm.generate([a], GREEDY, use_tqdm=False)
    for k in range(4):
        llm.generate([_prompt(8000 + 1000 * k, 6 * BS + 9)], GREEDY, use_tqdm=False)
    engine.add_request("loading", a, GREEDY)
    sched = engine.scheduler
    engine._schedule()  # admits it, and hands its copy to the copy thread
    assert "loading" in sched.loading  # waits for its blocks, not in the step
    held = engine.block_manager.num_total_blocks - engine.block_manager.num_free_blocks
    assert held >= 6
    engine.abort_request("loading")
    # Until the copy reports, the blocks stay with it (the copy thread may still write them).
    while engine.tiers.busy:
        sched._admit_loaded(engine.tiers.poll(timeout=0.05))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert not sched.has_unfinished()


def test_bad_tier_configuration_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineConfig(kv_offloading_size=-1)
    with pytest.raises(ValueError, match="kv_offloading_backend"):
        EngineConfig(kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="kv_store_url"):
        EngineConfig(kv_store_url="http://store:6379")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(kv_offloading_size=1, tensor_parallel_size=2)


def test_more_host_memory_than_the_host_has_is_an_error_naming_the_flag(
        fast_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_offloading_size=100000 GiB exceeds"):
        LLM(str(fast_model_dir), num_blocks=24, kv_offloading_size=100000)


def test_async_scheduling_loads_from_host_memory_alike(fast_model_dir: Path) -> None:
    """With a step in flight while the next is scheduled, loads start only once no step in
    flight can write to their blocks; the output is the same."""
    llm = LLM(str(fast_model_dir), num_blocks=24, block_size=BS, max_num_seqs=4,
              kv_offloading_size=0.01, async_scheduling=True)
    try:
        a = _prompt(1500, 5 * BS + 7)
        others = [_prompt(2500 + 1000 * k, 6 * BS + 9) for k in range(4)]
        first = llm.generate([a], GREEDY, use_tqdm=False)[0]
        llm.generate(others, GREEDY, use_tqdm=False)  # together: steps overlap
        outs = llm.generate([a, *others[:2]], GREEDY, use_tqdm=False)
        assert outs[0].outputs[0].token_ids == first.outputs[0].token_ids
        assert outs[0].num_cached_tokens == 5 * BS
    finally:
        llm.shutdown()


def test_a_held_block_outlives_its_request_and_returns_to_the_queue_after() -> None:
    """The write-through's hold: a finished (or preempted, or aborted) request's block stays
    out of the free queue until the copy that reads it is done."""
    from services.engine.block_manager import BlockManager
    from services.protocol.block_hash import BlockHasher

    bm = BlockManager(4, BS)
    bm.track_cached = True
    tokens = list(range(2 * BS))
    hashes = BlockHasher("m", BS).chain(tokens)
    assert bm.allocate_slots("r", len(tokens))
    bm.cache_full_blocks("r", tokens, hashes, len(tokens))
    cached = bm.take_new_cached()
    assert [h for _, h, _ in cached] == hashes and bm.take_new_cached() == []
    ids = [block.block_id for block, _, _ in cached]
    bm.hold(ids)
    bm.free("r")
    assert bm.num_free_blocks == 2  # the two held ones are not reusable
    assert not bm.allocate_slots("other", 3 * BS)
    bm.release(ids)
    assert bm.num_free_blocks == 4
    assert bm.get_computed_blocks(tokens + [1], hashes)[1] == 2 * BS  # still cached


def test_close_waits_for_a_copy_in_flight_which_then_writes_nothing() -> None:
    """A load's store call outlasts the copier's old 5 s join (the store stalls): ``close``
    returns only once the thread is gone, and the copy, told to stop, leaves the caches (about
    to be freed) alone."""
    shape = (1, 2, BS, 1, 8)  # (layers, 2, block_size, kv_heads, head_dim)
    caches = [(torch.zeros(4, BS, 1, 8), torch.zeros(4, BS, 1, 8))]
    h, tokens = BlockHash(bytes(16)), tuple(range(BS))
    with RedisServer() as server:
        layout = StoreLayout("m", "w", "torch.float32", BS, 1, 1, 8, 1, "xxh3_128")
        remote = RemoteKVStore(server.url, layout, b"seed", 8.0,
                               BlockCodec(b"copier-test-secret-0123"))
        client = redis.Redis.from_url(server.url)
        payload = torch.ones(shape).numpy().tobytes()
        client.set(remote.key(h), remote.encode(h, tokens, payload))
        copier = KVCopier(caches, None, remote, shape)
        client.client_pause(5500, all=True)  # the load's MGET waits for the store
        copier.submit(LoadJob("r", [], [h], [tokens], [1]))
        time.sleep(0.3)
        copier.close()
        assert not copier._thread.is_alive()  # nothing of it can run after close
        done = copier.done.get_nowait()
        assert isinstance(done, LoadDone) and done.num_remote == 0
        assert not caches[0][0].any() and not caches[0][1].any()
        remote.close()
