"""Pagoda's C++ CPU kernels (``services.engine.cpu_ops``) against their torch references.

Each kernel replaces torch ops on the CPU hot path: the tests hold it to the reference's
rounding (exact where the reference rounds at the same points, a float32 reduction order
apart otherwise), for float32 and bfloat16, and over the shapes that pick its specialised and
generic code (block size 16 with head_dim 64/128 and query groups 1-8; anything else).
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from services.engine.attention import contract, selector
from services.engine.attention.cpu_backend import CpuAttentionBackend
from services.engine.attention.metadata import build_attention_metadata
from services.engine.attention.torch_backend import TorchAttentionBackend
from services.engine.cpu_ops import ops
from services.engine.cpu_ops.isa import cpu_flags
from services.engine.models import onednn
from services.engine.models.layer_kernels import rms_norm_torch
from services.engine.models.layers import Linear, RopeStep, apply_rotary
from tests.engine.test_attention_torch import make_batch, naive_attention
from tests.support.attention import attend

kernels = ops()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU kernels did not build here")

DTYPES = [torch.float32, torch.bfloat16]


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units of the last place of ``b``'s dtype (bf16: 2^-7 relative)."""
    eps = torch.finfo(b.dtype).eps
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-30)
    return int(((a.float() - b.float()).abs() / (scale * eps)).max().round())


# ------------------------------------------------------------------------------ build


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_no_kernel_helper_is_compiled_out_of_line() -> None:
    """Each kernel is cloned per ISA (AVX-512, AVX2, baseline); a helper it calls that the
    compiler leaves out of line is compiled once, for baseline x86-64, and the clone then runs
    SSE2 code (the decode kernel did, 2-4x slower)."""
    names = subprocess.run(["nm", "-C", kernels.__file__], capture_output=True, text=True,
                           check=True).stdout
    helpers = ("decode_task<", "fast_exp(", "norm_row<", "rope_row<", "silu_mul_row<",
               "bf16_to_f(", "f_to_bf16(", "prefetch_chunk<", "prefetch_chunk_l2<", "fast_log(",
               "mix64(")
    assert [h for h in helpers if h in names] == []


# ------------------------------------------------------------------------------ elementwise

# On CPUs with AVX512-BF16 the bfloat16 rows and the decode attention of both dtypes run in
# intrinsics; the portable loops are what every other CPU runs. Both are held to the
# reference here, on the same machine.
ROW_CASES = [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
             (torch.bfloat16, True)]


@pytest.fixture(params=ROW_CASES, ids=["fp32-portable", "fp32-avx512", "bf16-portable",
                                       "bf16-avx512"])
def row_dtype(request: pytest.FixtureRequest):
    dtype, fast = request.param
    was = kernels.use_avx512_bf16(fast)
    yield dtype
    kernels.use_avx512_bf16(was)


def test_the_avx512_bf16_rows_are_on_where_the_cpu_has_them() -> None:
    wanted = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
    has = wanted.issubset(cpu_flags())
    was = kernels.use_avx512_bf16(True)
    try:
        assert kernels.use_avx512_bf16(True) == has
        assert was == has  # the default: on wherever the CPU has them
    finally:
        kernels.use_avx512_bf16(was)


@pytest.mark.parametrize("width", [576, 100])  # whole vectors, and a tail
def test_rms_norm_matches_the_torch_reference(row_dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, width, generator=gen).to(row_dtype)
    weight = torch.randn(width, generator=gen).to(row_dtype)
    got = kernels.rms_norm(x, None, weight, 1e-5)
    # Both sum 576 squares in float32 but in different orders, and torch's order follows the
    # CPU's vector width: 2 ulps on AVX-512 machines, 3 on the AVX2-only kind.
    assert _ulps_apart(got, rms_norm_torch(x, weight, 1e-5)) <= 4


@pytest.mark.parametrize("width", [256, 72])
def test_rms_norm_adds_the_residual_in_place_first(row_dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, width, generator=gen).to(row_dtype)
    residual = torch.randn(9, width, generator=gen).to(row_dtype)
    weight = torch.randn(width, generator=gen).to(row_dtype)
    expected_residual = residual + x  # the reference's add_, rounded in dtype
    got = kernels.rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, expected_residual)
    assert _ulps_apart(got, rms_norm_torch(expected_residual, weight, 1e-6)) <= 2


def test_rms_norm_reads_rows_of_a_strided_view(row_dtype: torch.dtype) -> None:
    base = torch.randn(6, 128).to(row_dtype)
    x, weight = base[:, :64], torch.randn(64).to(row_dtype)
    got = kernels.rms_norm(x, None, weight, 1e-5)
    # Both sum 576 squares in float32 but in different orders, and torch's order follows the
    # CPU's vector width: 2 ulps on AVX-512 machines, 3 on the AVX2-only kind.
    assert _ulps_apart(got, rms_norm_torch(x, weight, 1e-5)) <= 4


@pytest.mark.parametrize("half", [96, 37])
def test_silu_and_mul_matches_the_torch_reference(row_dtype: torch.dtype, half: int) -> None:
    gate_up = (torch.randn(11, 2 * half) * 6).to(row_dtype)  # wide range: exp's tails too
    expected = F.silu(gate_up[:, :half]) * gate_up[:, half:]
    assert _ulps_apart(kernels.silu_and_mul(gate_up), expected) <= 2


@pytest.mark.parametrize("dim", [64, 128, 48])  # the vector path's sizes, and the loops'
def test_rotary_in_place_equals_the_reference_exactly(row_dtype: torch.dtype, dim: int) -> None:
    gen = torch.Generator().manual_seed(2)
    tokens, heads = 13, 5
    qkv = torch.randn(tokens, (heads + 2) * dim, generator=gen).to(row_dtype)
    qk = qkv[:, : heads * dim].view(tokens, heads, dim)  # a view with a token stride
    table = torch.randn(50, 2, dim, generator=gen).to(row_dtype)
    positions = torch.randint(0, 50, (tokens,), generator=gen)
    cs = table.index_select(0, positions)
    expected = apply_rotary(qk.clone(), RopeStep(positions, table, cs[:, 0:1], cs[:, 1:2]))
    untouched = qkv[:, heads * dim :].clone()
    kernels.rotary_(qk, table, positions)
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, heads * dim :], untouched)  # the rest of the row stays as it was


def test_rotary_refuses_a_position_outside_the_table() -> None:
    with pytest.raises(RuntimeError, match="position"):
        kernels.rotary_(torch.zeros(2, 1, 8), torch.zeros(4, 2, 8), torch.tensor([0, 4]))


# ------------------------------------------------------------------------------ attention


def _cpu_caches(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's caches re-laid in the CPU kernels' storage (same logical contents)."""
    nb, bs, kv_heads, dim = batch.k_cache.shape
    k, v = CpuAttentionBackend().allocate_kv_cache(nb, bs, kv_heads, dim, batch.k_cache.dtype,
                                                  torch.device("cpu"))
    k.copy_(batch.k_cache)
    v.copy_(batch.v_cache)
    return k, v


SHAPES = [  # (num_heads, num_kv_heads, head_dim, block_size): specialised and generic paths
    (9, 3, 64, 16),
    (8, 8, 64, 16),
    (16, 2, 128, 16),
    (32, 4, 128, 16),
    (10, 2, 64, 16),  # a group of 5: the AVX512-BF16 kernel's two-sum layout
    (6, 2, 32, 16),
    (4, 2, 16, 16),
    (6, 2, 48, 16),  # a head_dim without its own clone: the generic loops
    (4, 1, 64, 8),
    (12, 1, 64, 32),
]


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "bs"), SHAPES)
def test_decode_matches_dense_attention(row_dtype, heads, kv_heads, dim, bs) -> None:
    dtype = row_dtype  # both ways: the AVX512-BF16 kernels and the portable loops
    # Lengths on and around block edges, a single token, and a long context.
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 300]
    batch = make_batch(lens, [1] * len(lens), block_size=bs, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=dim, dtype=dtype, seed=heads + dim)
    k, v = _cpu_caches(batch)
    got = attend(CpuAttentionBackend(), batch.query, k, v, batch.meta, 0.3)
    expected = naive_attention(batch, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "bs"), SHAPES)
def test_prefill_rows_match_dense_causal_attention(row_dtype, heads, kv_heads, dim, bs) -> None:
    """Prompts go through the kernel as causal rows: a fresh prompt, a chunk over a cached
    prefix that ends mid-block, a two-token chunk and a decode, in one step."""
    dtype = row_dtype
    lens = [3 * bs + 5, 300, bs + 1, 40]
    q_lens = [3 * bs + 5, 41, 2, 1]
    batch = make_batch(lens, q_lens, block_size=bs, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=dim, dtype=dtype, seed=heads * dim)
    k, v = _cpu_caches(batch)
    backend = CpuAttentionBackend(amx=False)  # rows for every dtype, whatever this CPU has
    got = attend(backend, batch.query, k, v, batch.meta, 0.3)
    assert batch.meta.plan.rows is not None
    expected = naive_attention(batch, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_step_equals_the_torch_backend(dtype: torch.dtype) -> None:
    """Decodes, a chunk over a cached prefix and a fresh prefill in one step: the kernel's
    rows against the torch backend's SDPA over the plain layout."""
    batch = make_batch([40, 1, 70, 16, 23], [1, 1, 30, 16, 1], num_heads=9, num_kv_heads=3,
                       head_dim=64, dtype=dtype, seed=5)
    k, v = _cpu_caches(batch)
    got = attend(CpuAttentionBackend(amx=False), batch.query, k, v, batch.meta, 0.125)
    ref = attend(TorchAttentionBackend(), batch.query, batch.k_cache, batch.v_cache, batch.meta,
                                          0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_what_the_torch_backend_writes(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    cpu, ref = CpuAttentionBackend(), TorchAttentionBackend()
    k, v = cpu.allocate_kv_cache(6, 16, 3, 64, dtype, torch.device("cpu"))
    kr, vr = ref.allocate_kv_cache(6, 16, 3, 64, dtype, torch.device("cpu"))
    qkv = torch.randn(7, 15 * 64, generator=gen).to(dtype)  # views, as the model passes them
    key = qkv[:, 9 * 64 : 12 * 64].view(7, 3, 64)
    value = qkv[:, 12 * 64 :].view(7, 3, 64)
    slots = torch.tensor([0, 17, 95, -1, 33, 48, 5])  # -1: padding, never written
    cpu.store_kv(key, value, k, v, slots)
    ref.store_kv(key, value, kr, vr, slots)
    assert torch.equal(k, kr) and torch.equal(v, vr)


def test_the_cpu_layout_passes_the_cache_contract() -> None:
    caches = [CpuAttentionBackend().allocate_kv_cache(4, 16, 2, 64, torch.float32,
                                                     torch.device("cpu")) for _ in range(3)]
    contract.check_kv_caches(caches, num_heads=4, num_kv_heads=2, head_dim=64,
                             dtype=torch.float32)
    plain = TorchAttentionBackend().allocate_kv_cache(4, 16, 2, 64, torch.float32,
                                                     torch.device("cpu"))
    with pytest.raises(contract.AttentionContractError, match="laid out unlike"):
        contract.check_kv_caches([caches[0], plain], num_heads=4, num_kv_heads=2, head_dim=64,
                                 dtype=torch.float32)
    with pytest.raises(RuntimeError, match="layout"):  # the kernel refuses a plain cache
        kernels.paged_decode_attention(torch.zeros(1, 4, 64), *plain,
                                       torch.zeros(1, 1, dtype=torch.int32),
                                       torch.ones(1, dtype=torch.int32), 1.0)


def test_a_float16_model_on_the_cpu_takes_the_torch_attention() -> None:
    """The kernels compute float32 and bfloat16 only: a float16 cache read as float32 was
    garbage (the engine failed at its first step)."""
    assert selector.get_attention_backend("cpu", dtype=torch.bfloat16).name == "cpu"
    assert selector.get_attention_backend("cpu", dtype=torch.float16).name == "torch"
    with pytest.raises(ValueError, match="float16"):
        selector.get_attention_backend("cpu", "cpu", torch.float16)


def test_a_float16_engine_runs_on_the_cpu(tiny_model_dir) -> None:
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.protocol.sampling_params import SamplingParams

    path = tiny_model_dir("LlamaForCausalLM", num_hidden_layers=2)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float16", num_blocks=16))
    assert engine.runner.attn_backend.name == "torch"
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0,
                                                             ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for update in engine.step():
            tokens += update.new_token_ids
    engine.close()
    assert len(tokens) == 4


def test_selector_takes_the_kernels_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert selector.get_attention_backend("cpu").name == "cpu"
    assert selector.get_attention_backend("cpu", "torch").name == "torch"
    monkeypatch.setattr(selector, "ops", lambda: None)  # not built: torch, and "cpu" says why
    assert selector.get_attention_backend("cpu").name == "torch"
    with pytest.raises(ValueError, match="CPU kernels"):
        selector.get_attention_backend("cpu", "cpu")


def test_metadata_to_kernel_through_real_steps() -> None:
    """store_kv + forward over steps: a prefill chunk, a second chunk, decodes."""
    gen = torch.Generator().manual_seed(4)
    cpu, ref = CpuAttentionBackend(), TorchAttentionBackend()
    k, v = cpu.allocate_kv_cache(10, 16, 2, 64, torch.float32, torch.device("cpu"))
    kr, vr = ref.allocate_kv_cache(10, 16, 2, 64, torch.float32, torch.device("cpu"))
    table, total = [[7, 2, 9, 4]], 50
    keys = torch.randn(total, 2, 64, generator=gen)
    values = torch.randn(total, 2, 64, generator=gen)
    queries = torch.randn(total, 6, 64, generator=gen)
    done = 0
    for chunk in (20, 17, 1, 1, 1):
        meta, _ = build_attention_metadata(table, [done + chunk], [chunk], 16)
        new = slice(done, done + chunk)
        cpu.store_kv(keys[new], values[new], k, v, meta.slot_mapping)
        ref.store_kv(keys[new], values[new], kr, vr, meta.slot_mapping)
        got = attend(cpu, queries[new], k, v, meta, 0.2)
        expected = attend(ref, queries[new], kr, vr, meta, 0.2)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        done += chunk


# ------------------------------------------------------------------------------ oneDNN linear


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, bias: bool) -> None:
    gen = torch.Generator().manual_seed(6)
    layer = Linear(256, (192, 128), bias=bias, dtype=dtype)  # 81,920 weights: packed
    layer.weight.copy_(torch.randn(320, 256, generator=gen))
    if bias:
        layer.bias.copy_(torch.randn(320, generator=gen))
    x = torch.randn(5, 256, generator=gen).to(dtype)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.pack()
    assert layer.packed is not None and layer.weight is None  # the plain copy is dropped
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(layer(x).float(), expected.float(), atol=tol, rtol=tol)
    assert layer(x[:1]).shape == (1, 320)  # any batch size with the same packed weight


def test_small_float32_weights_stay_plain_and_bf16_ones_are_packed() -> None:
    """Below 64k float32 weights oneDNN's per-call cost exceeds the product itself."""
    small = Linear(64, (96, 96), bias=False, dtype=torch.float32)
    torch.nn.init.normal_(small.weight)  # the layer's storage starts uninitialised
    small.pack()
    assert small.packed is None and small.weight is not None
    x = torch.randn(3, 64)
    torch.testing.assert_close(small(x), F.linear(x, small.weight))
    small_bf16 = Linear(64, (96, 96), bias=False, dtype=torch.bfloat16)
    small_bf16.pack()
    assert small_bf16.packed is not None


def test_large_row_counts_warm_up_one_product_per_weight_shape(monkeypatch) -> None:
    """Past ``FULL_PASS_ROWS`` a warm-up runs each distinct packed shape once, not the
    model: the primitives are per shape and row count."""
    layers = torch.nn.ModuleList(
        Linear(256, (256,), bias=False, dtype=torch.bfloat16) for _ in range(3))
    layers.append(Linear(256, (128, 128), bias=True, dtype=torch.bfloat16))
    for layer in layers:
        layer.pack()
    calls: list[tuple[int, int]] = []
    real = onednn.packed_linear

    def counting(x: torch.Tensor, w: onednn.PackedWeight) -> torch.Tensor:
        calls.append((x.shape[0], w.out_features))
        return real(x, w)

    monkeypatch.setattr(onednn, "packed_linear", counting)
    rows = next(b for b in onednn.ROW_BUCKETS if b > onednn.FULL_PASS_ROWS)
    onednn.warm_up_products(layers, rows)
    assert sorted(calls) == [(rows, 256), (rows, 256)]  # [256, 256] plain, and with a bias


def test_bf16_without_native_support_computes_in_float32(monkeypatch) -> None:
    """On CPUs without bf16 dot products (AVX2) a bf16 weight is packed as float32."""
    monkeypatch.setattr(onednn, "has_native_bf16", lambda: False)
    w = torch.randn(32, 16).bfloat16()
    packed = onednn.pack(w)
    assert packed.compute_dtype == torch.float32
    x = torch.randn(3, 16).bfloat16()
    out = onednn.packed_linear(x, packed)
    assert out.dtype == torch.bfloat16
    expected = F.linear(x.float(), w.float()).bfloat16()
    torch.testing.assert_close(out.float(), expected.float(), atol=0, rtol=0)


def test_long_contexts_take_the_torch_path_and_still_match() -> None:
    from services.engine.attention.cpu_backend import ROWS_MAX_CONTEXT

    lens = [ROWS_MAX_CONTEXT + 40, 50, 30]
    batch = make_batch(lens, [60, 50, 1], num_heads=9, num_kv_heads=3, head_dim=64,
                       dtype=torch.float32, seed=11)
    k, v = _cpu_caches(batch)
    backend = CpuAttentionBackend()
    got = attend(backend, batch.query, k, v, batch.meta, 0.125)
    assert batch.meta.plan.rows is None  # the rows path was not taken
    torch.testing.assert_close(got.double(), naive_attention(batch, 0.125).double(),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_prefill_path_is_chosen_by_isa_and_dtype(dtype: torch.dtype, amx: bool) -> None:
    """With AMX (Intel Xeon: SDPA on the tile units and MKL's AVX-512), prompts over more than
    a few blocks of context take one SDPA each; decodes, steps of a few tokens per request and
    short prompts stay kernel rows; without AMX every step under 1,024 tokens of context is
    rows. Both paths give the naive attention's output."""
    from services.engine.attention.cpu_backend import AMX_ROWS_MAX_QUERY

    short = AMX_ROWS_MAX_QUERY
    cases = (([60, 20, 300], [40, 1, 30], not amx), ([60, 20, 300], [short, 1, short], True),
             ([60, 20, 300], [1, 1, 1], True), ([16, 12], [16, 12], True))
    for lens, q_lens, rows in cases:
        batch = make_batch(lens, q_lens, num_heads=9, num_kv_heads=3, head_dim=64,
                           dtype=dtype, seed=sum(q_lens))
        k, v = _cpu_caches(batch)
        got = attend(CpuAttentionBackend(amx=amx), batch.query, k, v, batch.meta, 0.125)
        assert (batch.meta.plan.rows is not None) == rows, q_lens
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), naive_attention(batch, 0.125).double(),
                                   atol=tol, rtol=tol)


def test_amx_is_read_from_the_cpu_flags() -> None:
    from services.engine.cpu_ops.isa import has_amx, has_native_bf16

    xeon = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    epyc = frozenset({"avx2", "avx512f", "avx512_bf16"})
    assert has_amx(xeon) and has_native_bf16(xeon)
    assert not has_amx(epyc) and has_native_bf16(epyc)
    assert not has_amx(frozenset({"avx2"})) and not has_native_bf16(frozenset({"avx2"}))


# ------------------------------------------------------------------------------ sampling


def _gumbel_argmax_reference(logits: torch.Tensor, keys: torch.Tensor) -> list[int]:
    """The kernel's noise, written out in numpy's wrapping uint64 and float64 logs:
    G[r, v] = -log(-log(U)), U the top 24 bits of SplitMix64's mix of key[r] + (v + 1) * gamma,
    centred in their interval."""
    vocab = logits.shape[1]
    v = np.arange(1, vocab + 1, dtype=np.uint64)
    out = []
    with np.errstate(over="ignore"):
        for r, key in enumerate(keys.tolist()):
            z = np.uint64(key & (2**64 - 1)) + v * np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
            u = ((z >> np.uint64(40)).astype(np.float64) + 0.5) * 2.0**-24
            out.append(int(np.argmax(logits[r].double().numpy() - np.log(-np.log(u)))))
    return out


@pytest.mark.parametrize("vocab", [49_152, 20_000, 7])  # whole chunks, a partial one, tiny
def test_gumbel_argmax_matches_its_reference_whatever_the_threads(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen) * 3
    logits[:, 1::3] = float("-inf")  # what top-k / top-p masks leave
    keys = torch.randint(-(2**63), 2**63 - 1, (9,), dtype=torch.int64, generator=gen)
    expected = _gumbel_argmax_reference(logits, keys)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):  # other chunkings of the vocabulary over the threads
            torch.set_num_threads(n)
            assert kernels.gumbel_argmax(logits, keys).tolist() == expected
    finally:
        torch.set_num_threads(threads)
    assert all(t % 3 != 1 for t in expected)  # a masked token never wins


def test_gumbel_argmax_keys_decide_and_a_dead_row_gives_token_zero() -> None:
    logits = torch.zeros(64, 1000)  # uniform: the noise alone picks
    same = kernels.gumbel_argmax(logits, torch.full((64,), 12345, dtype=torch.int64))
    assert len(set(same.tolist())) == 1  # one key, one token
    spread = kernels.gumbel_argmax(logits, torch.arange(64, dtype=torch.int64))
    assert len(set(spread.tolist())) > 50  # neighbouring keys are unrelated streams
    dead = torch.full((2, 10), float("-inf"))
    assert kernels.gumbel_argmax(dead, torch.tensor([1, 2])).tolist() == [0, 0]  # as torch


def test_top_k_top_p_keeps_what_a_float64_sort_keeps() -> None:
    from services.engine.sampler import _mask_top_k_top_p_sorted

    gen = torch.Generator().manual_seed(5)
    for vocab in (1, 8, 33, 1000, 49_152):
        for trial in range(6):
            if trial % 2:  # integer logits: ties everywhere, at the cuts too (lower ids stay)
                logits = torch.randint(-4, 5, (16, vocab), generator=gen).float()
            else:  # flat to peaked
                logits = torch.randn(16, vocab, generator=gen) * (1 + 4 * trial)
            logits[::5, ::3] = float("-inf")
            top_k = torch.randint(0, 12 if trial % 3 else vocab + 2, (16,), generator=gen)
            top_p = [1.0 if i % 4 == 0 else 0.05 + 0.9 * x
                     for i, x in enumerate(torch.rand(16, generator=gen).tolist())]
            ks = [min(k, vocab) if k > 0 else vocab for k in top_k.tolist()]
            # float64: a float32 cumulative sum over 49k tokens drifts past one token's weight.
            expected = _mask_top_k_top_p_sorted(logits.double(), ks, top_p).float()
            got = kernels.top_k_top_p(logits, top_k, torch.tensor(top_p, dtype=torch.float64))
            assert torch.equal(got, expected), (vocab, trial)


def test_argmax_rows_equals_torch_argmax_ties_nans_and_infinities() -> None:
    """The greedy path's argmax: the first of equal maxima, a NaN wins (the first one), a row
    of -inf gives token 0, as torch's."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 777, generator=gen)
    logits[1, 5] = logits[1, 9] = 50.0  # a tie: the lower id
    logits[2, 7] = logits[2, 3] = float("nan")  # NaNs: the first one
    logits[3] = float("-inf")
    logits[4, 0] = float("inf")
    logits[5] = -1.0
    logits[5, 100], logits[5, 700] = -0.0, 0.0  # zero's two signs: the first one wins
    logits[6, 776] = 60.0  # the maximum in the last, partial chunk of 64
    logits[7, 640] = logits[7, 650] = 70.0  # a tie inside one chunk
    logits[8, 770] = float("nan")  # a NaN past the maximum
    for rows in (logits, logits[:1], logits[:, :1], logits[::2]):  # incl. a strided view
        got = kernels.argmax_rows(rows.contiguous())
        assert torch.equal(got, rows.argmax(-1))
    assert kernels.argmax_rows(logits)[5:9].tolist() == [100, 776, 640, 770]
    vocab = torch.randn(64, 49_152, generator=gen)  # the default model's vocabulary
    vocab[3, 49_151] = 99.0
    assert torch.equal(kernels.argmax_rows(vocab), vocab.argmax(-1))
