"""A bounded load client for fault tests: N workers stream completions from the gateway.

Each request is recorded (which engine served it, when it started streaming and ended, whether
it succeeded, its cached prompt tokens), so a test can count what a fault cost: e.g. the
streams that were in flight on an engine at the moment it was killed.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

ENGINE_HEADER = "x-pagoda-engine"


@dataclass
class Outcome:
    started: float  # monotonic, request sent
    ended: float = 0.0
    streaming_at: float | None = None  # response headers received (the engine had a token)
    engine: str | None = None
    ok: bool = False
    disconnected: bool = False  # the client hung up on purpose
    error: str | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""  # the streamed completion, whole
    finish_reason: str | None = None

    def streaming_during(self, t: float) -> bool:
        """Whether this stream was in progress at ``t``: sent before it, ended after it, and
        got its first token. Its first token may reach the client a moment after ``t`` (a
        frozen or killed engine sent it just before), so ``streaming_at`` is not compared."""
        return self.streaming_at is not None and self.started <= t < self.ended


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    @property
    def succeeded(self) -> int:
        return sum(o.ok for o in self.outcomes)

    @property
    def disconnected(self) -> int:
        return sum(o.disconnected for o in self.outcomes)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok and not o.disconnected]

    def by_engine(self, since: float = 0.0) -> Counter[str]:
        return Counter(o.engine for o in self.outcomes if o.ok and o.started >= since)

    def in_flight_on(self, engine: str, t: float) -> int:
        return sum(o.engine == engine and o.streaming_during(t) for o in self.outcomes)

    def summary(self) -> str:
        errors = Counter((o.error or "?")[:80] for o in self.failed)
        return (f"sent={self.sent} succeeded={self.succeeded} failed={len(self.failed)} "
                f"disconnected={self.disconnected} engines={dict(self.by_engine())} "
                f"errors={dict(errors)}")


PromptFn = Callable[[int], str]


async def run_load(
    base_url: str,
    model: str,
    prompt: PromptFn,
    *,
    requests: int | None = None,
    duration_s: float | None = None,
    until: Callable[[], bool] | None = None,
    concurrency: int = 8,
    max_tokens: int = 16,
    disconnect_fraction: float = 0.0,
    headers: dict[str, str] | None = None,
    seed: int = 0,
    result: LoadResult | None = None,
    request_timeout_s: float = 60.0,
) -> LoadResult:
    """Streams completions until ``requests`` were sent, ``duration_s`` passed or ``until()``
    holds (whichever comes first). ``prompt(i)`` makes request i's prompt. A
    ``disconnect_fraction`` of the requests hang up after their first chunk. ``result`` may be
    passed in to watch it live."""
    if requests is None and duration_s is None:
        raise ValueError("give requests or duration_s (a bound, also with until)")
    out = result if result is not None else LoadResult()
    rng = random.Random(seed)
    deadline = time.monotonic() + duration_s if duration_s is not None else float("inf")
    counter = iter(range(requests if requests is not None else 1 << 62))
    body_base = {"model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                 "temperature": 0.0, "stream_options": {"include_usage": True}}
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline and not (until is not None and until()):
            i = next(counter, None)
            if i is None:
                return
            hang_up = rng.random() < disconnect_fraction
            o = Outcome(started=time.monotonic())
            out.outcomes.append(o)
            await _one(session, base_url, {**body_base, "prompt": prompt(i)}, o, hang_up,
                       headers or {}, timeout)
            o.ended = time.monotonic()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return out


async def _one(session: aiohttp.ClientSession, base_url: str, body: dict, o: Outcome,
               hang_up: bool, headers: dict[str, str], timeout: aiohttp.ClientTimeout) -> None:
    try:
        async with session.post(f"{base_url}/completions", json=body, headers=headers,
                                timeout=timeout) as resp:
            o.engine = resp.headers.get(ENGINE_HEADER)
            if resp.status != 200:
                o.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            o.streaming_at = time.monotonic()
            done = False
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    o.error = f"stream error: {event['error'].get('message', '')[:200]}"
                    return
                if hang_up:
                    o.disconnected = True
                    resp.close()  # mid-stream: the gateway must abort the engine request
                    return
                for choice in event.get("choices") or []:
                    o.text += choice.get("text") or ""
                    o.finish_reason = choice.get("finish_reason") or o.finish_reason
                usage = event.get("usage")
                if usage:
                    o.completion_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    o.cached_tokens = details.get("cached_tokens") or 0
            if not done:
                o.error = "stream ended without [DONE]"
                return
            o.ok = True
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        o.error = f"{type(exc).__name__}: {exc}"[:200]


async def stream_completion(session: aiohttp.ClientSession, base_url: str, model: str,
                            prompt: str, max_tokens: int, timeout_s: float = 60.0,
                            outcome: Outcome | None = None) -> Outcome:
    """One streamed completion (greedy, ``ignore_eos``), recorded in ``outcome`` (pass one in
    to watch it live: ``streaming_at`` is set at the first token)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
    o = outcome or Outcome(started=0.0)
    o.started = time.monotonic()
    await _one(session, base_url, body, o, False, {}, aiohttp.ClientTimeout(total=timeout_s))
    o.ended = time.monotonic()
    return o


def word_prompt(seed: int, words: int) -> str:
    """A deterministic prompt of ``words`` plain words (about as many tokens)."""
    rng = random.Random(seed)
    vocab = ("river", "stone", "cloud", "amber", "signal", "lantern", "orbit", "meadow",
             "copper", "harbor", "violet", "engine", "garden", "silver", "thunder", "pixel")
    return " ".join(rng.choice(vocab) for _ in range(words))
