"""API keys on a real gateway: probes and scrapes open, everything else behind a key, 401s in
OpenAI's error shape, and keys compared in constant time."""

from __future__ import annotations

import hmac

import openai
import pytest

from services.gateway import auth
from tests.security.conftest import KEY_A, KEY_B, Reply, complete, http
from tests.support.stack import PagodaStack

# Open by design: liveness/readiness probes and Prometheus carry no key, schema tools neither.
OPEN = [("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics"), ("GET", "/metrics/engines"),
        ("GET", "/openapi.json"), ("GET", "/version")]
PROTECTED = [
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models/pagoda-tiny"),
    ("POST", "/v1/embeddings"),  # not served: still 401 first, so paths cannot be probed
    ("GET", "/admin"),
]
WRONG = {
    "no header": None,
    "wrong key": "sk-not-a-key",
    "empty bearer": "Bearer ",
    "other scheme": f"Basic {KEY_A}",
    "key plus a character": f"Bearer {KEY_A}x",
    "key less a character": f"Bearer {KEY_A[:-1]}",
    "the key upper-cased": f"Bearer {KEY_A.upper()}",
    "both keys": f"Bearer {KEY_A},{KEY_B}",
}


def _body_for(path: str, model: str) -> dict | None:
    if path == "/v1/completions":
        return {"model": model, "prompt": "hello", "max_tokens": 1}
    if path == "/v1/chat/completions":
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    if path == "/tokenize":
        return {"model": model, "prompt": "hello"}
    if path == "/detokenize":
        return {"model": model, "tokens": [1, 2, 3]}
    return {} if path.startswith("/v1/embeddings") else None


def _call(stack: PagodaStack, method: str, path: str, authorization: str | None) -> Reply:
    headers = {} if authorization is None else {"Authorization": authorization}
    return http(method, stack.gateway.url + path, _body_for(path, stack.model), headers=headers)


def _assert_openai_401(r: Reply, what: str) -> None:
    assert r.status == 401, (what, r.status, r.body)
    assert r.headers.get("WWW-Authenticate") == "Bearer", what
    assert r.headers.get("Content-Type", "").startswith("application/json"), what
    err = r.body["error"]
    assert err["code"] == "invalid_api_key" and err["type"] and err["message"], (what, err)
    assert KEY_A not in str(r.body) and KEY_B not in str(r.body)


@pytest.mark.parametrize(("method", "path"), OPEN)
def test_health_metrics_ready_and_schema_are_open(
    keyed_stack: PagodaStack, method: str, path: str
) -> None:
    for authorization in (None, "Bearer sk-not-a-key"):
        r = _call(keyed_stack, method, path, authorization)
        assert r.status == 200, (path, authorization, r.body)


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_everything_else_needs_a_valid_key(
    keyed_stack: PagodaStack, method: str, path: str
) -> None:
    for what, authorization in WRONG.items():
        _assert_openai_401(_call(keyed_stack, method, path, authorization), f"{path}: {what}")


@pytest.mark.parametrize("key", [KEY_A, KEY_B], ids=["flag-key", "env-key"])
def test_each_configured_key_is_served(keyed_stack: PagodaStack, key: str) -> None:
    for method, path in PROTECTED[:5]:
        r = _call(keyed_stack, method, path, f"Bearer {key}")
        assert r.status == 200, (path, r.body)
    # The scheme is case-insensitive, as RFC 6750 has it.
    assert _call(keyed_stack, "GET", "/v1/models", f"bearer {key}").status == 200
    assert complete(keyed_stack, "hello", key)["choices"][0]["text"] is not None


def test_openai_client_sees_an_authentication_error(keyed_stack: PagodaStack) -> None:
    bad = openai.OpenAI(base_url=keyed_stack.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.completions.create(model=keyed_stack.model, prompt="hi", max_tokens=1)
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
    good = openai.OpenAI(base_url=keyed_stack.base_url, api_key=KEY_B, max_retries=0)
    assert good.models.list().data[0].id == keyed_stack.model


def test_keys_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every configured key goes through ``hmac.compare_digest``, whichever matches (or none),
    so neither the comparison nor the number of comparisons depends on the key sent.
    (A wall-clock test over HTTP could not see nanoseconds; this checks the mechanism.)"""
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys = ["k-first-0000", "k-second-111", "k-third-2222"]
    checker = auth.ApiKeyAuth(keys)
    for sent, matches in [
        ("k-first-0000", True),
        ("k-third-2222", True),
        ("k-first-0001", False),
        ("x", False),
    ]:
        compared.clear()
        if matches:
            assert checker.authenticate(f"Bearer {sent}") == auth.tenant_id(sent)
        else:
            with pytest.raises(auth.OpenAIError):
                checker.authenticate(f"Bearer {sent}")
        assert sorted(b for _, b in compared) == sorted(k.encode() for k in keys), sent
        assert all(a == sent.encode() for a, _ in compared)
