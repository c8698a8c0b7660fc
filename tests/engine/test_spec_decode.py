"""Speculative decoding in the engine, on tiny random models (fp32): greedy outputs equal to
speculation off and to transformers' own speculative generation, with prompt lookup, a
deliberately bad draft model (another random model) and the target as its own draft (every
draft accepted); the sampling law kept end to end; the counters' invariants; and the engine's
features under speculation (stop tokens inside an accepted run, penalties, logit_bias,
min_tokens and logprobs at every verified position, seeds, async scheduling, chunked prefill,
the prefix cache, preemption, tensor parallelism).

``benchmarks/spec_decode_equality.py`` runs the transformers comparison on all 20 prompts
(here: 4 of them, to keep the suite's time)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from services.engine.config import EngineConfig
from services.engine.spec_decode.config import SpeculativeConfig
from services.engine.spec_decode.metrics import SpecDecodeStats
from services.engine.step_buffers import StepBuffers
from services.protocol.sampling_params import SamplingParams
from tests.support import spec_decode as sd

VOCAB = 256


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return tiny_model_dir("LlamaForCausalLM")


@pytest.fixture(scope="module")
def bad_draft(tiny_model_dir):
    return tiny_model_dir("LlamaForCausalLM", seed=1)


@pytest.fixture(scope="module")
def prompts():
    return sd.repetitive_prompts(sd.NUM_PROMPTS, VOCAB)


@pytest.fixture(scope="module")
def reference(target, prompts):
    """Greedy outputs without speculation."""
    eng = sd.engine(target, num_blocks=256)
    try:
        return sd.run(eng, prompts, sd.greedy())
    finally:
        eng.close()


# Every test of the engine under speculation runs synchronously and with async scheduling.
STEPPING = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def _check_invariants(stats: SpecDecodeStats) -> None:
    per_pos = stats.accepted_per_position
    assert sum(per_pos) == stats.num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert stats.num_draft_tokens <= stats.num_drafts * stats.num_speculative_tokens


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "key"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1},
     "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"},
     "speculative_model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "model": "/nonexistent", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "model": "/nonexistent", "num_speculative_tokens": 2,
      "prompt_lookup_max": 3}, "prompt_lookup_max"),
])
def test_a_bad_config_is_refused_naming_the_key(target, raw, key) -> None:
    with pytest.raises(ValueError, match=f"speculative_config.{key}"):
        EngineConfig(model=str(target), speculative_config=raw)


def test_a_draft_with_another_vocabulary_is_refused_at_start(target, tiny_model_dir) -> None:
    other = tiny_model_dir("LlamaForCausalLM", seed=2, vocab_size=128)
    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocabulary"):
        EngineConfig(model=str(target), speculative_config=sd.draft(other))


def test_the_flag_reads_vllm_json_and_a_bad_one_exits_2(target, capsys) -> None:
    from services.engine.serving.server_config import configs_from_args

    engine, _ = configs_from_args(["--model", str(target), "--speculative-config",
                                   '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert engine.speculative_config == SpeculativeConfig("ngram", 4, None, 5, 5)
    with pytest.raises(SystemExit) as exit_info:
        configs_from_args(["--model", str(target), "--speculative-config",
                           '{"method": "medusa", "num_speculative_tokens": 4}'])
    assert exit_info.value.code == 2
    assert "speculative_config.method must be one of ngram, draft_model" in \
        capsys.readouterr().err


# -- greedy equality -----------------------------------------------------------------------------


@STEPPING
@pytest.mark.parametrize("kind", ["ngram", "bad_draft", "self_draft"])
def test_greedy_equals_speculation_off_and_transformers(kind, target, bad_draft, prompts,
                                                         reference, async_scheduling) -> None:
    spec = {"ngram": sd.ngram(), "bad_draft": sd.draft(bad_draft),
            "self_draft": sd.draft(target)}[kind]
    eng = sd.engine(target, spec, num_blocks=256, async_scheduling=async_scheduling)
    try:
        assert sd.run(eng, prompts, sd.greedy()) == reference
        stats = eng.stats().spec_decode
    finally:
        eng.close()
    _check_invariants(stats)
    assert stats.num_drafts > 50
    if kind == "self_draft":  # the target as its own draft: every draft accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    elif kind == "ngram":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks
    if not async_scheduling:  # transformers' side is the same either way
        assert sd.hf_speculative(target, prompts[:4], spec) == reference[:4]


def test_draft_passes_staged_in_one_copy_give_the_same_tokens(target, bad_draft, prompts,
                                                              reference) -> None:
    """A GPU's way for the draft's passes (``DraftModel.staging``: each pass put on the device
    in one copy from the step buffers, on the step thread), run over the CPU's step buffers:
    the same greedy tokens, and every pass went through them."""
    eng = sd.engine(target, sd.draft(bad_draft), num_blocks=256)
    try:
        runner, c = eng.runner, eng.runner.config
        width = runner.input_batch.block_table.shape[1]
        staging = StepBuffers(c.max_num_batched_tokens, c.max_num_seqs, width, c.block_size,
                              runner.device)
        staged = []
        real = staging.stage
        staging.stage = lambda *a, **k: staged.append(1) or real(*a, **k)
        runner.features.get("speculation").draft.staging = staging
        assert sd.run(eng, prompts[:4], sd.greedy()) == reference[:4]
    finally:
        eng.close()
    assert len(staged) > 20  # every pass of every drafting step


# -- the sampling law ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab(tiny_model_dir):
    """Models of a 12-token vocabulary: pairs of tokens fall into few enough cells to compare
    two samples of 2,000."""
    return (tiny_model_dir("LlamaForCausalLM", seed=3, vocab_size=12),
            tiny_model_dir("LlamaForCausalLM", seed=4, vocab_size=12))


def _pairs(model, spec, seed: int) -> np.ndarray:
    torch.manual_seed(seed)
    eng = sd.engine(model, spec, num_blocks=1024, max_num_seqs=256)
    params = SamplingParams(max_tokens=2, temperature=1.0, ignore_eos=True)
    # Every token occurs in the prompt, so prompt lookup always has a draft for the second.
    motif = [5, 2, 9, 0, 11, 3, 7, 1, 10, 4, 8, 6]
    prompts = [(motif * 2)[i % 12 : i % 12 + 14] for i in range(2000)]
    try:
        out = sd.run(eng, prompts, params)
        stats = eng.stats().spec_decode
    finally:
        eng.close()
    if spec is not None:  # both verdicts, many times
        assert stats.num_drafts > 1500
        assert 100 < stats.num_accepted_tokens < stats.num_draft_tokens - 100
        _check_invariants(stats)
    return np.array([a * 12 + b for a, b in out])


def test_sampling_law_is_kept_end_to_end(small_vocab) -> None:
    """2,000 requests of two tokens at temperature 1 (the second verified against a draft),
    with and without speculation: a two-sample chi-square on the pairs."""
    target, draft = small_vocab
    off = _pairs(target, None, 0)
    for spec in (sd.ngram(k=2), sd.draft(draft, k=2)):
        on = _pairs(target, spec, 1)
        table = np.stack([np.bincount(off, minlength=144), np.bincount(on, minlength=144)])
        table = table[:, table.sum(0) >= 10]
        assert chi2_contingency(table).pvalue > 1e-3, spec["method"]


# -- the engine's features under speculation -----------------------------------------------------


@STEPPING
def test_stop_token_inside_an_accepted_run_ends_the_request_there(target, prompts, reference,
                                                                  async_scheduling) -> None:
    # A token each output reaches after a few tokens: with 100% acceptance it sits inside a run.
    stops = [ref[5] for ref in reference[:6]]
    params = [SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[t]) for t in stops]
    eng = sd.engine(target, sd.draft(target), num_blocks=256, async_scheduling=async_scheduling)
    try:
        got = sd.run(eng, prompts[:6], params)
    finally:
        eng.close()
    for out, ref, t in zip(got, reference, stops, strict=False):
        assert out == ref[: ref.index(t) + 1]


@STEPPING
def test_penalties_bias_min_tokens_and_logprobs_apply_at_every_position(target, prompts,
                                                                        async_scheduling) -> None:
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=0.6,
                       presence_penalty=0.4, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, logit_bias={7: 5.0, 9: 3.0},
                       ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, min_tokens=20, logprobs=3),
        SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True),
    ]

    def outputs(spec):
        eng = sd.engine(target, spec, num_blocks=256, async_scheduling=async_scheduling)
        reqs = [eng.add_request(f"p{i}", p, sp)
                for i, (p, sp) in enumerate(zip(prompts, params, strict=False))]
        lps = {r.request_id: [] for r in reqs}
        while eng.has_unfinished_requests():
            for u in eng.step():
                lps[u.request_id].extend(u.new_logprobs)
        eng.close()
        return [list(r.output_token_ids) for r in reqs], lps, eng.stats().spec_decode

    want, want_lps, _ = outputs(None)
    for spec in (sd.draft(target), sd.ngram()):
        got, got_lps, stats = outputs(spec)
        assert got == want
        assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < \
            stats.num_draft_tokens  # penalties and bias make some drafts wrong
        for rid, lps in got_lps.items():
            for a, b in zip(lps, want_lps[rid], strict=True):
                if b is None:
                    assert a is None
                    continue
                assert (a.token_id, a.rank) == (b.token_id, b.rank)
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]


@STEPPING
def test_seeded_sampling_is_reproducible_alone_or_in_a_batch(target, bad_draft, prompts,
                                                             async_scheduling) -> None:
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=11,
                            ignore_eos=True)
    for spec in (sd.ngram(), sd.draft(bad_draft)):
        eng = sd.engine(target, spec, num_blocks=256, async_scheduling=async_scheduling)
        try:
            alone = sd.run(eng, prompts[:1], params)
            batched = sd.run(eng, prompts[:6], [params] + [SamplingParams(
                max_tokens=32, temperature=1.0, ignore_eos=True)] * 5)
        finally:
            eng.close()
        assert batched[0] == alone[0]


@pytest.mark.parametrize("setting", ["async", "chunked", "prefix_cache", "preemption",
                                     "disable_by_batch_size"])
def test_greedy_is_unchanged_by_the_engine_setting(setting, target, prompts, reference) -> None:
    config = {"num_blocks": 256}
    spec = sd.draft(target)
    if setting == "async":
        config["async_scheduling"] = True
        spec = sd.ngram()
    elif setting == "chunked":  # long prompts in chunks; drafts cut to the budget
        config["max_num_batched_tokens"] = 16
    elif setting == "preemption":
        config["num_blocks"] = 48
    elif setting == "disable_by_batch_size":  # speculation only once few requests are left
        config["async_scheduling"] = True
        spec = sd.draft(target, disable_by_batch_size=6)
    eng = sd.engine(target, spec, **config)
    try:
        if setting == "disable_by_batch_size":  # requests of different lengths, ending apart
            lengths = [min(sd.NEW_TOKENS, 6 + 3 * i) for i in range(len(prompts))]
            got = sd.run(eng, prompts, [sd.greedy(n) for n in lengths])
            assert got == [ref[:n] for ref, n in zip(reference, lengths, strict=True)]
        else:
            assert sd.run(eng, prompts, sd.greedy()) == reference
        if setting == "prefix_cache":  # again: the prompts' blocks (both models') are cached
            assert sd.run(eng, prompts, sd.greedy()) == reference
            assert eng.stats().prefix_cache_hits > 0
        stats = eng.stats()
    finally:
        eng.close()
    assert stats.spec_decode.num_drafts > 0
    if setting == "preemption":
        assert stats.num_preemptions > 0
    if setting != "async":  # the draft is the target: every draft accepted
        assert stats.spec_decode.num_accepted_tokens == stats.spec_decode.num_draft_tokens


@pytest.mark.parametrize("kind", ["ngram", "self_draft"])
def test_a_request_joining_a_drafting_batch_past_the_limit_under_async(kind, target, prompts,
                                                                      reference) -> None:
    """disable_by_batch_size = 2, async scheduling: a third request joins while two draft. The
    step that admits it carries drafts, so the next one must wait for its tokens (it once
    asked only whether the grown batch drafts, and was scheduled on wrong token counts)."""
    spec = {"ngram": sd.ngram, "self_draft": lambda **kw: sd.draft(target, **kw)}[kind](
        disable_by_batch_size=2)
    eng = sd.engine(target, spec, num_blocks=256, async_scheduling=True)
    n = 24
    try:
        reqs = [eng.add_request(f"q{i}", list(prompts[i]), sd.greedy(n)) for i in range(2)]
        for _ in range(3):
            eng.step()
        assert eng.stats().spec_decode.num_drafts > 0  # the two draft when the third comes
        reqs.append(eng.add_request("q2", list(prompts[2]), sd.greedy(n)))
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        eng.close()
    assert [list(r.output_token_ids) for r in reqs] == [ref[:n] for ref in reference[:3]]


def test_tensor_parallel_with_the_draft_unsharded_on_rank_0(target, prompts, reference) -> None:
    eng = sd.engine(target, sd.draft(target), num_blocks=256, tensor_parallel_size=2)
    try:
        assert sd.run(eng, prompts[:8], sd.greedy()) == reference[:8]
        stats = eng.stats().spec_decode
    finally:
        eng.close()
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
