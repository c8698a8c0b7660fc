"""KV tier 2: a store shared by engines (a real redis-server). A prefix one engine computed is
served to another process from the store, equal to its own recompute; a store that dies or
holds a bad block costs a recompute, never a wrong token or an error; tenants never share;
a value written without the deployment's secret, or moved to another key, is a miss; two
weight versions under one model name never share; the write thread outlives a bad batch and
``close`` is bounded with a full queue."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.engine import LLM, SamplingParams
from services.engine.config import EngineConfig
from services.engine.kv_offload.block_value import BlockCodec
from services.engine.kv_offload.remote_store import RemoteKVStore, StoreLayout
from services.engine.kv_offload.secret import SECRET_ENV, load_store_secret
from services.engine.kv_offload.weights_digest import weights_digest
from services.protocol.block_hash import BlockHash
from tests.support.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SECRET = "test-kv-store-mac-key-0123456789"


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deployment's MAC key, as the chart gives it ($PAGODA_KV_STORE_SECRET)."""
    monkeypatch.setenv(SECRET_ENV, SECRET)


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


def _llm(model: Path, url: str, **kwargs) -> LLM:  # noqa: ANN003
    return LLM(str(model), num_blocks=160, block_size=BS, max_num_seqs=2, kv_store_url=url,
               kv_store_timeout_s=0.3, **kwargs)


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
                                            "PATH": "/usr/bin:/bin", SECRET_ENV: SECRET})
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


def test_a_value_written_without_the_secret_or_moved_to_another_key_is_never_used(
        fast_model_dir: Path, store: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = _prompt(5000, 4 * BS + 2)
    monkeypatch.setenv(SECRET_ENV, "another-deployment-secret-0123")
    foreign = _llm(fast_model_dir, store.url)
    try:
        computed, _ = _run(foreign, prompt)
        _settle(foreign)  # the store holds all four blocks, under another key's MAC
        hashes = foreign.engine.hasher().chain(prompt)
        values = redis.Redis.from_url(store.url).mget(
            [foreign.engine.tiers.remote.key(h) for h in hashes])
        assert None not in values
    finally:
        foreign.shutdown()
    monkeypatch.setenv(SECRET_ENV, SECRET)
    llm = _llm(fast_model_dir, store.url)
    try:
        got, cached = _run(llm, prompt)
        assert got == computed and cached == 0  # recomputed: the foreign block is a miss
        assert llm.engine.stats().kv_tiers.store.corrupt == 1  # the first one ends the run
        _settle(llm)  # now the store holds this deployment's values
        # A client of the store copies these values over the keys of tenant-b's chain (same
        # tokens, same KV): bound to its key, a moved value is a miss all the same.
        client = redis.Redis.from_url(store.url)
        remote = llm.engine.tiers.remote
        mine = client.mget([remote.key(h) for h in hashes])
        theirs = llm.engine.hasher("tenant-b").chain(prompt)
        client.mset({remote.key(h): v for h, v in zip(theirs, mine, strict=True)})
        moved, cached = _run(llm, prompt, salt="tenant-b")
        assert moved == computed and cached == 0
        assert llm.engine.stats().kv_tiers.store.corrupt == 2
        again, cached = _run(llm, prompt)  # and its own values serve it
        assert again == computed and cached == 4 * BS
    finally:
        llm.shutdown()


def test_two_weight_versions_under_one_name_never_share(
        fast_model_dir: Path, store: RedisServer, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    v2 = tmp_path / "v2"
    v2.mkdir()
    for f in fast_model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (v2 / f.name).write_bytes(f.read_bytes())
    for f in fast_model_dir.glob("*.safetensors"):  # a fine-tune: same names, shapes, sizes
        tensors = load_file(str(f))
        name = next(n for n in sorted(tensors) if "norm" in n)
        tensors[name] = tensors[name] * 1.01
        save_file(tensors, str(v2 / f.name), metadata={"format": "pt"})
    assert weights_digest(v2) != weights_digest(fast_model_dir)
    prompt = _prompt(6000, 3 * BS + 1)
    one = _llm(fast_model_dir, store.url, served_model_name="m")
    try:
        _run(one, prompt)
        _settle(one)
        prefix_one = one.engine.tiers.remote.prefix
    finally:
        one.shutdown()
    two = _llm(v2, store.url, served_model_name="m")
    try:
        _, cached = _run(two, prompt)
        assert cached == 0 and two.engine.tiers.remote.prefix != prefix_one
        assert two.engine.stats().kv_tiers.store.corrupt == 0  # not even read: another key
    finally:
        two.shutdown()


def test_the_secret_is_required_and_read_as_an_operator_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ValueError, match=r"--kv-store-secret-file PATH or \$PAGODA_KV_STORE"):
        EngineConfig(kv_store_url="redis://127.0.0.1:1/0")
    key = tmp_path / "key"
    key.write_text("short\n")
    with pytest.raises(ValueError, match="at least 16 bytes, got 5"):
        load_store_secret(str(key))
    key.write_text(SECRET + "\n")
    assert load_store_secret(str(key)) == SECRET.encode()  # the newline is not the key
    config = EngineConfig(kv_store_url="redis://127.0.0.1:1/0", kv_store_secret_file=str(key))
    assert config.kv_store_secret_file == str(key)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(ValueError, match="not a regular file"):
        load_store_secret(str(fifo))
    assert time.monotonic() - start < 1.0  # opened without blocking on a writer
    with pytest.raises(ValueError, match="larger than 4096"):
        (tmp_path / "big").write_bytes(b"x" * 5000)
        load_store_secret(str(tmp_path / "big"))
    with pytest.raises(ValueError, match="cannot open"):
        load_store_secret(str(tmp_path / "missing"))


def _bare_store(url: str, timeout_s: float) -> RemoteKVStore:
    layout = StoreLayout("m", "w", "torch.float32", BS, 1, 1, 8, 1, "xxh3_128")
    return RemoteKVStore(url, layout, b"seed", timeout_s, BlockCodec(SECRET.encode()))


def _hash(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def test_the_writer_outlives_a_bad_batch_and_close_is_bounded_with_a_full_queue(
        store: RedisServer) -> None:
    remote = _bare_store(store.url, timeout_s=5.0)
    remote.put("not a block hash", b"x")  # type: ignore[arg-type] -- a bug's batch: it raises
    deadline = time.monotonic() + 5
    while remote.pending_writes and time.monotonic() < deadline:
        time.sleep(0.01)
    remote.put(_hash(1), b"after")
    while remote.pending_writes and time.monotonic() < deadline:
        time.sleep(0.01)
    client = redis.Redis.from_url(store.url)
    assert client.get(remote.key(_hash(1))) == b"after"  # the thread lives on
    stats = remote.stats
    assert stats.writes == 1 and stats.dropped_writes == 1
    # The store stalls: the writer waits on it, and the queue fills up behind it.
    client.client_pause(4000, all=True)
    for i in range(2000):
        remote.put(_hash(10 + i), b"v")
    assert remote.pending_writes > 1000
    closed = threading.Event()
    threading.Thread(target=lambda: (remote.close(), closed.set()), daemon=True).start()
    assert closed.wait(4.0)  # the writer's 2 s, not the stall's, and never a full put()
    dropped = remote.stats.dropped_writes
    assert dropped >= 900, remote.stats  # past the queue's 1024: dropped, never waited for
    remote.put(_hash(1), b"late")
    assert remote.stats.dropped_writes == dropped + 1  # closed: dropped at once
