"""KV tier 2: a store shared by engines (a real redis-server). A prefix one engine computed is
served to another process from the store, equal to its own recompute; a store that dies or
holds a bad block costs a recompute, never a wrong token or an error; tenants never share."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.engine import LLM, SamplingParams
from tests.support.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _prompt(base: int, n: int) -> list[int]:
    return [base + (i * 13) % 5000 for i in range(n)]


@pytest.fixture
def store() -> Iterator[RedisServer]:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        client.config_set("maxmemory", "64mb")  # as the chart runs it: its own cap, LRU
        client.config_set("maxmemory-policy", "allkeys-lru")
        client.close()
        yield server


def _llm(model: Path, url: str) -> LLM:
    return LLM(str(model), num_blocks=160, block_size=BS, max_num_seqs=2, kv_store_url=url,
               kv_store_timeout_s=0.3)


def _settle(llm: LLM) -> None:
    """Waits for the copies and the store's writes, then empties the pool's cache (so a prefix
    can only come from the store)."""
    engine = llm.engine
    deadline = time.monotonic() + 10
    remote = engine.tiers.remote
    while (engine.tiers.busy or remote.pending_writes) and time.monotonic() < deadline:
        engine.scheduler._admit_loaded(engine.tiers.poll(timeout=0.02))
    assert engine.block_manager.reset_prefix_cache()


def _run(llm: LLM, prompt: list[int], salt: str | None = None):
    out = llm.generate([prompt], GREEDY, use_tqdm=False, cache_salt=salt)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


_OTHER_ENGINE = """
import json, sys
from services.engine import LLM, SamplingParams
model, url, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
shared = LLM(model, num_blocks=160, block_size=16, max_num_seqs=2, kv_store_url=url)
out = shared.generate([prompt], p, use_tqdm=False)[0]
stats = shared.engine.stats().kv_tiers
# Its own recompute: under another salt nothing is cached anywhere (same weights, same KV).
own = shared.generate([prompt], p, use_tqdm=False, cache_salt="recompute")[0]
print(json.dumps({"tokens": out.outputs[0].token_ids, "cached": out.num_cached_tokens,
                  "shared_hits": stats.shared_hit_tokens, "own": own.outputs[0].token_ids}))
"""


def test_another_engine_process_serves_a_long_prefix_from_the_store(
        fast_model_dir: Path, store: RedisServer) -> None:
    prompt = _prompt(1000, 2000)
    llm = _llm(fast_model_dir, store.url)
    try:
        computed, cached = _run(llm, prompt)
        assert cached == 0
        _settle(llm)
        keys = redis.Redis.from_url(store.url).keys("pagoda:kvs:*")
        assert len(keys) == 2000 // BS + 1  # every full block, and the seed
    finally:
        llm.shutdown()
    proc = subprocess.run([sys.executable, "-c", _OTHER_ENGINE, str(fast_model_dir), store.url,
                           json.dumps(prompt)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO), "PAGODA_CPU_OPS": "0",
                                            "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    last_full = (len(prompt) - 1) // BS * BS
    assert got["cached"] == last_full and got["shared_hits"] == last_full
    assert got["tokens"] == got["own"] == computed


def test_a_store_killed_mid_load_costs_a_recompute_and_is_used_again_when_back(
        fast_model_dir: Path, store: RedisServer) -> None:
    prompt = _prompt(2000, 5 * BS + 3)
    llm = _llm(fast_model_dir, store.url)
    try:
        computed, _ = _run(llm, prompt)
        _settle(llm)
        # The store stalls (every client paused), so the load's MGET waits on it; then it is
        # killed under that load.
        redis.Redis.from_url(store.url).client_pause(3000, all=True)
        threading.Timer(0.1, store.stop).start()
        start = time.monotonic()
        down, cached = _run(llm, prompt)
        assert down == computed and cached == 0
        assert time.monotonic() - start < 2.0  # a timeout's wait, not the stall's
        stats = llm.engine.stats().kv_tiers
        assert stats.store.errors >= 1 and not stats.store_available
        _settle(llm)
        time.sleep(0.2)
        store.start()  # back (empty), on the same port, with no engine restart
        time.sleep(2.2)  # the client leaves a failed store alone for 2 s
        _run(llm, prompt)  # written again
        _settle(llm)
        again, cached = _run(llm, prompt)
        assert again == computed and cached == 5 * BS
        assert llm.engine.stats().kv_tiers.store_available
    finally:
        llm.shutdown()


def test_a_corrupted_block_is_recomputed_never_used(
        fast_model_dir: Path, store: RedisServer) -> None:
    prompt = _prompt(3000, 6 * BS + 1)
    llm = _llm(fast_model_dir, store.url)
    try:
        computed, _ = _run(llm, prompt)
        _settle(llm)
        client = redis.Redis.from_url(store.url)
        key = llm.engine.tiers.remote.key(llm.engine.hasher().chain(prompt)[3])
        value = bytearray(client.get(key))
        value[-5] ^= 0xFF  # one byte of the fourth block's KV
        client.set(key, bytes(value))
        got, cached = _run(llm, prompt)
        assert got == computed and cached == 3 * BS  # the three blocks before it only
        assert llm.engine.stats().kv_tiers.store.corrupt == 1
    finally:
        llm.shutdown()


def test_two_tenants_never_share_a_block_through_the_store(
        fast_model_dir: Path, store: RedisServer) -> None:
    prompt = _prompt(4000, 4 * BS + 2)
    llm = _llm(fast_model_dir, store.url)
    try:
        computed, _ = _run(llm, prompt, salt="tenant-a")
        _settle(llm)
        other, cached = _run(llm, prompt, salt="tenant-b")
        assert cached == 0 and other == computed  # same weights, its own KV
        _settle(llm)
        again, cached = _run(llm, prompt, salt="tenant-a")
        assert cached == 4 * BS and again == computed
    finally:
        llm.shutdown()
