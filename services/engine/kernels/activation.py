"""SiLU-and-mul (SwiGLU) on the fused ``[gate | up]`` projection, as one Triton kernel.

Layout: ``gate_up`` is ``[T, 2I]`` (any leading dims, rows of any stride, unit stride within a
row): columns ``[0, I)`` are the gate projection, ``[I, 2I)`` the up projection, as the loader
stacks them into ``gate_up_proj``. The result is a new contiguous ``[T, I]`` tensor in the
input dtype. One program handles one (row, column tile): it reads ``BLOCK`` gate and up values
and writes ``BLOCK`` outputs, so the pair costs one read of ``gate_up`` and one write, where
torch's ``F.silu(g) * u`` takes two kernels and an intermediate ``[T, I]`` tensor.

Rounding: the torch reference (HF's ``act_fn(gate) * up``, also the CPU path) runs ``F.silu``
in float32 and rounds it to the dtype, then multiplies two dtype values (in float32, rounded
once more). The kernel rounds at the same two points, so for bf16/fp16 it differs from torch
only where the float32 silu itself differs by an ulp across a rounding boundary. To make that
rare, compiled kernels use the same float32 arithmetic as torch's CUDA silu: libdevice's
``expf`` (what CUDA's ``expf`` is) and an IEEE division, not Triton's default fast ``exp2``
approximation and approximate division. The interpreter has no libdevice: there ``exp`` is
numpy's, an ulp or so away from torch's, which the tests tolerate.
"""

from __future__ import annotations

import torch

from services.engine.kernels import triton_only

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # CPU-only install: the CPU/torch paths (models.layer_kernels) still work
    triton = None


_MAX_BLOCK = 1024  # columns per program: wide enough for full-width loads, small for occupancy

if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(
        out_ptr,
        gate_up_ptr,
        gate_up_stride,
        out_stride,
        n_cols,  # I: half of gate_up's row
        BLOCK: tl.constexpr,
        LIBDEVICE_EXP: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # int64: row * stride can pass 2**31
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate_ptrs = gate_up_ptr + row * gate_up_stride + cols
        g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
        if LIBDEVICE_EXP:
            e = libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        # torch's silu: x / (1 + exp(-x)) in float32, IEEE-rounded division.
        silu = tl.math.div_rn(g, 1.0 + e)
        # Round silu to the dtype before the multiply, as F.silu's output is.
        silu = silu.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = (silu * u).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * out_stride + cols, y, mask=mask)

    # libdevice exists only for compiled kernels; the interpreter takes numpy's exp instead.
    _INTERPRETED = isinstance(_silu_and_mul_kernel, InterpretedFunction)


@triton_only
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]`` as a new ``[..., I]`` tensor.

    No host synchronisation and nothing that depends on tensor values: safe to capture in a
    CUDA graph (the grid depends only on the shape).
    """
    n_cols = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*gate_up.shape[:-1], n_cols), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] == 0 or n_cols == 0:
        return out
    block = min(_MAX_BLOCK, triton.next_power_of_2(n_cols))
    grid = (rows.shape[0], triton.cdiv(n_cols, block))
    _silu_and_mul_kernel[grid](
        out,
        rows,
        rows.stride(0),
        n_cols,  # out is contiguous: its row stride is I
        n_cols,
        BLOCK=block,
        LIBDEVICE_EXP=not _INTERPRETED,
        num_warps=4 if block >= 512 else 2,
        enable_fp_fusion=False,  # nothing to fuse here; explicit, as Triton 3.9 asks
    )
    return out
