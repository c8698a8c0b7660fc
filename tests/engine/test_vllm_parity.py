"""The offline engine where it follows vLLM's semantics: logit_bias, prompt_logprobs (chunked,
cached, preempted), prompt + max_tokens past the context, and stop tokens kept out of the text.
On the fast random model (SmolLM2's vocabulary and tokenizer), checked against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.protocol.wire import BadRequest

CONTEXT = 96
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the woods " * 2


@pytest.fixture(scope="module")
def llm(fast_model_dir: Path) -> LLM:
    # A small step budget (a 40-token prompt is prefilled in three chunks) and a small KV pool
    # (256 tokens: a few requests at once preempt each other).
    return LLM(str(fast_model_dir), max_model_len=CONTEXT, max_num_batched_tokens=16,
               num_blocks=16)


@pytest.fixture(scope="module")
def hf_logprobs(fast_model_dir: Path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(fast_model_dir), dtype=torch.float32)

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)

    return run


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **{"max_tokens": 6, **kw})


# -- logit_bias -----------------------------------------------------------------------------


def test_logit_bias_steers_only_its_own_row_of_a_batch(llm: LLM) -> None:
    plain = llm.generate([PROMPT, "Hello there"], greedy(), use_tqdm=False)
    forced_id = 1234
    params = [greedy(logit_bias={forced_id: 100.0}), greedy()]
    outs = llm.generate([PROMPT, "Hello there"], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [forced_id] * 6
    assert outs[1].outputs[0].token_ids == plain[1].outputs[0].token_ids  # its neighbour: unchanged
    # -100 on the greedy token: never picked again.
    first = plain[0].outputs[0].token_ids[0]
    banned = llm.generate(PROMPT, greedy(logit_bias={first: -100}), use_tqdm=False)
    assert first not in banned[0].outputs[0].token_ids


def test_logit_bias_past_the_vocabulary_is_refused(llm: LLM) -> None:
    vocab = llm.engine.runner.model_config.vocab_size
    with pytest.raises(BadRequest) as err:
        llm.engine.check_request([1, 2, 3], greedy(logit_bias={vocab: 1.0}))
    assert err.value.param == "logit_bias"


# -- prompt_logprobs ------------------------------------------------------------------------


def check_prompt_logprobs(out, ref: torch.Tensor, n: int) -> None:
    ids = out.prompt_token_ids
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    for j in range(1, len(ids)):
        entry = lps[j]
        assert ids[j] in entry
        assert entry[ids[j]].logprob == pytest.approx(ref[j - 1, ids[j]].item(), abs=2e-3)
        top = torch.topk(ref[j - 1], n)
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[t].logprob == pytest.approx(v, abs=2e-3)
        expected_rank = int((ref[j - 1] >= ref[j - 1, ids[j]] - 1e-6).sum())
        assert abs(entry[ids[j]].rank - expected_rank) <= 1


def test_prompt_logprobs_match_transformers_over_chunks_and_the_cache(
    llm: LLM, hf_logprobs
) -> None:
    params = greedy(prompt_logprobs=3, max_tokens=2)
    first = llm.generate(PROMPT, params, use_tqdm=False)[0]
    ref = hf_logprobs(first.prompt_token_ids)
    assert len(first.prompt_token_ids) > 32  # several chunks of 16
    check_prompt_logprobs(first, ref, 3)
    # Again: the prompt is in the prefix cache, yet every position is scored again.
    again = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    check_prompt_logprobs(again, ref, 3)
    # A request that does not ask reads the cache as before, and has no prompt logprobs.
    plain = llm.generate(PROMPT, greedy(max_tokens=2), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None


def test_prompt_logprobs_zero_is_the_prompt_token_only(llm: LLM) -> None:
    out = llm.generate("Hello there, friend", greedy(prompt_logprobs=0, max_tokens=1),
                       use_tqdm=False)[0]
    assert [None if e is None else list(e) for e in out.prompt_logprobs][1:] == [
        [t] for t in out.prompt_token_ids[1:]
    ]


def test_prompt_logprobs_survive_preemption(llm: LLM, hf_logprobs) -> None:
    # Eight 40-token prompts growing by 24 tokens in 16 blocks: requests are preempted and
    # recomputed, and their prompts are not scored twice.
    before = llm.engine.scheduler.num_preemptions
    prompts = [f"{i} {PROMPT}" for i in range(8)]
    outs = llm.generate(prompts, greedy(prompt_logprobs=1, max_tokens=24), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > before
    for out in outs:
        check_prompt_logprobs(out, hf_logprobs(out.prompt_token_ids), 1)


# -- context and stop tokens ----------------------------------------------------------------


def test_prompt_plus_max_tokens_past_the_context_generates_to_it(llm: LLM) -> None:
    ids = list(range(1000, 1000 + CONTEXT - 10))
    out = llm.generate([ids], greedy(max_tokens=50), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    with pytest.raises(BadRequest) as err:
        llm.engine.check_request(ids, greedy(max_tokens=CONTEXT + 1))
    assert err.value.param == "max_tokens"


def test_stop_token_is_not_in_the_text_unless_asked(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ref = llm.generate(PROMPT, greedy(max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
    stop = ref[3]
    cut = ref[: ref.index(stop) + 1]
    for stops in ([], ["never-there"]):  # the batched decode and the streamed text
        out = llm.generate(PROMPT, greedy(max_tokens=8, stop_token_ids=[stop], stop=stops),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids == cut and out.stop_reason == stop
        assert out.text == tok.decode(cut[:-1])
        kept = llm.generate(PROMPT, greedy(max_tokens=8, stop_token_ids=[stop], stop=stops,
                                           include_stop_str_in_output=True),
                            use_tqdm=False)[0].outputs[0]
        assert kept.text == tok.decode(cut)


def test_chat_continues_the_final_message(llm: LLM) -> None:
    partial = [{"role": "user", "content": "Name a fruit."},
               {"role": "assistant", "content": "My favourite fruit is"}]
    out = llm.chat(partial, greedy(max_tokens=2), use_tqdm=False,
                   add_generation_prompt=False, continue_final_message=True)[0]
    text = llm.get_tokenizer().decode(out.prompt_token_ids, skip_special_tokens=False)
    assert text.endswith("My favourite fruit is")  # the assistant's turn is left open
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(partial, greedy(), continue_final_message=True)
