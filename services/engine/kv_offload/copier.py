"""The copy thread: moves KV blocks between the pool, the host store and the shared store.

It never decides anything: the engine thread hands it jobs whose pool blocks and host slots are
reserved for it (pool blocks held or owned by a request that waits, host slots pinned), and
learns of each job's end from ``done`` before it lets go of them. So the copy thread and the
step touch disjoint memory, and the step never waits for a copy.

On CUDA the copies run on a side stream, into and out of pinned host memory, and a job is
reported done only after its stream synchronized. A block crosses between the device and the
host store straight from or into its pinned slot (``_copy_rows``: a view of the pinned store,
so ``non_blocking`` is truly asynchronous); an ``index_select`` of the store would first make a
pageable copy, which CUDA copies synchronously through a bounce buffer. On the CPU the same
code runs as plain copies.

``close`` returns only once the thread has ended: the runner's caches and the host store are
freed after it, so a copy must never still be writing into them. Closing tells the thread to
skip the jobs still queued and the scatter of a load whose store call was in flight, so the
wait is at most one store call (its socket timeout) and one block run's copy.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from services.engine.kv_offload.remote_store import RemoteKVStore
from services.protocol.block_hash import BlockHash

logger = logging.getLogger(__name__)

_CLOSE_LOG_EVERY_S = 5.0


@dataclass(slots=True)
class SaveJob:
    pool_ids: list[int]
    hashes: list[BlockHash]
    token_ids: list[tuple[int, ...]]
    host_slots: list[int | None]  # None: not to the host store (there already, or no room)
    upload: list[bool]  # to the shared store too


@dataclass(slots=True)
class LoadJob:
    request_id: str
    host_slots: list[int]  # into the first len(host_slots) of pool_ids
    remote_hashes: list[BlockHash]  # then these, into the rest of pool_ids, while they hit
    remote_tokens: list[tuple[int, ...]]
    pool_ids: list[int]


@dataclass(slots=True)
class LoadDone:
    job: LoadJob
    num_host: int
    num_remote: int  # leading remote blocks loaded (the first miss or bad block ends the run)
    num_corrupt: int = 0


@dataclass(slots=True)
class SaveDone:
    job: SaveJob
    error: str | None = None


@dataclass(slots=True)
class _Stop:
    pass


@dataclass
class KVCopier:
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    host: torch.Tensor | None  # [slots, layers, 2, block_size, kv_heads, head_dim]
    remote: RemoteKVStore | None
    block_shape: tuple[int, ...]  # (layers, 2, block_size, kv_heads, head_dim)
    done: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    def __post_init__(self) -> None:
        first = self.kv_caches[0][0]
        self.device = first.device
        self.dtype = first.dtype
        self.payload_bytes = int(torch.Size(self.block_shape).numel()) * first.element_size()
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-copier", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob | LoadJob) -> None:
        self._jobs.put(job)

    def finished(self, timeout: float = 0.0) -> Iterator[SaveDone | LoadDone]:
        """The jobs done since the last call, in order; with ``timeout``, waits that long for
        the first (the engine thread's only wait on the copy thread)."""
        while True:
            try:
                item = self.done.get(timeout=timeout) if timeout else self.done.get_nowait()
            except queue.Empty:
                return
            timeout = 0.0
            yield item

    def close(self) -> None:
        """Returns once the copy thread has ended (see the module docstring): never while a
        copy could still write into the caches."""
        self._stopping.set()
        self._jobs.put(_Stop())
        while True:
            self._thread.join(timeout=_CLOSE_LOG_EVERY_S)
            if not self._thread.is_alive():
                return
            logger.warning("waiting for a KV copy to end before its memory is freed")

    # -- the thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_num_threads(1)  # the step's threads own the cores; a copy is memory-bound
        while True:
            job = self._jobs.get()
            if isinstance(job, _Stop):
                return
            if self._stopping.is_set():
                continue  # closing: nobody waits for it, and its memory is about to go
            try:
                with torch.inference_mode(), self._on_stream():
                    result = self._save(job) if isinstance(job, SaveJob) else self._load(job)
                    if self.stream is not None:
                        self.stream.synchronize()
            except Exception as exc:  # a copy must never kill the thread: report and go on
                logger.exception("KV copy failed")
                result = (SaveDone(job, repr(exc)) if isinstance(job, SaveJob)
                          else LoadDone(job, 0, 0))
            self.done.put(result)

    def _on_stream(self):  # noqa: ANN202
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def _gather(self, pool_ids: list[int]) -> torch.Tensor:
        return gather(self.kv_caches, pool_ids)

    def _scatter(self, blocks: torch.Tensor, pool_ids: list[int]) -> None:
        ids = torch.tensor(pool_ids, dtype=torch.long, device=self.device)
        blocks = blocks.to(self.device, non_blocking=True)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, ids, blocks[:, layer, 0])
            v.index_copy_(0, ids, blocks[:, layer, 1])

    def _save(self, job: SaveJob) -> SaveDone:
        blocks = self._gather(job.pool_ids)
        to_host = [(j, s) for j, s in enumerate(job.host_slots) if s is not None]
        if to_host and self.host is not None:
            _copy_rows(self.host, [s for _, s in to_host], blocks, [j for j, _ in to_host])
        if self.remote is not None:
            if self.stream is not None:
                self.stream.synchronize()  # the host slots are written before they are read
            for j, wanted in enumerate(job.upload):
                if wanted:
                    payload = self._host_block(blocks, j, job.host_slots[j])
                    self.remote.put(job.hashes[j],
                                    self.remote.encode(job.hashes[j], job.token_ids[j], payload))
        return SaveDone(job)

    def _host_block(self, blocks: torch.Tensor, j: int, slot: int | None) -> bytes:
        """Block ``j`` of a save as bytes: from its host slot when it has one (already on the
        host), else copied off the device."""
        block = self.host[slot] if slot is not None and self.host is not None else blocks[j]
        return block.cpu().contiguous().view(torch.uint8).numpy().tobytes()

    def _load(self, job: LoadJob) -> LoadDone:
        n_host = len(job.host_slots)
        if n_host:
            assert self.host is not None
            staged = torch.empty((n_host, *self.block_shape), dtype=self.dtype,
                                 device=self.device)
            _copy_rows(staged, list(range(n_host)), self.host, job.host_slots)
            self._scatter(staged, job.pool_ids[:n_host])
        if not job.remote_hashes or self.remote is None:
            return LoadDone(job, n_host, 0)
        values = self.remote.get_many(job.remote_hashes)
        payloads: list[bytes] = []
        corrupt = 0
        for h, value, tokens in zip(job.remote_hashes, values, job.remote_tokens, strict=True):
            if value is None:
                break
            payload = self.remote.decode(h, value, tokens, self.payload_bytes)
            if payload is None:  # a bad or foreign block is a miss: recomputed, never used
                corrupt += 1
                break
            payloads.append(payload)
        self.remote.count(hits=len(payloads), misses=len(values) - len(payloads) - corrupt,
                          corrupt=corrupt)
        if self._stopping.is_set():  # the store call outlasted close(): write nothing now
            return LoadDone(job, n_host, 0, corrupt)
        if payloads:
            raw = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
            blocks = raw.view(self.dtype).view(len(payloads), *self.block_shape)
            self._scatter(blocks, job.pool_ids[n_host:n_host + len(payloads)])
        return LoadDone(job, n_host, len(payloads), corrupt)


def gather(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
           pool_ids: list[int]) -> torch.Tensor:
    """The pool blocks, on the pool's device: [n, layers, 2, block_size, kv_heads, head_dim]
    (a block's row is its value's KV bytes in the shared store)."""
    k0 = kv_caches[0][0]
    ids = torch.tensor(pool_ids, dtype=torch.long, device=k0.device)
    out = torch.empty((len(pool_ids), len(kv_caches), 2, *k0.shape[1:]), dtype=k0.dtype,
                      device=k0.device)
    for layer, (k, v) in enumerate(kv_caches):
        out[:, layer, 0] = k.index_select(0, ids)
        out[:, layer, 1] = v.index_select(0, ids)
    return out


def block_payloads(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   pool_ids: list[int]) -> list[bytes]:
    """The pool blocks' KV bytes as the shared store holds them, read on the caller's thread
    (P/D through the store writes them while its engine waits: the caller owns the blocks,
    and their KV is final)."""
    with torch.inference_mode():
        blocks = gather(kv_caches, pool_ids).cpu()
    raw = blocks.view(torch.uint8).numpy()  # one row per block
    return [raw[j].tobytes() for j in range(len(pool_ids))]


def _copy_rows(dst: torch.Tensor, dst_rows: list[int], src: torch.Tensor,
               src_rows: list[int]) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]``, one copy per run of consecutive rows on both
    sides: slices of the tensors themselves, so a pinned side stays pinned and the copy is
    ``non_blocking`` (asynchronous between pinned host memory and a GPU)."""
    assert len(dst_rows) == len(src_rows)
    i = 0
    while i < len(dst_rows):
        n = 1
        while (i + n < len(dst_rows) and dst_rows[i + n] == dst_rows[i] + n
               and src_rows[i + n] == src_rows[i] + n):
            n += 1
        d, s = dst_rows[i], src_rows[i]
        dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
        i += n
