from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from services.engine import sampler as sampler_module
from services.engine import sampling_batch as batch_module
from services.engine.cpu_ops import ops
from services.engine.sampler import (
    Sampler,
    SamplerOutput,
    apply_penalties,
    apply_top_k_top_p_min_p,
    make_generator,
)
from services.engine.sampling_batch import SamplingBatch, SamplingRequest
from services.protocol.sampling_params import SamplingParams

NUM_DRAWS = 20_000
# Hand-picked probabilities (sum 1) so every truncation below has a clear margin.
PROBS = np.array([0.35, 0.25, 0.15, 0.10, 0.08, 0.04, 0.02, 0.01])
LOGITS = torch.tensor(np.log(PROBS), dtype=torch.float32)


@pytest.fixture(params=["kernel", "torch"])
def noise_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on both implementations of truncation and noise: the CPU kernels
    (selection for top-k/top-p; counter-based noise fused with the argmax) and torch's
    (top candidates, then a sort; exponential_), the path of every other device."""
    if request.param == "kernel":
        if ops() is None:
            pytest.skip("the CPU kernels did not build here")
    else:
        monkeypatch.setattr(sampler_module, "kernels_for", lambda x: None)
    return request.param


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch paths only, as on devices other than the CPU (the tests of their parts)."""
    monkeypatch.setattr(sampler_module, "kernels_for", lambda x: None)


def row(
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: Sequence[int] = (),
    **params: object,
) -> SamplingRequest:
    p = SamplingParams(**params)
    generator = make_generator(p.seed) if p.seed is not None else None
    return SamplingRequest(p, list(prompt), list(output), generator, list(eos))


def sample(logits: torch.Tensor, rows: Sequence[SamplingRequest],
           sampler: Sampler | None = None) -> SamplerOutput:
    """The sampler over ``rows`` as the engine hands them over: one ``SamplingBatch``."""
    batch = SamplingBatch.from_requests(rows, logits.shape[-1])
    return (sampler or Sampler())(logits, batch)


def penalize(logits: torch.Tensor, rows: Sequence[SamplingRequest]) -> torch.Tensor:
    pen = SamplingBatch.from_requests(rows, logits.shape[-1]).penalties
    return logits if pen is None else apply_penalties(logits, pen)


def draw_counts(logits: torch.Tensor, n: int = NUM_DRAWS, **params: object) -> np.ndarray:
    """Token counts from one batch of n identical unseeded rows (global RNG pinned)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tokens = sample(logits.expand(n, -1), [row(**params)] * n).token_ids
    return np.bincount(tokens, minlength=logits.numel())


def fit_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of counts against probs; tokens with probability 0 must never occur."""
    probs = probs / probs.sum()
    kept = probs > 0
    assert counts[~kept].sum() == 0, f"masked tokens were sampled: {counts}"
    expected = probs[kept] * counts.sum()
    return float(chisquare(counts[kept], expected).pvalue)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# --- greedy -----------------------------------------------------------------------------------


def test_all_greedy_is_argmax_and_draws_no_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler_module, "gumbel_argmax", _fail)
    logits = torch.randn(16, 100, generator=make_generator(0))
    out = sample(logits, [row(temperature=0) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16


def test_greedy_rows_in_a_mixed_batch_are_argmax(noise_path: str) -> None:
    logits = torch.randn(8, 50, generator=make_generator(1))
    rows = [row(temperature=0) if i % 2 else row(temperature=1.0, top_k=5) for i in range(8)]
    tokens = sample(logits, rows).token_ids
    argmax = logits.argmax(-1).tolist()
    assert [tokens[i] for i in range(1, 8, 2)] == [argmax[i] for i in range(1, 8, 2)]


@pytest.mark.skipif(ops() is None, reason="the CPU kernels did not build here")
def test_on_the_cpu_the_kernel_makes_the_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's exponential_ draws one number at a time on one thread: a quarter of a decode
    # step at SmolLM2's vocabulary. The CPU must never take it.
    monkeypatch.setattr(sampler_module, "_gumbel_noise", _fail)
    rows = [row(temperature=0.8), row(seed=3, top_p=0.9), row(temperature=0)]
    assert len(sample(torch.randn(3, 1000), rows).token_ids) == 3


def test_no_penalties_skip_the_counting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_module, "token_counts", _fail)
    monkeypatch.setattr(sampler_module, "apply_penalties", _fail)
    sample(torch.randn(3, 10), [row(prompt=[1, 2], output=[3]) for _ in range(3)])


def _fail(*args: object, **kwargs: object) -> None:
    raise AssertionError("this work should have been skipped")


# --- the distribution -------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_samples_follow_softmax_of_logits_over_t(temperature: float, noise_path: str) -> None:
    counts = draw_counts(LOGITS, temperature=temperature)
    assert fit_p_value(counts, softmax(np.log(PROBS) / temperature)) > 1e-3


@pytest.mark.parametrize(
    "wrong_noise",
    [
        torch.rand_like,  # uniform instead of Gumbel
        torch.randn_like,  # normal instead of Gumbel
        lambda x: (-torch.rand_like(x).log()).log(),  # log(E) = minus a Gumbel
    ],
)
def test_the_fit_test_rejects_wrong_noise(
    monkeypatch: pytest.MonkeyPatch, wrong_noise, torch_path: None
) -> None:
    # Proves the test above has teeth: the same check fails when the noise is not Gumbel.
    monkeypatch.setattr(sampler_module, "_gumbel_noise", lambda logits, rows: wrong_noise(logits))
    counts = draw_counts(LOGITS, temperature=1.0)
    assert fit_p_value(counts, PROBS) < 1e-6


def test_temperature_is_applied_before_the_noise(noise_path: str) -> None:
    # argmax(logits + G) at T = 0.5 would follow PROBS, not PROBS ** 2.
    counts = draw_counts(LOGITS, temperature=0.5)
    assert fit_p_value(counts, PROBS) < 1e-6


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        ({"top_k": 3}, [0, 1, 2]),
        ({"top_k": 100}, list(range(8))),  # k beyond the vocabulary keeps everything
        ({"top_p": 0.7}, [0, 1, 2]),  # mass before token 2 is 0.60, before token 3 0.75
        ({"min_p": 0.25}, [0, 1, 2, 3]),  # floor 0.0875
        # top-p over the top-5's renormalised mass (0.93): mass before token 4 is 0.806/0.93.
        ({"top_k": 5, "top_p": 0.9, "min_p": 0.2}, [0, 1, 2, 3]),
        # On the temperature-scaled distribution (p ** 2 renormalised): floor 0.25 * 0.542.
        ({"temperature": 0.5, "min_p": 0.25}, [0, 1]),
        ({"temperature": 0.5, "top_p": 0.8}, [0, 1]),  # mass before token 2 is 0.819
    ],
)
def test_truncated_samples_follow_the_renormalised_distribution(
    params: dict, kept: list[int], noise_path: str
) -> None:
    temperature = params.get("temperature", 1.0)
    probs = softmax(np.log(PROBS) / temperature)
    mask = np.zeros_like(probs)
    mask[kept] = 1.0
    counts = draw_counts(LOGITS, **params)
    assert fit_p_value(counts, probs * mask) > 1e-3


def test_truncation_masks_only_what_it_should() -> None:
    logits = LOGITS.expand(4, -1)
    out = apply_top_k_top_p_min_p(
        logits, top_k=[0, 2, 0, 0], top_p=[1.0, 1.0, 0.7, 1.0], min_p=[0.0, 0.0, 0.0, 0.25]
    )
    alive = torch.isfinite(out).sum(-1).tolist()
    assert alive == [8, 2, 3, 4]
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])


# Most rows past the candidates (twice, then sorted), some past the first count, none.
@pytest.mark.parametrize("candidates", [(1, 2), (3, 30), (256, 4096)])
def test_truncation_from_the_top_candidates_equals_the_full_sort(
    monkeypatch: pytest.MonkeyPatch, candidates: tuple[int, int], torch_path: None
) -> None:
    monkeypatch.setattr(sampler_module, "_CANDIDATES", candidates)
    gen = make_generator(5)
    for vocab in (8, 40, 1000):
        # Integer logits: ties everywhere, at the cuts too (a stable sort keeps the lower ids).
        logits = torch.randint(-4, 5, (64, vocab), generator=gen).float()
        logits[::5, ::3] = float("-inf")  # banned tokens (logit_bias, min_tokens)
        top_k = torch.randint(0, 12, (64,), generator=gen).tolist()
        top_p = [1.0 if i % 4 == 0 else 0.05 + 0.9 * x
                 for i, x in enumerate(torch.rand(64, generator=gen).tolist())]
        fast = sampler_module._mask_top_k_top_p(logits, top_k, top_p)
        ks = [min(k, vocab) if k > 0 else vocab for k in top_k]
        assert torch.equal(fast, sampler_module._mask_top_k_top_p_sorted(logits, ks, top_p))


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_top_k_and_top_p_never_sort_a_peaked_vocabulary(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    # A full sort of 8 x 49k logits is 70% of a CPU decode step.
    if path == "torch":
        monkeypatch.setattr(sampler_module, "kernels_for", lambda x: None)
    elif ops() is None:
        pytest.skip("the CPU kernels did not build here")
    else:  # the CPU's kernel selects the cut: not even the top candidates
        monkeypatch.setattr(sampler_module, "_truncate", _fail)
    monkeypatch.setattr(sampler_module, "_mask_top_k_top_p_sorted", _fail)
    logits = torch.randn(8, 50_000, generator=make_generator(6)) * 5
    out = apply_top_k_top_p_min_p(logits, top_k=[0, 40] * 4, top_p=[0.9, 1.0] * 4,
                                  min_p=[0.0] * 8)
    alive = torch.isfinite(out).sum(-1).tolist()
    assert alive[1::2] == [40] * 4 and all(1 <= n <= 256 for n in alive[::2])


def test_top_p_one_keeps_a_long_tail() -> None:
    # A vocabulary whose tail rounds the cumulative mass to 1.0 in float32.
    logits = torch.cat([torch.tensor([30.0]), torch.zeros(50_000)]).unsqueeze(0)
    out = apply_top_k_top_p_min_p(logits, top_k=[10**6], top_p=[1.0], min_p=[0.0])
    assert torch.isfinite(out).all()


def test_seeded_rows_follow_the_distribution(noise_path: str) -> None:
    n = 5_000
    rows = [row(seed=s, temperature=1.0) for s in range(n)]
    tokens = sample(LOGITS.expand(n, -1), rows).token_ids
    assert fit_p_value(np.bincount(tokens, minlength=8), PROBS) > 1e-3


def test_one_seeded_request_over_many_steps_follows_the_distribution(noise_path: str) -> None:
    sampler, request = Sampler(), row(seed=7, top_k=4)
    logits = LOGITS.unsqueeze(0)
    tokens = [sample(logits, [request], sampler).token_ids[0] for _ in range(2_000)]
    mask = np.array([1.0] * 4 + [0.0] * 4)
    assert fit_p_value(np.bincount(tokens, minlength=8), PROBS * mask) > 1e-3


# --- seeds ------------------------------------------------------------------------------------


def _run_steps(logits: torch.Tensor, make_rows, target: int, steps: int = 30) -> list[int]:
    sampler, rows = Sampler(), make_rows()
    return [sample(logits, rows, sampler).token_ids[target] for _ in range(steps)]


def test_seeded_request_is_reproducible_whatever_the_batch(noise_path: str) -> None:
    vocab = 1000
    logits = torch.randn(6, vocab, generator=make_generator(3)) * 3
    mine = {"seed": 1234, "temperature": 0.9, "top_p": 0.95}
    alone = _run_steps(logits[3:4], lambda: [row(**mine)], target=0)
    torch.manual_seed(99)  # the unseeded rows' draws must not matter
    crowd = _run_steps(
        logits,
        lambda: [
            row(temperature=1.3),
            row(temperature=0),
            row(seed=5, top_k=10),
            row(**mine),
            row(logprobs=3, seed=1234, temperature=0.5),
            row(prompt=[1, 2], output=[4], repetition_penalty=1.3),
        ],
        target=3,
    )
    assert alone == crowd
    other_seed = _run_steps(logits[3:4], lambda: [row(**{**mine, "seed": 4321})], target=0)
    assert other_seed != alone


def test_seed_without_a_generator_is_rejected() -> None:
    request = SamplingRequest(SamplingParams(seed=1), [], [], None, [])
    with pytest.raises(ValueError, match="generator"):
        sample(torch.zeros(1, 4), [request])


def test_logits_must_have_one_row_per_request() -> None:
    with pytest.raises(AssertionError):  # the runner's invariant, not a client's input
        sample(torch.zeros(2, 4), [row()])


# --- penalties --------------------------------------------------------------------------------


def test_penalties_change_logits_exactly_as_defined() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]])
    request = row(
        prompt=[0, 4],
        output=[1, 1, 2],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    out = penalize(logits, [request])
    # repetition on {0, 1, 2, 4}: 2 -> 1, -1 -> -2, 0.5 -> 0.25, -0.5 -> -1; 3 untouched.
    # then output counts {1: 2, 2: 1}: token 1 -2 - 0.5*2 - 0.25, token 2 0.25 - 0.5 - 0.25.
    assert out.tolist() == [[1.0, -3.25, -0.5, 3.0, -1.0]]
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, -0.5]]  # the input is left alone


def test_presence_and_frequency_ignore_prompt_tokens() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    request = row(prompt=[0, 1, 1], output=[2], frequency_penalty=1.0, presence_penalty=-1.0)
    assert penalize(logits, [request]).tolist() == [[1.0, 2.0, 3.0]]


def test_penalties_touch_only_the_rows_that_have_them() -> None:
    logits = torch.tensor([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]])
    rows = [row(output=[1]), row(output=[1], presence_penalty=1.5), row(output=[0, 0])]
    assert penalize(logits, rows).tolist() == [[1.0, 2.0], [1.0, 0.5], [1.0, 2.0]]
    assert penalize(logits, [rows[0], rows[2]]) is logits


def test_repetition_penalty_turns_greedy_away_from_a_repeat() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0]])
    request = row(prompt=[1], temperature=0, repetition_penalty=2.0)
    assert sample(logits, [request]).token_ids == [2]


def test_penalties_reject_token_ids_outside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="token ids"):
        penalize(torch.zeros(1, 4), [row(output=[4], presence_penalty=1.0)])


# --- min_tokens -------------------------------------------------------------------------------

EOS = 3


def _min_tokens_pick(output_len: int, **params: object) -> int:
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0]])  # EOS (3) first, token 4 second
    request = row(output=[0] * output_len, eos=[EOS], temperature=0, **params)
    return sample(logits, [request]).token_ids[0]


def test_min_tokens_bans_eos_until_reached() -> None:
    assert _min_tokens_pick(0, min_tokens=2) == 4
    assert _min_tokens_pick(1, min_tokens=2) == 4
    assert _min_tokens_pick(2, min_tokens=2) == EOS


def test_min_tokens_bans_stop_token_ids_too() -> None:
    assert _min_tokens_pick(0, min_tokens=1, stop_token_ids=[4]) == 2


def test_with_ignore_eos_min_tokens_leaves_eos_alone() -> None:
    # As vLLM: EOS is no stop token when it is ignored, so nothing holds it back.
    assert _min_tokens_pick(0, min_tokens=1, ignore_eos=True) == EOS


def test_min_tokens_holds_for_sampled_rows_and_ignores_ids_past_the_vocab() -> None:
    logits = torch.tensor([0.0, 0.0, 0.0, 2.0])
    rows = [row(eos=[3, 77], min_tokens=1) for _ in range(500)]
    tokens = sample(logits.expand(500, -1), rows).token_ids
    assert EOS not in tokens
    assert set(tokens) == {0, 1, 2}


# --- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_the_raw_log_softmax_with_sorted_top_n() -> None:
    logits = torch.randn(5, 40, generator=make_generator(11)) * 2
    rows = [
        row(logprobs=5, temperature=0.7),
        row(),
        row(logprobs=0, temperature=0),
        row(logprobs=20, output=[1, 2], repetition_penalty=1.5, frequency_penalty=1.0),
        row(logprobs=3, temperature=0, seed=8),
    ]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    for i in (0, 2, 3, 4):
        lp, token = out.logprobs[i], out.token_ids[i]
        assert lp is not None
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(raw[i, token].item(), abs=1e-6)
        assert lp.rank == int((raw[i] >= raw[i, token]).sum())
        n = rows[i].params.logprobs
        assert [t for t, _ in lp.top] == raw[i].topk(n).indices.tolist()
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(raw[i].topk(n).values.tolist(), abs=1e-6)
    assert out.logprobs[2].top == []
    assert out.logprobs[2].rank == 1
    assert out.logprobs[4].rank == 1
