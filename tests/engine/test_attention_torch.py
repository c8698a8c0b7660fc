"""TorchAttentionBackend against a naive dense causal attention over contiguous K/V."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from services.engine.attention import contract, torch_backend
from services.engine.attention.base import AttentionMetadata
from services.engine.attention.contract import (
    AttentionContractError,
    check_kv_caches,
    check_step,
)
from services.engine.attention.metadata import build_attention_metadata
from services.engine.attention.torch_backend import TorchAttentionBackend
from tests.support.attention import attend


@dataclass
class Batch:
    meta: AttentionMetadata
    query: torch.Tensor  # [num_tokens, H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    keys: list[torch.Tensor]  # per request, contiguous [seq_len, H_kv, D]
    values: list[torch.Tensor]


def make_batch(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    block_size: int = 16,
    num_heads: int = 6,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """Random K/V written straight into a paged cache through shuffled (non-contiguous) blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3  # spare blocks hold garbage that must never be read
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in blocks_needed:
        tables.append(perm[start : start + n])
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    keys, values = [], []
    for table, n in zip(tables, seq_lens, strict=True):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(n):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        keys.append(k)
        values.append(v)
    meta, _ = build_attention_metadata(tables, seq_lens, query_lens, block_size)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return Batch(meta, query, k_cache, v_cache, keys, values)


def naive_attention(batch: Batch, scale: float) -> torch.Tensor:
    """Materialises each request's K/V and applies a plain masked softmax in float64."""
    outs = []
    start = 0
    for q_len, k, v in zip(batch.meta.query_lens, batch.keys, batch.values, strict=True):
        q = batch.query[start : start + q_len].double()
        start += q_len
        seq_len, num_kv_heads = k.shape[0], k.shape[1]
        group = q.shape[1] // num_kv_heads
        k = k.double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs).to(batch.query.dtype)


def run_and_compare(batch: Batch, atol: float = 1e-5) -> None:
    scale = batch.query.shape[-1] ** -0.5
    out = attend(TorchAttentionBackend(), batch.query, batch.k_cache, batch.v_cache, batch.meta,
                 scale)
    assert out.shape == batch.query.shape
    assert out.dtype == batch.query.dtype
    torch.testing.assert_close(out, naive_attention(batch, scale), atol=atol, rtol=atol)


# ---------------------------------------------------------------------- forward


@pytest.fixture(params=["bags", "sdpa"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test through each of the two batched-decode implementations."""
    threshold = 1 if request.param == "bags" else 10**9
    monkeypatch.setattr(torch_backend, "BAG_PATH_MIN_SEQS", threshold)
    return request.param


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4), (9, 3)])
def test_decode_only_varied_lengths(
    block_size: int, num_heads: int, num_kv_heads: int, decode_path: str
) -> None:
    seq_lens = [1, 7, 16, 17, 40, 33]  # single token, block boundary, just past it
    batch = make_batch(
        seq_lens,
        [1] * len(seq_lens),
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
    )
    run_and_compare(batch)


def test_decode_only_equal_lengths_needs_no_mask(decode_path: str) -> None:
    run_and_compare(make_batch([24, 24, 24], [1, 1, 1], block_size=8))


def test_decode_single_request(decode_path: str) -> None:
    run_and_compare(make_batch([50], [1]))


@pytest.mark.parametrize("block_size", [16, 8])
def test_prefill_without_prefix(block_size: int) -> None:
    run_and_compare(make_batch([5, 19, 32], [5, 19, 32], block_size=block_size))


@pytest.mark.parametrize("block_size", [16, 8])
def test_prefill_chunk_over_cached_prefix(block_size: int) -> None:
    # Chunks that start mid-block, on a block boundary, and end the sequence.
    run_and_compare(make_batch([29, 32, 45], [10, 16, 3], block_size=block_size))


@pytest.mark.parametrize("block_size", [16, 8])
def test_mixed_batch(block_size: int, decode_path: str) -> None:
    # Decodes before, between and after prefills, so outputs must be scattered back in place.
    seq_lens = [20, 37, 9, 12, 50, 3]
    query_lens = [1, 12, 1, 12, 1, 3]
    run_and_compare(make_batch(seq_lens, query_lens, block_size=block_size, num_heads=8))


def test_bfloat16_matches_within_rounding() -> None:
    batch = make_batch([30, 12, 7], [1, 12, 3], dtype=torch.bfloat16)
    run_and_compare(batch, atol=2e-2)


def test_non_contiguous_query_view(decode_path: str) -> None:
    """The model passes q as a strided view of a fused qk tensor."""
    batch = make_batch([9, 21, 4], [1, 5, 1])
    num_tokens, num_heads, head_dim = batch.query.shape
    fused = torch.randn(num_tokens, num_heads + 2, head_dim)
    fused[:, :num_heads] = batch.query
    batch.query = fused[:, :num_heads]
    assert not batch.query.is_contiguous()
    run_and_compare(batch)


def test_each_step_reads_its_own_plan(decode_path: str) -> None:
    """Steps of the same shapes with other block tables: every layer reads the plan of the
    metadata it is given, never a previous step's."""
    backend = TorchAttentionBackend()
    first = make_batch([20, 30], [1, 1], seed=1)
    second = make_batch([20, 30], [1, 1], seed=2)  # same shapes, other block tables
    scale = 0.2
    for batch in (first, second, first):
        out = attend(backend, batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)
        torch.testing.assert_close(out, naive_attention(batch, scale), atol=1e-5, rtol=1e-5)


def test_store_then_attend_over_steps() -> None:
    """store_kv + forward through real metadata: a prefill chunk, a second chunk, a decode."""
    gen = torch.Generator().manual_seed(3)
    block_size, num_heads, num_kv_heads, head_dim = 8, 4, 2, 16
    k_cache = torch.zeros(10, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    table = [7, 2, 5, 0]
    total = 27
    keys = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    values = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    queries = torch.randn(total, num_heads, head_dim, generator=gen)
    backend = TorchAttentionBackend()
    done = 0
    for chunk in (11, 15, 1):
        meta, positions = build_attention_metadata([table], [done + chunk], [chunk], block_size)
        new = slice(done, done + chunk)
        backend.store_kv(keys[new], values[new], k_cache, v_cache, meta.slot_mapping)
        out = attend(backend, queries[new], k_cache, v_cache, meta, 0.25)
        batch = Batch(
            meta, queries[new], k_cache, v_cache, [keys[: done + chunk]], [values[: done + chunk]]
        )
        torch.testing.assert_close(out, naive_attention(batch, 0.25), atol=1e-5, rtol=1e-5)
        assert positions.tolist() == list(range(done, done + chunk))
        done += chunk


# ---------------------------------------------------------------------- store_kv


def test_store_kv_writes_slots_and_skips_negative() -> None:
    gen = torch.Generator().manual_seed(4)
    k_cache = torch.zeros(4, 8, 2, 16)
    v_cache = torch.zeros_like(k_cache)
    # Strided views, like the model's slices of its fused qkv projection.
    fused = torch.randn(5, 6, 16, generator=gen)
    key, value = fused[:, 2:4], fused[:, 4:6]
    slots = torch.tensor([9, -1, 31, 0, 17])
    TorchAttentionBackend().store_kv(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[t])
            assert torch.equal(flat_v[slot], value[t])
    written = {9, 31, 0, 17}
    untouched = [s for s in range(flat_k.shape[0]) if s not in written]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_store_kv_empty_is_a_no_op() -> None:
    k_cache = torch.zeros(2, 4, 1, 8)
    empty = torch.zeros(0, 1, 8)
    TorchAttentionBackend().store_kv(
        empty, empty, k_cache, k_cache.clone(), torch.zeros(0, dtype=torch.int64)
    )
    assert not k_cache.any()


# ---------------------------------------------------------------------- the contract
#
# Nothing above validates per call: the runner checks the caches once when it allocates them
# (check_kv_caches) and each step's metadata once (check_step). What the backends used to
# reject per layer is rejected there, as an internal error (never a client's ValueError).


def _caches(**shape: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    dims = {"num_blocks": 4, "block_size": 8, "num_kv_heads": 2, "head_dim": 16, **shape}
    return [(torch.zeros(*dims.values()), torch.zeros(*dims.values())) for _ in range(3)]


LAYOUT = {"num_heads": 6, "num_kv_heads": 2, "head_dim": 16, "dtype": torch.float32}


def test_check_kv_caches_accepts_what_the_runner_allocates() -> None:
    check_kv_caches(_caches(), **LAYOUT)


def _swap(caches: list, layer: int, which: int, cache: torch.Tensor) -> list:
    pair = list(caches[layer])
    pair[which] = cache
    return [*caches[:layer], tuple(pair), *caches[layer + 1 :]]


@pytest.mark.parametrize(
    ("name", "caches", "layout"),
    [
        ("model has more kv heads than the cache", _caches(), {"num_kv_heads": 4}),
        ("model head_dim differs", _caches(), {"head_dim": 32}),
        ("heads not a multiple of kv heads", _caches(), {"num_heads": 5}),
        ("model dtype differs", _caches(), {"dtype": torch.bfloat16}),
        ("dtype no backend takes", _caches(), {"dtype": torch.float64}),
        ("3-D cache", [(c.flatten(2), c.flatten(2)) for c, _ in _caches()], {}),
        ("v_cache head_dim differs", _swap(_caches(), 0, 1, torch.zeros(4, 8, 2, 8)), {}),
        ("a later layer differs", _swap(_caches(), 2, 0, torch.zeros(5, 8, 2, 16)), {}),
        (
            "non-contiguous cache",
            _swap(_caches(), 1, 0, torch.zeros(4, 2, 8, 16).transpose(1, 2)),
            {},
        ),
        ("cache dtype differs", _swap(_caches(), 1, 1, torch.zeros(4, 8, 2, 16).double()), {}),
        ("no layers", [], {}),
    ],
)
def test_check_kv_caches_rejects(name: str, caches: list, layout: dict) -> None:
    with pytest.raises(AttentionContractError) as err:
        check_kv_caches(caches, **{**LAYOUT, **layout})
    assert not isinstance(err.value, ValueError)  # an engine bug, never a client's 400


def test_check_step_accepts_real_metadata() -> None:
    batch = make_batch([10, 5, 33], [1, 5, 2], block_size=16)
    check_step(batch.meta, 8, batch.k_cache)


def _bad_steps() -> dict[str, tuple[AttentionMetadata, int, torch.Tensor]]:
    batch = make_batch([40, 5], [1, 5], block_size=16)
    meta, kc = batch.meta, batch.k_cache

    def edited(**fields: object) -> AttentionMetadata:
        return replace(meta, **fields)

    return {
        "token count": (meta, 5, kc),
        "block size": (meta, 6, kc.view(-1, 8, *kc.shape[2:])),
        "block table too short": (edited(block_tables=meta.block_tables[:, :2]), 6, kc),
        "block table rows": (edited(block_tables=meta.block_tables[:1]), 6, kc),
        "block table dtype": (edited(block_tables=meta.block_tables.float()), 6, kc),
        "query_len > seq_len": (edited(query_lens=[1, 6], max_seqlen_q=6), 7, kc),
        "query_len 0": (edited(query_lens=[0, 5], seq_lens=[40, 5]), 5, kc),
        "seq_lens count": (edited(seq_lens=[40]), 6, kc),
        "slot_mapping count": (edited(slot_mapping=meta.slot_mapping[:5]), 6, kc),
        "slot_mapping dtype": (edited(slot_mapping=meta.slot_mapping.float()), 6, kc),
        "cu_seqlens_q count": (edited(cu_seqlens_q=meta.cu_seqlens_q[:2]), 6, kc),
        "context_lens count": (edited(context_lens=meta.context_lens[:1]), 6, kc),
        "max_seqlen_k": (edited(max_seqlen_k=30), 6, kc),
    }


@pytest.mark.parametrize("name", list(_bad_steps()))
def test_check_step_rejects(name: str) -> None:
    meta, num_tokens, k_cache = _bad_steps()[name]
    with pytest.raises(AttentionContractError) as err:
        check_step(meta, num_tokens, k_cache)
    assert not isinstance(err.value, ValueError)


def test_build_metadata_rejects_a_block_table_too_short_for_its_request() -> None:
    # The padded metadata cannot show it (the other table is long enough), so build checks.
    with pytest.raises(AttentionContractError, match="block table"):
        build_attention_metadata([[0, 1], [2, 3, 4]], [40, 40], [1, 1], 16)


def test_the_runner_checks_the_contract_once_per_step(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One check_step per step whatever the layer count, and the backend checks nothing."""
    from services.engine import model_runner
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.protocol.sampling_params import SamplingParams

    path = tiny_model_dir("LlamaForCausalLM", num_hidden_layers=3)
    engine = LLMEngine(EngineConfig(model=str(path), num_blocks=16))
    calls: list[int] = []

    def counting(meta: AttentionMetadata, num_tokens: int, k_cache: torch.Tensor) -> None:
        calls.append(num_tokens)
        contract.check_step(meta, num_tokens, k_cache)

    monkeypatch.setattr(model_runner, "check_step", counting)
    backend = engine.runner.attn_backend
    plans: list[object] = []
    build = backend.plan

    def planning(meta, layout):
        plans.append(build(meta, layout))
        return plans[-1]

    monkeypatch.setattr(backend, "plan", planning)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [1, 2, 3, 4, 5], params)
    engine.add_request("b", [6, 7], params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert calls == [7, 2, 2][:steps] and steps == 3
    # The attention plan too: built once per step by the runner, read by all three layers.
    assert len(plans) == steps and len({id(p) for p in plans}) == steps
