"""Rotate-half RoPE applied in place by one Triton kernel.

Layout: ``x`` is ``[T, heads, head_dim]`` with any token and head strides and a unit stride
over head_dim. The model passes a view of its fused qkv projection covering the q and k heads
together, so one launch rotates both and v (the rest of each row) is never touched. The table
is ``RotaryEmbedding.cos_sin``, a contiguous ``[max_positions, 2, head_dim]`` tensor in x's
dtype: ``[p, 0]`` holds ``cos`` over the full head_dim, ``[p, 1]`` the sine with its first half
negated. ``positions`` is ``[T]``, int64 or int32.

One program handles one (token, tile of ``BLOCK_H`` heads): it reads the token's cos/sin row
once and rotates every head of the tile. With ``x = [x1, x2]`` (the two halves), the rotation is
``x * cos + roll(x, d/2) * signed_sin``, i.e. ``[x1*c1 + x2*s1, x2*c2 + x1*s2]``; the kernel loads
both halves before storing either, so in place is safe.

Rounding: the torch path (``layers.apply_rotary``) rounds each product to the dtype, then the
sum; so does the kernel, and it is launched with floating-point fusion off, so float32 does not
turn ``a*b + c*d`` into a fused multiply-add either (one rounding fewer, measurably different
logits). The result equals the torch path exactly on a GPU.

CUDA graphs: the launch depends only on tensor shapes and strides (no host synchronisation,
no values read back). Positions are not bounds-checked on the device: they come from the
scheduler, which keeps them below ``max_position_embeddings`` (the table's length).

The wrapper runs once per layer and checks nothing: x is a view of the model's fused projection
and the table ``RotaryEmbedding``'s own buffer, both laid out as the kernel needs by
construction; ``check_rotary_args`` states what that is (the tests call it).
"""

from __future__ import annotations

import torch

from services.engine.kernels import triton_only

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: layers.apply_rotary's CPU/torch paths still work
    triton = None


_TILE_ELEMS = 2048  # elements of x per program: enough work to hide the table load

if triton is not None:

    @triton.jit
    def _round(v, dtype: tl.constexpr):
        """v rounded to dtype, kept in float32 (a no-op for float32), as torch's op would."""
        return v.to(dtype).to(tl.float32)

    @triton.jit
    def _rotary_kernel(
        x_ptr,
        cos_sin_ptr,
        positions_ptr,
        x_stride_t,
        x_stride_h,
        num_heads,
        HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_HALF)
        dim_mask = dims < HALF
        # int64 whatever positions' dtype: pos * row size may pass 2**31 for long tables.
        pos = tl.load(positions_ptr + token).to(tl.int64)
        cs_row = cos_sin_ptr + pos * (4 * HALF)  # a position's row is [cos | signed_sin]
        c1 = tl.load(cs_row + dims, mask=dim_mask, other=0.0).to(tl.float32)
        c2 = tl.load(cs_row + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)
        s1 = tl.load(cs_row + 2 * HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)
        s2 = tl.load(cs_row + 3 * HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)

        mask = (heads < num_heads)[:, None] & dim_mask[None, :]
        ptrs1 = x_ptr + token * x_stride_t + heads[:, None] * x_stride_h + dims[None, :]
        ptrs2 = ptrs1 + HALF
        x1 = tl.load(ptrs1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptrs2, mask=mask, other=0.0).to(tl.float32)
        dtype = x_ptr.dtype.element_ty
        out1 = _round(x1 * c1[None, :], dtype) + _round(x2 * s1[None, :], dtype)
        out2 = _round(x2 * c2[None, :], dtype) + _round(x1 * s2[None, :], dtype)
        tl.store(ptrs1, out1.to(dtype), mask=mask)
        tl.store(ptrs2, out2.to(dtype), mask=mask)


@triton_only
def apply_rotary_(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` ``[T, heads, head_dim]`` in place at ``positions`` and returns it (the
    arguments as ``check_rotary_args`` describes)."""
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0 or num_heads == 0:
        return x
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(num_heads), max(1, _TILE_ELEMS // (2 * block_half)))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _rotary_kernel[grid](
        x,
        cos_sin,
        positions,
        x.stride(0),
        x.stride(1),
        num_heads,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=4,
        enable_fp_fusion=False,  # float32: keep a*b + c*d as two rounded products and a sum
    )
    return x


def check_rotary_args(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> None:
    """What ``apply_rotary_`` indexes: x ``[T, heads, head_dim]`` with an even head_dim of unit
    stride, a contiguous ``[max_positions, 2, head_dim]`` table in x's dtype (the torch path
    rounds so) and ``[T]`` integer positions."""
    num_tokens, _, head_dim = x.shape
    assert x.stride(2) == 1 and head_dim % 2 == 0, "x needs an even head_dim of unit stride"
    assert cos_sin.is_contiguous() and cos_sin.shape[1:] == (2, head_dim), (
        "cos_sin must be a contiguous [max_positions, 2, head_dim] table"
    )
    assert cos_sin.dtype == x.dtype, "cos_sin must be in x's dtype (the torch path rounds so)"
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int64, torch.int32)
