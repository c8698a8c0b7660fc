"""kv_transfer_params on the OpenAI API, as vLLM's P/D proxy drives it: the prefill leg
(max_tokens 1, do_remote_decode) answers with the params, the decode leg sent them answers as
one aggregated request would, on completions and chat completions; bad params are a 400
naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support.stack import PagodaStack

BS = 16
TOKEN = "kv-params-gateway-test-token-0123456789"


@pytest.fixture(scope="module")
def pagoda(fast_model_dir: Path) -> Iterator[PagodaStack]:
    config = json.dumps({"kv_connector": "PagodaPDConnector", "kv_role": "kv_both"})
    args = ["--kv-transfer-config", config, "--block-size", str(BS)]
    with PagodaStack(fast_model_dir, engines=2, routers=1, policy="round-robin",
                     engine_args=[args, args], env={"PAGODA_INTERNAL_TOKENS": TOKEN}) as stack:
        yield stack


def _post(pagoda: PagodaStack, path: str, **fields: Any) -> requests.Response:
    body = {"model": pagoda.model, "temperature": 0, "ignore_eos": True, **fields}
    return requests.post(f"{pagoda.base_url}/{path}", json=body, timeout=60)


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_prefill_then_decode_legs_answer_as_one_request(pagoda: PagodaStack, path: str) -> None:
    if path == "completions":
        prompt: dict[str, Any] = {"prompt": [7 + (i * 29) % 700 for i in range(3 * BS + 5)]}
    else:
        prompt = {"messages": [{"role": "user", "content": "tell me " * 40}]}
    first = _post(pagoda, path, max_tokens=1, kv_transfer_params={"do_remote_decode": True},
                  **prompt)
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_num_blocks"] >= 3
    decode = _post(pagoda, path, max_tokens=8, kv_transfer_params=params, **prompt)
    assert decode.status_code == 200, decode.text
    alone = _post(pagoda, path, max_tokens=8, **prompt)
    assert "kv_transfer_params" not in alone.json()
    text = "text" if path == "completions" else "message"
    assert decode.json()["choices"][0][text] == alone.json()["choices"][0][text]
    usage = decode.json()["usage"]
    tokens = usage["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == (tokens - 1) // BS * BS


def test_bad_kv_transfer_params_are_refused(pagoda: PagodaStack) -> None:
    for bad in ([1], {"a": {"b": 1}}, {"x": "y" * 1000}):
        resp = _post(pagoda, "completions", prompt="hi", kv_transfer_params=bad)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "kv_transfer_params"
    resp = _post(pagoda, "completions", prompt="hi", n=2, kv_transfer_params={})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "kv_transfer_params"
