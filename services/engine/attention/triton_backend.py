"""The Triton attention backend (GPU): the kernels in ``services.engine.kernels``.

Decode-only steps use the GQA-grouped decode kernel (split over the context when the batch is
too small to fill the GPU); any step with a multi-token request uses the varlen prefill kernel,
which handles the step's single-token requests as one-row queries.

No per-layer checks: the runner checks the caches at allocation and each step's metadata once
(``attention.contract``); the kernels rely on that.
"""

from __future__ import annotations

import torch

from services.engine.attention.base import (
    AttentionLayout,
    AttentionMetadata,
    allocate_plain_kv_cache,
)
from services.engine.kernels import kv_store, paged_attention


class TritonAttentionBackend:
    """Paged attention with Triton kernels (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``)."""

    name = "triton"

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return allocate_plain_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype,
                                       device)

    def plan(self, meta: AttentionMetadata, layout: AttentionLayout) -> None:
        """The kernels take the metadata as it is: nothing to plan."""
        return

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        kv_store.store_kv(key, value, k_cache, v_cache, slot_mapping)

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
        if meta.is_decode_only:
            return paged_attention.paged_decode_attention(
                query,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                scale,
                max_context_len=meta.max_seqlen_k,
                num_splits=meta.decode_num_splits,
                window=window,
                softcap=softcap,
            )
        return paged_attention.paged_prefill_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.cu_seqlens_q,
            meta.max_seqlen_q,
            scale,
            window=window,
            softcap=softcap,
        )
