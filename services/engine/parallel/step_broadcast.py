"""One step's batch, as the model ranks need it, and its broadcast from rank 0 to the others.

A step travels as one int64 array (sizes, token ids, lengths, logits rows, block tables) behind
a two-number header (kind, length), in one gloo broadcast of a fixed ``_INLINE`` slots on the
step group; only a step bigger than that (long block tables of many requests, a long prefill)
needs a second broadcast for the rest. The workers rebuild positions, KV slots and the
attention metadata from it exactly as rank 0 does, so every rank runs the same shapes and
meets the same collectives.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from services.engine.attention.metadata import pack_tables
from services.engine.parallel.group import TPGroup

_STEP, _STOP = 1, 0
# Slots of the first broadcast (8 KiB): a decode step of ~60 requests with 2k-token contexts,
# or a ~1,000-token prefill, fits in it.
_INLINE = 1024


class WireSection(Protocol):
    """A step feature's part of a step that the other ranks need (``StepBatch.sections``),
    as int64 words; its decoder is registered by name (``register_section``)."""

    def to_wire(self) -> np.ndarray: ...


# code -> (name, decoder). The code is the name's CRC-32, so every rank, having imported the
# same features' modules, maps it back alike whatever its import order.
_SECTIONS: dict[int, tuple[str, Callable[[np.ndarray], Any]]] = {}


def register_section(name: str, from_wire: Callable[[np.ndarray], Any]) -> None:
    """Makes ``StepBatch.sections[name]`` cross to the other ranks, decoded by ``from_wire``
    there (called once, where the feature's module defines its section)."""
    code = zlib.crc32(name.encode())
    assert _SECTIONS.get(code, (name,))[0] == name, f"section code of {name!r} is taken"
    _SECTIONS[code] = (name, from_wire)


@dataclass(slots=True)
class StepBatch:
    """A step's flattened inputs, as numpy arrays: request i's new tokens are the last
    ``query_lens[i]`` of its ``seq_lens[i]``, in blocks ``block_tables[i, :num_blocks[i]]``;
    ``rows``: the requests (indices) whose last new token gets logits, in order; ``scored``:
    (first hidden row, count) pairs, flattened, of the slices whose logits score prompt
    positions (prompt_logprobs), in order; ``extra_logits`` (one per ``rows`` entry): how many
    positions before that request's last new token get logits too (its last
    ``1 + extra_logits[i]`` tokens: a verifier scores every token it checks)."""

    input_ids: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [S, W] int32, zero-padded rows
    num_blocks: np.ndarray  # [S] int64
    seq_lens: np.ndarray  # [S] int64
    query_lens: np.ndarray  # [S] int64
    rows: np.ndarray  # [R] int64
    scored: list[int] = field(default_factory=list)
    # The step features' own parts (``WireSection``s, by feature name), absent when a feature
    # has nothing for the step.
    sections: dict[str, WireSection] = field(default_factory=dict)
    extra_logits: np.ndarray | None = None  # [R] int64
    # Sampling on the shards (``shard_sampling.ShardPlan``, encoded): the ranks sample their
    # vocabulary columns and rank 0 merges; None: rank 0 gathers the logits.
    shard_sampling: np.ndarray | None = None  # int64

    def logits_rows(self) -> np.ndarray:
        """The hidden rows that get logits, in order: each of ``rows``' last new token, or its
        last ``1 + extra_logits[i]``."""
        ends = np.cumsum(self.query_lens) - 1
        last = ends[self.rows]
        if self.extra_logits is None:
            return last
        counts = 1 + self.extra_logits
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return np.repeat(last - self.extra_logits, counts) + within

    @classmethod
    def of(
        cls,
        input_ids: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        rows: Sequence[int],
        scored: Sequence[int] = (),
    ) -> StepBatch:
        """A batch given as lists (tests, benchmarks)."""
        tables, num_blocks = pack_tables(block_tables)
        return cls(np.asarray(input_ids, np.int64), tables, num_blocks,
                   np.asarray(seq_lens, np.int64), np.asarray(query_lens, np.int64),
                   np.asarray(rows, np.int64), list(scored))

    def same_as(self, other: StepBatch) -> bool:
        return np.array_equal(encode(self), encode(other))


def encode(batch: StepBatch) -> np.ndarray:
    num_seqs, width = batch.block_tables.shape
    extra = batch.extra_logits if batch.extra_logits is not None else np.zeros(0, np.int64)
    plan = batch.shard_sampling if batch.shard_sampling is not None else np.zeros(0, np.int64)
    sizes = [len(batch.input_ids), num_seqs, width, len(batch.rows), len(batch.scored),
             len(extra), len(plan)]
    return np.concatenate(
        [
            np.asarray(sizes, dtype=np.int64),
            batch.input_ids.astype(np.int64, copy=False),
            batch.seq_lens.astype(np.int64, copy=False),
            batch.query_lens.astype(np.int64, copy=False),
            batch.rows.astype(np.int64, copy=False),
            np.asarray(batch.scored, dtype=np.int64),
            extra.astype(np.int64, copy=False),
            plan.astype(np.int64, copy=False),
            batch.num_blocks.astype(np.int64, copy=False),
            batch.block_tables.reshape(-1).astype(np.int64),
            *_encode_sections(batch),
        ]
    )


def decode(data: np.ndarray) -> StepBatch:
    num_tokens, num_seqs, width, num_rows, num_scored, num_extra, num_plan = (
        int(v) for v in data[:7])
    at = 7

    def take(n: int) -> np.ndarray:
        nonlocal at
        at += n
        return data[at - n : at]

    input_ids, seq_lens, query_lens = take(num_tokens), take(num_seqs), take(num_seqs)
    rows, scored, extra = take(num_rows), take(num_scored), take(num_extra)
    plan = take(num_plan)
    num_blocks = take(num_seqs)
    tables = take(num_seqs * width).reshape(num_seqs, width).astype(np.int32)
    batch = StepBatch(
        input_ids=input_ids.copy(),
        block_tables=tables,
        num_blocks=num_blocks.copy(),
        seq_lens=seq_lens.copy(),
        query_lens=query_lens.copy(),
        rows=rows.copy(),
        scored=scored.tolist(),
        extra_logits=extra.copy() if num_extra else None,
        shard_sampling=plan.copy() if num_plan else None,
    )
    if at < len(data):
        _decode_sections(batch, data[at:])
    return batch


def _encode_sections(batch: StepBatch) -> list[np.ndarray]:
    """The features' sections, after everything else (absent when there is none):
    [count, then per section: code, length, its words]."""
    if not batch.sections:
        return []
    parts = [np.asarray([len(batch.sections)], np.int64)]
    for name, section in batch.sections.items():
        words = section.to_wire()
        parts += [np.asarray([zlib.crc32(name.encode()), len(words)], np.int64),
                  words.astype(np.int64, copy=False)]
    return parts


def _decode_sections(batch: StepBatch, data: np.ndarray) -> None:
    at = 1
    for _ in range(int(data[0])):
        code, n = int(data[at]), int(data[at + 1])
        name, from_wire = _SECTIONS[code]
        batch.sections[name] = from_wire(data[at + 2 : at + 2 + n].copy())
        at += 2 + n


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


def broadcast_bytes(tp: TPGroup, data: torch.Tensor | None, nbytes: int) -> torch.Tensor:
    """Rank 0's ``data`` (``nbytes`` of uint8) on every rank, on the step group (every rank
    calls it at the same point of the same step)."""
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    buf = data if tp.is_first else torch.empty(nbytes, dtype=torch.uint8)
    assert buf is not None and buf.numel() == nbytes and buf.dtype == torch.uint8
    dist.broadcast(buf, 0, group=tp.step_group)
    return buf


def _send(tp: TPGroup, kind: int, payload: np.ndarray) -> None:
    first = np.zeros(_INLINE, dtype=np.int64)
    first[:2] = kind, len(payload)
    inline = min(len(payload), _INLINE - 2)
    first[2 : 2 + inline] = payload[:inline]
    dist.broadcast(torch.from_numpy(first), 0, group=tp.step_group)
    if inline < len(payload):
        dist.broadcast(torch.from_numpy(payload[inline:].copy()), 0, group=tp.step_group)
