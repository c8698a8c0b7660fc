"""Gateway + router overhead per request, and the router's lookup latency at 1M indexed blocks.

    .venv/bin/python benchmarks/routing_overhead.py            # about 2 minutes on 2 cores
    .venv/bin/python benchmarks/routing_overhead.py --requests 200 --skip-lookup

Starts, on free loopback ports: a real redis-server, a fake engine (this script with
``--fake-engine``: it implements ``services.protocol.engine_api`` and answers every request with
one token and then ``finished``, publishes its heartbeat and the prompts' blocks through the real
``KVIndexPublisher``), the real router process and the real gateway process. Then, one request
at a time (``--requests`` each):

    direct            POST /internal/generate to the fake engine (msgpack, what the gateway does)
    router /route     POST /route to the router (msgpack RouteRequest, Redis lookup + write-back)
    ext_proc pick     the router's endpoint picker as Envoy asks it: one gRPC ext_proc stream,
                      request headers then the OpenAI body (FULL_DUPLEX_STREAMED), until the
                      headers' answer carrying the pick (it also parses the body and hashes
                      the prompt, which /route's caller does itself)
    gateway           POST /v1/completions, token-id prompt, non-streaming
    gateway stream    the same with stream=true (SSE)
    gateway text      a text prompt (adds tokenization), non-streaming

"added" is the gateway's latency percentile minus the direct call's. Then requests/s through
the gateway with ``--concurrency`` clients for ``--throughput-s`` seconds. Finally
``benchmarks.lookup_latency.measure_lookup_latency`` on the same Redis, 128 engines, as the index
grows to 1M blocks (128 x 8192), 128-block prompts.

Targets: gateway + router add < 5 ms at p50; lookup p99 < 2 ms at 1M indexed blocks.
Everything shares this machine's cores with the load generator, so the figures are an upper
bound for separate hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp

from services.protocol import engine_api
from services.protocol.block_hash import BlockHasher

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16
PROMPT_TOKENS = 256


# -- the fake engine (a child process: `routing_overhead.py --fake-engine ...`) ---------------


def fake_engine_main(port: int, redis_url: str, engine_id: str) -> None:
    from aiohttp import web

    from services.common.redis_index import KVIndexPublisher
    from services.protocol.kv_events import KVEvent, KVEventKind
    from services.protocol.messages import EngineHeartbeat

    url = f"http://127.0.0.1:{port}"
    hasher = BlockHasher(MODEL, BLOCK_SIZE)
    stored: list[bytes] = []
    known: set[bytes] = set()

    async def generate(request: web.Request) -> web.StreamResponse:
        try:
            req = engine_api.GenerateRequest.from_msgpack(await request.read())
        except ValueError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        if req.cache_salt is None:  # prefix-cache the prompt, as far as the router can tell
            for h in hasher.chain(req.prompt_token_ids):
                if h not in known:
                    known.add(h)
                    stored.append(h)
        resp = web.StreamResponse(headers={"Content-Type": engine_api.CONTENT_TYPE})
        await resp.prepare(request)
        n = len(req.prompt_token_ids)
        await resp.write(engine_api.TokensFrame([42], None, 0).to_msgpack())
        await resp.write(engine_api.FinishedFrame("length", None, n, 1, 0).to_msgpack())
        await resp.write_eof()
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def heartbeats(app: web.Application):
        publisher = KVIndexPublisher.from_url(redis_url)

        async def loop() -> None:
            while True:
                if stored:
                    batch = stored[:]
                    stored.clear()
                    with contextlib.suppress(Exception):
                        await publisher.apply_events(
                            engine_id, MODEL, [KVEvent(KVEventKind.STORED, tuple(batch))]
                        )
                hb = EngineHeartbeat(
                    engine_id, url, MODEL, BLOCK_SIZE, 0, 0, 0.0, 1000, 1000, time.time(), 8192
                )
                with contextlib.suppress(Exception):
                    await publisher.publish_heartbeat(hb, ttl_s=5.0)
                await asyncio.sleep(1.0)

        task = asyncio.create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(Exception):
            await publisher.remove_engine(engine_id, MODEL)
        await publisher.aclose()

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post(engine_api.GENERATE_PATH, generate)
    app.router.add_post(engine_api.ABORT_PATH, ok)
    app.router.add_get("/health", ok)
    app.cleanup_ctx.append(heartbeats)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# -- processes -----------------------------------------------------------------------------------


class Proc:
    def __init__(self, name: str, cmd: list[str], health_url: str) -> None:
        self.name = name
        self.health_url = health_url
        self.p = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    async def wait_healthy(self, http: aiohttp.ClientSession, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                err = self.p.stderr.read().decode(errors="replace")[-3000:] if self.p.stderr else ""
                raise RuntimeError(f"{self.name} exited ({self.p.returncode}):\n{err}")
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                async with http.get(self.health_url) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f}s")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)
        if self.p.stderr:
            self.p.stderr.close()


# -- measurements --------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def timed(n: int, call: Callable[[int], Awaitable[None]], warmup: int = 20) -> list[float]:
    for i in range(warmup):
        await call(-1 - i)
    out = []
    for i in range(n):
        start = time.perf_counter()
        await call(i)
        out.append((time.perf_counter() - start) * 1000)
    return out


async def timed_pair(n: int, a: Callable[[int], Awaitable[Callable[[], None] | None]],
                     b: Callable[[int], Awaitable[Callable[[], None] | None]], warmup: int = 20
                     ) -> tuple[list[float], list[float]]:
    """``timed`` for two calls taking turns (a then b on each request index). A call may
    return a function that ends what it started, run outside the time."""
    for i in range(warmup):
        for call in (a, b):
            if (end := await call(-1 - i)) is not None:
                end()
    out_a, out_b = [], []
    for i in range(n):
        for call, out in ((a, out_a), (b, out_b)):
            start = time.perf_counter()
            end = await call(i)
            out.append((time.perf_counter() - start) * 1000)
            if end is not None:
                end()
            await asyncio.sleep(0.002)  # the last call's loose ends settle before the next
    return out_a, out_b


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts: 8 shared 192-token prefixes + a unique tail (some prefix reuse)."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1000, 30000) for _ in range(192)] for _ in range(8)]
    return [
        heads[i % 8] + [rng.randrange(1000, 30000) for _ in range(PROMPT_TOKENS - 192)]
        for i in range(count)
    ]


async def overhead(args: argparse.Namespace) -> dict[str, list[float]]:
    from services.common.internal_auth import ensure_tokens
    from services.engine.models.default import default_model_path
    from services.protocol.messages import RouteRequest
    from tests.support.redis_server import RedisServer, free_port

    model_dir = default_model_path()
    results: dict[str, list[float]] = {}
    # The router and gateway started here require and send it (the fake engine ignores it).
    internal = ensure_tokens(os.environ).headers()
    with RedisServer() as redis:
        e_port, r_port, g_port, x_port = free_port(), free_port(), free_port(), free_port()
        engine_url = f"http://127.0.0.1:{e_port}"
        router_url = f"http://127.0.0.1:{r_port}"
        gateway_url = f"http://127.0.0.1:{g_port}"
        procs = [
            Proc("fake engine", [sys.executable, __file__, "--fake-engine", "--port", str(e_port),
                                 "--redis-url", redis.url], f"{engine_url}/health"),
            Proc("router", [sys.executable, "-m", "services.router", "--host", "127.0.0.1",
                            "--port", str(r_port), "--redis-url", redis.url, "--engines",
                            engine_url, "--log-level", "WARNING", "--ext-proc-port", str(x_port),
                            "--tokenizer", f"{MODEL}={model_dir}"], f"{router_url}/ready"),
            Proc("gateway", [sys.executable, "-m", "services.gateway", "--host", "127.0.0.1",
                             "--port", str(g_port), "--router-url", router_url,
                             "--model", f"{MODEL}={model_dir}", "--engines-refresh", "1",
                             "--log-level", "WARNING"], f"{gateway_url}/health"),
        ]  # fmt: skip
        try:
            connector = aiohttp.TCPConnector(limit=max(64, args.concurrency * 2))
            async with aiohttp.ClientSession(connector=connector, headers=internal) as http:
                for p in procs:
                    await p.wait_healthy(http)
                results = await _measure(
                    args, http, engine_url, router_url, gateway_url, RouteRequest, x_port
                )
        finally:
            for p in reversed(procs):
                p.stop()
    return results


async def _measure(args, http, engine_url, router_url, gateway_url, RouteRequest, x_port):
    n = args.requests
    ps = prompts(n + 64)
    hasher = BlockHasher(MODEL, BLOCK_SIZE)
    results: dict[str, list[float]] = {}
    gen_headers = {"Content-Type": engine_api.CONTENT_TYPE}

    async def direct(i: int) -> None:
        req = engine_api.GenerateRequest(f"direct-{i}", ps[i], _params())
        async with http.post(
            engine_url + engine_api.GENERATE_PATH, data=req.to_msgpack(), headers=gen_headers
        ) as r:
            dec = engine_api.FrameDecoder()
            async for chunk in r.content.iter_any():
                if any(isinstance(f, engine_api.FinishedFrame) for f in dec.feed(chunk)):
                    break

    async def route(i: int) -> None:
        body = RouteRequest(MODEL, hasher.chain(ps[i]), len(ps[i])).to_msgpack()
        async with http.post(
            router_url + "/route", data=body, headers={"Content-Type": "application/msgpack"}
        ) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"/route answered {r.status}")

    async def gateway(i: int, stream: bool = False, text: bool = False) -> None:
        body = {"model": MODEL, "prompt": ps[i], "max_tokens": 1, "temperature": 0}
        if text:
            body["prompt"] = "Summarize the routing design of the serving stack. " * 20
        if stream:
            body["stream"] = True
        async with http.post(gateway_url + "/v1/completions", json=body) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"gateway answered {r.status}: {await r.text()}")

    # Wait until the gateway can route (it learns the engine from the router's /engines).
    deadline = time.monotonic() + 30
    while True:
        try:
            await gateway(0)
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)

    results["direct"] = await timed(n, direct)
    # Interleaved, one of each in turn: the comparison the picker's goal names (its p99 no
    # more than /route's) must not hinge on which ran while the machine was busier.
    async with _picker(ps, x_port) as pick:
        results["router /route"], results["ext_proc pick"] = await timed_pair(n, route, pick)
    results["gateway"] = await timed(n, gateway)
    results["gateway stream"] = await timed(n, lambda i: gateway(i, stream=True))
    results["gateway text"] = await timed(n, lambda i: gateway(i, text=True))

    # Throughput: `concurrency` clients in a loop for throughput_s seconds.
    done = 0
    stop_at = time.monotonic() + args.throughput_s

    async def client(k: int) -> None:
        nonlocal done
        i = k
        while time.monotonic() < stop_at:
            await gateway(i % len(ps))
            done += 1
            i += args.concurrency

    start = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(args.concurrency)))
    results["_throughput"] = [done / (time.perf_counter() - start)]
    return results


@contextlib.asynccontextmanager
async def _picker(ps: list[list[int]], port: int
                  ) -> AsyncIterator[Callable[[int], Awaitable[Callable[[], None]]]]:
    """One pick as Envoy asks it: a stream's headers and body in, until the pick comes out."""
    import json

    from tests.router import ext_proc_client as ep

    async with ep.ext_proc_stub(port) as stub:

        async def pick(i: int) -> Callable[[], None]:
            body = json.dumps({"model": MODEL, "prompt": ps[i], "max_tokens": 1}).encode()
            call = stub.Process()
            await call.write(ep.headers("/v1/completions"))
            await call.write(ep.body(body, True))
            answer = await call.read()
            if answer.WhichOneof("response") != "request_headers":
                raise RuntimeError(f"the picker answered {answer}")
            return call.cancel  # Envoy now sends the request on: the stream's end is untimed

        yield pick


def _params():
    from services.protocol.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0)


async def lookup_latency(args: argparse.Namespace) -> list:
    from benchmarks.lookup_latency import measure_lookup_latency
    from tests.support.redis_server import RedisServer

    out = []
    with RedisServer() as redis:
        for per_engine in (128, 1024, 8192):
            out.append(
                await measure_lookup_latency(
                    redis.url,
                    engines=128,
                    blocks_per_engine=per_engine,
                    prompt_blocks=128,
                    lookups=args.lookups,
                )
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=500, help="sequential requests per path")
    p.add_argument("--concurrency", type=int, default=32, help="clients in the throughput test")
    p.add_argument("--throughput-s", type=float, default=10.0)
    p.add_argument("--lookups", type=int, default=1000, help="lookups per index size")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--skip-lookup", action="store_true")
    p.add_argument("--fake-engine", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--redis-url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.fake_engine:
        fake_engine_main(args.port, args.redis_url, "fake-engine-0")
        return 0

    targets = []
    if not args.skip_overhead:
        res = asyncio.run(overhead(args))
        base50, base99 = pct(res["direct"], 0.5), pct(res["direct"], 0.99)
        print(
            f"\n## Per-request latency, {args.requests} sequential requests each "
            f"({PROMPT_TOKENS}-token prompts, 1 output token)\n"
        )
        print("| path | p50 ms | p99 ms | mean ms | added p50 ms | added p99 ms |")
        print("|---|---|---|---|---|---|")
        for name, xs in res.items():
            if name.startswith("_"):
                continue
            add = name.startswith("gateway")
            print(
                f"| {name} | {pct(xs, 0.5):.2f} | {pct(xs, 0.99):.2f} | "
                f"{statistics.fmean(xs):.2f} | "
                f"{pct(xs, 0.5) - base50:.2f} | {pct(xs, 0.99) - base99:.2f} |"
                if add
                else f"| {name} | {pct(xs, 0.5):.2f} | {pct(xs, 0.99):.2f} | "
                f"{statistics.fmean(xs):.2f} | | |"
            )
        rps = res["_throughput"][0]
        print(
            f"\nthroughput through the gateway: {rps:.0f} requests/s "
            f"({args.concurrency} concurrent clients, {args.throughput_s:.0f} s)"
        )
        added = pct(res["gateway"], 0.5) - base50
        targets.append(
            f"[{'PASS' if added < 5 else 'FAIL'}] gateway + router add "
            f"{added:.2f} ms at p50 (< 5 ms)"
        )
    if not args.skip_lookup:
        rows = asyncio.run(lookup_latency(args))
        print("\n## Router lookup latency (one EVALSHA), 128 engines, 128-block prompts\n")
        print("| indexed blocks | p50 ms | p99 ms | mean ms | Redis CPU ms/lookup |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r.indexed_blocks:,} | {r.p50_ms:.3f} | {r.p99_ms:.3f} | {r.mean_ms:.3f} "
                f"| {r.server_cpu_ms:.3f} |"
            )
        big = rows[-1]
        targets.append(
            f"[{'PASS' if big.p99_ms < 2 else 'FAIL'}] lookup p99 "
            f"{big.p99_ms:.2f} ms at {big.indexed_blocks:,} blocks (< 2 ms)"
        )
    print("\n" + "\n".join(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
