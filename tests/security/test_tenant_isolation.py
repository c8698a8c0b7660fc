"""Prefix-cache isolation between tenants, end to end through real processes.

With API keys every request's block-hash chain is seeded with its tenant (and its own
``cache_salt``, if any), so tenant B can neither hit tenant A's cached prefixes (no
``cached_tokens``, no engine prefix-cache hits) nor probe for them (the router's index lookup
for B's chain matches nothing), and B's traffic does not cost A its hits. Without keys a
request's ``cache_salt`` alone chooses the namespace, as in vLLM.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.gateway.auth import cache_salt_for, tenant_id
from services.protocol.block_hash import BlockHasher
from tests.security.conftest import (
    KEY_A,
    KEY_B,
    cached_tokens,
    complete,
    engine_prefix_hits,
    http,
    long_prompt,
    route,
    router_matched_ratio,
    start_stack,
    wait_for,
    wait_until_served,
)
from tests.support.stack import PagodaStack

BLOCK = 16


def full_hit(prompt_tokens: int) -> int:
    """Cached tokens of a repeated prompt: every full block but never the last token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def test_a_tenant_cannot_hit_or_evict_another_tenants_prefix(keyed_stack: PagodaStack) -> None:
    s = keyed_stack
    prompt = long_prompt(f"isolation-{uuid.uuid4().hex[:8]}")
    a1 = complete(s, prompt, KEY_A)
    a2 = complete(s, prompt, KEY_A)
    n = a1["usage"]["prompt_tokens"]
    assert n >= 6 * BLOCK
    assert cached_tokens(a1) == 0 and cached_tokens(a2) == full_hit(n)

    ratio_sum, ratio_count = router_matched_ratio(s)
    hits = engine_prefix_hits(s)
    b1 = complete(s, prompt, KEY_B)  # the same text, another tenant
    assert cached_tokens(b1) == 0
    a3 = complete(s, prompt, KEY_A)
    assert cached_tokens(a3) == full_hit(n), "B's request cost A its cached prefix"
    # Between them, B's request and A's third one: the engine served exactly A's hits from its
    # prefix cache and the router's lookup matched A's chain in full, B's not at all.
    wait_for(lambda: engine_prefix_hits(s) - hits >= full_hit(n), what="engine hit counter")
    assert engine_prefix_hits(s) - hits == full_hit(n)
    new_sum, new_count = router_matched_ratio(s)
    assert new_count - ratio_count == 2
    assert new_sum - ratio_sum == pytest.approx(1.0)

    b2 = complete(s, prompt, KEY_B)  # B's own namespace caches as usual
    assert cached_tokens(b2) == full_hit(n)


def test_the_same_cache_salt_does_not_join_two_tenants(keyed_stack: PagodaStack) -> None:
    s = keyed_stack
    prompt = long_prompt(f"shared-salt-{uuid.uuid4().hex[:8]}")
    complete(s, prompt, KEY_A, cache_salt="team")
    a = complete(s, prompt, KEY_A, cache_salt="team")
    assert cached_tokens(a) == full_hit(a["usage"]["prompt_tokens"])
    assert cached_tokens(complete(s, prompt, KEY_B, cache_salt="team")) == 0
    # Within a tenant the request's salt still splits the cache.
    assert cached_tokens(complete(s, prompt, KEY_A, cache_salt="other")) == 0
    assert cached_tokens(complete(s, prompt, KEY_A)) == 0


def test_the_router_index_cannot_be_probed_across_tenants(keyed_stack: PagodaStack) -> None:
    """A's blocks are indexed under A's chain; the chain of the very same tokens for B (or for
    no tenant) finds nothing, so B learns nothing from routing or timing."""
    s = keyed_stack
    ids = [1000 + (i * 37) % 20000 for i in range(6 * BLOCK + 5)]
    ids[0] = 100 + uuid.uuid4().int % 900  # a prefix of its own
    complete(s, ids, KEY_A)
    assert cached_tokens(complete(s, ids, KEY_A)) == 6 * BLOCK

    def chain(key: str | None) -> list:
        salt = cache_salt_for(None if key is None else tenant_id(key), None)
        return BlockHasher(s.model, BLOCK, salt).chain(ids)

    chain_a, chain_b, chain_open = chain(KEY_A), chain(KEY_B), chain(None)
    assert len({chain_a[0], chain_b[0], chain_open[0]}) == 3
    wait_for(lambda: route(s, chain_a, len(ids)).matched_blocks == 6, what="A's chain indexed")
    assert route(s, chain_b, len(ids)).matched_blocks == 0
    assert route(s, chain_open, len(ids)).matched_blocks == 0
    assert cached_tokens(complete(s, ids, KEY_B)) == 0


@pytest.fixture(scope="module")
def open_stack(fast_model_dir: Path) -> Iterator[PagodaStack]:
    """No API keys: the request's ``cache_salt`` alone picks the cache namespace."""
    stack = start_stack(fast_model_dir, engines=1)
    try:
        wait_until_served(stack)
        yield stack
    finally:
        stack.stop()
        stack.redis.close()


def test_without_keys_the_request_salt_splits_the_cache(open_stack: PagodaStack) -> None:
    s = open_stack
    prompt = long_prompt(f"salted-{uuid.uuid4().hex[:8]}")
    first = complete(s, prompt, cache_salt="salt-1")
    full = full_hit(first["usage"]["prompt_tokens"])
    assert cached_tokens(first) == 0
    assert cached_tokens(complete(s, prompt, cache_salt="salt-1")) == full
    assert cached_tokens(complete(s, prompt, cache_salt="salt-2")) == 0
    assert cached_tokens(complete(s, prompt)) == 0  # unsalted is a namespace of its own
    assert cached_tokens(complete(s, prompt)) == full
    assert cached_tokens(complete(s, prompt, cache_salt="salt-1")) == full


def test_without_keys_chat_honours_cache_salt(open_stack: PagodaStack) -> None:
    s = open_stack
    messages = [{"role": "user", "content": long_prompt(f"chat-{uuid.uuid4().hex[:8]}")}]

    def chat(salt: str) -> int:
        r = http(
            "POST",
            f"{s.base_url}/chat/completions",
            {"model": s.model, "messages": messages, "max_tokens": 1, "cache_salt": salt},
        )
        assert r.status == 200, r.body
        return cached_tokens(r.body)

    assert chat("x") == 0
    assert chat("x") > 4 * BLOCK
    assert chat("y") == 0
