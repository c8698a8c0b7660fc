"""W8A8 int8 on a GPU: a Triton kernel for ``w8a8_int8``'s one math, ``y = (q @ weight^T) *
scale * weight_scale``, with int8 operands, exact int32 sums (``tl.dot`` on int8: the tensor
cores' int8 path) and the scales applied in float32 in the same order as the torch path, so the
results are the same bit for bit. The rows are quantized by ``w8a8_int8.quantize_rows`` (torch).

``torch._int_mm`` would serve a GPU too, but cuBLAS refuses it for 16 rows or fewer (every
decode step of a small batch); the kernel takes any row count.

Tested under ``TRITON_INTERPRET=1`` against ``int8_linear_torch``, and compiled on an H200
(2026-12-04: its tests, and an engine's greedy tokens against the fake-quantized reference), so
a GPU engine serves W8A8 checkpoints with it by default; ``PAGODA_W8A8_TRITON=0`` refuses them
there as before.
"""

from __future__ import annotations

import os

import torch

from services.engine.kernels import triton_only

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install
    triton = None

TRITON_ENV = "PAGODA_W8A8_TRITON"


def allowed_on_gpu() -> bool:
    return os.environ.get(TRITON_ENV, "1") != "0" and triton is not None


if triton is not None:

    @triton.jit
    def _w8a8_kernel(
        q_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, M, N, K, q_stride, w_stride, y_stride,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            mask_k = k < K
            q = tl.load(q_ptr + offs_m[:, None] * q_stride + k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0)
            w = tl.load(w_ptr + offs_n[None, :] * w_stride + k[:, None],
                        mask=mask_k[:, None] & mask_n[None, :], other=0)
            acc = tl.dot(q, w, acc, out_dtype=tl.int32)
        xs = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
        ws = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
        y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
        tl.store(y_ptr + offs_m[:, None] * y_stride + offs_n[None, :], y,
                 mask=mask_m[:, None] & mask_n[None, :])


@triton_only
def int8_linear_triton(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                       scale_row: torch.Tensor) -> torch.Tensor:
    """Rows ``q`` ``[T, in]`` int8 with their ``scale`` ``[T, 1]``, times ``weight`` ``[out, in]``
    int8 with ``scale_row`` ``[out]`` -> float32 ``[T, out]``."""
    rows, inp = q.shape
    out = weight.shape[0]
    y = torch.empty(rows, out, dtype=torch.float32, device=q.device)
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out, 64))
    _w8a8_kernel[grid](q, weight, scale.reshape(-1).contiguous(), scale_row, y, rows, out, inp,
                       q.stride(0), weight.stride(0), y.stride(0),
                       BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32, num_warps=4)
    return y
