"""Sliding-window and soft-capped attention in torch: the path of the models that need them.

Mistral, Mixtral and Phi-3 attend within a sliding window; Gemma 2 and 3 alternate windowed and
global layers, and Gemma 2 soft-caps its attention logits (``cap * tanh(scores / cap)``, which
SDPA cannot do). These layers take this path on the CPU (the torch and the CPU backend alike);
the Triton kernels do both natively on the GPU.

A query at absolute position p sees key k when ``p - window < k <= p`` (transformers'
``sliding_window_overlay``; no window: ``0 <= k <= p``). Only the keys of some query's window
are gathered, so a long context costs ``window`` keys per request, not its whole length::

    keys ->       0  1  2  3  4  5  6  7      context 8, window 3, the last 2 tokens new
    query p=6     .  .  .  .  1  1  1  .      gathered: blocks holding keys 4..7
    query p=7     .  .  .  .  .  1  1  1

The step's single-token requests form one batch (a ``[B, L]`` gather through per-key block ids
and offsets, padded and masked); each multi-token request is attended to on its own. The
layout of a step (gather indices and masks) depends only on the metadata and the window, so
it is built once per (step, window) and shared by every layer with that window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.attention.base import AttentionMetadata


@dataclass(slots=True)
class _KeyGroup:
    """Queries of one or more requests and the (window-trimmed) keys they attend to."""

    q_rows: torch.Tensor | slice  # rows of the step's query: [B] indices, or one request's range
    q_len: int  # queries per request (1 for the decode batch)
    blocks: torch.Tensor  # [B, L] physical block of each gathered key
    offsets: torch.Tensor  # [B, L] its row inside the block
    visible: torch.Tensor  # [B, 1, 1, q_len, L] True where the query sees the key


@dataclass(slots=True)
class WindowedPlan:
    meta: AttentionMetadata
    # The fields below identify the metadata's contents (as TorchAttentionBackend's plan).
    block_tables: torch.Tensor
    seq_lens: list[int]
    groups: list[_KeyGroup]

    def is_for(self, meta: AttentionMetadata) -> bool:
        return (
            self.meta is meta
            and self.block_tables is meta.block_tables
            and self.seq_lens is meta.seq_lens
        )


def build_plan(meta: AttentionMetadata, window: int | None, device: torch.device) -> WindowedPlan:
    tables = meta.block_tables.to(device)
    starts = [0]
    for q_len in meta.query_lens:
        starts.append(starts[-1] + q_len)
    decode = [i for i, q_len in enumerate(meta.query_lens) if q_len == 1]
    groups = []
    if decode:
        groups.append(_group(tables, decode, starts, meta, 1, window, device))
    for i, q_len in enumerate(meta.query_lens):
        if q_len > 1:
            groups.append(_group(tables, [i], starts, meta, q_len, window, device))
    return WindowedPlan(meta, meta.block_tables, meta.seq_lens, groups)


def _group(
    tables: torch.Tensor,
    rows: list[int],
    starts: list[int],
    meta: AttentionMetadata,
    q_len: int,
    window: int | None,
    device: torch.device,
) -> _KeyGroup:
    bs = meta.block_size
    seq_lens = [meta.seq_lens[i] for i in rows]
    # First key any query of the request can see, rounded down to its block.
    firsts = [0 if window is None else max(0, n - q_len - window + 1) // bs * bs for n in seq_lens]
    length = max(n - f for n, f in zip(seq_lens, firsts, strict=True))
    first = torch.tensor(firsts, device=device)[:, None]
    pos = first + torch.arange(length, device=device)[None, :]  # [B, L] absolute key positions
    lens = torch.tensor(seq_lens, device=device)[:, None]
    block_idx = (pos // bs).clamp_(max=tables.shape[1] - 1)  # padding keys: any real block
    blocks = tables[torch.tensor(rows, device=device)].to(torch.int64).gather(1, block_idx)
    q_pos = lens - q_len + torch.arange(q_len, device=device)[None, :]  # [B, q_len]
    visible = (pos[:, None, :] <= q_pos[:, :, None]) & (pos[:, None, :] < lens[:, :, None])
    if window is not None:
        visible &= pos[:, None, :] > q_pos[:, :, None] - window
    if q_len == 1:
        q_rows: torch.Tensor | slice = torch.tensor([starts[i] for i in rows], device=device)
    else:
        q_rows = slice(starts[rows[0]], starts[rows[0] + 1])
    return _KeyGroup(
        q_rows=q_rows,
        q_len=q_len,
        blocks=blocks,
        offsets=pos % bs,
        visible=visible[:, None, None],
    )


def windowed_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: WindowedPlan,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    out = torch.empty_like(query)
    for group in plan.groups:
        q = query[group.q_rows]
        out[group.q_rows] = _attend(q, k_cache, v_cache, group, scale, softcap).to(query.dtype)
    return out


def _attend(
    q: torch.Tensor,  # [B * q_len, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: _KeyGroup,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    num_kv_heads = k_cache.shape[2]
    num_seqs = group.blocks.shape[0]
    _, num_heads, head_dim = q.shape
    g = num_heads // num_kv_heads
    # [B, H_kv, g, q_len, D] queries against [B, H_kv, 1, L, D] keys: GQA without repeating KV.
    q = q.view(num_seqs, group.q_len, num_kv_heads, g, head_dim).permute(0, 2, 3, 1, 4)
    # Advanced indexing works on any cache layout (the CPU backend's is a permuted view).
    k = k_cache[group.blocks, group.offsets].permute(0, 2, 1, 3).unsqueeze(2)
    v = v_cache[group.blocks, group.offsets].permute(0, 2, 1, 3).unsqueeze(2)
    # As transformers' eager attention: scale, cap, mask, float32 softmax, back to the dtype.
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~group.visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v)  # [B, H_kv, g, q_len, D]
    return out.permute(0, 3, 1, 2, 4).reshape(num_seqs * group.q_len, num_heads, head_dim)
