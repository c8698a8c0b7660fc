"""The shared flow control (services.common.flow_control) in process, against a load source the
test sets: saturation from the engines' reports, strict bands, tenants taking turns, shedding
within ``shed_after_s``, bounded queues and metric labels."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from services.common.flow_control import (
    BoundedLabels,
    EngineLoad,
    FlowConfig,
    FlowController,
    FlowMetrics,
    Shed,
    headroom,
)

POLL = 0.005


class Engines:
    """A model's engines whose reported load the test sets; ``free`` places open one by one."""

    def __init__(self, waiting: int) -> None:
        self.loads = [EngineLoad(waiting=waiting, pending=0, kv_usage=0.1)]
        self.reads = 0

    async def __call__(self, model: str) -> list[EngineLoad]:
        self.reads += 1
        return self.loads

    def set_waiting(self, waiting: int) -> None:
        self.loads = [EngineLoad(waiting=waiting, pending=0, kv_usage=0.1)]


def _controller(engines: Engines, **cfg: object) -> FlowController:
    config = FlowConfig(enabled=True, queue_depth=1, poll_s=POLL, **cfg)  # type: ignore[arg-type]
    return FlowController(config, engines, FlowMetrics(CollectorRegistry(), "test"))


async def _release_one_by_one(flow: FlowController, engines: Engines, n: int) -> None:
    """Opens one place, waits for it to be taken (the queue shrinks), closes it again."""
    for _ in range(n):
        before = flow.queued("m")
        engines.set_waiting(0)
        while flow.queued("m") == before:
            await asyncio.sleep(POLL / 2)
        engines.set_waiting(1)
        await asyncio.sleep(POLL * 2)  # the snapshot that saw the place is gone


def test_headroom_counts_waiting_pending_and_kv() -> None:
    cfg = FlowConfig(queue_depth=3, kv_usage=0.9)
    assert headroom([], cfg) is None
    assert headroom([EngineLoad(1, 1, 0.5), EngineLoad(0, 0, 0.95)], cfg) == 1
    assert headroom([EngineLoad(5, 0, 0.1)], cfg) == 0


def test_unsaturated_requests_pass_at_once_and_a_burst_takes_only_the_headroom() -> None:
    async def run() -> None:
        engines = Engines(waiting=0)
        flow = _controller(engines, max_queued=100)
        flow.cfg = FlowConfig(enabled=True, queue_depth=3, poll_s=10.0)  # one snapshot
        tasks = [asyncio.create_task(flow.admit("m", "t", 0)) for _ in range(5)]
        await asyncio.sleep(0.05)
        assert sum(t.done() for t in tasks) == 3  # one snapshot's 3 places, not 5
        assert engines.reads == 1  # concurrent arrivals share one read
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert flow.queued("m") == 0  # cancelled waiters leave the queue

    asyncio.run(run())


def test_bands_are_strict_and_tenants_take_turns_in_a_band() -> None:
    async def run() -> None:
        engines = Engines(waiting=1)  # saturated
        flow = _controller(engines)
        order: list[str] = []

        async def client(name: str, tenant: str, priority: int) -> None:
            await flow.admit("m", tenant, priority)
            order.append(name)

        tasks = []
        # Tenant "big" queues 6 requests before "small" queues 2; one urgent request comes last.
        for i in range(6):
            tasks.append(asyncio.create_task(client(f"big{i}", "big", 1)))
        for i in range(2):
            tasks.append(asyncio.create_task(client(f"small{i}", "small", 1)))
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(client("urgent", "small", 0)))
        await asyncio.sleep(0.01)
        # More urgent than all that waits: not held (the engines' priority scheduling puts it
        # first); a second of its band waits its turn, ahead of the lower band.
        assert order == ["urgent"] and flow.queued("m") == 8
        tasks.append(asyncio.create_task(client("urgent2", "small", 0)))
        await asyncio.sleep(0.01)
        assert flow.queued("m") == 9
        await _release_one_by_one(flow, engines, 9)
        await asyncio.gather(*tasks)
        assert order[:2] == ["urgent", "urgent2"]  # a lower band always first
        assert order[2:6] == ["big0", "small0", "big1", "small1"]  # turns, not arrival order
        assert order[6:] == ["big2", "big3", "big4", "big5"]

    asyncio.run(run())


def test_a_sheddable_request_is_refused_within_shed_after_s_others_wait() -> None:
    async def run() -> None:
        engines = Engines(waiting=1)
        flow = _controller(engines, sheddable_priority=1, shed_after_s=0.2)
        patient = asyncio.create_task(flow.admit("m", "t", 0))
        await asyncio.sleep(0.01)  # it waits first (else, more urgent than all, it would pass)
        start = time.monotonic()
        with pytest.raises(Shed) as shed:
            await flow.admit("m", "t", 5)
        assert 0.2 <= time.monotonic() - start < 1.0
        assert shed.value.retry_after >= 1
        assert not patient.done()  # non-sheddable: still waiting, not refused
        engines.set_waiting(0)
        await asyncio.wait_for(patient, 1.0)

    asyncio.run(run())


def test_queues_are_bounded_per_model_and_per_tenant() -> None:
    async def run() -> None:
        engines = Engines(waiting=1)
        flow = _controller(engines, max_queued=3, max_queued_per_tenant=2)
        tasks = [asyncio.create_task(flow.admit("m", "a", 0)) for _ in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(Shed, match="API key"):
            await flow.admit("m", "a", 0)
        tasks.append(asyncio.create_task(flow.admit("m", "b", 0)))
        await asyncio.sleep(0.01)
        with pytest.raises(Shed, match="3 requests"):
            await flow.admit("m", "c", 0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert flow.queued("m") == 0

    asyncio.run(run())


def test_an_unknown_load_or_no_engine_holds_nothing() -> None:
    async def run() -> None:
        async def broken(model: str) -> list[EngineLoad]:
            raise ConnectionError("router down")

        async def none(model: str) -> list[EngineLoad]:
            return []

        for source in (broken, none):
            flow = FlowController(FlowConfig(enabled=True), source,
                                  FlowMetrics(CollectorRegistry(), "test"))
            await asyncio.wait_for(flow.admit("m", "t", 0), 1.0)

    asyncio.run(run())


def test_metric_labels_are_bounded() -> None:
    labels = BoundedLabels(limit=2)
    assert [labels(v) for v in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]


def test_a_finished_request_frees_its_place_before_the_next_report() -> None:
    """The engines' reports lag a request's end: while others wait, ``finished`` hands its
    place on at once (for ``credit_s``); with nobody waiting it is a no-op, and the bands in
    flight are forgotten at zero (memory follows what is in flight, not every band seen)."""
    async def run() -> None:
        engines = Engines(waiting=0)
        flow = _controller(engines, credit_s=0.5)
        await flow.admit("m", "a", 1)  # through (room), now in flight
        engines.set_waiting(1)  # saturated, and the reports stay so
        await asyncio.sleep(POLL * 2)
        waiter = asyncio.create_task(flow.admit("m", "b", 1))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # held: the reports say saturated
        flow.finished("m", 1)
        await asyncio.wait_for(waiter, 0.5)  # the freed place, not a report
        extra = asyncio.create_task(flow.admit("m", "c", 1))
        await asyncio.sleep(0.05)
        assert not extra.done()  # one end, one place
        flow.finished("m", 1)
        await asyncio.wait_for(extra, 0.5)
        for _ in range(2):
            flow.finished("m", 1)
        assert flow._models["m"].in_flight == {}
        for p in range(100):  # a client's many distinct priorities leave nothing behind
            engines.set_waiting(0)
            await asyncio.sleep(POLL * 2)
            await flow.admit("m", "a", p)
            flow.finished("m", p)
        assert flow._models["m"].in_flight == {}

    asyncio.run(run())


def test_the_most_urgent_request_of_this_door_is_not_held() -> None:
    async def run() -> None:
        engines = Engines(waiting=1)  # saturated by others: nothing of this door's in flight
        flow = _controller(engines)
        alone = asyncio.create_task(flow.admit("m", "a", 0))
        await asyncio.sleep(0.05)
        assert not alone.done()  # held: nothing of ours to pass
        engines.set_waiting(0)
        await asyncio.wait_for(alone, 0.5)
        engines.set_waiting(1)
        await asyncio.sleep(POLL * 2)
        await asyncio.wait_for(flow.admit("m", "a", -1), 0.05)  # more urgent than p0 in flight
        same = asyncio.create_task(flow.admit("m", "b", 0))  # not more urgent than -1
        await asyncio.sleep(0.05)
        assert not same.done()
        same.cancel()
        await asyncio.gather(same, return_exceptions=True)

    asyncio.run(run())
