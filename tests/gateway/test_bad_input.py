"""Bad input against a real stack (redis, engine, router, gateway processes): every refusal is a
4xx in OpenAI's error shape that names the param, never a 5xx, and the gateway keeps serving.

Invalid JSON, wrong types, max_tokens out of range or past the context, n too large, empty
prompts, prompts over the context, unknown models, invalid UTF-8 and lone surrogates, bad
Content-Encoding, a 10 MB body, a slowloris body (408 after ``--body-read-timeout``), logprobs
out of range and stop lists too long. The limits are ``services.protocol.openai``'s.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests

from services.protocol import openai as oa
from tests.gateway.conftest import MODEL, Stack
from tests.support.stack import PagodaStack

BODY_READ_TIMEOUT_S = 3.0
CONTEXT = 4096  # fast_model_dir's max_position_embeddings
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
BODY_PATHS = (*GENERATION_PATHS, "/tokenize", "/detokenize")


@pytest.fixture(scope="module")
def pagoda(fast_model_dir: Path) -> Iterator[PagodaStack]:
    args = ["--body-read-timeout", str(BODY_READ_TIMEOUT_S)]
    with PagodaStack(fast_model_dir, engines=1, routers=1, gateway_args=args) as stack:
        yield stack


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


# -- helpers --------------------------------------------------------------------------------


def completion(pagoda: PagodaStack, **fields: Any) -> dict[str, Any]:
    return {"model": pagoda.model, "prompt": "hello", "max_tokens": 2, **fields}


def chat(pagoda: PagodaStack, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "hello"}]
    return {"model": pagoda.model, "messages": messages, "max_tokens": 2, **fields}


def body_for(pagoda: PagodaStack, path: str, **fields: Any) -> dict[str, Any]:
    return chat(pagoda, **fields) if "chat" in path else completion(pagoda, **fields)


def post(
    http: requests.Session, pagoda: PagodaStack, path: str, body: Any = None, **kwargs: Any
) -> requests.Response:
    if body is not None:
        kwargs["json"] = body
    return http.post(pagoda.gateway.url + path, timeout=60, **kwargs)


def openai_error(resp: requests.Response, status: int) -> dict[str, Any]:
    """The ``error`` object of an OpenAI-shaped error response with ``status``."""
    assert resp.status_code == status, resp.text[:500]
    assert resp.headers["Content-Type"].startswith("application/json"), resp.headers
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    return err


def bad_request(resp: requests.Response, param: str | None) -> dict[str, Any]:
    err = openai_error(resp, 400)
    assert (err["type"], err["param"]) == ("invalid_request_error", param), err
    return err


def assert_serving(http: requests.Session, pagoda: PagodaStack) -> None:
    resp = post(http, pagoda, "/v1/completions", completion(pagoda, max_tokens=1))
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 1


# -- JSON and types -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [b"{not json", b"", b"   ", b"[1, 2]", b'"text"', b"null", b'{"model": ', b"[" * 100_000],
    ids=["garbage", "empty", "blank", "array", "string", "null", "truncated", "too-deep"],
)
def test_invalid_json_is_400(http: requests.Session, pagoda: PagodaStack, data: bytes) -> None:
    for path in BODY_PATHS:
        resp = post(http, pagoda, path, data=data, headers={"Content-Type": "application/json"})
        bad_request(resp, None)


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/completions", {"top_p": [0.5]}, "top_p"),
        ("/v1/completions", {"top_k": 1.5}, "top_k"),
        ("/v1/completions", {"seed": "7"}, "seed"),
        ("/v1/completions", {"n": True}, "n"),
        ("/v1/completions", {"n": 2.0}, "n"),
        ("/v1/completions", {"max_tokens": "16"}, "max_tokens"),
        ("/v1/completions", {"min_tokens": {"a": 1}}, "min_tokens"),
        ("/v1/completions", {"presence_penalty": "0"}, "presence_penalty"),
        ("/v1/completions", {"ignore_eos": "yes"}, "ignore_eos"),
        ("/v1/completions", {"stop_token_ids": 5}, "stop_token_ids"),
        ("/v1/completions", {"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        # Integers too big for the engine wire format (64 bits) must be refused up front.
        ("/v1/completions", {"stop_token_ids": [2**64]}, "stop_token_ids"),
        ("/v1/completions", {"top_k": 2**70}, "top_k"),
        ("/v1/completions", {"min_tokens": 2**70}, "min_tokens"),
        ("/v1/chat/completions", {"stop_token_ids": [2**31]}, "stop_token_ids"),
        ("/v1/completions", {"stop": 5}, "stop"),
        ("/v1/completions", {"stop": ["ok", 5]}, "stop"),
        ("/v1/completions", {"stop": [[[["deep"]]]]}, "stop"),
        ("/v1/completions", {"stream": 1}, "stream"),
        ("/v1/completions", {"stream": True, "stream_options": []}, "stream_options"),
        (
            "/v1/completions",
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
        ),
        ("/v1/completions", {"echo": "no"}, "echo"),
        ("/v1/completions", {"logprobs": "2"}, "logprobs"),
        ("/v1/completions", {"user": 5}, "user"),
        ("/v1/completions", {"cache_salt": 5}, "cache_salt"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": {"text": "x"}}, "prompt"),
        ("/v1/completions", {"prompt": [1, "two"]}, "prompt"),
        ("/v1/completions", {"prompt": [-1]}, "prompt"),
        ("/v1/completions", {"model": 3}, "model"),
        ("/v1/completions", {"model": ""}, "model"),  # null: the served model
        ("/v1/chat/completions", {"messages": "hello"}, "messages"),
        ("/v1/chat/completions", {"messages": ["hello"]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": ["user"]}]}, "messages"),
        ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
        ("/v1/chat/completions", {"max_completion_tokens": "5"}, "max_completion_tokens"),
        ("/v1/chat/completions", {"chat_template_kwargs": []}, "chat_template_kwargs"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_wrong_types_are_400_naming_the_param(
    http: requests.Session, pagoda: PagodaStack, path: str, fields: dict, param: str
) -> None:
    err = bad_request(post(http, pagoda, path, body_for(pagoda, path, **fields)), param)
    assert len(err["message"]) < 600  # a bad value is quoted briefly, never echoed whole


def test_a_huge_bad_value_is_not_echoed_back(http: requests.Session, pagoda: PagodaStack) -> None:
    resp = post(http, pagoda, "/v1/completions", completion(pagoda, temperature="x" * 1_000_000))
    err = bad_request(resp, "temperature")
    assert len(err["message"]) < 200 and len(resp.content) < 1000


# -- max_tokens, n, logprobs, stop ----------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, -(10**30), 1.5, 16.0, "16", [16]])
def test_max_tokens_out_of_range_is_400(
    http: requests.Session, pagoda: PagodaStack, value: Any
) -> None:
    for path, name in (
        ("/v1/completions", "max_tokens"),
        ("/v1/chat/completions", "max_tokens"),
        ("/v1/chat/completions", "max_completion_tokens"),
    ):
        body = body_for(pagoda, path)
        body.pop("max_tokens")
        body[name] = value
        err = bad_request(post(http, pagoda, path, body), name)
        assert err["message"].startswith(f"{name} must be a positive integer"), err


@pytest.mark.parametrize("value", [CONTEXT + 1, 10**6, 10**30])
def test_max_tokens_past_the_context_is_400_like_vllm(
    http: requests.Session, pagoda: PagodaStack, value: int
) -> None:
    for path, name in (
        ("/v1/completions", "max_tokens"),
        ("/v1/chat/completions", "max_completion_tokens"),
    ):
        body = body_for(pagoda, path)
        body.pop("max_tokens")
        body[name] = value
        err = bad_request(post(http, pagoda, path, body), name)
        assert err["code"] == "context_length_exceeded", err
        assert err["message"].startswith(
            f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
        ), err
        assert f"{value} for the completion" in err["message"] and name in err["message"]


def test_n_limits(http: requests.Session, pagoda: PagodaStack) -> None:
    for path in GENERATION_PATHS:
        for n in (0, -3):
            bad_request(post(http, pagoda, path, body_for(pagoda, path, n=n)), "n")
        err = bad_request(post(http, pagoda, path, body_for(pagoda, path, n=oa.MAX_N + 1)), "n")
        assert f"at most {oa.MAX_N}" in err["message"], err
        bad_request(post(http, pagoda, path, body_for(pagoda, path, n=10**12)), "n")
    prompts = ["hi"] * (oa.MAX_CHOICES // oa.MAX_N + 1)
    resp = post(http, pagoda, "/v1/completions", completion(pagoda, prompt=prompts, n=oa.MAX_N))
    assert f"at most {oa.MAX_CHOICES}" in bad_request(resp, "n")["message"]
    too_many = ["hi"] * (oa.MAX_PROMPTS + 1)
    bad_request(
        post(http, pagoda, "/v1/completions", completion(pagoda, prompt=too_many)), "prompt"
    )
    # The limit itself is served.
    resp = post(http, pagoda, "/v1/completions", completion(pagoda, n=oa.MAX_N, max_tokens=1))
    assert resp.status_code == 200 and len(resp.json()["choices"]) == oa.MAX_N


def test_logprobs_out_of_range(http: requests.Session, pagoda: PagodaStack) -> None:
    top = oa.MAX_COMPLETION_LOGPROBS
    for value in (top + 1, -1, 10**6):
        resp = post(http, pagoda, "/v1/completions", completion(pagoda, logprobs=value))
        assert f"[0, {top}]" in bad_request(resp, "logprobs")["message"]
    for value in (oa.MAX_TOP_LOGPROBS + 1, -1):
        body = chat(pagoda, logprobs=True, top_logprobs=value)
        err = bad_request(post(http, pagoda, "/v1/chat/completions", body), "top_logprobs")
        assert f"[0, {oa.MAX_TOP_LOGPROBS}]" in err["message"]
    body = chat(pagoda, top_logprobs=2)  # without logprobs: true
    bad_request(post(http, pagoda, "/v1/chat/completions", body), "top_logprobs")
    # The limits themselves are served.
    resp = post(http, pagoda, "/v1/completions", completion(pagoda, logprobs=top, max_tokens=1))
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= top
    body = chat(pagoda, logprobs=True, top_logprobs=oa.MAX_TOP_LOGPROBS, max_tokens=1)
    resp = post(http, pagoda, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert len(content[0]["top_logprobs"]) == oa.MAX_TOP_LOGPROBS


def test_stop_lists_too_long(http: requests.Session, pagoda: PagodaStack) -> None:
    for path in GENERATION_PATHS:
        stops = [f"s{i}" for i in range(oa.MAX_STOP + 1)]
        err = bad_request(post(http, pagoda, path, body_for(pagoda, path, stop=stops)), "stop")
        assert f"at most {oa.MAX_STOP}" in err["message"], err
        bad_request(post(http, pagoda, path, body_for(pagoda, path, stop=[""])), "stop")
        resp = post(http, pagoda, path, body_for(pagoda, path, stop=stops[: oa.MAX_STOP]))
        assert resp.status_code == 200, resp.text


# -- prompts and models ---------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["", [], [""], ["ok", ""], [[]], [[1], []]])
def test_empty_prompt_is_400(http: requests.Session, pagoda: PagodaStack, prompt: Any) -> None:
    bad_request(post(http, pagoda, "/v1/completions", completion(pagoda, prompt=prompt)), "prompt")


def test_empty_messages_are_400(http: requests.Session, pagoda: PagodaStack) -> None:
    for messages in ([], None, [{}], [{"content": "no role"}]):
        body = chat(pagoda, messages=messages)
        bad_request(post(http, pagoda, "/v1/chat/completions", body), "messages")


def test_prompt_over_the_context_is_400(http: requests.Session, pagoda: PagodaStack) -> None:
    for prompt in ([1] * CONTEXT, [[5], [1] * (CONTEXT + 10)], "hello " * (CONTEXT + 10)):
        body = completion(pagoda, prompt=prompt)
        err = bad_request(post(http, pagoda, "/v1/completions", body), "prompt")
        assert err["code"] == "context_length_exceeded"
        assert f"maximum context length is {CONTEXT} tokens" in err["message"], err
    body = chat(pagoda, messages=[{"role": "user", "content": "hello " * (CONTEXT + 10)}])
    err = bad_request(post(http, pagoda, "/v1/chat/completions", body), "messages")
    assert err["code"] == "context_length_exceeded"
    # One token short of the context leaves room for exactly one.
    body = completion(pagoda, prompt=[1] * (CONTEXT - 1), max_tokens=1)
    assert post(http, pagoda, "/v1/completions", body).status_code == 200


def test_unknown_model_is_404(http: requests.Session, pagoda: PagodaStack) -> None:
    for path in BODY_PATHS:
        body = {**body_for(pagoda, path), "model": "no-such-model", "tokens": [1]}
        err = openai_error(post(http, pagoda, path, body), 404)
        assert (err["type"], err["param"], err["code"]) == (
            "not_found_error",
            "model",
            "model_not_found",
        ), err
        assert "no-such-model" in err["message"]


# -- encodings ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"caf\xc3", b"\xf8\x88\x80\x80\x80"],
    ids=["invalid-byte", "overlong", "utf8-surrogate", "truncated", "five-byte"],
)
def test_invalid_utf8_is_400(http: requests.Session, pagoda: PagodaStack, raw: bytes) -> None:
    for path in BODY_PATHS:
        data = json.dumps(body_for(pagoda, path, prompt="PROMPT")).encode()
        data = data.replace(b"PROMPT", b"ok " + raw)
        resp = post(http, pagoda, path, data=data, headers={"Content-Type": "application/json"})
        assert "UTF-8" in bad_request(resp, None)["message"]


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/completions", {"prompt": "a\ud800b"}),
        ("/v1/completions", {"prompt": ["ok", "\udfff"]}),
        ("/v1/completions", {"stop": ["\ud83d"]}),
        ("/v1/completions", {"user": "\udc00"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}),
        ("/v1/chat/completions", {"chat_template_kwargs": {"\ud800": 1}}),
        ("/tokenize", {"prompt": "\ud800"}),
    ],
)
def test_lone_surrogate_escapes_are_400(
    http: requests.Session, pagoda: PagodaStack, path: str, fields: dict
) -> None:
    body = body_for(pagoda, path, **fields) if path in GENERATION_PATHS else fields
    data = json.dumps(body)  # ASCII: the lone surrogate goes as a JSON escape
    assert "\\ud" in data
    resp = post(http, pagoda, path, data=data, headers={"Content-Type": "application/json"})
    assert "surrogate" in bad_request(resp, None)["message"]


def test_surrogate_pairs_and_escaped_backslashes_are_fine(
    http: requests.Session, pagoda: PagodaStack
) -> None:
    emoji = "smile \U0001f600"
    headers = {"Content-Type": "application/json"}
    for text in (emoji, "a literal \\ud800 in text"):
        escaped = json.dumps({"prompt": text})  # ASCII: the emoji goes as a surrogate pair
        assert "\\ud" in escaped
        raw = json.dumps({"prompt": text}, ensure_ascii=False).encode()
        resp = post(http, pagoda, "/tokenize", data=escaped, headers=headers)
        direct = post(http, pagoda, "/tokenize", data=raw, headers=headers)
        assert resp.status_code == direct.status_code == 200, resp.text
        assert resp.json()["tokens"] == direct.json()["tokens"]
    resp = post(http, pagoda, "/v1/completions", completion(pagoda, prompt=emoji))
    assert resp.status_code == 200, resp.text


def test_bad_content_encoding_is_400(http: requests.Session, pagoda: PagodaStack) -> None:
    body = json.dumps(completion(pagoda, max_tokens=1)).encode()
    for encoding, data in (("gzip", b"not gzip at all"), ("deflate", b"\x00\x01garbage")):
        headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
        resp = post(http, pagoda, "/v1/completions", data=data, headers=headers)
        assert "could not be read" in bad_request(resp, None)["message"]
        assert resp.headers["Connection"].lower() == "close"  # the rest of the body is unread
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    resp = post(http, pagoda, "/v1/completions", data=gzip.compress(body)[:-12], headers=headers)
    assert "not valid JSON" in bad_request(resp, None)["message"]  # truncated: what came is JSON
    resp = post(http, pagoda, "/v1/completions", data=gzip.compress(body), headers=headers)
    assert resp.status_code == 200, resp.text
    assert_serving(http, pagoda)


# -- size and time --------------------------------------------------------------------------


def test_ten_megabyte_body_is_413(http: requests.Session, pagoda: PagodaStack) -> None:
    big = json.dumps(completion(pagoda, prompt="x" * (10 * 1024 * 1024))).encode()
    resp = post(
        http, pagoda, "/v1/completions", data=big, headers={"Content-Type": "application/json"}
    )
    err = openai_error(resp, 413)
    assert err["type"] == "invalid_request_error" and "too large" in err["message"]
    assert resp.headers["Connection"].lower() == "close"

    def chunks() -> Iterator[bytes]:  # no Content-Length: caught while reading
        for i in range(0, len(big), 256 * 1024):
            yield big[i : i + 256 * 1024]

    resp = post(
        http, pagoda, "/tokenize", data=chunks(), headers={"Content-Type": "application/json"}
    )
    openai_error(resp, 413)
    assert_serving(http, pagoda)


def _send_headers(pagoda: PagodaStack, length: int, first: bytes) -> socket.socket:
    port = int(pagoda.gateway.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()
    sock.sendall(head + first)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def test_slow_body_gets_408_and_others_are_served(
    http: requests.Session, pagoda: PagodaStack
) -> None:
    """Slowloris: clients that send headers, then dribble (or stall) the body get a 408 once
    --body-read-timeout has passed, while everyone else is served as usual."""
    assert_serving(http, pagoda)
    stop = threading.Event()
    slow = [_send_headers(pagoda, 1000, b'{"model": ') for _ in range(8)]
    stalled = _send_headers(pagoda, 1000, b"")
    started = time.monotonic()

    def dribble() -> None:
        while not stop.wait(0.2):
            for sock in slow:
                try:
                    sock.send(b" ")
                except OSError:
                    pass

    dribbler = threading.Thread(target=dribble, daemon=True)
    dribbler.start()
    try:
        t = time.monotonic()
        assert_serving(http, pagoda)  # while the slow ones are pending
        assert post(http, pagoda, "/tokenize", {"prompt": "hi"}).status_code == 200
        assert time.monotonic() - t < BODY_READ_TIMEOUT_S
        for sock in [*slow, stalled]:
            status, headers, body = _read_response(sock)
            elapsed = time.monotonic() - started
            assert status == 408, body
            assert BODY_READ_TIMEOUT_S * 0.9 <= elapsed < BODY_READ_TIMEOUT_S + 5, elapsed
            assert headers["connection"].lower() == "close"
            err = json.loads(body)["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error"
    finally:
        stop.set()
        dribbler.join()
        for sock in [*slow, stalled]:
            sock.close()
    assert_serving(http, pagoda)


def test_a_body_that_arrives_in_time_is_served(http: requests.Session, pagoda: PagodaStack) -> None:
    body = json.dumps(completion(pagoda, max_tokens=1)).encode()
    sock = _send_headers(pagoda, len(body), body[:10])
    try:
        time.sleep(BODY_READ_TIMEOUT_S / 4)
        sock.sendall(body[10:])
        status, _, data = _read_response(sock)
        assert status == 200, data
    finally:
        sock.close()


# -- limits are documented, handler bugs stay JSON --------------------------------------------


def test_openapi_document_states_the_limits(http: requests.Session, pagoda: PagodaStack) -> None:
    doc = http.get(pagoda.gateway.url + "/openapi.json", timeout=10).json()
    schemas = doc["components"]["schemas"]
    completions = schemas["CompletionRequest"]["properties"]
    chat_props = schemas["ChatCompletionRequest"]["properties"]
    assert completions["n"]["maximum"] == chat_props["n"]["maximum"] == oa.MAX_N
    assert completions["logprobs"]["maximum"] == oa.MAX_COMPLETION_LOGPROBS
    assert chat_props["top_logprobs"]["maximum"] == oa.MAX_TOP_LOGPROBS
    assert completions["stop"]["oneOf"][1]["maxItems"] == oa.MAX_STOP
    for path in BODY_PATHS:
        assert {"400", "408", "413"} <= set(doc["paths"][path]["post"]["responses"])


@pytest.mark.asyncio
async def test_a_handler_bug_is_a_json_500_even_for_browsers(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(body: object) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(oa, "parse_completion_request", boom)
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            stack.url + "/v1/completions",
            json={"model": MODEL, "prompt": "x"},
            headers={"Accept": "text/html"},
        ) as resp,
    ):
        assert resp.status == 500 and resp.content_type == "application/json"
        err = (await resp.json())["error"]
    assert err == {
        "message": "internal server error",
        "type": "server_error",
        "param": None,
        "code": None,
    }
