"""Schemathesis fuzzes a real stack (redis, engine, router, gateway) from its own /openapi.json:
every operation, with data that fits the schema (positive) and data that does not (negative).

For every case: no 5xx; every 4xx is OpenAI's error JSON ({"error": {message, type, param,
code}}); every response conforms to the document (status codes, content types, schemas: SSE
events included). Otherwise-valid generation requests are kept cheap: max_tokens at most 16
and n at most 4 when they ask for more, max_tokens 16 when absent. Values outside the limits
pass through untouched, so the validation paths are fuzzed too.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from services.protocol import openai as oa
from tests.support.stack import PagodaStack

# Examples per (operation, mode); operations without inputs run once.
EXAMPLES = {
    "/v1/completions": 60,
    "/v1/chat/completions": 60,
    "/tokenize": 40,
    "/detokenize": 40,
    "/v1/models": 5,
}
MAX_TOKENS = 16
MAX_N = 4
CONTEXT = 4096  # fast_model_dir's max_position_embeddings
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
GENERATION = ("/v1/completions", "/v1/chat/completions")

# (path, mode) -> Counter of statuses; printed at the end of the module (pytest -s).
SEEN: dict[tuple[str, str], Counter[int]] = {}


@pytest.fixture(scope="module")
def pagoda(fast_model_dir: Path) -> Iterator[PagodaStack]:
    with PagodaStack(fast_model_dir, engines=1, routers=1) as stack:
        yield stack
    for (path, mode), statuses in sorted(SEEN.items()):
        print(
            f"fuzz {path} {mode}: {sum(statuses.values())} cases {dict(sorted(statuses.items()))}"
        )


@pytest.fixture(scope="module")
def schema(pagoda: PagodaStack) -> schemathesis.BaseSchema:
    # Streams are read to their end (schemathesis stops after 20 events by default).
    config = schemathesis.Config.from_dict({"max-stream-events": 1_000_000})
    return schemathesis.openapi.from_url(
        pagoda.gateway.url + "/openapi.json", config=config, timeout=10
    )


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


def _operations() -> list[tuple[str, str, GenerationMode]]:
    """(method, path, mode) of every operation of the document, read without a server."""
    from services.gateway.openapi import openapi_document

    out = []
    for path, ops in openapi_document()["paths"].items():
        for method, op in ops.items():
            modes = [GenerationMode.POSITIVE]
            if "requestBody" in op:  # nothing to negate without inputs
                modes.append(GenerationMode.NEGATIVE)
            out += [(method.upper(), path, mode) for mode in modes]
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def keep_cheap(body: Any) -> None:
    """Caps what a generation request may cost, leaving invalid values alone."""
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if _is_int(value) and MAX_TOKENS < value <= CONTEXT:
            body[name] = MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    n = body.get("n")
    if _is_int(n) and MAX_N < n <= oa.MAX_N:
        body["n"] = MAX_N


def content_type(resp: schemathesis.Response) -> str:
    return resp.headers.get("content-type", [""])[0]


def assert_openai_error(resp: schemathesis.Response) -> None:
    assert content_type(resp).startswith("application/json"), resp.headers
    body = json.loads(resp.content)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)


def assert_complete_stream(resp: schemathesis.Response) -> None:
    assert not resp.stream_cut_short
    text = resp.content.decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
    assert events and events[-1] == "[DONE]", text[-500:]
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, chunk  # a healthy stack never fails mid-stream


@pytest.mark.parametrize(
    ("method", "path", "mode"), _operations(), ids=lambda v: str(v).strip("/") or "root"
)
def test_fuzz(
    schema: schemathesis.BaseSchema,
    pagoda: PagodaStack,
    http: requests.Session,
    method: str,
    path: str,
    mode: GenerationMode,
) -> None:
    operation = schema[path][method]
    statuses = SEEN.setdefault((path, str(mode)), Counter())

    @settings(
        max_examples=EXAMPLES.get(path, 1),
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    # Hypothesis leans to the first choice: mostly the served model, so cases get past the 404.
    @given(case=operation.as_strategy(mode), our_model=st.sampled_from([True, True, False]))
    def run(case: schemathesis.Case, our_model: bool) -> None:
        if isinstance(case.body, dict) and our_model and "model" in case.body:
            case.body["model"] = pagoda.model  # mostly the served model: past the 404
        if path in GENERATION:
            keep_cheap(case.body)
        resp = case.call(session=http, timeout=60)
        statuses[resp.status_code] += 1
        assert resp.status_code < 500, resp.content[:1000]
        if resp.status_code >= 400:
            assert_openai_error(resp)
        elif content_type(resp).startswith("text/event-stream"):
            assert_complete_stream(resp)
        case.validate_response(resp, checks=CHECKS)

    run()
    if mode == GenerationMode.POSITIVE and path in (*GENERATION, "/tokenize", "/detokenize"):
        # The fuzz got past validation: it reached the engines (or the tokenizer).
        assert statuses[200] > 0, statuses
