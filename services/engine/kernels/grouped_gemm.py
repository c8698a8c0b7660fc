"""The experts' grouped matmul (Triton): each row of an expert-sorted layout times its expert's
weight, with every shape fixed by the step's token count (CUDA-graph safe, no host sync).

Layout (built on the device by ``models.experts.expert_blocks``): the step's (token, choice)
pairs, ``P = tokens * top_k`` of them, sorted by expert and each expert's run padded to a
multiple of ``block_m`` rows::

    row         0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 ...        (block_m = 4)
    pairs       3  6  P  P | 0  1  4  7 | 9  P  P  P | P ...         P marks padding
    block       expert 0   | expert 2   | expert 2   | -1: unused

``pairs[r]`` is the pair in row r (``P`` in padding rows) and ``block_experts[b]`` the expert of
rows ``[b * block_m, (b + 1) * block_m)``, -1 for the blocks past the used ones. The row count is
the most the step can need, ``(P + min(E, P) * (block_m - 1)) // block_m`` blocks, whatever the
routing: the launch depends on shapes only, and the unused blocks' programs return at once, so
the work is that of the routed pairs plus under a block of padding per active expert.

One program computes one (block, tile of ``BLOCK_N`` output columns):
``out[rows] = a[src(rows)] @ weight[expert].T`` in float32, rounded once to a's dtype (as a GEMM
library does). ``src`` is ``pairs // top_k`` (gathering each pair's token row from the hidden
states) or the row itself (``top_k`` 0: the rows of the previous grouped matmul). Padding rows
and the rows of unused blocks get zeros, so every row of the output is defined (the activation
between the two matmuls runs over all of them).

The torch reference is ``models.experts.grouped_gemm_torch`` (beside the layout's builder, so
that CPU-only code never imports this module). The tile shape is a first choice, not tuned on a
GPU yet.
"""

from __future__ import annotations

import torch

from services.engine.kernels import dot_modes, triton_only

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # CPU-only install: the CPU engine groups experts on the host
    triton = None


if triton is not None:

    @triton.jit(do_not_specialize=["num_pairs"])
    def _grouped_gemm_kernel(
        out_ptr,  # [R, N]
        a_ptr,  # [tokens, K] (gathered through pairs) or [R, K]
        w_ptr,  # [E, N, K]
        pairs_ptr,  # [R]
        block_experts_ptr,  # [R // BLOCK_M]
        num_pairs,
        n_cols,
        k_dim,
        a_stride,
        w_stride_e,
        w_stride_n,
        out_stride,
        TOP_K: tl.constexpr,  # > 0: a's row is pairs // TOP_K; 0: the row itself
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
    ):
        block = tl.program_id(0).to(tl.int64)
        expert = tl.load(block_experts_ptr + block).to(tl.int64)
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if expert >= 0:  # blocks past the used ones only write their zeros
            pairs = tl.load(pairs_ptr + rows).to(tl.int64)
            valid = pairs < num_pairs
            if TOP_K > 0:
                src = pairs // TOP_K
            else:
                src = rows
            ks = tl.arange(0, BLOCK_K)
            a_ptrs = a_ptr + src[:, None] * a_stride + ks[None, :]
            w_ptrs = w_ptr + expert * w_stride_e + cols[None, :].to(tl.int64) * w_stride_n
            w_ptrs = w_ptrs + ks[:, None]
            for k0 in range(0, k_dim, BLOCK_K):
                k_mask = ks < k_dim - k0
                a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                if UPCAST_DOT:
                    a = a.to(tl.float32)
                    w = w.to(tl.float32)
                acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
        out_ptrs = out_ptr + rows[:, None] * out_stride + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_mask[None, :])

    # (tl.dot precision, bf16 upcast) per dtype, fixed by how the kernel was defined.
    _DOT_MODES = dot_modes(isinstance(_grouped_gemm_kernel, InterpretedFunction))


@triton_only
def grouped_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    pairs: torch.Tensor,
    block_experts: torch.Tensor,
    *,
    block_m: int,
    num_pairs: int,
    top_k: int,
) -> torch.Tensor:
    """``[R, N]``: row r is ``a[src(r)] @ weight[e(r)].T`` (see the module docstring).

    ``a``: ``[tokens, K]`` when ``top_k`` > 0 (rows gathered by ``pairs // top_k``), else
    ``[R, K]``; unit stride over K. ``weight``: contiguous ``[E, N, K]``. ``pairs``: ``[R]``,
    ``block_experts``: ``[R // block_m]`` (``check_grouped_gemm_args``).
    """
    num_rows = pairs.shape[0]
    num_cols, k_dim = weight.shape[1], weight.shape[2]
    out = torch.empty((num_rows, num_cols), dtype=a.dtype, device=a.device)
    if num_rows == 0:
        return out
    block_n = min(64, max(16, triton.next_power_of_2(num_cols)))
    block_k = min(32 if a.dtype == torch.float32 else 64, max(16, triton.next_power_of_2(k_dim)))
    precision, upcast = _DOT_MODES[a.dtype]
    _grouped_gemm_kernel[(num_rows // block_m, triton.cdiv(num_cols, block_n))](
        out,
        a,
        weight,
        pairs,
        block_experts,
        num_pairs,
        num_cols,
        k_dim,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        TOP_K=top_k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION=precision,
        UPCAST_DOT=upcast,
        num_warps=4,
    )
    return out


def check_grouped_gemm_args(
    a: torch.Tensor,
    weight: torch.Tensor,
    pairs: torch.Tensor,
    block_experts: torch.Tensor,
    *,
    block_m: int,
    top_k: int,
) -> None:
    """What ``grouped_gemm`` indexes: a and the weights unit-strided over K and of one K, the
    weights contiguous, ``block_m`` rows per block (a power of two >= 16, for tl.dot), and
    without gathering (``top_k`` 0) one row of ``a`` per row of the layout."""
    assert a.dim() == 2 and a.stride(1) == 1, "a must be [rows, K] with unit-stride rows"
    assert weight.dim() == 3 and weight.is_contiguous(), "weight must be a contiguous [E, N, K]"
    assert a.shape[1] == weight.shape[2], "a's columns must be the weights' K"
    assert block_m >= 16 and block_m & (block_m - 1) == 0, "block_m: a power of two >= 16"
    assert pairs.shape == (block_experts.shape[0] * block_m,), "pairs: block_m rows per block"
    assert top_k > 0 or a.shape[0] == pairs.shape[0], "without gathering, a is the layout's rows"
