"""Disaggregated prefill/decode through the shared KV store (PagodaStorePDConnector): two
in-process engines and a real redis-server. The decode engine's greedy output equals one
engine's while it computes only the prompt's tail (a partial last block, an exact one, two
tenants, a LoRA adapter); a block deleted or damaged in the store between the legs, or the
store down, costs a recompute from there, never an error or a wrong token; params from a
client reach only the keys of its own prompt and tenant; both ends count the transfer."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from services.engine import LLM, SamplingParams
from services.engine.engine import LLMEngine
from services.engine.kv_connector.config import KVTransferConfig
from services.engine.kv_offload.secret import SECRET_ENV
from services.protocol.kv_events import KVEventKind, Medium
from tests.engine.test_kv_pd import _prompt, _run
from tests.support.redis_server import RedisServer

BS = 16
SECRET = "pd-store-test-mac-key-0123456789"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
NO_TRANSFER = {"do_remote_prefill": False, "do_remote_decode": False}


def _llm(model: Path, url: str, role: str, step_tokens: int | None = None,
         **extra: Any) -> LLM:
    return LLM(str(model), num_blocks=160, block_size=BS, max_num_seqs=16, enable_lora=True,
               max_loras=1, max_num_batched_tokens=step_tokens, kv_transfer_config={
        "kv_connector": "PagodaStorePDConnector", "kv_role": role,
        "kv_connector_extra_config": {"kv_store_url": url, "kv_store_timeout_s": 0.5,
                                      **extra}})


@pytest.fixture(scope="module")
def store() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def engines(fast_model_dir: Path, store: RedisServer) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SECRET_ENV, SECRET)
        # Prompts are prefilled in chunks of two blocks: their blocks go out chunk by chunk.
        prefill = _llm(fast_model_dir, store.url, "kv_producer", step_tokens=2 * BS)
        decode = _llm(fast_model_dir, store.url, "kv_consumer")
        yield prefill.engine, decode.engine
        prefill.shutdown()
        decode.shutdown()


def _prefill(prefill: LLMEngine, rid: str, prompt: list[int], salt: str | None = None,
             lora: str | None = None) -> dict:
    _, req, _ = _run(prefill, rid, prompt, PREFILL, {"do_remote_decode": True}, salt, lora)
    bm = prefill.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks  # nothing held: the store has them
    return dict(req.kv_transfer_params)


def _alone(decode: LLMEngine, rid: str, prompt: list[int], salt: str | None = None,
           lora: str | None = None) -> list[int]:
    """What one engine computes by itself; its pool's cache emptied after."""
    tokens, _, _ = _run(decode, rid, prompt, GREEDY, None, salt, lora)
    assert decode.block_manager.reset_prefix_cache()
    return tokens


def _failures(engine: LLMEngine) -> dict[str, int]:
    return engine.stats().kv_transfer.failures  # what /metrics reads


@pytest.mark.parametrize("n", [3 * BS + 5, 4 * BS])
def test_decode_after_a_store_transfer_matches_one_engine(
        engines: tuple[LLMEngine, LLMEngine], n: int) -> None:
    prefill, decode = engines
    prompt = _prompt(n, n)
    alone = _alone(decode, f"alone{n}", prompt)
    sent, received = prefill.stats().kv_transfer.sent, decode.stats().kv_transfer.received
    params = _prefill(prefill, f"pd{n}", prompt)
    blocks = (n - 1) // BS  # never the last token's block
    assert params == {"do_remote_prefill": True, "do_remote_decode": False,
                      "kv_transport": "store", "remote_engine_id": params["remote_engine_id"],
                      "remote_request_id": f"pd{n}", "remote_num_blocks": blocks,
                      "kv_layout": decode.kv_connector.layout}
    tokens, req, steps = _run(decode, f"pd{n}", prompt, GREEDY, params)
    assert tokens == alone
    assert req.num_cached_tokens == blocks * BS and steps[0] == n - blocks * BS
    size = blocks * decode.kv_connector.block_bytes
    after_sent, after_received = prefill.stats().kv_transfer.sent, \
        decode.stats().kv_transfer.received
    assert (after_sent.bytes - sent.bytes, after_sent.transfers - sent.transfers) == (size, 1)
    assert (after_received.bytes - received.bytes,
            after_received.transfers - received.transfers) == (size, 1)
    assert decode.block_manager.reset_prefix_cache()


def test_a_prompts_blocks_are_written_while_it_is_computed(
        engines: tuple[LLMEngine, LLMEngine], store: RedisServer) -> None:
    prefill, decode = engines
    prompt = _prompt(61, 5 * BS + 3)  # three chunks on the prefill engine
    alone = _alone(decode, "chunks-ref", prompt)
    req = prefill.add_request("chunks", prompt, PREFILL,
                              kv_transfer_params={"do_remote_decode": True})
    prefill.step()  # the first chunk
    assert prefill.has_unfinished_requests()
    client, remote = redis.Redis.from_url(store.url), prefill.kv_connector.remote
    deadline = time.monotonic() + 5
    while client.exists(*(remote.key(h) for h in req.block_hashes[:2])) < 2:
        assert time.monotonic() < deadline, "the first chunk's blocks were not written"
        time.sleep(0.01)
    client.close()
    while prefill.has_unfinished_requests():
        prefill.step()
    assert req.kv_transfer_params["remote_num_blocks"] == 5
    tokens, d_req, _ = _run(decode, "chunks", prompt, GREEDY, dict(req.kv_transfer_params))
    assert tokens == alone and d_req.num_cached_tokens == 5 * BS
    assert decode.block_manager.reset_prefix_cache()


def test_the_engines_pair_by_the_store_transports_layout(
        engines: tuple[LLMEngine, LLMEngine]) -> None:
    from services.engine.serving.engine_info import EngineInfo

    prefill, decode = engines
    p, d = EngineInfo.of(prefill), EngineInfo.of(decode)
    assert (p.kv_role, d.kv_role) == ("prefill", "decode")
    assert p.kv_layout == d.kv_layout == decode.kv_connector.layout  # the heartbeat's
    assert p.kv_layout.startswith("store-") and p.kv_transfer_address is None


def test_two_tenants_never_share(engines: tuple[LLMEngine, LLMEngine]) -> None:
    """Tenant b replaying tenant a's params with the same prompt loads nothing: the decode
    engine reads the keys of b's own chain (b's salt), which only b's prefill leg writes."""
    prefill, decode = engines
    prompt = _prompt(7, 3 * BS + 2)
    alone = _alone(decode, "tenants-ref", prompt, "tenant-a")
    a_params = _prefill(prefill, "ta", prompt, "tenant-a")
    a, a_req, _ = _run(decode, "ta", prompt, GREEDY, a_params, "tenant-a")
    assert a == alone and a_req.num_cached_tokens == 3 * BS
    assert decode.block_manager.reset_prefix_cache()
    before = _failures(decode).get("missing", 0)
    b, b_req, _ = _run(decode, "tb", prompt, GREEDY, a_params, "tenant-b")
    assert b == alone and b_req.num_cached_tokens == 0
    assert _failures(decode).get("missing", 0) == before + 1
    assert decode.block_manager.reset_prefix_cache()
    b_params = _prefill(prefill, "tb2", prompt, "tenant-b")  # b's own leg: b's own keys
    b, b_req, _ = _run(decode, "tb2", prompt, GREEDY, b_params, "tenant-b")
    assert b == alone and b_req.num_cached_tokens == 3 * BS
    assert decode.block_manager.reset_prefix_cache()


def test_a_lora_adapter(engines: tuple[LLMEngine, LLMEngine], fast_model_dir: Path,
                       tmp_path: Path) -> None:
    """The adapter is in the chain: P/D under it equals one engine under it; the base model
    with the adapter's params reads the base chain's keys, which nobody wrote."""
    from services.engine.lora.manager import STATIC
    from tests.support.lora import write_adapter

    prefill, decode = engines
    adapter = write_adapter(fast_model_dir, tmp_path / "sql", seed=3, r=4)
    for engine in engines:
        engine.lora.load("sql", str(adapter), STATIC)
    prompt = _prompt(71, 3 * BS + 5)
    alone = _alone(decode, "lora-ref", prompt, lora="sql")
    base = _alone(decode, "lora-base", prompt)
    assert alone != base  # the adapter changes the output
    params = _prefill(prefill, "lora-pd", prompt, lora="sql")
    tokens, req, _ = _run(decode, "lora-pd", prompt, GREEDY, params, lora="sql")
    assert tokens == alone and req.num_cached_tokens == 3 * BS
    assert decode.block_manager.reset_prefix_cache()
    tokens, req, _ = _run(decode, "lora-cross", prompt, GREEDY, params)
    assert tokens == base and req.num_cached_tokens == 0
    assert decode.block_manager.reset_prefix_cache()


def test_a_block_deleted_or_damaged_in_the_store_is_recomputed_from_there(
        engines: tuple[LLMEngine, LLMEngine], store: RedisServer) -> None:
    prefill, decode = engines
    prompt = _prompt(11, 4 * BS + 3)
    alone = _alone(decode, "gone-ref", prompt)
    client = redis.Redis.from_url(store.url)
    remote = prefill.kv_connector.remote
    for rid, damage, cached, reason in (
            ("deleted", lambda key: client.delete(key), 2 * BS, "missing"),
            ("damaged", lambda key: client.setrange(key, 100, b"\xff\x00"), 2 * BS, "checksum")):
        _, p_req, _ = _run(prefill, rid, prompt, PREFILL, {"do_remote_decode": True})
        assert p_req.kv_transfer_params["remote_num_blocks"] == 4
        assert damage(remote.key(p_req.block_hashes[2]))  # between the legs
        before = _failures(decode).get(reason, 0)
        tokens, req, steps = _run(decode, rid, prompt, GREEDY, dict(p_req.kv_transfer_params))
        assert tokens == alone, rid
        assert req.num_cached_tokens == cached and steps[0] == len(prompt) - cached, rid
        assert _failures(decode).get(reason, 0) == before + 1, rid
        assert decode.block_manager.reset_prefix_cache()
    client.close()


def test_params_from_a_client_are_bounded_by_its_own_prompt(
        engines: tuple[LLMEngine, LLMEngine]) -> None:
    """A count past the prompt loads only the prompt's blocks (its own chain's keys, less the
    last token's); malformed params or another layout's are a recompute; the TCP transport
    leaves the store's params alone."""
    from services.common.internal_auth import InternalCredential
    from services.engine.kv_connector.pd import Remote

    prefill, decode = engines
    prompt = _prompt(31, 3 * BS + 3)
    alone = _alone(decode, "bounds-ref", prompt)
    params = _prefill(prefill, "bounds", prompt)
    assert Remote.parse(params, params["kv_layout"], InternalCredential(("x" * 32,))) is None
    for rid, edit, cached, reason in (
            ("huge", {"remote_num_blocks": 10**9}, 3 * BS, None),
            ("fewer", {"remote_num_blocks": 1}, BS, None),
            ("text", {"remote_num_blocks": "3"}, 0, "protocol"),
            ("bool", {"remote_num_blocks": True}, 0, "protocol"),
            ("layout", {"kv_layout": "store-another"}, 0, "layout")):
        before = dict(_failures(decode))
        tokens, req, _ = _run(decode, rid, prompt, GREEDY, {**params, **edit})
        assert tokens == alone and req.num_cached_tokens == cached, rid
        after = _failures(decode)
        if reason is not None:
            assert after.get(reason, 0) == before.get(reason, 0) + 1, rid
        else:
            assert after == before, rid
        assert decode.block_manager.reset_prefix_cache()


def test_an_aborted_prefill_leg_names_no_transfer(engines: tuple[LLMEngine, LLMEngine]) -> None:
    """Aborted before it ran, or after its first chunk was written: no params to pull, no
    transfer counted, its blocks freed."""
    prefill, _ = engines
    sent = prefill.stats().kv_transfer.sent.transfers
    for rid, steps in (("abort-waiting", 0), ("abort-running", 1)):
        prefill.add_request(rid, _prompt(41, 5 * BS), PREFILL,
                            kv_transfer_params={"do_remote_decode": True})
        for _ in range(steps):
            prefill.step()
        update = prefill.abort_request(rid)
        assert update is not None and update.kv_transfer_params == NO_TRANSFER, rid
    assert prefill.stats().kv_transfer.sent.transfers == sent
    assert not prefill.kv_connector._producing
    bm = prefill.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_the_store_down_costs_a_recompute(engines: tuple[LLMEngine, LLMEngine],
                                          store: RedisServer) -> None:
    """The producer's write fails: the prefill leg still answers, naming no transfer; valid
    params with the store down at the decode engine: a recompute."""
    prefill, decode = engines
    prompt = _prompt(51, 3 * BS + 7)
    alone = _alone(decode, "down-ref", prompt)
    params = _prefill(prefill, "down-ok", prompt)  # written while the store was up
    store.stop()
    try:
        before_p, before_d = _failures(prefill), _failures(decode)
        started = time.monotonic()
        _, p_req, _ = _run(prefill, "down", prompt, PREFILL, {"do_remote_decode": True})
        assert time.monotonic() - started < 10
        assert p_req.kv_transfer_params == NO_TRANSFER
        assert _failures(prefill).get("connection", 0) == before_p.get("connection", 0) + 1
        for rid, kv in (("down", NO_TRANSFER), ("down-ok", params)):
            tokens, req, _ = _run(decode, rid, prompt, GREEDY, kv)
            assert tokens == alone and req.num_cached_tokens == 0, rid
            assert decode.block_manager.reset_prefix_cache()
        assert _failures(decode).get("connection", 0) == before_d.get("connection", 0) + 1
    finally:
        store.start()
    deadline = time.monotonic() + 10  # used again once it answers (after its retry interval)
    while not (prefill.kv_connector.remote.available and decode.kv_connector.remote.available):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    params = _prefill(prefill, "back", prompt)
    tokens, req, _ = _run(decode, "back", prompt, GREEDY, params)
    assert tokens == alone and req.num_cached_tokens == 3 * BS
    assert decode.block_manager.reset_prefix_cache()


def test_a_decode_engine_with_the_tiers_on_the_same_store(
        engines: tuple[LLMEngine, LLMEngine], fast_model_dir: Path, store: RedisServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiers and the transport under one MultiConnector (the tiers first): the tiers load
    the prompt's blocks the prefill leg wrote (the same keys), the output is the same."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    prefill, decode = engines
    prompt = _prompt(81, 3 * BS + 9)
    alone = _alone(decode, "tiers-ref", prompt)
    llm = LLM(str(fast_model_dir), num_blocks=160, block_size=BS, kv_store_url=store.url,
              kv_transfer_config={"kv_connector": "PagodaStorePDConnector",
                                  "kv_role": "kv_consumer"})
    try:
        both = llm.engine
        assert [type(c).__name__ for c in both.kv_connector.connectors] == [
            "KVTiers", "PagodaStorePDConnector"]
        params = _prefill(prefill, "tiers", prompt)
        tokens, req, _ = _run(both, "tiers", prompt, GREEDY, params)
        assert tokens == alone and req.num_cached_tokens == 3 * BS
        assert both.stats().kv_tiers.shared_hit_tokens == 3 * BS
    finally:
        llm.shutdown()


def test_the_connector_refuses_a_bad_configuration(fast_model_dir: Path, store: RedisServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    with pytest.raises(ValueError, match="extra_config.kv_store_urll is not a key"):
        _llm(fast_model_dir, store.url, "kv_producer", kv_store_urll="redis://x")
    with pytest.raises(ValueError, match="kv_store_url: PagodaStorePDConnector needs"):
        LLM(str(fast_model_dir), num_blocks=32, block_size=BS, kv_transfer_config={
            "kv_connector": "PagodaStorePDConnector", "kv_role": "kv_consumer"})
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ValueError, match="MAC key"):
        _llm(fast_model_dir, store.url, "kv_consumer")
    with pytest.raises(ValueError, match="one P/D transport per engine"):
        KVTransferConfig.parse({"kv_connector": "MultiConnector", "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "PagodaPDConnector"},
                           {"kv_connector": "PagodaStorePDConnector"}]}})


def test_the_blocks_a_leg_put_in_the_store_are_announced_as_shared(
        engines: tuple[LLMEngine, LLMEngine], store: RedisServer) -> None:
    """KV events (the engine's --kv-events-config and the Redis channel): the leading blocks
    the store acknowledged, as the tiers announce their writes, so routers count them
    reachable from every engine of the store; none when the store took nothing."""
    prefill, decode = engines
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SECRET_ENV, SECRET)
        announcing = LLMEngine(prefill.config, kv_events=True)
    try:
        prompt = _prompt(71, 4 * BS + 2)
        _, req, _ = _run(announcing, "announced", prompt, PREFILL, {"do_remote_decode": True})
        assert req.kv_transfer_params["remote_num_blocks"] == 4
        shared = [e for e in announcing.take_kv_events() if e.medium == Medium.SHARED]
        assert [(e.kind, e.block_hashes, e.block_size) for e in shared] == [
            (KVEventKind.STORED, tuple(req.block_hashes[:4]), BS)]
        # The store down: the leg names no transfer and announces nothing.
        announcing.kv_connector.remote.close()
        _, req, _ = _run(announcing, "unannounced", _prompt(72, 4 * BS + 2), PREFILL,
                         {"do_remote_decode": True})
        assert req.kv_transfer_params == NO_TRANSFER
        assert not [e for e in announcing.take_kv_events() if e.medium == Medium.SHARED]
    finally:
        announcing.close()
    assert not [e for e in prefill.take_kv_events()]  # events off: nothing recorded
