"""Redis over TLS only (the plain port is off), with a password and a private CA.

The engine and the router reach it with ``rediss://...?ssl_ca_certs=CA`` (what the Helm chart
renders for ``redis.tls.caSecret``); a second router gets the CA from ``REDIS_CA_CERT`` instead.
The stack serves, the routers read the engine's heartbeats and prefix blocks back over TLS, and
a client without the CA (or with another CA, or in plain text) gets nothing."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.common.redis_index import REDIS_CA_CERT_ENV, connect
from services.protocol.block_hash import BlockHasher
from tests.security.conftest import (
    cached_tokens,
    complete,
    http,
    long_prompt,
    route,
    router_engines,
    router_matched_ratio,
    start_stack,
    wait_for,
    wait_until_served,
)
from tests.support.redis_server import RedisServer
from tests.support.services import ServiceProcess
from tests.support.stack import PagodaStack

PASSWORD = f"tls-pw-{uuid.uuid4().hex[:12]}"
NUM_BLOCKS = 384


@pytest.fixture(scope="module")
def tls_stack(fast_model_dir: Path) -> Iterator[PagodaStack]:
    stack = start_stack(
        fast_model_dir, RedisServer(password=PASSWORD, tls=True), engines=1, num_blocks=NUM_BLOCKS
    )
    try:
        wait_until_served(stack)
        yield stack
    finally:
        stack.stop()
        stack.redis.close()


def _ping(url: str) -> bool:
    async def go() -> bool:
        client = connect(url, timeout_s=2.0)
        try:
            return bool(await client.ping())
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_redis_answers_only_tls_clients_that_trust_its_ca(
    tls_stack: PagodaStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = tls_stack.redis
    assert server.url.startswith("rediss://") and "ssl_ca_certs=" in server.url
    bare = f"rediss://:{PASSWORD}@127.0.0.1:{server.port}/0"
    assert _ping(server.url)  # the CA in the URL, as the chart passes it
    with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        _ping(bare)  # the system CAs do not know the test CA
    with pytest.raises(redis.ConnectionError):
        _ping(bare.replace("rediss://", "redis://"))  # plain text on the TLS port
    with RedisServer(tls=True) as other:  # a CA that did not sign this server's certificate
        monkeypatch.setenv(REDIS_CA_CERT_ENV, str(other.ca_file))
        with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            _ping(bare)
    monkeypatch.setenv(REDIS_CA_CERT_ENV, str(server.ca_file))
    assert _ping(bare)
    # A CA with a URL that is not rediss:// is refused before any command is sent.
    with pytest.raises(ValueError, match="rediss://"):
        connect(bare.replace("rediss://", "redis://"))


def test_stack_serves_and_routes_by_prefix_over_tls(tls_stack: PagodaStack) -> None:
    s = tls_stack
    body = router_engines(s.routers[0].url)
    assert body["degraded"] is False
    (row,) = body["engines"]  # engine-0's heartbeat, written and read over TLS
    assert row["engine_id"] == "engine-0" and row["total_blocks"] == NUM_BLOCKS
    assert http("GET", f"{s.routers[0].url}/health").body["redis"] == "ok"

    prompt = long_prompt(f"tls-{uuid.uuid4().hex[:8]}")
    first = complete(s, prompt)
    ratio_sum, _ = router_matched_ratio(s)
    second = complete(s, prompt)
    assert cached_tokens(first) == 0 and cached_tokens(second) > 4 * 16
    assert router_matched_ratio(s)[0] - ratio_sum == pytest.approx(1.0)
    assert PASSWORD not in "".join(p.log_text() for p in (*s.routers, *s.engines))


def test_a_router_with_the_ca_from_the_environment(tls_stack: PagodaStack) -> None:
    s = tls_stack
    url = f"rediss://127.0.0.1:{s.redis.port}/0"  # neither password nor CA in the URL
    router = ServiceProcess(
        "services.router",
        ["--host", "127.0.0.1", "--redis-url", url, "--engines", s.engines[0].url],
        health_path="/ready",
        env={
            "REDIS_PASSWORD": PASSWORD,
            REDIS_CA_CERT_ENV: str(s.redis.ca_file),
            "OMP_NUM_THREADS": "1",
        },
    ).start()
    try:
        assert http("GET", f"{router.url}/health").body["redis"] == "ok"
        (row,) = router_engines(router.url)["engines"]
        assert row["engine_id"] == "engine-0"
        # Blocks the engine published over TLS, found by this router's lookup.
        ids = [2000 + (i * 53) % 30000 for i in range(5 * 16 + 3)]
        ids[0] = 100 + uuid.uuid4().int % 900
        complete(s, ids)
        chain = BlockHasher(s.model, 16).chain(ids)
        wait_for(
            lambda: route(s, chain, len(ids), router.url).matched_blocks == 5,
            what="the engine's blocks seen by the second router",
        )
    finally:
        router.stop()
