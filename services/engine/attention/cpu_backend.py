"""The CPU attention backend: the torch backend with Pagoda's C++ kernels on its hot paths.

Decode requests (one new token each) run the paged decode kernel, which reads keys and values
straight from the cache through the block tables, with no gather into a padded copy; new K/V
are written by the store kernel. Prefill requests take the torch backend's path (one SDPA call
each over the gathered context). Layers with a sliding window or a logit soft-cap (Mistral,
Gemma) take the torch backend's ``windowed`` path whole: the C++ kernel has neither (new K/V
are still written by the store kernel).

The kernels want each cache block stored head by head, with the keys transposed
(``cpu_ops.cpp`` draws it), so this backend allocates the caches that way: the tensors the
model sees are still the logical ``[num_blocks, block_size, num_kv_heads, head_dim]``, permuted
views of the storage, and every torch op on them (the prefill gather, the tests' writes) works
unchanged.
"""

from __future__ import annotations

import torch

from services.engine.attention.torch_backend import TorchAttentionBackend, _DecodeGroup
from services.engine.cpu_ops import ops


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        kernels = ops()
        assert kernels is not None, "the CPU kernels are not built"  # the selector checked
        self._kernels = kernels

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
        out = self._kernels.paged_decode_attention(
            query.float().contiguous(), k_cache, v_cache, group.tables, group.seq_lens32, scale
        )
        return out.to(query.dtype)
