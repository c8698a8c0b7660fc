"""Builds the flattened-batch tensors (positions, slot_mapping, cu_seqlens, block tables).

``plan_step`` does the arithmetic once, on the host, into numpy arrays (from the block tables
the persistent input batch gathered); ``to_metadata`` wraps them as tensors on a device (the
CPU runner), and ``step_buffers.StepBuffers`` stages them in pinned memory and sends a step in
one copy (the GPU runner).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.attention.base import AttentionMetadata
from services.engine.attention.contract import AttentionContractError


@dataclass(slots=True)
class HostStep:
    """One step's integer inputs on the host."""

    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    cu_seqlens_q: np.ndarray  # [S + 1] int32
    cu_seqlens_k: np.ndarray  # [S + 1] int32
    context_lens: np.ndarray  # [S] int32
    block_tables: np.ndarray  # [S, W] int32, each row padded with 0
    query_lens: list[int]
    seq_lens: list[int]
    max_seqlen_q: int
    max_seqlen_k: int


def pack_tables(block_tables: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Lists of block ids as one zero-padded ``[S, W]`` int32 array, and each row's length."""
    lens = np.fromiter((len(bt) for bt in block_tables), np.int64, len(block_tables))
    tables = np.zeros((len(block_tables), int(lens.max(initial=0))), dtype=np.int32)
    for i, bt in enumerate(block_tables):
        tables[i, : len(bt)] = bt
    return tables, lens


def plan_step(
    tables: np.ndarray,
    num_blocks: np.ndarray,
    seq_lens: np.ndarray,
    query_lens: np.ndarray,
    block_size: int,
) -> HostStep:
    """The step's positions, slots and boundaries, all vectorised.

    ``tables[i, :num_blocks[i]]`` are request i's blocks (int32, zero-padded rows);
    ``seq_lens[i]`` counts its tokens in KV after this step (cached + new); ``query_lens[i]``
    how many of them are new (computed this step, always the last ones). The inputs come from
    the scheduler, not from a client: the runner checks the result with
    ``contract.check_step`` (lengths, token count, block size); only what the padded tables
    can no longer show, a block table too short for its own request, is checked here.
    """
    q = np.asarray(query_lens, dtype=np.int64)
    k = np.asarray(seq_lens, dtype=np.int64)
    assert tables.shape[0] == len(q) == len(k) == len(num_blocks), "one entry per request"
    num_tokens = int(q.sum())
    if (-(-k // block_size) > num_blocks).any():
        raise AttentionContractError("a block table is too short for its sequence length")
    decodes = num_tokens == len(q)  # (q >= 1: check_step refuses the rest)
    if decodes:  # each one's last position
        positions = k - 1
        owner = np.arange(len(q))
        cu_q = np.arange(len(q) + 1, dtype=np.int32)
    else:  # absolute position of each new token: seq_len - q_len + j
        cumulative = np.cumsum(q)
        positions = np.repeat(k - q, q) + np.arange(num_tokens) - np.repeat(cumulative - q, q)
        owner = np.repeat(np.arange(len(q)), q)
        cu_q = np.zeros(len(q) + 1, dtype=np.int32)
        cu_q[1:] = cumulative
    block_idx = positions // block_size
    slots = tables[owner, block_idx].astype(np.int64) * block_size + positions % block_size
    cu_k = np.zeros(len(k) + 1, dtype=np.int32)
    cu_k[1:] = np.cumsum(k)
    return HostStep(
        positions=positions,
        slot_mapping=slots,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        context_lens=k.astype(np.int32),
        block_tables=tables,
        query_lens=[1] * len(q) if decodes else q.tolist(),
        seq_lens=k.tolist(),
        max_seqlen_q=int(q.max(initial=0)),
        max_seqlen_k=int(k.max(initial=0)),
    )


def to_metadata(step: HostStep, block_size: int,
                device: torch.device | str = "cpu") -> tuple[AttentionMetadata, torch.Tensor]:
    """The step's metadata and the absolute ``positions`` of its new tokens, as tensors on
    ``device`` (CPU: views of the host arrays, no copy)."""
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(step.slot_mapping).to(device),
        cu_seqlens_q=torch.from_numpy(step.cu_seqlens_q).to(device),
        cu_seqlens_k=torch.from_numpy(step.cu_seqlens_k).to(device),
        context_lens=torch.from_numpy(step.context_lens).to(device),
        block_tables=torch.from_numpy(step.block_tables).to(device),
        max_seqlen_q=step.max_seqlen_q,
        max_seqlen_k=step.max_seqlen_k,
        query_lens=step.query_lens,
        seq_lens=step.seq_lens,
        block_size=block_size,
    )
    return meta, torch.from_numpy(step.positions).to(device)


def build_attention_metadata(
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """``to_metadata`` of a step given as lists (the warm-up's and the tests' way in)."""
    tables, lens = pack_tables(block_tables)
    step = plan_step(tables, lens, np.asarray(seq_lens), np.asarray(query_lens), block_size)
    return to_metadata(step, block_size, device)
