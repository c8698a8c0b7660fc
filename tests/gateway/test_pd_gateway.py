"""The gateway drives both legs (--pd-disaggregation): a prefill engine computes the prompt, a
decode engine pulls its KV and generates, and the client (the openai package, streamed and
not) sees one completion, the same as one engine computing it all. With the prefill engine
dead the answer is the same (the decode engine recomputes); with the decode engine killed
mid-stream the stream ends with an error (an engine crash, as today). A prompt shorter than
--pd-min-prompt-tokens skips the prefill leg (selective P/D); only its uncached part counts.
With --pd-stream-kv (the default) the decode leg starts on the prefill engine's announcement
and pulls while the prefill's chunks are computed: the same answers, the whole prompt's full
blocks pulled."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from tests.support.stack import PagodaStack

BS = 16
SHORT = 2 * BS + 8  # --pd-min-prompt-tokens: prompts shorter than this skip the prefill leg


@pytest.fixture(scope="module")
def pagoda(fast_model_dir: Path) -> Iterator[PagodaStack]:
    def role(kv_role: str) -> list[str]:
        return ["--block-size", str(BS), "--kv-transfer-config", json.dumps(
            {"kv_connector": "PagodaPDConnector", "kv_role": kv_role})]

    with PagodaStack(fast_model_dir, engines=2, routers=1, policy="round-robin",
                     engine_args=[role("kv_producer"), role("kv_consumer")],
                     gateway_args=["--pd-disaggregation", "--pd-min-prompt-tokens", str(SHORT),
                                   "--pd-stream-kv=false"],  # pulled after the prefill
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


def test_a_short_prompt_skips_the_prefill_engine(pagoda: PagodaStack) -> None:
    from tests.support.stack import scrape

    def prefilled() -> float:  # the prefill engine's finished requests
        return scrape(pagoda.engines[0].url).get("vllm:request_success_total", 0.0)

    before = prefilled()
    prompt = [19 + (i * 37) % 700 for i in range(SHORT - 1)]
    short = _complete(pagoda, prompt=prompt)
    assert prefilled() == before  # no prefill leg
    assert short["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing pulled
    alone = _complete(pagoda, prompt=prompt, kv_transfer_params={})  # on either engine
    assert short["choices"][0]["text"] == alone["choices"][0]["text"]
    # SHORT tokens, but the decode engine holds 2 of its 3 blocks (the short prompt's): only
    # the uncached 8 tokens count, so no prefill leg either.
    long = _complete(pagoda, prompt=[*prompt, 5])
    assert prefilled() == before
    assert long["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BS
    alone = _complete(pagoda, prompt=[*prompt, 5], kv_transfer_params={})
    assert long["choices"][0]["text"] == alone["choices"][0]["text"]


def test_a_long_prompt_whose_prefix_the_decode_engine_holds_skips_the_prefill_leg(
        pagoda: PagodaStack) -> None:
    """Selective P/D counts only the uncached part: a long prompt goes through the prefill
    leg (its blocks pulled, so now cached on the decode engine); the same prefix with a
    short new tail, longer than the threshold in all, is computed by the decode engine
    alone; a long new tail takes the prefill leg again."""
    from tests.support.stack import scrape

    def prefilled() -> float:
        return scrape(pagoda.engines[0].url).get("vllm:request_success_total", 0.0)

    def decisions() -> dict[str, float]:
        got = scrape(pagoda.gateway.url)
        name = "pagoda_gateway_pd_prefill_decisions_total{"
        return {d: sum(v for k, v in got.items() if k.startswith(name) and f'"{d}"' in k)
                for d in ("prefill", "cached")}

    prefix = [29 + (i * 53) % 700 for i in range(4 * BS)]
    before, counted = prefilled(), decisions()
    first = _complete(pagoda, prompt=[*prefix, 3])
    assert prefilled() == before + 1
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BS  # pulled
    tail = [*prefix, *[31 + i for i in range(BS + 3)]]  # 83 tokens, 19 of them uncached
    cached = _complete(pagoda, prompt=tail)
    assert prefilled() == before + 1  # no prefill leg
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BS
    assert cached["choices"][0]["text"] == _complete(
        pagoda, prompt=tail, kv_transfer_params={})["choices"][0]["text"]
    longer = [*prefix, *[37 + i for i in range(SHORT + 1)]]  # 41 uncached: a prefill leg
    _complete(pagoda, prompt=longer)
    assert prefilled() == before + 2
    after = decisions()
    assert (after["prefill"] - counted["prefill"], after["cached"] - counted["cached"]) == (2, 1)


def _client(pagoda: PagodaStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=pagoda.base_url, api_key="none", max_retries=0, timeout=60)


def _stream_text(pagoda: PagodaStack, **fields: Any) -> str:
    chunks = _client(pagoda).completions.create(
        model=pagoda.model, temperature=0, stream=True, extra_body={"ignore_eos": True},
        **fields)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_the_openai_client_streamed_and_not_then_faults(pagoda: PagodaStack) -> None:
    prompt = [13 + (i * 41) % 700 for i in range(3 * BS + 4)]
    client = _client(pagoda)
    plain = client.completions.create(model=pagoda.model, prompt=prompt, max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert plain.usage.prompt_tokens_details.cached_tokens == 3 * BS
    text = _stream_text(pagoda, prompt=prompt, max_tokens=8)
    assert text == plain.choices[0].text
    other = [17 + (i * 43) % 700 for i in range(2 * BS + 5)]
    # The prefill engine dies: the decode engine computes the prompt, the answer is the same.
    pagoda.engines[0].kill()
    again = client.completions.create(model=pagoda.model, prompt=prompt, max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].text == plain.choices[0].text
    # The decode engine dies mid-stream: the stream ends with an error after its tokens.
    stream = client.completions.create(model=pagoda.model, prompt=other, max_tokens=2000,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    got = []
    with pytest.raises(openai.APIError):
        for chunk in stream:
            got.append(chunk)
            if len(got) == 2:
                pagoda.engines[1].kill()
                time.sleep(0.2)
    assert got


@pytest.fixture(scope="module")
def streamed(fast_model_dir: Path) -> Iterator[PagodaStack]:
    """The gateway's default (streamed KV), and a prefill engine whose prompts take several
    steps."""
    def role(kv_role: str, *extra: str) -> list[str]:
        return ["--block-size", str(BS), *extra, "--kv-transfer-config", json.dumps(
            {"kv_connector": "PagodaPDConnector", "kv_role": kv_role})]

    with PagodaStack(fast_model_dir, engines=2, routers=1, policy="round-robin",
                     engine_args=[role("kv_producer", "--max-num-batched-tokens", str(BS)),
                                  role("kv_consumer")],
                     gateway_args=["--pd-disaggregation"],
                     env={"PAGODA_INTERNAL_TOKENS": "pd-gateway-test-token-0123456789"}
                     ) as stack:
        yield stack


@pytest.mark.parametrize("n", [6 * BS + 5, 5 * BS])
def test_streamed_kv_answers_as_one_engine(streamed: PagodaStack, n: int) -> None:
    prompt = [23 + n + (i * 47) % 700 for i in range(n)]
    pd = _complete(streamed, prompt=prompt)
    assert pd["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // BS * BS
    alone = _complete(streamed, prompt=prompt, kv_transfer_params={})  # on either engine
    assert pd["choices"][0]["text"] == alone["choices"][0]["text"]
    assert _stream_text(streamed, prompt=prompt, max_tokens=8) == alone["choices"][0]["text"]
