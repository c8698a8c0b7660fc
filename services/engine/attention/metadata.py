"""Builds the flattened-batch tensors (positions, slot_mapping, cu_seqlens, block tables)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.engine.attention.base import AttentionMetadata
from services.engine.attention.contract import AttentionContractError


def build_attention_metadata(
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Returns the step's metadata and the absolute ``positions`` of its new tokens.

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
    max_blocks = max(len(bt) for bt in block_tables)
    tables = np.zeros((len(block_tables), max_blocks), dtype=np.int64)
    for i, bt in enumerate(block_tables):
        tables[i, : len(bt)] = bt
    owner = np.repeat(np.arange(len(q)), q)
    block_idx = positions // block_size
    if (block_idx >= np.array([len(bt) for bt in block_tables])[owner]).any():
        raise AttentionContractError("a block table is too short for its sequence length")
    slots = tables[owner, block_idx] * block_size + positions % block_size
    cu_q = np.zeros(len(q) + 1, dtype=np.int32)
    cu_q[1:] = np.cumsum(q)
    cu_k = np.zeros(len(k) + 1, dtype=np.int32)
    cu_k[1:] = np.cumsum(k)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        cu_seqlens_q=torch.from_numpy(cu_q).to(device),
        cu_seqlens_k=torch.from_numpy(cu_k).to(device),
        context_lens=torch.from_numpy(k.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(tables.astype(np.int32)).to(device),
        max_seqlen_q=int(q.max()),
        max_seqlen_k=int(k.max()),
        query_lens=[int(x) for x in q],
        seq_lens=[int(x) for x in k],
        block_size=block_size,
    )
    return meta, torch.from_numpy(positions).to(device)
