"""The experts' device path (``models.experts.routed_experts``): its layout, and that it never
needs a value on the host.

Its matmul here is the torch reference (``grouped_gemm_torch``); the Triton kernel is held to
that reference in ``test_triton_moe.py``. Both paths against a per-token loop, and a whole MoE
model on the device path against transformers, are in ``test_model_families.py``.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from services.engine.models.experts import (
    block_rows,
    expert_blocks,
    grouped_experts,
    grouped_gemm_torch,
    routed_experts,
)
from services.engine.models.layer_kernels import silu_and_mul_torch

DEVICE_PATH = partial(routed_experts, gemm=grouped_gemm_torch, act=silu_and_mul_torch)
HOST_PATH = partial(grouped_experts, act=silu_and_mul_torch)


def _routing(num_tokens: int, top_k: int, num_experts: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices


def _inputs(num_tokens: int, top_k: int, num_experts: int, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = 16, 8
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.3).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.3).to(dtype)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return x, gate_up, down, weights, _routing(num_tokens, top_k, num_experts, seed)


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "block_m"),
    [(1, 2, 8, 16), (37, 2, 8, 16), (5, 8, 128, 16), (300, 4, 16, 32), (64, 1, 4, 64)],
)
def test_the_layout_holds_each_pair_once_in_its_experts_blocks(
    num_tokens: int, top_k: int, num_experts: int, block_m: int
) -> None:
    experts = _routing(num_tokens, top_k, num_experts, seed=num_tokens)
    blocks = expert_blocks(experts, num_experts, block_m)
    num_pairs = num_tokens * top_k
    flat = experts.reshape(-1)
    real = blocks.pairs < num_pairs
    # Every pair exactly once, and pair_rows its inverse.
    assert sorted(blocks.pairs[real].tolist()) == list(range(num_pairs))
    assert torch.equal(blocks.pairs[blocks.pair_rows], torch.arange(num_pairs))
    # Each row sits in a block of its pair's expert; within an expert, tokens keep their order.
    row_experts = blocks.block_experts.repeat_interleave(block_m)
    assert torch.equal(row_experts[real], flat[blocks.pairs[real]])
    for e in range(num_experts):
        pairs = blocks.pairs[real & (row_experts == e)]
        assert pairs.tolist() == sorted(pairs.tolist())
    # Used blocks first, each holding at least one pair; the rest marked -1 and empty.
    used = blocks.block_experts >= 0
    num_used = int(used.sum())
    assert used[:num_used].all() and not used[num_used:].any()
    assert real.view(-1, block_m).any(dim=1).tolist() == used.tolist()
    assert num_used == sum(-(-int((flat == e).sum()) // block_m) for e in range(num_experts))


def test_the_layout_is_sized_for_the_worst_routing() -> None:
    """The row count depends only on the shapes, and the worst routing (every active expert
    one pair past a whole block) fills it exactly."""
    num_experts, block_m, top_k = 4, 16, 1
    experts = torch.tensor([[e] for e in range(num_experts) for _ in range(block_m + 1)])
    blocks = expert_blocks(experts, num_experts, block_m)
    assert bool((blocks.block_experts >= 0).all())
    one_expert = expert_blocks(torch.zeros_like(experts), num_experts, block_m)
    assert one_expert.pairs.shape == blocks.pairs.shape  # same shapes, whatever the routing
    assert blocks.num_pairs == experts.shape[0] * top_k


def test_block_rows_grow_with_the_rows_per_expert() -> None:
    assert block_rows(num_pairs=2, num_experts=8) == 16  # decode
    assert block_rows(num_pairs=256 * 8, num_experts=128) == 16
    assert block_rows(num_pairs=40 * 8, num_experts=8) == 64
    assert block_rows(num_pairs=8192 * 8, num_experts=128) == 64


def test_the_device_path_needs_no_value_on_the_host() -> None:
    """Traced with fake tensors (no data at all), the device path goes through: no .item(),
    .tolist(), nonzero or shape taken from a value, so nothing syncs and a CUDA graph can
    capture it. The host path (the CPU's) cannot be traced so: it reads the expert counts."""
    args = _inputs(num_tokens=5, top_k=2, num_experts=6)
    graph = make_fx(DEVICE_PATH, tracing_mode="fake")(*args)
    ops = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert not {o for o in ops if "nonzero" in o or "_local_scalar_dense" in o or "aten.item" in o}
    assert "aten.sort.stable" in ops and "aten.searchsorted.Tensor" in ops
    with pytest.raises(Exception, match="data-dependent"):
        make_fx(HOST_PATH, tracing_mode="fake")(*args)


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_the_paths_agree_in_bfloat16_with_float32_router_weights(num_tokens: int) -> None:
    """Mixtral's router weights stay float32 while the model runs in bf16: both paths multiply
    in float32, round to bf16, and add each token's choices in expert order."""
    x, gate_up, down, weights, experts = _inputs(num_tokens, 2, 8, seed=4, dtype=torch.bfloat16)
    device = DEVICE_PATH(x, gate_up, down, weights, experts)
    host = HOST_PATH(x, gate_up, down, weights, experts)
    assert device.dtype == host.dtype == torch.bfloat16
    # The matmuls differ in how they accumulate (bmm over fp32 copies vs bf16 linear).
    torch.testing.assert_close(device, host, atol=2e-2, rtol=2e-2)
