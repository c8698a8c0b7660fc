"""A slow engine (every step delayed) gets less traffic: the load it reports steers routing.

Both engines serve the same model; one sleeps 100 ms before each step (``--debug-step-delay-s``).
Prompts share no prefix, so only load decides.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.faults.helpers import router_engines, wait_for
from tests.faults.load import run_load, word_prompt
from tests.support.stack import PagodaStack


def test_slow_engine_is_steered_away(fast_model_dir: Path) -> None:
    with PagodaStack(fast_model_dir, engines=2,
                     engine_args=[[], ["--debug-step-delay-s", "0.1"]]) as stack:
        wait_for(lambda: len(router_engines(stack.routers[0].url)) == 2, 10, "both engines")
        fast, slow = stack.engine_id(0), stack.engine_id(1)
        result = asyncio.run(run_load(stack.base_url, stack.model,
                                      lambda i: word_prompt(70_000 + i, 30), duration_s=6.0,
                                      concurrency=8, max_tokens=16))
        served = result.by_engine()
        print(f"\nslow engine: {result.summary()} fast_share={served[fast] / result.sent:.0%}")
        assert result.succeeded == result.sent, result.summary()
        # Round-robin would give each half. The heartbeats carry queue length and step time,
        # so the router sees the slow engine as busy even when its queue is short.
        assert served[fast] >= 0.85 * result.sent, served
        assert served[fast] + served[slow] == result.sent
