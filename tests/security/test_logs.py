"""What the services log never holds an API key (right or wrong), a prompt or an output.

The same traffic runs against the package's stack at the default log level and against a stack
whose gateway and router log at DEBUG (the engine has no log-level flag: it logs at INFO).
Every service's whole stderr is then searched for the key, a marker sent in prompts, the
prompt's token ids and every generated text."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.conftest import KEY_A, complete, http, start_stack, wait_until_served
from tests.support.stack import PagodaStack

DEBUG_KEY = "sk-debug-tenant-Rj4Tq8Wz1Xc6Vb3N"


@pytest.fixture(scope="module")
def debug_stack(fast_model_dir: Path) -> Iterator[PagodaStack]:
    stack = start_stack(
        fast_model_dir,
        engines=1,
        gateway_args=["--log-level", "DEBUG", "--api-key", DEBUG_KEY],
        router_args=["--log-level", "DEBUG"],
    )
    try:
        wait_until_served(stack, DEBUG_KEY)
        yield stack
    finally:
        stack.stop()
        stack.redis.close()


def _chat(stack: PagodaStack, key: str, marker: str, stream: bool) -> str:
    body = {
        "model": stack.model,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "messages": [
            {"role": "system", "content": f"You are {marker} the assistant."},
            {"role": "user", "content": f"Tell me about {marker} please."},
        ],
    }
    r = http("POST", f"{stack.base_url}/chat/completions", body, key)
    assert r.status == 200, r.body
    if not stream:
        return r.body["choices"][0]["message"]["content"]
    text = ""
    for line in r.body.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: ") :])
            text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    return text


def exercise(
    stack: PagodaStack, key: str, marker: str, wrong_key: str, token_ids: list[int]
) -> list[str]:
    """Successful, failing and unauthorised requests carrying ``marker``; returns the outputs."""
    outputs = [
        complete(stack, f"The secret is {marker}. Repeat it:", key, max_tokens=24, ignore_eos=True)[
            "choices"
        ][0]["text"],
        complete(stack, token_ids, key, max_tokens=24, ignore_eos=True)["choices"][0]["text"],
        _chat(stack, key, marker, stream=False),
        _chat(stack, key, marker, stream=True),
    ]
    tokenized = http("POST", f"{stack.gateway.url}/tokenize", {"prompt": marker}, key)
    assert tokenized.status == 200
    base = f"{stack.base_url}/completions"
    failing = [  # (body, key, expected status)
        ({"model": stack.model, "prompt": marker, "max_tokens": 2}, wrong_key, 401),
        ({"model": stack.model, "prompt": marker, "temperature": -1}, key, 400),
        ({"model": f"model-{marker}", "prompt": marker}, key, 404),
        ({"model": stack.model, "prompt": f"{marker} " * 5000, "max_tokens": 2}, key, 400),
        (
            {
                "model": stack.model,
                "prompt": marker,
                "stop": [marker],
                "max_tokens": 2,
                "logit_bias": {"not-a-token": marker},
            },
            key,
            400,
        ),
    ]
    for body, k, status in failing:
        assert http("POST", base, body, k).status == status, body
    return outputs


def assert_nothing_leaked(stack: PagodaStack, secrets: dict[str, str]) -> None:
    logs = {
        "gateway": stack.gateway.log_text(),
        **{f"router-{i}": r.log_text() for i, r in enumerate(stack.routers)},
        **{f"engine-{i}": e.log_text() for i, e in enumerate(stack.engines)},
    }
    assert "request done" in logs["gateway"], "the gateway logged nothing: the test is blind"
    for service, text in logs.items():
        for what, secret in secrets.items():
            assert secret not in text, f"{service} logged {what}: {secret!r}"


def _run_and_check(stack: PagodaStack, key: str) -> None:
    marker = f"QuokkaMarker{uuid.uuid4().hex[:10]}"
    wrong_key = f"sk-wrong-{uuid.uuid4().hex}"
    token_ids = [31000 + (i * 131) % 9000 for i in range(40)]
    outputs = exercise(stack, key, marker, wrong_key, token_ids)
    secrets = {
        "the API key": key,
        "a wrong API key": wrong_key,
        "the prompt marker": marker,
        "prompt token ids": ", ".join(map(str, token_ids[:8])),
        "prompt token ids (no spaces)": ",".join(map(str, token_ids[:8])),
    }
    checked = [o.strip() for o in outputs if len(o.strip()) >= 8]
    assert checked, f"outputs too short to search for: {outputs!r}"
    secrets |= {f"output {i}": o for i, o in enumerate(checked)}
    assert_nothing_leaked(stack, secrets)


def test_default_level_logs_hold_no_key_prompt_or_output(keyed_stack: PagodaStack) -> None:
    _run_and_check(keyed_stack, KEY_A)


_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
_LINE = re.compile(_STAMP.pattern + r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) (\S+) \S+: ")


def test_every_service_logs_in_the_one_format(keyed_stack: PagodaStack) -> None:
    """services.common.logs: every process of the stack writes the same line format, naming
    its role (the engine's core process its own)."""
    expected = {"gateway": {"gateway"}, "router": {"router"}, "engine": {"engine", "engine-core"}}
    logs = {
        "gateway": keyed_stack.gateway.log_text(),
        "router": keyed_stack.routers[0].log_text(),
        "engine": keyed_stack.engines[0].log_text(),
    }
    for service, text in logs.items():
        stamped = [line for line in text.splitlines() if _STAMP.match(line)]
        assert stamped, f"{service} logged nothing"
        roles = set()
        for line in stamped:
            m = _LINE.match(line)
            assert m, f"{service} logged a line in another format: {line!r}"
            roles.add(m.group(2))
        assert service in roles and roles <= expected[service], (service, roles)


def test_debug_level_logs_hold_no_key_prompt_or_output(debug_stack: PagodaStack) -> None:
    _run_and_check(debug_stack, DEBUG_KEY)
    router_log = debug_stack.routers[0].log_text()
    assert "DEBUG" in router_log and "DEBUG" in debug_stack.gateway.log_text(), (
        "DEBUG logging did not take effect: the test is blind to debug-only leaks"
    )
