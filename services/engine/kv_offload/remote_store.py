"""Tier 2: a KV store shared by every engine of a model, on Redis/Valkey.

A separate instance from the routers' index, run with its own ``maxmemory`` and
``allkeys-lru``: the store evicts by itself and nothing here deletes. Keys::

    pagoda:kvs:{namespace}:{block hash, hex}     one block: header, tokens, KV bytes
    pagoda:kvs:{namespace}:seed                  the chain's base-model seed (checked on join)

``namespace`` is a digest of what makes KV bytes interchangeable (model, dtype, block size,
layers, KV heads per rank, head size, tensor-parallel size, hash algorithm), so engines that
cannot share never read each other's blocks. The block hash carries the tenant salt and the
adapter (the chain's seed), so no tenant or adapter reads another's blocks; the value also
holds the block's tokens, compared on load (a hash collision never serves wrong KV), and an
xxh3-64 checksum over tokens and bytes: a block that fails it is a miss (recomputed).

Loads are one MGET for a run of blocks. Writes go through a bounded queue to a thread of their
own, pipelined; a full queue drops the write (the block is only not shared).

Faults: every call has a short socket timeout. A failed call is a miss (or a dropped write),
counted in ``errors``, logged once per outage, and the store is left alone for
``_RETRY_AFTER_S`` before the next try (a down store costs one timeout per interval, not one
per request); the next success logs that it is back. A store that does not answer at start is
the same outage: the engine starts without it and uses it once it answers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis
import xxhash

from services.common.redis_index import redact_url
from services.protocol.block_hash import BlockHash

logger = logging.getLogger(__name__)

PASSWORD_ENV = "KV_STORE_PASSWORD"
_MAGIC = b"PKV1"
_HEADER = struct.Struct("<4sQI")  # magic, checksum, number of tokens
_RETRY_AFTER_S = 2.0
_MAX_QUEUED_WRITES = 1024


@dataclass(frozen=True, slots=True)
class StoreLayout:
    """What must match for two engines to share KV bytes."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    tensor_parallel_size: int
    hash_algorithm: str

    def namespace(self) -> str:
        text = json.dumps([self.model, self.dtype, self.block_size, self.num_layers,
                           self.num_kv_heads, self.head_dim, self.tensor_parallel_size,
                           self.hash_algorithm])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def encode_block(token_ids: Sequence[int], payload: bytes) -> bytes:
    tokens = struct.pack(f"<{len(token_ids)}I", *token_ids)
    checksum = xxhash.xxh3_64_intdigest(tokens + payload)
    return _HEADER.pack(_MAGIC, checksum, len(token_ids)) + tokens + payload


def decode_block(value: bytes, token_ids: Sequence[int], payload_bytes: int) -> bytes | None:
    """The block's KV bytes, or None if ``value`` is not exactly this block intact."""
    n = len(token_ids)
    if len(value) != _HEADER.size + 4 * n + payload_bytes:
        return None
    magic, checksum, count = _HEADER.unpack_from(value)
    body = memoryview(value)[_HEADER.size:]
    if magic != _MAGIC or count != n or xxhash.xxh3_64_intdigest(body) != checksum:
        return None
    if struct.unpack_from(f"<{n}I", value, _HEADER.size) != tuple(token_ids):
        return None
    return bytes(body[4 * n:])


@dataclass(slots=True)
class StoreStats:
    hits: int = 0  # blocks loaded
    misses: int = 0  # blocks asked for and not there
    corrupt: int = 0  # blocks that failed their checksum (recomputed)
    errors: int = 0  # failed calls (store down or slow)
    writes: int = 0  # blocks written
    dropped_writes: int = 0  # writes not sent (queue full, or the store down)


class RemoteKVStore:
    """One engine's client of the shared store (thread-safe: redis-py's pool)."""

    def __init__(self, url: str, layout: StoreLayout, seed: bytes, timeout_s: float) -> None:
        self.url = url
        self.prefix = f"pagoda:kvs:{layout.namespace()}:"
        self._seed = seed.hex()
        # A password in the URL wins; else $KV_STORE_PASSWORD (the chart's Secret), so it never
        # shows in a manifest or in the process's arguments.
        self._client = redis.Redis.from_url(url, password=os.environ.get(PASSWORD_ENV) or None,
                                            socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s,
                                            retry_on_timeout=False)
        self.stats = StoreStats()
        self._down_until = 0.0
        self._failing = False
        self._seed_checked = False
        self.disabled: str | None = None  # set for good when the seed check fails
        self._writes: queue.Queue[tuple[BlockHash, bytes] | None] = queue.Queue(
            _MAX_QUEUED_WRITES)
        self._writer = threading.Thread(target=self._write_loop, name="kv-store-writer",
                                        daemon=True)
        self._writer.start()
        if self._call(self._join) is None and self.disabled is None:
            logger.warning("KV store %s does not answer: starting without it; it is used "
                           "once it answers", redact_url(url))

    @property
    def available(self) -> bool:
        return self.disabled is None and time.monotonic() >= self._down_until

    def key(self, block_hash: BlockHash) -> str:
        return self.prefix + block_hash.hex()

    def get_many(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """The stored values of ``hashes`` in one round trip; all None when the store is
        unavailable."""
        if not hashes or not self.available:
            return [None] * len(hashes)
        values = self._call(lambda: self._client.mget([self.key(h) for h in hashes]))
        return [None] * len(hashes) if values is None else values

    def put(self, block_hash: BlockHash, value: bytes) -> None:
        """Queues a write (never blocks: dropped when the queue is full)."""
        if not self.available:
            self.stats.dropped_writes += 1
            return
        try:
            self._writes.put_nowait((block_hash, value))
        except queue.Full:
            self.stats.dropped_writes += 1

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(timeout=2.0)
        self._client.close()

    # -- internals ----------------------------------------------------------------------------

    def _join(self) -> bool:
        """Checks (once) that the store's engines hash with this engine's seed."""
        if self._seed_checked:
            return True
        key = self.prefix + "seed"
        self._client.set(key, self._seed, nx=True)
        theirs = self._client.get(key)
        if theirs is not None and theirs.decode() != self._seed:
            self.disabled = (f"KV store {redact_url(self.url)}: its block-hash seed differs from "
                             "this engine's (another hash algorithm or model name); not used")
            logger.error("%s", self.disabled)
            return False
        self._seed_checked = True
        return True

    def _call(self, fn):  # noqa: ANN001, ANN202 - any redis call
        if not self._seed_checked and fn != self._join:
            if self._call(self._join) is not True:
                return None
        try:
            result = fn()
        except (redis.RedisError, OSError) as exc:
            self.stats.errors += 1
            self._down_until = time.monotonic() + _RETRY_AFTER_S
            if not self._failing:
                logger.warning("KV store %s failed (%s): recomputing until it answers",
                               redact_url(self.url), exc)
            self._failing = True
            return None
        if self._failing:
            logger.info("KV store %s answers again", redact_url(self.url))
        self._failing = False
        return result

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            batch = [item]
            stop = False
            while len(batch) < 64:
                try:
                    nxt = self._writes.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            self._flush(batch)
            for _ in batch:
                self._writes.task_done()
            if stop:
                return

    @property
    def pending_writes(self) -> int:
        """Writes queued or being sent."""
        return self._writes.unfinished_tasks

    def _flush(self, batch: list[tuple[BlockHash, bytes]]) -> None:
        if not self.available:
            self.stats.dropped_writes += len(batch)
            return

        def send() -> bool:
            pipe = self._client.pipeline(transaction=False)
            for h, value in batch:
                pipe.set(self.key(h), value)
            pipe.execute()
            return True

        if self._call(send):
            self.stats.writes += len(batch)
        else:
            self.stats.dropped_writes += len(batch)
