"""Disaggregated prefill/decode against aggregated serving, on one machine: 1 prefill + 1
decode engine against 2 aggregated engines, each engine on its own core(s), behind the router
and the gateway (``python -m services.serve``, what ``make serve`` runs), under one mixed
workload: steady chat streams decode while long prompts arrive.

    .venv/bin/python benchmarks/disagg.py            # the figures (several minutes)
    .venv/bin/python benchmarks/disagg.py --quick    # a short check that it all runs
    .venv/bin/python benchmarks/disagg.py --transport store   # P/D through a KV store
    .venv/bin/python benchmarks/disagg.py --stream-compare    # P/D's KV streamed or not
    .venv/bin/python benchmarks/disagg.py --stream-mixed --rounds 2  # aggregated, P/D, P/D
                                                              # streamed: mixed workload

What P/D should buy: in an aggregated engine a long prompt's prefill steps hold up every
decode that shares the engine (inter-token latency spikes); with P/D the decode engine never
prefills. Printed for both, and P/D over aggregated: p99 inter-token latency of the chat
streams, mean time to first token (all requests, and the long prompts alone), output
throughput. Then, on the P/D stack alone and idle, one fresh long prompt: its KV transfer time
(the decode engine's ``pagoda:kv_transfer_seconds``; without that metric, an upper bound: the
client's time to first token less the prefill leg's latency) against its prefill time (the
prefill engine's ``vllm:request_prefill_time_seconds``). Last, if ``benchmarks/peer_pull.py``
exists, its figures (a prefix pulled from a peer against recomputing it).

``--stream-compare`` measures instead what streaming the KV buys (the gateway's
``--pd-stream-kv``: the decode leg pulls each block as the prefill's chunks compute it): two
P/D stacks in one run, without and with it, each sent the same long prompts one after another
on an otherwise idle stack; the time to first token of each, mean and p99, and each stack's
transfer against prefill. Give the engines steps shorter than the prompt (the CPU default is
256 tokens), or there is one chunk and nothing to overlap.

Every figure comes with the machine line (CPU, ISA flags, usable cores). Run it on a machine
nothing else is using: the engines are pinned to cores, the load is not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_throughput import machine_line  # noqa: E402

_PY = sys.executable
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_ENGINE_LOG = re.compile(r"engine-(\d+) metrics: (http://\S+)/metrics")
CHAT = ("You are a helpful assistant.", "Tell me about the history of tea, briefly.")


@dataclass(frozen=True, slots=True)
class Workload:
    chat_streams: int  # concurrent chat clients, each asking again as soon as one ends
    chat_tokens: int  # output tokens per chat answer
    long_prompts: int  # how many long prompts arrive
    long_tokens: int  # their length in tokens
    long_every_s: float  # one arrives this often
    long_output: int  # output tokens per long prompt

    @classmethod
    def of(cls, args: argparse.Namespace) -> Workload:
        if args.quick:
            return cls(2, 16, 2, args.long_tokens or 512, 4.0, 4)
        return cls(4, 64, 6, args.long_tokens or 2000, 10.0, 16)


@dataclass(slots=True)
class Stream:
    """One request's timeline, seen by the client."""

    long: bool
    sent: float
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


# -- the stack ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """``python -m services.serve`` with the given engine flags; knows its engines' URLs from
    its log (engine-0 first: with P/D the prefill engines come first)."""

    def __init__(self, flags: list[str], log: Path) -> None:
        self.port = free_port()
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen(
            [_PY, "-m", "services.serve", "--port", str(self.port), *flags],
            cwd=REPO, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)
        self.engines: list[str] = []

    def wait(self, timeout_s: float = 900.0) -> Serve:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"services.serve exited ({self.proc.returncode}); see {self.log}")
            found = dict(_ENGINE_LOG.findall(self.log.read_text()))
            if found and _answers(f"http://127.0.0.1:{self.port}/v1/models"):
                self.engines = [found[k] for k in sorted(found, key=int)]
                return self
            time.sleep(1.0)
        raise SystemExit(f"services.serve not ready after {timeout_s:.0f}s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._out.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def scrape(engine_url: str) -> dict[str, float]:
    """An engine's ``/metrics``, each family summed over its labels."""
    with urllib.request.urlopen(engine_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is not None:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


# -- the clients ----------------------------------------------------------------------------

async def stream(session: aiohttp.ClientSession, base: str, path: str, body: dict,
                 long: bool) -> Stream:
    s = Stream(long, time.perf_counter())
    body = {**body, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0, "ignore_eos": True}
    async with session.post(base + path, json=body) as resp:
        if resp.status != 200:
            raise SystemExit(f"{path}: {resp.status} {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                s.output_tokens = chunk["usage"]["completion_tokens"]
            if any(_text(c) for c in chunk.get("choices", [])):
                s.token_times.append(time.perf_counter())
    return s


def _text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def chat_client(session, base: str, model: str, w: Workload, stop: asyncio.Event,
                      out: list[Stream]) -> None:
    system, user = CHAT
    while not stop.is_set():
        out.append(await stream(session, base, "/v1/chat/completions", {
            "model": model, "max_tokens": w.chat_tokens,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}]}, long=False))


def long_prompt(seed: int, tokens: int) -> list[int]:
    """Token ids no other prompt shares (no prefix-cache hit)."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(tokens)]


async def mixed(base: str, model: str, w: Workload, seed: int) -> tuple[list[Stream], float]:
    stop = asyncio.Event()
    streams: list[Stream] = []
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        chats = [asyncio.create_task(chat_client(session, base, model, w, stop, streams))
                 for _ in range(w.chat_streams)]
        await asyncio.sleep(w.long_every_s / 2)  # the chats settle first
        longs = []
        for i in range(w.long_prompts):
            body = {"model": model, "prompt": long_prompt(seed + i, w.long_tokens),
                    "max_tokens": w.long_output}
            longs.append(asyncio.create_task(stream(session, base, "/v1/completions", body,
                                                    long=True)))
            await asyncio.sleep(w.long_every_s)
        streams += await asyncio.gather(*longs)
        stop.set()
        await asyncio.gather(*chats)
        return streams, time.perf_counter() - start


# -- figures --------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(streams: list[Stream], wall_s: float) -> dict[str, float]:
    chats = [s for s in streams if not s.long and s.token_times]
    longs = [s for s in streams if s.long and s.token_times]
    every = chats + longs
    return {
        "p99 ITL, chat streams (ms)": 1000 * percentile([x for s in chats for x in s.itls()],
                                                        0.99),
        "p50 ITL, chat streams (ms)": 1000 * percentile([x for s in chats for x in s.itls()],
                                                        0.50),
        "mean TTFT, all (ms)": 1000 * sum(s.ttft for s in every) / max(1, len(every)),
        "mean TTFT, long prompts (ms)": 1000 * sum(s.ttft for s in longs) / max(1, len(longs)),
        "output throughput (tok/s)": sum(s.output_tokens for s in every) / wall_s,
        "requests": float(len(every)),
    }


async def transfer_vs_prefill(serve: Serve, model: str, w: Workload, seed: int,
                              transport: str = "tcp") -> None:
    """One fresh long prompt on the idle P/D stack: the decode engine's KV transfer time
    against the prefill engine's prefill time, from their metrics' deltas (through the
    store, the transfer is the prefill engine's write and the decode engine's read)."""
    prefill, decode = serve.engines[0], serve.engines[1]
    before_p, before_d = scrape(prefill), scrape(decode)
    async with aiohttp.ClientSession() as session:
        s = await stream(session, f"http://127.0.0.1:{serve.port}", "/v1/completions",
                         {"model": model, "prompt": long_prompt(seed, w.long_tokens),
                          "max_tokens": 2}, long=True)
    await asyncio.sleep(0.5)  # the histograms are observed as the requests finish
    after_p, after_d = scrape(prefill), scrape(decode)

    def delta(after: dict[str, float], before: dict[str, float], name: str) -> float | None:
        return after[name] - before.get(name, 0.0) if name in after else None

    prefill_s = delta(after_p, before_p, "vllm:request_prefill_time_seconds_sum")
    transfer_s = delta(after_d, before_d, "pagoda:kv_transfer_seconds_sum")
    how = "pagoda:kv_transfer_seconds"
    written_s = delta(after_p, before_p, "pagoda:kv_transfer_seconds_sum")
    if transport == "store" and transfer_s is not None and written_s is not None:
        transfer_s += written_s
        how = "pagoda:kv_transfer_seconds, the prefill engine's write + the decode engine's read"
    if transfer_s is None:  # no transfer metric: what the client waited beyond the prefill leg
        prefill_leg = delta(after_p, before_p, "vllm:e2e_request_latency_seconds_sum")
        transfer_s = None if prefill_leg is None else max(0.0, s.ttft - prefill_leg)
        how = ("<= the client's TTFT - the prefill leg's latency: transfer, the decode engine's "
               "first step and two hops; no pagoda:kv_transfer_seconds")
    print(f"\nKV transfer of one {w.long_tokens}-token prompt (idle P/D stack; client TTFT "
          f"{1000 * s.ttft:.0f} ms):")
    print(f"  prefill time (prefill engine): {_ms(prefill_s)}")
    print(f"  transfer time ({how}): {_ms(transfer_s)}")
    if prefill_s and transfer_s is not None:
        print(f"  transfer / prefill: {transfer_s / prefill_s:.3f} (the issue asks <= 0.10)")


async def sequential_ttft(base: str, model: str, prompts: int, tokens: int, seed: int,
                          prefill_engine: str) -> list[tuple[float, float]]:
    """``prompts`` fresh long prompts, one after another: each one's time to first token and
    its prefill time on the prefill engine (``vllm:request_prefill_time_seconds``' delta), so
    that what P/D adds past the prefill shows apart from the prefill's own variation."""
    timeout = aiohttp.ClientTimeout(total=1800)
    name = "vllm:request_prefill_time_seconds_sum"
    out = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for i in range(prompts):
            before = scrape(prefill_engine).get(name, 0.0)
            s = await stream(session, base, "/v1/completions",
                             {"model": model, "prompt": long_prompt(seed + i, tokens),
                              "max_tokens": 2}, long=True)
            await asyncio.sleep(0.3)  # the prefill leg's histogram: observed as it finishes
            out.append((s.ttft, scrape(prefill_engine).get(name, 0.0) - before))
    return out


def cpu_flags() -> list[str]:
    """``grep -o 'avx[^ ]*\\|amx[^ ]*' /proc/cpuinfo | sort -u``: every AVX and AMX flag."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return sorted(set(re.findall(r"\b(?:avx|amx)\S*", text)))


def stream_compare(args: argparse.Namespace, model_flags: list[str], tmp: str) -> None:
    """P/D without and with --pd-stream-kv, in one run: TTFT of the same long prompts."""
    prompts = 3 if args.quick else args.stream_prompts
    tokens = args.long_tokens or (512 if args.quick else 2000)
    print(f"work: {prompts} prompts of {tokens} tokens (2 out) one after another on an idle "
          f"1P1D stack; greedy, float32; KV over tcp", flush=True)
    ttfts: dict[str, list[float]] = {}
    gaps: dict[str, list[float]] = {}
    for name, extra in (("not streamed", ["--pd-stream-kv=false"]),
                        ("streamed", ["--pd-stream-kv=true"])):
        serve = Serve(["--prefill-engines", "1", "--decode-engines", "1", *extra, *model_flags,
                       *args.engine_flags.split()], Path(tmp) / f"serve-{len(ttfts)}.log")
        try:
            serve.wait()
            model = _served_model(serve.port)
            base = f"http://127.0.0.1:{serve.port}"
            prefill = serve.engines[0]
            asyncio.run(sequential_ttft(base, model, 1, 64, args.seed + 7, prefill))  # warm-up
            runs = asyncio.run(sequential_ttft(base, model, prompts, tokens, args.seed, prefill))
            ttfts[name] = [t for t, _ in runs]
            gaps[name] = [t - p for t, p in runs]
            print(f"{name}: TTFT (ms) {[round(1000 * t) for t in ttfts[name]]}; TTFT - prefill "
                  f"(ms) {[round(1000 * g) for g in gaps[name]]}", flush=True)
            w = Workload(0, 0, 1, tokens, 0.0, 2)
            asyncio.run(transfer_vs_prefill(serve, model, w, args.seed + 1000))
            if name == "streamed":
                print("  (streamed: the pull starts with the prefill, so its time includes the "
                      "prefill's; TTFT is the figure to compare)")
        finally:
            serve.stop()
    print(f"\n| {prompts} prompts of {tokens} tokens | mean TTFT (ms) | p99 TTFT (ms) | "
          "mean TTFT - prefill (ms) | p99 TTFT - prefill (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for name, values in ttfts.items():
        g = gaps[name]
        print(f"| {name} | {1000 * sum(values) / len(values):.0f} | "
              f"{1000 * percentile(values, 0.99):.0f} | {1000 * sum(g) / len(g):.0f} | "
              f"{1000 * percentile(g, 0.99):.0f} |")
    off, on = ttfts["not streamed"], ttfts["streamed"]
    print(f"streamed / not streamed: mean {sum(on) / sum(off):.2f}x, p99 "
          f"{percentile(on, 0.99) / percentile(off, 0.99):.2f}x")


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.1f} ms"


def report(results: dict[str, dict[str, float]]) -> None:
    """One table: each setup's figures, and each P/D setup's over aggregated's."""
    agg = results["aggregated"]
    others = [n for n in results if n != "aggregated"]
    print("\n| metric | aggregated (2 engines) | " + " | ".join(others) + " | " +
          " | ".join(f"{n} / aggregated" for n in others) + " |")
    print("| --- " * (2 + 2 * len(others)) + "|")
    for key in agg:
        ratios = [results[n][key] / agg[key] if agg[key] else float("nan") for n in others]
        print(f"| {key} | {agg[key]:.1f} | " +
              " | ".join(f"{results[n][key]:.1f}" for n in others) + " | " +
              " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    print("(the issue asks: p99 ITL at least 2x lower with P/D, mean TTFT <= 1.3x, "
          "throughput >= 0.8x)")
    if "P/D streamed" in results and "P/D" in results:
        on, off = results["P/D streamed"], results["P/D"]
        print("streamed / not streamed: " + ", ".join(
            f"{k} {on[k] / off[k]:.2f}x" for k in off if off[k] and k != "requests"))


def peer_pull(quick: bool) -> None:
    script = REPO / "benchmarks" / "peer_pull.py"
    if not script.exists():
        print("\nbenchmarks/peer_pull.py: not there (yet); no peer-pull figures")
        return
    cmd = [_PY, str(script)]
    if quick and "--quick" in subprocess.run(cmd + ["--help"], capture_output=True, text=True,
                                             cwd=REPO).stdout:
        cmd.append("--quick")
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=REPO, check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a short run that checks everything works (not figures to quote)")
    ap.add_argument("--long-tokens", type=int, default=0,
                    help="tokens per long prompt (default 2000; --quick: 512)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="HF model directory (default: SmolLM2)")
    ap.add_argument("--engine-flags", default="",
                    help="extra flags for every engine, e.g. '--max-num-batched-tokens 512'")
    ap.add_argument("--pd-min-prompt-tokens", type=int, default=0,
                    help="P/D: shorter prompts skip the prefill engine (selective P/D)")
    ap.add_argument("--transport", choices=("tcp", "store"), default="tcp",
                    help="P/D's KV transfer: engine to engine (tcp) or through a KV store")
    ap.add_argument("--pd-stream-kv", choices=("true", "false"), default="true",
                    help="P/D: the prefill engine streams the prompt's KV (the gateway's flag, "
                    "on by default)")
    ap.add_argument("--stream-compare", action="store_true",
                    help="instead: P/D with and without --pd-stream-kv, TTFT of long prompts")
    ap.add_argument("--stream-prompts", type=int, default=6,
                    help="--stream-compare: long prompts per stack")
    ap.add_argument("--stream-mixed", action="store_true",
                    help="the mixed workload on three stacks in one run: aggregated, P/D, and "
                    "P/D with --pd-stream-kv (what decides streaming's default)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the stacks this many times, the order reversed each round "
                    "(a shared machine's drift falls on every side)")
    ap.add_argument("--reversed", action="store_true",
                    help="the first round in the reversed order (a run continuing another)")
    args = ap.parse_args()
    # A SIGTERM (timeout, Ctrl-C from a supervisor) still stops the stacks (finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    w = Workload.of(args)
    print(machine_line(), flush=True)
    if args.stream_compare:
        print(f"cpu flags: {' '.join(cpu_flags())}", flush=True)
        tmp = tempfile.mkdtemp(prefix="pagoda-disagg-")
        print(f"logs: {tmp}", flush=True)
        stream_compare(args, ["--model", args.model] if args.model else [], tmp)
        return
    if args.stream_mixed:
        print(f"cpu flags: {' '.join(cpu_flags())}", flush=True)
    print(f"work: {w.chat_streams} chat streams of {w.chat_tokens} tokens, meanwhile "
          f"{w.long_prompts} prompts of {w.long_tokens} tokens ({w.long_output} out) one every "
          f"{w.long_every_s:.0f}s; greedy, ignore_eos, float32; P/D's KV over "
          f"{args.transport}", flush=True)
    tmp = tempfile.mkdtemp(prefix="pagoda-disagg-")  # the stacks' logs stay for a post-mortem
    print(f"logs: {tmp}", flush=True)
    setups = _setups(args)
    for turn in range(args.rounds):
        forward = (turn + args.reversed) % 2 == 0
        order = list(setups.items()) if forward else list(setups.items())[::-1]
        results: dict[str, dict[str, float]] = {}
        for name, flags in order:
            results[name] = _run_mixed(args, w, name, flags, Path(tmp) / f"serve-{turn}-"
                                       f"{len(results)}.log", transfer=turn == 0)
        print(f"\nround {turn + 1} of {args.rounds} (order: "
              f"{', '.join(n for n, _ in order)}):")
        report(results)
    if not args.stream_mixed:
        peer_pull(args.quick)


def _setups(args: argparse.Namespace) -> dict[str, list[str]]:
    pd = ["--prefill-engines", "1", "--decode-engines", "1", "--pd-transport", args.transport,
          "--pd-min-prompt-tokens", str(args.pd_min_prompt_tokens)]
    if args.stream_mixed:
        return {"aggregated": ["--engines", "2"], "P/D": [*pd, "--pd-stream-kv=false"],
                "P/D streamed": [*pd, "--pd-stream-kv=true"]}
    return {"aggregated": ["--engines", "2"],
            "P/D": [*pd, f"--pd-stream-kv={args.pd_stream_kv}"]}


def _run_mixed(args: argparse.Namespace, w: Workload, name: str, flags: list[str], log: Path,
               transfer: bool) -> dict[str, float]:
    """One stack under the mixed workload: its figures (and, for a P/D stack on the first
    round, one prompt's transfer against its prefill on the idle stack)."""
    model_flags = ["--model", args.model] if args.model else []
    serve = Serve([*flags, *model_flags, *args.engine_flags.split()], log)
    try:
        serve.wait()
        model = _served_model(serve.port)
        streams, wall = asyncio.run(mixed(f"http://127.0.0.1:{serve.port}", model, w,
                                          args.seed))
        figures = summarize(streams, wall)
        print(f"{name}: {json.dumps({k: round(v, 1) for k, v in figures.items()})}",
              flush=True)
        if transfer and name.startswith("P/D"):
            asyncio.run(transfer_vs_prefill(serve, model, w, args.seed + 1000, args.transport))
            if "--pd-stream-kv=true" in flags and args.transport == "tcp":
                print("  (streamed: the pull starts with the prefill, so its time includes the "
                      "prefill's)")
        return figures
    finally:
        serve.stop()


def _served_model(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
        return json.loads(r.read())["data"][0]["id"]


if __name__ == "__main__":
    main()
