"""kv_transfer_params on the OpenAI API, as vLLM's P/D proxy drives it: the prefill leg
(max_tokens 1, do_remote_decode) answers with the params, the decode leg sent them answers as
one aggregated request would, on completions and chat completions; bad params are a 400
naming the field; streamed, the prefill leg's params come in its last chunk; a client that
names a host of its own in the params gets an ordinary answer and the engine never connects
there, and a client cannot send the gateway's pull_prefix_from."""

from __future__ import annotations

import json
import socket
import threading
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


def test_a_client_cannot_point_an_engine_at_its_own_host(pagoda: PagodaStack) -> None:
    prompt = {"prompt": [3 + (i * 37) % 700 for i in range(3 * BS + 2)]}
    first = _post(pagoda, "completions", max_tokens=1,
                  kv_transfer_params={"do_remote_decode": True}, **prompt).json()
    alone = _post(pagoda, "completions", max_tokens=8, **prompt).json()
    connections: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as fake:
        port = fake.getsockname()[1]
        listener = threading.Thread(target=lambda: connections.append(fake.accept()[0]),
                                    daemon=True)
        listener.start()
        # The real grant's fields with the client's address: the signature no longer matches.
        forged = {**first["kv_transfer_params"], "remote_host": "127.0.0.1",
                  "remote_port": port}
        for params in (forged, {**forged, "remote_signature": "0" * 64}):
            resp = _post(pagoda, "completions", max_tokens=8, kv_transfer_params=params,
                         **prompt)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == alone["choices"][0]["text"]
        listener.join(timeout=0.2)
    assert connections == []
    peer = {"pull_prefix_from": {"engine_id": "e", "address": f"127.0.0.1:{port}",
                                 "blocks": 3}}
    resp = _post(pagoda, "completions", max_tokens=2, kv_transfer_params=peer, **prompt)
    assert resp.status_code == 400 and "set by the gateway" in resp.json()["error"]["message"]


def test_a_streamed_prefill_leg_returns_the_params_in_its_last_chunk(
        pagoda: PagodaStack) -> None:
    prompt = {"prompt": [19 + (i * 43) % 700 for i in range(2 * BS + 5)]}
    resp = _post(pagoda, "completions", max_tokens=1, stream=True,
                 kv_transfer_params={"do_remote_decode": True}, **prompt)
    chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    params = chunks[-1]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_num_blocks"] == 2
    assert all("kv_transfer_params" not in c for c in chunks[:-1])
    decode = _post(pagoda, "completions", max_tokens=8, stream=True, kv_transfer_params=params,
                   **prompt)
    alone = _post(pagoda, "completions", max_tokens=8, **prompt).json()
    text = "".join(json.loads(line[6:])["choices"][0]["text"]
                   for line in decode.text.splitlines() if line.startswith("data: {"))
    assert text == alone["choices"][0]["text"]
