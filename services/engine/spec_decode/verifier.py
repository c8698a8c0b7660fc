"""The verifier: speculative decoding's one owner of the drafts in a step.

It holds each input-batch row's drafts for the next step and how far the draft model's KV
reaches in it (rows join and move through ``join``/``move``), the draft model (rank 0), the
proposers (``proposers``, run before each schedule: ``before_schedule``) and the rejection
sampler. It is a step feature (``features.protocol``), built by ``feature``; the rest of the
engine sees its hooks, the scheduler's lookahead tokens, and a ``SpecOutput`` (the runs a
verified step emits, in ``StepResult.spec``).

Engine thread, when the step is prepared (``prepare_rows``): the verification's inputs, as copies
the step owns: one sampling row per verified position (the request's parameters repeated,
min_tokens counting the drafts before the position as output), the drafts padded per request,
where they sit in the step's input ids, and for a draft model its passes
(``draft_model``, built from the step's gathered block tables).

Step thread: the draft model proposes (``before_step``), the target scores every position
in its one forward pass, grammars mask every position (``after_logits``, ``grammar``), then
``verify``: penalties count the drafts before each position, the sampler's stages
(``StagedLogits``) adjust, scale and truncate the logits at every position, ``rejection``
accepts or rejects, and one Gumbel-max per request (the sampler's ``draw``) draws the
replacement or bonus token, so a request without drafts draws exactly as in a step without
speculation (``sample``: the verifier samples a verifying step). Logprobs are the target's,
at each emitted position.

Engine thread, after the step (``applied``): the proposers count the verdicts, and how far the
draft model's KV reaches in each row (its accepted drafts' KV is valid, the others' is
overwritten by the next step's first pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.engine.config import SpeculativeConfig
from services.engine.features.protocol import StepFeature, StepRows
from services.engine.input_batch import InputBatch
from services.engine.model_runner import StepResult
from services.engine.parallel.step_broadcast import StepBatch
from services.engine.sampler import SamplerOutput, StagedLogits, draw
from services.engine.sampling_batch import Penalties, SamplingBatch, SamplingRequest
from services.engine.scheduler import SchedulerOutput
from services.engine.spec_decode import rejection
from services.engine.spec_decode.draft_model import DraftInputs, DraftModel, DraftPass
from services.engine.spec_decode.grammar import fill_position_masks
from services.protocol.engine_api import TokenLogprobs
from services.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.engine.model_runner import ModelRunner, PreparedStep
    from services.engine.request import Request
    from services.engine.spec_decode.proposers import Speculator
    from services.engine.structured.manager import GrammarManager


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


@dataclass(slots=True)
class VerifyStep:
    """What one step verifies (None parts: no drafts this step / no draft model)."""

    spec: SpecInputs | None
    draft: DraftInputs | None


class Verifier(StepFeature):
    """Rank 0's drafts per input-batch row, the draft model and the rejection sampler: the
    step feature ``speculation`` (``StepFeature``), and the step's sampler when it verifies."""

    name = "speculation"
    sets_lookahead = True

    def __init__(self, spec: SpeculativeConfig, max_rows: int, device: torch.device,
                 draft: DraftModel | None = None, masks: GrammarManager | None = None) -> None:
        """``masks``: the grammar masks, applied at every verified position. The input
        batch whose rows it follows (it reads their sampling parameters) comes with each
        step's rows (``StepRows.input_batch``)."""
        self.spec = spec
        self.device = device
        self.draft = draft
        self.masks = masks
        self.proposers: Speculator | None = None  # set by ``feature`` (engine-thread drafts)
        # Each row's drafts for the next step, and how many of its tokens the draft model has
        # in its KV cache (-1: just joined).
        k = spec.num_speculative_tokens
        self.draft_tokens = np.zeros((max_rows, max(k, 1)), dtype=np.int64)
        self.draft_computed = np.zeros(max_rows, dtype=np.int64)

    # -- rows (the input batch calls these) -------------------------------------------------

    def join(self, req: Request, row: int) -> None:
        self.draft_computed[row] = -1

    def move(self, src: int, dst: int) -> None:
        self.draft_tokens[dst] = self.draft_tokens[src]
        self.draft_computed[dst] = self.draft_computed[src]

    # -- proposals (engine thread, before the schedule) -------------------------------------

    def before_schedule(self, running: Sequence[Request]) -> None:
        if self.proposers is not None:
            self.proposers.propose(running)

    def hold(self, row: int, drafts: list[int]) -> None:
        """A proposer's drafts for ``row``'s next step."""
        self.draft_tokens[row, : len(drafts)] = drafts

    def drafts_of(self, row: int, n: int) -> list[int]:
        """The first ``n`` drafts ``row`` holds: the step's input ids after its last token
        (zeros with a draft model, which fills them in the step)."""
        return self.draft_tokens[row, :n].tolist()

    def lookahead_ids(self, row: int, n: int) -> list[int]:
        return self.drafts_of(row, n)

    # -- a step -----------------------------------------------------------------------------

    def prepare_rows(self, step: StepRows) -> VerifyStep | None:
        """The step's verification inputs and draft passes (None: neither); sets
        ``batch.extra_logits`` (before the runner builds the step's CPU inputs)."""
        ib, sched, batch, row_idx = step.input_batch, step.sched, step.batch, step.rows
        per_req = np.array(sched.num_lookahead_tokens, dtype=np.int64)
        num_drafts = per_req[batch.rows]
        spec = None
        if num_drafts.any():
            batch.extra_logits = num_drafts
            ends = np.cumsum(batch.query_lens)[batch.rows] - 1
            spec = _gather(ib, self.draft_tokens, row_idx[batch.rows], num_drafts, ends,
                           lookup=self.draft is None, device=self.device)
        passes = None if self.draft is None else _draft_inputs(
            self.draft_computed, ib, sched, batch, row_idx, per_req)
        return None if spec is None and passes is None else VerifyStep(spec, passes)

    def before_step(self, step: VerifyStep | None, batch: StepBatch) -> None:
        """Step thread, before the target (and before the batch crosses to the other ranks):
        the draft model's passes; its drafts go into the verification and the input ids."""
        if step is not None and step.draft is not None:
            drafts, q = self.draft.propose(step.draft)
            if step.spec is not None:
                step.spec.fill(drafts, q, batch.input_ids)

    def waits_after(self, step: VerifyStep | None, num_rows: int) -> bool:
        """Whether the step after ``step`` needs its tokens on the host before it is
        prepared (async scheduling): a step that verified emits a varying number of tokens
        per request, which the next step's placeholders (one each) cannot stand for; and the
        next step's drafts come from this one's tokens unless the batch is too big. The first
        is this step's own state: the batch may have grown past disable_by_batch_size since
        its drafts were made."""
        return (step is not None and step.spec is not None) or self.spec.drafts_at(num_rows)

    def whole_logits(self, state: VerifyStep | None) -> bool:
        return state is not None and state.spec is not None

    def after_logits(self, logits: torch.Tensor, state: VerifyStep | None,
                     step: PreparedStep) -> None:
        """Structured outputs' masks at every verified position (the grammar feature leaves
        a verifying step to this)."""
        if state is None or state.spec is None or self.masks is None:
            return
        grammars = step.state.get(self.masks.name)
        if grammars is not None:
            spec = state.spec
            self.masks.apply(logits, grammars, fill=lambda bitmask: fill_position_masks(
                bitmask, grammars, spec.num_drafts.tolist(), spec.drafts.tolist()))

    def sample(self, logits: torch.Tensor, state: VerifyStep | None,
               step: PreparedStep) -> StepResult | None:
        """A verifying step's sampler: every verified position (None: no drafts this step)."""
        if state is None or state.spec is None:
            return None
        out, emitted = verify(logits, state.spec, step.sampling)
        return StepResult(out, spec=emitted)

    def warm_up_logits(self, runner: ModelRunner, logits: torch.Tensor,
                       compiling: bool) -> list[str]:
        """Before serving (rank 0): requests verifying every draft (token 0) as sampling rows,
        ``logits`` being ``1 + k`` rows per request, with the draft's distributions when there
        is a draft model; then the draft model's own warm-up. Returns the paths run."""
        k = self.spec.num_speculative_tokens
        rows = len(logits) // (1 + k)
        vocab = logits.shape[1]
        params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=1)

        def make_batch(n: int) -> SamplingBatch:
            requests = [SamplingRequest(params, [0, 1], [1]) for _ in range(n)]
            return SamplingBatch.from_requests(requests, vocab, self.device)

        q = None
        if self.draft is not None:
            vocab = logits.shape[1]
            q = torch.full((rows, k, vocab), 1.0 / vocab, device=self.device)
        spec = SpecInputs(
            num_drafts=np.full(rows, k, np.int64),
            drafts=torch.zeros((rows, k), dtype=torch.long, device=self.device),
            draft_at=np.zeros(0, np.int64),
            positions=make_batch(rows * (1 + k)),
            owner=np.repeat(np.arange(rows), 1 + k),
            ahead=np.tile(np.arange(1 + k), rows),
            q=q,
        )
        verify(logits[: rows * (1 + k)], spec, make_batch(rows))
        if self.draft is None:
            return ["verification"]
        c = runner.config
        self.draft.warm_up(c.max_num_batched_tokens, c.max_num_seqs,
                           runner.num_blocks * runner.block_size)
        return ["verification", "draft model"]

    def applied(self, sched: SchedulerOutput, result: StepResult) -> None:
        """After the step was applied: the proposers' counters and the draft's progress."""
        if result.spec is not None and self.proposers is not None:
            self.proposers.record(sched, result.spec)

    def stats(self) -> dict[str, object]:
        return {} if self.proposers is None else {"spec_decode": self.proposers.stats.snapshot()}

    def record(self, sched: SchedulerOutput, out: SpecOutput) -> None:
        """After the step was applied (rows of finished requests already given back): how
        far the draft model's KV reaches."""
        if self.draft is None:
            return
        for req, k, a in zip(sched.sampling_requests(), out.num_drafts, out.num_accepted,
                             strict=True):
            if k and req.batch_row >= 0:  # draft j's KV is valid when draft j was accepted
                self.draft_computed[req.batch_row] += min(a, k - 1)


# -- preparing a step (engine thread) -----------------------------------------------


def _gather(ib: InputBatch, held: np.ndarray, rows: np.ndarray, num_drafts: np.ndarray,
            ends: np.ndarray, lookup: bool, device: torch.device) -> SpecInputs:
    counts = 1 + num_drafts
    first = np.cumsum(counts) - counts
    ahead = np.arange(int(counts.sum())) - np.repeat(first, counts)
    width = int(num_drafts.max())
    drafts = np.zeros((len(rows), width), dtype=np.int64)
    if lookup:
        drafts[:] = held[rows, :width]
        drafts[np.arange(width) >= num_drafts[:, None]] = 0
    draft_at = np.repeat(ends - num_drafts + 1, num_drafts) + (
        np.arange(int(num_drafts.sum())) - np.repeat(np.cumsum(num_drafts) - num_drafts,
                                                     num_drafts))
    return SpecInputs(
        num_drafts=num_drafts,
        drafts=torch.from_numpy(drafts).to(device),
        draft_at=draft_at,
        positions=ib.sampling_batch(np.repeat(rows, counts), ahead),
        owner=np.repeat(np.arange(len(rows)), counts),
        ahead=ahead,
    )


def _draft_inputs(computed: np.ndarray, ib: InputBatch, sched: SchedulerOutput,
                  batch: StepBatch, row_idx: np.ndarray, per_req: np.ndarray) -> DraftInputs:
    """Pass 1 (what the draft has not seen of each request: up to the end of the target's
    non-draft tokens, as far as they are known) and one pass per further draft."""
    members: list[int] = []
    ids: list[int] = []
    seen: list[int] = []  # the draft's KV reaches this far after pass 1
    q_lens: list[int] = []
    for i, (req, start, num_new, num_drafts) in enumerate(zip(
            sched.requests, sched.starts, sched.num_new_tokens, sched.num_lookahead_tokens,
            strict=True)):
        row = int(row_idx[i])
        end = min(start + num_new - num_drafts, len(req.token_ids))
        done = int(computed[row])
        if done < 0:  # joined: a prefix-cache hit's last token may lack the draft's KV
            done = max(start - 1, 0)
        if end > done:
            members.append(i)
            ids.extend(req.token_ids[done:end])
            seen.append(end)
            q_lens.append(end - done)
        computed[row] = end
    drafting = np.flatnonzero(per_req)  # in schedule order = logits order
    rows = row_idx[drafting]
    greedy, temperature, generators = ib.draw_params(rows)
    inputs = DraftInputs(passes=[], num_drafts=per_req[drafting], greedy=greedy,
                         temperature=temperature, generators=generators)
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


# -- the step thread (rank 0) ----------------------------------------------------------------


def verify(logits: torch.Tensor, spec: SpecInputs,
           rows: SamplingBatch) -> tuple[SamplerOutput, SpecOutput]:
    """The rejection sampler over the target's logits at every verified position (``[P, V]``);
    ``rows``: one sampling row per request, as a step without drafts would sample them."""
    pos = spec.positions
    device = logits.device
    drafts = spec.drafts.to(device)
    nd = torch.from_numpy(spec.num_drafts).to(device)
    width = drafts.shape[1]
    counts = 1 + nd
    starts = torch.cumsum(counts, 0) - counts
    mask = rejection.draft_mask(nd, width)
    at = torch.where(mask, starts.unsqueeze(1) + torch.arange(width, device=device),
                     starts.unsqueeze(1))  # the position verifying each draft
    if pos.penalties is not None:  # before the stages: they read the counts
        _count_drafts(pos.penalties, spec, drafts)
    staged = StagedLogits(logits, pos)
    adjusted = staged.adjusted
    argmax = staged.greedy_tokens()
    accept = (argmax[at] == drafts) & mask  # greedy rows: while the draft is the argmax
    scaled = probs = None
    if rows.greedy is not None:  # some request samples
        scaled = staged.scaled()
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
    return _outputs(spec, drafts, accepted, tokens, starts, staged)


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
             tokens: torch.Tensor, starts: torch.Tensor,
             staged: StagedLogits) -> tuple[SamplerOutput, SpecOutput]:
    acc, toks, ds = accepted.tolist(), tokens.tolist(), drafts.tolist()
    runs = [d[:a] + [t] for d, a, t in zip(ds, acc, toks, strict=True)]
    lps: list[list[TokenLogprobs | None]] = [[None] * len(r) for r in runs]
    if staged.raw is not None:
        # The token each position emits: its draft while accepted, then the request's own.
        width = drafts.shape[1]
        per_pos = torch.cat([drafts, tokens.unsqueeze(1)], 1)
        per_pos[torch.arange(len(toks)), accepted] = tokens
        nd = torch.from_numpy(spec.num_drafts).to(drafts.device)
        flat = per_pos[rejection.draft_mask(nd + 1, width + 1)]
        every = staged.logprobs(flat)
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
