"""KV events: the engine's prefix cache changes, published for the routers' block index."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import msgpack

from services.protocol.block_hash import BlockHash


class Medium(StrEnum):
    """Where the blocks of an event live (vLLM's ``medium`` names, plus the shared store)."""

    GPU = "GPU"  # the engine's KV pool (on the CPU engine too: vLLM's name for the pool)
    CPU = "CPU"  # the engine's host-memory tier (--kv-offloading-size)
    SHARED = "SHARED"  # the KV store shared by every engine of the model (--kv-store-url)


class KVEventKind(StrEnum):
    STORED = "stored"  # blocks entered the prefix cache
    REMOVED = "removed"  # blocks left it (evicted, or the cache was reset)
    CLEARED = "cleared"  # a re-announcement starts: forget everything published before


@dataclass(frozen=True, slots=True)
class KVEvent:
    """A change to an engine's prefix cache."""

    kind: KVEventKind
    block_hashes: tuple[BlockHash, ...] = ()  # in chain order for STORED; empty for CLEARED
    block_size: int = 0  # tokens per block (0: not stated)
    # STORED only: hash of the block before the first one stored (None: it starts the prompt).
    parent_hash: BlockHash | None = None
    # STORED only: the stored blocks' tokens, flattened (len == len(block_hashes) * block_size).
    token_ids: tuple[int, ...] = ()
    medium: Medium = Medium.GPU  # the tier the change happened in


def encode_batch(engine_id: str, timestamp: float, events: list[KVEvent]) -> bytes:
    """A batch of events as msgpack, in vLLM's array-encoded shape (``KVEventBatch``: [ts,
    events, engine]; ``BlockStored``: [tag, hashes, parent, token_ids, block_size, lora_id,
    medium]; ``BlockRemoved``: [tag, hashes, medium]; ``AllBlocksCleared``: [tag]), so a
    subscriber written for vLLM's events reads Pagoda's (hashes are 16 raw bytes)."""
    return msgpack.packb([timestamp, _vllm_events(events, False), engine_id], use_bin_type=True)


def encode_vllm_batch(timestamp: float, events: list[KVEvent], data_parallel_rank: int = 0,
                      lora_name: str | None = None) -> bytes:
    """The same events exactly as vLLM's ZeroMQ publisher sends a ``KVEventBatch`` (msgspec,
    array-like, trailing defaults left out): [ts, events, data_parallel_rank], ``BlockStored``
    with ``lora_name`` after ``medium``; what llm-d's KV-event subscribers decode."""
    return msgpack.packb([timestamp, _vllm_events(events, True, lora_name), data_parallel_rank],
                         use_bin_type=True)


def _vllm_events(events: list[KVEvent], with_lora_name: bool,
                 lora_name: str | None = None) -> list[list[object]]:
    out: list[list[object]] = []
    for e in events:
        if e.kind is KVEventKind.STORED:
            stored: list[object] = ["BlockStored", list(e.block_hashes), e.parent_hash,
                                    list(e.token_ids), e.block_size, None, e.medium.value]
            out.append(stored + [lora_name] if with_lora_name else stored)
        elif e.kind is KVEventKind.REMOVED:
            out.append(["BlockRemoved", list(e.block_hashes), e.medium.value])
        else:
            out.append(["AllBlocksCleared"])
    return out
