"""4-bit weights (GPTQ, AWQ) on a GPU from their nibbles: a Triton kernel that dequantizes in
registers, so each step reads a quarter of bf16's weight bytes.

Layout at load (``TritonWeight``): ``qw`` int32 ``[in / 8, out]``, input ``k`` in bits
``4 (k % 8) .. 4 (k % 8) + 3`` of row ``k // 8`` (GPTQ's own ``qweight`` layout; AWQ's values are
repacked into it), and per group and output a float32 scale and zero point times scale, so
``w[k, o] = q[k, o] * scale[g, o] - zs[g, o]`` with ``g = k // group``. An act-order checkpoint's
inputs are sorted by group first and the activations' columns gathered in that order each step,
as on the CPU (``w4a16_cpu``).

One program computes a ``BLOCK_M x BLOCK_N`` tile of the output: per ``BLOCK_K`` inputs it loads
the activations, the packed words (each word serves its eight inputs), shifts out the nibbles,
scales them and multiplies with ``tl.dot`` into a float32 accumulator; the result is rounded to
the activations' dtype once.

Tested under ``TRITON_INTERPRET=1`` against the dequantized weight's product, and compiled on an
H200 (2026-12-04: its tests, and an engine's greedy tokens equal to the dequantized reference's),
so a GPU engine uses it by default; ``PAGODA_W4A16_TRITON=0`` dequantizes the 4-bit weights once
at load into the model's dtype instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from services.engine.kernels import dot_modes, triton_only
from services.engine.quantization.base import LinearMethod

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # CPU-only install
    triton = None

TRITON_ENV = "PAGODA_W4A16_TRITON"


def wanted(device: torch.device) -> bool:
    """Whether a 4-bit layer on ``device`` runs this kernel: on a GPU, unless turned off."""
    return (device.type == "cuda" and os.environ.get(TRITON_ENV, "1") != "0"
            and triton is not None)


if triton is not None:

    @triton.jit
    def _w4a16_kernel(
        x_ptr, q_ptr, s_ptr, zs_ptr, y_ptr, M, N, K, group, x_stride, y_stride,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            mask_k = k < K
            x = tl.load(x_ptr + offs_m[:, None] * x_stride + k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            mask_w = mask_k[:, None] & mask_n[None, :]
            word = tl.load(q_ptr + (k // 8)[:, None] * N + offs_n[None, :], mask=mask_w, other=0)
            nibble = (word >> ((k % 8) * 4)[:, None]) & 0xF
            at = (k // group)[:, None] * N + offs_n[None, :]
            scale = tl.load(s_ptr + at, mask=mask_w, other=0.0)
            zs = tl.load(zs_ptr + at, mask=mask_w, other=0.0)
            w = nibble.to(tl.float32) * scale - zs
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        tl.store(y_ptr + offs_m[:, None] * y_stride + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    _PRECISION = dot_modes(isinstance(_w4a16_kernel, InterpretedFunction))[torch.float32][0]


@dataclass(frozen=True, slots=True)
class TritonWeight:
    qw: torch.Tensor  # int32 [in / 8, out]
    scale: torch.Tensor  # float32 [groups, out]
    zs: torch.Tensor  # float32 [groups, out]: zero point times scale
    group: int  # inputs per group
    perm: torch.Tensor | None  # int64 [in]: the input column each kernel row reads


def triton_weight(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                  groups: torch.Tensor) -> TritonWeight | None:
    """From the unpacked ``q`` ``[in, out]`` (0..15), ``zeros``/``scales`` ``[G, out]`` and each
    input's group; None when the groups are not of one size (or the inputs not whole words)."""
    inp, out = q.shape
    n_groups = scales.shape[0]
    if inp % 8 or inp % n_groups:
        return None
    order = torch.argsort(groups, stable=True)
    group = inp // n_groups
    if not torch.equal(groups[order], torch.arange(inp, device=groups.device) // group):
        return None
    identity = torch.equal(order, torch.arange(inp, device=order.device))
    q = q if identity else q.index_select(0, order)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    words = (q.to(torch.int32).view(inp // 8, 8, out) << shifts[None, :, None]).sum(1)
    scale = scales.float().contiguous()
    return TritonWeight(qw=words.to(torch.int32).contiguous(), scale=scale,
                        zs=(zeros.float() * scale).contiguous(), group=group,
                        perm=None if identity else order)


@triton_only
def w4a16_linear(x: torch.Tensor, w: TritonWeight) -> torch.Tensor:
    """``x`` ``[T, in]`` times the 4-bit weight, ``[T, out]`` in ``x``'s dtype."""
    if w.perm is not None:
        x = x.index_select(-1, w.perm)
    x = x.contiguous()
    rows, inp = x.shape
    out = w.qw.shape[1]
    y = torch.empty(rows, out, dtype=x.dtype, device=x.device)
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out, 64))
    _w4a16_kernel[grid](x, w.qw, w.scale, w.zs, y, rows, out, inp, w.group, x.stride(0),
                        y.stride(0), BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32,
                        DOT_PRECISION=_PRECISION, num_warps=4)
    return y


def w4a16_linear_torch(x: torch.Tensor, w: TritonWeight) -> torch.Tensor:
    """The reference: the weight dequantized in float32, then one product."""
    if w.perm is not None:
        x = x.index_select(-1, w.perm)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.qw.device)
    q = ((w.qw[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, w.qw.shape[1])
    at = torch.arange(q.shape[0], device=q.device) // w.group
    dense = q.float() * w.scale[at] - w.zs[at]
    return (x.float() @ dense).to(x.dtype)


class W4A16TritonMethod(LinearMethod):
    """A GPTQ or AWQ layer once loaded for the kernel: ``layer.w4`` is its ``TritonWeight``."""

    name = "w4a16-triton"

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        y = w4a16_linear(x, layer.w4)
        if bias is not None:
            y.add_(bias)
        return y


W4A16_TRITON = W4A16TritonMethod()


def gpu_weight(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
               groups: torch.Tensor) -> TritonWeight | None:
    """The kernel's layout when it is wanted here (``wanted``) and takes the layer, else
    None."""
    return triton_weight(q, zeros, scales, groups) if wanted(q.device) else None
