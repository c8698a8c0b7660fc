"""A prompt's prefix pulled from a peer engine vs recomputed (issue 34, section 3: the pull of a
2,000-token prefix should be at least 3x faster).

Two in-process engines with ``PagodaPDConnector`` (``kv_both``) over a loopback transfer port:
engine A computes the prompt (its prefix cache holds it); engine B computes it from nothing
(the recompute), then, with its cache emptied, runs it again with ``pull_prefix_from`` naming
A (what the gateway sends when the router's answer has a ``kv_peer``): its full blocks are
pulled by chain hash, only the tail is computed. Each time is to the first token (max_tokens 1),
the best of ``--repeats``. ``measure()`` is what another benchmark calls
(``benchmarks/disagg.py``). ``--from-host``: A has a host tier and its pool evicted the prefix
(two other prompts ran through it), so A serves the blocks from host memory.

    python benchmarks/peer_pull.py [--tokens 2000] [--repeats 3] [--model DIR] [--quick]
                                   [--from-host]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# This checkout's services, not an installed copy's (a worktree shares the main virtualenv).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_TOKEN_ENV = "PAGODA_INTERNAL_TOKENS"


@dataclass(frozen=True, slots=True)
class PeerPullResult:
    tokens: int
    recompute_s: float  # engine B computes the whole prompt
    pull_s: float  # engine B pulls its full blocks from A, computes the tail
    transfer_s: float  # of pull_s: the transfer alone (B's pagoda:kv_transfer_seconds)
    transfer_bytes: int

    @property
    def ratio(self) -> float:
        return self.recompute_s / self.pull_s


def _engine(model: str | None, num_blocks: int, block_size: int,
            host_gib: float | None = None):  # noqa: ANN202
    from services.engine import LLM

    return LLM(model, num_blocks=num_blocks, block_size=block_size, max_num_seqs=4,
               dtype="float32", kv_offloading_size=host_gib, kv_transfer_config={
                   "kv_connector": "PagodaPDConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"read_timeout_s": 30}})  # keep it: its
    # collection would close the engine


def _first_token_s(engine, rid: str, prompt: list[int], kv: dict | None) -> float:  # noqa: ANN001
    from services.engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(rid, prompt, params, kv_transfer_params=kv)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - started


def measure(tokens: int = 2000, repeats: int = 3, model: str | None = None,
            block_size: int = 16, from_host: bool = False) -> PeerPullResult:
    """Recompute vs pull-from-a-peer of one ``tokens``-long prompt, best of ``repeats``
    (``from_host``: the peer holds it only in its host tier)."""
    if not os.environ.get(_TOKEN_ENV):
        from services.common.internal_auth import ensure_tokens

        ensure_tokens(os.environ)
    blocks = tokens // block_size + 8
    llms = [_engine(model, blocks, block_size, 1.0 if from_host else None),
            _engine(model, blocks, block_size)]
    a, b = (llm.engine for llm in llms)
    prompt = [100 + (i * 7919) % 20000 for i in range(tokens)]
    _first_token_s(a, "warm", prompt, None)  # A's cache now holds the prompt
    if from_host:  # two other prompts through A's pool: the prompt's blocks are evicted
        for k in (1, 2):
            _first_token_s(a, f"evict{k}", [p + k for p in prompt], None)
            a.poll_kv_transfers()  # the host tier's copies are done
        chain = a.hasher().chain(prompt)
        assert a.block_manager.get_computed_blocks(prompt, chain)[1] == 0, "still in A's pool"
    stop = threading.Event()

    def idle(engine) -> None:  # noqa: ANN001 - what the server's core loop does while idle
        while not stop.wait(0.002):
            engine.poll_kv_transfers()

    threading.Thread(target=idle, args=(a,), daemon=True).start()
    ask = {"pull_prefix_from": {"engine_id": "a", "blocks": tokens // block_size,
                                "address": f"127.0.0.1:{_transfer_port(a)}"}}
    recompute, pull = [], []
    try:
        for i in range(repeats):
            assert b.block_manager.reset_prefix_cache()
            recompute.append(_first_token_s(b, f"recompute{i}", prompt, None))
            assert b.block_manager.reset_prefix_cache()
            pull.append(_first_token_s(b, f"pull{i}", prompt, ask))
    finally:
        stop.set()
        time.sleep(0.01)
    stats = b.transfer_stats.snapshot()
    for llm in llms:
        llm.shutdown()
    if stats.failures:
        raise RuntimeError(f"pulls failed: {stats.failures}")
    moved = stats.received
    return PeerPullResult(tokens, min(recompute), min(pull), moved.seconds.total / max(
        1, moved.transfers), moved.bytes // max(1, moved.transfers))


def _transfer_port(engine) -> int:  # noqa: ANN001
    """The P/D connector's port (with a host tier, the connector is a MultiConnector)."""
    connectors = getattr(engine.kv_connector, "connectors", [engine.kv_connector])
    return next(c.server.port for c in connectors if getattr(c, "server", None) is not None)


def _machine() -> str:
    flags: set[str] = set()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "sha_ni")
                   if f in flags)
    return f"{model} ({isa}), {len(os.sched_getaffinity(0))} usable cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="weights directory (default: the default "
                    "model, SmolLM2-135M-Instruct)")
    ap.add_argument("--from-host", action="store_true",
                    help="the peer holds the prefix only in its host tier")
    ap.add_argument("--quick", action="store_true", help="512 tokens, one repeat: a check that "
                    "it works, not figures to quote")
    args = ap.parse_args()
    tokens, repeats = (512, 1) if args.quick else (args.tokens, args.repeats)
    r = measure(tokens, repeats, args.model, from_host=args.from_host)
    print(f"machine: {_machine()}")
    where = " from the peer's host tier" if args.from_host else ""
    print(f"peer pull{where} of a {r.tokens}-token prefix: recompute {r.recompute_s:.3f} s, "
          f"pull + tail {r.pull_s:.3f} s (transfer {r.transfer_s:.3f} s, "
          f"{r.transfer_bytes / 1e6:.1f} MB): {r.ratio:.2f}x faster (goal 3x: "
          f"{'met' if r.ratio >= 3 else 'not met'})")


if __name__ == "__main__":
    main()
