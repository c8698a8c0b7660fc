"""Sliding-window and soft-capped attention (``attention.windowed``) against a float64 loop,
through the torch backend and the CPU backend (whose caches are permuted views)."""

from __future__ import annotations

import pytest
import torch

from services.engine.attention.cpu_backend import CpuAttentionBackend
from services.engine.attention.torch_backend import TorchAttentionBackend
from services.engine.cpu_ops import ops
from tests.engine.test_attention_torch import Batch, make_batch
from tests.support.attention import attend


def naive(batch: Batch, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    outs, start = [], 0
    for q_len, k, v in zip(batch.meta.query_lens, batch.keys, batch.values, strict=True):
        q = batch.query[start : start + q_len].double()
        start += q_len
        seq_len, group = k.shape[0], q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs).float()


# Prefill without and with a cached prefix, chunks, and decodes of very different lengths.
SEQ_LENS = [20, 37, 9, 12, 3, 100, 1]
QUERY_LENS = [1, 12, 1, 12, 3, 1, 1]
CASES = [(1, None), (5, None), (16, None), (1000, None), (None, 2.0), (7, 0.5)]


@pytest.mark.parametrize(("window", "softcap"), CASES)
def test_torch_backend_matches_a_float64_loop(window: int | None, softcap: float | None) -> None:
    batch = make_batch(SEQ_LENS, QUERY_LENS, block_size=8, seed=3)
    backend = TorchAttentionBackend()
    args = (batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    out = attend(backend, *args, window=window, softcap=softcap)
    torch.testing.assert_close(out, naive(batch, 0.25, window, softcap), atol=2e-6, rtol=2e-6)
    # Another window in the same step (Gemma's layers alternate), then the first again.
    other = attend(backend, *args, window=3, softcap=None)
    torch.testing.assert_close(other, naive(batch, 0.25, 3, None), atol=2e-6, rtol=2e-6)
    assert torch.equal(attend(backend, *args, window=window, softcap=softcap), out)


def test_a_window_wider_than_every_context_is_full_attention() -> None:
    batch = make_batch(SEQ_LENS, QUERY_LENS, block_size=8, seed=4)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    full = attend(TorchAttentionBackend(), *args)
    torch.testing.assert_close(attend(TorchAttentionBackend(), *args, window=1000), full)


@pytest.mark.skipif(ops() is None, reason="the CPU kernels are not built")
@pytest.mark.parametrize(("window", "softcap"), [(5, None), (None, 2.0)])
def test_cpu_backend_takes_the_torch_path_on_its_own_cache_layout(
    window: int | None, softcap: float | None
) -> None:
    batch = make_batch(SEQ_LENS, QUERY_LENS, block_size=8, seed=5)
    backend = CpuAttentionBackend()
    k_cache, v_cache = backend.allocate_kv_cache(
        batch.k_cache.shape[0], 8, batch.k_cache.shape[2], batch.k_cache.shape[3],
        torch.float32, torch.device("cpu"),
    )  # fmt: skip
    k_cache.copy_(batch.k_cache)
    v_cache.copy_(batch.v_cache)
    out = attend(backend, batch.query, k_cache, v_cache, batch.meta, 0.25, window, softcap)
    torch.testing.assert_close(out, naive(batch, 0.25, window, softcap), atol=2e-6, rtol=2e-6)
