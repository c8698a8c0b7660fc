"""A Gateway API pool's data path through real processes, the test playing Envoy: the router's
endpoint picker (ext_proc over gRPC, with ``--ext-proc-target-port`` as the chart sets it)
picks an engine, and the OpenAI request goes to exactly the address it answered: the engine's
OpenAI front, Pagoda's gateway pinned to that engine (``--engine-url``), with API keys on.

The engines are the e2e stack's (no engine starts here); a picker router and the front start
beside them. No Envoy runs: what one does with the answer (send the request to the endpoint in
``x-gateway-destination-endpoint``) is the step the test takes itself."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import MODEL, Stack
from tests.router import ext_proc_client as ep
from tests.support.redis_server import free_port
from tests.support.services import ServiceProcess, stop_all

KEY = "sk-pool-client"
MESSAGES = [{"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 8


@dataclass
class Pool:
    picker_port: int
    front: ServiceProcess  # the OpenAI front of the stack's first engine


@pytest.fixture(scope="module")
def pool(stack: Stack, default_model_path: Path) -> Iterator[Pool]:
    engine = stack.engines[0]
    front_port, picker_port = free_port(), free_port()
    # The picker may choose only the first engine (static discovery), as an InferencePool's
    # picker chooses among its pool's pods: the answer is then one known pod's front.
    router = ServiceProcess(
        "services.router",
        ["--host", "127.0.0.1", "--redis-url", stack.redis.url, "--engines", engine.url,
         "--ext-proc-port", str(picker_port), "--ext-proc-target-port", str(front_port),
         "--tokenizer", f"{MODEL}={default_model_path}"],
        health_path="/ready",
    )
    front = ServiceProcess(
        "services.gateway",
        ["--host", "127.0.0.1", "--engine-url", engine.url,
         "--model", f"{MODEL}={default_model_path}"],
        port=front_port,
        env={"PAGODA_API_KEYS": KEY},
        health_path="/ready",  # 200 once the engine beside it serves
    )
    try:
        router.launch()
        front.launch()
        router.wait_healthy()
        front.wait_healthy()
        yield Pool(picker_port, front)
    finally:
        stop_all((front, router))


async def _pick(port: int, body: bytes) -> list[str]:
    """The endpoints the picker answers for ``body``, as Envoy would send it (full duplex)."""
    async with ep.ext_proc_stub(port) as stub, ep.stream(stub) as s:
        await s.send(ep.headers(key=KEY), ep.body(body, True))
        answer = await s.read(timeout=60)
        assert answer.WhichOneof("response") == "request_headers", answer
        return ep.header_mutation(answer.request_headers.response)[
            "x-gateway-destination-endpoint"].split(",")


def picked(pool: Pool, **request: object) -> str:
    body = json.dumps({"model": MODEL, "messages": MESSAGES, **request}).encode()
    endpoints = asyncio.run(_pick(pool.picker_port, body))
    assert len(set(endpoints)) == 1, endpoints  # one engine in the pool
    return endpoints[0]


def test_the_picked_endpoint_answers_openai_with_the_models_output(
    pool: Pool, stack: Stack
) -> None:
    endpoint = picked(pool, max_tokens=MAX_TOKENS, temperature=0)
    host, _, port = endpoint.rpartition(":")
    # The front's port, never the engine's internal one.
    assert int(port) == pool.front.port != stack.engines[0].port
    assert host in ("127.0.0.1", "localhost")
    with (openai.OpenAI(base_url=f"http://{endpoint}/v1", api_key=KEY, max_retries=0,
                        timeout=120) as front,
          openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0,
                        timeout=120) as reference):
        chat = front.chat.completions.create(model=MODEL, messages=MESSAGES,
                                             max_tokens=MAX_TOKENS, temperature=0)
        text = chat.choices[0].message.content
        assert text and chat.usage.completion_tokens <= MAX_TOKENS
        # The same greedy output as through Pagoda's own gateway and router: the same model.
        expected = reference.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                     max_tokens=MAX_TOKENS, temperature=0)
        assert text == expected.choices[0].message.content
        chunks = list(front.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
        assert [m.id for m in front.models.list().data] == [MODEL]


def test_the_front_enforces_the_gateways_api_keys(pool: Pool) -> None:
    with (openai.OpenAI(base_url=f"{pool.front.url}/v1", api_key="sk-wrong", max_retries=0,
                        timeout=30) as wrong,
          pytest.raises(openai.AuthenticationError) as exc):
        wrong.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert exc.value.status_code == 401
    # No key at all (the openai client always sends one): a bare request.
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{pool.front.url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 401
