"""Autoscaling on the real stack (Redis, tiny-model engines, router, gateway: real processes).

- The router's demand metric tracks reality: through a bounded step load its in-flight count
  equals the engines' running + waiting, within one, at every scrape.
- On a prefill-heavy load (long prompts, max_tokens 1) a controller applying the HPA formula to
  the router's queue asks for a scale-up within 3 polls, where the same formula on KV-cache
  usage does not (usage stays low while requests queue).
- Scale-in under load: SIGTERM to an engine with 4 streams in flight: all 4 end with [DONE] and
  their full text, the engine leaves the routing set at once and no request routed after that
  reaches it, and no client sees an error.
- Scale from zero: with no engine, 8 requests are held by the gateway (and counted by the
  router) and all succeed once an engine starts 10 s later; a burst past the hold's bound gets
  429 with Retry-After.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from services.gateway.admission import RETRY_AFTER_S
from tests.faults.helpers import router_engines, router_idle, wait_for
from tests.faults.load import LoadResult, Outcome, run_load, stream_completion, word_prompt
from tests.support.hpa import AverageValuePolicy
from tests.support.stack import PagodaStack, scrape

POLL_S = 0.5  # the controller's polling interval
QUEUE_POLICY = AverageValuePolicy("router queue", target=4.0)  # the chart's keda.threshold
KV_POLICY = AverageValuePolicy("KV usage", target=0.8)  # 80% of the KV cache per replica
# Inline engine cores: one interpreter per engine, so the stack starts in less time.
ENGINE_ARGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "512",
               "--debug-step-delay-s", "0.03", "--shutdown-timeout", "15",
               "--engine-core", "inline"]


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    router_in_flight: float
    router_waiting: float
    engines_running: float
    engines_waiting: float
    kv_usage: float  # summed over the engines

    @property
    def engines_in_flight(self) -> float:
        return self.engines_running + self.engines_waiting


def sample(stack: PagodaStack) -> Sample:
    """The router's demand gauges, then every engine's own counts, as close together as two
    HTTP scrapes allow."""
    at = time.monotonic()
    router = scrape(stack.routers[0].url)
    engines = [scrape(e.url) for e in stack.engines if e.proc.poll() is None]
    label = f'{{model="{stack.model}"}}'
    return Sample(
        at,
        router.get("pagoda_router_requests_in_flight" + label, 0.0),
        router.get("pagoda_router_requests_waiting" + label, 0.0),
        sum(m["vllm:num_requests_running"] for m in engines),
        sum(m["vllm:num_requests_waiting"] for m in engines),
        sum(m["vllm:kv_cache_usage_perc"] for m in engines),
    )


@pytest.fixture(scope="module")
def two_engines(fast_model_dir: Path) -> Iterator[PagodaStack]:
    """One stack for the module (starting engines is what costs): two engines, a gateway that
    holds up to 8 requests for 150 s (a bound, not a wait: an engine starts in seconds on an idle
    machine, in a minute on a crowded one) when no engine is ready. The tests run in file order: the
    scale-in stops one engine, scale-from-zero stops the other and starts one again."""
    with PagodaStack(fast_model_dir, engines=2, num_blocks=1024,
                     engine_args=[ENGINE_ARGS, ENGINE_ARGS],
                     gateway_args=["--engine-wait-timeout", "150",
                                   "--engine-wait-max-requests", "8"]) as stack:
        wait_for(lambda: len(router_engines(stack.routers[0].url)) == 2, 10, "both engines")
        yield stack


def test_router_queue_tracks_the_engines_and_leads_a_prefill_heavy_scale_up(
    two_engines: PagodaStack,
) -> None:
    stack = two_engines
    step = asyncio.run(_step_load(stack))
    worst = max(abs(s.router_in_flight - s.engines_in_flight) for s in step)
    peak = max(s.engines_in_flight for s in step)
    print(f"\nstep load: {len(step)} scrapes, peak in flight {peak:.0f} (waiting "
          f"{max(s.engines_waiting for s in step):.0f}), worst |router - engines| = {worst:.0f}")
    assert peak >= 9  # the step was reached...
    assert max(s.engines_waiting for s in step) >= 1  # ...with requests queued at the engines
    assert worst <= 1, [(round(s.at - step[0].at, 2), s.router_in_flight, s.engines_in_flight)
                        for s in step if abs(s.router_in_flight - s.engines_in_flight) > 1]

    wait_for(lambda: router_idle(stack.routers[0].url), 10, "the router sees no load")
    polls, result = asyncio.run(_prefill_heavy(stack))
    queue_up = [QUEUE_POLICY.wants_more(2, p.router_waiting) for p in polls]
    kv_up = [KV_POLICY.wants_more(2, p.kv_usage) for p in polls]
    print(f"prefill-heavy load: {result.summary()}\n  poll  router_waiting  kv_usage(sum)"
          f"  queue->replicas  kv->replicas")
    for i, p in enumerate(polls, 1):
        print(f"  {i:4d}  {p.router_waiting:14.0f}  {p.kv_usage:13.3f}  "
              f"{QUEUE_POLICY.desired(2, p.router_waiting):15d}  "
              f"{KV_POLICY.desired(2, p.kv_usage):12d}")
    assert not result.failed, result.summary()
    assert True in queue_up[:3], "the queue policy did not ask for more engines within 3 polls"
    assert not any(kv_up), "the KV-usage policy asked for more engines"


async def _step_load(stack: PagodaStack) -> list[Sample]:
    """10 streams, one every 0.2 s (a step to 10 in flight on 8 running slots), each ~3 s;
    scraped every 0.1 s until they have all ended."""
    samples: list[Sample] = []
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> Outcome:
            await asyncio.sleep(0.2 * i)
            return await stream_completion(session, stack.base_url, stack.model,
                                           word_prompt(i, 8), max_tokens=80)

        tasks = [asyncio.create_task(one(i)) for i in range(10)]
        while not all(t.done() for t in tasks):
            samples.append(await asyncio.to_thread(sample, stack))
            await asyncio.sleep(0.1)
        outcomes = [t.result() for t in tasks]
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    samples.append(await asyncio.to_thread(sample, stack))
    return samples


async def _prefill_heavy(stack: PagodaStack) -> tuple[list[Sample], LoadResult]:
    """16 clients sending ~700-token prompts for one token each; the controller polls every
    POLL_S from the start."""
    result = LoadResult()
    polls: list[Sample] = []

    async def controller() -> None:
        for _ in range(8):
            await asyncio.sleep(POLL_S)
            polls.append(await asyncio.to_thread(sample, stack))

    await asyncio.gather(
        run_load(stack.base_url, stack.model, lambda i: word_prompt(1000 + i, 700),
                 duration_s=8 * POLL_S + 0.5, concurrency=16, max_tokens=1, result=result),
        controller(),
    )
    return polls, result


def test_scale_in_under_load_loses_no_generation(two_engines: PagodaStack) -> None:
    stack = two_engines
    router = stack.routers[0].url
    wait_for(lambda: router_idle(router), 10, "the router sees no load")
    retries_before = _engine_retries(stack)
    prefix = word_prompt(7, 120)  # a shared prefix of several blocks
    marks: dict[str, float] = {}

    async def scenario() -> tuple[str, list[Outcome], LoadResult]:
        async with aiohttp.ClientSession() as session:
            warm = await stream_completion(session, stack.base_url, stack.model,
                                           prefix + " warm", max_tokens=1)
            assert warm.ok, warm.error
            victim = warm.engine
            await asyncio.sleep(0.5)  # its KV events reach the index with the next heartbeat
            watched = [Outcome(started=0.0) for _ in range(4)]
            streams = [asyncio.create_task(stream_completion(
                session, stack.base_url, stack.model, f"{prefix} tail{i}", max_tokens=60,
                outcome=o)) for i, o in enumerate(watched)]
            proc = stack.engines[int(victim.rsplit("-", 1)[1])].proc
            after = LoadResult()
            while not all(o.streaming_at for o in watched):  # each has its first token
                assert not any(t.done() for t in streams), "a stream ended before SIGTERM"
                await asyncio.sleep(0.01)
            marks["term"] = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            load = asyncio.create_task(run_load(
                stack.base_url, stack.model, lambda i: word_prompt(300 + i, 6),
                duration_s=2.5, concurrency=2, max_tokens=4, result=after))
            while victim in await asyncio.to_thread(router_engines, router):
                await asyncio.sleep(0.01)
            marks["left"] = time.monotonic()
            outcomes = await asyncio.gather(*streams)
            await load
            await asyncio.to_thread(proc.wait, 20)
            marks["exited"] = time.monotonic()
            return victim, outcomes, after

    victim, streams, after = asyncio.run(scenario())
    t = marks["term"]
    left_s, exit_s = marks["left"] - t, marks["exited"] - t
    retries = _engine_retries(stack) - retries_before
    late = [o for o in after.outcomes if o.started >= marks["left"]]
    ends = [(o.engine, o.completion_tokens, o.finish_reason) for o in streams]
    print(f"\nscale-in: victim={victim} streams={ends} left_routing_after={left_s:.2f}s "
          f"exited_after={exit_s:.2f}s load_after_sigterm: {after.summary()} "
          f"gateway_retries={retries:.0f}")
    for o in streams:  # all 4 streamed on the victim and finished in full
        assert o.engine == victim and o.ok, o.error
        assert o.completion_tokens == 60 and o.finish_reason == "length" and o.text
    assert left_s < 1.0
    assert not after.failed, after.summary()  # zero client errors
    assert late and all(o.engine != victim for o in late)  # nothing new reached it...
    assert retries == 0  # ...not even a request refused and sent elsewhere
    assert exit_s < 15.0


def _engine_retries(stack: PagodaStack) -> float:
    return scrape(stack.gateway.url).get("pagoda_gateway_engine_retries_total", 0.0)


def test_scale_from_zero_holds_requests_until_an_engine_starts(
    two_engines: PagodaStack,
) -> None:
    stack = two_engines
    for engine in stack.engines:  # scaled to zero: SIGTERM, and they leave Redis
        engine.stop()
    wait_for(lambda: not router_engines(stack.routers[0].url), 5, "no engine left")
    figures: dict[str, float] = {}

    async def scenario() -> tuple[list[Outcome], list[tuple[int, str | None, dict]]]:
        async with aiohttp.ClientSession() as session:
            t0 = time.monotonic()
            held = [asyncio.create_task(stream_completion(
                session, stack.base_url, stack.model, word_prompt(i, 10), max_tokens=8,
                timeout_s=180)) for i in range(8)]
            await asyncio.to_thread(wait_for, lambda: _held(stack) == (8, 8), 10,
                                    "8 requests held at the gateway and seen by the router")
            figures["arrival_rate"] = scrape(stack.routers[0].url)[
                f'pagoda_router_arrival_rate{{model="{stack.model}"}}']
            burst = await asyncio.gather(*(_post(session, stack) for _ in range(4)))
            await asyncio.sleep(max(0.0, 10.0 - (time.monotonic() - t0)))
            started = time.monotonic()
            await asyncio.to_thread(stack.restart_engine, 0)  # KEDA's first replica
            ready = time.monotonic()
            figures["engine_start_s"] = ready - started
            outcomes = await asyncio.gather(*held)
            figures["served_after_ready_s"] = max(o.ended for o in outcomes) - ready
            figures["first_request_waited_s"] = outcomes[0].ended - t0
            return outcomes, burst

    outcomes, burst = asyncio.run(scenario())
    print(f"\nscale from zero: { {k: round(v, 2) for k, v in figures.items()} } held: "
          f"{[(o.ok, o.completion_tokens) for o in outcomes]} burst past the bound: "
          f"{[(s, ra) for s, ra, _ in burst]}")
    assert figures["arrival_rate"] > 0  # what wakes KEDA's second trigger
    for status, retry_after, body in burst:  # past the bound: refused, told when to retry
        assert status == 429 and retry_after == str(RETRY_AFTER_S)
        assert body["error"]["type"] == "rate_limit_error"
    assert all(o.ok and o.completion_tokens == 8 for o in outcomes), [o.error for o in outcomes]
    assert _held(stack) == (0, 0)


def _held(stack: PagodaStack) -> tuple[float, float]:
    """(held at the gateway, held as the router counts them)."""
    label = f'{{model="{stack.model}"}}'
    gateway = scrape(stack.gateway.url).get(
        "pagoda_gateway_requests_waiting_for_engine" + label, 0.0)
    router = scrape(stack.routers[0].url).get("pagoda_router_requests_held" + label, 0.0)
    return gateway, router


async def _post(session: aiohttp.ClientSession, stack: PagodaStack) -> tuple[int, str | None,
                                                                              dict]:
    body = {"model": stack.model, "prompt": "one more", "max_tokens": 4}
    async with session.post(f"{stack.base_url}/completions", json=body) as resp:
        return resp.status, resp.headers.get("Retry-After"), await resp.json()
