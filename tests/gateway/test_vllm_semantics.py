"""vLLM's semantics through a real stack (redis, an engine, the router and the gateway as
processes, the fast random model): logit_bias, completions echo with logprobs and the
prompt_logprobs extension (JSON and SSE), logprobs=0, stop_token_ids kept out of the text,
prompt + max_tokens past the context, the default max_tokens of 16, and the engine's vLLM
metric families."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from services.engine.serving.request_metrics import (
    ITERATION_TOKEN_BUCKETS,
    PREEMPTION_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TIME_PER_OUTPUT_TOKEN_BUCKETS,
)
from tests.support.stack import PagodaStack

CONTEXT = 4096  # fast_model_dir's max_position_embeddings
PROMPT = "The quick brown fox jumps over the lazy dog"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pagoda(fast_model_dir: Path) -> Iterator[PagodaStack]:
    with PagodaStack(fast_model_dir, engines=1, routers=1) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(pagoda: PagodaStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=pagoda.base_url, api_key="x", max_retries=0, timeout=60)


def post(pagoda: PagodaStack, path: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(pagoda.gateway.url + path, json={"model": pagoda.model, **body},
                         timeout=60)


def sse(pagoda: PagodaStack, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    resp = requests.post(pagoda.gateway.url + path, timeout=60, stream=True,
                         json={"model": pagoda.model, "stream": True, **body})
    assert resp.status_code == 200, resp.text
    events = [line[6:] for line in resp.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def pagoda_tokenizer(pagoda: PagodaStack):
    from services.text.tokenizer import Tokenizer

    return Tokenizer(pagoda.model_dir)


# -- logit_bias -----------------------------------------------------------------------------


def test_logit_bias_in_completions_and_chat(pagoda: PagodaStack) -> None:
    tok = pagoda_tokenizer(pagoda)
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    body = {"prompt": PROMPT, "max_tokens": 4, "logit_bias": {str(forced): 100}, **GREEDY}
    resp = post(pagoda, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == tok.decode([forced] * 4)
    chat = post(pagoda, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "logit_bias": {str(forced): 100}, **GREEDY})
    assert chat.json()["choices"][0]["message"]["content"] == tok.decode([forced] * 3)
    for bad in ({str(tok.vocab_size): 1}, {"x": 1}, [1]):
        resp = post(pagoda, "/v1/completions", {"prompt": PROMPT, "logit_bias": bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "logit_bias"


# -- prompt logprobs ------------------------------------------------------------------------


def test_echo_with_logprobs_returns_the_prompts_first_null(pagoda: PagodaStack) -> None:
    tok = pagoda_tokenizer(pagoda)
    prompt_ids = tok.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 2, **GREEDY}
    choice = post(pagoda, "/v1/completions", body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == len(prompt_ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    for token, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:], strict=True):
        assert token in top and len(top) <= 3  # the top 2, and the token itself
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # Streamed: the same text and logprobs, the echo leading the first chunk.
    chunks = sse(pagoda, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    streamed = [t for c in chunks if c["choices"][0]["logprobs"]
                for t in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(lp["token_logprobs"][:1] + lp["token_logprobs"][1:])


def test_prompt_logprobs_extension(pagoda: PagodaStack) -> None:
    tok = pagoda_tokenizer(pagoda)
    prompt_ids = tok.encode(PROMPT)
    echo = post(pagoda, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "echo": True,
                                            "logprobs": 1, **GREEDY}).json()
    body = post(pagoda, "/v1/completions",
                {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1, **GREEDY}).json()
    plps = body["choices"][0]["prompt_logprobs"]
    assert len(plps) == len(prompt_ids) and plps[0] is None
    for pos, (tid, entry) in enumerate(zip(prompt_ids[1:], plps[1:], strict=True), start=1):
        mine = entry[str(tid)]
        assert mine["decoded_token"] == tok.decode([tid], skip_special_tokens=False)
        assert mine["rank"] >= 1 and len(entry) <= 2
        assert mine["logprob"] == pytest.approx(
            echo["choices"][0]["logprobs"]["token_logprobs"][pos], abs=1e-5)
    assert body["choices"][0]["logprobs"] is None  # prompt_logprobs alone: no output logprobs
    chat = post(pagoda, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "prompt_logprobs": 0, **GREEDY}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat[
        "usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    streamed = sse(pagoda, "/v1/completions",
                   {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1, **GREEDY})
    assert next(c["choices"][0].get("prompt_logprobs") for c in streamed) == plps


def test_logprobs_zero_puts_the_chosen_token_in_top_logprobs(pagoda: PagodaStack) -> None:
    lp = post(pagoda, "/v1/completions",
              {"prompt": PROMPT, "max_tokens": 4, "logprobs": 0, **GREEDY}).json()[
        "choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"],
                                                         strict=True)]


# -- stops, lengths -------------------------------------------------------------------------


def test_stop_token_ids_are_not_in_the_text(pagoda: PagodaStack) -> None:
    tok = pagoda_tokenizer(pagoda)
    full = post(pagoda, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, **GREEDY}).json()
    ids = tok.encode(full["choices"][0]["text"], add_special_tokens=False)
    stop = ids[2]
    cut = ids[: ids.index(stop)]
    body = {"prompt": PROMPT, "max_tokens": 6, "stop_token_ids": [stop], **GREEDY}
    choice = post(pagoda, "/v1/completions", body).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["text"] == tok.decode(cut)
    streamed = "".join(c["choices"][0]["text"] for c in sse(pagoda, "/v1/completions", body))
    assert streamed == tok.decode(cut)
    kept = post(pagoda, "/v1/completions", {**body, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == tok.decode([*cut, stop])


def test_prompt_plus_max_tokens_past_the_context(pagoda: PagodaStack) -> None:
    prompt = [1000 + i % 500 for i in range(CONTEXT - 7)]
    body = post(pagoda, "/v1/completions",
                {"prompt": prompt, "max_tokens": 500, **GREEDY}).json()
    assert body["usage"]["completion_tokens"] == 7, body
    assert body["choices"][0]["finish_reason"] == "length"
    resp = post(pagoda, "/v1/completions", {"prompt": "hi", "max_tokens": CONTEXT + 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    resp = post(pagoda, "/v1/completions", {"prompt": [5] * CONTEXT, "max_tokens": 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"


def test_completions_default_to_16_tokens(pagoda: PagodaStack) -> None:
    body = post(pagoda, "/v1/completions", {"prompt": PROMPT, **GREEDY}).json()
    assert body["usage"]["completion_tokens"] == 16
    assert body["choices"][0]["finish_reason"] == "length"


# -- metrics --------------------------------------------------------------------------------

_FAMILY = re.compile(r"^# TYPE (\S+) (\S+)$", re.MULTILINE)
_SAMPLE = re.compile(r"^([^{\s]+)(?:\{(.*)\})? (\S+)$")


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def _engine_metrics(pagoda: PagodaStack) -> str:
    return urllib.request.urlopen(pagoda.engines[0].url + "/metrics", timeout=5).read().decode()


def test_engine_exports_vllms_metric_families(pagoda: PagodaStack) -> None:
    before = _samples(_engine_metrics(pagoda))
    resp = post(pagoda, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 2, **GREEDY})
    text = _engine_metrics(pagoda)
    types = dict(_FAMILY.findall(text))
    expected = {
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram",
        "vllm:request_decode_time_seconds": "histogram",
        "vllm:request_inference_time_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram",
        "vllm:request_generation_tokens": "histogram",
        "vllm:request_params_n": "histogram",
        "vllm:request_params_max_tokens": "histogram",
        "vllm:iteration_tokens_total": "histogram",
        "vllm:num_requests_waiting_by_reason": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:prompt_tokens_cached_total": "counter",
        "vllm:request_time_per_output_token_seconds": "histogram",
        "vllm:request_num_preemptions": "histogram",
        "vllm:request_prefill_kv_computed_tokens": "histogram",
        "vllm:request_max_num_generation_tokens": "histogram",
    }
    for name, kind in expected.items():
        assert types.get(name) == kind, (name, types.get(name))
    samples = _samples(text)
    mine = {"model_name": pagoda.model, "engine": "0"}

    def bounds(name: str) -> list[str]:
        return [lb["le"] for n, lb, _ in samples
                if n == name + "_bucket" and {k: lb.get(k) for k in mine} == mine]

    assert bounds("vllm:request_queue_time_seconds") == [
        *(str(float(b)) for b in REQUEST_LATENCY_BUCKETS), "+Inf"]
    assert bounds("vllm:iteration_tokens_total") == [
        *(str(float(b)) for b in ITERATION_TOKEN_BUCKETS), "+Inf"]
    tokens = bounds("vllm:request_prompt_tokens")
    assert tokens[:3] == ["1.0", "2.0", "5.0"] and float(tokens[-2]) <= CONTEXT
    assert bounds("vllm:request_time_per_output_token_seconds") == [
        *(str(float(b)) for b in TIME_PER_OUTPUT_TOKEN_BUCKETS), "+Inf"]
    assert bounds("vllm:request_num_preemptions") == [
        *(str(float(b)) for b in PREEMPTION_BUCKETS), "+Inf"]
    assert bounds("vllm:request_prefill_kv_computed_tokens") == tokens
    assert bounds("vllm:request_max_num_generation_tokens") == tokens

    def grew(name: str) -> float:
        def value(snapshot) -> float:
            return sum(v for n, lb, v in snapshot if n == name and lb == mine)
        return value(samples) - value(before)

    # The two samples of n=2, each its own engine request of 3 generated tokens.
    for family in ("vllm:request_decode_time_seconds", "vllm:request_num_preemptions",
                   "vllm:request_time_per_output_token_seconds",
                   "vllm:request_prefill_kv_computed_tokens",
                   "vllm:request_max_num_generation_tokens"):
        assert grew(family + "_count") == 2, family
    assert grew("vllm:request_max_num_generation_tokens_sum") == 6
    assert grew("vllm:request_num_preemptions_sum") == 0
    assert grew("vllm:request_time_per_output_token_seconds_sum") > 0
    prompt_len = resp.json()["usage"]["prompt_tokens"]
    cached = grew("vllm:prompt_tokens_cached_total")
    assert grew("vllm:request_prefill_kv_computed_tokens_sum") == 2 * prompt_len - cached
    assert re.search(r'^vllm:num_requests_waiting_by_reason\{.*reason="capacity".*\} 0\.0$', text,
                     re.MULTILINE)
    assert re.search(r'^vllm:cache_config_info\{.*block_size="16".*num_gpu_blocks="512".*\} 1\.0$',
                     text, re.MULTILINE)


def test_gateway_federates_every_engines_metrics(pagoda: PagodaStack) -> None:
    post(pagoda, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **GREEDY})
    resp = requests.get(pagoda.gateway.url + "/metrics/engines", timeout=10)
    assert resp.status_code == 200
    samples = _samples(resp.text)
    eid = pagoda.engine_id(0)
    assert ("pagoda_gateway_engine_scrape_up", {"engine_id": eid}, 1.0) in samples
    count = [v for n, lb, v in samples
             if n == "vllm:request_queue_time_seconds_count" and lb.get("engine_id") == eid]
    assert count and count[0] >= 1
    # One family per name, its samples together (the text format's rule).
    types = _FAMILY.findall(resp.text)
    assert len(types) == len({name for name, _ in types})


def test_federation_merges_families_of_several_engines() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from services.gateway.engine_metrics import _Merged
    from services.gateway.router_client import EngineInfo

    def text(value: float) -> str:
        return ("# HELP vllm:num_requests_waiting w\n# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{model_name="m"}} {value}\n')

    engines = [EngineInfo(f"e{i}", f"http://e{i}", "m", 16) for i in range(3)]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged([(engines[0], text(1)), (engines[1], text(2)), (engines[2], None)]))
    out = generate_latest(registry).decode()
    assert out.count("# TYPE vllm:num_requests_waiting gauge") == 1
    samples = _samples(out)
    assert ("vllm:num_requests_waiting", {"model_name": "m", "engine_id": "e1"}, 2.0) in samples
    assert ("pagoda_gateway_engine_scrape_up", {"engine_id": "e2"}, 0.0) in samples
