"""One step's batch, as the model ranks need it, and its broadcast from rank 0 to the others.

A step travels as one int64 array (sizes, token ids, lengths, logits rows, block tables) behind
a two-number header (kind, length), in one gloo broadcast of a fixed ``_INLINE`` slots on the
step group; only a step bigger than that (long block tables of many requests, a long prefill)
needs a second broadcast for the rest. The workers rebuild positions, KV slots and the attention metadata from it exactly as rank 0
does, so every rank runs the same shapes and meets the same collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from services.engine.parallel.group import TPGroup

_STEP, _STOP = 1, 0
# Slots of the first broadcast (8 KiB): a decode step of ~60 requests with 2k-token contexts,
# or a ~1,000-token prefill, fits in it.
_INLINE = 1024


@dataclass(slots=True)
class StepBatch:
    """A step's flattened inputs; ``rows``: the requests (indices) whose last new token gets
    logits, in order; ``scored``: (first hidden row, count) pairs, flattened, of the slices
    whose logits score prompt positions (prompt_logprobs), in order."""

    input_ids: list[int]
    block_tables: list[list[int]]
    seq_lens: list[int]
    query_lens: list[int]
    rows: list[int]
    scored: list[int] = field(default_factory=list)


def encode(batch: StepBatch) -> np.ndarray:
    num_seqs = len(batch.seq_lens)
    table_lens = [len(t) for t in batch.block_tables]
    width = max(table_lens, default=0)
    tables = np.zeros((num_seqs, width), dtype=np.int64)
    for i, t in enumerate(batch.block_tables):
        tables[i, : len(t)] = t
    sizes = [len(batch.input_ids), num_seqs, width, len(batch.rows), len(batch.scored)]
    return np.concatenate(
        [
            np.asarray(sizes, dtype=np.int64),
            np.asarray(batch.input_ids, dtype=np.int64),
            np.asarray(batch.seq_lens, dtype=np.int64),
            np.asarray(batch.query_lens, dtype=np.int64),
            np.asarray(batch.rows, dtype=np.int64),
            np.asarray(batch.scored, dtype=np.int64),
            np.asarray(table_lens, dtype=np.int64),
            tables.reshape(-1),
        ]
    )


def decode(data: np.ndarray) -> StepBatch:
    num_tokens, num_seqs, width, num_rows, num_scored = (int(v) for v in data[:5])
    at = 5

    def take(n: int) -> np.ndarray:
        nonlocal at
        at += n
        return data[at - n : at]

    input_ids, seq_lens, query_lens = take(num_tokens), take(num_seqs), take(num_seqs)
    rows, scored, table_lens = take(num_rows), take(num_scored), take(num_seqs)
    tables = take(num_seqs * width).reshape(num_seqs, width)
    return StepBatch(
        input_ids=input_ids.tolist(),
        block_tables=[tables[i, :n].tolist() for i, n in enumerate(table_lens.tolist())],
        seq_lens=seq_lens.tolist(),
        query_lens=query_lens.tolist(),
        rows=rows.tolist(),
        scored=scored.tolist(),
    )


def send_step(tp: TPGroup, batch: StepBatch) -> None:
    """Rank 0: hands ``batch`` to every worker."""
    _send(tp, _STEP, encode(batch))


def send_stop(tp: TPGroup) -> None:
    """Rank 0: tells the workers to leave their loop."""
    _send(tp, _STOP, np.zeros(0, dtype=np.int64))


def receive_step(tp: TPGroup) -> StepBatch | None:
    """A worker: waits (as long as it takes) for the next step; None means stop."""
    first = torch.empty(_INLINE, dtype=torch.int64)
    dist.broadcast(first, 0, group=tp.step_group)
    kind, length = first[:2].tolist()
    if kind == _STOP:
        return None
    if length <= _INLINE - 2:
        return decode(first[2 : 2 + length].numpy())
    rest = torch.empty(length - (_INLINE - 2), dtype=torch.int64)
    dist.broadcast(rest, 0, group=tp.step_group)
    return decode(np.concatenate([first[2:].numpy(), rest.numpy()]))


def _send(tp: TPGroup, kind: int, payload: np.ndarray) -> None:
    first = np.zeros(_INLINE, dtype=np.int64)
    first[:2] = kind, len(payload)
    inline = min(len(payload), _INLINE - 2)
    first[2 : 2 + inline] = payload[:inline]
    dist.broadcast(torch.from_numpy(first), 0, group=tp.step_group)
    if inline < len(payload):
        dist.broadcast(torch.from_numpy(payload[inline:].copy()), 0, group=tp.step_group)
