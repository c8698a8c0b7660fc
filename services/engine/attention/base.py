"""The attention-backend contract: one flattened batch per step, KV read through block tables.

A step's batch concatenates the new tokens of every scheduled request::

    request:        r0 (prefill chunk)   r1 (decode)   r2 (decode)
    new tokens:     t0 t1 t2 t3          t4            t5
    cu_seqlens_q:   0            4             5             6
    context_lens:   4 (+cached prefix)   37            9

Request i's queries are ``query[cu_seqlens_q[i]:cu_seqlens_q[i+1]]``; they are the LAST
``q_len_i`` tokens of its ``context_lens[i]`` tokens, so query j of request i sits at absolute
position ``context_lens[i] - q_len_i + j`` and attends causally to keys ``0 .. that position``.
Keys and values of every context token live in the paged cache: token at absolute position p of
request i is stored in slot ``block_tables[i, p // block_size] * block_size + p % block_size``.
``slot_mapping[t]`` is that slot for new token t (the backend writes the new K/V there first).

KV cache per layer: ``k_cache`` and ``v_cache``, each logically ``[num_blocks, block_size,
num_kv_heads, head_dim]``, preallocated once by the backend: contiguous, except that the CPU
backend stores each block's keys transposed per head (the key tensor is then a permuted view).

The contract is checked where it is set up, not per layer: the caches once when allocated,
each step's metadata once before the model runs (``attention.contract``). Backends trust both.

What a backend derives from a step's metadata (which requests decode, gather indices, masks,
per-token kernel rows) is its ``plan``: built once per step by the runner
(``meta.plan = backend.plan(meta, layout)``) and read by every layer, never built by a layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about one step's flattened batch."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: physical KV slot of each new token
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32: query (new token) boundaries
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32: key boundaries (cumsum of context_lens)
    context_lens: torch.Tensor  # [num_seqs] int32: tokens in KV after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_seqlen_q: int
    max_seqlen_k: int
    # Host-side copies, so CPU backends never synchronise on device tensors.
    query_lens: list[int]
    seq_lens: list[int]  # == context_lens as Python ints
    block_size: int
    # Set by a CUDA graph (whose launches cannot follow max_seqlen_k from step to step): the
    # decode kernel's fixed context split count; None lets the kernel plan from max_seqlen_k.
    decode_num_splits: int | None = None
    # The backend's plan of this step (``AttentionBackend.plan``), set once by the runner.
    plan: Any = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.max_seqlen_q == 1


def allocate_plain_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's zeroed, contiguous ``k_cache`` and ``v_cache``. Zeroed, not empty: padded
    reads must see finite values."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device))


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """What a plan needs to know of the model's attention layers: fixed once it is loaded."""

    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's KV heads
    dtype: torch.dtype
    windows: frozenset[int | None] = frozenset({None})  # the layers' sliding windows
    softcap: float | None = None  # the layers' attention logit soft-cap (Gemma 2)


class AttentionBackend(Protocol):
    """Writes new K/V into the paged cache and computes attention for a flattened batch."""

    name: str

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's zeroed caches, logically ``[num_blocks, block_size, num_kv_heads,
        head_dim]``; the backend chooses the storage order (``contract.check_kv_caches``)."""
        ...

    def plan(self, meta: AttentionMetadata, layout: AttentionLayout) -> Any:
        """What every layer of the step will read of ``meta`` (``meta.plan``), built once;
        None for a backend whose kernels take the metadata as it is."""
        ...

    def store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,  # the layer's sliding window
        softcap: float | None = None,  # the layer's attention logit soft-cap
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
