"""Structured outputs in the engine, through the offline ``LLM``: masks only on constrained rows,
valid outputs whatever the model (a random one here), preemption, padding rows, errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jsonschema
import pytest

from services.engine.llm import LLM
from services.protocol.sampling_params import SamplingParams
from services.protocol.structured_outputs import StructuredOutputsParams as SO
from services.protocol.wire import BadRequest
from tests.support.stack import TOKENIZER_FILES
from tests.support.timing import collector_held_off

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Give me JSON:", "Once upon a time", "The list of numbers is 1, 2,", "Hello"]


def constrained(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=120, structured_outputs=SO(**kw), temperature=0)


def check(text: str, spec: dict) -> None:
    if "json" in spec:
        jsonschema.validate(json.loads(text), spec["json"])
    elif "regex" in spec:
        assert re.fullmatch(spec["regex"], text), text
    else:
        assert text in spec["choice"], text


SPECS = [{"json": SCHEMA}, {"regex": r"[a-z]{2,5}-[0-9]{1,3}"}, {"choice": ["alpha", "beta"]}]


@pytest.fixture(scope="module")
def llm(fast_model_dir: Path) -> LLM:
    return LLM(str(fast_model_dir))


def test_constrained_and_free_requests_share_a_batch(llm: LLM) -> None:
    free = SamplingParams(max_tokens=12, temperature=0)
    alone = [o.outputs[0].text for o in llm.generate(PROMPTS, free, use_tqdm=False)]
    params = [free, *(constrained(**s) for s in SPECS)] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, prompt, out in zip(params, prompts, outs, strict=True):
        c = out.outputs[0]
        if p.structured_outputs is None:  # untouched by its neighbours' masks
            assert c.text == alone[PROMPTS.index(prompt)]
        else:
            assert c.finish_reason == "stop", c
            check(c.text, SPECS[[constrained(**s).structured_outputs for s in SPECS]
                               .index(p.structured_outputs)])


def test_sampled_outputs_stay_valid(llm: LLM) -> None:
    params = [SamplingParams(max_tokens=150, temperature=1.5, seed=i,
                             structured_outputs=SO(**SPECS[i % 3])) for i in range(12)]
    outs = llm.generate(["x"] * 12, params, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].finish_reason == "stop"
        check(out.outputs[0].text, SPECS[i % 3])


def test_a_finished_grammar_allows_only_eos(llm: LLM) -> None:
    eos = llm.engine.eos_token_ids
    p = SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True,
                       structured_outputs=SO(choice=["done"]))
    ids = llm.generate(["x"], p, use_tqdm=False)[0].outputs[0].token_ids
    end = ids.index(eos[0])
    assert llm.tokenizer.decode(ids[:end]) == "done"
    assert len(ids) == 30 and set(ids[end:]) <= set(eos)


def test_outputs_unchanged_under_preemption_and_prefix_caching(
        llm: LLM, fast_model_dir: Path) -> None:
    prompts = [f"{p} {i}" * 8 for i, p in enumerate(PROMPTS * 3)]
    params = [constrained(**SPECS[i % 3]) for i in range(len(prompts))]
    reference = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    cached = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in cached] == reference
    assert sum(o.num_cached_tokens for o in cached) > 0
    tiny = LLM(str(fast_model_dir), num_blocks=24, max_num_batched_tokens=128)
    assert [o.outputs[0].text for o in tiny.generate(prompts, params, use_tqdm=False)] == reference
    assert tiny.engine.stats().num_preemptions > 0, "the tiny pool should force preemption"
    for i, text in enumerate(reference):
        check(text, SPECS[i % 3])


def test_lm_head_padding_rows_are_never_sampled(tiny_model_dir, default_model_path) -> None:
    """An LM head wider than the tokenizer (as Qwen's): the extra ids must stay masked."""
    vocab = json.loads((default_model_path / "config.json").read_text())["vocab_size"]
    made = tiny_model_dir("LlamaForCausalLM", seed=11, vocab_size=vocab + 256,
                          eos_token_id=2, tie_word_embeddings=True)
    for name in TOKENIZER_FILES:
        if (default_model_path / name).exists():
            shutil.copy(default_model_path / name, made / name)
    llm = LLM(str(made))
    outs = llm.generate(["a"] * 4, [SamplingParams(max_tokens=60, temperature=2.0, seed=i,
                                                   structured_outputs=SO(json_object=True))
                                    for i in range(4)], use_tqdm=False)
    for o in outs:
        assert max(o.outputs[0].token_ids) < vocab
        if o.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(o.outputs[0].text), dict)


def test_bad_specs_are_bad_requests_naming_structured_outputs(llm: LLM) -> None:
    for spec in ({"json": {"type": "nope"}}, {"regex": "(a"}, {"grammar": "root ::= undefined"}):
        with pytest.raises(BadRequest) as exc:
            llm.generate(["x"], SamplingParams(structured_outputs=SO(**spec)), use_tqdm=False)
        assert exc.value.param == "structured_outputs"
    for bad in ({}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"json": "{not json"}):
        with pytest.raises(ValueError, match="structured_outputs"):
            SamplingParams(structured_outputs=bad)
    assert llm.engine.requests == {}


def test_compiles_off_the_loop_are_cached_and_bounded_in_time(llm: LLM, monkeypatch) -> None:
    import asyncio

    from services.engine.structured import compiler

    grammars = llm.engine.grammars
    spec = SO(json={"type": "object", "properties": {"slow": {"type": "string",
                                                               "pattern": "^[a-z]{3,40}$"}}})
    monkeypatch.setattr(compiler, "COMPILE_TIMEOUT_S", 1e-6)
    with pytest.raises(BadRequest, match="to compile") as exc:
        asyncio.run(grammars.compile_async(spec))
    assert exc.value.param == "structured_outputs"
    fast = SO(regex="[0-9]+")
    monkeypatch.setattr(compiler, "COMPILE_TIMEOUT_S", 30.0)
    asyncio.run(grammars.compile_async(fast))
    assert grammars.compile(fast) is grammars.compile(SO(regex="[0-9]+"))  # one cache entry


def test_a_slow_compile_runs_beside_the_event_loop_and_the_steps(llm: LLM) -> None:
    """A schema that takes seconds to compile: the event loop keeps ticking and the engine
    keeps stepping meanwhile (xgrammar releases the GIL on its compile thread)."""
    import asyncio
    import threading
    import time

    props = {f"f{i}": {"type": "object", "properties": {
        f"g{j}": {"type": ["string", "integer", "null"], "pattern": "^[a-z]{3,9}$"}
        for j in range(15)}} for i in range(40)}
    slow = SO(json={"type": "object", "properties": props})
    free_done: list[float] = []

    async def compile_and_watch() -> tuple[float, float]:
        start = time.perf_counter()
        task = asyncio.ensure_future(llm.engine.grammars.compile_async(slow))
        worst = 0.0
        while not task.done():
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            worst = max(worst, time.perf_counter() - t)
        await task
        return time.perf_counter() - start, worst

    def free_requests() -> None:
        time.sleep(0.05)
        llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        free_done.append(time.perf_counter())

    stepper = threading.Thread(target=free_requests)
    with collector_held_off():
        stepper.start()
        compile_s, worst_gap = asyncio.run(compile_and_watch())
        compiled_at = time.perf_counter()
        stepper.join()
    # A compile on the loop would stall it for the whole compile (seconds).
    assert worst_gap < min(0.5, max(0.1, compile_s / 4)), (
        f"the event loop stalled {worst_gap:.2f}s during a {compile_s:.2f}s compile")
    if compile_s > 1.0:  # a slow machine: the free requests finished while it compiled
        assert free_done[0] < compiled_at
