"""KV tiers: multi-turn agent sessions on 2 engines behind the router, with and without the
tiers (host memory per engine + the shared store), and a long prefix from the store.

    .venv/bin/python benchmarks/kv_tiers.py                      # small: a few minutes on 2 cores
    .venv/bin/python benchmarks/kv_tiers.py --sessions 24 --turns 6 --num-blocks 128

Workload: ``--sessions`` agent sessions share one system + tools prefix (``--prefix-tokens``);
each turn appends a user message (``--turn-tokens``) and the previous turn's answer (its
``--output-tokens``, as fixed ids: the cache sees the same growth as with the model's own),
so every prompt re-sends the whole conversation. Turns go round the sessions (session 0 turn 0,
session 1 turn 0, ..., session 0 turn 1, ...), ``--concurrency`` requests at a time, so by the
time a session comes back its blocks have met every other session's: with a working set
several times the engines' pools (``--num-blocks`` each; printed), a pool alone loses them.
Each request streams from the gateway (token-id prompts, greedy, ``stream_options``
include_usage): TTFT is the time to the first chunk, and the prefix hit rate is
``usage.prompt_tokens_details.cached_tokens`` / prompt tokens, summed.

Both runs use the same stack (redis, 2 engines with ``--num-blocks``, the prefix router, the
gateway), started afresh; "tiers" adds ``--kv-offloading-size`` and a shared store (a second
redis-server with ``--store-maxmemory`` and allkeys-lru) via ``--kv-store-url``.

Then the shared store alone: engine 1 (offline ``LLM``, store on) computes a fresh
``--long-prefix`` token prompt; engine 2 (a second ``LLM``, store on, empty pool) serves it
once from the store and once under another cache salt (nothing cached anywhere: its own
recompute); time to first token of each (``max_tokens=1``), best of ``--repeats``.

Goals (issue 25, on the default model): hit rate >= 80% with tiers; mean TTFT >= 3x lower than
without; the long prefix from the store >= 3x faster than recomputing it. Printed with the
machine's CPU flags; the figures for README come from a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_throughput import machine_line  # noqa: E402

from services.common.internal_auth import ensure_tokens  # noqa: E402
from services.engine.models.default import default_model_path  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402
from tests.support.services import ServiceProcess  # noqa: E402


@dataclass
class RunResult:
    label: str
    ttfts: list[float]
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)

    @property
    def mean_ttft(self) -> float:
        return statistics.fmean(self.ttfts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the default model)")
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prefix-tokens", type=int, default=768, help="shared system + tools")
    p.add_argument("--turn-tokens", type=int, default=160, help="user tokens per turn")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=96, help="KV pool blocks per engine")
    p.add_argument("--kv-offloading-size", type=float, default=1.0, help="GiB per engine")
    p.add_argument("--store-maxmemory", default="512mb")
    p.add_argument("--long-prefix", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-sessions", action="store_true", help="only the store measurement")
    return p


def session_prompts(args: argparse.Namespace) -> list[list[int]]:
    """Every request's prompt, in sending order (turn by turn, round the sessions)."""
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    prefix = ids(args.prefix_tokens)
    convs = [list(prefix) for _ in range(args.sessions)]
    order = []
    for turn in range(args.turns):
        for conv in convs:
            if turn:
                conv += ids(args.output_tokens)  # the previous answer
            conv += ids(args.turn_tokens)
            order.append(list(conv))
    return order


class Stack:
    """redis, 2 engines, the router and the gateway (plus the shared store with tiers)."""

    def __init__(self, model: Path, args: argparse.Namespace, tiers: bool) -> None:
        self.model, self.args, self.tiers = model, args, tiers
        self.procs: list[ServiceProcess] = []
        self.servers: list[RedisServer] = []

    def __enter__(self) -> Stack:
        env = {"OMP_NUM_THREADS": "1"}  # two engines share the cores
        index = RedisServer().start()
        self.servers.append(index)
        extra: list[str] = []
        if self.tiers:
            store = RedisServer().start()
            self.servers.append(store)
            subprocess.run(["redis-cli", "-p", str(store.port), "config", "set", "maxmemory",
                            self.args.store_maxmemory], check=True, capture_output=True)
            subprocess.run(["redis-cli", "-p", str(store.port), "config", "set",
                            "maxmemory-policy", "allkeys-lru"], check=True, capture_output=True)
            extra = ["--kv-offloading-size", str(self.args.kv_offloading_size),
                     "--kv-store-url", store.url]
        engines = [ServiceProcess("services.engine.serving.server", [
            "--model", str(self.model), "--engine-id", f"engine-{i}", "--redis-url", index.url,
            "--num-blocks", str(self.args.num_blocks), "--heartbeat-interval-s", "0.5",
            *extra], env=env).launch() for i in range(2)]
        self.procs += engines
        for e in engines:
            e.wait_healthy()
        router = ServiceProcess("services.router", [
            "--host", "127.0.0.1", "--redis-url", index.url, "--policy", "prefix",
            "--engines", ",".join(e.url for e in engines)], health_path="/ready",
            env=env).start()
        self.procs.append(router)
        self.gateway = ServiceProcess("services.gateway", [
            "--host", "127.0.0.1", "--router-url", router.url,
            "--model", f"{self.model.name}={self.model}", "--engines-refresh", "0.5"],
            env=env).start()
        self.procs.append(self.gateway)
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):
            p.stop()
        for s in self.servers:
            s.close()


def stream_one(base: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(TTFT seconds, cached tokens) of one streamed completion."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    ttft, cached = None, 0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return (ttft or time.perf_counter() - start), cached


def run_sessions(model: Path, args: argparse.Namespace, tiers: bool) -> RunResult:
    prompts = session_prompts(args)
    with Stack(model, args, tiers) as stack, ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(
            lambda p: stream_one(stack.gateway.url, model.name, p, args.output_tokens),
            prompts))
    return RunResult("tiers" if tiers else "pool only", [r[0] for r in results],
                     sum(len(p) for p in prompts), sum(r[1] for r in results))


def store_ttft(model: Path, args: argparse.Namespace) -> tuple[float, float]:
    """(TTFT from the shared store, TTFT recomputing) of a fresh long prefix on engine 2."""
    from services.engine import LLM, SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(1)
    with RedisServer() as store:
        kw = {"kv_store_url": store.url, "num_blocks": args.long_prefix // 16 + 64}
        first, second = LLM(str(model), **kw), LLM(str(model), **kw)
        loaded, recomputed = [], []
        try:
            for r in range(args.repeats):
                prompt = [rng.randrange(1000, 40000) for _ in range(args.long_prefix)]
                first.generate([prompt], one, use_tqdm=False)
                _wait_for_writes(first)
                t = time.perf_counter()
                out = second.generate([prompt], one, use_tqdm=False)[0]
                loaded.append(time.perf_counter() - t)
                assert out.num_cached_tokens >= args.long_prefix - 16, out.num_cached_tokens
                t = time.perf_counter()
                second.generate([prompt], one, use_tqdm=False, cache_salt=f"recompute-{r}")
                recomputed.append(time.perf_counter() - t)
        finally:
            first.shutdown()
            second.shutdown()
    return min(loaded), min(recomputed)


def _wait_for_writes(llm) -> None:  # noqa: ANN001
    tiers = llm.engine.tiers
    deadline = time.monotonic() + 30
    while (tiers.busy or tiers.remote.pending_writes) and time.monotonic() < deadline:
        llm.engine.scheduler._admit_loaded(tiers.poll(timeout=0.01))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The shared store's MAC key, one per run (the engines and the in-process LLMs read it).
    os.environ.setdefault("PAGODA_KV_STORE_SECRET", secrets.token_hex(32))
    ensure_tokens(os.environ)  # the internal credential the services started here share
    model = Path(args.model) if args.model else default_model_path()
    print(machine_line())
    if not args.skip_sessions:
        prompts = session_prompts(args)
        working = args.prefix_tokens + args.sessions * args.turns * (
            args.turn_tokens + args.output_tokens)
        pool = 2 * args.num_blocks * 16
        print(f"{len(prompts)} requests, {args.sessions} sessions x {args.turns} turns; "
              f"working set {working} tokens = {working / pool:.1f}x the 2 engines' pools "
              f"({pool} tokens)")
        rows = [run_sessions(model, args, tiers=False), run_sessions(model, args, tiers=True)]
        print("| run | prefix hit rate (tokens) | mean TTFT (s) | p50 TTFT (s) |")
        print("| --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r.label} | {r.hit_rate:.1%} | {r.mean_ttft:.3f} | "
                  f"{statistics.median(r.ttfts):.3f} |")
        print(f"mean TTFT, pool only / tiers: {rows[0].mean_ttft / rows[1].mean_ttft:.2f}x "
              f"(goal >= 3x); hit rate with tiers {rows[1].hit_rate:.1%} (goal >= 80%)")
    loaded, recomputed = store_ttft(model, args)
    print(f"{args.long_prefix}-token prefix on a second engine: from the shared store "
          f"{loaded:.3f} s, recomputed {recomputed:.3f} s: {recomputed / loaded:.2f}x "
          "(goal >= 3x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
