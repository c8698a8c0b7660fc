"""Tier 2: a KV store shared by every engine of a model, on Redis/Valkey.

A separate instance from the routers' index, run with its own ``maxmemory`` and
``allkeys-lru``: the store evicts by itself and nothing here deletes. Keys::

    pagoda:kvs:{namespace}:{block hash, hex}     one block: header, MAC tag, KV bytes
    pagoda:kvs:{namespace}:seed                  the chain's base-model seed (checked on join)

``namespace`` is a digest of what makes KV bytes interchangeable (model, a digest of its
weights, dtype, block size, layers, KV heads per rank, head size, tensor-parallel size, hash
algorithm), so engines that cannot share, two weight versions under one name included, never
read each other's blocks. The block hash carries the tenant salt and the adapter (the chain's
seed), so no tenant or adapter reads another's blocks. Values are authenticated with the
deployment's secret (``block_value``: a keyed MAC over the key, the block's tokens and its
bytes): a value anything without the secret wrote, or one that is not exactly this block, is a
miss (recomputed), never used.

Loads are one MGET for a run of blocks. Writes go through a bounded queue to a thread of their
own, pipelined; a full queue drops the write (the block is only not shared). ``put_many`` is the
other way to write, for P/D through the store (``kv_offload/pd_store.py``): one pipelined
round trip on the caller's thread, which learns whether the store acknowledged every block.
The writer thread outlives any error of a batch (the batch is dropped and counted), and
``close`` returns within ``_CLOSE_WAIT_S`` whatever the writer or the queue are doing.

Threads: the engine thread (start, ``available``), the copy thread (loads, ``put``), the
writer and P/D's writers (``put_many``) all count into ``stats`` and mark outages; one lock
guards those (never held over a call to the store). ``stats`` is a copy.

Faults: every call has a short socket timeout. A failed call is a miss (or a dropped write),
counted in ``errors``, logged once per outage, and the store is left alone for
``_RETRY_AFTER_S`` before the next try (a down store costs one timeout per interval, not one
per request); the next success logs that it is back. A store that does not answer at start is
the same outage: the engine starts without it and uses it once it answers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

from services.common.redis_index import redact_url
from services.engine.kv_offload.block_value import BlockCodec
from services.engine.kv_offload.secret import load_store_secret
from services.engine.kv_offload.weights_digest import weights_digest
from services.protocol.block_hash import BlockHash

logger = logging.getLogger(__name__)

T = TypeVar("T")

PASSWORD_ENV = "KV_STORE_PASSWORD"
_RETRY_AFTER_S = 2.0
_MAX_QUEUED_WRITES = 1024
_MAX_BATCH = 64
_CLOSE_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class StoreLayout:
    """What must match for two engines to share KV bytes."""

    model: str
    weights: str  # weights_digest: two weight versions under one name never share
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    tensor_parallel_size: int
    hash_algorithm: str

    @classmethod
    def of_pool(cls, model: str, model_path: str, kv_caches: Sequence[tuple[Any, Any]],
                block_size: int, tensor_parallel_size: int, hash_algorithm: str) -> StoreLayout:
        """The layout of an engine's KV pool (``kv_caches``: its (key, value) tensors per
        layer, [blocks, block_size, kv_heads, head_dim])."""
        k0 = kv_caches[0][0]
        return cls(model, weights_digest(model_path), str(k0.dtype), block_size,
                   len(kv_caches), k0.shape[2], k0.shape[3], tensor_parallel_size,
                   hash_algorithm)

    def namespace(self) -> str:
        text = json.dumps([self.model, self.weights, self.dtype, self.block_size,
                           self.num_layers, self.num_kv_heads, self.head_dim,
                           self.tensor_parallel_size, self.hash_algorithm])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(slots=True)
class StoreStats:
    hits: int = 0  # blocks loaded
    misses: int = 0  # blocks asked for and not there
    corrupt: int = 0  # blocks that failed their MAC (foreign, damaged or not this block)
    errors: int = 0  # failed calls (store down or slow)
    writes: int = 0  # blocks written
    dropped_writes: int = 0  # writes not sent (queue full, the store down, or closing)


_Write = tuple[BlockHash, bytes]


class RemoteKVStore:
    """One engine's client of the shared store (thread-safe: redis-py's pool, and ``_lock``
    for the counters and the outage state)."""

    def __init__(self, url: str, layout: StoreLayout, seed: bytes, timeout_s: float,
                 codec: BlockCodec) -> None:
        self.url = url
        self.prefix = f"pagoda:kvs:{layout.namespace()}:"
        self.codec = codec
        self._seed = seed.hex()
        # A password in the URL wins; else $KV_STORE_PASSWORD (the chart's Secret), so it never
        # shows in a manifest or in the process's arguments.
        self._client = redis.Redis.from_url(url, password=os.environ.get(PASSWORD_ENV) or None,
                                            socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s,
                                            retry_on_timeout=False)
        self._lock = threading.Lock()  # _stats, _down_until, _failing
        self._stats = StoreStats()
        self._down_until = 0.0
        self._failing = False
        self._join_lock = threading.Lock()  # one seed check at a time
        self._seed_checked = False
        self._closed = False
        self.disabled: str | None = None  # set for good when the seed check fails
        self._writes: queue.Queue[_Write | None] = queue.Queue(_MAX_QUEUED_WRITES)
        self._writer = threading.Thread(target=self._write_loop, name="kv-store-writer",
                                        daemon=True)
        self._writer.start()
        if not self._joined() and self.disabled is None:
            logger.warning("KV store %s does not answer: starting without it; it is used "
                           "once it answers", redact_url(url))

    @property
    def available(self) -> bool:
        return self.disabled is None and time.monotonic() >= self._down_until

    @property
    def stats(self) -> StoreStats:
        """A copy of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + n)

    def key(self, block_hash: BlockHash) -> str:
        return self.prefix + block_hash.hex()

    def encode(self, block_hash: BlockHash, token_ids: Sequence[int], payload: bytes) -> bytes:
        return self.codec.encode(self.key(block_hash).encode(), token_ids, payload)

    def decode(self, block_hash: BlockHash, value: bytes, token_ids: Sequence[int],
               payload_bytes: int) -> bytes | None:
        """The KV bytes of ``value`` if it is this block as an engine with the secret wrote it
        under this key; else None (a miss)."""
        return self.codec.decode(self.key(block_hash).encode(), value, token_ids, payload_bytes)

    def get_many(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """The stored values of ``hashes`` in one round trip; all None when the store is
        unavailable."""
        if not hashes or not self.available:
            return [None] * len(hashes)
        values = self._call(lambda: self._client.mget([self.key(h) for h in hashes]))
        return [None] * len(hashes) if values is None else values

    def put(self, block_hash: BlockHash, value: bytes) -> None:
        """Queues a write (never blocks: dropped when the queue is full, or when closing)."""
        if self._closed or not self.available:
            self.count(dropped_writes=1)
            return
        try:
            self._writes.put_nowait((block_hash, value))
        except queue.Full:
            self.count(dropped_writes=1)

    def put_many(self, items: Sequence[_Write]) -> bool:
        """Writes ``items`` (hash, encoded value) in one pipelined round trip and waits for the
        answer: True once the store acknowledged every one; False when it is unavailable or
        the call failed (then nothing is known to be stored)."""
        if not items or self._closed or not self.available:
            self.count(dropped_writes=len(items))
            return False
        if self._call(lambda: self._send(items)):
            self.count(writes=len(items))
            return True
        self.count(dropped_writes=len(items))
        return False

    @property
    def pending_writes(self) -> int:
        """Writes queued or being sent."""
        return self._writes.unfinished_tasks

    def close(self) -> None:
        """Stops the writer within ``_CLOSE_WAIT_S``: what it has not sent by then is dropped.
        Never blocks on a full queue (a writer stuck on a slow store leaves it full)."""
        self._closed = True  # put() drops from now on
        while True:
            try:
                self._writes.put_nowait(None)
                break
            except queue.Full:  # make room: the queued writes are dropped, not waited for
                self._drop_queued()
        self._writer.join(timeout=_CLOSE_WAIT_S)
        if self._writer.is_alive():
            logger.warning("KV store writer still busy after %.0fs; closing under it",
                           _CLOSE_WAIT_S)
        self._client.close()

    # -- internals ----------------------------------------------------------------------------

    def _drop_queued(self) -> None:
        dropped = 0
        while True:
            try:
                item = self._writes.get_nowait()
            except queue.Empty:
                break
            self._writes.task_done()
            dropped += item is not None
        self.count(dropped_writes=dropped)

    def _joined(self) -> bool:
        """Whether the seed check passed (tried once per call until it did)."""
        if self._seed_checked:
            return True
        with self._join_lock:
            return self._seed_checked or self._guarded(self._join) is True

    def _join(self) -> bool:
        """Checks that the store's engines hash with this engine's seed."""
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

    def _call(self, fn: Callable[[], T]) -> T | None:
        """``fn()``'s result once the seed check passed; None when it or the store failed."""
        if not self._joined():
            return None
        return self._guarded(fn)

    def _guarded(self, fn: Callable[[], T]) -> T | None:
        try:
            result = fn()
        except (redis.RedisError, OSError) as exc:
            with self._lock:
                self._stats.errors += 1
                self._down_until = time.monotonic() + _RETRY_AFTER_S
                was_failing, self._failing = self._failing, True
            if not was_failing:
                logger.warning("KV store %s failed (%s): recomputing until it answers",
                               redact_url(self.url), exc)
            return None
        with self._lock:
            was_failing, self._failing = self._failing, False
        if was_failing:
            logger.info("KV store %s answers again", redact_url(self.url))
        return result

    def _write_loop(self) -> None:
        while True:
            batch, stop = self._next_batch()
            try:
                if batch:
                    self._flush(batch)
            except Exception:  # a bug in one batch must not end the thread: drop it, go on
                logger.exception("KV store writer: dropped a batch of %d blocks", len(batch))
                self.count(dropped_writes=len(batch))
            finally:
                for _ in range(len(batch) + stop):
                    self._writes.task_done()
            if stop:
                return

    def _next_batch(self) -> tuple[list[_Write], bool]:
        """Up to ``_MAX_BATCH`` queued writes (waiting for the first), and whether the stop
        sentinel came after them."""
        item = self._writes.get()
        if item is None:
            return [], True
        batch = [item]
        while len(batch) < _MAX_BATCH:
            try:
                item = self._writes.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    def _flush(self, batch: list[_Write]) -> None:
        if not self.available:
            self.count(dropped_writes=len(batch))
            return

        if self._call(lambda: self._send(batch)):
            self.count(writes=len(batch))
        else:
            self.count(dropped_writes=len(batch))

    def _send(self, batch: Sequence[_Write]) -> bool:
        pipe = self._client.pipeline(transaction=False)
        for h, value in batch:
            pipe.set(self.key(h), value)
        pipe.execute()
        return True


def open_store(url: str, timeout_s: float, secret_file: str | None, layout: StoreLayout,
               seed: bytes) -> RemoteKVStore:
    """A client of the store at ``url`` with the deployment's MAC key (``secret_file``, else
    ``$PAGODA_KV_STORE_SECRET``; ValueError when there is none): the tiers' and P/D's."""
    return RemoteKVStore(url, layout, seed, timeout_s, BlockCodec(load_store_secret(secret_file)))
