"""Gumbel-max sampler: one batched pass over a step's logits, one row per request.

Per step, in this order (vLLM v1's, with the truncation masks in Hugging Face's order):

    raw logprobs      log_softmax of the model's logits, only for rows that ask
    logit_bias        added to the biased rows' logits (``logit_bias``)
    min_tokens        EOS (unless ignore_eos) and stop_token_ids banned until reached
    penalties         repetition (prompt + output), frequency and presence (output only)
    greedy rows       argmax, done
    other rows        / temperature -> top-k -> top-p -> min-p -> argmax(logits + Gumbel noise)

``argmax(logits / T + G)`` with ``G = -log(E)``, ``E ~ Exp(1)`` i.i.d. per vocabulary entry is an
exact draw from ``softmax(logits / T)``: no CDF, no search, one element-wise pass. A seeded row
draws its noise from its own generator, so its tokens do not depend on what else is in the
batch; unseeded rows draw from torch's global one. On the CPU the noise is the C++ kernel's
(``gumbel_argmax``: counter-based, keyed per row by one draw from that generator, fused with
the argmax); on other devices it is torch's ``exponential_``, a full vocabulary row per step.

The rows come as a ``SamplingBatch``: arrays the step owns, gathered by the persistent input
batch when the step was prepared (``input_batch``); the sampler reads nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.cpu_ops import kernels_for
from services.engine.logit_bias import apply_logit_bias
from services.engine.sampling_batch import Penalties, SamplingBatch, Truncation, make_truncation
from services.protocol.engine_api import TokenLogprobs

_NEG_INF = float("-inf")
_KEY_LOW, _KEY_HIGH = -(2**63), 2**63 - 1  # the kernel's noise keys: any int64
# top-k / top-p read this many of each row's best tokens (a topk), not a sorted vocabulary;
# rows whose cut lies further try the next count, then sort. Beyond the last count topk is
# no faster than a sort.
_CANDIDATES = (256, 4096)
_EXP_FLOOR = -80.0  # exp(-80) is 1.8e-35, still a normal float32


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A seeded request's noise source: create once, keep for the request's life (it advances)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows whose params.logprobs is None
    # The same ids on the device: async scheduling takes the next step's inputs from them.
    token_tensor: torch.Tensor | None = None


class Sampler:
    """``sampler(logits[N, V], batch) -> SamplerOutput``; never modifies ``logits``."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == batch.num_rows, (logits.shape,
                                                                          batch.num_rows)
        staged = StagedLogits(logits, batch)
        tokens = staged.greedy_tokens() if batch.greedy is None else draw(
            staged.scaled(), staged.adjusted, batch)
        logprobs = staged.logprobs(tokens)
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs, token_tensor=tokens)


class StagedLogits:
    """A batch's logits through the sampler's stages, each taken when asked for: what the
    sampler itself draws from and what another consumer of the same distributions (the
    verifier, ``spec_decode.verifier``) reads, so that both apply one set of rules. Built
    from ``logits`` as they came from the model (the raw logprobs are taken first)."""

    __slots__ = ("batch", "want", "raw", "adjusted")

    def __init__(self, logits: torch.Tensor, batch: SamplingBatch) -> None:
        logits = logits.float()
        self.batch = batch
        self.want, self.raw = raw_logprobs(logits, batch)
        self.adjusted = adjust_logits(logits, batch)  # what a greedy row takes the argmax of

    def greedy_tokens(self) -> torch.Tensor:
        return argmax_rows(self.adjusted)

    def scaled(self) -> torch.Tensor:
        """The sampling rows' log-weights (temperature, truncation); needs a sampling row."""
        return scale_and_truncate(self.adjusted, self.batch)

    def logprobs(self, tokens: torch.Tensor) -> list[TokenLogprobs | None]:
        """Each row's logprobs of ``tokens`` (one per row), for the rows that asked."""
        return token_logprobs(self.raw, self.want, tokens, self.batch)


def raw_logprobs(logits: torch.Tensor,
                 batch: SamplingBatch) -> tuple[list[int] | None, torch.Tensor | None]:
    """The rows that ask for logprobs, and their log-softmax rows: taken before anything
    changes the logits (vLLM's default "raw" logprobs)."""
    want = None
    if batch.logprobs is not None:
        want = [i for i, n in enumerate(batch.logprobs) if n >= 0]
    return want, torch.log_softmax(logits[want], -1) if want else None


def adjust_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``logit_bias``, the min_tokens bans and the penalties, in that order: what a greedy row
    takes the argmax of. Returns ``logits`` itself when the batch has none of them."""
    if batch.logit_bias is not None:
        logits = apply_logit_bias(logits, batch.logit_bias)
    if batch.banned is not None:
        logits = ban_tokens(logits, batch.banned)
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    return logits


def scale_and_truncate(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Adjusted logits / temperature (1 on greedy rows), then top-k, top-p and min-p: the
    distribution a sampling row draws from is their softmax. Needs a batch that samples."""
    assert batch.greedy is not None and batch.temperature is not None
    scaled = logits / _column(batch.temperature, logits.device)
    if batch.truncation is not None:
        scaled = apply_truncation(scaled, batch.truncation)
    return scaled


def ban_tokens(logits: torch.Tensor, banned: tuple[list[int], list[int]]) -> torch.Tensor:
    """min_tokens: a row short of it cannot pick a token that would end it (vLLM's rule);
    ``banned`` is (rows, token ids). Returns a new tensor."""
    out = logits.clone()
    out[banned[0], banned[1]] = _NEG_INF
    return out


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """Repetition over prompt + output tokens (positive logits divided, negative multiplied),
    then ``- frequency * count - presence * [count > 0]`` over output tokens only, on the
    penalised rows. Returns a new tensor."""
    device = logits.device
    x = logits[pen.rows]
    counts = pen.output_counts.to(device)
    in_output = counts > 0
    if pen.prompt_seen is not None:
        rep = _column(pen.repetition, device)
        seen = in_output | pen.prompt_seen.to(device)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - _column(pen.frequency, device) * counts
    x = x - _column(pen.presence, device) * in_output
    return logits.index_copy(0, torch.tensor(pen.rows, device=device), x)


def _column(values: Sequence[float] | np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float32).to(device).unsqueeze(1)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    kernels = kernels_for(logits)
    if kernels is None:
        return logits.argmax(-1)
    return kernels.argmax_rows(logits.contiguous())


def draw(scaled: torch.Tensor, adjusted: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One token per row: a Gumbel-max draw from ``scaled`` (log-weights) for the sampling
    rows, the argmax of ``adjusted`` for the greedy ones (they divide by 1 in ``scaled``)."""
    sampled = gumbel_argmax(scaled, batch)
    if not batch.greedy.any():
        return sampled
    greedy = torch.from_numpy(batch.greedy).to(scaled.device)
    return torch.where(greedy, argmax_rows(adjusted), sampled)


def apply_truncation(logits: torch.Tensor, t: Truncation) -> torch.Tensor:
    """``apply_top_k_top_p_min_p`` with a batch's ``Truncation``."""
    if t.any_top_k_top_p:
        logits = _mask_top_k_top_p(logits, t.top_k, t.top_p)
    if t.any_min_p:
        logits = _mask_min_p(logits, t.min_p)
    return logits


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float]
) -> torch.Tensor:
    """Sets to -inf, per row: all but the top_k (0 = off); then what lies beyond top_p of the
    top-k survivors' renormalised mass; then tokens below min_p * the top token's probability.
    The most likely token always survives. Returns ``logits`` itself when no row truncates."""
    t = make_truncation(np.asarray(top_k, np.int64), np.asarray(top_p, np.float64),
                        np.asarray(min_p, np.float32))
    return logits if t is None else apply_truncation(logits, t)


def _mask_min_p(logits: torch.Tensor, min_p: np.ndarray) -> torch.Tensor:
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log space cannot underflow.
    log_min_p = _column(min_p, logits.device).log()  # log(0) = -inf: the row keeps all
    return logits.masked_fill(logits < logits.amax(-1, keepdim=True) + log_min_p, _NEG_INF)


def _mask_top_k_top_p(logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray) -> torch.Tensor:
    """Keeps, per row, the first tokens of the row sorted by logit (ties: the lower id first)
    up to top_k and while the mass of the strictly higher-ranked survivors is below top_p.

    The cut nearly always lies among the first few hundred tokens, so those come from one
    ``topk`` (0.5 ms for 8 rows of a 49k vocabulary on the CPU, where a full sort takes 13 ms,
    70% of a decode step); a row whose cut lies further (a flat distribution) tries more
    candidates, then the full sort. On the CPU the kernel finds every cut by selection
    (``top_k_top_p``: O(V) per row, flat or not)."""
    top_k, top_p = np.asarray(top_k, np.int64), np.asarray(top_p, np.float64)
    kernels = kernels_for(logits)
    if kernels is not None:
        return kernels.top_k_top_p(logits.contiguous(), torch.from_numpy(top_k),
                                   torch.from_numpy(top_p))
    vocab = logits.shape[1]
    ks = [min(k, vocab) if k > 0 else vocab for k in top_k.tolist()]
    return _truncate(logits, ks, top_p.tolist(), 0)


def _truncate(
    logits: torch.Tensor, ks: list[int], top_p: list[float], attempt: int
) -> torch.Tensor:
    """``_mask_top_k_top_p`` from each row's top ``_CANDIDATES[attempt]`` tokens (a top_k
    needs no more than k); the rows whose cut lies further go to the next attempt."""
    vocab = logits.shape[1]
    if attempt == len(_CANDIDATES):
        return _mask_top_k_top_p_sorted(logits, ks, top_p)
    m = max(k if k < vocab else _CANDIDATES[attempt] for k in ks)
    if m >= vocab or m > _CANDIDATES[-1]:  # then topk is no faster than the sort
        return _mask_top_k_top_p_sorted(logits, ks, top_p)
    device = logits.device
    values = logits.topk(m, dim=-1).values  # descending
    k = torch.tensor(ks, device=device).unsqueeze(1)
    in_k = torch.arange(m, device=device) < k
    top = values[:, :1]
    weights = (values - top).exp().masked_fill(~in_k, 0.0)
    # The top-k survivors' mass: all within the candidates when top_k is set (k <= m), the
    # whole row when it is not (k = vocab).
    total = weights.sum(-1, keepdim=True)
    if any(kk == vocab and p < 1.0 for kk, p in zip(ks, top_p, strict=True)):
        # Clamped so exp never returns a subnormal (10x slower on the CPU): all of them
        # together are under 1e-30 of a total that is at least 1, so the sum is unchanged.
        row_mass = (logits - top).clamp_min(_EXP_FLOOR).exp().sum(-1, keepdim=True)
        total = torch.where(k < vocab, total, row_mass)
    probs = weights / total
    mass_before = probs.cumsum(-1) - probs
    p_col = _column([p if p < 1.0 else float("inf") for p in top_p], device)
    keep = in_k & (mass_before < p_col)
    # keep is a prefix (mass_before never decreases); the top token always survives.
    n_keep = keep.sum(-1, keepdim=True).clamp_min(1)
    out = logits.masked_fill(~_first_n_of_sorted(logits, values, n_keep), _NEG_INF)
    # Every candidate kept and no top_k among them: the cut may lie further. The next count
    # can hold at most its extra tokens times the last candidate's probability more: a row
    # that cannot reach top_p even so goes straight to the sort.
    unsettled = (n_keep == m) & (k > m)
    if bool(unsettled.any()):
        nxt = _CANDIDATES[attempt + 1] if attempt + 1 < len(_CANDIDATES) else vocab
        reach = probs.sum(-1, keepdim=True) + (nxt - m) * probs[:, -1:]
        for rows_mask, next_attempt in ((unsettled & (reach >= p_col), attempt + 1),
                                        (unsettled & (reach < p_col), len(_CANDIDATES))):
            rows = rows_mask.squeeze(1).nonzero().squeeze(1)
            if rows.numel():
                idx = rows.tolist()
                out[rows] = _truncate(logits[rows], [ks[i] for i in idx],
                                      [top_p[i] for i in idx], next_attempt)
    return out


def _first_n_of_sorted(logits: torch.Tensor, values: torch.Tensor,
                       n: torch.Tensor) -> torch.Tensor:
    """The mask of each row's first ``n`` tokens in sorted order (``values``: the row's top
    values, descending), ties at the cut going to the lower ids, as a stable sort orders them."""
    cut = values.gather(1, n - 1)  # the last kept value
    above = logits > cut
    equal = logits == cut
    # How many of the tokens equal to the cut stay: all of them unless a tie straddles it.
    room = n.squeeze(1) - torch.count_nonzero(above, dim=-1)
    if bool(torch.equal(torch.count_nonzero(equal, dim=-1), room)):
        return above | equal
    return above | (equal & (equal.cumsum(-1) <= room.unsqueeze(1)))


def _mask_top_k_top_p_sorted(
    logits: torch.Tensor, ks: Sequence[int], top_p: Sequence[float]
) -> torch.Tensor:
    """``_mask_top_k_top_p`` by a full stable sort of every row (``ks``: top_k with 0 as the
    vocabulary size)."""
    vocab, device = logits.shape[1], logits.device
    ordered, order = logits.sort(dim=-1, descending=True, stable=True)
    k = torch.tensor(ks, device=device)
    drop = torch.arange(vocab, device=device) >= k.unsqueeze(1)
    probs = ordered.masked_fill(drop, _NEG_INF).softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # of the strictly higher-ranked survivors
    # top_p = 1 must drop nothing, but rounding can bring mass_before to 1.0 in a long tail.
    drop |= mass_before >= _column([p if p < 1.0 else float("inf") for p in top_p], device)
    return logits.masked_fill(drop.scatter(-1, order, drop), _NEG_INF)


def gumbel_argmax(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``argmax(logits + G)`` per row, G standard Gumbel noise; seeded rows from their own
    generators. On the CPU the kernel makes the noise (counter-based, fused with the argmax:
    torch's exponential_ costs a quarter of a decode step there); elsewhere torch does."""
    kernels = kernels_for(logits)
    if kernels is None:
        return (logits + _gumbel_noise(logits, batch)).argmax(-1)
    return kernels.gumbel_argmax(logits.contiguous(), noise_keys(batch))


def _seeded_rows(batch: SamplingBatch) -> list[int]:
    """Sampling rows with a generator of their own (greedy rows draw nothing)."""
    gens, greedy = batch.generators, batch.greedy
    if gens is None:
        return []
    return [i for i, g in enumerate(gens) if g is not None and not greedy[i]]


def noise_keys(batch: SamplingBatch) -> torch.Tensor:
    """One 64-bit key per row for the kernel's noise: a seeded row draws its key from its own
    generator (so the batch never changes its tokens), the others from torch's global one."""
    keys = torch.randint(_KEY_LOW, _KEY_HIGH, (batch.num_rows,), dtype=torch.int64)
    for i in _seeded_rows(batch):
        keys[i] = torch.randint(_KEY_LOW, _KEY_HIGH, (1,), dtype=torch.int64,
                                generator=batch.generators[i])
    return keys


def _gumbel_noise(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Standard Gumbel noise shaped like ``logits``; seeded rows from their own generators."""
    noise = torch.empty_like(logits)
    seeded = _seeded_rows(batch)
    if len(seeded) < batch.num_rows:
        noise.exponential_()  # one batch-wide draw for the unseeded rows
    for i in seeded:  # the one per-row loop: each seeded row owns its random stream
        noise[i].exponential_(generator=batch.generators[i])
    # Exp(1) can round to 0; clamping keeps -log(E) finite, so a masked -inf stays -inf.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_().neg_()


def token_logprobs(
    raw: torch.Tensor | None,
    want: list[int] | None,
    tokens: torch.Tensor,
    batch: SamplingBatch,
) -> list[TokenLogprobs | None]:
    """For rows ``want`` (whose log-softmax rows are ``raw``): the chosen token's logprob and
    rank, and the row's top-N; None for the other rows."""
    out: list[TokenLogprobs | None] = [None] * batch.num_rows
    if raw is None:
        return out
    top_n = batch.logprobs
    chosen = tokens[want].unsqueeze(1)
    chosen_lp = raw.gather(1, chosen)
    ranks = (raw >= chosen_lp).sum(-1)
    n_top = min(max(top_n[i] for i in want), raw.shape[1])
    top_lp, top_ids = raw.topk(n_top, dim=-1)
    per_row = zip(
        want,
        chosen.squeeze(1).tolist(),
        chosen_lp.squeeze(1).tolist(),
        ranks.tolist(),
        top_ids.tolist(),
        top_lp.tolist(),
        strict=True,
    )
    for i, token, logprob, rank, ids, lps in per_row:
        n = top_n[i]
        out[i] = TokenLogprobs(token, logprob, rank, list(zip(ids[:n], lps[:n], strict=True)))
    return out
