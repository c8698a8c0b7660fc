"""LoRA's shrink and expand (Triton), grouped by segment as vLLM's: per request under an
adapter, its tokens times that adapter's slot of A, then of B.

Layout (``lora.step.build`` with ``segments``): ``segments`` is ``[3, S]`` int32, column s
being (first token, tokens, slot) of the s-th request that runs an adapter; tokens of other
requests are in no segment and untouched. Per projection, every slot's weights are stacked::

    a: [slots, in, W]   A^T of the projection's slices side by side (W = slices * max rank)
    b: [slots, W, out]  B^T, scaled

* ``lora_shrink``: ``h[t] = x[t] @ a[slot(t)]`` in float32, for the tokens of every segment
  (``h`` is zeroed by the caller; other rows stay zero);
* ``lora_expand``: ``y[t] += h[t] @ b[slot(t)]``, in place, rounded once to y's dtype.

One program computes one (segment, block of ``BLOCK_M`` of its tokens, block of ``BLOCK_N``
columns); blocks past a segment's end return at once, so the grid (segments x longest segment
x columns) costs the work of the tokens under adapters. The torch references, ``*_torch``,
gather each token's slot and multiply with ``einsum``. Tested under ``TRITON_INTERPRET=1`` and
compiled on an H200 (2026-12-04); the engine uses them only when ``PAGODA_LORA_TRITON=1`` until
their speed beside the batched torch path has been measured there.
"""

from __future__ import annotations

import torch

from services.engine.kernels import dot_modes, triton_only

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # CPU-only install: the engine's batched torch path
    triton = None


if triton is not None:

    @triton.jit
    def _shrink_kernel(
        x_ptr, a_ptr, h_ptr, seg_ptr, num_segs, in_features, width,
        x_stride, a_stride_s, a_stride_k, h_stride,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    ):
        seg = tl.program_id(0)
        start = tl.load(seg_ptr + seg).to(tl.int64)
        length = tl.load(seg_ptr + num_segs + seg)
        slot = tl.load(seg_ptr + 2 * num_segs + seg).to(tl.int64)
        m0 = tl.program_id(1) * BLOCK_M
        if m0 < length:
            offs_m = m0 + tl.arange(0, BLOCK_M)
            mask_m = offs_m < length
            rows = start + offs_m
            cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = cols < width
            ks = tl.arange(0, BLOCK_K)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, in_features, BLOCK_K):
                mask_k = ks < in_features - k0
                x = tl.load(x_ptr + rows[:, None] * x_stride + (k0 + ks)[None, :],
                            mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                a = tl.load(a_ptr + slot * a_stride_s + (k0 + ks)[:, None] * a_stride_k
                            + cols[None, :], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                if UPCAST_DOT:
                    x = x.to(tl.float32)
                    a = a.to(tl.float32)
                acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
            tl.store(h_ptr + rows[:, None] * h_stride + cols[None, :], acc,
                     mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _expand_kernel(
        h_ptr, b_ptr, y_ptr, seg_ptr, num_segs, width, out_features,
        h_stride, b_stride_s, b_stride_k, y_stride,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        seg = tl.program_id(0)
        start = tl.load(seg_ptr + seg).to(tl.int64)
        length = tl.load(seg_ptr + num_segs + seg)
        slot = tl.load(seg_ptr + 2 * num_segs + seg).to(tl.int64)
        m0 = tl.program_id(1) * BLOCK_M
        if m0 < length:
            offs_m = m0 + tl.arange(0, BLOCK_M)
            mask_m = offs_m < length
            rows = start + offs_m
            cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = cols < out_features
            ks = tl.arange(0, BLOCK_K)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, width, BLOCK_K):
                mask_k = ks < width - k0
                h = tl.load(h_ptr + rows[:, None] * h_stride + (k0 + ks)[None, :],
                            mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                b = tl.load(b_ptr + slot * b_stride_s + (k0 + ks)[:, None] * b_stride_k
                            + cols[None, :], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                acc = tl.dot(h, b.to(tl.float32), acc, input_precision="ieee")
            y_ptrs = y_ptr + rows[:, None] * y_stride + cols[None, :]
            mask = mask_m[:, None] & mask_n[None, :]
            y = tl.load(y_ptrs, mask=mask, other=0.0)
            tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)

    _DOT_MODES = dot_modes(isinstance(_shrink_kernel, InterpretedFunction))


_BLOCK_M = 16


def _block(n: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(n)))


@triton_only
def lora_shrink(x: torch.Tensor, a: torch.Tensor, segments: torch.Tensor, max_segment: int,
                h: torch.Tensor) -> None:
    """``h[t] = x[t] @ a[slot(t)]`` for every segment's tokens (see the module docstring)."""
    num_segs = segments.shape[1]
    if num_segs == 0:
        return
    in_features, width = a.shape[1], a.shape[2]
    block_n, block_k = _block(width, 64), _block(in_features, 32)
    precision, upcast = _DOT_MODES[x.dtype]
    grid = (num_segs, triton.cdiv(max_segment, _BLOCK_M), triton.cdiv(width, block_n))
    _shrink_kernel[grid](
        x, a, h, segments, num_segs, in_features, width,
        x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=precision, UPCAST_DOT=upcast, num_warps=4,
    )


@triton_only
def lora_expand(h: torch.Tensor, b: torch.Tensor, segments: torch.Tensor, max_segment: int,
                y: torch.Tensor) -> None:
    """``y[t] += h[t] @ b[slot(t)]`` for every segment's tokens, in place."""
    num_segs = segments.shape[1]
    if num_segs == 0:
        return
    width, out_features = b.shape[1], b.shape[2]
    block_n, block_k = _block(out_features, 64), _block(width, 32)
    grid = (num_segs, triton.cdiv(max_segment, _BLOCK_M), triton.cdiv(out_features, block_n))
    _expand_kernel[grid](
        h, b, y, segments, num_segs, width, out_features,
        h.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )


def check_lora_args(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: torch.Tensor,
                    y: torch.Tensor) -> None:
    """What the kernels index: rows of unit stride, every slot's weights contiguous, one
    width shared by a and b, segments as ``[3, S]`` int32."""
    assert x.dim() == 2 and x.stride(1) == 1 and y.dim() == 2 and y.stride(1) == 1
    assert a.is_contiguous() and b.is_contiguous(), "slot weights must be contiguous"
    assert a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1], "a, b: one slot count, width"
    assert x.shape[1] == a.shape[1] and y.shape[1] == b.shape[2]
    assert segments.dim() == 2 and segments.shape[0] == 3 and segments.dtype == torch.int32


# -- torch references ---------------------------------------------------------------------------


def token_slots(segments: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each token's slot (-1: in no segment)."""
    slots = torch.full((num_tokens,), -1, dtype=torch.long)
    for start, length, slot in segments.t().tolist():
        slots[start : start + length] = slot
    return slots


def lora_shrink_torch(x: torch.Tensor, a: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    slots = token_slots(segments, x.shape[0])
    on = slots >= 0
    h = torch.zeros(x.shape[0], a.shape[2], dtype=torch.float32)
    h[on] = torch.einsum("ti,tiw->tw", x[on].float(), a[slots[on]].float())
    return h


def lora_expand_torch(h: torch.Tensor, b: torch.Tensor, segments: torch.Tensor,
                      y: torch.Tensor) -> torch.Tensor:
    slots = token_slots(segments, h.shape[0])
    on = slots >= 0
    out = y.float().clone()
    out[on] += torch.einsum("tw,two->to", h[on], b[slots[on]].float())
    return out.to(y.dtype)
