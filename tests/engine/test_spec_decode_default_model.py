"""Speculative decoding on the default model (SmolLM2-135M-Instruct, fp32) through the offline
``LLM``: greedy outputs equal to speculation off and to transformers' speculative generation
(prompt lookup, a deliberately bad random draft, the model as its own draft), stop strings
inside an accepted run, and JSON-schema outputs (every verified position masked, the matcher
rolled back) valid and equal to speculation off.

Three prompts here, and transformers' prompt lookup on two of them (its assisted generation
with a draft on this model takes too long for the suite: the tiny models' tests compare it);
``benchmarks/spec_decode_equality.py`` runs all 20 prompts against transformers, every kind."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.engine import LLM, SamplingParams, StructuredOutputsParams
from tests.support import spec_decode as sd

PROMPTS = [sd.TEXTS[0], sd.TEXTS[4], sd.TEXTS[12]]  # copying, copying, free
SMALL = {"max_num_seqs": 8, "num_blocks": 256}  # a small pool and warm-up: start fast


def _llm(model, spec=None) -> LLM:
    return LLM(str(model), speculative_config=spec, **SMALL)


@pytest.fixture(scope="module")
def off(default_model_path):
    with _llm(default_model_path) as llm:
        yield llm


@pytest.fixture(scope="module")
def bad_draft(default_model_path, tmp_path_factory):
    return sd.random_draft_like(default_model_path, tmp_path_factory.mktemp("bad-draft"))


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", ["ngram", "bad_draft", "self_draft"])
def test_greedy_equals_speculation_off_and_transformers(kind, off, default_model_path,
                                                         bad_draft) -> None:
    spec = {"ngram": sd.ngram(), "bad_draft": sd.draft(bad_draft),
            "self_draft": sd.draft(default_model_path)}[kind]
    want = _ids(off.generate(PROMPTS, sd.greedy(), use_tqdm=False))
    with _llm(default_model_path, spec) as llm:
        got = _ids(llm.generate(PROMPTS, sd.greedy(), use_tqdm=False))
        stats = llm.engine.stats().spec_decode
    assert got == want
    assert stats.num_drafts > 0
    if kind == "self_draft":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if kind == "ngram":
        prompt_ids = [o.prompt_token_ids for o in off.generate(PROMPTS[:2], sd.greedy(1),
                                                               use_tqdm=False)]
        assert sd.hf_speculative(default_model_path, prompt_ids, spec) == want[:2]


def test_a_stop_string_inside_an_accepted_run_cuts_text_and_tokens(off, default_model_path):
    prompt = sd.TEXTS[0]
    ref = off.generate(prompt, sd.greedy(40), use_tqdm=False)[0].outputs[0]
    stop = ref.text[30:38]  # a few tokens in: inside a run of accepted drafts
    params = SamplingParams(max_tokens=40, temperature=0, stop=[stop])
    want = off.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    with _llm(default_model_path, sd.draft(default_model_path)) as llm:
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
        (want.text, want.token_ids, "stop", stop)


SCHEMA = {"type": "object", "properties": {
    "cities": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "country": {"type": "string",
                                                                  "maxLength": 16}},
        "required": ["name", "country"], "additionalProperties": False}, "maxItems": 3}},
    "required": ["cities"], "additionalProperties": False}


def test_json_schema_outputs_are_valid_and_equal_to_speculation_off(off, default_model_path):
    params = SamplingParams(max_tokens=64, temperature=0,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    messages = [[{"role": "user", "content": f"List {what} as JSON."}]
                for what in ("three European capitals", "three cities in Japan")]
    want = off.chat(messages, params, use_tqdm=False)
    for spec in (sd.ngram(), sd.draft(default_model_path)):
        with _llm(default_model_path, spec) as llm:
            got = llm.chat(messages, params, use_tqdm=False)
            stats = llm.engine.stats().spec_decode
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
        for out in got:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        # drafts accepted and rejected: the grammar masked every position and rolled back
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
