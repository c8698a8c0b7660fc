"""The attention contract, checked where it is set up, never per layer.

Two checks, both internal (only an engine bug can fail them, never a client's input):

* ``check_kv_caches`` once, when the runner allocates the KV cache: every layer's ``k_cache`` and
  ``v_cache`` is a logical ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensor laid out
  alike (contiguous, or the CPU kernels' per-head layout), in the model's
  dtype and head layout, all on one device;
* ``check_step`` once per step, on the step's ``AttentionMetadata``: it is consistent with itself,
  with the step's token count and with the caches.

The backends and the kernel wrappers rely on both and check nothing per call, so every layer of
a step runs without validation. A failure raises ``AttentionContractError``: an internal error
(a 500 or a failed step), deliberately not a ``ValueError``, so it can never pass for a client's
bad request (a 400).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import le

import torch

from services.engine.attention.base import AttentionMetadata

# What every backend handles (the Triton kernels take exactly these; so does EngineConfig).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


class AttentionContractError(RuntimeError):
    """The engine broke the attention contract: a bug in the engine, not in the request."""


def check_kv_caches(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> None:
    """Checks the caches once, at allocation, against the model that will read and write them."""
    if not kv_caches:
        raise AttentionContractError("no KV cache layers")
    if dtype not in SUPPORTED_DTYPES:
        raise AttentionContractError(f"unsupported dtype {dtype}; use fp16, bf16 or fp32")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise AttentionContractError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    first = kv_caches[0][0]
    if first.dim() != 4 or tuple(first.shape[2:]) != (num_kv_heads, head_dim):
        raise AttentionContractError(
            f"KV caches must be [num_blocks, block_size, num_kv_heads={num_kv_heads}, "
            f"head_dim={head_dim}], got {tuple(first.shape)}"
        )
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            where = f"layer {layer} {name}"
            if cache.shape != first.shape:
                raise AttentionContractError(
                    f"{where} is {tuple(cache.shape)}, not {tuple(first.shape)} like layer 0"
                )
            if cache.stride() != kv_caches[0][0 if name == "k_cache" else 1].stride():
                raise AttentionContractError(f"{where} is laid out unlike layer 0")
            if not (cache.is_contiguous() or cpu_kernel_layout(cache, keys=name == "k_cache")):
                raise AttentionContractError(
                    f"{where} must be contiguous or in the CPU kernels' per-head layout"
                )
            if cache.dtype != dtype:
                raise AttentionContractError(f"{where} is {cache.dtype}, not the model's {dtype}")
            if cache.device != first.device:
                raise AttentionContractError(
                    f"{where} is on {cache.device}, layer 0 on {first.device}"
                )


def cpu_kernel_layout(cache: torch.Tensor, keys: bool) -> bool:
    """Whether a logical ``[blocks, block_size, kv_heads, head_dim]`` cache is stored per block
    and head, as the CPU kernels read it: keys ``[blocks, kv_heads, head_dim, block_size]``,
    values ``[blocks, kv_heads, block_size, head_dim]``."""
    if cache.dim() != 4:
        return False
    _, bs, heads, dim = cache.shape
    block = heads * dim * bs
    if keys:
        return cache.stride() == (block, 1, dim * bs, bs)
    return cache.stride() == (block, dim, bs * dim, 1)


def check_step(meta: AttentionMetadata, num_tokens: int, k_cache: torch.Tensor) -> None:
    """Checks one step's metadata once, before the model runs: ``num_tokens`` new tokens, and
    ``k_cache`` any layer's key cache (``check_kv_caches`` made them all alike). Host values
    only: nothing here reads a device tensor's contents, so nothing synchronises."""
    query_lens, seq_lens = meta.query_lens, meta.seq_lens
    num_seqs = len(query_lens)
    if len(seq_lens) != num_seqs:
        raise AttentionContractError(
            f"metadata has {num_seqs} query_lens but {len(seq_lens)} seq_lens"
        )
    if sum(query_lens) != num_tokens:
        raise AttentionContractError(
            f"the step has {num_tokens} tokens but the metadata schedules {sum(query_lens)}"
        )
    # Decodes (as many tokens as requests, none without one): every query_len is 1, so each
    # is at most its seq_len when the least seq_len is at least 1.
    decodes = num_tokens == num_seqs
    if num_seqs and (min(query_lens) <= 0 or not (
            min(seq_lens) >= 1 if decodes else all(map(le, query_lens, seq_lens)))):
        raise AttentionContractError(
            "every request needs 0 < query_len <= seq_len, got "
            f"query_lens={query_lens[:8]} seq_lens={seq_lens[:8]}"
        )
    block_size = k_cache.shape[1]
    if meta.block_size != block_size:
        raise AttentionContractError(
            f"metadata block_size {meta.block_size} != the cache's block size {block_size}"
        )
    _check_tensors(meta, num_seqs, num_tokens, k_cache.device)
    if not num_seqs:
        return
    if (meta.max_seqlen_q != (1 if decodes else max(query_lens))
            or meta.max_seqlen_k != max(seq_lens)):
        raise AttentionContractError(
            f"max_seqlen_q/k ({meta.max_seqlen_q}, {meta.max_seqlen_k}) are not the maxima"
        )
    needed = -(-meta.max_seqlen_k // block_size)
    if needed > meta.block_tables.shape[1]:
        raise AttentionContractError(
            f"a sequence of {meta.max_seqlen_k} tokens needs {needed} blocks, more than the "
            f"{meta.block_tables.shape[1]} the block table holds"
        )


def _check_tensors(
    meta: AttentionMetadata, num_seqs: int, num_tokens: int, device: torch.device
) -> None:
    for name, length in (
        ("slot_mapping", num_tokens),
        ("cu_seqlens_q", num_seqs + 1),
        ("cu_seqlens_k", num_seqs + 1),
        ("context_lens", num_seqs),
    ):
        t = getattr(meta, name)
        if t.dim() != 1 or t.shape[0] != length:
            raise AttentionContractError(f"{name} must be [{length}], got {tuple(t.shape)}")
        if t.dtype not in _INDEX_DTYPES:
            raise AttentionContractError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.device != device:
            raise AttentionContractError(f"{name} is on {t.device}, the caches on {device}")
    tables = meta.block_tables
    if tables.dim() != 2 or tables.shape[0] != num_seqs or tables.stride(1) != 1:
        raise AttentionContractError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks] with unit-stride rows, "
            f"got {tuple(tables.shape)}"
        )
    if tables.dtype not in _INDEX_DTYPES:
        raise AttentionContractError(f"block_tables must be int32 or int64, got {tables.dtype}")
    if tables.device != device:
        raise AttentionContractError(f"block_tables is on {tables.device}, the caches on {device}")
