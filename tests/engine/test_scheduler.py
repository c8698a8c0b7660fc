"""Scheduler behaviour on the real block manager, without a model: each step is
``schedule()`` then ``update()`` with made-up sampled tokens, as the engine drives it."""

from __future__ import annotations

import pytest

from services.engine.block_manager import BlockManager
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.protocol.block_hash import BlockHasher
from services.protocol.sampling_params import SamplingParams

BS = 4
HASHER = BlockHasher("test-model", BS)
EOS = 2


def make_request(
    rid: str, prompt_len: int, max_tokens: int = 8, base: int = 0, **params: object
) -> Request:
    prompt = [(base + i) % 97 + 3 for i in range(prompt_len)]  # never EOS
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(rid, prompt, sp, HASHER, max_tokens, eos_token_ids=(EOS,))


def make_scheduler(
    num_blocks: int = 64, max_seqs: int = 8, budget: int = 32, max_model_len: int = 1024
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_seqs, budget, max_model_len)


def advance(sched: Scheduler, out: SchedulerOutput, next_token: int = 5) -> list[Request]:
    """Feeds the step's result back: ``next_token`` for every request that samples."""
    n = sum(s.completes_sequence for s in out.scheduled)
    return sched.update(out, [next_token] * n)


def step(sched: Scheduler, next_token: int = 5) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    return out, advance(sched, out, next_token)


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
    advance(sched, out)  # a scheduled step is applied before the next (or is in flight)
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


# -- update(): the scheduler applies each step's result ---------------------------------------


def test_stop_token_finishes_the_request_and_frees_its_blocks() -> None:
    sched = make_scheduler(num_blocks=16)
    req = make_request("r", 6, max_tokens=10, stop_token_ids=[42])
    sched.add(req)
    _, sampled = step(sched)  # prefill samples token 5
    assert sampled == [req] and req.output_token_ids == [5] and req.first_token_time is not None
    assert req.status is RequestStatus.RUNNING and sched.block_manager.num_free_blocks == 14
    first_token_time = req.first_token_time
    _, sampled = step(sched, next_token=42)
    assert sampled == [req] and req.output_token_ids == [5, 42]
    assert req.finish_reason == "stop" and req.stop_reason == 42
    assert req.first_token_time == first_token_time
    assert not sched.running and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 16


def test_eos_stops_unless_ignore_eos() -> None:
    sched = make_scheduler()
    stops = make_request("stops", 3, max_tokens=10)
    ignores = make_request("ignores", 3, max_tokens=3, base=40, ignore_eos=True)
    sched.add(stops)
    sched.add(ignores)
    step(sched, next_token=EOS)
    assert stops.finish_reason == "stop" and stops.stop_reason is None
    assert ignores.status is RequestStatus.RUNNING
    run_to_completion(sched)
    assert ignores.finish_reason == "length" and ignores.num_output_tokens == 3


def test_max_tokens_finishes_with_length() -> None:
    sched = make_scheduler(num_blocks=16)
    req = make_request("r", 5, max_tokens=3)
    sched.add(req)
    for _ in range(2):
        step(sched)
        assert req.status is RequestStatus.RUNNING
    _, sampled = step(sched)
    assert sampled == [req] and req.num_output_tokens == 3
    assert req.finish_reason == "length" and req.stop_reason is None
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 16


def test_max_model_len_finishes_with_length() -> None:
    sched = make_scheduler(max_model_len=7)
    req = make_request("r", 5, max_tokens=10)
    sched.add(req)
    run_to_completion(sched)
    assert req.finish_reason == "length" and req.num_tokens == 7


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    sched = make_scheduler()
    req = make_request("r", 4, max_tokens=10, min_tokens=3, stop_token_ids=[42])
    sched.add(req)
    step(sched, next_token=EOS)
    step(sched, next_token=42)
    assert req.status is RequestStatus.RUNNING and req.output_token_ids == [EOS, 42]
    step(sched, next_token=EOS)  # the third token may stop
    assert req.finish_reason == "stop" and req.num_output_tokens == 3


def test_chunked_prefill_samples_only_at_its_last_chunk() -> None:
    sched = make_scheduler(budget=8)
    req = make_request("r", 20, max_tokens=4)
    sched.add(req)
    chunks = []
    while not req.output_token_ids:
        out = sched.schedule()
        (s,) = out.scheduled
        chunks.append((s.num_new_tokens, s.completes_sequence))
        sampled = advance(sched, out)
        # The decision was made at schedule time: applying the step does not change it.
        assert s.completes_sequence == bool(sampled)
    assert chunks == [(8, False), (8, False), (4, True)]
    assert req.num_computed_tokens == 20 and req.output_token_ids == [5]


def test_update_refuses_a_token_count_that_does_not_match_the_schedule() -> None:
    sched = make_scheduler(budget=8)
    req = make_request("r", 20)
    sched.add(req)
    out = sched.schedule()  # a partial prefill: nothing samples
    with pytest.raises(AssertionError):  # an engine bug, not a client error
        sched.update(out, [5])
    assert req.num_computed_tokens == 0  # refused before anything changed


def test_preempted_requests_are_not_updated() -> None:
    # 4 blocks of 4: a and b fill them; a's next decode needs a fifth, so b is preempted.
    sched = make_scheduler(num_blocks=4, budget=64)
    a = make_request("a", 8, max_tokens=6)
    b = make_request("b", 7, max_tokens=6, base=40)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled: a holds 8 tokens + 1 sampled, b 7 + 1
    out, sampled = step(sched)
    assert out.preempted == [b] and [s.request for s in out.scheduled] == [a]
    assert sampled == [a] and a.num_output_tokens == 2
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [5] and sched.waiting[0] is b
    run_to_completion(sched)
    assert a.num_output_tokens == b.num_output_tokens == 6
    assert sched.block_manager.num_free_blocks == 4


def test_finished_blocks_are_cached_for_the_next_prompt() -> None:
    sched = make_scheduler(budget=64)
    a = make_request("a", 9, max_tokens=4)
    sched.add(a)
    run_to_completion(sched)
    # 9 prompt + 3 fed-back outputs computed (the last sampled token never is): 3 full blocks.
    b = Request("b", a.token_ids + [7], SamplingParams(max_tokens=1), HASHER, 1)
    sched.add(b)
    sched.schedule()
    assert b.num_cached_tokens == 12


def test_the_cpu_step_budget_defaults_to_256_tokens_and_never_below_max_num_seqs(
    monkeypatch,
) -> None:
    from services.engine import config
    from services.engine.config import EngineConfig

    monkeypatch.setattr(config, "has_amx", lambda: False)  # AMX: test_cpus_with_amx_...
    assert EngineConfig(device="cpu").max_num_batched_tokens == 256
    assert EngineConfig(device="cpu", max_num_seqs=512).max_num_batched_tokens == 512
    monkeypatch.setattr(config, "has_amx", lambda: True)
    assert EngineConfig(device="cpu", max_num_seqs=4096).max_num_batched_tokens == 4096
    assert EngineConfig(device="cpu", max_num_batched_tokens=2048).max_num_batched_tokens == 2048
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(device="cpu", max_num_batched_tokens=0)


@pytest.mark.parametrize("amx", [False, True])
def test_cpus_with_amx_take_longer_steps(monkeypatch, amx: bool) -> None:
    """oneDNN's AMX products reach their full rate from ~2k rows: bf16 steps on AMX default to
    2,048 tokens, fp32 ones there to 1,024; without AMX both keep 256."""
    from services.engine import config

    monkeypatch.setattr(config, "has_amx", lambda: amx)
    bf16 = config.EngineConfig(device="cpu", dtype="bfloat16").max_num_batched_tokens
    assert bf16 == (2048 if amx else 256)
    assert config.EngineConfig(device="cpu", dtype="float32").max_num_batched_tokens == (
        1024 if amx else 256)
