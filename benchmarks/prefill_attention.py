"""Prefill attention on the CPU: the paged kernel's causal rows against torch's SDPA.

    .venv/bin/python benchmarks/prefill_attention.py [--threads N]

SmolLM2's head layout (9 query / 3 KV heads, head_dim 64), blocks of 16 scattered over the
pool. For each prompt length and dtype: the CPU backend's whole step (every prompt token a
causal row of the paged kernel, one call) against the torch backend's path on the same step
(the gather from the plain cache + one causal SDPA per prompt, as Pagoda ran prompts before
2026-12-01), and against bare SDPA on contiguous tensors (no gather). Prints ms per layer and
GFLOP/s (useful causal work: 4 * H * D * L * (L + 1) / 2 per prompt). Not a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_throughput import machine_line
from services.engine.attention.base import AttentionLayout
from services.engine.attention.cpu_backend import CpuAttentionBackend
from services.engine.attention.metadata import build_attention_metadata
from services.engine.attention.torch_backend import TorchAttentionBackend

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def timed(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def run(prompt_len: int, prompts: int, dtype: torch.dtype, reps: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(prompt_len)
    blocks_each = -(-prompt_len // BLOCK)
    num_blocks = prompts * blocks_each + 8
    order = torch.randperm(num_blocks, generator=gen)
    tables = [order[i * blocks_each : (i + 1) * blocks_each].tolist() for i in range(prompts)]
    meta, _ = build_attention_metadata(tables, [prompt_len] * prompts, [prompt_len] * prompts,
                                       BLOCK)
    tokens = prompts * prompt_len
    query = torch.randn(tokens, HEADS, DIM, generator=gen).to(dtype)
    key = torch.randn(tokens, KV_HEADS, DIM, generator=gen).to(dtype)
    value = torch.randn(tokens, KV_HEADS, DIM, generator=gen).to(dtype)
    cpu, ref = CpuAttentionBackend(), TorchAttentionBackend()
    device = torch.device("cpu")
    kc, vc = cpu.allocate_kv_cache(num_blocks, BLOCK, KV_HEADS, DIM, dtype, device)
    kr, vr = ref.allocate_kv_cache(num_blocks, BLOCK, KV_HEADS, DIM, dtype, device)
    cpu.store_kv(key, value, kc, vc, meta.slot_mapping)
    ref.store_kv(key, value, kr, vr, meta.slot_mapping)
    scale = DIM**-0.5
    # Each backend's plan of the step, built once (as the runner does), read by every call.
    layout = AttentionLayout(HEADS, KV_HEADS, dtype)
    meta_r = replace(meta)
    meta.plan, meta_r.plan = cpu.plan(meta, layout), ref.plan(meta_r, layout)
    got = cpu.forward(query, kc, vc, meta, scale)
    want = ref.forward(query, kr, vr, meta_r, scale)
    err = (got.float() - want.float()).abs().max().item()
    q = query[:prompt_len].view(prompt_len, KV_HEADS, HEADS // KV_HEADS, DIM).permute(1, 2, 0, 3)
    k = key[:prompt_len].permute(1, 0, 2).unsqueeze(1).expand(KV_HEADS, HEADS // KV_HEADS,
                                                              prompt_len, DIM)
    v = value[:prompt_len].permute(1, 0, 2).unsqueeze(1).expand_as(k)
    flops = 4 * HEADS * DIM * prompt_len * (prompt_len + 1) / 2 * prompts
    kernel_ms = timed(lambda: cpu.forward(query, kc, vc, meta, scale), reps)
    torch_ms = timed(lambda: ref.forward(query, kr, vr, meta_r, scale), reps)
    sdpa_ms = timed(lambda: [F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
                             for _ in range(prompts)], reps)
    return {"kernel_ms": kernel_ms, "torch_ms": torch_ms, "sdpa_ms": sdpa_ms,
            "gflops": flops / kernel_ms / 1e6, "sdpa_gflops": flops / sdpa_ms / 1e6,
            "max_abs_diff": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line(), f"threads: {torch.get_num_threads()}")
    print("| dtype | prompts x tokens | kernel rows (ms/layer) | torch backend: gather + SDPA "
          "| bare SDPA | kernel GFLOP/s | SDPA GFLOP/s | speed-up vs torch backend | max diff |")
    print("| --- " * 9 + "|")
    for dtype in (torch.float32, torch.bfloat16):
        for prompt_len, prompts in ((128, 7), (512, 2), (2048, 1)):
            r = run(prompt_len, prompts, dtype, args.reps)
            print(f"| {str(dtype).split('.')[1]} | {prompts} x {prompt_len} "
                  f"| {r['kernel_ms']:.2f} | {r['torch_ms']:.2f} | {r['sdpa_ms']:.2f} "
                  f"| {r['gflops']:.0f} | {r['sdpa_gflops']:.0f} "
                  f"| {r['torch_ms'] / r['kernel_ms']:.1f}x | {r['max_abs_diff']:.1e} |",
                  flush=True)


if __name__ == "__main__":
    main()
