"""Speculative decoding in the engine's step: the core's side of ``spec_decode``.

Engine thread, before each schedule (``Speculator.propose``): each running request that decodes
with all its tokens known gets ``num_speculative_tokens`` drafts (fewer near max_tokens or the
context; none while more than ``disable_by_batch_size`` requests run). Prompt lookup finds
them at once and writes them into the request's input-batch row; a draft model proposes them
inside the step, so only their count is set. The scheduler then schedules ``1 + k`` tokens.

Engine thread, when the step is prepared (``prepare``): the verification's inputs, as copies
the step owns: one sampling row per verified position (the request's parameters repeated,
min_tokens counting the drafts before the position as output), the drafts padded per request,
where they sit in the step's input ids, and for a draft model its passes
(``spec_decode.draft_model``, built from the step's gathered block tables).

Step thread: the draft model proposes (``propose_drafts``), the target scores every position
in its one forward pass, grammars mask every position (``spec_decode.grammar``), then
``verify``: penalties count the drafts before each position, the sampler's own pieces adjust,
scale and truncate the logits at every position, ``spec_decode.rejection`` accepts or rejects,
and one Gumbel-max per request (the sampler's) draws the replacement or bonus token, so a
request without drafts draws exactly as in a step without speculation. Logprobs are the
target's, at each emitted position.

Engine thread, after the step (``Speculator.record``): the counters, and how far the draft
model's KV reaches in each row (its accepted drafts' KV is valid, the others' is overwritten
by the next step's first pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.engine.input_batch import InputBatch
from services.engine.parallel.step_broadcast import StepBatch
from services.engine.request import Request
from services.engine.sampler import (
    SamplerOutput,
    adjust_logits,
    argmax_rows,
    draw,
    raw_logprobs,
    scale_and_truncate,
    token_logprobs,
)
from services.engine.sampling_batch import Penalties, SamplingBatch
from services.engine.scheduler import SchedulerOutput
from services.engine.spec_decode import rejection
from services.engine.spec_decode.config import SpecMethod, SpeculativeConfig
from services.engine.spec_decode.draft_model import DraftInputs, DraftModel, DraftPass
from services.engine.spec_decode.grammar import fill_position_masks
from services.engine.spec_decode.metrics import SpecDecodeStats
from services.engine.spec_decode.ngram import NgramProposer
from services.engine.structured.masks import GrammarState, TokenMasker
from services.protocol.engine_api import TokenLogprobs


@dataclass(slots=True)
class SpecInputs:
    """A step's verification inputs, one entry per sampled request (logits order)."""

    num_drafts: np.ndarray  # [R] int64 (0: none)
    drafts: torch.Tensor  # [R, K] int64, padded with 0; a draft model's are filled in the step
    draft_at: np.ndarray  # [D] where each draft sits in the step's input ids (row-major)
    positions: SamplingBatch  # one row per verified position: request i's 1 + num_drafts[i]
    owner: np.ndarray  # [P] the request of each position
    ahead: np.ndarray  # [P] drafts before each position
    q: torch.Tensor | None = None  # [R, K, V] a draft model's distributions; None: one-hot

    def fill(self, drafts: torch.Tensor, q: torch.Tensor | None, input_ids: np.ndarray) -> None:
        """Takes a draft model's proposals (``[Rd, K]`` for the drafting requests, in order)
        into the verification and into the step's input ids."""
        drafting = torch.from_numpy(np.flatnonzero(self.num_drafts)).to(drafts.device)
        self.drafts = self.drafts.to(drafts.device).index_copy(0, drafting, drafts)
        if q is not None:
            full = q.new_zeros((len(self.num_drafts), *q.shape[1:]))
            self.q = full.index_copy(0, drafting, q)
        mask = rejection.draft_mask(torch.from_numpy(self.num_drafts), self.drafts.shape[1])
        input_ids[self.draft_at] = self.drafts.cpu()[mask].numpy()


@dataclass(slots=True)
class SpecOutput:
    """A verified step, per sampled request: the tokens it emits (its accepted drafts, then
    the target's own token; ``Scheduler.update`` cuts a run where its request stops), their
    logprobs, and the rejection sampler's verdict."""

    runs: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]]
    num_drafts: list[int]
    num_accepted: list[int]


class Speculator:
    """The engine thread's side (see the module docstring)."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        self.spec = spec
        self.max_model_len = max_model_len
        self.ngram = (NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
                      if spec.method is SpecMethod.NGRAM else None)
        self.stats = SpecDecodeStats(spec.num_speculative_tokens)

    def propose(self, running: list[Request], batch: InputBatch) -> None:
        """Sets each running request's ``num_draft_tokens`` for the next schedule."""
        k = self.spec.num_speculative_tokens
        on = self.spec.drafts_at(len(running))
        max_len = self.max_model_len
        for req in running:
            n = 0
            if (on and not req.num_placeholders and not req.num_scheduled_tokens
                    and req.num_computed_tokens == len(req.token_ids) - 1):
                room = min(k, req.max_tokens - len(req.output_token_ids),
                           max_len - len(req.token_ids))
                if room > 0:
                    n = self._drafts(req, room, batch)
            req.num_draft_tokens = n
        if self.ngram is not None:
            self.ngram.end_step()

    def _drafts(self, req: Request, room: int, batch: InputBatch) -> int:
        row = req.batch_row
        assert row >= 0, req.request_id  # a decoding request has had a step, so a row
        if self.ngram is None:  # the draft model fills them in the step
            batch.draft_tokens[row, :room] = 0
            return room
        found = self.ngram.propose(req.request_id, req.token_ids, room)
        batch.draft_tokens[row, : len(found)] = found
        return len(found)

    def record(self, sched: SchedulerOutput, out: SpecOutput, batch: InputBatch) -> None:
        """After the step was applied (rows of finished requests already given back)."""
        self.stats.observe(out.num_drafts, out.num_accepted)
        if self.ngram is not None:
            return
        sampled = (s.request for s in sched.scheduled if s.completes_sequence)
        for req, k, a in zip(sampled, out.num_drafts, out.num_accepted, strict=True):
            if k and req.batch_row >= 0:  # draft j's KV is valid when draft j was accepted
                batch.draft_computed[req.batch_row] += min(a, k - 1)


# -- preparing a step (engine thread) -----------------------------------------------------------


def prepare(ib: InputBatch, sched: SchedulerOutput, batch: StepBatch, row_idx: np.ndarray,
            draft: DraftModel | None) -> tuple[SpecInputs | None, DraftInputs | None]:
    """The step's verification inputs (None without drafts) and its draft passes (None without
    a draft model); sets ``batch.draft_lens``."""
    scheduled = sched.scheduled
    per_req = np.fromiter((s.num_draft_tokens for s in scheduled), np.int64, len(scheduled))
    num_drafts = per_req[batch.rows]
    spec = None
    if num_drafts.any():
        batch.draft_lens = num_drafts
        ends = np.cumsum(batch.query_lens)[batch.rows] - 1
        spec = _gather(ib, row_idx[batch.rows], num_drafts, ends, lookup=draft is None)
    passes = None if draft is None else _draft_inputs(draft, ib, sched, batch, row_idx,
                                                      per_req)
    return spec, passes


def _gather(ib: InputBatch, rows: np.ndarray, num_drafts: np.ndarray, ends: np.ndarray,
            lookup: bool) -> SpecInputs:
    counts = 1 + num_drafts
    first = np.cumsum(counts) - counts
    ahead = np.arange(int(counts.sum())) - np.repeat(first, counts)
    width = int(num_drafts.max())
    drafts = np.zeros((len(rows), width), dtype=np.int64)
    if lookup:
        drafts[:] = ib.draft_tokens[rows, :width]
        drafts[np.arange(width) >= num_drafts[:, None]] = 0
    draft_at = np.repeat(ends - num_drafts + 1, num_drafts) + (
        np.arange(int(num_drafts.sum())) - np.repeat(np.cumsum(num_drafts) - num_drafts,
                                                     num_drafts))
    device = ib.penalties.device
    return SpecInputs(
        num_drafts=num_drafts,
        drafts=torch.from_numpy(drafts).to(device),
        draft_at=draft_at,
        positions=ib.sampling_batch(np.repeat(rows, counts), ahead),
        owner=np.repeat(np.arange(len(rows)), counts),
        ahead=ahead,
    )


def _draft_inputs(draft: DraftModel, ib: InputBatch, sched: SchedulerOutput, batch: StepBatch,
                  row_idx: np.ndarray, per_req: np.ndarray) -> DraftInputs:
    """Pass 1 (what the draft has not seen of each request: up to the end of the target's
    non-draft tokens, as far as they are known) and one pass per further draft."""
    members: list[int] = []
    ids: list[int] = []
    seen: list[int] = []  # the draft's KV reaches this far after pass 1
    q_lens: list[int] = []
    for i, s in enumerate(sched.scheduled):
        req, row = s.request, int(row_idx[i])
        end = min(s.start + s.num_new_tokens - s.num_draft_tokens, len(req.token_ids))
        done = int(ib.draft_computed[row])
        if done < 0:  # joined: a prefix-cache hit's last token may lack the draft's KV
            done = max(s.start - 1, 0)
        if end > done:
            members.append(i)
            ids.extend(req.token_ids[done:end])
            seen.append(end)
            q_lens.append(end - done)
        ib.draft_computed[row] = end
    drafting = np.flatnonzero(per_req)  # in schedule order = logits order
    rows = row_idx[drafting]
    inputs = DraftInputs(passes=[], num_drafts=per_req[drafting], greedy=ib.greedy[rows],
                         temperature=ib.temperature[rows],
                         generators=[ib.generator[r] for r in rows.tolist()]
                         if ib.features.seeded else None)
    if not members:
        return inputs
    idx = np.array(members)
    seen_a, q_a = np.array(seen, np.int64), np.array(q_lens, np.int64)
    last = np.cumsum(q_a) - 1
    where = np.searchsorted(idx, drafting)  # every drafting request is a member
    inputs.passes.append(DraftPass(batch.block_tables[idx], batch.num_blocks[idx], seen_a, q_a,
                                   np.array(ids, np.int64), last[where]))
    ends = seen_a[where]
    for j in range(1, int(inputs.num_drafts.max(initial=0))):
        take = np.flatnonzero(inputs.num_drafts > j)
        sel = drafting[take]
        inputs.passes.append(DraftPass(batch.block_tables[sel], batch.num_blocks[sel],
                                       ends[take] + j, np.ones(len(take), np.int64), None, take))
    return inputs


# -- the step thread ----------------------------------------------------------------------------


def propose_drafts(draft: DraftModel, inputs: DraftInputs, spec: SpecInputs | None,
                   input_ids: np.ndarray) -> None:
    """The draft model's passes; its drafts go into the verification and the input ids."""
    drafts, q = draft.propose(inputs)
    if spec is not None:
        spec.fill(drafts, q, input_ids)


def mask_positions(masker: TokenMasker, logits: torch.Tensor,
                   grammars: list[GrammarState | None], spec: SpecInputs) -> None:
    rows = fill_position_masks(masker.bitmask, grammars, spec.num_drafts.tolist(),
                               spec.drafts.tolist())
    if rows:
        masker.mask(logits, rows)


def verify(logits: torch.Tensor, spec: SpecInputs,
           rows: SamplingBatch) -> tuple[SamplerOutput, SpecOutput]:
    """The rejection sampler over the target's logits at every verified position (``[P, V]``);
    ``rows``: one sampling row per request, as a step without drafts would sample them."""
    pos = spec.positions
    device = logits.device
    logits = logits.float()
    drafts = spec.drafts.to(device)
    nd = torch.from_numpy(spec.num_drafts).to(device)
    width = drafts.shape[1]
    counts = 1 + nd
    starts = torch.cumsum(counts, 0) - counts
    mask = rejection.draft_mask(nd, width)
    at = torch.where(mask, starts.unsqueeze(1) + torch.arange(width, device=device),
                     starts.unsqueeze(1))  # the position verifying each draft
    want, raw = raw_logprobs(logits, pos)
    if pos.penalties is not None:
        _count_drafts(pos.penalties, spec, drafts)
    adjusted = adjust_logits(logits, pos)
    argmax = argmax_rows(adjusted)
    accept = (argmax[at] == drafts) & mask  # greedy rows: while the draft is the argmax
    scaled = probs = None
    if rows.greedy is not None:  # some request samples
        scaled = scale_and_truncate(adjusted, pos)
        probs = torch.softmax(scaled, -1)
        q = None if spec.q is None else spec.q.gather(2, drafts.unsqueeze(2)).squeeze(2)
        sampled = rejection.accept_sampled(probs[at, drafts], q,
                                           _uniforms(rows, spec.num_drafts, width, device))
        greedy = torch.from_numpy(rows.greedy).to(device).unsqueeze(1)
        accept = torch.where(greedy, accept, sampled & mask)
    accepted = rejection.accepted_counts(accept)
    decision = starts + accepted
    if scaled is None:
        tokens = argmax[decision]
    else:
        tokens = draw(_final(scaled, probs, spec, drafts, accepted, decision, nd),
                      adjusted[decision], rows)
    return _outputs(spec, drafts, accepted, tokens, starts, want, raw)


def _final(scaled: torch.Tensor, probs: torch.Tensor, spec: SpecInputs, drafts: torch.Tensor,
           accepted: torch.Tensor, decision: torch.Tensor, nd: torch.Tensor) -> torch.Tensor:
    """Per request, what its last token is drawn from: the target's (scaled, truncated)
    logits where every draft was accepted (the bonus), else log max(0, p - q) at the first
    rejected one."""
    final = scaled[decision]
    rejected = (accepted < nd).nonzero().squeeze(1)
    if rejected.numel():
        j = accepted[rejected]
        q = None if spec.q is None else spec.q[rejected, j]
        res = rejection.residual(probs[decision[rejected]], q, drafts[rejected, j])
        final = final.index_copy(0, rejected, res.log())
    return final


def _outputs(spec: SpecInputs, drafts: torch.Tensor, accepted: torch.Tensor,
             tokens: torch.Tensor, starts: torch.Tensor, want: list[int] | None,
             raw: torch.Tensor | None) -> tuple[SamplerOutput, SpecOutput]:
    acc, toks, ds = accepted.tolist(), tokens.tolist(), drafts.tolist()
    runs = [d[:a] + [t] for d, a, t in zip(ds, acc, toks, strict=True)]
    lps: list[list[TokenLogprobs | None]] = [[None] * len(r) for r in runs]
    if raw is not None:
        # The token each position emits: its draft while accepted, then the request's own.
        width = drafts.shape[1]
        per_pos = torch.cat([drafts, tokens.unsqueeze(1)], 1)
        per_pos[torch.arange(len(toks)), accepted] = tokens
        nd = torch.from_numpy(spec.num_drafts).to(drafts.device)
        flat = per_pos[rejection.draft_mask(nd + 1, width + 1)]
        every = token_logprobs(raw, want, flat, spec.positions)
        lps = [every[s : s + len(r)] for s, r in zip(starts.tolist(), runs, strict=True)]
    out = SamplerOutput(token_ids=[r[0] for r in runs], logprobs=[lp[0] for lp in lps])
    return out, SpecOutput(runs, lps, spec.num_drafts.tolist(), acc)


def _uniforms(rows: SamplingBatch, num_drafts: np.ndarray, width: int,
              device: torch.device) -> torch.Tensor:
    """One uniform per draft; a seeded request's from its own generator."""
    u = torch.rand((rows.num_rows, width), device=device)
    gens = rows.generators
    if gens is not None:
        for i, g in enumerate(gens):
            k = int(num_drafts[i])
            if g is not None and k and not rows.greedy[i]:
                u[i, :k] = torch.rand(k, generator=g, device=g.device).to(device)
    return u


def _count_drafts(pen: Penalties, spec: SpecInputs, drafts: torch.Tensor) -> None:
    """A penalised position counts the drafts before it as output (the counts are the step's
    own copy)."""
    counts = pen.output_counts
    for n, e in enumerate(pen.rows):
        j = int(spec.ahead[e])
        if j:
            before = drafts[int(spec.owner[e]), :j].to(counts.device)
            counts[n].index_put_((before,), torch.ones(j, device=counts.device),
                                 accumulate=True)
