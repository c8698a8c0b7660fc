"""The offline ``LLM``'s text: decoded once when a sample finishes, unless stop strings need it
step by step; either way the same text incremental detokenization gives."""

from __future__ import annotations

import pytest

from services.engine import LLM, SamplingParams
from services.text.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(fast_model_dir) -> LLM:
    return LLM(str(fast_model_dir), num_blocks=512)


def incremental_text(llm: LLM, prompt: list[int], output: list[int], skip: bool) -> str:
    detok = IncrementalDetokenizer(llm.get_tokenizer(), prompt, skip)
    for t in output:
        detok.push([t])
    return detok.text


def test_text_equals_incremental_detokenization(llm: LLM) -> None:
    prompts = [llm.get_tokenizer().encode(f"Story {i}: 😀 naïve 中文") for i in range(12)]
    for skip in (True, False):
        params = SamplingParams(max_tokens=40, temperature=1.5, seed=3,
                                skip_special_tokens=skip, ignore_eos=True)
        for out in llm.generate(prompts, params, use_tqdm=False):
            c = out.outputs[0]
            assert c.text == incremental_text(llm, out.prompt_token_ids, c.token_ids, skip)
            assert c.finish_reason == "length" and c.stop_reason is None


def test_the_step_loop_never_detokenizes_without_stop_strings(llm: LLM, monkeypatch) -> None:
    tok = llm.get_tokenizer()
    calls = {"decode": 0, "decode_batch": 0}
    for name in calls:
        real = getattr(tok, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(tok, name, counted)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9, 10, 11]], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 30 and o.outputs[0].text for o in outs)
    assert calls["decode"] == 0
    assert 2 <= calls["decode_batch"] <= 4  # contexts and texts, at most for two finishing steps


def test_stop_strings_still_cut_the_text(llm: LLM) -> None:
    prompt = llm.get_tokenizer().encode("Count:")
    base = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = base.text[6:9]
    assert len(stop) == 3
    out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]


def test_logprobs_carry_each_token_text(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    c = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    for token, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert entry[token].decoded_token == tok.decode([token], skip_special_tokens=False)
        assert all(lp.decoded_token == tok.decode([t], skip_special_tokens=False)
                   for t, lp in entry.items())
