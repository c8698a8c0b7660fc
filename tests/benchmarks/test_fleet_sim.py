"""Smoke tests of the fleet simulator (benchmarks/fleet_sim): a toy trace on 4 engines."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from benchmarks.fleet_sim import (
    CostModel,
    EngineSpec,
    OracleRouting,
    RedisRouting,
    SimConfig,
    SimEngine,
    Simulation,
    TraceConfig,
    make_trace,
)
from benchmarks.fleet_sim.trace import MODEL, Session, Turn
from services.protocol.block_hash import BlockHasher
from tests.support.redis_server import RedisServer

ENGINES = 4
TOY = TraceConfig(
    duration_s=10.0,
    requests_per_engine_s=2.0,
    agent_tenants=4,
    chat_prompts=2,
    rag_documents=4,
    length_scale=0.5,
    seed=1,
)
SMALL = SimConfig(spec=EngineSpec(num_blocks=1024))


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


def _run(trace, routing, config=SMALL):
    async def go():
        try:
            return await Simulation(trace, ENGINES, routing, config).run()
        finally:
            await routing.close()

    return asyncio.run(go())


def test_prefix_beats_round_robin_on_hit_rate(redis_url: str) -> None:
    trace = make_trace(TOY, ENGINES)
    assert 40 <= trace.num_requests <= 200
    prefix = _run(trace, RedisRouting(redis_url, "prefix", "t-prefix"))
    rr = _run(trace, RedisRouting(redis_url, "round-robin", "t-rr"))
    oracle = _run(trace, OracleRouting())
    for r in (prefix, rr, oracle):
        assert r.requests == trace.num_requests
        assert sum(r.served) == trace.num_requests
        assert 0.0 <= r.hit_rate < 1.0 and r.ttft_mean_s > 0
    assert prefix.hit_rate > rr.hit_rate + 0.1
    assert prefix.by_kind["agent"].ttft_mean_s < rr.by_kind["agent"].ttft_mean_s
    assert oracle.hit_rate > rr.hit_rate
    assert prefix.reasons.get("prefix-hit", 0) > 0 and rr.reasons == {"round-robin": len(rr.ttfts)}


def test_same_trace_same_result(redis_url: str) -> None:
    """The simulation is deterministic: the same trace gives the same figures."""
    trace = make_trace(TraceConfig(duration_s=4.0, length_scale=0.3, seed=2), ENGINES)
    a = _run(trace, OracleRouting())
    b = _run(trace, OracleRouting())
    assert (a.hit_rate, a.ttfts, a.served) == (b.hit_rate, b.ttfts, b.served)


def test_engine_model_reuses_the_prefix_cache() -> None:
    """A second turn that extends the first is mostly served from the cache, so its prefill
    (and TTFT) is shorter, and the cost model's arithmetic holds for a lone request."""
    trace = make_trace(TraceConfig(duration_s=1.0, seed=3), 1)
    tokens = list(range(1000, 1000 + 64 * 16))
    hashes = BlockHasher(MODEL, 16).chain(tokens)
    turns = [Turn(600, 10, 0.0), Turn(1000, 10, 0.5)]
    trace.sessions = [Session(0, "agent", 0.0, tokens, hashes, turns)]
    cost = CostModel(step_overhead_s=0.01, prefill_s_per_token=0.001, decode_s_per_seq=0.0)
    config = SimConfig(spec=EngineSpec(num_blocks=256), cost=cost)

    async def go():
        sim = Simulation(trace, 1, OracleRouting(), config)
        await sim.run()
        return sim.requests

    first, second = asyncio.run(go())
    assert first.cached_tokens == 0
    # 600 prompt tokens in one 2048-token step: 0.01 + 0.6 s to the first token.
    assert first.ttft_s == pytest.approx(0.61)
    # The first turn's prompt and output (609 computed tokens: 38 full blocks) are cached.
    assert second.cached_tokens == 38 * 16
    assert second.ttft_s == pytest.approx(0.01 + (1000 - 608) * 0.001)


def _one_engine(trace, spec: EngineSpec):
    async def go():
        sim = Simulation(trace, 1, OracleRouting(), SimConfig(spec=spec))
        result = await sim.run()
        return sim, result

    return asyncio.run(go())


TIGHT = TraceConfig(duration_s=2.0, requests_per_engine_s=20.0, length_scale=0.3, seed=4)
TIGHT_SPEC = EngineSpec(num_blocks=160, max_num_batched_tokens=256)


def test_engine_model_is_the_real_scheduler() -> None:
    """A KV pool too small for the load: the real scheduler chunks prefills and preempts, and
    every request still finishes with its whole output, leaving no block held."""
    trace = make_trace(TIGHT, 1)
    sim, result = _one_engine(trace, TIGHT_SPEC)
    (engine,) = sim.engines
    assert result.requests == trace.num_requests == engine.stats.served
    assert engine.scheduler.num_preemptions > 0
    assert not engine.scheduler.has_unfinished() and engine.bm.num_free_blocks == 160
    assert all(r.finish_s >= r.first_token_s > r.arrival_s for r in sim.requests)


def test_fused_decode_steps_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode-only steps run as one event give the timings of running them one by one, even
    with preemptions around them."""
    trace = make_trace(TIGHT, 1)
    events: list[int] = []
    end_step = SimEngine._end_step

    def counted(self: SimEngine, version: int) -> None:
        events.append(version)
        end_step(self, version)

    monkeypatch.setattr(SimEngine, "_end_step", counted)
    fused_sim, fused = _one_engine(trace, TIGHT_SPEC)
    num_fused_events = len(events)
    monkeypatch.setattr(SimEngine, "_fusable", lambda self, out: 1)
    stepped_sim, stepped = _one_engine(trace, TIGHT_SPEC)
    assert num_fused_events < len(events) - num_fused_events  # fusing did happen
    (a,), (b,) = fused_sim.engines, stepped_sim.engines
    assert a.stats.steps == b.stats.steps
    assert a.scheduler.num_preemptions == b.scheduler.num_preemptions > 0
    assert fused.ttfts == pytest.approx(stepped.ttfts)
    finishes = [r.finish_s for r in fused_sim.requests]
    assert finishes == pytest.approx([r.finish_s for r in stepped_sim.requests])
    assert fused.hit_rate == stepped.hit_rate
