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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from services.engine.cpu_ops import kernels_for
from services.engine.logit_bias import LogitBias, apply_logit_bias
from services.protocol.engine_api import TokenLogprobs
from services.protocol.sampling_params import SamplingParams

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
class SamplingRequest:
    """One row of the step's logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far
    generator: torch.Generator | None = None  # required when params.seed is set
    eos_token_ids: Sequence[int] = ()  # the model's
    logit_bias: LogitBias | None = None  # params.logit_bias as tensors (built once per request)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows whose params.logprobs is None
    # The same ids on the device: async scheduling takes the next step's inputs from them.
    token_tensor: torch.Tensor | None = None


class Sampler:
    """``sampler(logits[N, V], rows) -> SamplerOutput``; never modifies ``logits``."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRequest]) -> SamplerOutput:
        _check_batch(logits, rows)
        logits = logits.float()
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        # Before anything changes the logits: vLLM's default "raw" logprobs.
        raw = torch.log_softmax(logits[want], -1) if want else None
        logits = apply_logit_bias(logits, [r.logit_bias for r in rows])
        logits = ban_stop_tokens(logits, rows)
        logits = apply_penalties(logits, rows)
        tokens = _sample(logits, rows)
        logprobs = _token_logprobs(raw, want, tokens, rows)
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs, token_tensor=tokens)


def _check_batch(logits: torch.Tensor, rows: Sequence[SamplingRequest]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {list(logits.shape)}")
    for row in rows:
        if row.params.seed is not None and row.generator is None:
            raise ValueError("generator must be set for a request whose params.seed is set")


def ban_stop_tokens(logits: torch.Tensor, rows: Sequence[SamplingRequest]) -> torch.Tensor:
    """min_tokens: a row short of it cannot pick a token that would end it (vLLM's rule).
    Returns a new tensor when anything is banned, else ``logits`` itself."""
    vocab = logits.shape[1]
    hits = [
        (i, t)
        for i, row in enumerate(rows)
        if len(row.output_token_ids) < row.params.min_tokens
        for t in _stop_ids(row)
        if 0 <= t < vocab  # a client's stop id past the vocabulary can never be sampled anyway
    ]
    if not hits:
        return logits
    banned = logits.clone()
    row_idx, tok_idx = zip(*hits, strict=True)
    banned[list(row_idx), list(tok_idx)] = _NEG_INF
    return banned


def _stop_ids(row: SamplingRequest) -> list[int]:
    # With ignore_eos, EOS does not end the request, so there is nothing to hold back.
    eos = [] if row.params.ignore_eos else list(row.eos_token_ids)
    return row.params.stop_token_ids + eos


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRequest]) -> torch.Tensor:
    """Repetition over prompt + output tokens (positive logits divided, negative multiplied),
    then ``- frequency * count - presence * [count > 0]`` over output tokens only.
    Returns a new tensor when any row has a penalty, else ``logits`` itself."""
    idx = [i for i, row in enumerate(rows) if _has_penalty(row.params)]
    if not idx:
        return logits
    sub = [rows[i].params for i in idx]
    vocab, device = logits.shape[1], logits.device
    x = logits[idx]
    counts = _token_counts([rows[i].output_token_ids for i in idx], vocab, device)
    in_output = counts > 0
    if any(p.repetition_penalty != 1.0 for p in sub):
        prompts = _token_counts([rows[i].prompt_token_ids for i in idx], vocab, device)
        rep = _column([p.repetition_penalty for p in sub], device)
        x = torch.where(in_output | (prompts > 0), torch.where(x > 0, x / rep, x * rep), x)
    x = x - _column([p.frequency_penalty for p in sub], device) * counts
    x = x - _column([p.presence_penalty for p in sub], device) * in_output
    return logits.index_copy(0, torch.tensor(idx, device=device), x)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _token_counts(seqs: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), vocab] float32 occurrence counts, from one bincount over the flattened ids."""
    flat_ids = list(chain.from_iterable(seqs))
    if flat_ids and not (min(flat_ids) >= 0 and max(flat_ids) < vocab):
        # Checked here because bincount would silently credit the neighbouring row.
        raise ValueError(f"token ids must be in [0, {vocab}) to apply penalties")
    ids = torch.tensor(flat_ids, dtype=torch.long, device=device)
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    owner = torch.repeat_interleave(torch.arange(len(seqs), device=device), lengths)
    flat = torch.bincount(owner * vocab + ids, minlength=len(seqs) * vocab)
    return flat.view(len(seqs), vocab).float()


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRequest]) -> torch.Tensor:
    params = [r.params for r in rows]
    if all(p.greedy for p in params):
        return logits.argmax(-1)
    # Greedy rows divide by 1 here; their token is the plain argmax, picked at the end.
    temps = _column([p.temperature or 1.0 for p in params], logits.device)
    scaled = apply_top_k_top_p_min_p(
        logits / temps,
        top_k=[p.top_k for p in params],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
    )
    sampled = _gumbel_argmax(scaled, rows)
    if not any(p.greedy for p in params):
        return sampled
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    return torch.where(greedy, logits.argmax(-1), sampled)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float]
) -> torch.Tensor:
    """Sets to -inf, per row: all but the top_k (0 = off); then what lies beyond top_p of the
    top-k survivors' renormalised mass; then tokens below min_p * the top token's probability.
    The most likely token always survives. Returns ``logits`` itself when no row truncates."""
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _mask_top_k_top_p(logits, top_k, top_p)
    if any(p > 0.0 for p in min_p):
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log space cannot underflow.
        log_min_p = _column(min_p, logits.device).log()  # log(0) = -inf: the row keeps all
        logits = logits.masked_fill(logits < logits.amax(-1, keepdim=True) + log_min_p, _NEG_INF)
    return logits


def _mask_top_k_top_p(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]
) -> torch.Tensor:
    """Keeps, per row, the first tokens of the row sorted by logit (ties: the lower id first)
    up to top_k and while the mass of the strictly higher-ranked survivors is below top_p.

    The cut nearly always lies among the first few hundred tokens, so those come from one
    ``topk`` (0.5 ms for 8 rows of a 49k vocabulary on the CPU, where a full sort takes 13 ms,
    70% of a decode step); a row whose cut lies further (a flat distribution) tries more
    candidates, then the full sort. On the CPU the kernel finds every cut by selection
    (``top_k_top_p``: O(V) per row, flat or not)."""
    kernels = kernels_for(logits)
    if kernels is not None:
        device = logits.device
        return kernels.top_k_top_p(logits.contiguous(),
                                   torch.tensor(top_k, dtype=torch.int64, device=device),
                                   torch.tensor(top_p, dtype=torch.float64, device=device))
    vocab = logits.shape[1]
    ks = [min(k, vocab) if k > 0 else vocab for k in top_k]
    return _truncate(logits, ks, list(top_p), 0)


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


def _gumbel_argmax(logits: torch.Tensor, rows: Sequence[SamplingRequest]) -> torch.Tensor:
    """``argmax(logits + G)`` per row, G standard Gumbel noise; seeded rows from their own
    generators. On the CPU the kernel makes the noise (counter-based, fused with the argmax:
    torch's exponential_ costs a quarter of a decode step there); elsewhere torch does."""
    kernels = kernels_for(logits)
    if kernels is None:
        return (logits + _gumbel_noise(logits, rows)).argmax(-1)
    return kernels.gumbel_argmax(logits.contiguous(), _noise_keys(rows))


def _noise_keys(rows: Sequence[SamplingRequest]) -> torch.Tensor:
    """One 64-bit key per row for the kernel's noise: a seeded row draws its key from its own
    generator (so the batch never changes its tokens), the others from torch's global one."""
    keys = torch.randint(_KEY_LOW, _KEY_HIGH, (len(rows),), dtype=torch.int64)
    for i, r in enumerate(rows):
        if r.generator is not None and not r.params.greedy:
            keys[i] = torch.randint(_KEY_LOW, _KEY_HIGH, (1,), dtype=torch.int64,
                                    generator=r.generator)
    return keys


def _gumbel_noise(logits: torch.Tensor, rows: Sequence[SamplingRequest]) -> torch.Tensor:
    """Standard Gumbel noise shaped like ``logits``; seeded rows from their own generators."""
    noise = torch.empty_like(logits)
    seeded = [i for i, r in enumerate(rows) if r.generator is not None and not r.params.greedy]
    if len(seeded) < len(rows):
        noise.exponential_()  # one batch-wide draw for the unseeded rows
    for i in seeded:  # the one per-row loop: each seeded row owns its random stream
        noise[i].exponential_(generator=rows[i].generator)
    # Exp(1) can round to 0; clamping keeps -log(E) finite, so a masked -inf stays -inf.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_().neg_()


def _token_logprobs(
    raw: torch.Tensor | None,
    want: list[int],
    tokens: torch.Tensor,
    rows: Sequence[SamplingRequest],
) -> list[TokenLogprobs | None]:
    """For rows ``want`` (whose log-softmax rows are ``raw``): the chosen token's logprob and
    rank, and the row's top-N; None for the other rows."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if raw is None:
        return out
    chosen = tokens[want].unsqueeze(1)
    chosen_lp = raw.gather(1, chosen)
    ranks = (raw >= chosen_lp).sum(-1)
    n_top = min(max(rows[i].params.logprobs for i in want), raw.shape[1])
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
        n = rows[i].params.logprobs
        out[i] = TokenLogprobs(token, logprob, rank, list(zip(ids[:n], lps[:n], strict=True)))
    return out
