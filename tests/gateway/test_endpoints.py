"""/tokenize, /detokenize, /openapi.json, /metrics, /health, /ready."""

from __future__ import annotations

import aiohttp
import pytest

from services.gateway.openapi import openapi_document
from tests.gateway.conftest import MODEL, Stack, StackFactory

pytestmark = pytest.mark.asyncio


async def call(stack: Stack, method: str, path: str, **kwargs) -> tuple[int, dict | str]:
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, stack.url + path, **kwargs) as resp,
    ):
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


async def test_tokenize_round_trip(make_stack: StackFactory) -> None:
    stack = await make_stack(max_model_len=4096)
    text = "Hello, wörld! 你好 🎉"
    status, tok = await call(
        stack,
        "POST",
        "/tokenize",
        json={"model": MODEL, "prompt": text, "return_token_strs": True},
    )
    assert status == 200
    assert tok["tokens"] == stack.tokenizer.encode(text)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 4096
    assert len(tok["token_strs"]) == tok["count"]
    status, detok = await call(stack, "POST", "/detokenize", json={"tokens": tok["tokens"]})
    assert (status, detok) == (200, {"prompt": text})  # model optional: only one is served


async def test_tokenize_chat(stack: Stack) -> None:
    messages = [{"role": "user", "content": "hi"}]
    status, tok = await call(
        stack, "POST", "/tokenize", json={"model": MODEL, "messages": messages}
    )
    assert status == 200
    assert tok["tokens"] == stack.tokenizer.encode_chat(messages)
    assert tok["token_strs"] is None


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": [{"role": "bogus"}]}, 400, "messages"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
async def test_tokenize_errors(
    stack: Stack, path: str, body: dict, status: int, param: str
) -> None:
    got, err = await call(stack, "POST", path, json=body)
    assert (got, err["error"]["param"]) == (status, param)


async def test_openapi_document_describes_every_route(stack: Stack) -> None:
    status, doc = await call(stack, "GET", "/openapi.json")
    assert status == 200 and doc == openapi_document()
    assert doc["openapi"].startswith("3.")
    described = {(p, m.upper()) for p, ops in doc["paths"].items() for m in ops}
    served = {
        (r.resource.canonical, r.method) for r in stack.app.router.routes() if r.method != "HEAD"
    }
    assert served == described
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        name = ref["$ref"].rsplit("/", 1)[1]
        assert name in doc["components"]["schemas"]


async def test_metrics(stack: Stack) -> None:
    stack.engines["e1"].behaviour.script = [42, 43]
    client = stack.client()
    await client.completions.create(model=MODEL, prompt="x")
    stream = await client.completions.create(model=MODEL, prompt="x", stream=True)
    [c async for c in stream]
    await call(stack, "POST", "/v1/completions", json={"model": "nope", "prompt": "x"})
    status, text = await call(stack, "GET", "/metrics")
    assert status == 200
    assert (
        'pagoda_gateway_requests_total{endpoint="/v1/completions",model="smol",status="200"} 2.0'
        in text
    )
    assert (
        'pagoda_gateway_requests_total{endpoint="/v1/completions",model="other",status="404"} 1.0'
        in text
    )
    assert 'pagoda_gateway_time_to_first_token_seconds_count{model="smol"} 2.0' in text
    assert 'pagoda_gateway_e2e_request_latency_seconds_count{model="smol"} 2.0' in text
    assert 'pagoda_gateway_requests_in_flight{endpoint="/v1/completions",model="smol"} 0.0' in text


async def test_health_and_ready(stack: Stack) -> None:
    assert await call(stack, "GET", "/health") == (200, {"status": "ok"})
    status, body = await call(stack, "GET", "/ready")
    assert status == 200 and body["live_models"] == [MODEL]
    stack.router.down = True
    assert (await call(stack, "GET", "/ready"))[0] == 503
    assert (await call(stack, "GET", "/health"))[0] == 200


async def test_openapi_document_is_valid_openapi() -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(openapi_document())


async def test_unexpected_errors_are_500_in_openai_shape(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.gateway.responses import ResponseBuilder

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("bug")

    stack.engines["e1"].behaviour.script = [42, 43]
    monkeypatch.setattr(ResponseBuilder, "response", boom)
    monkeypatch.setattr(ResponseBuilder, "chunk", boom)
    status, body = await call(
        stack, "POST", "/v1/completions", json={"model": MODEL, "prompt": "x"}
    )
    assert status == 500 and body["error"]["type"] == "server_error"
    status, text = await call(
        stack, "POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}
    )
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]" and '"server_error"' in events[-2]
