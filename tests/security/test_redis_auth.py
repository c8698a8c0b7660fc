"""A password-protected redis-server under a whole stack: the password in the URL, or only in
``REDIS_PASSWORD`` with a URL that has none; and a wrong password, which the router and the
engine report clearly while the gateway keeps serving (the router routes without Redis).
No service ever logs the password."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.security.conftest import (
    cached_tokens,
    complete,
    http,
    long_prompt,
    router_engines,
    router_matched_ratio,
    start_stack,
    wait_until_served,
)
from tests.support.redis_server import RedisServer
from tests.support.stack import PagodaStack

PASSWORD = f"redis-pw-{uuid.uuid4().hex[:16]}"
NUM_BLOCKS = 512


class _WrongPasswordInUrl(RedisServer):
    """A server with ``PASSWORD`` whose ``url`` (what the services get) has another one."""

    wrong = f"wrong-pw-{uuid.uuid4().hex[:16]}"

    @property
    def url(self) -> str:
        return f"redis://:{self.wrong}@127.0.0.1:{self.port}/0"


def _stack(model_dir: Path, server: RedisServer, **options) -> Iterator[PagodaStack]:
    stack = start_stack(model_dir, server, engines=1, num_blocks=NUM_BLOCKS, **options)
    try:
        yield stack
    finally:
        stack.stop()
        stack.redis.close()


@pytest.fixture(scope="module")
def url_password_stack(fast_model_dir: Path) -> Iterator[PagodaStack]:
    yield from _stack(fast_model_dir, RedisServer(password=PASSWORD))


@pytest.fixture(scope="module")
def env_password_stack(fast_model_dir: Path) -> Iterator[PagodaStack]:
    server = RedisServer(password=PASSWORD, password_in_url=False)
    yield from _stack(fast_model_dir, server, env={"REDIS_PASSWORD": PASSWORD})


def _all_logs(stack: PagodaStack) -> str:
    return "".join(p.log_text() for p in (stack.gateway, *stack.routers, *stack.engines))


def assert_serves_with_prefix_routing(stack: PagodaStack) -> None:
    """Engines publish heartbeats and KV events to Redis, the router reads both back."""
    wait_until_served(stack)
    body = router_engines(stack.routers[0].url)
    assert body["degraded"] is False
    (row,) = body["engines"]  # from engine-0's heartbeat in Redis
    assert row["engine_id"] == "engine-0" and row["total_blocks"] == NUM_BLOCKS
    assert http("GET", f"{stack.routers[0].url}/health").body["redis"] == "ok"

    prompt = long_prompt(f"redis-auth-{uuid.uuid4().hex[:8]}")
    first = complete(stack, prompt)
    ratio_sum, _ = router_matched_ratio(stack)
    second = complete(stack, prompt)
    assert cached_tokens(first) == 0 and cached_tokens(second) > 4 * 16
    # The router's lookup found every block of the prompt on engine-0: read from Redis.
    assert router_matched_ratio(stack)[0] - ratio_sum == pytest.approx(1.0)


def test_redis_refuses_clients_without_the_password(url_password_stack: PagodaStack) -> None:
    port = url_password_stack.redis.port
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port, socket_timeout=2).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port, password="nope", socket_timeout=2).ping()
    ok = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, socket_timeout=2)
    assert ok.ping()
    ok.close()


def test_password_in_the_url(url_password_stack: PagodaStack) -> None:
    assert PASSWORD in url_password_stack.redis.url
    assert_serves_with_prefix_routing(url_password_stack)
    assert PASSWORD not in _all_logs(url_password_stack)
    assert "redis://:***@" in url_password_stack.routers[0].log_text()  # redacted, not absent


def test_password_only_in_redis_password_env(env_password_stack: PagodaStack) -> None:
    stack = env_password_stack
    assert PASSWORD not in stack.redis.url
    for p in (*stack.routers, *stack.engines):
        assert PASSWORD not in " ".join(p.args)
    assert_serves_with_prefix_routing(stack)
    assert PASSWORD not in _all_logs(stack)


@pytest.fixture(scope="module")
def wrong_password_stack(fast_model_dir: Path) -> Iterator[PagodaStack]:
    yield from _stack(fast_model_dir, _WrongPasswordInUrl(password=PASSWORD))


def test_a_wrong_password_fails_clearly_and_the_gateway_still_serves(
    wrong_password_stack: PagodaStack,
) -> None:
    stack = wrong_password_stack
    router = stack.routers[0]
    health = http("GET", f"{router.url}/health")
    assert health.status == 200 and health.body["redis"] == "unavailable"
    # Degraded: routed by the router's own view of load, not from Redis.
    for _ in range(2):
        r = complete(stack, long_prompt("wrong-password"), max_tokens=4)
        assert r["usage"]["completion_tokens"] == 4
    assert router_engines(router.url)["degraded"] is True
    decisions = _scrape_text(router.url)
    assert 'reason="degraded"' in decisions
    router_log, engine_log = router.log_text(), stack.engines[0].log_text()
    assert "redis unavailable" in router_log and "AuthenticationError" in router_log
    assert "redis publish failed: invalid username-password pair" in engine_log
    for log in (router_log, engine_log, stack.gateway.log_text()):
        assert PASSWORD not in log and _WrongPasswordInUrl.wrong not in log


def _scrape_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return resp.read().decode()
