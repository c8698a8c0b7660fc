"""The gateway drives both legs through the shared KV store (PagodaStorePDConnector; the TCP
transport's stack is test_pd_gateway.py): the engines' heartbeats carry the store transport's
layout (no transfer port), the router pairs the legs by it, the decode engine loads the blocks
the prefill engine wrote, and the client (the openai package, streamed and not) sees the same
completion as one engine computing it all."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from services.engine.kv_offload.secret import SECRET_ENV
from tests.support.redis_server import RedisServer
from tests.support.services import internal_headers
from tests.support.stack import PagodaStack

BS = 16


@pytest.fixture(scope="module")
def pagoda(fast_model_dir: Path) -> Iterator[PagodaStack]:
    with RedisServer() as kv_store:  # the KV store: an instance of its own, as deployed
        def role(kv_role: str) -> list[str]:
            return ["--block-size", str(BS), "--kv-transfer-config", json.dumps(
                {"kv_connector": "PagodaStorePDConnector", "kv_role": kv_role,
                 "kv_connector_extra_config": {"kv_store_url": kv_store.url}})]

        with PagodaStack(fast_model_dir, engines=2, routers=1, policy="round-robin",
                         engine_args=[role("kv_producer"), role("kv_consumer")],
                         gateway_args=["--pd-disaggregation"],
                         env={SECRET_ENV: "pd-store-gateway-mac-key-0123456789"}) as stack:
            yield stack


def _engines(pagoda: PagodaStack) -> dict[str, dict]:
    """The router's view of the engines, once both heartbeats are in."""
    deadline = time.monotonic() + 15
    while True:
        req = urllib.request.Request(pagoda.routers[0].url + "/engines",
                                     headers=internal_headers())
        with urllib.request.urlopen(req, timeout=5) as resp:
            engines = {e["engine_id"]: e for e in json.loads(resp.read())["engines"]}
        if len(engines) == 2 or time.monotonic() > deadline:
            return engines
        time.sleep(0.1)


def test_the_gateway_drives_both_legs_through_the_store(pagoda: PagodaStack) -> None:
    engines = _engines(pagoda)
    prefill, decode = engines[pagoda.engine_id(0)], engines[pagoda.engine_id(1)]
    assert (prefill["kv_role"], decode["kv_role"]) == ("prefill", "decode")
    assert prefill["kv_layout"] == decode["kv_layout"]
    assert prefill["kv_layout"].startswith("store-")
    assert prefill.get("kv_transfer_address") is None

    client = openai.OpenAI(base_url=pagoda.base_url, api_key="none", max_retries=0, timeout=60)
    prompt = [17 + (i * 37) % 700 for i in range(3 * BS + 6)]
    fields = {"model": pagoda.model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    pd = client.completions.create(**fields, extra_body={"ignore_eos": True})
    # The decode engine never saw the prompt: its full blocks came through the store.
    assert pd.usage.prompt_tokens_details.cached_tokens == 3 * BS
    # kv_transfer_params from the client: the gateway drives no legs (an engine computes it).
    alone = client.completions.create(**fields, extra_body={"ignore_eos": True,
                                                            "kv_transfer_params": {}})
    assert pd.choices[0].text == alone.choices[0].text
    chunks = client.completions.create(**fields, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == alone.choices[0].text
