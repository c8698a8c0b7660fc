"""Bad input is a 4xx in OpenAI's error shape, naming the param; never a 500. Auth."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from services.gateway.auth import cache_salt_for, tenant_id
from services.protocol.block_hash import BlockHasher
from tests.gateway.conftest import MODEL, Stack, StackFactory

pytestmark = pytest.mark.asyncio


async def post(stack: Stack, path: str, **kwargs) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(stack.url + path, **kwargs) as resp:
        return resp.status, await resp.json()


def assert_error_shape(body: dict) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),  # past --max-n (128)
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": 5}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [[1, 2], "x"]}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"model": 3}, "model"),
        ({"echo": "yes"}, "echo"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": "x"}}, "logit_bias"),
        ({"logit_bias": {"49152": 1}}, "logit_bias"),  # past the vocabulary
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"seed": 2**64 - 1, "n": 2}, "seed"),
        ({"prompt": ["a"] * 20, "n": 16}, "n"),
    ],
)
async def test_completion_400_names_the_param(stack: Stack, extra: dict, param: str) -> None:
    status, body = await post(
        stack, "/v1/completions", json={"model": MODEL, "prompt": "hi", **extra}
    )
    assert status == 400, body
    err = assert_error_shape(body)
    assert (err["type"], err["param"]) == ("invalid_request_error", param)


async def test_chat_400s_through_the_openai_client(stack: Stack) -> None:
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=MODEL, messages=[])
    assert exc.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=3
        )
    assert exc.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "wizard", "content": "x"}]
        )
    assert exc.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"chat_template_kwargs": {"tokenize": True}},
        )
    assert exc.value.param == "chat_template_kwargs"
    assert not stack.router.requests  # nothing was routed


async def test_unknown_model_404(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        await stack.client().completions.create(model="nope", prompt="x")
    assert exc.value.param == "model" and exc.value.code == "model_not_found"


@pytest.mark.parametrize(
    "data", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"str"', b"[" * 100_000]
)
async def test_invalid_json_400(stack: Stack, data: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        status, body = await post(
            stack, path, data=data, headers={"Content-Type": "application/json"}
        )
        assert status == 400, (path, body)
        assert_error_shape(body)


async def test_body_over_the_limit_413(make_stack: StackFactory) -> None:
    stack = await make_stack(max_body_bytes=4096)
    with pytest.raises(openai.APIStatusError) as exc:
        await stack.client().completions.create(model=MODEL, prompt="x" * 10_000)
    assert exc.value.status_code == 413
    assert exc.value.body["type"] == "invalid_request_error"

    # Chunked (no Content-Length): caught while reading.
    async def gen():
        for _ in range(10):
            yield b"x" * 1000

    status, body = await post(stack, "/v1/completions", data=gen())
    assert status == 413
    assert_error_shape(body)


async def test_context_length_checks(make_stack: StackFactory) -> None:
    stack = await make_stack(max_model_len=64)
    client = stack.client()
    long_prompt = "word " * 80
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model=MODEL, prompt=long_prompt)
    assert exc.value.param == "prompt" and exc.value.code == "context_length_exceeded"
    # Only max_tokens past the whole context is refused (vLLM 0.32's rule).
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model=MODEL, prompt="word " * 30, max_tokens=65)
    assert exc.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=65,
        )
    assert exc.value.param == "max_completion_tokens"
    # prompt + max_tokens past the context goes to the engine, which stops at the context.
    stack.engines["e1"].behaviour.script = [42]
    await client.completions.create(model=MODEL, prompt="word " * 30, max_tokens=50)
    assert stack.engines["e1"].requests[-1].params.max_tokens == 50
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_prompt}]
        )
    assert exc.value.param == "messages"
    # Fits: 30-ish prompt tokens, up to the context (max_tokens absent -> None).
    await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "word " * 30}]
    )
    assert stack.engines["e1"].requests[-1].params.max_tokens is None


async def test_engine_refusal_is_passed_on(stack: Stack) -> None:
    for e in stack.engines.values():
        e.behaviour.mode = "http400"
    with pytest.raises(openai.BadRequestError) as exc:
        await stack.client().completions.create(model=MODEL, prompt="x")
    assert exc.value.param == "prompt"
    assert len(stack.router.requests) == 1  # a refusal is not retried elsewhere


async def test_unknown_route_and_method_are_openai_errors(stack: Stack) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(stack.url + "/v1/nothing") as resp:
            assert resp.status == 404
            assert_error_shape(await resp.json())
        async with s.get(stack.url + "/v1/completions") as resp:
            assert resp.status == 405
            assert_error_shape(await resp.json())


async def test_auth(make_stack: StackFactory) -> None:
    stack = await make_stack(api_keys=("k-alpha", "k-beta"))
    stack.engines["e1"].behaviour.script = [42]
    with pytest.raises(openai.AuthenticationError) as exc:
        await stack.client("wrong").completions.create(model=MODEL, prompt="x")
    assert exc.value.body["type"] == "authentication_error"
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.url + "/v1/completions", json={}) as resp:
            assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
            assert_error_shape(await resp.json())
        for path in ("/health", "/metrics", "/openapi.json"):
            async with s.get(stack.url + path) as resp:
                assert resp.status == 200, path
    prompt = "shared system prompt " * 12
    for key in ("k-alpha", "k-beta"):
        await stack.client(key).completions.create(model=MODEL, prompt=prompt)
    await stack.client("k-alpha").completions.create(
        model=MODEL, prompt=prompt, extra_body={"cache_salt": "mine"}
    )
    ids = stack.tokenizer.encode(prompt)
    a, b, a_salted = stack.router.requests
    assert a.block_hashes and b.block_hashes
    assert not set(a.block_hashes) & set(b.block_hashes)  # tenants never share prefixes
    salt = cache_salt_for(tenant_id("k-alpha"), "mine")
    assert a_salted.block_hashes == BlockHasher(MODEL, 16, salt).chain(ids)
    salts = [r.cache_salt for r in stack.engines["e1"].requests]
    assert salts == [f"tenant:{tenant_id('k-alpha')}", f"tenant:{tenant_id('k-beta')}", salt]
    assert all("k-alpha" not in s and "k-beta" not in s for s in salts)


async def test_open_without_keys(stack: Stack) -> None:
    stack.engines["e1"].behaviour.script = [42]
    async with (
        aiohttp.ClientSession() as s,
        s.post(stack.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as resp,
    ):
        assert resp.status == 200
    assert stack.engines["e1"].requests[0].cache_salt is None
