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

The step's single-token requests form one batch (whole blocks gathered per request from the
first one its window reaches, padded to the longest and masked); each multi-token request is
attended to on its own. GQA is one batched matmul of ``[B, H_kv, group * q_len, D]`` queries
against ``[B, H_kv, L, D]`` keys. The layout of a step (blocks and masks) depends only on the
metadata and the window, so it is built once per (step, window) and shared by every layer with
that window (the backend's ``plan``). A step whose contexts all fit in the window, without a
soft-cap, never comes here: that is plain causal attention, and the torch backend's own paths
(or the C++ kernel) run it.
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
    blocks: torch.Tensor  # [B, num_blocks] the blocks gathered: keys L = num_blocks * block_size
    visible: torch.Tensor  # [B, 1, 1, q_len, L] True where the query sees the key


@dataclass(slots=True)
class WindowedPlan:
    """One step's key groups for the layers of one window (part of the step's plan)."""

    groups: list[_KeyGroup]


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
    return WindowedPlan(groups)


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
    # The block of the first key any query of the request can see: whole blocks are gathered.
    firsts = [0 if window is None else max(0, n - q_len - window + 1) // bs for n in seq_lens]
    num_blocks = max(-(-n // bs) - f for n, f in zip(seq_lens, firsts, strict=True))
    first = torch.tensor(firsts, device=device)[:, None]
    block_idx = first + torch.arange(num_blocks, device=device)[None, :]
    block_idx = block_idx.clamp_(max=tables.shape[1] - 1)  # padding keys: any real block
    blocks = tables[torch.tensor(rows, device=device)].to(torch.int64).gather(1, block_idx)
    # [B, L] absolute key positions
    pos = first * bs + torch.arange(num_blocks * bs, device=device)[None, :]
    lens = torch.tensor(seq_lens, device=device)[:, None]
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
    num_seqs, length = group.visible.shape[0], group.visible.shape[-1]
    _, num_heads, head_dim = q.shape
    g, q_len = num_heads // num_kv_heads, group.q_len
    # [B, H_kv, g * q_len, D] queries against [B, H_kv, L, D] keys: GQA as one batched matmul,
    # without repeating (or broadcasting) KV heads.
    q = q.view(num_seqs, q_len, num_kv_heads, g, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, g * q_len, head_dim)
    k = _gather(k_cache, group).permute(0, 2, 1, 3)
    v = _gather(v_cache, group).permute(0, 2, 1, 3)
    # As transformers' eager attention: scale, cap, mask, float32 softmax, back to the dtype.
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(num_seqs, num_kv_heads, g, q_len, length)
    scores = scores.masked_fill(~group.visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs.view(num_seqs, num_kv_heads, g * q_len, length), v)
    out = out.view(num_seqs, num_kv_heads, g, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs * q_len, num_heads, head_dim)


def _gather(cache: torch.Tensor, group: _KeyGroup) -> torch.Tensor:
    """``[B, L, H_kv, D]``: the group's keys (or values) in position order, whole blocks with one
    index op (it also reads the CPU backend's permuted layout)."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    rows = cache.index_select(0, group.blocks.view(-1))
    return rows.view(group.blocks.shape[0], -1, num_kv_heads, head_dim)
