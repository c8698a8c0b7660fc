"""Continuous batching: who runs this step, with how many new tokens, in which KV blocks.

Each step is one token budget (``max_num_batched_tokens``) shared by every request:
running requests come first (so decodes keep flowing while long prompts prefill), then
waiting ones in arrival order (FCFS, never skipping the head). A prompt that does not fit
the remaining budget is prefilled in chunks over several steps. When KV blocks run out the
most recently admitted running request is preempted by recompute: its blocks are freed and it
goes back to the front of the queue, to be recomputed (mostly from the prefix cache) later.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from services.engine.block_manager import BlockManager
from services.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    block_table: list[int]

    @property
    def completes_sequence(self) -> bool:
        """True when this step reaches the last known token, so its logits are sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        """Removes a request wherever it is; its blocks go back to the pool."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request.request_id)

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate_or_preempt(req, num_new, out):
                break  # req itself was preempted: everything after it is gone too
            out.scheduled.append(
                ScheduledRequest(req, num_new, self.block_manager.get_block_table(req.request_id))
            )
            budget -= num_new
            i += 1
        return budget

    def _allocate_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Finds blocks for ``req``, preempting the newest running requests if needed."""
        total = req.num_computed_tokens + num_new
        while not self.block_manager.allocate_slots(req.request_id, total):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        logger.debug("preempted request_id=%s", req.request_id)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            blocks, num_cached = self.block_manager.get_computed_blocks(
                req.token_ids, req.block_hashes
            )
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(req.request_id, num_cached + num_new, blocks):
                break  # FCFS: the head waits for blocks; nothing overtakes it
            self.waiting.popleft()
            self.block_manager.record_prefix_lookup(req.num_tokens, num_cached)
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(
                ScheduledRequest(req, num_new, self.block_manager.get_block_table(req.request_id))
            )
            budget -= num_new
