"""Continuous batching: who runs this step, with how many new tokens, in which KV blocks.

Each step is one token budget (``max_num_batched_tokens``) shared by every request:
running requests come first (so decodes keep flowing while long prompts prefill), then
waiting ones in arrival order (FCFS, never skipping the head). A prompt that does not fit
the remaining budget is prefilled in chunks over several steps. When KV blocks run out the
most recently admitted running request is preempted by recompute: its blocks are freed and it
goes back to the front of the queue, to be recomputed (mostly from the prefix cache) later.

A step feature may limit admission (``admission``: a pass over the requests that hold a
place, asked for each waiting one): a waiting request it refuses is deferred (it keeps its
place; later requests that fit go ahead), counted in ``num_deferrals``.

One step is ``schedule()`` -> the model runs -> ``update()``: the scheduler decides who samples
and applies the result (tokens computed and cached, sampled tokens appended, stop checks,
finished requests freed), as vLLM's ``update_from_output`` and nano-vllm's ``postprocess``.

Async scheduling (``async_scheduling``) schedules step n+1 before step n is applied: a request
counts the tokens of steps scheduled but not applied (``num_scheduled_tokens``) as computed,
and each token such a step samples for it as known (a placeholder, ``num_placeholders``: its
value reaches the model runner from step n's sampled ids). ``update`` of step n then drops the
token of a request that has finished or was aborted meanwhile. Synchronous stepping goes
through the same bookkeeping, with nothing in flight at ``schedule``, with one shortcut: while
the running set only decodes, each step is scheduled and applied from a ``DecodeBatch``'s
arrays (``decode_batch``), which leaves the scheduled and placeholder counts alone; anything
else that happens to the set drops the batch and the bookkeeping above resumes.

Lookahead tokens (proposed by ``spec_decode``, verified by the step): a decoding request with
``num_lookahead_tokens`` = k is scheduled for its last token and them (``1 + k`` tokens, fewer
lookahead ones when the budget is short), and gets a run of up to ``k + 1`` tokens back (every
request gets a run: one token without lookahead). Only the accepted tokens' KV counts as
computed; the blocks past what its tokens then need go back to the pool (``trim``) and the
input batch's row is told (``take_trimmed``). A step with lookahead tokens is never in flight
while the next is scheduled (its runs decide the next step's), so none of this meets a
placeholder.

KV from outside the pool (``connector``: any ``kv_connector.base.KVConnector``): an admission
whose prefix the connector can deliver past its pool hit gets its blocks and waits for KV in
``loading`` while the connector fills them; the step goes on without it. Once the connector
reports the load done it joins the running set with the tokens that arrived computed (and
cached in the pool), at the start of a later ``schedule``. An abort while it loads frees its
blocks only once the load is reported. A finished request whose blocks the connector holds for
sending keeps them until the connector reports them sent, or ``kv_transfer_timeout_s`` has
passed.

Scheduling policy (``SchedulingPolicy``, vLLM's ``--scheduling-policy``): FCFS as above, or
PRIORITY: the waiting queue is kept in (priority, arrival) order (a lower value first, ties by
arrival, as vLLM's ``Request.__lt__``) and so is the running set, so that its last entry is the
one preemption takes: the least urgent (largest value), latest arrival among running requests,
which is vLLM's ``max(running, key=(priority, arrival_time))``. A preempted request goes back
into the queue at its rank (vLLM's priority queue has no front). The running set's order also
means a more urgent request gets the step's budget first, and a victim is never one already
scheduled this step (everything scheduled before it is more urgent than the request asking).
"""

from __future__ import annotations

import bisect
import enum
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import sub
from typing import Any, Protocol

import numpy as np

from services.engine.block_manager import BlockManager
from services.engine.decode_batch import DecodeBatch
from services.engine.kv_connector.base import FinishedTransfers, KVConnector
from services.engine.kv_connector.config import DEFAULT_TIMEOUT_S
from services.engine.prompt_logprobs import reads_prefix_cache
from services.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class AdmissionPass(Protocol):
    """One scheduling pass of a feature's admission limit."""

    deferred: list[Request]  # the waiting requests it refused, in queue order

    def admits(self, req: Request) -> bool:
        """Whether ``req`` may start now (if not, it is recorded in ``deferred``)."""
        ...

    def admitted(self, req: Request) -> None: ...


# A pass built from the requests that hold a place (running, and loading KV to run).
Admission = Callable[[Iterable[Request]], AdmissionPass]


class SchedulingPolicy(enum.Enum):
    """vLLM's ``--scheduling-policy`` values."""

    FCFS = "fcfs"
    PRIORITY = "priority"


def _rank(req: Request) -> tuple[int, float]:
    """PRIORITY's order: lower value first, then earlier arrival."""
    return req.priority, req.arrival_time


@dataclass(slots=True)
class ScheduledRequest:
    """One request of a step: a view of ``SchedulerOutput``'s columns at one index (they say
    what each field means; ``completes_sequence`` is the ``samples`` column)."""

    request: Request
    num_new_tokens: int
    block_ids: list[int]
    completes_sequence: bool
    start: int
    num_lookahead_tokens: int = 0


@dataclass(slots=True)
class WaitingForKV:
    """A request in ``Scheduler.loading``: its blocks are allocated and being filled."""

    request: Request
    num_pool_tokens: int  # the pool's hit, before the loaded tokens


@dataclass(slots=True)
class SchedulerOutput:
    """The step, as columns: its requests in schedule order and, at the same index of each
    other column, what the step does for that request (``ScheduledRequest`` names them). The
    runner and ``Scheduler.update`` read the columns whole, so a step of decodes is built and
    applied by list and array operations rather than an object per request."""

    requests: list[Request] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # first position computed this step
    num_new_tokens: list[int] = field(default_factory=list)  # computed from ``starts`` on
    # Each one's block ids, the block manager's own list (engine thread only: the runner
    # appends what is new to its persistent row, never keeps it).
    block_ids: list[list[int]] = field(default_factory=list)
    # Decided by schedule(): this step reaches the last known token, so a token is sampled
    # from its logits (False for every chunk of a chunked prefill but the last).
    samples: list[bool] = field(default_factory=list)
    num_lookahead_tokens: list[int] = field(default_factory=list)  # the last new ones: drafts
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_sampling: int = 0  # the scheduled requests with ``samples``
    # The connector's metadata for the step (the loads it planned), for its worker side.
    kv_connector_metadata: Any = None
    # The indices of the requests whose block list this schedule grew, when the decode path
    # built the step and nothing was admitted after it (None: any may have; the runner
    # compares each row's). A row is brought up to date by the prepare of the schedule that
    # grew its list, so no other row can lag.
    grown: list[int] | None = None
    # The running set as arrays, when the step was scheduled from them (``decode_batch``):
    # its requests' scheduled counts were left as they were, and its apply goes by the arrays.
    decode_batch: DecodeBatch | None = None

    def add(self, req: Request, start: int, num_new: int, block_ids: list[int], samples: bool,
            num_lookahead: int = 0) -> None:
        self.requests.append(req)
        self.starts.append(start)
        self.num_new_tokens.append(num_new)
        self.block_ids.append(block_ids)
        self.samples.append(samples)
        self.num_lookahead_tokens.append(num_lookahead)
        self.num_sampling += samples

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """The step, a request at a time (a view built on each call: not for the step loop)."""
        return list(map(ScheduledRequest, self.requests, self.num_new_tokens, self.block_ids,
                        self.samples, self.starts, self.num_lookahead_tokens))

    @property
    def one_token_each(self) -> bool:
        """Every request computes one token and samples it: a step of decodes (no prefill
        chunk, no lookahead tokens), which the array paths of the scheduler and the runner
        take."""
        n = len(self.requests)
        return n > 0 and self.num_batched_tokens == n == self.num_sampling

    def sampling_requests(self) -> list[Request]:
        """The requests the step samples for, in the order of its sampled tokens."""
        if self.num_sampling == len(self.requests):
            return self.requests
        return [req for req, smp in zip(self.requests, self.samples, strict=True) if smp]

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        admission: Admission | None = None,
        policy: SchedulingPolicy = SchedulingPolicy.FCFS,
    ) -> None:
        self.block_manager = block_manager
        self.by_priority = policy is SchedulingPolicy.PRIORITY
        self.admission = admission  # a feature's limit on who starts (None: anyone who fits)
        self.num_deferrals = 0  # admissions it deferred (tests, metrics)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len  # prompt + output never grows past it
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_finished = 0  # requests ``update`` finished (the engine's cue to drop them)
        self.num_steps_in_flight = 0  # scheduled, not applied yet (async scheduling: up to 2)
        # Pipeline parallelism's batch queue (``pipeline_batches``): a request in a step in
        # flight is not scheduled again before that step is applied, and a step takes at most
        # ``max_batch_seqs`` requests (None: as many as fit).
        self.one_batch_per_request = False
        self.max_batch_seqs: int | None = None
        # Requests that left the running set (finished, aborted, preempted) since the last
        # ``take_left``: the engine gives their input-batch rows back.
        self._left: list[Request] = []
        # (request, blocks it kept) after giving back rejected tokens' blocks (``trim``).
        self._trimmed: list[tuple[Request, int]] = []
        self.connector: KVConnector | None = None  # moves KV from outside the pool, if any
        self.kv_transfer_timeout_s = DEFAULT_TIMEOUT_S
        # Admitted, waiting for KV from outside the pool (the one "waiting for KV" state).
        self.loading: dict[str, WaitingForKV] = {}
        self._cancelled_loads: set[str] = set()  # aborted while loading: freed once reported
        self._held: dict[str, float] = {}  # finished, blocks held for sending: id -> deadline
        # The running set as arrays while it only decodes (``decode_batch``): built by a step
        # of decodes' apply, used by the next schedule if nothing else happened in between.
        # The engine turns it on where each step is applied before the next is scheduled, no
        # feature sets lookahead tokens before schedules and no KV connector is set.
        self.decode_batches = False
        self._decode_batch: DecodeBatch | None = None

    # -- queue management -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        assert self.by_priority or request.priority == 0, "the engine refuses it (a 400)"
        if self.by_priority:
            bisect.insort(self.waiting, request, key=_rank)
        else:
            self.waiting.append(request)

    def set_connector(self, connector: KVConnector, timeout_s: float) -> None:
        self.connector, self.kv_transfer_timeout_s = connector, timeout_s

    def abort(self, request: Request) -> None:
        """Removes a request wherever it is; its blocks go back to the pool (held first, if
        the connector is still writing or sending them)."""
        rid = request.request_id
        if self.loading.pop(rid, None) is not None:  # its blocks are being written
            self._cancelled_loads.add(rid)
            self.connector.request_finished(request, self.block_manager.block_ids(rid))
            return
        block_ids = []
        if request in self.running:
            self.running.remove(request)
            self._left.append(request)
            block_ids = self.block_manager.block_ids(rid)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free_finished(request, block_ids)

    def holds_blocks_of(self, request_id: str) -> bool:
        """Whether a request that left still has blocks (its id cannot be reused yet)."""
        return request_id in self._held or request_id in self._cancelled_loads

    def _free_finished(self, req: Request, block_ids: list[int]) -> None:
        """Frees a finished or aborted request's blocks, unless the connector holds them for
        sending (then ``get_finished`` or the timeout frees them)."""
        if self.connector is not None:
            delay, req.kv_transfer_params = self.connector.request_finished(req, block_ids)
            if delay:
                self._held[req.request_id] = time.monotonic() + self.kv_transfer_timeout_s
                return
        self.block_manager.free(req.request_id)

    def take_left(self) -> list[Request]:
        """The requests that left the running set since the last call (each at most once per
        leaving: finished, aborted, or preempted)."""
        left, self._left = self._left, []
        return left

    def take_trimmed(self) -> list[tuple[Request, int]]:
        """(request, blocks it holds now) for each request that gave blocks back since the
        last call (rejected lookahead tokens' slots)."""
        trimmed, self._trimmed = self._trimmed, []
        return trimmed

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def poll_transfers(self) -> None:
        """Applies the connector's report between steps: an idle engine frees the blocks it
        held for sending once they were pulled or expired (no step would)."""
        if self.connector is not None and self._held and not self.loading:
            self._admit_loaded(self.connector.get_finished())

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.connector is None:
            return self._schedule()
        self._admit_loaded(self.connector.get_finished())
        out = self._schedule()
        if out.is_empty and self.loading:  # nothing else to run: wait for a load, briefly
            self._admit_loaded(self.connector.get_finished(timeout=0.05))
            out = self._schedule()
        out.kv_connector_metadata = self.connector.build_connector_meta()
        return out

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # Whatever this schedule does, the batch is used by it or by nobody.
        batch, self._decode_batch = self._decode_batch, None
        budget = None
        if self.num_steps_in_flight:
            # A step from the batch left the requests' scheduled counts alone: no other step
            # may be scheduled before it is applied.
            assert not self.decode_batches, "decode batches need synchronous stepping"
            self._cache_in_flight()
        elif batch is not None and batch.requests == self.running:
            budget = self._schedule_batch(out, self.max_num_batched_tokens, batch)
        if budget is None:
            budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            budget = self._schedule_waiting(out, budget)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        self._left.extend(out.preempted)
        self.num_steps_in_flight += not out.is_empty
        return out

    def _cache_in_flight(self) -> None:
        """Caches the blocks a step in flight fills (async scheduling), as synchronous
        stepping would have by now, so admissions hit the same prefixes either way. Safe: steps
        run in order, so their KV is written before any step scheduled from here reads it."""
        for req in self.running:
            if req.num_scheduled_tokens:
                self._cache_blocks(req, req.num_computed_tokens + req.num_scheduled_tokens)

    def _cache_blocks(self, req: Request, num_computed: int) -> None:
        # Only a step that fills a block can cache one (its hash exists by then: the request
        # hashes each block as its last token arrives, before it is computed).
        bs = self.block_manager.block_size
        if num_computed // bs != req.num_computed_tokens // bs:
            self.block_manager.cache_computed_blocks(
                req.request_id, req.token_ids, req.block_hashes, num_computed
            )

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        if not self.one_batch_per_request:
            left = self._schedule_decodes(out, budget)
            if left is not None:
                return left
        # Preemption only removes from the end of ``running``, which the loop then never
        # reaches.
        add, requests = out.add, out.requests
        bm = self.block_manager
        allocate, tables, bs = bm.allocate_slots, bm.block_tables, bm.block_size
        room = self.max_batch_seqs or self.max_num_seqs
        exclusive = self.one_batch_per_request
        for req in self.running:
            if budget <= 0 or len(requests) >= room:
                break
            if exclusive and req.num_scheduled_tokens:
                continue  # in a step in flight (a pipeline's): its next step waits for it
            placeholders = req.num_placeholders
            if placeholders and self._surely_finishes(req):
                continue  # its last token is on its way: nothing more to compute for it
            start = req.num_computed_tokens + req.num_scheduled_tokens
            end = len(req.token_ids) + placeholders
            # A decode's lookahead tokens come after its last one (as many as the budget holds).
            num_new = end - start + req.num_lookahead_tokens
            if num_new > budget:
                num_new = budget
            total = start + num_new
            ids = tables[req.request_id]  # grows in place when blocks are allocated
            # While its last block has room (most decodes) nothing needs allocating.
            if total > len(ids) * bs and not allocate(req.request_id, total) and not (
                    self._preempt_for(req, total, out)):
                break  # req itself was preempted: everything after it is gone too
            samples = total >= end
            req.num_scheduled_tokens += num_new
            req.num_placeholders = placeholders + samples
            add(req, start, num_new, ids, samples, total - end if total > end else 0)
            budget -= num_new
        return budget

    def _schedule_batch(self, out: SchedulerOutput, budget: int,
                        batch: DecodeBatch) -> int | None:
        """``_schedule_decodes`` from the arrays of a running set that only decoded since the
        last schedule: each request computes the position after the last one. The requests'
        scheduled and placeholder counts are not raised (nothing reads them before this
        step's apply, which goes by the batch too). None, having changed nothing, when the
        step is not that (too small a budget, too few free blocks)."""
        n = len(batch.requests)
        if n > budget or n > (self.max_batch_seqs or self.max_num_seqs):
            return None
        starts = batch.starts + 1
        short = np.flatnonzero(starts >= batch.capacity)  # its next token needs a block
        bm = self.block_manager
        if len(short) > bm.num_free_blocks:
            return None  # someone is preempted: the loop picks whom
        grown = short.tolist()
        for i in grown:  # a block each: they fit
            allocated = bm.allocate_slots(batch.requests[i].request_id, int(starts[i]) + 1)
            assert allocated, batch.requests[i].request_id
            batch.capacity[i] = len(batch.block_ids[i]) * bm.block_size
        batch.starts = starts
        out.requests = batch.requests
        out.starts = starts.tolist()
        out.num_new_tokens = [1] * n
        out.block_ids = batch.block_ids
        out.samples = [True] * n
        out.num_lookahead_tokens = [0] * n
        out.num_sampling = n
        out.grown = grown
        out.decode_batch = batch
        return budget - n

    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> int | None:
        """The common step, by list operations: every running request computes one token (its
        last, or the one on its way) and samples it, as the loop of ``_schedule_running``
        would schedule them. None, having changed nothing, when the step is not that (a
        prefill chunk, lookahead tokens, a last token that surely ends its request, too small
        a budget, too few free blocks): the loop decides then."""
        running = self.running
        n = len(running)
        if not n or n > budget or n > (self.max_batch_seqs or self.max_num_seqs):
            return None
        starts = [r.num_computed_tokens + r.num_scheduled_tokens for r in running]
        placeholders = [r.num_placeholders for r in running]
        ends = [len(r.token_ids) + p for r, p in zip(running, placeholders, strict=True)]
        if list(map(sub, ends, starts)).count(1) != n or any(
                [r.num_lookahead_tokens for r in running]):
            return None
        if any(placeholders) and any([self._surely_finishes(r) for r in running
                                      if r.num_placeholders]):
            return None
        bm = self.block_manager
        tables, bs = bm.block_tables, bm.block_size
        ids = [tables[r.request_id] for r in running]
        short = [i for i, (end, t) in enumerate(zip(ends, ids, strict=True)) if end > len(t) * bs]
        if len(short) > bm.num_free_blocks:
            return None  # someone is preempted: the loop picks whom
        for i in short:  # a block each: they fit
            allocated = bm.allocate_slots(running[i].request_id, ends[i])
            assert allocated, running[i].request_id
        for r in running:
            r.num_scheduled_tokens += 1
            r.num_placeholders += 1
        out.requests = running.copy()
        out.starts = starts
        out.num_new_tokens = [1] * n
        out.block_ids = ids
        out.samples = [True] * n
        out.num_lookahead_tokens = [0] * n
        out.num_sampling = n
        out.grown = short
        return budget - n

    def _preempt_for(self, req: Request, total: int, out: SchedulerOutput) -> bool:
        """Preempts the newest running requests (PRIORITY: the least urgent) until ``req`` gets
        blocks for ``total`` tokens; False if ``req`` itself had to go."""
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
        req.num_computed_tokens = req.num_scheduled_tokens = 0  # a step in flight: not applied
        req.num_lookahead_tokens = 0  # their values go with its row
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:  # back at its rank: vLLM's priority queue has no front
            bisect.insort(self.waiting, req, key=_rank)
        else:
            self.waiting.appendleft(req)
        out.preempted.append(req)
        logger.debug("preempted request_id=%s", req.request_id)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        if not self.waiting:  # the common decode step: no admission gate to build
            return budget
        gate = None if self.admission is None else self.admission(
            [*self.running, *(w.request for w in self.loading.values())])  # loading: to run
        cap = self.max_batch_seqs or self.max_num_seqs
        while self.waiting and budget > 0 and len(out.requests) < cap and (
                len(self.running) + len(self.loading) < self.max_num_seqs):
            req = self.waiting[0]
            if gate is not None and not gate.admits(req):
                self.waiting.popleft()  # keeps its place: put back in front below
                continue
            # A request preempted by this schedule may await a token, but no admission follows
            # a preemption; every other waiting request has all its tokens.
            assert not req.num_placeholders, req.request_id
            blocks, num_cached = (
                self.block_manager.get_computed_blocks(req.token_ids, req.block_hashes)
                if reads_prefix_cache(req) else ([], 0)
            )
            if self.connector is not None and reads_prefix_cache(req):
                started = self._start_load(req, blocks, num_cached)
                if started is False:
                    break  # FCFS: the head waits for blocks
                if started:
                    if gate is not None:
                        gate.admitted(req)
                    continue
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(req.request_id, num_cached + num_new, blocks):
                break  # FCFS: the head waits for blocks; nothing overtakes it
            self.waiting.popleft()
            self.block_manager.record_prefix_lookup(req.num_tokens, num_cached)
            if self.connector is not None:
                self.connector.update_state_after_alloc(
                    req, self.block_manager.block_ids(req.request_id), 0)
            self._start_running(req, num_cached)
            self._schedule_new(out, req, num_new)
            budget -= num_new
            if gate is not None:
                gate.admitted(req)
        if gate is not None and gate.deferred:
            self.num_deferrals += len(gate.deferred)
            self.waiting.extendleft(reversed(gate.deferred))
        return budget

    def _start_running(self, req: Request, num_cached: int) -> None:
        """A request admitted with its first ``num_cached`` tokens already in the pool."""
        req.num_computed_tokens = num_cached
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        req.status = RequestStatus.RUNNING
        if self.by_priority:  # running[-1] stays the one preemption takes
            bisect.insort(self.running, req, key=_rank)
        else:
            self.running.append(req)

    def _start_load(self, req: Request, blocks: list, num_cached: int) -> bool | None:
        """Starts loading the KV the connector has after the pool's hit, if any: True (it
        waits in ``loading``), None (nothing to load: admit it as usual) or False (no free
        blocks for them: it waits)."""
        num_external, is_async = self.connector.get_num_new_matched_tokens(req, num_cached)
        if not num_external:
            return None
        assert is_async, "a connector's loads are asynchronous (the only kind the step has)"
        bm = self.block_manager
        if not bm.allocate_slots(req.request_id, num_cached + num_external, blocks):
            return False
        self.waiting.popleft()
        self.connector.update_state_after_alloc(req, bm.block_ids(req.request_id), num_external)
        self.loading[req.request_id] = WaitingForKV(req, num_cached)
        return True

    def _admit_loaded(self, done: FinishedTransfers) -> None:
        """Applies the connector's report: requests whose KV arrived are cached in the pool
        and run with those tokens computed; blocks held for sending, or by an aborted load,
        are freed (held ones also once their timeout has passed)."""
        bm = self.block_manager
        for rid in done.sending:
            if self._held.pop(rid, None) is not None:
                bm.free(rid)
        for rid, num_loaded in done.recving.items():
            if rid in self._cancelled_loads:
                self._cancelled_loads.discard(rid)
                bm.free(rid)
                continue
            waiting = self.loading.pop(rid)
            req, num_cached = waiting.request, waiting.num_pool_tokens + num_loaded
            if num_loaded:
                bm.cache_full_blocks(rid, req.token_ids, req.block_hashes, num_cached)
            bm.record_prefix_lookup(req.num_tokens, waiting.num_pool_tokens)
            self._start_running(req, num_cached)
        if self._held:
            self._free_expired()

    def _free_expired(self) -> None:
        now = time.monotonic()
        for rid in [rid for rid, deadline in self._held.items() if deadline <= now]:
            del self._held[rid]
            self.block_manager.free(rid)
            logger.warning("request_id=%s: its KV was not taken within %.0f s; freed",
                           rid, self.kv_transfer_timeout_s)

    def _schedule_new(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        if out.decode_batch is not None:  # a request joins: the step is the general kind
            out.decode_batch = None
            out.requests, out.block_ids = list(out.requests), list(out.block_ids)
            for r in out.requests:
                r.num_scheduled_tokens += 1
                r.num_placeholders += 1
        start = req.num_computed_tokens + req.num_scheduled_tokens
        samples = start + num_new == len(req.token_ids) + req.num_placeholders
        req.num_scheduled_tokens += num_new
        req.num_placeholders += samples
        out.grown = None  # an admission after the decode path: its list is not in ``grown``
        out.add(req, start, num_new, self.block_manager.block_ids(req.request_id), samples)

    def _surely_finishes(self, req: Request) -> bool:
        """The tokens on their way reach max_tokens or the context: the request ends with
        them whatever they are, so a step scheduled before they land would be wasted."""
        num_tokens = len(req.token_ids) + req.num_placeholders
        return (req.num_output_tokens + req.num_placeholders >= req.max_tokens
                or num_tokens >= self.max_model_len)

    # -- the step's result ------------------------------------------------------------------

    def update(self, sched: SchedulerOutput, token_ids: Sequence[int],
               runs: Sequence[list[int]] | None = None) -> list[Request]:
        """Applies a step: appends ``token_ids`` (one per request scheduled with
        ``completes_sequence``, in schedule order), or ``runs`` when the step verified lookahead
        tokens (each sampling request's accepted ones, then the model's own token;
        ``token_ids`` holds their first ones). Either way each request's tokens are a run,
        one token without lookahead, applied by the one loop below.

        Returns the requests that got a token, in the order of ``token_ids``; each one's new
        token is its last output token, and ``status`` says whether it finished. A request
        that had finished (or was aborted) before the step was applied gets none: with async
        scheduling a step can be scheduled before its requests' previous tokens are known.
        """
        assert len(token_ids) == sched.num_sampling, "one token per request that samples"
        self.num_steps_in_flight -= 1
        if runs is None:
            kept = self._apply_decodes(sched, token_ids)
            if kept is not None:
                return kept
        now = time.monotonic()
        finished = False
        kept = []
        running, preempted = RequestStatus.RUNNING, RequestStatus.PREEMPTED
        max_len, bs = self.max_model_len, self.block_manager.block_size
        k = 0  # the next sampling request's index in token_ids (and runs)
        for req, num_new, samples, lookahead in zip(
                sched.requests, sched.num_new_tokens, sched.samples, sched.num_lookahead_tokens,
                strict=True):
            status = req.status
            if not samples:  # a prefill chunk: its KV counts if it still runs
                if status is running:
                    req.num_scheduled_tokens -= num_new
                    after = req.num_computed_tokens + num_new
                    self._cache_blocks(req, after)  # the blocks it filled, if any
                    req.num_computed_tokens = after
                continue
            run = (token_ids[k],) if runs is None else runs[k]
            k += 1
            # ``computed``: it still runs, so the step's KV counts (else it was preempted by a
            # step scheduled since, and its tokens are kept for its recompute).
            computed = status is running
            if computed:
                req.num_scheduled_tokens -= num_new
            elif status is not preempted:
                continue  # finished or aborted: the extra token of a step scheduled before
            kept.append(req)
            req.num_placeholders -= 1
            if req.first_token_time is None:
                req.first_token_time = now
            # The run appended, each token stop-checked, cut after the one that ends it (a list
            # run: its logprobs are cut to match).
            toks, grammar, stops, limit = (req.token_ids, req.grammar, req.stop_token_set,
                                           req.token_limit)
            n, stopped = 0, False
            for tok in run:
                toks.append(tok)
                n += 1
                if grammar is not None:
                    grammar.accept(tok)
                if (tok in stops or len(toks) >= limit or len(toks) >= max_len) and (
                        self._stopped(req, tok)):
                    stopped = True
                    if n < len(run):
                        del run[n:]  # type: ignore[index]  # a verified run is a list
                    break
            if len(toks) % bs < n:  # a block filled: hash it
                req.hash_full_blocks()
            if computed:
                # Every token it scheduled counts but the rejected lookahead ones
                # (``num_lookahead_tokens`` less the accepted ``n - 1``); the blocks past its
                # tokens go back.
                done = req.num_computed_tokens
                after = done + num_new - lookahead + n - 1
                if after // bs != done // bs:  # a block filled: cache it
                    self._cache_blocks(req, after)
                req.num_computed_tokens = after
                if lookahead and not stopped:
                    kept_blocks = self.block_manager.trim(req.request_id, after + 1)
                    if kept_blocks is not None:
                        self._trimmed.append((req, kept_blocks))
            if stopped:
                finished = True
                self._free_finished(req, self.block_manager.block_ids(req.request_id)
                                    if computed else [])
                if not computed:  # preempted by a step scheduled since
                    self.waiting.remove(req)
        if finished:
            self._drop_finished(kept)
        return kept

    def _apply_decodes(self, sched: SchedulerOutput,
                       token_ids: Sequence[int]) -> list[Request] | None:
        """``update`` of the common step by array operations: each request computed one token,
        sampled one and still runs (what the loop of ``update`` does with a run of one token,
        the blocks' hashing and caching and the stop's exact rules called only for the few it
        concerns). The step's requests as a ``DecodeBatch``: the one it was scheduled from, or
        one built here once their scheduled counts are cleared. None, having changed nothing,
        when the step is not that."""
        if not sched.one_token_each:
            return None
        batch = sched.decode_batch
        if batch is None:
            reqs = sched.requests
            if [r.status for r in reqs].count(RequestStatus.RUNNING) != len(reqs):
                return None  # some finished (or were preempted) since it was scheduled
            now = time.monotonic()
            for req in reqs:
                req.num_scheduled_tokens -= 1
                req.num_placeholders -= 1
                if req.first_token_time is None:
                    req.first_token_time = now
            batch = DecodeBatch.of(reqs, sched.starts, sched.block_ids, self.max_model_len,
                                   self.block_manager.block_size)
        return self._apply_batch(batch, token_ids)

    def _apply_batch(self, batch: DecodeBatch, token_ids: Sequence[int]) -> list[Request]:
        """Appends each request's token, stop-checks, hashes and caches the blocks that filled,
        and frees those that finished. Kept for the next schedule, without them, where the
        engine steps synchronously (``decode_batches``)."""
        reqs, tokens = batch.requests, list(token_ids)
        ends = batch.append(tokens)
        for i in batch.grammar_rows:
            reqs[i].grammar.accept(tokens[i])
        bs = self.block_manager.block_size
        for i in np.flatnonzero(batch.lengths % bs == 0).tolist():  # a block of tokens: hash
            reqs[i].hash_full_blocks()
        after = batch.starts + 1
        for i in np.flatnonzero(after % bs == 0).tolist():  # its KV filled a block: cache it
            self._cache_blocks(reqs[i], int(after[i]))
        for req, n in zip(reqs, after.tolist(), strict=True):
            req.num_computed_tokens = n
        finished = [i for i in ends.tolist() if self._stopped(reqs[i], tokens[i])]
        for i in finished:
            req = reqs[i]
            self._free_finished(req, self.block_manager.block_ids(req.request_id))
        if finished:
            self._drop_finished(reqs)
        if self.decode_batches:  # the engine's choice (synchronous, no connector, ...)
            if finished:
                batch.keep([i for i, r in enumerate(reqs) if not r.status.is_finished])
            self._decode_batch = batch if batch.requests else None
        return reqs

    def _drop_finished(self, kept: list[Request]) -> None:
        """The finished requests out of the running set, in one pass (not a ``list.remove``
        each)."""
        self.running[:] = [r for r in self.running if not r.status.is_finished]
        done = [r for r in kept if r.status.is_finished]
        self._left.extend(done)
        self.num_finished += len(done)

    def _stopped(self, req: Request, tok: int) -> bool:
        """Sets the finished status if ``tok`` ends the request; True if it does."""
        p = req.params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in req.eos_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if tok in p.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = tok
                return True
        if n_out >= req.max_tokens or len(req.token_ids) >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
