"""The GPU's expert path: the Triton grouped matmul against its torch reference, the device
routing through it, and whole MoE models on the Triton kernel set against transformers.

Run like ``test_triton_kernels.py``: compiled on a CUDA device when there is one, else on the
CPU under Triton's interpreter, re-running this file in a child pytest with
``TRITON_INTERPRET=1`` when this process imported the kernels compiled.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

triton = pytest.importorskip("triton")

from services.engine.attention.metadata import build_attention_metadata
from services.engine.attention.torch_backend import TorchAttentionBackend
from services.engine.kernels import activation, grouped_gemm
from services.engine.models.experts import expert_blocks, grouped_gemm_torch, routed_experts
from services.engine.models.layer_kernels import triton_kernels
from services.engine.models.loader import load_model
from tests.engine.test_model_families import FAMILIES, IDS, _naive_experts
from tests.engine.test_models import ATOL, BLOCK_SIZE, _hf_logits, _kv_caches, _random_ids
from tests.support.per_call import per_layer_work
from tests.support.triton_child import kernel_device, run_under_interpreter

_CHILD_ENV = "PAGODA_TRITON_MOE_INTERPRETER_CHILD"
INTERPRETED, DEVICE = kernel_device(
    (grouped_gemm._grouped_gemm_kernel, activation._silu_and_mul_kernel), _CHILD_ENV
)

needs_kernels = pytest.mark.skipif(
    DEVICE is None,
    reason="kernels are compiled in this process and there is no GPU; "
    "test_moe_kernels_under_the_interpreter runs them in a child process",
)
# Against a float32 reference. The interpreter truncates fp32 -> bf16 (a GPU rounds to
# nearest), so bf16 allows a couple of its 2**-8 ulps.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
ROUTINGS = {  # (tokens, top_k, experts, seed): all busy, some idle, one token (decode)
    "prefill": (37, 2, 8, 0),
    "idle-experts": (20, 2, 16, 1),
    "one-token": (1, 4, 8, 2),
}


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CUDA is available: the kernel tests ran compiled here"
)
def test_moe_kernels_under_the_interpreter() -> None:
    # The CUDA-only test would only skip there.
    run_under_interpreter(__file__, _CHILD_ENV, "test_moe_kernels_under_the_interpreter or on_cuda")


def _routing(num_tokens: int, top_k: int, num_experts: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices


@needs_kernels
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_grouped_gemm_matches_its_reference(routing: str, dtype: torch.dtype) -> None:
    num_tokens, top_k, num_experts, seed = ROUTINGS[routing]
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = 40, 24  # neither a multiple of the tiles: masked columns and K steps
    experts = _routing(num_tokens, top_k, num_experts, seed)
    blocks = expert_blocks(experts.to(DEVICE), num_experts, 16)
    layout = {"block_m": 16, "num_pairs": blocks.num_pairs}
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen).to(dtype).to(DEVICE)
    rows = torch.randn(blocks.pairs.shape[0], inter, generator=gen).to(dtype).to(DEVICE)
    down = torch.randn(num_experts, hidden, inter, generator=gen).to(dtype).to(DEVICE)
    for a, weight, top in ((x, gate_up, top_k), (rows, down, 0)):  # gathered, then direct
        args = (a, weight, blocks.pairs, blocks.block_experts)
        grouped_gemm.check_grouped_gemm_args(*args, block_m=16, top_k=top)
        out = grouped_gemm.grouped_gemm(*args, top_k=top, **layout)
        expected = grouped_gemm_torch(*args, top_k=top, **layout)
        assert out.shape == expected.shape and out.dtype == dtype
        tol = TOLERANCE[dtype] * max(1.0, float(expected.float().abs().max()))
        torch.testing.assert_close(out, expected, atol=tol, rtol=TOLERANCE[dtype])


def test_grouped_gemm_args_are_checked_by_their_helper() -> None:
    a, weight = torch.zeros(4, 8), torch.zeros(2, 6, 8)
    pairs, block_experts = torch.zeros(32, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    grouped_gemm.check_grouped_gemm_args(a, weight, pairs, block_experts, block_m=16, top_k=2)
    bad = {
        "strided a": (a.t().contiguous().t(), weight, pairs, 16, 2),
        "K mismatch": (torch.zeros(4, 7), weight, pairs, 16, 2),
        "block_m": (a, weight, pairs[:24], 12, 2),
        "pairs per block": (a, weight, pairs[:16], 16, 2),
        "direct rows": (a, weight, pairs, 16, 0),
    }
    for name, (a_, w_, p_, bm, top) in bad.items():
        with pytest.raises(AssertionError):
            grouped_gemm.check_grouped_gemm_args(a_, w_, p_, block_experts, block_m=bm, top_k=top)
            pytest.fail(f"no AssertionError for {name}")


@needs_kernels
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_device_routing_on_the_kernels_matches_a_per_token_loop(routing: str) -> None:
    num_tokens, top_k, num_experts, seed = ROUTINGS[routing]
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = 32, 16
    experts = _routing(num_tokens, top_k, num_experts, seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.3
    down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.3
    weights = torch.rand(num_tokens, top_k, generator=gen)
    expected = _naive_experts(x, gate_up, down, weights, experts).float()
    on_kernels = partial(routed_experts, gemm=grouped_gemm.grouped_gemm,
                         act=activation.silu_and_mul)
    args = (x, gate_up, down, weights, experts)
    out = on_kernels(*(t.to(DEVICE) for t in args))
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("name", ["mixtral-window", "qwen2-moe-shared"])
def test_moe_model_on_the_triton_kernels_matches_transformers(tiny_model_dir, name) -> None:
    """Every per-layer kernel of the GPU path (norms, RoPE, SiLU-and-mul, the experts routed on
    the device) in a whole model, attention aside: a prefill chunk, a second one, decodes; and
    no step imports anything or tests the device."""
    _, architecture, overrides = FAMILIES[IDS.index(name)]
    path = tiny_model_dir(architecture, **overrides)
    model = load_model(path, device=DEVICE, attn_backend=TorchAttentionBackend())
    model.use_kernels(triton_kernels())
    ids = _random_ids(256, 30, seed=6)
    ref = _hf_logits(path, ids)
    kv = [(k.to(DEVICE), v.to(DEVICE)) for k, v in _kv_caches(model)]
    done = 0
    for n in (17, 10, 1, 1, 1):
        meta, positions = build_attention_metadata(
            [[5, 1, 11]], [done + n], [n], BLOCK_SIZE, DEVICE
        )
        model.plan_attention(meta)  # once per step, as the runner does
        new_ids = torch.tensor(ids[done : done + n], device=DEVICE)
        with per_layer_work() as seen, torch.inference_mode():
            logits = model.compute_logits(model(new_ids, positions, kv, meta))
        # Allocating on x's device reads x.device; nothing else about the device is asked.
        assert [s for s in seen if not s.startswith("tensor.device")] == []
        assert (logits.cpu() - ref[done : done + n]).abs().max().item() < ATOL
        done += n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and sync checks need CUDA")
@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe-shared"])
def test_a_moe_block_on_cuda_syncs_nothing_and_replays_in_a_graph(tiny_model_dir, name) -> None:
    """On CUDA the whole block (router, device routing, experts, shared expert) runs with
    synchronising calls turned into errors, and one captured graph replays any routing exactly
    as eager execution computes it."""
    from services.engine.models.moe import SparseMoeBlock

    _, architecture, overrides = FAMILIES[IDS.index(name)]
    path = tiny_model_dir(architecture, **overrides)
    model = load_model(path, dtype=torch.bfloat16, device="cuda",
                       attn_backend=TorchAttentionBackend())  # fmt: skip
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    assert block.experts.kernels.name == "triton"
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = model.config.hidden_size

    def fresh() -> torch.Tensor:
        return torch.randn(8, hidden, device="cuda", generator=gen).to(torch.bfloat16)

    static = fresh()
    with torch.inference_mode():
        block(static)  # compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            block(static)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            block(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = block(static)
        for _ in range(3):
            static.copy_(fresh())
            graph.replay()
            assert torch.equal(captured, block(static))
