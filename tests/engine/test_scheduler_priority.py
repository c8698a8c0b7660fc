"""``--scheduling-policy priority`` against vLLM v1's semantics (``v1/core/sched``): waiting
requests run by (priority, arrival) (a lower value first), preemption takes the running
request with the largest (priority, arrival), and a preempted request returns at its rank."""

from __future__ import annotations

from services.engine.block_manager import BlockManager
from services.engine.request import Request
from services.engine.scheduler import Scheduler, SchedulingPolicy
from tests.engine.test_scheduler import BS, advance, make_request


def _sched(num_blocks: int = 64, max_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_seqs, budget, 1024,
                     policy=SchedulingPolicy.PRIORITY)


def _req(rid: str, priority: int, arrival: float, prompt_len: int = 4,
         max_tokens: int = 8) -> Request:
    req = make_request(rid, prompt_len, max_tokens=max_tokens, base=hash(rid) % 50)
    req.priority, req.arrival_time = priority, arrival
    return req


def _admitted(sched: Scheduler) -> list[str]:
    return [s.request.request_id for s in sched.schedule().scheduled]


def test_waiting_requests_run_lowest_value_first_ties_by_arrival() -> None:
    sched = _sched(max_seqs=1)
    for rid, prio, t in [("late-1", 1, 3.0), ("early-1", 1, 1.0), ("urgent", -5, 4.0),
                         ("zero", 0, 2.0)]:
        sched.add(_req(rid, prio, t, max_tokens=1))
    order = []
    while sched.has_unfinished():
        out = sched.schedule()
        order += [s.request.request_id for s in out.scheduled if s.start == 0]
        advance(sched, out)
    assert order == ["urgent", "zero", "early-1", "late-1"]


def test_preemption_takes_the_least_urgent_latest_running_request() -> None:
    # 3 requests of 4 prompt tokens fill 3 of 4 blocks; decoding, each needs a second block:
    # the pool runs out and vLLM preempts max(running, key=(priority, arrival)).
    sched = _sched(num_blocks=4)
    # Admitted in this order, so FCFS would take p2-early (the newest admission).
    reqs = [_req("p2-late", 2, 2.0), _req("p0-late", 0, 3.0), _req("p2-early", 2, 1.0)]
    for r in reqs:
        sched.add(r)
    advance(sched, sched.schedule())  # all prefilled (3 blocks), one token each
    out = sched.schedule()  # each needs a 2nd block: 1 free -> preempt
    assert [r.request_id for r in out.preempted] == ["p2-late"]
    # The preempted request is back in the queue at its rank, not at a front.
    sched.add(_req("p1", 1, 9.0))
    assert [r.request_id for r in sched.waiting] == ["p1", "p2-late"]


def test_the_request_asking_is_the_victim_when_it_is_the_least_urgent() -> None:
    sched = _sched(num_blocks=2)
    urgent, lazy = _req("urgent", 0, 2.0), _req("lazy", 3, 1.0)
    sched.add(lazy)
    sched.add(urgent)
    advance(sched, sched.schedule())
    out = sched.schedule()
    assert [r.request_id for r in out.preempted] == ["lazy"]
    assert [s.request.request_id for s in out.scheduled] == ["urgent"]
