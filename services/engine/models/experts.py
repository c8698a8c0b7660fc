"""How a step's tokens reach their experts: grouped on the host (CPU) or on the device (GPU).

Both compute, for every token, the router-weighted sum of its ``top_k`` experts' SwiGLU outputs,
adding each token's contributions in expert order, as transformers does. Neither loops over
tokens::

    (token, choice) pairs      t0:e2 t0:e5 t1:e2 t2:e0 ...
    sorted by expert           e0:[t2]  e2:[t0 t1]  e5:[t0]      (experts with no token: no work)
    per expert                 [n_e, H] x [H, 2I], SwiGLU, [n_e, I] x [I, H]
    back to tokens             weighted by the router, summed per token in expert order

``grouped_experts`` (the CPU path) reads the expert counts on the host and runs one pair of
matmuls per active expert: free on the CPU, where there is no device to wait for and no CUDA
graph. ``routed_experts`` (the GPU path) never reads a value on the host and has no shape that
depends on one: the sort, the per-expert offsets and the padded layout (``expert_blocks``) are
built on the device, and a grouped matmul (``kernels.grouped_gemm``) whose launch depends only on
the token count skips the unused blocks on the device. So it runs inside a CUDA graph, and its
work is that of the routed pairs (plus under one block of padding per active expert), not of
every expert over every token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
Activation = Callable[[Tensor], Tensor]  # [rows, 2I] -> [rows, I]
# (x [T, H], gate_up [E, 2I, H], down [E, H, I], weights [T, K], experts [T, K]) -> [T, H]
ExpertsFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


class GroupedGemm(Protocol):
    """``kernels.grouped_gemm.grouped_gemm`` or its torch reference."""

    def __call__(
        self,
        a: Tensor,
        weight: Tensor,
        pairs: Tensor,
        block_experts: Tensor,
        *,
        block_m: int,
        num_pairs: int,
        top_k: int,
    ) -> Tensor: ...


# --------------------------------------------------------------------------- host (CPU)


def grouped_experts(
    x: Tensor,  # [T, H]
    gate_up: Tensor,  # [E, 2I, H]
    down: Tensor,  # [E, H, I]
    weights: Tensor,  # [T, K]
    experts: Tensor,  # [T, K]
    *,
    act: Activation,
) -> Tensor:
    """Tokens sorted by expert, one pair of matmuls per expert that got any (counts read on
    the host)."""
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # stable: each expert's tokens stay in order
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tokens = order // top_k
    rows = x.index_select(0, tokens)
    row_weights = weights.reshape(-1).index_select(0, order)[:, None]
    out_rows = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        h = act(F.linear(rows[start:end], gate_up[expert]))
        out_rows[start:end] = F.linear(h, down[expert]) * row_weights[start:end]
        start = end
    # Rows are expert-major: each token's contributions are added in expert order.
    return torch.zeros_like(x).index_add_(0, tokens, out_rows)


# --------------------------------------------------------------------------- device (GPU)


@dataclass(frozen=True, slots=True)
class ExpertBlocks:
    """A step's (token, choice) pairs sorted by expert, each expert's run padded to whole
    blocks (``kernels.grouped_gemm`` draws it). Every shape follows from the token count."""

    pairs: Tensor  # [R] int64: the pair (token * top_k + choice) in each row; num_pairs: padding
    pair_rows: Tensor  # [P] int64: the row of each pair (the inverse of ``pairs``)
    block_experts: Tensor  # [R // block_m] int64: each block's expert, -1 past the used blocks
    block_m: int
    num_pairs: int  # P = tokens * top_k
    top_k: int


def block_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per block for a step: 16 when experts get few rows each (decode), so padding stays
    small; 64 for prefills, which then reuse each weight tile over more rows. Two sizes only:
    the engine's warm-up (a full prefill and the decode graphs) compiles both kernel variants."""
    return 16 if num_pairs <= 32 * num_experts else 64


def expert_blocks(experts: Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """The padded expert-sorted layout of ``experts`` ``[T, K]``, built on its device without
    reading a value back: sizes come from T, K, E and ``block_m`` only."""
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    num_pairs = flat.shape[0]
    device = flat.device
    order = torch.argsort(flat, stable=True)  # sorted position -> pair
    sorted_experts = flat.index_select(0, order)
    # Where each expert's run starts in the sorted pairs (and where the last one ends).
    bounds = torch.searchsorted(
        sorted_experts, torch.arange(num_experts + 1, device=device, dtype=flat.dtype)
    )
    counts = bounds[1:] - bounds[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    rank = torch.arange(num_pairs, device=device) - bounds.index_select(0, sorted_experts)
    dest = (padded_end - padded).index_select(0, sorted_experts) + rank  # sorted pos -> row
    # At most one partly filled block per expert that got a pair.
    num_blocks = (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m
    pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    pairs.scatter_(0, dest, order)
    pair_rows = torch.empty(num_pairs, dtype=torch.int64, device=device).scatter_(0, order, dest)
    starts = torch.arange(num_blocks, device=device, dtype=torch.int64) * block_m
    block_experts = torch.searchsorted(padded_end, starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return ExpertBlocks(pairs, pair_rows, block_experts, block_m, num_pairs, top_k)


def routed_experts(
    x: Tensor,  # [T, H]
    gate_up: Tensor,  # [E, 2I, H]
    down: Tensor,  # [E, H, I]
    weights: Tensor,  # [T, K]
    experts: Tensor,  # [T, K]
    *,
    gemm: GroupedGemm,
    act: Activation,
) -> Tensor:
    """Routed on the device: no host sync, no value-dependent shape (CUDA-graph safe)."""
    num_tokens, top_k = experts.shape
    # Each token's choices in expert order, so its contributions are summed in that order.
    experts, perm = torch.sort(experts, dim=1)
    weights = weights.gather(1, perm)
    num_experts = gate_up.shape[0]
    blocks = expert_blocks(experts, num_experts, block_rows(num_tokens * top_k, num_experts))
    layout = (blocks.pairs, blocks.block_experts)
    sizes = {"block_m": blocks.block_m, "num_pairs": blocks.num_pairs}
    h = act(gemm(x, gate_up, *layout, top_k=top_k, **sizes))
    rows = gemm(h, down, *layout, top_k=0, **sizes)
    per_pair = rows.index_select(0, blocks.pair_rows).view(num_tokens, top_k, x.shape[1])
    # Weighted, rounded to the model dtype, then added one choice at a time, as transformers.
    weighted = (per_pair * weights[..., None]).to(x.dtype)
    out = weighted[:, 0]
    for choice in range(1, top_k):
        out = out + weighted[:, choice]
    return out


def grouped_gemm_torch(
    a: Tensor,
    weight: Tensor,
    pairs: Tensor,
    block_experts: Tensor,
    *,
    block_m: int,
    num_pairs: int,
    top_k: int,
) -> Tensor:
    """``kernels.grouped_gemm.grouped_gemm`` in torch: its reference, and the device path's
    matmul in the tests that run it without Triton. One batched matmul over per-block copies of
    the experts' weights: fine for tests, far too much memory for a real model."""
    num_blocks = block_experts.shape[0]
    valid = pairs < num_pairs
    if top_k > 0:
        src = torch.where(valid, pairs // top_k, 0)
    else:
        src = torch.arange(pairs.shape[0], device=pairs.device)
    rows = torch.where(valid[:, None], a.index_select(0, src), 0)  # padding rows: zeros
    rows = rows.view(num_blocks, block_m, a.shape[1])
    w = weight.index_select(0, block_experts.clamp(min=0))  # [blocks, N, K]
    w = torch.where((block_experts >= 0)[:, None, None], w, 0)  # unused blocks: zeros
    out = torch.bmm(rows.float(), w.float().transpose(1, 2))
    return out.view(pairs.shape[0], weight.shape[1]).to(a.dtype)
