"""The block manager's building blocks: a KV block and the free-block queue.

Pure Python (no torch): these objects only describe which physical KV slots hold what; the
tensors themselves belong to the model runner.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from services.protocol.block_hash import BlockHash


# eq=False: blocks are identities (two blocks are never "equal"), and a field-wise __eq__ would
# recurse through the free-queue links.
@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical KV block of ``block_size`` token slots."""

    block_id: int
    # Number of live requests whose block table holds this block; 0 means it is in the free
    # queue (possibly still cached, until its slot is needed).
    ref_cnt: int = 0
    # Chain hash of the full prefix ending with this block; None until the block is full and
    # cached, and again once it is evicted.
    block_hash: BlockHash | None = None
    # The block's own tokens, kept while it is cached: a hit compares them, so a hash collision
    # between blocks with different tokens can never serve the wrong KV.
    token_ids: tuple[int, ...] = ()
    # Intrusive links of the free queue; both None exactly when the block is not queued.
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)

    @property
    def is_free(self) -> bool:
        return self.prev_free is not None


class FreeBlockQueue:
    """Free blocks in eviction order (head = taken first), as an intrusive doubly linked list.

    The links live in the blocks themselves, so taking a cached block back out of the middle
    (a prefix hit on a block nobody holds) is O(1), unlike ``deque.remove``. Two sentinel nodes
    bound the list, so no operation needs an empty-list special case::

        head_sentinel <-> b7 <-> b2 <-> b5 <-> tail_sentinel
                          ^ popleft()         ^ append()
    """

    __slots__ = ("_head", "_len", "_tail")

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(block_id=-1)
        self._tail = KVBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("pop from an empty FreeBlockQueue")
        self.remove(first)
        return first

    def append(self, block: KVBlock) -> None:
        """Queues ``block`` last (evicted last)."""
        last = self._tail.prev_free
        assert last is not None  # the sentinels are always linked; narrows the type
        self._link(block, last, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        """Queues ``block`` first (reused first)."""
        first = self._head.next_free
        assert first is not None  # the sentinels are always linked; narrows the type
        self._link(block, self._head, first)

    def remove(self, block: KVBlock) -> None:
        """Unlinks ``block`` from wherever it sits in the queue, in O(1)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def _link(self, block: KVBlock, prev: KVBlock, nxt: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1
