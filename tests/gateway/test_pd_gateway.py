"""The gateway drives both legs (--pd-disaggregation): a prefill engine computes the prompt, a
decode engine pulls its KV and generates, and the client sees one completion, the same as one
engine computing it all."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support.stack import PagodaStack

BS = 16


@pytest.fixture(scope="module")
def pagoda(fast_model_dir: Path) -> Iterator[PagodaStack]:
    def role(kv_role: str) -> list[str]:
        return ["--block-size", str(BS), "--kv-transfer-config", json.dumps(
            {"kv_connector": "PagodaPDConnector", "kv_role": kv_role})]

    with PagodaStack(fast_model_dir, engines=2, routers=1, policy="round-robin",
                     engine_args=[role("kv_producer"), role("kv_consumer")],
                     gateway_args=["--pd-disaggregation"],
                     env={"PAGODA_INTERNAL_TOKENS": "pd-gateway-test-token-0123456789"}
                     ) as stack:
        yield stack


def _complete(pagoda: PagodaStack, **fields: Any) -> dict[str, Any]:
    body = {"model": pagoda.model, "temperature": 0, "ignore_eos": True, "max_tokens": 8,
            **fields}
    resp = requests.post(f"{pagoda.base_url}/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_gateway_drives_prefill_then_decode(pagoda: PagodaStack) -> None:
    prompt = [11 + (i * 31) % 700 for i in range(3 * BS + 9)]
    pd = _complete(pagoda, prompt=prompt)
    # The decode engine never saw the prompt: its full blocks came from the prefill engine.
    assert pd["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BS
    assert "kv_transfer_params" not in pd
    # kv_transfer_params from the client: the gateway drives no legs (any engine computes it).
    alone = _complete(pagoda, prompt=[*prompt], kv_transfer_params={})
    assert pd["choices"][0]["text"] == alone["choices"][0]["text"]
    stream = requests.post(f"{pagoda.base_url}/completions", json={
        "model": pagoda.model, "prompt": prompt, "temperature": 0, "ignore_eos": True,
        "max_tokens": 8, "stream": True}, timeout=60)
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines()
              if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert text == alone["choices"][0]["text"]
