"""Builds the flattened-batch tensors (positions, slot_mapping, cu_seqlens, block tables).

``plan_step`` does the arithmetic once, on the host, into numpy arrays; ``build_attention_metadata``
wraps them as tensors on a device (the CPU runner, the tests), and ``step_buffers.StepBuffers``
stages them in pinned memory and sends a step in one copy (the GPU runner).
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
    """One step's integer inputs on the host; ``block_tables`` is filled by ``plan_step``
    into the array the caller passed (rows past each table's length are left as they were)."""

    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    cu_seqlens_q: np.ndarray  # [S + 1] int32
    cu_seqlens_k: np.ndarray  # [S + 1] int32
    context_lens: np.ndarray  # [S] int32
    query_lens: list[int]
    seq_lens: list[int]
    max_blocks: int  # the widest block table of the step

    @property
    def max_seqlen_q(self) -> int:
        return max(self.query_lens)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.seq_lens)


def plan_step(
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    tables_out: np.ndarray,
) -> HostStep:
    """The step's positions, slots and boundaries; writes the block tables into
    ``tables_out[:S, :max_blocks]`` (int32, wide enough: the caller sizes it).

    ``seq_lens[i]`` counts request i's tokens in KV after this step (cached + new);
    ``query_lens[i]`` how many of them are new (computed this step, always the last ones).
    The inputs come from the scheduler, not from a client: the runner checks the result with
    ``contract.check_step`` (lengths, token count, block size); only what the padded metadata
    can no longer show, a block table too short for its own request, is checked here.
    """
    assert len(block_tables) == len(seq_lens) == len(query_lens), "one entry per request"
    q = np.asarray(query_lens, dtype=np.int64)
    k = np.asarray(seq_lens, dtype=np.int64)
    num_tokens = int(q.sum())
    # Absolute position of each new token: seq_len - q_len + j.
    starts = np.repeat(k - q, q)
    offsets = np.arange(num_tokens) - np.repeat(np.cumsum(q) - q, q)
    positions = starts + offsets
    table_lens = np.fromiter((len(bt) for bt in block_tables), np.int64, len(block_tables))
    max_blocks = int(table_lens.max())
    assert tables_out.shape[1] >= max_blocks, "tables_out is too narrow for the step"
    for i, bt in enumerate(block_tables):
        tables_out[i, : len(bt)] = bt
    owner = np.repeat(np.arange(len(q)), q)
    block_idx = positions // block_size
    if (block_idx >= table_lens[owner]).any():
        raise AttentionContractError("a block table is too short for its sequence length")
    slots = tables_out[owner, block_idx].astype(np.int64) * block_size + positions % block_size
    cu_q = np.zeros(len(q) + 1, dtype=np.int32)
    cu_q[1:] = np.cumsum(q)
    cu_k = np.zeros(len(k) + 1, dtype=np.int32)
    cu_k[1:] = np.cumsum(k)
    return HostStep(
        positions=positions,
        slot_mapping=slots,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        context_lens=k.astype(np.int32),
        query_lens=q.tolist(),
        seq_lens=k.tolist(),
        max_blocks=max_blocks,
    )


def build_attention_metadata(
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Returns the step's metadata and the absolute ``positions`` of its new tokens, as
    tensors of their own on ``device`` (see ``plan_step`` for the arguments)."""
    tables = np.zeros((len(block_tables), max(len(bt) for bt in block_tables)), dtype=np.int32)
    step = plan_step(block_tables, seq_lens, query_lens, block_size, tables)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(step.slot_mapping).to(device),
        cu_seqlens_q=torch.from_numpy(step.cu_seqlens_q).to(device),
        cu_seqlens_k=torch.from_numpy(step.cu_seqlens_k).to(device),
        context_lens=torch.from_numpy(step.context_lens).to(device),
        block_tables=torch.from_numpy(tables).to(device),
        max_seqlen_q=step.max_seqlen_q,
        max_seqlen_k=step.max_seqlen_k,
        query_lens=step.query_lens,
        seq_lens=step.seq_lens,
        block_size=block_size,
    )
    return meta, torch.from_numpy(step.positions).to(device)
