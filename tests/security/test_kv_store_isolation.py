"""Tenant isolation through the shared KV store, end to end: with API keys, a prefix tenant A
left in the store (and lost from the engine's pool) serves A again from the store, and never
tenant B."""

from __future__ import annotations

import uuid
from pathlib import Path

from services.engine.kv_offload.secret import SECRET_ENV
from tests.security.conftest import (
    KEY_A,
    KEY_B,
    cached_tokens,
    complete,
    long_prompt,
    start_stack,
    wait_until_served,
)
from tests.support.redis_server import RedisServer
from tests.support.stack import scrape

BLOCK = 16


def test_a_tenants_blocks_in_the_store_serve_it_and_never_another(fast_model_dir: Path) -> None:
    with RedisServer(password="kv-secret") as store:
        stack = start_stack(
            fast_model_dir, engines=1, num_blocks=24, gateway_args=["--api-key", KEY_A],
            env={"PAGODA_API_KEYS": KEY_B, "KV_STORE_PASSWORD": "kv-secret",
                 SECRET_ENV: "the-deployment-kv-mac-key-0123"},
            engine_args=[["--kv-store-url", f"redis://127.0.0.1:{store.port}/0"]])
        try:
            wait_until_served(stack, KEY_A)
            prompt = long_prompt(f"store-{uuid.uuid4().hex[:8]}")
            a1 = complete(stack, prompt, KEY_A)
            n = a1["usage"]["prompt_tokens"]
            assert cached_tokens(a1) == 0 and n >= 6 * BLOCK
            for i in range(4):  # A's blocks leave the 24-block pool
                complete(stack, long_prompt(f"evict-{i}-{uuid.uuid4().hex[:6]}", 150), KEY_A)
            assert cached_tokens(complete(stack, prompt, KEY_B)) == 0  # not B's, in any tier
            a2 = complete(stack, prompt, KEY_A)
            assert cached_tokens(a2) == (n - 1) // BLOCK * BLOCK  # A's, from the store
            metrics = scrape(stack.engines[0].url)
            assert metrics["vllm:external_prefix_cache_hits_total"] == cached_tokens(a2)
        finally:
            stack.stop()
            stack.redis.close()
