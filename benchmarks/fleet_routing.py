"""Fleet routing benchmark: one multi-tenant trace routed by `prefix`, `least-loaded` and
`round-robin` (plus an oracle), over simulated fleets of 8, 32 and 128 engines.

    .venv/bin/python benchmarks/fleet_routing.py                  # 8, 32, 128 engines (~10 min)
    .venv/bin/python benchmarks/fleet_routing.py --engines 8      # a quick look (~10 s)
    .venv/bin/python benchmarks/fleet_routing.py --engines 128 --duration 60  # steady state
    .venv/bin/python benchmarks/fleet_routing.py --trace agent    # agent sessions only
    .venv/bin/python benchmarks/fleet_routing.py --real --url http://127.0.0.1:8000 --label prefix

Simulated mode: the REAL router (``services.router.routing.Router``: Redis index lookup, policy,
write-back) against a REAL redis-server started here; every engine is a model
(``benchmarks/fleet_sim``): the REAL ``Scheduler`` (continuous batching, chunked prefill,
preemption, its own ``update`` after each step) over the REAL ``BlockManager`` (prefix caching,
LRU eviction, a KV capacity), with a step-time cost model (prefill tokens not cached + decodes)
in place of the model, in simulated time.
The engines publish heartbeats and KV events through the real ``KVIndexPublisher`` once per
simulated second, as the real engine does, so the router sees only what it would see.

Reported per policy: fleet prefix-cache hit rate (cached / prompt tokens), mean and p99 time
to first token, mean TTFT of the agent-session requests, load imbalance (max/mean over engines
of the time-averaged running + waiting requests, and of requests served), and the hit rate of
an oracle: the same prefix policy fed every engine's exact cache and queue at each decision.
A markdown table goes to stdout; a PNG per fleet size and a JSON of every figure go to
benchmarks/results/.

Targets (checked at the end): at 128 engines `prefix` reaches >= 90% of the oracle's hit rate
with load max/mean < 1.5, and its mean agent-session TTFT is >= 3x lower than round-robin's.

Run length: first turns arrive for `--duration` seconds (default 20) and every session then
runs to its end. An agent session lives about 30 simulated seconds, so the default run is
mostly ramp-up and drain (lower load); `--duration 60` reaches steady state and is the fairer
test of the targets (about 5 minutes for 128 engines and the four routings on 2 idle cores).

Real mode (`--real`) sends a scaled-down trace (token-id prompts, /v1/completions, streamed)
through a running stack's gateway, e.g. `python -m services.serve --engines 2 --policy prefix`,
and reports the same figures from the client's side for the policy the stack runs (`--label`);
restart the stack with another `--policy` to compare. It is slow on a CPU; it stops launching
requests after `--real-timeout` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fleet_sim.engine import CostModel, EngineSpec
from benchmarks.fleet_sim.report import kind_table, markdown_table, plot
from benchmarks.fleet_sim.routing import ORACLE, OracleRouting, RedisRouting
from benchmarks.fleet_sim.simulator import RunResult, SimConfig, Simulation
from benchmarks.fleet_sim.trace import TraceConfig, make_trace
from services.router.config import RouterConfig

POLICIES = ("prefix", "least-loaded", "round-robin")
_ROUTER = RouterConfig()  # the router's defaults
RESULTS = ROOT / "benchmarks" / "results"
TRACE_MIX = {"mixed": (0.5, 0.25, 0.15, 0.10), "agent": (1.0, 0.0, 0.0, 0.0)}


def _csv(kind: type) -> object:
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engines", type=_csv(int), default=[8, 32, 128], help="fleet sizes")
    p.add_argument("--policies", type=_csv(str), default=list(POLICIES), help="router policies")
    p.add_argument("--no-oracle", action="store_true", help="skip the oracle run")
    p.add_argument("--trace", choices=sorted(TRACE_MIX), default="mixed", help="traffic mix")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of session arrivals")
    p.add_argument("--rate", type=float, default=2.5, help="requests/s per engine offered")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-blocks", type=int, default=4096, help="KV capacity per engine (blocks)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--step-overhead-ms", type=float, default=6.0)
    p.add_argument("--prefill-us-per-token", type=float, default=80.0)
    p.add_argument("--decode-us-per-seq", type=float, default=250.0)
    p.add_argument(
        "--publish-interval",
        type=float,
        default=1.0,
        help="seconds between an engine's heartbeat/KV-event publishes",
    )
    p.add_argument(
        "--load-weight",
        type=float,
        default=_ROUTER.load_weight,
        help="prefix policy knob (router --load-weight)",
    )
    p.add_argument("--hot-spot-ratio", type=float, default=_ROUTER.hot_spot_ratio)
    p.add_argument("--hot-spot-min-load", type=int, default=_ROUTER.hot_spot_min_load)
    p.add_argument("--out", type=Path, default=RESULTS, help="where PNGs and JSON go")
    p.add_argument("--no-plot", action="store_true")
    real = p.add_argument_group("real mode")
    real.add_argument("--real", action="store_true", help="drive a running stack instead")
    real.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway")
    real.add_argument("--model", default="SmolLM2-135M-Instruct")
    real.add_argument("--label", default="stack", help="row name (the stack's policy)")
    real.add_argument("--real-requests", type=int, default=40)
    real.add_argument("--real-concurrency", type=int, default=4)
    real.add_argument("--real-max-tokens", type=int, default=16)
    real.add_argument("--real-scale", type=float, default=0.25, help="length scale of prompts")
    real.add_argument("--real-timeout", type=float, default=300.0)
    return p


def _summary(results: list[RunResult]) -> list[dict]:
    out = []
    for r in results:
        d = dataclasses.asdict(r)
        d.pop("ttfts")
        d.pop("served")
        d.pop("loads")
        out.append(d)
    return out


async def simulate(args: argparse.Namespace) -> list[RunResult]:
    from tests.support.redis_server import RedisServer

    spec = EngineSpec(args.kv_blocks, args.block_size, args.max_num_seqs, args.max_batched_tokens)
    cost = CostModel(
        args.step_overhead_ms / 1e3, args.prefill_us_per_token / 1e6, args.decode_us_per_seq / 1e6
    )
    sim_config = SimConfig(spec, cost, args.publish_interval, args.seed)
    router_config = RouterConfig(
        load_weight=args.load_weight,
        hot_spot_ratio=args.hot_spot_ratio,
        hot_spot_min_load=args.hot_spot_min_load,
    )
    trace_config = TraceConfig(
        duration_s=args.duration,
        requests_per_engine_s=args.rate,
        mix=TRACE_MIX[args.trace],
        block_size=args.block_size,
        seed=args.seed,
    )
    everything: list[RunResult] = []
    with RedisServer() as redis:
        for n in args.engines:
            trace = make_trace(trace_config, n)
            print(f"\n## {n} engines: {trace.num_requests} requests {trace.summary()}", flush=True)
            results = []
            runs = [*args.policies, *([] if args.no_oracle else [ORACLE])]
            for i, name in enumerate(runs):
                if name == ORACLE:
                    routing = OracleRouting(router_config)
                else:
                    routing = RedisRouting(redis.url, name, f"fleet{n}-{i}", router_config)
                try:
                    result = await Simulation(trace, n, routing, sim_config).run()
                finally:
                    await routing.close()
                print(
                    f"  {name:13s} hit {result.hit_rate:6.1%}  TTFT mean "
                    f"{result.ttft_mean_s * 1e3:5.0f} ms  p99 {result.ttft_p99_s * 1e3:5.0f} ms"
                    f"  load max/mean {result.imbalance_load:.2f}  ({result.wall_s:.0f} s)"
                    f"  {dict(sorted(result.reasons.items()))}",
                    flush=True,
                )
                results.append(result)
            everything += results
            if not args.no_plot:
                title = (
                    f"{n} simulated engines, {args.trace} trace, {trace.num_requests} requests, "
                    f"{args.rate:g} req/s/engine, KV {args.kv_blocks} blocks/engine"
                )
                path = plot(results, args.out / f"fleet_routing_{args.trace}_{n}.png", title)
                print(f"  plot: {path}")
    return everything


def check_targets(results: list[RunResult]) -> list[str]:
    """The targets at the largest fleet size present, as printable lines."""
    biggest = max(r.engines for r in results)
    at = {r.policy: r for r in results if r.engines == biggest}
    prefix, oracle, rr = at.get("prefix"), at.get(ORACLE), at.get("round-robin")
    lines = []
    if prefix and oracle:
        ratio = prefix.hit_rate / oracle.hit_rate
        ok = ratio >= 0.9 and prefix.imbalance_load < 1.5
        lines.append(
            f"[{'PASS' if ok else 'FAIL'}] {biggest} engines: prefix hit rate {ratio:.1%} of the "
            f"oracle's (>= 90%), load max/mean {prefix.imbalance_load:.2f} (< 1.5)"
        )
    if prefix and rr and "agent" in prefix.by_kind and "agent" in rr.by_kind:
        speedup = rr.by_kind["agent"].ttft_mean_s / prefix.by_kind["agent"].ttft_mean_s
        lines.append(
            f"[{'PASS' if speedup >= 3 else 'FAIL'}] {biggest} engines: agent-session mean TTFT "
            f"{speedup:.1f}x lower than round-robin's (>= 3x)"
        )
    return lines


async def real(args: argparse.Namespace) -> list[RunResult]:
    from benchmarks.fleet_sim.real import run_real

    trace = make_trace(
        TraceConfig(
            duration_s=60.0,
            requests_per_engine_s=1.0,
            mix=TRACE_MIX[args.trace],
            length_scale=args.real_scale,
            max_context=2000,
            seed=args.seed,
        ),
        engines=2,
    )
    result = await run_real(
        trace,
        args.url,
        args.model,
        label=args.label,
        max_requests=args.real_requests,
        concurrency=args.real_concurrency,
        max_tokens=args.real_max_tokens,
        timeout_s=args.real_timeout,
    )
    print(f"engines seen: {result.reasons}")
    return [result]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    results = asyncio.run(real(args) if args.real else simulate(args))
    print()
    print(markdown_table(results))
    print()
    print(kind_table(results))
    mode = "real" if args.real else f"sim-{args.trace}"
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"fleet_routing_{mode}.json"
    out.write_text(
        json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "results": _summary(results)},
            indent=1,
        )
    )
    print(f"\nfigures: {out}")
    if not args.real:
        print()
        print("\n".join(check_targets(results)))
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
