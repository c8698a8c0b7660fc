"""The persistent input batch: one row per running request, kept from step to step.

As vLLM v1's ``InputBatch``: what a step needs of each request is written into the row once,
when the request joins the batch, and then only appended to: the block table grows by the
blocks allocated since the last step, a penalised row's output counts by the tokens sampled
since. Per step the runner gathers the scheduled rows (numpy fancy indexing: copies) into
the step's inputs, so the step owns everything it reads.

Rows::

    row:           0        1        2        3  (num_rows = 4)   ... max_rows
    request:       r7       r2       r9       r4
    block_table:   [5 9 ..] [1 ..]   [3 4 8]  [2]       int32 [max_rows, max_blocks]
    num_blocks:    2        1        3        1         written entries of each table row
    temperature, top_k, top_p, min_p, greedy, logprobs ... one entry per row

A request that leaves (finished, aborted, preempted) gives its row back at once: the last row
moves into the hole (compaction), so rows ``0 .. num_rows - 1`` are always the live ones. A
preempted request that comes back joins again with a fresh row (its blocks are new). The step's
optional features (``step_features``) keep their own per-row state and are told of every join,
leave and move.

Threads: only the engine thread touches the batch (``ModelRunner.prepare``: joins, leaves,
appends, gathers). With async scheduling the step thread runs the previous step meanwhile,
but that step's inputs are gathered copies (``SamplingBatch``, the step's arrays), never
views of these rows or a request's live lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.engine.logit_bias import LogitBias
from services.engine.request import Request
from services.engine.sampling_batch import (
    Penalties,
    SamplingBatch,
    has_penalty,
    make_truncation,
    stop_ids,
)
from services.engine.step_features import StepFeatures


@dataclass(slots=True)
class RowFeatures:
    """How many live rows use each optional feature: a step skips a feature's gather (and
    the sampler its pass) when no row has it."""

    sampling: int = 0  # not greedy
    truncating: int = 0  # top-k, top-p or min-p
    seeded: int = 0  # a generator of its own (and not greedy)
    logprobs: int = 0
    logit_bias: int = 0
    min_tokens: int = 0
    penalties: int = 0

    def count(self, req: Request, delta: int) -> None:
        p = req.params
        sampling = not p.greedy
        self.sampling += delta * sampling
        self.truncating += delta * (sampling and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0))
        self.seeded += delta * (sampling and req.generator is not None)
        self.logprobs += delta * (p.logprobs is not None)
        self.logit_bias += delta * (req.logit_bias is not None)
        self.min_tokens += delta * (p.min_tokens > 0)
        self.penalties += delta * has_penalty(p)


class PenaltyCounts:
    """Per-token output counts (and prompt presence) of the penalised rows, in slots of a pool
    that grows as such rows join (a vocabulary-wide row each: only rows that ask pay)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros((0, vocab_size), dtype=torch.float32, device=device)
        self.prompt_seen = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.free: list[int] = []
        # slot -> how many of its request's output tokens the counts hold
        self.counted: list[int] = []

    def take(self, req: Request) -> int:
        if not self.free:
            self._grow()
        slot = self.free.pop()
        vocab, device = self.vocab_size, self.device
        self.counts[slot] = _bincount(req.output_token_ids, vocab, device)
        self.prompt_seen[slot] = _bincount(req.prompt_token_ids, vocab, device) > 0
        self.counted[slot] = req.num_output_tokens
        return slot

    def catch_up(self, slot: int, req: Request) -> None:
        """Counts the request's output tokens sampled since the last call."""
        toks, done = req.token_ids, self.counted[slot]
        num_out = req.num_output_tokens
        if num_out > done:
            new = torch.tensor(toks[len(toks) - num_out + done:], dtype=torch.long,
                               device=self.device)
            self.counts[slot].index_put_((new,), torch.ones(len(new), device=self.device),
                                         accumulate=True)
            self.counted[slot] = num_out

    def give_back(self, slot: int) -> None:
        self.free.append(slot)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(4, 2 * old)
        counts = torch.zeros((new, self.vocab_size), dtype=torch.float32, device=self.device)
        seen = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        seen[:old] = self.prompt_seen
        self.counts, self.prompt_seen = counts, seen
        self.counted.extend([0] * (new - old))
        self.free.extend(range(new - 1, old - 1, -1))


def _bincount(ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    t = torch.tensor(ids, dtype=torch.long, device=device)
    return torch.bincount(t, minlength=vocab).to(torch.float32)


class InputBatch:
    """Rows of the running requests (see the module docstring). Engine thread only."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int, vocab_size: int,
                 device: torch.device, features: StepFeatures | None = None) -> None:
        """``features``: the step's optional features, told of each row's join, leave and
        move."""
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.num_rows = 0
        self.layout = 0  # counts joins and leaves: a request's row stays while it is unchanged
        self.requests: list[Request | None] = [None] * max_rows
        self.block_table = np.zeros((max_rows, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)
        # num_blocks as Python ints: the runner compares them every step
        self.blocks_written = [0] * max_rows
        self.temperature = np.ones(max_rows, dtype=np.float32)
        self.greedy = np.ones(max_rows, dtype=bool)
        self.top_k = np.zeros(max_rows, dtype=np.int64)
        self.top_p = np.ones(max_rows, dtype=np.float64)
        self.min_p = np.zeros(max_rows, dtype=np.float32)
        self.logprobs = np.full(max_rows, -1, dtype=np.int64)
        self.generator: list[torch.Generator | None] = [None] * max_rows
        self.logit_bias: list[LogitBias | None] = [None] * max_rows
        self.stop_ids: list[list[int]] = [[] for _ in range(max_rows)]  # min_tokens bans
        self.penalty_slot = np.full(max_rows, -1, dtype=np.int64)
        self.step_features = features or StepFeatures()
        self.features = RowFeatures()
        self.penalties = PenaltyCounts(vocab_size, device)

    # -- joining and leaving ------------------------------------------------------------------

    def add(self, req: Request, block_ids: list[int]) -> int:
        """Gives ``req`` the next row; writes its parameters and block table."""
        assert req.batch_row < 0, req.request_id
        assert self.num_rows < self.max_rows, "more running requests than max_num_seqs"
        row = self.num_rows
        self.num_rows += 1
        self.layout += 1
        self.requests[row] = req
        req.batch_row = row
        n = len(block_ids)
        self.block_table[row, :n] = block_ids
        self.num_blocks[row] = self.blocks_written[row] = n
        p = req.params
        self.greedy[row] = p.greedy
        self.temperature[row] = 1.0 if p.greedy else p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.generator[row] = req.generator
        self.logit_bias[row] = req.logit_bias
        self.stop_ids[row] = (stop_ids(p, req.eos_token_ids, self.vocab_size)
                              if p.min_tokens > 0 else [])
        self.penalty_slot[row] = self.penalties.take(req) if has_penalty(p) else -1
        self.features.count(req, +1)
        self.step_features.join(req, row)
        return row

    def remove(self, req: Request) -> None:
        """Frees the request's row (if it has one); the last row moves into it."""
        row = req.batch_row
        if row < 0:
            return
        assert self.requests[row] is req, req.request_id
        req.batch_row = -1
        self.layout += 1
        self.features.count(req, -1)
        slot = int(self.penalty_slot[row])
        if slot >= 0:
            self.penalties.give_back(slot)
        self.step_features.leave(req, row)
        last = self.num_rows - 1
        self.num_rows = last
        if row != last:
            self._move(last, row)
        self.requests[last] = None
        self.generator[last] = self.logit_bias[last] = None

    def _move(self, src: int, dst: int) -> None:
        moved = self.requests[src]
        self.requests[dst] = moved
        moved.batch_row = dst
        n = self.blocks_written[src]
        self.block_table[dst, :n] = self.block_table[src, :n]
        self.num_blocks[dst] = self.blocks_written[dst] = n
        for arr in (self.temperature, self.greedy, self.top_k, self.top_p, self.min_p,
                    self.logprobs, self.penalty_slot):
            arr[dst] = arr[src]
        for lst in (self.generator, self.logit_bias, self.stop_ids):
            lst[dst] = lst[src]
        self.step_features.move(src, dst)

    # -- every step ---------------------------------------------------------------------------

    def refresh(self, req: Request, block_ids: list[int]) -> None:
        """Appends the blocks allocated since the last step to the request's table row (and
        counts a penalised row's new output tokens)."""
        row = req.batch_row
        written = self.blocks_written[row]
        n = len(block_ids)
        if n > written:
            self.block_table[row, written:n] = block_ids[written:]
            self.num_blocks[row] = self.blocks_written[row] = n
        if self.features.penalties:
            slot = int(self.penalty_slot[row])
            if slot >= 0:
                self.penalties.catch_up(slot, req)

    def trim_blocks(self, req: Request, num_blocks: int) -> None:
        """The request gave its last blocks back (slots it no longer needs): its
        table row ends after ``num_blocks`` (the next ``refresh`` writes what comes after)."""
        row = req.batch_row
        if num_blocks < self.blocks_written[row]:
            self.num_blocks[row] = self.blocks_written[row] = num_blocks

    def sampling_batch(self, rows: np.ndarray, ahead: np.ndarray | None = None) -> SamplingBatch:
        """The sampler's inputs for ``rows`` (the sampling requests' rows, in logits order):
        gathered copies, so the step owns them. ``ahead`` (a row per scored position): how
        many tokens not yet appended each row's position comes after, counted as output for
        min_tokens."""
        f = self.features
        greedy = temperature = truncation = generators = None
        if f.sampling:
            greedy = self.greedy[rows]
            if not greedy.all():
                temperature = self.temperature[rows]
                if f.truncating:
                    truncation = make_truncation(self.top_k[rows], self.top_p[rows],
                                                 self.min_p[rows])
                if f.seeded:
                    generators = [self.generator[r] for r in rows.tolist()]
            else:
                greedy = None
        logprobs = None
        if f.logprobs:
            lp = self.logprobs[rows]
            logprobs = lp.tolist() if (lp >= 0).any() else None
        return SamplingBatch(
            num_rows=len(rows),
            greedy=greedy,
            temperature=temperature,
            truncation=truncation,
            generators=generators,
            logprobs=logprobs,
            logit_bias=self._biases(rows) if f.logit_bias else None,
            banned=self._banned(rows, ahead) if f.min_tokens else None,
            penalties=self._penalties(rows) if f.penalties else None,
        )

    def draw_params(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                     list[torch.Generator | None] | None]:
        """What drawing a token for ``rows`` needs besides the logits (gathered copies): greedy,
        temperature (1 on greedy rows) and the seeded rows' generators (None: no seeded row)."""
        gens = [self.generator[r] for r in rows.tolist()] if self.features.seeded else None
        return self.greedy[rows], self.temperature[rows], gens

    def needs_host_tokens(self) -> bool:
        """Whether the step after one that samples for these rows must wait for its tokens on
        the host before it is prepared (async scheduling): penalties count the output tokens;
        min_tokens compares their number while it may still matter (once the output is past
        it, a count one short decides the same); and the step's features say (a grammar
        advances with each token, prompt logprobs are collected across chunks)."""
        f = self.features
        if f.penalties or self.step_features.needs_host_tokens():
            return True
        if not f.min_tokens:
            return False
        return any(r is not None and r.params.min_tokens > 0
                   and r.num_output_tokens <= r.params.min_tokens
                   for r in self.requests[: self.num_rows])

    def _biases(self, rows: np.ndarray) -> list[LogitBias | None] | None:
        out = [self.logit_bias[r] for r in rows.tolist()]
        return out if any(b is not None for b in out) else None

    def _banned(self, rows: np.ndarray,
                ahead: np.ndarray | None) -> tuple[list[int], list[int]] | None:
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, r in enumerate(rows.tolist()):
            ids = self.stop_ids[r]
            req = self.requests[r]
            out = req.num_output_tokens + (0 if ahead is None else int(ahead[i]))
            if ids and out < req.params.min_tokens:
                ban_rows.extend([i] * len(ids))
                ban_ids.extend(ids)
        return (ban_rows, ban_ids) if ban_rows else None

    def _penalties(self, rows: np.ndarray) -> Penalties | None:
        slots = self.penalty_slot[rows]
        idx = np.flatnonzero(slots >= 0)
        if not len(idx):
            return None
        slot_t = torch.from_numpy(slots[idx]).to(self.penalties.device)
        params = [self.requests[r].params for r in rows[idx].tolist()]
        rep = [p.repetition_penalty for p in params]
        seen = None
        if any(v != 1.0 for v in rep):
            seen = self.penalties.prompt_seen.index_select(0, slot_t)
        return Penalties(
            rows=idx.tolist(),
            output_counts=self.penalties.counts.index_select(0, slot_t),
            prompt_seen=seen,
            repetition=rep,
            frequency=[p.frequency_penalty for p in params],
            presence=[p.presence_penalty for p in params],
        )
