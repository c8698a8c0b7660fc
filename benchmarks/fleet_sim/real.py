"""``--real``: the trace, scaled down, through a running stack's gateway (token-id prompts on
``/v1/completions``, streamed), measured from the client side.

TTFT is the time to the first streamed chunk with text; the hit rate comes from
``usage.prompt_tokens_details.cached_tokens`` (``stream_options.include_usage``); the engine
that served each request from the ``x-pagoda-engine`` response header. Sessions run closed
loop, ``concurrency`` at a time, with no think time; nothing new starts after ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp

from benchmarks.fleet_sim.simulator import KindStats, RunResult
from benchmarks.fleet_sim.trace import KINDS, Session, Trace

ENGINE_HEADER = "x-pagoda-engine"


@dataclass(slots=True)
class RealRecord:
    kind: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    engine: str


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, int, int, str]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = math.nan
    usage: dict = {}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"gateway answered {resp.status}: {(await resp.text())[:300]}")
        engine = resp.headers.get(ENGINE_HEADER, "?")
        buf = b""
        async for chunk in resp.content.iter_any():
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                obj = json.loads(line[5:])
                if math.isnan(ttft) and any(c.get("text") for c in obj.get("choices") or []):
                    ttft = time.perf_counter() - start
                if obj.get("usage"):
                    usage = obj["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ttft, int(usage.get("prompt_tokens", len(prompt))), int(cached), engine


async def run_real(
    trace: Trace,
    url: str,
    model: str,
    *,
    label: str,
    max_requests: int,
    concurrency: int,
    max_tokens: int,
    timeout_s: float,
) -> RunResult:
    url = url.rstrip("/")
    deadline = time.monotonic() + timeout_s
    records: list[RealRecord] = []
    queue: asyncio.Queue[Session] = asyncio.Queue()
    budget = max_requests
    for s in trace.sessions:
        if budget <= 0:
            break
        queue.put_nowait(s)
        budget -= len(s.turns)
    wall = time.perf_counter()

    async def worker(http: aiohttp.ClientSession) -> None:
        while not queue.empty() and time.monotonic() < deadline:
            s = queue.get_nowait()
            for turn in s.turns:
                if time.monotonic() >= deadline:
                    return
                out = min(turn.output_len, max_tokens)
                ttft, prompt, cached, engine = await _one(
                    http, url, model, s.tokens[: turn.prompt_len], out
                )
                records.append(RealRecord(s.kind, prompt, cached, ttft, engine))

    timeout = aiohttp.ClientTimeout(total=timeout_s + 120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    if not records:
        raise RuntimeError("no request finished: is the stack up and the timeout long enough?")
    return _result(label, records, time.perf_counter() - wall)


def _result(label: str, records: list[RealRecord], wall_s: float) -> RunResult:
    ttfts = sorted(r.ttft_s for r in records if not math.isnan(r.ttft_s))
    served = Counter(r.engine for r in records)
    counts = [float(c) for c in served.values()]
    mean = statistics.fmean(counts)

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] if values else math.nan

    by_kind = {}
    for kind in KINDS:
        rs = [r for r in records if r.kind == kind]
        kt = sorted(r.ttft_s for r in rs if not math.isnan(r.ttft_s))
        if rs and kt:
            by_kind[kind] = KindStats(
                len(rs),
                sum(r.cached_tokens for r in rs) / max(1, sum(r.prompt_tokens for r in rs)),
                statistics.fmean(kt),
                pct(kt, 0.99),
            )
    return RunResult(
        policy=label,
        engines=len(served),
        requests=len(records),
        hit_rate=sum(r.cached_tokens for r in records)
        / max(1, sum(r.prompt_tokens for r in records)),
        ttft_mean_s=statistics.fmean(ttfts) if ttfts else math.nan,
        ttft_p50_s=pct(ttfts, 0.5),
        ttft_p99_s=pct(ttfts, 0.99),
        imbalance_requests=max(counts) / mean,
        imbalance_load=math.nan,
        imbalance_busy=math.nan,
        utilization=math.nan,
        mean_load=math.nan,
        sim_s=wall_s,
        wall_s=wall_s,
        by_kind=by_kind,
        reasons=dict(served),
        ttfts=ttfts,
        served=[int(c) for c in counts],
        loads=counts,
    )
