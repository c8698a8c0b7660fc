"""Security tests on real stacks: redis-server, engines, routers and gateways as processes.

``keyed_stack`` (shared by the package) serves two tenants, ``KEY_A`` (given with
``--api-key``) and ``KEY_B`` (given in ``PAGODA_API_KEYS``), at the default log level.
The helpers speak plain HTTP (urllib) so a test sees exactly the status, headers and body.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.protocol.block_hash import BlockHash
from services.protocol.messages import RouteRequest, RouteResponse
from tests.support.redis_server import RedisServer
from tests.support.services import internal_headers
from tests.support.stack import PagodaStack, StackOptions, scrape

KEY_A = "sk-tenant-a-7Qx2Lr9Vb4Nd1Hs6"
KEY_B = "sk-tenant-b-Wm3Kp8Zc5Jt0Fy2G"
VOCAB = ["amber", "basil", "cedar", "dune", "ember", "fjord", "granite", "harbor", "iris",
         "juniper", "kestrel", "lagoon", "meadow", "nectar", "orchid", "pebble", "quartz",
         "river", "saffron", "thistle", "umber", "violet", "willow"]  # fmt: skip


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: Any  # parsed JSON, or text when the body is not JSON


def http(
    method: str,
    url: str,
    body: Any = None,
    key: str | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> Reply:
    """One request; never raises on an HTTP error status."""
    data = None if body is None else json.dumps(body).encode()
    h = {"Content-Type": "application/json"} if data is not None else {}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    h.update(headers or {})
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return _reply(resp.status, dict(resp.headers), resp.read())
    except urllib.error.HTTPError as err:
        return _reply(err.code, dict(err.headers), err.read())


def _reply(status: int, headers: dict[str, str], raw: bytes) -> Reply:
    text = raw.decode(errors="replace")
    try:
        return Reply(status, headers, json.loads(text))
    except ValueError:
        return Reply(status, headers, text)


def complete(
    stack: PagodaStack,
    prompt: str | list[int],
    key: str | None = None,
    max_tokens: int = 1,
    **extra: Any,
) -> dict[str, Any]:
    """A greedy ``/v1/completions``; returns the response (fails the test on an error)."""
    body = {
        "model": stack.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    r = http("POST", f"{stack.base_url}/completions", body, key)
    assert r.status == 200, r.body
    return r.body


def cached_tokens(response: dict[str, Any]) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def long_prompt(tag: str, words: int = 120) -> str:
    """A prompt of several 16-token blocks that no other test sends (``tag`` leads it)."""
    return f"{tag}: " + " ".join(VOCAB[(i * 7 + len(tag)) % len(VOCAB)] for i in range(words))


def wait_until_served(stack: PagodaStack, key: str | None = None, timeout: float = 60.0) -> None:
    """Until the gateway lists the model (the router has seen an engine's heartbeat)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = http("GET", f"{stack.base_url}/models", key=key)
        if r.status == 200 and any(m["id"] == stack.model for m in r.body["data"]):
            return
        time.sleep(0.05)
    pytest.fail(f"{stack.model} never appeared in the gateway's /v1/models")


def wait_for(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Polls ``condition()`` until it returns something truthy, and returns that (metrics and
    the Redis index lag a heartbeat behind the response)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            assert value, f"timed out waiting for {what}"
            return value
        time.sleep(0.1)


def router_matched_ratio(stack: PagodaStack) -> tuple[float, float]:
    """(sum, count) of the router's matched-block-ratio histogram: what its lookups saw."""
    m = scrape(stack.routers[0].url)
    return (
        m.get("pagoda_router_matched_block_ratio_sum", 0.0),
        m.get("pagoda_router_matched_block_ratio_count", 0.0),
    )


def engine_prefix_hits(stack: PagodaStack) -> float:
    return scrape(stack.engines[0].url).get("vllm:prefix_cache_hits_total", 0.0)


def route(
    stack: PagodaStack,
    block_hashes: list[BlockHash],
    prompt_len: int,
    router_url: str | None = None,
) -> RouteResponse:
    """Asks a router (the stack's first by default) directly which engine holds how much of a
    chain (``POST /route``)."""
    payload = RouteRequest(stack.model, block_hashes, prompt_len).to_msgpack()
    url = router_url or stack.routers[0].url
    req = urllib.request.Request(
        f"{url}/route", data=payload, method="POST",
        headers={"Content-Type": "application/msgpack", **internal_headers()},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return RouteResponse.from_msgpack(resp.read())


def router_engines(router_url: str) -> dict[str, Any]:
    """A router's ``GET /engines``: one row per engine whose heartbeat it read from Redis."""
    r = http("GET", f"{router_url}/engines", headers=internal_headers())
    assert r.status == 200, r.body
    return r.body


def start_stack(model_dir: Path, redis: RedisServer | None = None, **options: Any) -> PagodaStack:
    """A started stack; ``redis`` replaces the plain one PagodaStack would make (TLS, or a
    password kept out of the URL)."""
    stack = PagodaStack(model_dir, StackOptions(**options))
    if redis is not None:
        stack.redis = redis
    stack.start()
    return stack


@pytest.fixture(scope="package")
def keyed_stack(fast_model_dir: Path) -> Iterator[PagodaStack]:
    stack = start_stack(
        fast_model_dir, engines=1, gateway_args=["--api-key", KEY_A], env={"PAGODA_API_KEYS": KEY_B}
    )
    try:
        wait_until_served(stack, KEY_A)
        yield stack
    finally:
        stack.stop()
        stack.redis.close()
