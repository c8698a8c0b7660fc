"""Triton kernels against their torch references, on the CPU with ``TRITON_INTERPRET=1``.

Triton decides between compiling and interpreting when a ``@triton.jit`` function is defined,
i.e. when a kernel module is first imported (triton 3.9 reads ``TRITON_INTERPRET`` in its
``jit`` decorator, through ``triton.knobs``). In an ordinary pytest process some other test may
already have imported the kernel modules compiled, and flipping the variable afterwards changes
nothing. So the kernel tests run wherever the kernels really are interpreted (or on a CUDA
device if there is one), and otherwise ``test_kernels_under_the_interpreter`` re-runs this file
in a child pytest with the variable set from the start and asserts that it passed.

The attention contract's checks, the selector and the backend's plumbing run in the parent: they
never launch a kernel.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton")

from services.engine.attention.base import AttentionMetadata
from services.engine.attention.contract import AttentionContractError, check_kv_caches, check_step
from services.engine.attention.metadata import build_attention_metadata
from services.engine.attention.selector import BACKEND_NAMES, get_attention_backend
from services.engine.attention.torch_backend import TorchAttentionBackend
from services.engine.attention.triton_backend import TritonAttentionBackend
from services.engine.kernels import kv_store, paged_attention, rmsnorm
from tests.engine.test_attention_torch import Batch, make_batch
from tests.support.attention import attend
from tests.support.triton_child import kernel_device, run_under_interpreter

_CHILD_ENV = "PAGODA_TRITON_INTERPRETER_CHILD"
INTERPRETED, DEVICE = kernel_device(
    (
        kv_store._store_kv_kernel,
        paged_attention._decode_kernel,
        paged_attention._merge_splits_kernel,
        paged_attention._prefill_kernel,
        rmsnorm._rms_norm_kernel,
    ),
    _CHILD_ENV,
)

needs_kernels = pytest.mark.skipif(
    DEVICE is None,
    reason="kernels are compiled in this process and there is no GPU; "
    "test_kernels_under_the_interpreter runs them in a child process",
)

# Per dtype: tolerance vs a float32 reference. The interpreter rounds fp32 -> bf16 by
# truncation (a GPU rounds to nearest), so bf16 allows a couple of its 2**-8 ulps.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = list(TOLERANCE)


# ---------------------------------------------------------------------- the child run


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CUDA is available: the kernel tests ran compiled here"
)
def test_kernels_under_the_interpreter() -> None:
    run_under_interpreter(__file__, _CHILD_ENV, "test_kernels_under_the_interpreter")


# ---------------------------------------------------------------------- helpers


def meta_to(meta: AttentionMetadata, device: str | torch.device) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping.to(device),
        cu_seqlens_q=meta.cu_seqlens_q.to(device),
        cu_seqlens_k=meta.cu_seqlens_k.to(device),
        context_lens=meta.context_lens.to(device),
        block_tables=meta.block_tables.to(device),
        max_seqlen_q=meta.max_seqlen_q,
        max_seqlen_k=meta.max_seqlen_k,
        query_lens=meta.query_lens,
        seq_lens=meta.seq_lens,
        block_size=meta.block_size,
    )


def to_device(batch: Batch, dtype: torch.dtype) -> Batch:
    """The batch on the kernels' device, its tensors rounded to ``dtype``."""
    dev = DEVICE or "cpu"
    return Batch(
        meta_to(batch.meta, dev),
        batch.query.to(dev, dtype),
        batch.k_cache.to(dev, dtype),
        batch.v_cache.to(dev, dtype),
        batch.keys,
        batch.values,
    )


def reference_attention(
    batch: Batch, scale: float, window: int | None = None, softcap: float | None = None
) -> torch.Tensor:
    """The torch backend on float32 CPU copies of the (already rounded) inputs."""
    return attend(
        TorchAttentionBackend(),
        batch.query.cpu().float(),
        batch.k_cache.cpu().float(),
        batch.v_cache.cpu().float(),
        meta_to(batch.meta, "cpu"),
        scale,
        window=window,
        softcap=softcap,
    )


def run_decode(batch: Batch, scale: float, num_splits: int | None) -> torch.Tensor:
    m = batch.meta
    return paged_attention.paged_decode_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        m.block_tables,
        m.context_lens,
        scale,
        max_context_len=m.max_seqlen_k,
        num_splits=num_splits,
    )


def run_prefill(
    batch: Batch, scale: float, context_lens: torch.Tensor | None = None
) -> torch.Tensor:
    m = batch.meta
    return paged_attention.paged_prefill_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        m.block_tables,
        m.context_lens if context_lens is None else context_lens,
        m.cu_seqlens_q,
        m.max_seqlen_q,
        scale,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.cpu().float(), expected.float(), atol=tol, rtol=tol)


# ---------------------------------------------------------------------- KV store


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_kv_heads, head_dim = 3, 24  # neither a power of two: the kernel pads and masks
    k_cache = torch.randn(5, 8, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(5, 8, num_kv_heads, head_dim, generator=gen).to(dtype)
    # Strided views of one fused tensor, as the model passes them.
    fused = torch.randn(6, 2 * num_kv_heads + 1, head_dim, generator=gen).to(dtype)
    key, value = fused[:, 1 : 1 + num_kv_heads], fused[:, 1 + num_kv_heads :]
    slots = torch.tensor([39, -1, 0, 17, 8, -1], dtype=torch.int32)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    TorchAttentionBackend().store_kv(key, value, expected_k, expected_v, slots)
    dev = DEVICE
    k_dev, v_dev = k_cache.to(dev), v_cache.to(dev)
    kv_store.store_kv(key.to(dev), value.to(dev), k_dev, v_dev, slots.to(dev))
    assert torch.equal(k_dev.cpu(), expected_k)
    assert torch.equal(v_dev.cpu(), expected_v)


# ---------------------------------------------------------------------- paged attention


DECODE_CASES = {
    # The benchmarked family's shape (Llama: group 4, head_dim 64), blocks of 16.
    "g4-d64-bs16": {"block_size": 16, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64},
    # Qwen-style group of 7 (padded to 16 rows and masked), head_dim 128, blocks of 32.
    "g7-d128-bs32": {"block_size": 32, "num_heads": 14, "num_kv_heads": 2, "head_dim": 128},
    # MHA (group 1), small blocks: eight block ids per 64-key tile.
    "g1-d32-bs8": {"block_size": 8, "num_heads": 3, "num_kv_heads": 3, "head_dim": 32},
    # A group wider than 16 rows: BLOCK_G grows to 32.
    "g20-d64-bs16": {"block_size": 16, "num_heads": 20, "num_kv_heads": 1, "head_dim": 64},
}
# One token, a block boundary, just past it, odd, several tiles, long (ten 64-key tiles).
DECODE_SEQ_LENS = [1, 16, 17, 45, 130, 613]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_matches_torch(case: str, dtype: torch.dtype) -> None:
    n = len(DECODE_SEQ_LENS)
    batch = make_batch(DECODE_SEQ_LENS, [1] * n, **DECODE_CASES[case], seed=1)
    batch = to_device(batch, dtype)
    expected = reference_attention(batch, 0.3)
    assert_close(run_decode(batch, 0.3, num_splits=1), expected, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [2, 7, 40])
def test_decode_split_context_matches_torch(num_splits: int, dtype: torch.dtype) -> None:
    # Each sequence splits its own context: 40 splits leave most of them empty (more splits
    # than 64-key tiles), and the short sequences' trailing splits must weigh nothing.
    batch = make_batch([3, 70, 129, 600], [1] * 4, block_size=16, num_heads=8, seed=2)
    batch = to_device(batch, dtype)
    out = run_decode(batch, 0.2, num_splits=num_splits)
    assert_close(out, reference_attention(batch, 0.2), dtype)


@needs_kernels
@pytest.mark.parametrize(
    "config",
    [
        # Tiles inside one block (the single block-id load), unpipelined, one warp.
        paged_attention.DecodeConfig(block_n=16, num_warps=1, num_stages=1),
        # 32-key tiles over 32-token blocks: one block per tile exactly.
        paged_attention.DecodeConfig(block_n=32, num_warps=2, num_stages=3),
        # 128-key tiles: four blocks of 32 per tile, the last ones past short contexts.
        paged_attention.DecodeConfig(block_n=128, num_warps=8, num_stages=4),
    ],
    ids=lambda c: f"n{c.block_n}-w{c.num_warps}-s{c.num_stages}",
)
def test_decode_configs_match_torch(config: paged_attention.DecodeConfig) -> None:
    """Every tile shape the benchmark sweeps computes the same function."""
    batch = make_batch([5, 32, 33, 200], [1] * 4, block_size=32, num_heads=8, seed=3)
    batch = to_device(batch, torch.float16)
    expected = reference_attention(batch, 0.25)
    for num_splits in (1, 3):
        out = paged_attention.paged_decode_attention(
            batch.query,
            batch.k_cache,
            batch.v_cache,
            batch.meta.block_tables,
            batch.meta.context_lens,
            0.25,
            num_splits=num_splits,
            config=config,
        )
        assert_close(out, expected, torch.float16)


def prefix_attention(batch: Batch, context_lens: list[int], scale: float) -> torch.Tensor:
    """Float64 attention of each sequence's query over the first ``context_lens[i]`` of its
    keys; zeros for an empty context (a padded CUDA-graph slot)."""
    group = batch.query.shape[1] // batch.keys[0].shape[1]
    outs = []
    for q, k, v, n in zip(batch.query.cpu(), batch.keys, batch.values, context_lens, strict=True):
        k = k[:n].double().repeat_interleave(group, dim=1)  # [n, H, D]
        v = v[:n].double().repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,khd->hk", q.double(), k) * scale).softmax(-1)
        outs.append(torch.einsum("hk,khd->hd", probs, v))
    return torch.stack(outs).float()


@needs_kernels
def test_decode_replays_one_launch_over_changing_contexts() -> None:
    """CUDA-graph style: fixed tensors, split count and output buffer; only the contents of
    context_lens change between calls (as a replayed graph sees them)."""
    longest = [300, 41, 170]
    batch = to_device(
        make_batch(longest, [1] * 3, block_size=16, num_heads=8, seed=4), torch.float32
    )
    lens = batch.meta.context_lens
    out = torch.full_like(batch.query, float("nan"))
    for step_lens in ([1, 41, 97], [300, 0, 170], [257, 16, 1]):
        lens.copy_(torch.tensor(step_lens, dtype=lens.dtype))
        paged_attention.paged_decode_attention(
            batch.query,
            batch.k_cache,
            batch.v_cache,
            batch.meta.block_tables,
            lens,
            0.3,
            num_splits=8,
            out=out,
        )
        assert_close(out, prefix_attention(batch, step_lens, 0.3), torch.float32)


def test_decode_split_plan() -> None:
    """The split count fills the GPU for small batches, stops at short contexts, never for big
    batches, and never depends on anything but its arguments (a CUDA graph fixes it)."""
    plan = paged_attention.decode_num_splits
    assert plan(128, 8, 1024) == 1  # 1,024 programs already
    assert plan(32, 8, 4096) == 4
    assert plan(1, 8, 1024) == 32  # the most splits; 32 keys each
    assert plan(1, 8, 320) == 10  # bounded by min_split_tokens (32)
    assert plan(4, 8, 1) == 1
    config = paged_attention.DecodeConfig(target_programs=64, min_split_tokens=16, max_splits=4)
    assert plan(1, 8, 1024, config=config) == 4
    with pytest.raises(ValueError, match="block_n"):
        paged_attention.DecodeConfig(block_n=48)


def test_decode_config_table() -> None:
    """Measured entries are found by the padded query rows; anything else gets the default."""
    config = paged_attention.decode_config
    bf16 = torch.bfloat16
    assert config(64, 4, bf16) == config(64, 7, bf16) == config(64, 16, torch.float16)
    assert config(64, 4, bf16).num_warps == 1
    assert config(128, 8, bf16).num_warps == 2
    assert config(64, 4, torch.float32) == config(80, 4, bf16) == paged_attention.DecodeConfig()
    assert config(64, 20, bf16) == paged_attention.DecodeConfig()


PREFILL_CASES = {
    "no-prefix": ([5, 19, 32], [5, 19, 32], 16),
    "cached-prefix": ([29, 32, 45], [10, 16, 3], 8),
    "mixed-with-decodes": ([20, 37, 9, 12, 3], [1, 12, 1, 12, 3], 8),
    "several-row-tiles": ([90], [70], 16),  # 70 rows: two BLOCK_M tiles, a prefix of 20
}


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_matches_torch(case: str, dtype: torch.dtype) -> None:
    seq_lens, query_lens, block_size = PREFILL_CASES[case]
    batch = make_batch(seq_lens, query_lens, block_size=block_size, num_heads=6, seed=3)
    batch = to_device(batch, dtype)
    assert_close(run_prefill(batch, 0.25), reference_attention(batch, 0.25), dtype)


# (window, softcap): Mistral-like windows (narrower than a block, a tile, several tiles, wider
# than every context), Gemma 2's cap alone and with a window.
WINDOW_CASES = [(1, None), (5, None), (37, None), (1000, None), (None, 2.0), (19, 0.5)]


@needs_kernels
@pytest.mark.parametrize(
    ("window", "softcap", "dtype"),
    [(w, c, torch.float32) for w, c in WINDOW_CASES] + [(19, 0.5, torch.bfloat16)],
)
def test_decode_window_and_softcap_match_torch(
    window: int | None, softcap: float | None, dtype: torch.dtype
) -> None:
    seq_lens = [1, 16, 17, 45, 300]  # windows inside a tile, across tiles and splits
    batch = make_batch(seq_lens, [1] * len(seq_lens), block_size=16, seed=6)
    batch = to_device(batch, dtype)
    expected = reference_attention(batch, 0.3, window, softcap)
    m = batch.meta
    for num_splits in (1, 3, None):  # None: planned from the window, not the whole context
        out = paged_attention.paged_decode_attention(
            batch.query, batch.k_cache, batch.v_cache, m.block_tables, m.context_lens, 0.3,
            max_context_len=m.max_seqlen_k, num_splits=num_splits, window=window, softcap=softcap,
        )  # fmt: skip
        assert_close(out, expected, dtype)


@needs_kernels
@pytest.mark.parametrize(("window", "softcap"), WINDOW_CASES)
@pytest.mark.parametrize("case", ["cached-prefix", "mixed-with-decodes", "several-row-tiles"])
def test_prefill_window_and_softcap_match_torch(
    case: str, window: int | None, softcap: float | None
) -> None:
    seq_lens, query_lens, block_size = PREFILL_CASES[case]
    batch = make_batch(seq_lens, query_lens, block_size=block_size, num_heads=6, seed=7)
    batch = to_device(batch, torch.float32)
    m = batch.meta
    out = paged_attention.paged_prefill_attention(
        batch.query, batch.k_cache, batch.v_cache, m.block_tables, m.context_lens,
        m.cu_seqlens_q, m.max_seqlen_q, 0.25, window=window, softcap=softcap,
    )  # fmt: skip
    assert_close(out, reference_attention(batch, 0.25, window, softcap), torch.float32)


@needs_kernels
def test_window_comparison_catches_an_off_by_one_window() -> None:
    """The harness is sensitive: a window one key wider than the reference's fails."""
    batch = to_device(make_batch([29, 32], [10, 1], block_size=8, seed=4), torch.float32)
    m = batch.meta
    out = paged_attention.paged_prefill_attention(
        batch.query, batch.k_cache, batch.v_cache, m.block_tables, m.context_lens,
        m.cu_seqlens_q, m.max_seqlen_q, 0.25, window=6,
    )  # fmt: skip
    with pytest.raises(AssertionError):
        assert_close(out, reference_attention(batch, 0.25, window=5), torch.float32)


@needs_kernels
def test_comparison_catches_a_wrong_causal_offset() -> None:
    """The harness is sensitive: shifting every context by one (a mask off by one) fails."""
    batch = to_device(make_batch([29, 32], [10, 16], block_size=8, seed=4), torch.float32)
    out = run_prefill(batch, 0.25, context_lens=batch.meta.context_lens - 1)
    with pytest.raises(AssertionError):
        assert_close(out, reference_attention(batch, 0.25), torch.float32)


@needs_kernels
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (6, None), (None, 1.0)])
def test_triton_backend_over_steps_matches_torch(window: int | None, softcap: float | None) -> None:
    """store_kv + forward through real metadata: prefill, mixed chunk + decode, decode only
    (with a sliding window and a soft-cap passed through the backend, as layers pass them)."""
    gen = torch.Generator().manual_seed(5)
    block_size, num_heads, num_kv_heads, head_dim = 8, 6, 2, 16
    shape = (12, block_size, num_kv_heads, head_dim)
    caches = {name: (torch.zeros(shape), torch.zeros(shape)) for name in ("torch", "triton")}
    caches["triton"] = tuple(c.to(DEVICE) for c in caches["triton"])
    backends = {"torch": TorchAttentionBackend(), "triton": TritonAttentionBackend()}
    tables = [[3, 9, 0, 5], [11, 1, 7]]
    done = [0, 0]
    for q_lens in ([13, 1], [9, 1], [1, 1], [1, 1]):
        seq_lens = [d + q for d, q in zip(done, q_lens, strict=True)]
        meta, _ = build_attention_metadata(tables, seq_lens, q_lens, block_size)
        # Strided views of one fused projection, as the model passes them.
        qkv = torch.randn(sum(q_lens), num_heads + 2 * num_kv_heads, head_dim, generator=gen)
        q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        outs = {}
        for name, backend in backends.items():
            k_cache, v_cache = caches[name]
            dev = k_cache.device
            step_meta = meta_to(meta, dev)
            backend.store_kv(k.to(dev), v.to(dev), k_cache, v_cache, step_meta.slot_mapping)
            outs[name] = attend(
                backend, q.to(dev), k_cache, v_cache, step_meta, 0.25, window=window,
                softcap=softcap,
            ).cpu()
        assert_close(outs["triton"], outs["torch"], torch.float32)
        done = seq_lens


@needs_kernels
def test_gemma2_on_the_triton_backend_matches_the_torch_backend(tiny_model_dir) -> None:
    """A whole model whose layers alternate a 6-token window and full attention, scores
    soft-capped: prefill, a chunk over the cached prefix, then decodes, through the kernels."""
    from services.engine.models.loader import load_model

    path = tiny_model_dir(
        "Gemma2ForCausalLM",
        sliding_window=6,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=3.0,
    )
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = {}
    for name, backend, dev in (
        ("torch", TorchAttentionBackend(), "cpu"),
        ("triton", TritonAttentionBackend(), DEVICE),
    ):
        model = load_model(path, device=dev, attn_backend=backend)
        cfg = model.config
        shape = (8, 8, cfg.num_kv_heads, cfg.head_dim)
        kv = [(torch.zeros(shape, device=dev), torch.zeros(shape, device=dev)) for _ in range(2)]
        outs, done = [], 0
        for n in (17, 10, 1, 1, 1):
            meta, positions = build_attention_metadata([[5, 1, 7, 2]], [done + n], [n], 8, dev)
            model.plan_attention(meta)
            with torch.inference_mode():
                hidden = model(torch.tensor(ids[done : done + n], device=dev), positions, kv, meta)
                outs.append(model.compute_logits(hidden).cpu())
            done += n
        logits[name] = torch.cat(outs)
    assert_close(logits["triton"], logits["torch"], torch.float32)


# ---------------------------------------------------------------------- RMSNorm


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    wide = torch.randn(4, 3, 100, generator=gen).to(dtype)
    x = wide[..., :72]  # strided rows, hidden size not a power of two
    weight = torch.randn(72, generator=gen).to(dtype)
    out = rmsnorm.rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, rmsnorm.rms_norm_reference(x, weight, 1e-5), dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 48, generator=gen).to(dtype)
    residual = torch.randn(5, 48, generator=gen).to(dtype)
    weight = torch.randn(48, generator=gen).to(dtype)
    expected_res = residual.clone()
    expected, _ = rmsnorm.fused_add_rms_norm_reference(x, expected_res, weight, 1e-6)
    res_dev = residual.to(DEVICE)
    out, returned = rmsnorm.fused_add_rms_norm(x.to(DEVICE), res_dev, weight.to(DEVICE), 1e-6)
    assert returned is res_dev  # updated in place, handed back for the next layer
    assert_close(res_dev, expected_res, dtype)
    assert_close(out, expected, dtype)


# ---------------------------------------------------------------------- no kernel launched


def test_what_the_kernels_cannot_take_is_rejected_once_not_per_call() -> None:
    """The wrappers do not validate per call: the caches are checked once at allocation and the
    metadata once per step (``attention.contract``), and those checks refuse what the kernels
    cannot take, as an internal error."""
    kc = torch.zeros(4, 8, 2, 16)
    layout = {"num_heads": 6, "num_kv_heads": 2, "head_dim": 16, "dtype": torch.float32}
    bad_caches = {
        "head_dim": ([(kc, kc)], {"head_dim": 8}),
        "heads": ([(kc, kc)], {"num_heads": 5}),
        "dtype": ([(kc, kc)], {"dtype": torch.float16}),
        "dtype the kernels lack": ([(kc.double(), kc.double())], {"dtype": torch.float64}),
        "cache layout": ([(kc[:, :, :1], kc)], {}),
        "non-contiguous cache": ([(kc.transpose(1, 2), kc.transpose(1, 2))], {}),
    }
    for name, (caches, changes) in bad_caches.items():
        with pytest.raises(AttentionContractError):
            check_kv_caches(caches, **{**layout, **changes})
            pytest.fail(f"no AttentionContractError for caches: {name}")
    meta, _ = build_attention_metadata([[0], [1], [2]], [3, 3, 3], [1, 1, 1], 8)
    bad_steps = {
        "one query per sequence": (meta, 2),
        "table dtype": (replace(meta, block_tables=meta.block_tables.float()), 3),
        "context_lens": (replace(meta, context_lens=meta.context_lens[:2]), 3),
        "cu_seqlens": (replace(meta, cu_seqlens_q=meta.cu_seqlens_q[:3]), 3),
        "table rows strided": (
            replace(meta, block_tables=meta.block_tables.repeat(1, 2)[:, ::2]),
            3,
        ),
        "slot count": (replace(meta, slot_mapping=meta.slot_mapping[:2]), 3),
    }
    for name, (step_meta, num_tokens) in bad_steps.items():
        with pytest.raises(AttentionContractError):
            check_step(step_meta, num_tokens, kc)
            pytest.fail(f"no AttentionContractError for step: {name}")


def test_what_the_wrappers_index_is_stated_by_check_helpers() -> None:
    """The wrappers check nothing per call (they run in every layer); what they index beyond
    the attention contract is stated by ``check_*`` helpers, which refuse the rest."""
    q = torch.zeros(3, 6, 16)
    tables = torch.zeros(3, 2, dtype=torch.int32)
    paged_attention.check_decode_args(q, tables, num_splits=2, out=torch.zeros_like(q))
    bad_decode = {
        "one query per sequence": ((q[:2], tables), {}),
        "head_dim stride": ((torch.zeros(3, 16, 6).transpose(1, 2), tables), {}),
        "no split": ((q, tables), {"num_splits": 0}),
        "out shape": ((q, tables), {"out": torch.zeros(3, 6, 8)}),
    }
    for name, (args, kwargs) in bad_decode.items():
        with pytest.raises(AssertionError):
            paged_attention.check_decode_args(*args, **kwargs)
            pytest.fail(f"no AssertionError for decode: {name}")
    with pytest.raises(AssertionError):
        paged_attention.check_prefill_args(q, out=q.double())
    kv_store.check_store_args(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16))
    with pytest.raises(AssertionError):
        kv_store.check_store_args(torch.zeros(3, 16, 2).transpose(1, 2), torch.zeros(3, 2, 16))
    rmsnorm.check_norm_args(torch.zeros(2, 8), torch.zeros(8), torch.zeros(2, 8))
    with pytest.raises(AssertionError):
        rmsnorm.check_norm_args(torch.zeros(2, 8), torch.zeros(7))
    with pytest.raises(AssertionError):
        rmsnorm.check_norm_args(torch.zeros(2, 8), torch.zeros(8), torch.zeros(3, 8))
    with pytest.raises(AssertionError):  # a residual that cannot be updated through a view
        rmsnorm.check_norm_args(
            torch.zeros(2, 3, 8), torch.zeros(8), torch.zeros(3, 2, 8).transpose(0, 1)
        )


def test_selector_picks_torch_or_the_cpu_kernels_off_cuda() -> None:
    # The CPU backend's own choice is tested in test_cpu_kernels.py.
    assert get_attention_backend("cpu").name in ("cpu", "torch")
    assert get_attention_backend(torch.device("cpu"), "torch").name == "torch"


def test_selector_picks_triton_on_cuda() -> None:
    # Constructing a backend touches no device, so this runs without a GPU.
    assert get_attention_backend("cuda").name == "triton"
    assert get_attention_backend("cuda:0", "Torch").name == "torch"


def test_selector_falls_back_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.engine.attention import selector

    monkeypatch.setattr(selector, "triton_available", lambda: False)
    assert get_attention_backend("cuda").name == "torch"
    with pytest.raises(ValueError, match="triton package"):
        get_attention_backend("cuda", "triton")


def test_selector_rejects_unknown_and_unusable_names(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError) as err:
        get_attention_backend("cpu", "flash")
    for name in BACKEND_NAMES:
        assert name in str(err.value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        get_attention_backend("cpu", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_attention_backend("cpu", "triton").name == "triton"
