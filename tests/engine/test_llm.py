"""End-to-end engine behaviour on the real default model (SmolLM2-135M-Instruct, fp32 CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.batch import run_batch

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

SENTENCES = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three prime numbers:",
    "Kubernetes schedules pods onto nodes by",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "Translate to French: good morning",
]


def mixed_prompts(count: int) -> list[str]:
    """Prompts of very different lengths (a few tokens to a few hundred)."""
    out = []
    for i in range(count):
        head = SENTENCES[i % len(SENTENCES)]
        filler = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range((i * 7) % 23))
        out.append(f"{filler} {head}".strip())
    return out


@pytest.fixture(scope="module")
def llm(default_model_path) -> LLM:
    return LLM(str(default_model_path))


def texts(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_generate_matches_transformers_greedy(llm: LLM, default_model_path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(default_model_path), dtype=torch.float32)
    prompts = ["Hello", "The capital of France is"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        ref = hf.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist()
        assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids)
        assert out.outputs[0].finish_reason == "length"


def test_greedy_identical_alone_and_in_a_mixed_batch_of_32(llm: LLM) -> None:
    prompts = mixed_prompts(32)
    batched = texts(llm.generate(prompts, GREEDY, use_tqdm=False))
    alone = [texts(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts[:6]]
    # Exact identity holds here: our CPU attention computes each request with the same
    # kernels whatever the batch; the matmuls over the flattened batch are row-independent.
    assert alone == batched[:6]


def test_greedy_identical_with_prefix_caching_off_and_under_preemption(
    llm: LLM, default_model_path
) -> None:
    prompts = mixed_prompts(12)
    reference = texts(llm.generate(prompts, GREEDY, use_tqdm=False))
    again = llm.generate(prompts, GREEDY, use_tqdm=False)  # now served from the prefix cache
    assert texts(again) == reference
    assert sum(o.num_cached_tokens for o in again) > 0

    no_cache = LLM(str(default_model_path), enable_prefix_caching=False)
    assert texts(no_cache.generate(prompts, GREEDY, use_tqdm=False)) == reference
    del no_cache

    tiny = LLM(str(default_model_path), num_blocks=48, max_num_batched_tokens=256)
    assert texts(tiny.generate(prompts, GREEDY, use_tqdm=False)) == reference
    stats = tiny.engine.stats()
    assert stats.num_preemptions > 0, "the tiny pool should have forced preemption"
    assert stats.num_free_blocks == stats.num_total_blocks


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=10, temperature=0.9, seed=1234)
    alone = llm.generate(["Tell me a story"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=10, temperature=1.0)
    outs = llm.generate(
        ["Hi there", "Tell me a story", "Why is the sky blue?"],
        [others, seeded, others],
        use_tqdm=False,
    )
    assert outs[1].outputs[0].token_ids == alone


def test_stop_strings_stop_tokens_and_lengths(llm: LLM) -> None:
    base = llm.generate(["Count: 1, 2, 3,"], SamplingParams(max_tokens=20, temperature=0),
                        use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 20
    stop_text = base.text[5:8]
    out = llm.generate(["Count: 1, 2, 3,"],
                       SamplingParams(max_tokens=20, temperature=0, stop=[stop_text]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_text
    assert out.text == base.text[: base.text.index(stop_text)]
    tok = base.token_ids[3]
    out = llm.generate(["Count: 1, 2, 3,"],
                       SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.stop_reason == tok
    assert out.token_ids == base.token_ids[: base.token_ids.index(tok) + 1]
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_total_blocks


def test_token_id_prompts_n_and_logprobs(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("The capital of France is")
    outs = llm.generate([ids], SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=7,
                                              logprobs=3), use_tqdm=False)
    assert len(outs[0].outputs) == 3
    for c in outs[0].outputs:
        assert len(c.token_ids) == 5 and len(c.logprobs) == 5
        for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
            assert tok in lp and lp[tok].logprob <= 0
        assert c.cumulative_logprob == pytest.approx(
            sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)), abs=1e-4
        )


def test_chat_applies_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}],
                   SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
    assert "<|im_start|>assistant" in out.prompt
    assert out.outputs[0].text.strip()


def test_bad_inputs_raise_value_error(llm: LLM) -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(["hi"], SamplingParams(max_tokens=10**6), use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_batch_job_writes_one_record_per_line(llm: LLM) -> None:
    lines = [
        json.dumps({"custom_id": "c1", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "m", "prompt": "Hello", "max_tokens": 4}}),
        "this is not json",
        json.dumps({"custom_id": "c3", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "m", "max_tokens": 4,
                             "messages": [{"role": "user", "content": "Hi"}]}}),
        json.dumps({"custom_id": "c4", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "m", "prompt": "x", "temperature": -3}}),
        json.dumps({"custom_id": "c5", "method": "POST", "url": "/v1/embeddings", "body": {}}),
    ]
    records = run_batch(llm, lines, use_tqdm=False)
    assert [r["custom_id"] for r in records] == ["c1", None, "c3", "c4", "c5"]
    assert records[0]["error"] is None
    assert records[0]["response"]["body"]["usage"]["completion_tokens"] == 4
    assert records[2]["response"]["body"]["choices"][0]["message"]["content"]
    assert all(records[i]["error"] is not None for i in (1, 3, 4))
    assert records[3]["response"]["status_code"] == 400
    assert "temperature" in records[3]["error"]["message"]


def test_batch_command_line_runs_with_engine_flags(fast_model_dir, tmp_path) -> None:
    """``python -m services.engine.batch IN OUT`` and the engine server's own flags (the one
    CLI scheme): a real process, a tiny model, one result line per input line."""
    source = tmp_path / "in.jsonl"
    out = tmp_path / "out.jsonl"
    body = {"model": "m", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
    source.write_text(json.dumps({"custom_id": "a", "url": "/v1/completions", "body": body})
                      + "\nnot json\n")
    proc = subprocess.run(
        [sys.executable, "-m", "services.engine.batch", str(source), str(out),
         "--model", str(fast_model_dir), "--dtype", "float32", "--num-blocks", "32",
         "--max-num-seqs", "2", "--block-size=16", "--enable-prefix-caching=false"],
        check=False, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["a", None]
    assert records[0]["response"]["body"]["usage"]["completion_tokens"] == 3
    done = [line for line in proc.stderr.splitlines() if "batch done:" in line]
    assert done and " INFO batch " in done[0] and "lines=2 ok=1 failed=1" in done[0]
    bad = subprocess.run([sys.executable, "-m", "services.engine.batch", str(source)],
                         check=False, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "required: output" in bad.stderr
