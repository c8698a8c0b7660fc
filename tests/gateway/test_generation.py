"""Completions and chat through the gateway with the official openai client: JSON and SSE,
usage, system_fingerprint, n > 1, stop strings, multi-byte text, logprobs, block hashes and
routing by model."""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import pytest

from services.gateway.config import ModelSpec
from services.gateway.models import ModelRegistry
from services.gateway.router_client import EngineInfo
from services.protocol.block_hash import BlockHasher, HashAlgorithm
from tests.gateway.conftest import MODEL, Stack, StackFactory

pytestmark = pytest.mark.asyncio

FOX = "The quick brown fox jumps over the lazy dog."


def script(stack: Stack, text: str, engines: tuple[str, ...] | None = None) -> list[int]:
    ids = stack.tokenizer.encode(text, add_special_tokens=False)
    for eid, engine in stack.engines.items():
        if engines is None or eid in engines:
            engine.behaviour.script = ids
    return ids


async def test_completion_json(stack: Stack) -> None:
    ids = script(stack, FOX)
    stack.engines["e1"].behaviour.cached_tokens = 16
    prompt = "Tell me about foxes. " * 8
    resp = await stack.client().completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=64, temperature=0
    )
    assert resp.headers["x-pagoda-engine"] == "e1"
    out = resp.parse()
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].text == FOX
    assert out.choices[0].finish_reason == "stop"
    prompt_ids = stack.tokenizer.encode(prompt)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == len(ids)
    assert out.usage.total_tokens == len(prompt_ids) + len(ids)
    assert out.usage.prompt_tokens_details.cached_tokens == 16
    # What the engine got: the prompt tokenized once, one sample, and no stop strings.
    (req,) = stack.engines["e1"].requests
    assert req.prompt_token_ids == prompt_ids
    assert (req.params.n, req.params.max_tokens, req.params.temperature) == (1, 64, 0.0)


async def test_max_tokens_absent_means_16_for_completions_and_the_context_for_chat(
    stack: Stack,
) -> None:
    script(stack, FOX)
    out = await stack.client().completions.create(model=MODEL, prompt="hi")
    assert out.choices[0].text == FOX
    assert stack.engines["e1"].requests[0].params.max_tokens == 16  # OpenAI's and vLLM's
    await stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert stack.engines["e1"].requests[1].params.max_tokens is None


async def test_length_finish(stack: Stack) -> None:
    ids = script(stack, FOX)
    out = await stack.client().completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text == stack.tokenizer.decode(ids[:3])
    assert out.usage.completion_tokens == 3


async def test_chat_json_applies_template_once(stack: Stack) -> None:
    script(stack, "Paris is the capital.")
    messages = [{"role": "user", "content": "Capital of France?"}]
    out = await stack.client().chat.completions.create(model=MODEL, messages=messages)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == "Paris is the capital."
    (req,) = stack.engines["e1"].requests
    assert req.prompt_token_ids == stack.tokenizer.encode_chat(messages)
    assert out.usage.prompt_tokens == len(req.prompt_token_ids)


async def test_chat_stream_with_usage(stack: Stack) -> None:
    ids = script(stack, "Paris is the capital of France.")
    stack.engines["e1"].behaviour.cached_tokens = 16
    stream = await stack.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Capital?"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Paris is the capital of France."
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "stop" and all(f is None for f in finals[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(ids)
    assert last.usage.prompt_tokens_details.cached_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


async def test_stream_without_usage_and_raw_sse_framing(stack: Stack) -> None:
    script(stack, "abc def")
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "x", "stream": True},
        ) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["x-pagoda-engine"] == "e1"
        raw = (await resp.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert '"usage"' not in raw


async def test_system_fingerprint_on_every_body_and_chunk(stack: Stack) -> None:
    script(stack, FOX)
    fp = stack.app_state.models.get(MODEL).fingerprint
    assert re.fullmatch(r"pagoda-\S+-[0-9a-f]{8}", fp)
    c = stack.client()
    messages = [{"role": "user", "content": "Foxes?"}]
    assert (await c.completions.create(model=MODEL, prompt="hi")).system_fingerprint == fp
    assert (await c.chat.completions.create(model=MODEL, messages=messages)
            ).system_fingerprint == fp
    usage = {"include_usage": True}
    for stream in (
        await c.completions.create(model=MODEL, prompt="hi", echo=True, stream=True,
                                   stream_options=usage),
        await c.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                        stream_options=usage),
    ):
        chunks = [ch async for ch in stream]
        assert len(chunks) > 3 and chunks[-1].usage is not None
        assert all(ch.system_fingerprint == fp for ch in chunks)


async def test_system_fingerprint_follows_the_serving_configuration(
        tokenizer, default_model_path) -> None:
    registry = ModelRegistry.build([ModelSpec(MODEL, str(default_model_path))],
                                   {MODEL: tokenizer}, block_size=16)
    model = registry.get(MODEL)
    seen = {model.fingerprint}
    for block_size, context in ((16, None), (32, None), (32, 2048)):
        registry.update([EngineInfo("e1", "http://e1", MODEL, block_size, context)])
        seen.add(model.fingerprint)
    assert len(seen) == 3  # the first update changed nothing


async def test_n2_non_stream_seeds_and_choice_indexes(stack: Stack) -> None:
    script(stack, FOX)
    out = await stack.client().completions.create(
        model=MODEL, prompt="hello", n=2, seed=7, max_tokens=64
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.text == FOX for c in out.choices)
    reqs = stack.engines["e1"].requests
    assert sorted(r.params.seed for r in reqs) == [7, 8]
    assert all(r.params.n == 1 for r in reqs)
    assert len({r.request_id for r in reqs}) == 2
    prompt_len = len(stack.tokenizer.encode("hello"))
    assert out.usage.prompt_tokens == prompt_len  # the prompt counts once
    assert out.usage.completion_tokens == 2 * len(stack.tokenizer.encode(FOX, False))


async def test_n2_stream_and_several_prompts(stack: Stack) -> None:
    script(stack, "one two")
    stream = await stack.client().completions.create(
        model=MODEL, prompt=["a", "b"], n=2, stream=True, stream_options={"include_usage": True}
    )
    texts: dict[int, str] = {}
    finished: set[int] = set()
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2, 3}
    assert texts == {i: "one two" for i in range(4)}
    assert len(stack.engines["e1"].requests) == 4
    assert all(r.params.seed is None for r in stack.engines["e1"].requests)


async def test_stop_string_across_token_boundaries(stack: Stack) -> None:
    script(stack, FOX)
    stack.engines["e1"].behaviour.delay = 0.02  # still generating when the stop string hits
    out = await stack.client().completions.create(model=MODEL, prompt="x", stop=["fox ju", "never"])
    assert out.choices[0].text == "The quick brown "
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == "fox ju"
    await _wait(stack.engines["e1"].abort_seen)  # the engine stream was closed: it aborts
    assert stack.engines["e1"].requests[0].params.stop == []


async def test_stop_string_streamed_never_leaks_and_can_be_included(stack: Stack) -> None:
    script(stack, FOX)
    client = stack.client()
    stream = await client.completions.create(model=MODEL, prompt="x", stop="fox ju", stream=True)
    pieces = [c.choices[0].text async for c in stream if c.choices]
    assert "".join(pieces) == "The quick brown "
    assert not any("fox" in p for p in pieces)
    out = await client.completions.create(
        model=MODEL, prompt="x", stop="fox ju", extra_body={"include_stop_str_in_output": True}
    )
    assert out.choices[0].text == "The quick brown fox ju"


async def test_multibyte_characters_stream_intact(stack: Stack) -> None:
    text = "héllo 世界 🎉🦊 naïve ☃ done"
    ids = script(stack, text)
    assert len(ids) > len(text.split())  # some characters span several tokens
    stream = await stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
    )
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


async def test_logprobs_completion_and_chat(stack: Stack) -> None:
    ids = script(stack, "a b c")
    client = stack.client()
    out = await client.completions.create(model=MODEL, prompt="x", logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens == [stack.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs == [-0.5] * len(ids)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert stack.engines["e1"].requests[0].params.logprobs == 2
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == [-0.5] * len(ids)
    assert all(len(c.top_logprobs) == 2 for c in content)


async def test_echo(stack: Stack) -> None:
    script(stack, " world")
    client = stack.client()
    out = await client.completions.create(model=MODEL, prompt="hello", echo=True)
    assert out.choices[0].text == "hello world"
    stream = await client.completions.create(model=MODEL, prompt="hello", echo=True, stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == "hello world"


async def test_token_id_prompt(stack: Stack) -> None:
    script(stack, "ok")
    out = await stack.client().completions.create(model=MODEL, prompt=[1, 2, 3, 4])
    assert out.choices[0].text == "ok"
    assert stack.engines["e1"].requests[0].prompt_token_ids == [1, 2, 3, 4]


async def test_block_hashes_salt_and_engine_block_size(make_stack: StackFactory) -> None:
    stack = await make_stack(block_size=8)
    script(stack, "ok")
    prompt = "word " * 40
    client = stack.client()
    await client.completions.create(model=MODEL, prompt=prompt)
    await client.completions.create(model=MODEL, prompt=prompt, extra_body={"cache_salt": "s1"})
    ids = stack.tokenizer.encode(prompt)
    plain, salted = stack.router.requests
    assert plain.block_hashes == BlockHasher(MODEL, 8).chain(ids)
    assert len(plain.block_hashes) == len(ids) // 8 > 0
    assert salted.block_hashes == BlockHasher(MODEL, 8, "s1").chain(ids)
    assert (plain.prompt_len, plain.model, plain.exclude) == (len(ids), MODEL, [])
    assert [r.cache_salt for r in stack.engines["e1"].requests] == [None, "s1"]


async def test_prompts_are_hashed_with_the_engines_hash_algorithm(
    make_stack: StackFactory,
) -> None:
    """Engines started with --hash-algorithm sha256 say so in their heartbeats: the gateway
    hashes with it too, or no prefix would ever match theirs."""
    stack = await make_stack(block_size=8, hash_algorithm="sha256")
    script(stack, "ok")
    prompt = "word " * 40
    await stack.client().completions.create(model=MODEL, prompt=prompt)
    ids = stack.tokenizer.encode(prompt)
    (sent,) = stack.router.requests
    assert sent.block_hashes == BlockHasher(MODEL, 8, None, HashAlgorithm.SHA256).chain(ids)
    assert sent.block_hashes != BlockHasher(MODEL, 8).chain(ids)


async def test_requests_only_reach_engines_of_their_model(make_stack: StackFactory) -> None:
    stack = await make_stack(engines=[("a1", "alpha"), ("b1", "beta")], models=("alpha", "beta"))
    script(stack, "ok")
    client = stack.client()
    for _ in range(2):
        r = await client.completions.with_raw_response.create(model="beta", prompt="x")
        assert r.headers["x-pagoda-engine"] == "b1"
    r = await client.completions.with_raw_response.create(model="alpha", prompt="x")
    assert r.headers["x-pagoda-engine"] == "a1"
    assert [len(e.requests) for e in stack.engines.values()] == [1, 2]
    assert [r.model for r in stack.router.requests] == ["beta", "beta", "alpha"]


async def test_models_lists_live_configured_models(make_stack: StackFactory) -> None:
    stack = await make_stack(
        engines=[("a1", "alpha"), ("g1", "ghost")], models=("alpha", "beta"), max_model_len=512
    )
    models = await stack.client().models.list()
    assert [m.id for m in models.data] == ["alpha"]  # beta has no engine, ghost no tokenizer
    assert models.data[0].model_extra["max_model_len"] == 512
    stack.router.engines.append(stack.router.engines[0].__class__("b1", "http://x:1", "beta"))
    models = await stack.client().models.list()
    assert sorted(m.id for m in models.data) == ["alpha", "beta"]


async def _wait(event, timeout: float = 5.0) -> None:
    import asyncio

    await asyncio.wait_for(event.wait(), timeout)


# A token id past any vocabulary: the detokenizer raises (OverflowError) on it. An engine that
# sends one is buggy; the client must get an error at once, not wait out the request timeout.
UNDECODABLE = 2**32


@pytest.mark.parametrize("stream", [False, True])
async def test_an_output_the_gateway_cannot_decode_is_an_error_at_once(
    stack: Stack, stream: bool
) -> None:
    ids = stack.tokenizer.encode("word " * 50, add_special_tokens=False)
    engine = stack.engines["e1"]
    engine.behaviour.script = ids[:3] + [UNDECODABLE] + ids[3:]
    engine.behaviour.delay = 0.02  # the engine is still streaming when the gateway gives up
    body = {"model": MODEL, "prompt": "x", "stream": stream, "max_tokens": 40}
    start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=10)  # once: it waited for the request timeout
    async with aiohttp.ClientSession(timeout=timeout) as s, s.post(
            f"{stack.url}/v1/completions", json=body) as resp:
        raw = await resp.read()
    assert time.monotonic() - start < 5
    if stream:  # the text decoded so far, then an error event
        assert resp.status == 200
        events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "server_error" and "decoding" in err["message"]
        assert any(json.loads(e).get("choices") for e in events[:-2])
    else:
        assert resp.status == 500
        assert "decoding the engine's output" in json.loads(raw)["error"]["message"]
    await asyncio.wait_for(engine.abort_seen.wait(), 5)  # the engine request was aborted
    assert not engine.finished
