"""End to end through real processes: the official openai client -> gateway -> router (Redis)
-> two engines. Ordered so the destructive test (an engine killed) runs last."""

from __future__ import annotations

import functools
import random
import re
import time
import urllib.request

import openai
import pytest

from services.engine.models.default import default_model_path
from services.text.tokenizer import Tokenizer
from tests.e2e.conftest import ENGINE_BLOCKS, MODEL, Stack, start_router
from tests.support.services import ServiceProcess

BLOCK = 16


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


def wait_for_model(stack: Stack, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(m.id == MODEL for m in client(stack).models.list().data):
            return
        time.sleep(0.3)
    pytest.fail(f"{MODEL} never appeared in /v1/models")


def free_blocks(engine_url: str) -> float:
    text = urllib.request.urlopen(engine_url + "/metrics", timeout=5).read().decode()
    return float(re.search(r"^pagoda:kv_free_blocks\{[^}]*\} (\S+)$", text, re.MULTILINE).group(1))


@pytest.fixture(scope="module")
def ready(stack: Stack) -> Stack:
    wait_for_model(stack)
    return stack


def test_completions_chat_and_streaming_with_usage(ready: Stack) -> None:
    c = client(ready)
    comp = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens <= 8
    chat = c.chat.completions.create(model=MODEL, max_tokens=16, temperature=0,
                                     messages=[{"role": "user", "content": "What is 2+2?"}])
    assert chat.choices[0].message.content
    chunks = list(c.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "What is 2+2?"}]))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content[: len(text)]
    assert chunks[-1].usage.completion_tokens == 12 or chunks[-1].usage.completion_tokens <= 12
    raw = c.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert raw.headers.get("x-pagoda-engine")


def test_errors_have_openai_shape(ready: Stack) -> None:
    c = client(ready)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)
    assert "temperature" in str(exc.value)
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=MODEL, prompt="hello " * 9000, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=MODEL, prompt="hello", max_tokens=10**6)
    assert "max_tokens" in str(exc.value)


def prefix_workload(seed: int, prefixes: int, follow_ups: int) -> list[tuple[int, str]]:
    """Distinct long prefixes (about 200 tokens), each followed by requests that extend it."""
    rng = random.Random(seed)
    words = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
             "november oscar papa quebec romeo sierra tango uniform victor whiskey").split()
    out = []
    for p in range(prefixes):
        base = " ".join(rng.choice(words) for _ in range(180))
        out.append((p, base))
        for f in range(follow_ups):
            tail = " ".join(rng.choice(words) for _ in range(8))
            out.append((p, f"{base} question {f}: {tail}"))
    return out


def cached_fraction(stack: Stack, seed: int) -> float:
    c = client(stack)
    hits = total = 0
    for _, prompt in prefix_workload(seed, prefixes=4, follow_ups=4):
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        if prompt.count("question"):
            shared_blocks = token_count(prompt.split(" question ")[0]) // BLOCK
            total += 1
            hits += r.usage.prompt_tokens_details.cached_tokens >= (shared_blocks - 1) * BLOCK
    return hits / total


@functools.cache
def _tokenizer() -> Tokenizer:
    return Tokenizer(default_model_path())


def token_count(text: str) -> int:
    return len(_tokenizer().encode(text))


def test_prefix_routing_lands_follow_ups_where_their_prefix_is_cached(ready: Stack) -> None:
    prefix = cached_fraction(ready, seed=1)
    # The same engines behind a round-robin router (same Redis) and a second gateway, on
    # fresh prefixes so neither run benefits from the other's cache.
    rr_router = start_router(ready.redis.url, ready.engines, "round-robin")
    try:
        gw = ServiceProcess("services.gateway",
                            ["--host", "127.0.0.1", "--router-url", rr_router.url,
                             "--model", f"{MODEL}={default_model_path()}"]).start()
        try:
            rr_stack = Stack(ready.redis, ready.engines, rr_router, gw)
            wait_for_model(rr_stack)
            rr = cached_fraction(rr_stack, seed=2)
        finally:
            gw.stop()
    finally:
        rr_router.stop()
    print(f"follow-ups served from cache: prefix={prefix:.0%} round-robin={rr:.0%}")
    assert prefix >= 0.9
    assert prefix >= rr


def test_client_disconnect_aborts_and_frees_blocks(ready: Stack) -> None:
    c = client(ready)
    stream = c.completions.create(model=MODEL, prompt="Count to one thousand:", max_tokens=2000,
                                  temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if all(free_blocks(e.url) == ENGINE_BLOCKS for e in ready.engines):
            return
        time.sleep(0.2)
    pytest.fail("KV blocks were not freed after the client disconnected")


def test_engine_killed_before_first_token_is_retried_elsewhere(ready: Stack) -> None:
    victim = ready.engines[0]
    victim.kill()  # SIGKILL: its heartbeat lives on in Redis for a few seconds
    c = client(ready)
    served = []
    for i in range(6):
        raw = c.completions.with_raw_response.create(model=MODEL, prompt=f"Retry test {i}",
                                                     max_tokens=2)
        served.append(raw.headers.get("x-pagoda-engine"))
        assert raw.parse().choices[0].finish_reason in ("length", "stop")
    assert all(s and "engine-0" not in s and victim.url not in s for s in served), served
