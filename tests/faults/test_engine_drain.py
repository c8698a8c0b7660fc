"""SIGTERM to an engine under load: it leaves the routing set first, lets its in-flight
requests finish, and exits within its grace period; a request that would outlive the grace
period is cut at the deadline (its stream ends with an error event, it does not hang)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aiohttp

from services.protocol.engine_api import (
    GENERATE_PATH,
    FinishedFrame,
    FrameDecoder,
    GenerateRequest,
)
from services.protocol.sampling_params import SamplingParams
from tests.faults.helpers import router_engines, wait_for
from tests.faults.load import LoadResult, run_load, word_prompt
from tests.support.services import internal_headers
from tests.support.stack import PagodaStack

DRAIN_S = 4.0


def test_engine_sigterm_drains_under_load(fast_model_dir: Path) -> None:
    # Both engines decode at under 20 steps/s: the victim's requests are still streaming when
    # the gateway notices it left the routing set, and the load spreads over both engines.
    slow = ["--debug-step-delay-s", "0.05"]
    drain_args = ["--shutdown-timeout", str(DRAIN_S), *slow]
    with PagodaStack(fast_model_dir, engines=2, engine_args=[drain_args, slow]) as stack:
        router = stack.routers[0].url
        victim = stack.engine_id(0)
        wait_for(lambda: len(router_engines(router)) == 2, 10, "both engines")
        proc = stack.engines[0].proc
        result = LoadResult()
        long: list[str] = []  # about 150 s of decoding: far longer than the grace period
        medium: list[str] = []  # about 2.4 s, started 0.5 s before SIGTERM: must finish
        marks: dict[str, float] = {}

        async def direct(name: str, max_tokens: int, delay_s: float, out: list[str]) -> None:
            """One request straight to the victim's internal API; records how it ended."""
            await asyncio.sleep(delay_s)
            req = GenerateRequest(name, list(range(100, 120)),
                                  SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            dec, frames = FrameDecoder(), []
            try:
                async with aiohttp.ClientSession(headers=internal_headers()) as s, s.post(
                        stack.engines[0].url + GENERATE_PATH, data=req.to_msgpack()) as r:
                    async for chunk in r.content.iter_any():
                        frames.extend(dec.feed(chunk))
                out.append("finished" if frames and isinstance(frames[-1], FinishedFrame)
                           else "cut")
            except aiohttp.ClientError:
                out.append("cut")

        async def sigterm_later() -> None:
            await asyncio.sleep(2.0)
            marks["term"] = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            while victim in await asyncio.to_thread(router_engines, router):
                await asyncio.sleep(0.02)
            marks["left"] = time.monotonic()
            await asyncio.to_thread(proc.wait, DRAIN_S + 10)
            marks["exited"] = time.monotonic()

        async def scenario() -> None:
            await asyncio.gather(
                run_load(stack.base_url, stack.model, lambda i: word_prompt(i, 30),
                         duration_s=6.0, concurrency=8, max_tokens=48, result=result),
                direct("too-long", 3000, 0.0, long),
                direct("medium", 48, 1.5, medium),
                sigterm_later(),
            )

        asyncio.run(scenario())
        t = marks["term"]
        in_flight = result.in_flight_on(victim, t)
        left_s, exit_s = marks["left"] - t, marks["exited"] - t
        print(f"\nengine drain: {result.summary()} in_flight_on_victim_at_sigterm={in_flight} "
              f"left_routing_after={left_s:.2f}s exited_after={exit_s:.2f}s "
              f"request_running_at_sigterm={medium} request_longer_than_the_grace_period={long}")

        assert not result.failed, result.summary()  # drained, and new requests went elsewhere
        assert medium == ["finished"]  # it was streaming at SIGTERM and was drained
        assert left_s < 1.0
        # Half a second of late arrivals after leaving, the grace period, then the exit (the
        # process's own teardown: 4.2 s on the slowest kind of 2-core machine, AVX2 only).
        assert exit_s < DRAIN_S + 5.0
        late = [o for o in result.outcomes if o.started > t + 0.5]
        assert late and {o.engine for o in late} == {stack.engine_id(1)}
        assert long == ["cut"]  # ended at the deadline: neither finished nor left hanging
