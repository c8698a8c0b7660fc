"""Pipeline parallelism on 2 cores: PP=2 (one stage per core, threads pinned) against PP=1 (one
process, both cores), throughput at 64 requests, and the pipeline's bubble.

    .venv/bin/python benchmarks/pipeline_parallel.py            # 64 requests x 64 tokens
    .venv/bin/python benchmarks/pipeline_parallel.py --quick    # 64 requests x 8 tokens

Each configuration runs in a process of its own (one parallel engine per process) on the
default model (SmolLM2-135M, fp32; its 30 layers as 15 + 15). PP=1: the engine's OpenMP team
over both cores. PP=2: rank 0 (scheduler, stage 1, LM head, sampling) on core 1 with one
thread, the stage-0 worker on core 0 with one thread; every thread of each process is pinned
once the engine is up. Both run the same greedy workload (random 32-token prompts), all
requests submitted at once; the figure is output tokens per second of wall time.

The bubble, named: each stage measures the time it waited for its input between its first
batch and its last (``parallel.pipeline.StageIdle``). Stage 0 waiting is rank 0's host work
(scheduling, sampling, applying) not hidden behind stage 0's compute, plus the drain at the
end; the last stage (rank 0) waiting is the imbalance of the two halves plus the fill at the
start. The target is PP=2 at 0.8x PP=1 or better.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_IDLE = re.compile(r"pipeline stage (\d+) \(rank (\d+)\): (\d+) batches, idle ([\d.]+)s of "
                   r"([\d.]+)s")


def machine_line() -> str:
    """The CPU and its ISA flags (from /proc/cpuinfo), and the cores this process may use."""
    info = Path("/proc/cpuinfo").read_text()
    model = next(ln.split(":", 1)[1].strip() for ln in info.splitlines()
                 if ln.startswith("model name"))
    flags = next(ln.split(":", 1)[1].split() for ln in info.splitlines()
                 if ln.startswith("flags"))
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return (f"machine: {model}; cores usable: {len(os.sched_getaffinity(0))}; "
            f"ISA: {' '.join(isa) or 'no avx2/avx512'}; load average "
            f"{os.getloadavg()[0]:.1f}")


def _pin(pid: int, core: int) -> None:
    """Every thread of ``pid`` on ``core`` (a process's affinity covers only its threads
    started after it is set)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # a thread that has ended meanwhile
            pass


def child(pp: int, requests: int, max_tokens: int) -> None:
    """One configuration: prints ``RESULT {json}`` (the stages log their idle time at close:
    INFO, which the workers inherit)."""
    import logging

    from services.engine import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.engine.models.default import default_model_path

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cores = sorted(os.sched_getaffinity(0))[:2]
    engine = LLMEngine(EngineConfig(model=str(default_model_path()), dtype="float32",
                                    device="cpu", pipeline_parallel_size=pp,
                                    cpu_threads=1 if pp > 1 else len(cores),
                                    max_num_seqs=requests))
    if pp > 1:  # rank 0 on the second core, the stage-0 worker on the first
        _pin(os.getpid(), cores[1])
        for pid in engine.runner.workers.pids:
            _pin(pid, cores[0])
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(requests):
        engine.add_request(f"r{i}", [rng.randrange(1000, 40000) for _ in range(32)], params)
    start = time.perf_counter()
    tokens = steps = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(u.new_token_ids) for u in engine.step())
        steps += 1
    wall = time.perf_counter() - start
    result = {"pp": pp, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
              "steps": steps}
    if engine.batches is not None:
        result["peak_in_flight"] = engine.batches.peak
    engine.close()
    print("RESULT " + json.dumps(result), flush=True)


def run(pp: int, requests: int, max_tokens: int) -> dict:
    cmd = [sys.executable, __file__, "--child", str(pp), "--requests", str(requests),
           "--max-tokens", str(max_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"PP={pp} failed:\n{out.stderr[-3000:]}")
    result = json.loads(lines[0][7:])
    # findall's groups: stage, rank, batches, idle seconds, span seconds
    result["stages"] = {int(m[0]): {"batches": int(m[2]), "idle_s": float(m[3]),
                                    "span_s": float(m[4])} for m in _IDLE.findall(out.stderr)}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 output tokens a request, not 64")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    max_tokens = args.max_tokens or (8 if args.quick else 64)
    if args.child is not None:
        child(args.child, args.requests, max_tokens)
        return
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs 2 usable cores (one per stage)")
    print(machine_line())
    print(f"workload: {args.requests} requests, 32-token prompts, {max_tokens} tokens each, "
          "greedy, SmolLM2-135M fp32")
    one, two = run(1, args.requests, max_tokens), run(2, args.requests, max_tokens)
    for r in (one, two):
        print(f"PP={r['pp']}: {r['tok_s']:.1f} output tok/s ({r['tokens']} tokens in "
              f"{r['wall_s']:.2f}s, {r['steps']} engine steps)")
    print(f"PP=2 / PP=1 throughput: {two['tok_s'] / one['tok_s']:.2f}x (target >= 0.8x); "
          f"batches in flight at most: {two.get('peak_in_flight')}")
    names = {0: "stage 0 (worker, core 0) waiting for rank 0's next batch",
             1: "stage 1 (rank 0, core 1) waiting for stage 0's hidden states"}
    for stage, s in sorted(two["stages"].items()):
        share = s["idle_s"] / s["span_s"] if s["span_s"] else 0.0
        print(f"bubble, {names.get(stage, f'stage {stage}')}: {s['idle_s']:.3f}s of "
              f"{s['span_s']:.3f}s ({share:.0%}) over {s['batches']} batches")


if __name__ == "__main__":
    main()
