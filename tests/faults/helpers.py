"""Small polling helpers for fault tests: what the router sees, what an engine holds."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable

from tests.support.services import internal_headers
from tests.support.stack import scrape


def router_engines(router_url: str) -> set[str]:
    """Engine ids the router considers live."""
    return {e["engine_id"] for e in _router_view(router_url)["engines"]}


def router_engine_idle(router_url: str, engine_id: str) -> bool:
    """Whether the router sees ``engine_id`` live with nothing running or waiting (its
    heartbeat after a hang can still count the requests it held when it stopped)."""
    return any(e["engine_id"] == engine_id and e["running"] == 0 and e["waiting"] == 0
               for e in _router_view(router_url)["engines"])


def _router_view(router_url: str) -> dict:
    req = urllib.request.Request(router_url + "/engines", headers=internal_headers())
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def router_degraded(router_url: str) -> bool:
    """Whether the router answers from its fallback (Redis unreachable, or in its retry
    back-off) rather than from Redis."""
    return bool(_router_view(router_url)["degraded"])


def router_idle(router_url: str) -> bool:
    """Whether the router sees no running, waiting or pending request on any engine."""
    engines = _router_view(router_url)["engines"]
    return all(e["running"] + e["waiting"] + e["pending"] == 0 for e in engines)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str,
             interval_s: float = 0.05) -> float:
    """Polls until ``predicate()`` holds; returns the seconds it took. Fails after timeout."""
    start = time.monotonic()
    last: object = None
    while True:
        try:
            if predicate():
                return time.monotonic() - start
        except OSError as exc:
            last = exc
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s}s: {what} (last error: {last!r})")
        time.sleep(interval_s)


def kv_blocks(engine_url: str) -> tuple[int, int]:
    """(free, total) KV blocks of an engine."""
    m = scrape(engine_url)
    return int(m["pagoda:kv_free_blocks"]), int(m["pagoda:kv_total_blocks"])
