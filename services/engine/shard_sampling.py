"""Sampling under tensor parallelism without gathering the vocabulary.

Each rank holds the logits of its vocabulary rows only (``ParallelLMHead``). Gathering them on
rank 0 moves ``rows x vocab / N`` floats from every rank per step; for the rows below, two or a
few numbers per row are enough, and the tokens are the ones the gathered logits would give:

    greedy    each rank's (max logit, its id); rank 0 takes the largest (ties: the lower id)
    Gumbel    argmax(logits / T + G) is the largest of the shards' (best score, its id): the
              noise G of token v depends on (the row's key, v) only (the CPU kernel's
              counter-based noise), so a shard computes the very numbers the whole row would
    top-k     each rank's own top-k (its survivors of the whole row's cut are among them) as
              (value, id, Gumbel score); rank 0 keeps the k best values of all (ties: the lower
              id, the kernel's rule) and takes the best score among them

Rows that need the whole distribution keep the gather (``plan`` returns None for the step):
logprobs, top-p, min-p, logit_bias, min_tokens bans, penalties; the runner adds grammar masks
and verification. A sampling row needs the counter-based noise, so only with the CPU kernels; an
all-greedy step on any CPU. The plan is rank 0's, made when the step runs (the seeded rows'
keys come from their generators as the sampler draws them), and travels in the step broadcast.

Per rank and step the gather moves ``rows x C x 3`` float64 (C = 1, or the largest top-k),
instead of ``rows x vocab / N`` float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.engine.cpu_ops import kernels_for, ops
from services.engine.parallel.group import TPGroup
from services.engine.sampler import argmax_rows, noise_keys
from services.engine.sampling_batch import SamplingBatch

# A top-k row sends k candidates of 24 bytes; past this k a gathered shard costs about as much.
MAX_TOP_K = 256
_FIELDS = 4  # per row in the broadcast: greedy, temperature's bits, top_k, noise key
_PAD_ID = float(2**62)  # a candidate that is none: sorts after every real id


@dataclass(slots=True)
class ShardPlan:
    """How every rank samples its shard, one entry per logits row."""

    greedy: np.ndarray  # [R] bool
    temperature: np.ndarray  # [R] float32 (1 on greedy rows)
    top_k: np.ndarray  # [R] int64, 0 = no cut
    keys: np.ndarray  # [R] int64: the rows' noise keys (unused on greedy rows)

    def __post_init__(self) -> None:
        n = len(self.greedy)
        assert len(self.temperature) == len(self.top_k) == len(self.keys) == n
        assert (self.top_k >= 0).all() and (self.top_k <= MAX_TOP_K).all()

    @property
    def candidates(self) -> int:
        """Candidates per row in the gather: 1, or the largest top-k of a sampling row."""
        cut = self.top_k[~self.greedy]
        return max(1, int(cut.max())) if len(cut) else 1

    def encode(self) -> np.ndarray:
        bits = self.temperature.astype(np.float32).view(np.int32).astype(np.int64)
        return np.stack([self.greedy.astype(np.int64), bits, self.top_k, self.keys], 1).ravel()

    @classmethod
    def decode(cls, data: np.ndarray) -> ShardPlan:
        rows = np.asarray(data, np.int64).reshape(-1, _FIELDS)
        temperature = rows[:, 1].astype(np.int32).view(np.float32)
        return cls(rows[:, 0] != 0, temperature, rows[:, 2].copy(), rows[:, 3].copy())


def plan(batch: SamplingBatch, device: torch.device) -> ShardPlan | None:
    """The step's plan, or None when a row needs the whole vocabulary (then rank 0 gathers
    the logits and samples as at one rank). Draws the sampling rows' noise keys: call it once
    per step, where the sampler would have sampled."""
    if device.type != "cpu" or _needs_whole_rows(batch):
        return None
    n = batch.num_rows
    if batch.greedy is None:  # every row greedy: no noise, any CPU
        return ShardPlan(np.ones(n, bool), np.ones(n, np.float32), np.zeros(n, np.int64),
                         np.zeros(n, np.int64))
    if ops() is None:  # torch's noise is not counter-based: a shard cannot draw its part
        return None
    top_k = np.zeros(n, np.int64)
    if batch.truncation is not None:
        t = batch.truncation
        if t.any_min_p or (t.top_p < 1.0).any() or (t.top_k > MAX_TOP_K).any():
            return None
        top_k = np.where(batch.greedy, 0, t.top_k)
    return ShardPlan(batch.greedy.copy(), batch.temperature.copy(), top_k,
                     noise_keys(batch).numpy())


def _needs_whole_rows(batch: SamplingBatch) -> bool:
    return (batch.logprobs is not None or batch.logit_bias is not None
            or batch.banned is not None or batch.penalties is not None)


def sample(logits: torch.Tensor, shard_plan: ShardPlan, tp: TPGroup,
           vocab_start: int) -> torch.Tensor | None:
    """Every rank: ``logits`` [R, V_rank] float32, this rank's real vocabulary columns, which
    start at id ``vocab_start``. Returns the tokens [R] on rank 0, None on the others (a
    collective: every rank calls it at the same point of the step)."""
    parts = tp.gather_first(shard_candidates(logits, shard_plan, vocab_start))
    return None if parts is None else merge(torch.cat(parts, 1), shard_plan)


def shard_candidates(logits: torch.Tensor, shard_plan: ShardPlan,
                     vocab_start: int) -> torch.Tensor:
    """[R, C, 3] float64 (value, id, score) per candidate; pads are (-inf, a huge id, -inf)."""
    rows = logits.shape[0]
    assert rows == len(shard_plan.greedy), (rows, len(shard_plan.greedy))
    c = shard_plan.candidates
    out = torch.full((rows, c, 3), float("-inf"), dtype=torch.float64)
    out[:, :, 1] = _PAD_ID
    if logits.shape[1] == 0:  # a tiny vocabulary left this rank no real row: no candidate
        return out
    greedy = torch.from_numpy(shard_plan.greedy)
    if greedy.any():
        g = greedy.nonzero().squeeze(1)
        ids = argmax_rows(logits.index_select(0, g))
        best = logits.index_select(0, g).gather(1, ids.unsqueeze(1)).squeeze(1).double()
        out[g, 0] = torch.stack([best, (ids + vocab_start).double(), best], 1)
    if not greedy.all():
        _sampling_candidates(logits, shard_plan, vocab_start, out)
    return out


def _sampling_candidates(logits: torch.Tensor, p: ShardPlan, vocab_start: int,
                         out: torch.Tensor) -> None:
    kernels = kernels_for(logits)
    assert kernels is not None, "a sampling row's shard needs the CPU kernels' noise"
    rows = torch.from_numpy(np.flatnonzero(~p.greedy))
    keys = torch.from_numpy(p.keys).index_select(0, rows)
    temperature = torch.from_numpy(p.temperature).index_select(0, rows).unsqueeze(1)
    scaled = (logits.index_select(0, rows) / temperature).contiguous()  # as the sampler scales
    top_k = torch.from_numpy(p.top_k).index_select(0, rows)
    cut = top_k > 0
    if (~cut).any():
        plain = (~cut).nonzero().squeeze(1)
        scores, ids = kernels.gumbel_best_of_shard(scaled.index_select(0, plain).contiguous(),
                                                   keys.index_select(0, plain), vocab_start)
        out[rows[plain], 0] = torch.stack([scores.double(), ids.double(), scores.double()], 1)
    if cut.any():
        at = cut.nonzero().squeeze(1)
        k = top_k.index_select(0, at)
        # The shard's own top-k by the kernel's rule (ties: the lower id), as the whole row's
        # cut would keep them; then the best k of them in order.
        kept = kernels.top_k_top_p(scaled.index_select(0, at).contiguous(), k,
                                   torch.ones(len(at), dtype=torch.float64))
        values, local = kept.topk(min(int(k.max()), kept.shape[1]), dim=-1)
        ids = local + vocab_start
        scores = kernels.gumbel_scores(values.contiguous(), ids.contiguous(),
                                       keys.index_select(0, at).contiguous())
        n = values.shape[1]
        out[rows[at], :n] = torch.stack([values.double(), ids.double(), scores.double()], 2)


def merge(candidates: torch.Tensor, shard_plan: ShardPlan) -> torch.Tensor:
    """Rank 0: every rank's candidates [R, N*C, 3] -> the tokens [R] int64."""
    values, ids, scores = candidates.unbind(2)
    top_k = torch.from_numpy(shard_plan.top_k)
    if bool((top_k > 0).any()):
        # Order by (value descending, id ascending): a stable sort by id, then by value.
        by_id = ids.argsort(dim=1, stable=True)
        by_value = values.gather(1, by_id).argsort(dim=1, descending=True, stable=True)
        order = by_id.gather(1, by_value)
        rank = torch.empty_like(order).scatter_(
            1, order, torch.arange(order.shape[1]).expand_as(order).contiguous())
        cut = top_k.unsqueeze(1)
        scores = scores.masked_fill((cut > 0) & (rank >= cut), float("-inf"))
    best = scores.amax(1, keepdim=True)
    # The best score; among equal ones the lower id (a row all -inf: id 0, as the sampler).
    winner = ids.masked_fill(scores != best, float("inf")).amin(1)
    return winner.long()
