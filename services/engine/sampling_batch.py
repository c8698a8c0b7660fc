"""What the sampler needs of one step's rows, as arrays the step owns.

A ``SamplingBatch`` holds one row per request that samples this step, in the order of the
step's logits. The persistent input batch (``input_batch``) gathers it from its per-row
arrays when the step is prepared; every field is a copy or an immutable object, so the step
thread never reads anything the engine thread goes on changing (a request's output list, its
parameters' lists). ``from_requests`` builds the same from plain rows: the tests' and the
warm-up's way in, and the reference for what the input batch keeps.

Fields a step does not need are None, so an all-greedy batch without logprobs costs nothing
to build and nothing to check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.logit_bias import LogitBias
from services.protocol.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRequest:
    """One row given as a request's parameters and tokens (``SamplingBatch.from_requests``)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far
    generator: torch.Generator | None = None  # required when params.seed is set
    eos_token_ids: Sequence[int] = ()  # the model's
    logit_bias: LogitBias | None = None  # params.logit_bias as tensors


@dataclass(slots=True)
class Truncation:
    """Per-row top-k / top-p / min-p (only when some row truncates)."""

    top_k: np.ndarray  # [R] int64, 0 = off
    top_p: np.ndarray  # [R] float64, 1.0 = off
    min_p: np.ndarray  # [R] float32, 0.0 = off
    any_top_k_top_p: bool
    any_min_p: bool


@dataclass(slots=True)
class Penalties:
    """The rows with a repetition, frequency or presence penalty."""

    rows: list[int]  # rows of the batch
    output_counts: torch.Tensor  # [P, V] float32: each token's count in the row's output
    prompt_seen: torch.Tensor | None  # [P, V] bool: in the prompt (repetition penalty only)
    repetition: list[float]
    frequency: list[float]
    presence: list[float]


@dataclass(slots=True)
class SamplingBatch:
    num_rows: int
    # None when every row is greedy (then nothing below but logprobs and bans applies).
    greedy: np.ndarray | None  # [R] bool
    temperature: np.ndarray | None  # [R] float32, 1.0 on greedy rows
    truncation: Truncation | None
    generators: list[torch.Generator | None] | None  # None: no seeded sampling row
    logprobs: list[int] | None  # [R] top-N per row, -1 = none; None: no row asks
    logit_bias: list[LogitBias | None] | None
    banned: tuple[list[int], list[int]] | None  # min_tokens: (rows, token ids) held back
    penalties: Penalties | None

    @property
    def all_greedy(self) -> bool:
        return self.greedy is None

    @classmethod
    def from_requests(
        cls, rows: Sequence[SamplingRequest], vocab_size: int, device: torch.device | str = "cpu"
    ) -> SamplingBatch:
        """The batch for ``rows`` (one per logits row). Raises ValueError for a seeded row
        without its generator."""
        params = [r.params for r in rows]
        for r in rows:
            if r.params.seed is not None and r.generator is None:
                raise ValueError("generator must be set for a request whose params.seed is set")
        greedy = np.array([p.greedy for p in params], dtype=bool)
        sampling = not bool(greedy.all())
        lp = [-1 if p.logprobs is None else p.logprobs for p in params]
        biases = [r.logit_bias for r in rows]
        return cls(
            num_rows=len(rows),
            greedy=greedy if sampling else None,
            temperature=np.array([1.0 if p.greedy else p.temperature for p in params],
                                 np.float32) if sampling else None,
            truncation=truncation_of(params) if sampling else None,
            generators=[r.generator for r in rows]
            if any(r.generator is not None and not r.params.greedy for r in rows) else None,
            logprobs=lp if max(lp, default=-1) >= 0 else None,
            logit_bias=biases if any(b is not None for b in biases) else None,
            banned=_banned(rows, vocab_size),
            penalties=_penalties(rows, vocab_size, torch.device(device)),
        )


def truncation_of(params: Sequence[SamplingParams]) -> Truncation | None:
    top_k = np.array([p.top_k for p in params], np.int64)
    top_p = np.array([p.top_p for p in params], np.float64)
    min_p = np.array([p.min_p for p in params], np.float32)
    return make_truncation(top_k, top_p, min_p)


def make_truncation(top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray) -> Truncation | None:
    any_kp = bool((top_k > 0).any() or (top_p < 1.0).any())
    any_min_p = bool((min_p > 0.0).any())
    if not (any_kp or any_min_p):
        return None
    return Truncation(top_k, top_p, min_p, any_kp, any_min_p)


def stop_ids(params: SamplingParams, eos_token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """What min_tokens holds back: stop_token_ids, and EOS unless ignore_eos (then EOS does not
    end the request). Ids past the vocabulary can never be sampled anyway."""
    eos = [] if params.ignore_eos else list(eos_token_ids)
    return [t for t in params.stop_token_ids + eos if 0 <= t < vocab_size]


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def token_counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), vocab] float32 occurrence counts, from one bincount over the flattened ids."""
    flat = [t for s in seqs for t in s]
    if flat and not (min(flat) >= 0 and max(flat) < vocab):
        # Checked here because bincount would silently credit the neighbouring row.
        raise ValueError(f"token ids must be in [0, {vocab}) to apply penalties")
    ids = torch.tensor(flat, dtype=torch.long, device=device)
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    owner = torch.repeat_interleave(torch.arange(len(seqs), device=device), lengths)
    counts = torch.bincount(owner * vocab + ids, minlength=len(seqs) * vocab)
    return counts.view(len(seqs), vocab).float()


def _banned(rows: Sequence[SamplingRequest], vocab: int) -> tuple[list[int], list[int]] | None:
    hits = [
        (i, t)
        for i, r in enumerate(rows)
        if len(r.output_token_ids) < r.params.min_tokens
        for t in stop_ids(r.params, r.eos_token_ids, vocab)
    ]
    if not hits:
        return None
    return [i for i, _ in hits], [t for _, t in hits]


def _penalties(
    rows: Sequence[SamplingRequest], vocab: int, device: torch.device
) -> Penalties | None:
    idx = [i for i, r in enumerate(rows) if has_penalty(r.params)]
    if not idx:
        return None
    params = [rows[i].params for i in idx]
    prompt_seen = None
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_seen = token_counts([rows[i].prompt_token_ids for i in idx], vocab, device) > 0
    return Penalties(
        rows=idx,
        output_counts=token_counts([rows[i].output_token_ids for i in idx], vocab, device),
        prompt_seen=prompt_seen,
        repetition=[p.repetition_penalty for p in params],
        frequency=[p.frequency_penalty for p in params],
        presence=[p.presence_penalty for p in params],
    )
