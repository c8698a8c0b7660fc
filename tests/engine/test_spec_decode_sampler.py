"""The rejection sampler alone, no model: whatever the drafts and whatever distribution they
came from, every emitted token follows the target's distribution at its position, drafts are
accepted as often as ``sum(min(p, q))`` says, a draft from the target's own distribution is
always accepted, and greedy rows accept exactly while the draft is the argmax.

Each case is 200,000 requests verified at once (one ``verify`` call over ``200,000 x (k + 1)``
positions of a 16-token vocabulary), at a fixed seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from services.engine.sampling_batch import SamplingBatch, make_truncation
from services.engine.spec_decode import verifier

VOCAB = 16
DRAWS = 200_000


def _batch(n: int, top_k: int = 0, top_p: float = 1.0, greedy: bool = False) -> SamplingBatch:
    return SamplingBatch(
        num_rows=n,
        greedy=np.full(n, greedy),
        temperature=np.ones(n, np.float32),
        truncation=make_truncation(np.full(n, top_k, np.int64), np.full(n, top_p, np.float64),
                                   np.zeros(n, np.float32)),
        generators=None, logprobs=None, logit_bias=None, banned=None, penalties=None)


def _verify(logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None,
            **batch: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits``: [k + 1, V] the target's at each position (the same for every request);
    ``drafts``: [n, k]; ``q``: [k, V] or None (one-hot drafts). Returns the accepted counts
    [n] and the emitted tokens [n, k + 1] (-1 past each request's last)."""
    n, k = drafts.shape
    counts = np.full(n, k + 1)
    spec = verifier.SpecInputs(
        num_drafts=np.full(n, k, np.int64), drafts=drafts, draft_at=np.zeros(0, np.int64),
        positions=_batch(n * (k + 1), **batch), owner=np.repeat(np.arange(n), counts),
        ahead=np.tile(np.arange(k + 1), n), q=None if q is None else q.expand(n, k, VOCAB))
    _, out = verifier.verify(logits.repeat(n, 1), spec, _batch(n, **batch))
    accepted = torch.tensor(out.num_accepted)
    last = torch.tensor([run[-1] for run in out.runs])
    assert all(run[:-1] == d[: len(run) - 1] for run, d in zip(out.runs[:100], drafts.tolist(),
                                                               strict=False))
    j = torch.arange(k + 1)
    emitted = torch.where(j < accepted.unsqueeze(1), torch.cat([drafts, drafts[:, :1]], 1), -1)
    emitted[torch.arange(n), accepted] = last
    return accepted, emitted


def _target(probs: np.ndarray, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution sampling draws from: top-k, then top-p of the survivors, renormalised
    (ties are absent: the probabilities are continuous draws)."""
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(VOCAB, bool)
    kept = probs[order][: top_k or VOCAB]
    mass_before = np.cumsum(kept / kept.sum()) - kept / kept.sum()
    keep[order[: len(kept)][mass_before < top_p]] = True
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def _check_position(tokens: torch.Tensor, p: np.ndarray) -> None:
    counts = np.bincount(tokens.numpy(), minlength=VOCAB)
    assert counts[p == 0].sum() == 0, "a token the target never picks was emitted"
    expected = p * counts.sum()
    big = expected >= 5
    f_obs = np.append(counts[big], counts[~big].sum())
    f_exp = np.append(expected[big], expected[~big].sum())
    if f_exp[-1] == 0:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    assert chisquare(f_obs, f_exp).pvalue > 1e-3, (counts, expected)


def _within_4_sigma(hits: int, trials: int, rate: float) -> None:
    sigma = np.sqrt(trials * rate * (1 - rate))
    assert abs(hits - trials * rate) <= 4 * sigma + 1e-9, (hits, trials, rate)


@pytest.mark.parametrize(("case", "k"), [("draft_model", 1), ("draft_model", 2),
                                         ("draft_model", 3), ("draft_model", 4),
                                         ("one_hot", 4), ("top_k_top_p", 3)])
def test_every_position_follows_the_target_and_acceptance_is_sum_min_p_q(case: str,
                                                                         k: int) -> None:
    rng = np.random.default_rng(k + 10 * len(case))
    torch.manual_seed(k)
    truncation = {"top_k": 6, "top_p": 0.8} if case == "top_k_top_p" else {}
    # Peaked targets and drafts near them (as a useful draft is), so that every position is
    # reached often enough to be tested; q still differs from p everywhere.
    raw = rng.dirichlet(np.full(VOCAB, 0.3), size=k + 1)
    p = np.stack([_target(r, **truncation) for r in raw])
    q = 0.6 * raw[:k] + 0.4 * rng.dirichlet(np.ones(VOCAB), size=k)
    q_t = torch.tensor(q, dtype=torch.float32)
    drafts = torch.multinomial(q_t, DRAWS, replacement=True).T.contiguous()  # [n, k]
    logits = torch.tensor(np.log(raw), dtype=torch.float32)
    accepted, emitted = _verify(logits, drafts, None if case == "one_hot" else q_t,
                                **truncation)
    for j in range(k + 1):
        reached = accepted >= j
        _check_position(emitted[reached, j], p[j])
        if j < k:
            # one-hot drafts: q is a point mass at the draft, so min(p, q) sums to p(draft)
            rate = float((p[j] * q[j]).sum() if case == "one_hot"
                         else np.minimum(p[j], q[j]).sum())
            _within_4_sigma(int((accepted[reached] > j).sum()), int(reached.sum()), rate)


def test_drafts_from_the_target_itself_are_always_accepted() -> None:
    rng = np.random.default_rng(7)
    torch.manual_seed(7)
    k = 4
    p = rng.dirichlet(np.ones(VOCAB), size=k + 1)
    q = torch.tensor(p[:k], dtype=torch.float32)
    drafts = torch.multinomial(q, DRAWS, replacement=True).T.contiguous()
    accepted, emitted = _verify(torch.tensor(np.log(p), dtype=torch.float32), drafts, q)
    assert (accepted == k).all()
    assert torch.equal(emitted[:, :k], drafts)
    _check_position(emitted[:, k], p[k])  # the bonus token


def test_greedy_rows_accept_while_the_draft_is_the_argmax() -> None:
    logits = torch.randn(4, VOCAB)
    best = logits.argmax(-1)
    wrong = (best + 1) % VOCAB
    drafts = torch.stack([best[:3], torch.stack([best[0], wrong[1], best[2]]),
                          torch.stack([wrong[0], best[1], best[2]])])
    accepted, emitted = _verify(logits, drafts, None, greedy=True)
    assert accepted.tolist() == [3, 1, 0]
    assert emitted[0].tolist() == best.tolist()  # every draft, then the bonus argmax
    assert emitted[1, :2].tolist() == [best[0], best[1]]  # the argmax replaces the rejected
    assert emitted[2, :1].tolist() == [best[0]]
