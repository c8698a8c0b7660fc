"""KV exhaustion on a real engine process: three times more concurrent long requests than the
KV cache holds all finish, through preemption by recompute and queueing; none fails, the engine
stays up, every block is free again afterwards, and preemption never changes a greedy result.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from services.protocol import engine_api
from services.protocol.sampling_params import SamplingParams
from tests.support.services import ServiceProcess, internal_headers

BLOCK_SIZE = 16
NUM_BLOCKS = 64  # 1024 tokens of KV cache
PROMPT_LEN = 64  # 4 blocks
MAX_TOKENS = 192  # 12 more: 16 blocks a request at its full length
HELD = NUM_BLOCKS // ((PROMPT_LEN + MAX_TOKENS) // BLOCK_SIZE)  # 4 requests fit at once
NUM_REQUESTS = 3 * HELD
REFERENCE_SALT = "alone"  # reference runs share no cached block with the storm


@pytest.fixture(scope="module")
def engine(fast_model_dir: Path):
    proc = ServiceProcess(
        "services.engine.serving.server",
        ["--model", str(fast_model_dir), "--num-blocks", str(NUM_BLOCKS),
         "--block-size", str(BLOCK_SIZE)],
        env={"OMP_NUM_THREADS": "1"},
    )
    with proc:
        yield proc


def prompt(i: int) -> list[int]:
    """Distinct prompts (no shared prefix), ids well inside the vocabulary."""
    return [1000 + 97 * i + j for j in range(PROMPT_LEN)]


def body(i: int, salt: str | None = None) -> bytes:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return engine_api.GenerateRequest(f"kv-{i}", prompt(i), params, salt).to_msgpack()


@dataclass
class Outcome:
    status: int
    tokens: list[int] = field(default_factory=list)
    last: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)


async def generate(session: aiohttp.ClientSession, url: str, data: bytes) -> Outcome:
    async with session.post(url + engine_api.GENERATE_PATH, data=data) as r:
        out = Outcome(r.status)
        if r.status != 200:
            out.errors.append(await r.text())
            return out
        dec = engine_api.FrameDecoder()
        async for chunk in r.content.iter_any():
            for frame in dec.feed(chunk):
                if isinstance(frame, engine_api.TokensFrame):
                    out.tokens.extend(frame.token_ids)
                elif isinstance(frame, engine_api.ErrorFrame):
                    out.errors.append(frame.message)
                out.last = frame
    return out


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)$", re.MULTILINE)


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return {m.group(1): float(m.group(2)) for m in _SAMPLE.finditer(text)}


@dataclass
class Watch:
    """What /metrics showed while the storm ran."""

    max_running: float = 0.0
    max_waiting: float = 0.0
    min_free: float = float(NUM_BLOCKS)
    samples: int = 0


async def watch(session: aiohttp.ClientSession, url: str, seen: Watch) -> None:
    while True:
        m = await scrape(session, url)
        seen.samples += 1
        seen.max_running = max(seen.max_running, m["vllm:num_requests_running"])
        seen.max_waiting = max(seen.max_waiting, m["vllm:num_requests_waiting"])
        seen.min_free = min(seen.min_free, m["pagoda:kv_free_blocks"])
        await asyncio.sleep(0.05)


async def wait_idle(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The metrics once nothing runs or waits and every block is free (or the last seen)."""
    deadline = time.monotonic() + 30
    while True:
        m = await scrape(session, url)
        idle = m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
        if (idle and m["pagoda:kv_free_blocks"] == NUM_BLOCKS) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.1)


def test_three_times_the_kv_cache_all_finish(engine: ServiceProcess) -> None:
    async def run() -> tuple[list[Outcome], list[Outcome], Watch, dict, dict, float]:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout, headers=internal_headers()) as session:
            before = await scrape(session, engine.url)
            seen = Watch()
            watcher = asyncio.create_task(watch(session, engine.url, seen))
            start = time.monotonic()
            storm = await asyncio.gather(
                *(generate(session, engine.url, body(i)) for i in range(NUM_REQUESTS))
            )
            wall = time.monotonic() - start
            watcher.cancel()
            after = await wait_idle(session, engine.url)
            # Each alone, one after another: nothing to preempt, no block shared with the storm.
            alone = [
                await generate(session, engine.url, body(i, REFERENCE_SALT))
                for i in range(NUM_REQUESTS)
            ]
            return storm, alone, seen, before, after, wall

    storm, alone, seen, before, after, wall = asyncio.run(run())
    preemptions = after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"]
    print(
        f"\nKV exhaustion: {NUM_REQUESTS} requests of {PROMPT_LEN}+{MAX_TOKENS} tokens "
        f"({(PROMPT_LEN + MAX_TOKENS) // BLOCK_SIZE} blocks each, "
        f"{NUM_REQUESTS * (PROMPT_LEN + MAX_TOKENS) // BLOCK_SIZE} in all) on {NUM_BLOCKS} "
        f"blocks: {preemptions:.0f} preemptions, max running {seen.max_running:.0f}, "
        f"max waiting {seen.max_waiting:.0f}, min free blocks {seen.min_free:.0f} "
        f"({seen.samples} scrapes), wall {wall:.2f}s; afterwards free blocks "
        f"{after['pagoda:kv_free_blocks']:.0f}/{NUM_BLOCKS}"
    )

    for i, out in enumerate(storm):
        assert out.status == 200 and not out.errors, (i, out.status, out.errors)
        assert isinstance(out.last, engine_api.FinishedFrame), (i, out.last)
        assert out.last.finish_reason == "length", (i, out.last)
        assert len(out.tokens) == MAX_TOKENS, (i, len(out.tokens))
        assert out.last.completion_tokens == MAX_TOKENS
    assert engine.proc.poll() is None, engine.log_tail()
    log = engine.log_text()
    assert "Traceback" not in log, log[log.find("Traceback") - 300 :][:3000]

    # The cache really ran out: requests were preempted and queued behind each other.
    assert preemptions > 0
    assert seen.max_waiting > 0
    assert seen.max_running <= NUM_REQUESTS

    # Nothing leaked: every block is free (cached blocks count as free) and none is in use.
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["pagoda:kv_free_blocks"] == NUM_BLOCKS, after
    assert after["vllm:kv_cache_usage_perc"] == 0.0, after
    if "pagoda:kv_total_blocks" in after:
        assert after["pagoda:kv_total_blocks"] == NUM_BLOCKS

    # Preemption by recompute does not change a greedy result.
    for i, (crowded, ref) in enumerate(zip(storm, alone, strict=True)):
        assert ref.status == 200 and len(ref.tokens) == MAX_TOKENS, (i, ref.errors)
        assert crowded.tokens == ref.tokens, f"request {i}: greedy output changed"
