"""The engine thread's side of the KV tiers: what to save, where a prefix continues, and the
bookkeeping of the copies in flight (see the package docstring for the lifecycle).

``KVTiers`` is a KV connector (``services.engine.kv_connector.base``, registered as
``PagodaTiersConnector``): the scheduler asks it where a prefix continues and hands it a
request's blocks, the engine starts its loads and saves through the connector's worker side.
Only the engine thread calls it; the copy thread reports through ``copier.done``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from services.engine.kv_connector.base import ConnectorContext, FinishedTransfers
from services.engine.kv_connector.base import ConnectorRequest as Request
from services.engine.kv_connector.config import KVTransferConfig
from services.engine.kv_offload.copier import KVCopier, LoadDone, LoadJob, SaveDone, SaveJob
from services.engine.kv_offload.host_store import HostBlockStore
from services.engine.kv_offload.remote_store import (
    RemoteKVStore,
    StoreLayout,
    StoreStats,
    open_store,
)
from services.protocol.block_hash import BlockHash
from services.protocol.kv_events import KVEvent, KVEventKind, Medium

logger = logging.getLogger(__name__)

_GIB = 1024**3
_MAX_SKIP_UPLOAD = 65536


class BlockManager(Protocol):
    """What the tiers use of the engine's ``BlockManager``."""

    block_size: int
    track_cached: bool

    def take_new_cached(self) -> list[tuple[Any, BlockHash, tuple[int, ...]]]: ...
    def hold(self, block_ids: list[int]) -> None: ...
    def release(self, block_ids: list[int]) -> None: ...


@dataclass(slots=True)
class LoadPlan:
    first: int  # the request's first block to load (its pool hit ends there)
    host_slots: list[int]  # the host store's hits, in order
    num_remote: int  # blocks after those to ask the shared store for

    @property
    def num_blocks(self) -> int:
        return len(self.host_slots) + self.num_remote


@dataclass(slots=True)
class KVTierStats:
    """Counters behind vLLM's external-prefix-cache and prompt-token-source metrics."""

    external_queries: int = 0  # prompt tokens of the lookups that asked a lower tier
    external_hits: int = 0  # tokens loaded from a lower tier
    host_hit_tokens: int = 0
    shared_hit_tokens: int = 0
    # vllm:prompt_tokens_by_source, once per request (its first admission)
    local_compute: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0
    host_blocks: int = 0  # blocks ready in the host store
    host_capacity: int = 0
    host_evictions: int = 0
    store: StoreStats | None = None  # the shared store's client (None: no store)
    store_available: bool = False


@dataclass(slots=True)
class _Load:
    request: Request
    plan: LoadPlan
    pool_ids: list[int] = field(default_factory=list)
    aborted: bool = False  # the request went away while its blocks were written


class KVTiers:
    def __init__(self, spec: KVTransferConfig, ctx: ConnectorContext) -> None:
        # The tier flags (or this connector's extra config, merged into them by EngineConfig),
        # which also refuses what the tiers cannot serve (tensor parallelism, a second model's KV).
        config, block_manager = ctx.engine_config, ctx.block_manager
        model_name, seed, record_events = ctx.model_name, ctx.seed, ctx.record_events
        assert config.tensor_parallel_size == 1
        self.role = spec.kv_role
        model_path = ctx.model_path  # the shared store's namespace has its weights' digest
        self.bm = block_manager
        self.block_size = bs = block_manager.block_size
        caches = ctx.kv_caches
        k0 = caches[0][0]
        self.block_shape = (len(caches), 2, bs, k0.shape[2], k0.shape[3])
        block_bytes = torch.Size(self.block_shape).numel() * k0.element_size()
        self.host: HostBlockStore | None = None
        if config.kv_offloading_size is not None:
            self.host = HostBlockStore(
                _host_slots(config.kv_offloading_size, block_bytes), self.block_shape,
                k0.dtype, bs, pin_memory=k0.device.type == "cuda", record_events=record_events)
        self.remote: RemoteKVStore | None = None
        if config.kv_store_url is not None:
            assert model_path is not None
            layout = StoreLayout.of_pool(model_name, model_path, caches, bs,
                                         config.tensor_parallel_size, str(config.hash_algorithm))
            self.remote = open_store(config.kv_store_url, config.kv_store_timeout_s,
                                     config.kv_store_secret_file, layout, seed)
        self.copier = KVCopier(caches, None if self.host is None else self.host.data,
                               self.remote, self.block_shape)
        self.stats = KVTierStats(host_capacity=0 if self.host is None else self.host.num_slots)
        self._loads: dict[str, _Load] = {}
        self._to_submit: list[LoadJob] = []
        # The last request asked for (id, its pool tokens, the plan): update_state_after_alloc
        # follows for the same request when its blocks are allocated.
        self._asked: tuple[str, int, LoadPlan | None] | None = None
        self._saves_in_flight = 0
        self._skip_upload: set[BlockHash] = set()  # loaded from a tier: no need to write back
        self.record_events = record_events
        self._events: list[KVEvent] = []  # the shared store's (medium SHARED)
        block_manager.track_cached = self.role.saves  # else nobody drains the list
        logger.info("KV tiers: host=%s blocks (%.2f GiB), shared store=%s",
                    0 if self.host is None else self.host.num_slots,
                    0.0 if self.host is None else self.host.num_slots * block_bytes / _GIB,
                    "off" if self.remote is None else "on")

    # -- the connector's scheduler side --------------------------------------------------------

    def get_num_new_matched_tokens(self, req: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens the host store and the shared store hold after the pool's hit (always
        loaded asynchronously, by the copy thread)."""
        plan = self.plan(req, num_computed_tokens // self.block_size) if self.role.loads else None
        self._asked = (req.request_id, num_computed_tokens, plan)
        return (0, False) if plan is None else (plan.num_blocks * self.block_size, True)

    def update_state_after_alloc(self, req: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        asked = self._asked is not None and self._asked[0] == req.request_id
        pool_tokens, plan = self._asked[1:] if asked else (0, None)
        self._asked = None
        if not num_external_tokens:  # admitted as usual: counted now
            self.record_admission(req, pool_tokens, 0, 0, asked)
            return
        assert plan is not None and num_external_tokens == plan.num_blocks * self.block_size
        self.start_load(req, plan, block_ids[plan.first:plan.first + plan.num_blocks])

    def build_connector_meta(self) -> list[LoadJob]:
        """The loads planned since the last call, for ``start_load_kv``."""
        jobs, self._to_submit = self._to_submit, []
        return jobs

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, None]:
        """The tiers hold no finished request's blocks (a save holds its blocks itself)."""
        load = self._loads.get(req.request_id)
        if load is not None:  # aborted while loading: reported when the copy is done
            load.aborted = True
        return False, None

    def take_announced(self) -> dict[str, dict[str, Any]]:
        return {}  # nothing to tell a client before its request ends

    # -- the connector's worker side --------------------------------------------------------

    def start_load_kv(self, jobs: list[LoadJob]) -> None:
        """Hands the planned loads to the copy thread (the engine calls it when no step in
        flight could still write to the blocks they fill)."""
        for job in jobs:
            self.copier.submit(job)

    def save_kv(self) -> None:
        if self.role.saves:
            self.save_new()

    # -- admission -----------------------------------------------------------------------------

    def plan(self, req: Request, num_pool_blocks: int) -> LoadPlan | None:
        """Where the request's prefix continues after its pool hit, or None (nothing to load).
        The last prompt token is always computed, as in the pool."""
        bs = self.block_size
        stop = min(len(req.block_hashes), max(req.num_tokens - 1, 0) // bs)
        if num_pool_blocks >= stop:
            return None
        slots = [] if self.host is None else self.host.hits(
            req.block_hashes, req.token_ids, num_pool_blocks, stop)
        remote = 0
        if self.remote is not None and self.remote.available:
            remote = stop - num_pool_blocks - len(slots)
        if not slots and not remote:
            return None
        return LoadPlan(num_pool_blocks, slots, remote)

    def start_load(self, req: Request, plan: LoadPlan, pool_ids: list[int]) -> None:
        """The request holds ``pool_ids`` for the plan's blocks: copy into them."""
        bs, first = self.block_size, plan.first
        n_host = len(plan.host_slots)
        assert len(pool_ids) == plan.num_blocks, (len(pool_ids), plan.num_blocks)
        for h in req.block_hashes[first:first + n_host]:
            self.host.pin(h)
        rest = range(first + n_host, first + plan.num_blocks)
        job = LoadJob(req.request_id, plan.host_slots,
                      [req.block_hashes[i] for i in rest],
                      [tuple(req.token_ids[i * bs:(i + 1) * bs]) for i in rest], pool_ids)
        self._loads[req.request_id] = _Load(req, plan, pool_ids)
        self._to_submit.append(job)

    def record_admission(self, req: Request, pool_tokens: int, tier_tokens: int,
                         host_tokens: int, asked: bool) -> None:
        s = self.stats
        if asked:
            s.external_queries += req.num_tokens
            s.external_hits += tier_tokens
            s.host_hit_tokens += host_tokens
            s.shared_hit_tokens += tier_tokens - host_tokens
        if req.num_cached_tokens < 0:  # its first admission
            prompt = len(req.prompt_token_ids)
            s.local_cache_hit += min(pool_tokens, prompt)
            s.external_kv_transfer += min(tier_tokens, prompt - min(pool_tokens, prompt))
            s.local_compute += max(prompt - pool_tokens - tier_tokens, 0)

    # -- completions ---------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return bool(self._loads or self._saves_in_flight)

    def get_finished(self, timeout: float = 0.0) -> FinishedTransfers:
        """Applies the copies done since the last call; reports each load done with the
        tokens it loaded (an aborted request's too: its blocks may be freed now). With
        ``timeout``, waits that long for the first."""
        done = FinishedTransfers()
        for item in self.copier.finished(timeout):
            if isinstance(item, SaveDone):
                self._saved(item)
            else:
                done.recving[item.job.request_id] = self._loaded(item)
        return done

    poll = get_finished  # the name the tiers' own tests use

    def _loaded(self, item: LoadDone) -> int:
        load = self._loads.pop(item.job.request_id)
        req, first = load.request, load.plan.first
        for h in req.block_hashes[first:first + len(item.job.host_slots)]:
            self.host.unpin(h)
        loaded = req.block_hashes[first:first + item.num_host + item.num_remote]
        if len(self._skip_upload) > _MAX_SKIP_UPLOAD:
            self._skip_upload.clear()
        self._skip_upload.update(loaded)
        bs = self.block_size
        tokens = (item.num_host + item.num_remote) * bs
        if not load.aborted:  # before the scheduler admits it (its first admission or not)
            self.record_admission(req, first * bs, tokens, item.num_host * bs, True)
        return tokens

    def _saved(self, item: SaveDone) -> None:
        job = item.job
        self._saves_in_flight -= 1
        self.bm.release(job.pool_ids)
        uploaded = tuple(h for h, up in zip(job.hashes, job.upload, strict=True) if up)
        if self.record_events and uploaded and item.error is None:
            # Queued for the store: announced now (a write the store drops, or its LRU
            # evicts, only makes the routers' guess stale until the entry expires).
            self._events.append(KVEvent(KVEventKind.STORED, uploaded, self.block_size,
                                        medium=Medium.SHARED))
        if self.host is not None:
            written = [h for h, s in zip(job.hashes, job.host_slots, strict=True)
                       if s is not None]
            if item.error is None:
                self.host.written(written, None)
            else:  # nothing usable was written: the slots go back, the blocks may come again
                self.host.discard(written)

    # -- saving ---------------------------------------------------------------------------------

    def save_new(self) -> None:
        """Writes through the blocks the pool cached since the last call (called once their
        step was applied: their KV is final). Each is held until the copy is done."""
        entries = self.bm.take_new_cached()
        if not entries:
            return
        job = SaveJob([], [], [], [], [])
        for block, h, tokens in entries:
            if block.block_hash != h:
                continue  # evicted since (cannot happen within one apply; cheap to check)
            slot = None if self.host is None else self.host.reserve(h, tokens)
            upload = self.remote is not None and h not in self._skip_upload
            self._skip_upload.discard(h)
            if slot is None and not upload:
                continue
            job.pool_ids.append(block.block_id)
            job.hashes.append(h)
            job.token_ids.append(tokens)
            job.host_slots.append(slot)
            job.upload.append(upload)
        if job.pool_ids:
            self.bm.hold(job.pool_ids)
            self._saves_in_flight += 1
            self.copier.submit(job)

    # -- observability ------------------------------------------------------------------------

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        if self.host is not None:
            events.extend(self.host.take_events())
        return events

    def snapshot_events(self) -> list[KVEvent]:
        return [] if self.host is None else self.host.snapshot_events()

    def snapshot_stats(self) -> KVTierStats:
        s = self.stats
        if self.host is not None:
            s.host_blocks = self.host.num_ready
            s.host_evictions = self.host.num_evictions
        if self.remote is not None:
            s.store = self.remote.stats  # a copy
            s.store_available = self.remote.available
        return KVTierStats(**{k: getattr(s, k) for k in s.__slots__})

    def close(self) -> None:
        self.copier.close()
        if self.remote is not None:
            self.remote.close()


def _host_slots(size_gib: float, block_bytes: int) -> int:
    wanted = int(size_gib * _GIB)
    available = _available_memory()
    if available is not None and wanted > available:
        raise ValueError(f"kv_offloading_size={size_gib} GiB exceeds this host's available "
                         f"memory ({available / _GIB:.1f} GiB)")
    slots = wanted // block_bytes
    if slots < 1:
        raise ValueError(f"kv_offloading_size={size_gib} GiB holds no KV block of "
                         f"{block_bytes} bytes")
    return slots


def _available_memory() -> int | None:
    """The host's available memory, or less where a cgroup (a pod's limit) caps this process."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:")]
    except OSError:
        pass
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()  # noqa: SIM115
        used = int(open("/sys/fs/cgroup/memory.current").read())  # noqa: SIM115
        if limit != "max":
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None
