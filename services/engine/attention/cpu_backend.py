"""The CPU attention backend: the torch backend with Pagoda's C++ kernels on its hot paths.

Every new token of a step, decode or prefill, runs through one call of the paged attention
kernel per layer, which reads keys and values straight from the cache through the block
tables, with no gather into a padded copy; new K/V are written by the store kernel first. A
prompt's tokens are causal rows of their own: token j of a request whose ``q_len`` new tokens
end its ``seq_len``-token context attends to the first ``seq_len - q_len + j + 1`` cache slots, so a
prefill (with or without a cached prefix) is a batch of "decode" rows that share one block
table. That is one kernel call per layer for the whole step, spread over the cores by (token,
KV head), instead of one SDPA call per prompt: torch's CPU SDPA reaches ~30 GFLOP/s per core
on 128-token prompts, the kernel several times that (``benchmarks/prefill_attention.py``).
Steps with a context longer than ``ROWS_MAX_CONTEXT`` take the torch backend's path (the
decode kernel for decodes, one SDPA per prompt), where tiled SDPA is faster.

On Intel Xeons with AMX, torch's SDPA runs bf16 on the tile units and fp32 through MKL's
AVX-512 GEMMs, and the kernel rows (vector code, one row at a time, each re-reading its context)
lose from a few new tokens per request on. There a step takes the torch backend's path as soon
as a request brings more than ``AMX_ROWS_MAX_QUERY`` tokens over a context longer than a few
blocks. Single core, Xeon with AMX, ms per layer, SDPA against rows: 4 x 128-token prompts bf16
0.37x, fp32 0.87x; 16 new tokens after a 272-token cached prefix 0.57x / 0.74x; 64 after 320,
0.52x / 0.52x; 8 after 264, 1.05x / 1.16x (rows stay); 16 prompts of 16 tokens, rows 3.6x / 5.3x
faster (one SDPA call per prompt costs more than the math). On AMD EPYC, where MKL does not
take its AVX-512 path, rows won up to 1,024 tokens (2.6x at 128).
Layers with a sliding window or a logit soft-cap (Mistral, Gemma) take the torch backend's
``windowed`` path whole: the C++ kernel has neither (new K/V are still written by the store
kernel).

The kernels want each cache block stored head by head, with the keys transposed
(``cpu_ops.cpp`` draws it), so this backend allocates the caches that way: the tensors the
model sees are still the logical ``[num_blocks, block_size, num_kv_heads, head_dim]``, permuted
views of the storage, and every torch op on them (the prefill gather, the tests' writes) works
unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from services.engine.attention.base import AttentionLayout, AttentionMetadata
from services.engine.attention.torch_backend import (
    StepPlan,
    TokenRows,
    TorchAttentionBackend,
    _DecodeGroup,
    effective_window,
    layer_paths,
)
from services.engine.cpu_ops import ops
from services.engine.cpu_ops.isa import has_amx

# Rows re-read their context's K/V with no tiling across queries, so past ~1k tokens of context
# torch's flash SDPA (tiled) wins: 2,048-token prompt 0.7x, 512 2.0x, 128 2.6x (2 cores).
ROWS_MAX_CONTEXT = 1024
AMX_ROWS_MAX_QUERY = 8  # decodes and verified steps (1 + k tokens) stay rows
# below these contexts rows win whatever the query length: SDPA's per-call cost dominates
AMX_ROWS_MAX_CONTEXT = {torch.bfloat16: 16, torch.float32: 96}


def rows_limits(dtype: torch.dtype, amx: bool) -> tuple[int, int]:
    """A step runs as kernel rows when no request brings more than the first number of new
    tokens, or when no context is longer than the second; chosen by the CPU's ISA and the
    cache's dtype (see the module docstring)."""
    if amx:
        return AMX_ROWS_MAX_QUERY, AMX_ROWS_MAX_CONTEXT.get(dtype, ROWS_MAX_CONTEXT)
    return 1, ROWS_MAX_CONTEXT


def token_rows(meta: AttentionMetadata) -> TokenRows:
    """One kernel row per new token: its request's block table and its causal length. A
    decode-only step's rows are its requests' (the metadata's own tensors, no copy)."""
    if meta.max_seqlen_q == 1:
        return TokenRows(meta.block_tables, meta.context_lens.to(torch.int32))
    query_lens = np.asarray(meta.query_lens, dtype=np.int64)
    seq_lens = np.asarray(meta.seq_lens, dtype=np.int64)
    owner = np.repeat(np.arange(len(query_lens)), query_lens)  # each token's request
    starts = np.cumsum(query_lens) - query_lens
    # Token j of request i sits at position seq_len - q_len + j and sees slots 0..that.
    lens = seq_lens[owner] - query_lens[owner] + (np.arange(len(owner)) - starts[owner]) + 1
    # numpy's gather, not index_select: nothing here starts an OpenMP team
    tables = torch.from_numpy(meta.block_tables.numpy()[owner])
    return TokenRows(tables, torch.from_numpy(lens.astype(np.int32)))


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, amx: bool | None = None) -> None:
        kernels = ops()
        assert kernels is not None, "the CPU kernels are not built"  # the selector checked
        self._kernels = kernels
        self._amx = has_amx() if amx is None else amx  # the tests choose either machine

    def plan(self, meta: AttentionMetadata, layout: AttentionLayout) -> StepPlan:
        windowed, plain = layer_paths(meta, layout)
        plan = self._windowed_plan(meta, windowed)
        if not (plain and plan.num_tokens):
            return plan
        max_query, max_context = rows_limits(layout.dtype, self._amx)
        if meta.max_seqlen_q <= max_query or meta.max_seqlen_k <= max_context:
            plan.rows = token_rows(meta)  # one kernel call per layer for every token
        else:
            self._plain_plan(plan, meta, layout)  # prompts: one SDPA each, decodes batched
        return plan

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        rows = meta.plan.rows
        if rows is None or softcap is not None or effective_window(window, meta) is not None:
            return super().forward(query, k_cache, v_cache, meta, scale, window, softcap)
        # The kernel reads and writes the model's dtype: no conversion copies per layer.
        return self._kernels.paged_decode_attention(
            query.contiguous(), k_cache, v_cache, rows.tables, rows.lens, scale
        )

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed caches, seen as the logical [blocks, block_size, kv_heads, head_dim] and stored
        per block and head: keys [blocks, kv_heads, head_dim, block_size], values [blocks,
        kv_heads, block_size, head_dim]."""
        keys = torch.zeros(num_blocks, num_kv_heads, head_dim, block_size, dtype=dtype,
                           device=device).permute(0, 3, 1, 2)
        values = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype,
                             device=device).permute(0, 2, 1, 3)
        return keys, values

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._kernels.store_kv(key, value, k_cache, v_cache, slot_mapping.to(torch.int64))

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: _DecodeGroup,
        scale: float,
    ) -> torch.Tensor:
        return self._kernels.paged_decode_attention(
            query.contiguous(), k_cache, v_cache, group.tables, group.seq_lens32, scale
        )
