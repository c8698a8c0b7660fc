"""KV events: the engine's prefix cache changes, published for the routers' block index."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from services.protocol.block_hash import BlockHash


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
