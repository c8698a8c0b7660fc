"""Triton kernel: write a step's new K and V into the paged cache by ``slot_mapping``.

One program per new token copies its ``[num_kv_heads, head_dim]`` key and value rows into
cache slot ``slot_mapping[t]`` (a slot is one row of the flattened
``[num_blocks * block_size, num_kv_heads, head_dim]`` cache). Tokens whose slot is negative
(padding) are skipped. The torch reference is ``TorchAttentionBackend.store_kv``.

The wrapper runs once per layer and checks nothing: the caches are checked when allocated, the
slot mapping once per step (``attention.contract``), and key/value are views of the model's
fused projection, unit-strided over head_dim by construction (``check_store_args``).
"""

from __future__ import annotations

import torch

from services.engine.kernels import triton_only

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the torch backend does not need this module
    triton = None


if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_mapping_ptr,
        key_stride_t,
        key_stride_h,
        value_stride_t,
        value_stride_h,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        # int64: slot * row size overflows int32 for caches past 2**31 elements.
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:  # padding tokens carry slot -1
            heads = tl.arange(0, BLOCK_H)[:, None]
            dims = tl.arange(0, BLOCK_D)[None, :]
            mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
            # The cache is contiguous, so a slot's rows are NUM_KV_HEADS * HEAD_DIM apart.
            dst = slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
            k = tl.load(key_ptr + token * key_stride_t + heads * key_stride_h + dims, mask=mask)
            tl.store(k_cache_ptr + dst, k, mask=mask)
            v_src = value_ptr + token * value_stride_t + heads * value_stride_h + dims
            tl.store(v_cache_ptr + dst, tl.load(v_src, mask=mask), mask=mask)


@triton_only
def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes ``key[t]``/``value[t]`` into cache slot ``slot_mapping[t]``; slots < 0 skip.

    ``key``/``value``: ``[num_tokens, num_kv_heads, head_dim]`` in the cache's dtype, any
    token/head strides (the model passes views of its fused qkv projection) but a unit stride
    over head_dim. ``k_cache``/``v_cache``: contiguous ``[num_blocks, block_size, num_kv_heads,
    head_dim]``. Not validated here: the caches are checked once when allocated and the slot
    mapping once per step (``attention.contract``), key and value by ``check_store_args``.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def check_store_args(key: torch.Tensor, value: torch.Tensor) -> None:
    """What ``store_kv`` indexes beyond the attention contract: key and value of one shape,
    each unit-strided over head_dim."""
    assert key.dim() == 3 and key.shape == value.shape, "key/value must be [T, kv_heads, d]"
    assert key.stride(2) == 1 and value.stride(2) == 1, "key/value need a unit head_dim stride"
