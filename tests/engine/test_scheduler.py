"""Scheduler behaviour on the real block manager, without a model: tokens are 'computed' by
advancing counters the way the engine does after each step."""

from __future__ import annotations

import pytest

from services.engine.block_manager import BlockManager
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.protocol.block_hash import BlockHasher
from services.protocol.sampling_params import SamplingParams

BS = 4
HASHER = BlockHasher("test-model", BS)


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, base: int = 0) -> Request:
    prompt = [(base + i) % 97 + 1 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), HASHER, max_tokens)


def make_scheduler(num_blocks: int = 64, max_seqs: int = 8, budget: int = 32) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_seqs, budget)


def advance(sched: Scheduler, out: SchedulerOutput, next_token: int = 5) -> list[Request]:
    """What the engine does after the model ran: count tokens, sample, retire finished."""
    finished = []
    for s in out.scheduled:
        req = s.request
        completes = s.completes_sequence
        req.num_computed_tokens += s.num_new_tokens
        sched.block_manager.cache_full_blocks(
            req.request_id, req.token_ids, req.block_hashes, req.num_computed_tokens
        )
        if completes:
            req.append_output_token(next_token)
            if req.num_output_tokens >= req.max_tokens:
                req.status = RequestStatus.FINISHED_LENGTH
                sched.finish(req)
                finished.append(req)
    return finished


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert not out.is_empty, "scheduler stalled with unfinished requests"
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        advance(sched, out)
        steps += 1
        assert steps < max_steps
    return steps


def test_budget_chunks_long_prefill_and_keeps_decodes_flowing() -> None:
    sched = make_scheduler(budget=16)
    short = make_request("short", 3, max_tokens=20)
    sched.add(short)
    advance(sched, sched.schedule())  # short prefilled, now decoding
    long = make_request("long", 40, base=50)
    sched.add(long)
    out = sched.schedule()
    by_id = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    # The decode comes first and takes one token; the long prompt gets the rest as a chunk.
    assert by_id == {"short": 1, "long": 15}
    assert out.scheduled[0].request is short
    advance(sched, out)
    assert long.num_output_tokens == 0  # a partial prefill samples nothing
    out = sched.schedule()
    assert {s.request.request_id: s.num_new_tokens for s in out.scheduled} == {
        "short": 1,
        "long": 15,
    }


def test_fcfs_head_is_never_overtaken() -> None:
    # 10 blocks of 4: the first request holds most; the big head must wait, the small one too.
    sched = make_scheduler(num_blocks=10, budget=64)
    first = make_request("first", 28, max_tokens=4)
    big = make_request("big", 24, max_tokens=4, base=30)
    small = make_request("small", 2, max_tokens=4, base=60)
    for r in (first, big, small):
        sched.add(r)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["first"]
    run_to_completion(sched)
    assert sched.block_manager.num_free_blocks == 10


def test_max_num_seqs_limits_running() -> None:
    sched = make_scheduler(max_seqs=2, budget=100)
    for i in range(5):
        sched.add(make_request(f"r{i}", 5, base=i * 10))
    out = sched.schedule()
    assert len(out.scheduled) == 2
    assert len(sched.waiting) == 3


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # Two requests that each grow past half the pool: the newer one must be preempted.
    sched = make_scheduler(num_blocks=8, budget=64)
    a = make_request("a", 8, max_tokens=12)
    b = make_request("b", 8, max_tokens=12, base=40)
    sched.add(a)
    sched.add(b)
    preempted = []
    while sched.has_unfinished():
        out = sched.schedule()
        preempted.extend(r.request_id for r in out.preempted)
        advance(sched, out)
    assert preempted and preempted[0] == "b"
    assert b.num_preemptions >= 1
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert sched.block_manager.num_free_blocks == 8


def test_abort_anywhere_returns_blocks() -> None:
    sched = make_scheduler(num_blocks=16, budget=8)
    running = make_request("running", 12)
    waiting = make_request("waiting", 12, base=40)
    sched.add(running)
    sched.add(waiting)
    advance(sched, sched.schedule())  # running is mid-prefill (8 of 12)
    assert sched.block_manager.get_block_table("running")
    sched.abort(running)
    sched.abort(waiting)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 16


def test_prefix_cache_hit_skips_cached_tokens() -> None:
    sched = make_scheduler(budget=64)
    a = make_request("a", 17, max_tokens=1)
    sched.add(a)
    run_to_completion(sched)
    b = make_request("b", 17, max_tokens=1)  # same prompt
    sched.add(b)
    out = sched.schedule()
    # 4 full blocks are cached, but the hit never covers the whole prompt: 16 of 17 reused.
    assert b.num_cached_tokens == 16
    assert out.scheduled[0].num_new_tokens == 1


@pytest.mark.parametrize("num_blocks", [6, 9, 40])
def test_many_requests_finish_whatever_the_pool(num_blocks: int) -> None:
    sched = make_scheduler(num_blocks=num_blocks, max_seqs=4, budget=10)
    reqs = [make_request(f"r{i}", 3 + i % 7, max_tokens=5, base=i) for i in range(12)]
    for r in reqs:
        sched.add(r)
    run_to_completion(sched)
    assert all(r.num_output_tokens == 5 for r in reqs)
    assert sched.block_manager.num_free_blocks == num_blocks
