"""Paged attention kernels on a GPU: time, bandwidth and a decode meta-parameter sweep.

    PYTHONPATH=. python benchmarks/decode_attention_bench.py --json decode.json
    PYTHONPATH=. python benchmarks/decode_attention_bench.py --quick    # no sweep
    PYTHONPATH=. python benchmarks/decode_attention_bench.py --smoke    # CPU, TRITON_INTERPRET=1

Decode: bf16, 32 query heads over 8 KV heads, head_dim 64, KV blocks of 16 scattered at random
over the pool (a random permutation), every sequence at the shape's context length. Each shape
reports the default config (``decode_config`` + ``decode_num_splits``) and torch SDPA
(``enable_gqa``) on contiguous copies of the same K/V; bandwidth = K and V bytes read / time.
A sweep over BLOCK_N x num_warps x num_stages x split count runs on three shapes and prints
the five fastest; every candidate is checked once against an fp32 SDPA reference and a wrong
or failing one is marked, not fatal. Prefill: the varlen kernel on fresh prompts, TFLOP/s
against SDPA causal on contiguous tensors.

Timing: each op is captured in a CUDA graph (as the engine replays decode) and replayed after
an L2 flush; the figure is the mean of ``--reps`` replays after warm-up, from CUDA events.
The sweep's kernel variants are compiled first by ``--jobs`` processes into Triton's disk
cache, so a full sweep fits in about a minute. Only torch, triton and the standard library.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

HBM_TBPS = 4.8  # H200 datasheet; the %HBM column is relative to it
FLUSH_BYTES = 256 << 20  # > the H200's 60 MB L2
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 64, 16
DECODE_SHAPES = [(128, 190), (128, 1024), (256, 512), (32, 4096), (1, 1024), (256, 1024)]
SWEEP_SHAPES = [(128, 1024), (1, 1024), (32, 4096)]
PREFILL_SHAPES = [(8, 1024), (4, 2048)]
SWEEP_BLOCK_N = (16, 32, 64, 128)
SWEEP_WARPS = (1, 2, 4, 8)
SWEEP_STAGES = (1, 2, 3, 4)
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32)
MAX_SWEEP_PROGRAMS = 8192  # split counts past this many programs only add merge work
TOLERANCE = 3e-2  # max abs error of a bf16 output against the fp32 reference


@dataclass(frozen=True, slots=True)
class Layout:
    """What a kernel variant is compiled for (the sweep's worker processes rebuild it)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: str


@dataclass(frozen=True, slots=True, order=True)
class Candidate:
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int

    @property
    def tile(self) -> tuple[int, int, int]:
        return (self.block_n, self.num_warps, self.num_stages)


# ---------------------------------------------------------------------- inputs


def decode_inputs(
    layout: Layout, seqs: int, ctx: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """A paged batch with every context at ``ctx``; its blocks a random permutation of the pool."""
    blocks_per_seq = -(-ctx // layout.block_size)
    num_blocks = seqs * blocks_per_seq
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, device=layout.device).to(layout.dtype)

    perm = torch.randperm(num_blocks, generator=gen, device=layout.device).to(torch.int32)
    return {
        "query": rand(seqs, layout.num_heads, layout.head_dim),
        "k_cache": rand(*shape),
        "v_cache": rand(*shape),
        "block_tables": perm.view(seqs, blocks_per_seq),
        "context_lens": torch.full((seqs,), ctx, dtype=torch.int32, device=layout.device),
    }


def contiguous_kv(inputs: dict[str, torch.Tensor], ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's K and V gathered to ``[seqs, kv_heads, ctx, head_dim]`` (SDPA's layout)."""
    tables = inputs["block_tables"].long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        seqs, _ = tables.shape
        per_seq = cache[tables].reshape(seqs, -1, cache.shape[2], cache.shape[3])[:, :ctx]
        return per_seq.transpose(1, 2).contiguous()

    return gather(inputs["k_cache"]), gather(inputs["v_cache"])


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)
    return out[:, :, 0]


# ---------------------------------------------------------------------- timing


class Timer:
    """Mean time of an op: CUDA-graph replays after an L2 flush on a GPU, wall clock on CPU."""

    def __init__(self, device: str, reps: int, warmup: int) -> None:
        self.cuda = device == "cuda"
        self.reps, self.warmup = reps, warmup
        self.flush = (
            torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device) if self.cuda else None
        )

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(self.reps):
                fn()
            return (time.perf_counter() - start) / self.reps * 1e6
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(self.reps)
        ]
        for start, end in events:
            self.flush.zero_()
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        del graph
        return statistics.fmean(s.elapsed_time(e) for s, e in events) * 1e3


def tbps(num_bytes: int, us: float) -> float:
    return num_bytes / us / 1e6


# ---------------------------------------------------------------------- decode


def kv_bytes(layout: Layout, seqs: int, ctx: int) -> int:
    itemsize = torch.empty((), dtype=layout.dtype).element_size()
    return 2 * seqs * ctx * layout.num_kv_heads * layout.head_dim * itemsize


def decode_call(
    pa: ModuleType,
    inputs: dict[str, torch.Tensor],
    out: torch.Tensor,
    ctx: int,
    cand: Candidate | None,
) -> Callable[[], torch.Tensor]:
    """The op with the default config and split plan (``cand`` None) or a swept candidate."""
    scale = inputs["query"].shape[-1] ** -0.5
    args = [inputs[k] for k in ("query", "k_cache", "v_cache", "block_tables", "context_lens")]
    if cand is None:
        return lambda: pa.paged_decode_attention(*args, scale, max_context_len=ctx, out=out)
    config = pa.DecodeConfig(cand.block_n, cand.num_warps, cand.num_stages)
    return lambda: pa.paged_decode_attention(
        *args, scale, num_splits=cand.num_splits, config=config, out=out
    )


def check(fn: Callable[[], torch.Tensor], out: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs error of one run, the output poisoned first (an unwritten element is NaN)."""
    out.fill_(float("nan"))
    err = (fn().float() - expected).abs().max().item()
    return err if math.isfinite(err) else float("inf")


def bench_decode_shape(
    pa: ModuleType, layout: Layout, seqs: int, ctx: int, timer: Timer, gen: torch.Generator
) -> tuple[dict, Callable[[Candidate], dict]]:
    """The shape's default-config and SDPA figures, and a function that times one candidate."""
    inputs = decode_inputs(layout, seqs, ctx, gen)
    k, v = contiguous_kv(inputs, ctx)
    scale = layout.head_dim**-0.5
    q = inputs["query"]
    expected = sdpa_decode(q.float(), k.float(), v.float(), scale)
    out = torch.empty_like(q)
    num_bytes = kv_bytes(layout, seqs, ctx)
    default = decode_call(pa, inputs, out, ctx, None)
    # The first figure after new inputs came out ~8% slow on an H200 (the same config, timed
    # again in the sweep, was faster): busy the GPU and discard one timing first.
    spin_up(layout.device, 0.2)
    timer(default)
    us = timer(default)
    sdpa_us = timer(lambda: sdpa_decode(q, k, v, scale))
    row = {
        "shape": f"{seqs}x{ctx}",
        "kv_bytes": num_bytes,
        "default_config": asdict(
            pa.decode_config(layout.head_dim, layout.num_heads // layout.num_kv_heads, q.dtype)
        ),
        "default_splits": pa.decode_num_splits(seqs, layout.num_kv_heads, ctx),
        "default_us": us,
        "default_tbps": tbps(num_bytes, us),
        "default_max_abs_err": check(default, out, expected),
        "sdpa_us": sdpa_us,
        "sdpa_tbps": tbps(num_bytes, sdpa_us),
    }

    def run_candidate(cand: Candidate) -> dict:
        rec = asdict(cand)
        try:
            fn = decode_call(pa, inputs, out, ctx, cand)
            rec["max_abs_err"] = check(fn, out, expected)
            if rec["max_abs_err"] > TOLERANCE:
                rec["status"] = "wrong"
                return rec
            rec["us"] = timer(fn)
            rec["tbps"] = tbps(num_bytes, rec["us"])
            rec["status"] = "ok"
        # Triton's compile, ptxas and launch raise many types; a failing variant is marked.
        except Exception as exc:  # noqa: BLE001
            rec["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return rec

    return row, run_candidate


def candidates(seqs: int, num_kv_heads: int, ctx: int, smoke: bool) -> list[Candidate]:
    """The sweep space at one shape: split counts that leave >= 32 keys per split."""
    if smoke:
        return [Candidate(16, 1, 1, 1), Candidate(64, 4, 2, 3)]
    splits = [
        s
        for s in SWEEP_SPLITS
        if ctx / s >= 32 and seqs * num_kv_heads * s <= max(MAX_SWEEP_PROGRAMS, seqs * num_kv_heads)
    ]
    grid = itertools.product(SWEEP_BLOCK_N, SWEEP_WARPS, SWEEP_STAGES, splits)
    return [Candidate(*c) for c in grid]


def common_tile(sweeps: dict[str, list[dict]]) -> dict | None:
    """The (block_n, warps, stages) best over all sweep shapes (geometric mean of its best time
    per shape over the shape's best), with the split count it wants at each shape."""
    per_tile: dict[tuple[int, int, int], dict[str, dict]] = {}
    for shape, recs in sweeps.items():
        for rec in recs:
            if rec["status"] != "ok":
                continue
            tile = (rec["block_n"], rec["num_warps"], rec["num_stages"])
            best = per_tile.setdefault(tile, {}).get(shape)
            if best is None or rec["us"] < best["us"]:
                per_tile[tile][shape] = rec
    best_us = {
        shape: min(r["us"] for r in recs if r["status"] == "ok")
        for shape, recs in sweeps.items()
        if any(r["status"] == "ok" for r in recs)
    }
    scored = [
        (statistics.geometric_mean(by[s]["us"] / best_us[s] for s in best_us), tile, by)
        for tile, by in per_tile.items()
        if set(by) == set(best_us)
    ]
    if not scored:
        return None
    score, tile, by = min(scored)
    return {
        "block_n": tile[0],
        "num_warps": tile[1],
        "num_stages": tile[2],
        "slowdown_vs_best_per_shape": score,
        "splits": {s: by[s]["num_splits"] for s in by},
    }


# ---------------------------------------------------------------------- compile warm-up


def _warm_worker(job: tuple[Layout, list[Candidate]]) -> dict[Candidate, str]:
    """Compiles candidates into Triton's disk cache (in a worker process); returns failures."""
    layout, cands = job
    pa = importlib.import_module("services.engine.kernels.paged_attention")
    gen = torch.Generator(layout.device).manual_seed(0)
    inputs = decode_inputs(layout, 2, 64, gen)
    out = torch.empty_like(inputs["query"])
    failures = {}
    for cand in cands:
        try:
            decode_call(pa, inputs, out, 64, cand)()
        except Exception as exc:  # noqa: BLE001 -- compile errors come in many types
            failures[cand] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if layout.device == "cuda":
        torch.cuda.synchronize()
    return failures


def precompile(layout: Layout, cands: list[Candidate], jobs: int) -> dict[Candidate, str]:
    """Compiles every distinct variant in ``jobs`` processes; the parent then loads them from
    Triton's disk cache. A decode variant is a tile and whether it writes partials (splits > 1);
    the merge kernel's, the split count's power of two. Returns the candidates that failed."""
    if jobs <= 1:
        return {}
    variants = {(c.tile, c.num_splits > 1, triton_next_power_of_2(c.num_splits)): c for c in cands}
    tiles = sorted({c.tile for c in cands})
    # A tile's variants all go to one process, so none is compiled twice.
    chunks = [
        (layout, [c for key, c in variants.items() if key[0] in tiles[i::jobs]])
        for i in range(min(jobs, len(tiles)))
    ]
    try:
        with multiprocessing.get_context("spawn").Pool(len(chunks)) as pool:
            results = pool.map(_warm_worker, chunks)
    except Exception as exc:  # noqa: BLE001 -- the parent then compiles on first use
        print(f"warm-up processes failed ({exc}); compiling in this process", file=sys.stderr)
        return {}
    failed = {(c.tile, c.num_splits > 1): e for r in results for c, e in r.items()}
    return {
        c: failed[(c.tile, c.num_splits > 1)] for c in cands if (c.tile, c.num_splits > 1) in failed
    }


def triton_next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def compiled_variants(kernel: object) -> int | None:
    """How many variants Triton holds for a kernel (None where this Triton keeps them elsewhere)."""
    try:
        return sum(len(entry[0]) for entry in kernel.device_caches.values())
    except (AttributeError, TypeError, IndexError):
        return None


def recompile_check(pa: ModuleType, layout: Layout, gen: torch.Generator) -> dict:
    """Changing contexts, split counts and the block table's width must not recompile (the
    engine meets all three at run time; a recompile is a cold start). Split counts 3 and 4
    share the merge kernel's variant (its BLOCK_S is the power of two above)."""
    inputs = decode_inputs(layout, 4, 300, gen)
    out = torch.empty_like(inputs["query"])
    decode_call(pa, inputs, out, 300, Candidate(64, 4, 2, 3))()
    before = compiled_variants(pa._decode_kernel), compiled_variants(pa._merge_splits_kernel)
    for width_pad, splits, ctx in ((1, 4, 17), (16, 3, 299), (3, 4, 1)):
        pad = torch.zeros(4, width_pad, dtype=torch.int32, device=layout.device)
        wide = dict(inputs, block_tables=torch.cat([inputs["block_tables"], pad], dim=1))
        wide["context_lens"] = torch.full_like(inputs["context_lens"], ctx)
        decode_call(pa, wide, out, ctx, Candidate(64, 4, 2, splits))()
    if layout.device == "cuda":
        torch.cuda.synchronize()
    after = compiled_variants(pa._decode_kernel), compiled_variants(pa._merge_splits_kernel)
    return {"decode_variants": [before[0], after[0]], "merge_variants": [before[1], after[1]]}


# ---------------------------------------------------------------------- prefill


def bench_prefill(
    pa: ModuleType, layout: Layout, seqs: int, ctx: int, timer: Timer, gen: torch.Generator
) -> dict:
    """Fresh prefill of ``seqs`` prompts of ``ctx`` tokens (K/V already in the paged cache)."""
    inputs = decode_inputs(layout, seqs, ctx, gen)
    k, v = contiguous_kv(inputs, ctx)
    scale = layout.head_dim**-0.5
    dev = layout.device
    query = torch.randn(seqs * ctx, layout.num_heads, layout.head_dim, generator=gen, device=dev)
    query = query.to(layout.dtype)
    cu_seqlens = torch.arange(0, seqs + 1, dtype=torch.int32, device=dev) * ctx
    args = (inputs["k_cache"], inputs["v_cache"], inputs["block_tables"], inputs["context_lens"])
    out = torch.empty_like(query)

    def kernel() -> torch.Tensor:
        return pa.paged_prefill_attention(query, *args, cu_seqlens, ctx, scale, out=out)

    q4 = query.view(seqs, ctx, layout.num_heads, layout.head_dim).transpose(1, 2)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q4, k, v, is_causal=True, scale=scale, enable_gqa=True
        )

    expected = sdpa().transpose(1, 2).reshape(query.shape).float()
    flops = seqs * layout.num_heads * 2 * ctx * (ctx + 1) * layout.head_dim
    us, sdpa_us = timer(kernel), timer(sdpa)
    return {
        "shape": f"{seqs}x{ctx}",
        "us": us,
        "tflops": flops / us / 1e6,
        "max_abs_err": check(kernel, out, expected),
        "sdpa_us": sdpa_us,
        "sdpa_tflops": flops / sdpa_us / 1e6,
    }


# ---------------------------------------------------------------------- report


def print_report(report: dict, layout: Layout) -> None:
    print_decode(report["decode"], layout)
    print_prefill(report["prefill"], layout)
    print(f"\ncommon tile over the sweep shapes: {report['common_tile']}")
    print(f"recompile check (variants before, after): {report['recompile_check']}")
    print(f"precompile {report['precompile_seconds']:.1f} s, total {report['seconds']:.1f} s")


def print_decode(rows: list[dict], layout: Layout) -> None:
    print(
        f"\ndecode, bf16, {layout.num_heads} q heads / {layout.num_kv_heads} kv heads, head_dim "
        f"{layout.head_dim}, blocks of {layout.block_size} (scattered); graph replays, L2 flushed"
    )
    head = (
        "shape",
        "default µs",
        "TB/s",
        "%HBM",
        "splits",
        "err",
        "best µs",
        "TB/s",
        "best of sweep",
        "SDPA µs",
        "TB/s",
    )
    print("{:>10} {:>10} {:>6} {:>5} {:>6} {:>8} {:>8} {:>6} {:>22} {:>8} {:>6}".format(*head))
    for r in rows:
        best = r.get("best")
        best_cols = (
            (
                f"{best['us']:.1f}",
                f"{best['tbps']:.2f}",
                f"n{best['block_n']} w{best['num_warps']} s{best['num_stages']} "
                f"x{best['num_splits']}",
            )
            if best
            else ("-", "-", "-")
        )
        print(
            f"{r['shape']:>10} {r['default_us']:>10.1f} {r['default_tbps']:>6.2f} "
            f"{100 * r['default_tbps'] / HBM_TBPS:>5.0f} {r['default_splits']:>6} "
            f"{r['default_max_abs_err']:>8.1e} {best_cols[0]:>8} {best_cols[1]:>6} "
            f"{best_cols[2]:>22} {r['sdpa_us']:>8.1f} {r['sdpa_tbps']:>6.2f}"
        )


def print_sweep(shape: str, recs: list[dict]) -> None:
    ok = sorted((r for r in recs if r["status"] == "ok"), key=lambda r: r["us"])
    bad = [r for r in recs if r["status"] != "ok"]
    print(f"\nsweep {shape}: {len(ok)} ok, {len(bad)} failed, wrong or skipped; top 5")
    for r in ok[:5]:
        print(
            f"  block_n {r['block_n']:>3}  warps {r['num_warps']}  stages {r['num_stages']}  "
            f"splits {r['num_splits']:>2}  {r['us']:8.1f} µs  {r['tbps']:5.2f} TB/s  "
            f"err {r['max_abs_err']:.1e}"
        )
    for r in bad[:5]:
        print(
            f"  FAILED block_n {r['block_n']} warps {r['num_warps']} stages {r['num_stages']} "
            f"splits {r['num_splits']}: {r['status']} (err {r.get('max_abs_err')})"
        )


def print_prefill(rows: list[dict], layout: Layout) -> None:
    print(f"\nprefill (fresh prompts, causal), bf16, head_dim {layout.head_dim}")
    print(
        "{:>10} {:>10} {:>8} {:>8} {:>10} {:>8}".format(
            "shape", "kernel µs", "TFLOP/s", "err", "SDPA µs", "TFLOP/s"
        )
    )
    for r in rows:
        print(
            f"{r['shape']:>10} {r['us']:>10.1f} {r['tflops']:>8.1f} {r['max_abs_err']:>8.1e} "
            f"{r['sdpa_us']:>10.1f} {r['sdpa_tflops']:>8.1f}"
        )


# ---------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="no meta-parameter sweep")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU under TRITON_INTERPRET=1, tiny shapes: proves the script runs",
    )
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--reps", type=int, default=50, help="timed replays per figure")
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(16, os.cpu_count() or 1),
        help="processes compiling the sweep's variants up front (1: none)",
    )
    parser.add_argument(
        "--sweep-all", action="store_true", help="sweep every decode shape, not only three"
    )
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, help="64 as measured; 128 too")
    parser.add_argument(
        "--sweep-seconds",
        type=float,
        default=60.0,
        help="stop sweeping (keeping what was measured) after this long",
    )
    return parser.parse_args()


def load_kernels(smoke: bool) -> ModuleType:
    """The kernel module; under --smoke with the interpreter on (Triton reads the variable when
    the kernels are defined, so it is set before the first import)."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke to check the script on the CPU")
    return importlib.import_module("services.engine.kernels.paged_attention")


def main() -> None:
    args = parse_args()
    pa = load_kernels(args.smoke)
    device = "cpu" if args.smoke else "cuda"
    layout = Layout(NUM_HEADS, NUM_KV_HEADS, args.head_dim, BLOCK_SIZE, torch.bfloat16, device)
    decode_shapes = [(2, 40), (1, 70)] if args.smoke else DECODE_SHAPES
    sweep_shapes = [] if args.quick else decode_shapes[:1] if args.smoke else SWEEP_SHAPES
    if args.sweep_all and not args.smoke:
        sweep_shapes = DECODE_SHAPES
    timer = Timer(device, 2 if args.smoke else args.reps, 1 if args.smoke else 5)
    gen = torch.Generator(device).manual_seed(0)
    started = time.perf_counter()
    report: dict = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": importlib.import_module("triton").__version__,
        "layout": {**asdict(layout), "dtype": str(layout.dtype)},
    }
    sweep_cands = {
        (seqs, ctx): candidates(seqs, NUM_KV_HEADS, ctx, args.smoke) for seqs, ctx in sweep_shapes
    }
    compile_s = time.perf_counter()
    distinct = sorted({c for cs in sweep_cands.values() for c in cs})
    failures = precompile(layout, distinct, min(2, args.jobs) if args.smoke else args.jobs)
    report["precompile_seconds"] = time.perf_counter() - compile_s
    spin_up(device)

    rows, sweeps = [], {}
    deadline = time.perf_counter() + args.sweep_seconds
    for seqs, ctx in decode_shapes:
        row, run_candidate = bench_decode_shape(pa, layout, seqs, ctx, timer, gen)
        if (seqs, ctx) in sweep_cands:
            recs = sweep(sweep_cands[(seqs, ctx)], run_candidate, failures, deadline)
            sweeps[row["shape"]] = recs
            ok = [r for r in recs if r["status"] == "ok"]
            row["best"] = min(ok, key=lambda r: r["us"]) if ok else None
            print_sweep(row["shape"], recs)
        rows.append(row)
        print(f"  {row['shape']}: default {row['default_us']:.1f} µs", flush=True)
    report["decode"] = rows
    report["sweeps"] = sweeps
    report["common_tile"] = common_tile(sweeps)
    report["recompile_check"] = recompile_check(pa, layout, gen)
    prefill_shapes = [(2, 32)] if args.smoke else PREFILL_SHAPES
    report["prefill"] = [bench_prefill(pa, layout, s, c, timer, gen) for s, c in prefill_shapes]
    report["seconds"] = time.perf_counter() - started
    print_report(report, layout)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {args.json}")


def sweep(
    cands: list[Candidate],
    run_candidate: Callable[[Candidate], dict],
    failures: dict[Candidate, str],
    deadline: float,
) -> list[dict]:
    """Every candidate's record; those that failed to compile, or past the deadline, unrun."""
    recs = []
    for cand in cands:
        if cand in failures:
            recs.append({**asdict(cand), "status": f"error: {failures[cand]}"})
        elif time.perf_counter() > deadline:
            recs.append({**asdict(cand), "status": "skipped: --sweep-seconds reached"})
        else:
            recs.append(run_candidate(cand))
    return recs


def spin_up(device: str, seconds: float = 0.5) -> None:
    """Busy the GPU for a moment so that the first figures see its working clocks, not idle."""
    if device != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
