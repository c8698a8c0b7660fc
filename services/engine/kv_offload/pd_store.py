"""``PagodaStorePDConnector``: disaggregated prefill/decode through the shared KV store, the
second P/D transport (``pd.PagodaPDConnector`` is the first: engine to engine over TCP).

For clusters where engines cannot dial each other, or to decouple the two legs in time: the
prefill engine's blocks reach the decode engine through the Redis/Valkey store the KV tiers use
(``kv_offload/remote_store.py``), under the tiers' keys and values (chain hash in the key, a
MAC over key, tokens and bytes in the value), so one store serves both.

Prefill engine (``kv_producer`` or ``kv_both``): a request sent with ``kv_transfer_params``
``{"do_remote_decode": true}`` writes its prompt's full blocks (not the one holding the last
prompt token: the decode engine computes that token for its logits) to the store as its chunks
are computed: after each step (``save_kv``) the engine thread reads the new blocks' bytes (the
request owns them and their KV is final) and a writer thread sends them in one pipelined round
trip per run. When it finishes with its prompt computed, the last run goes out and the engine
thread waits until the store acknowledged every run (at most ``write_wait_s``): the leg answers
only once its blocks are there. Its params then say::

    {"do_remote_prefill": true, "do_remote_decode": false, "kv_transport": "store",
     "remote_engine_id", "remote_request_id", "remote_num_blocks", "kv_layout"}

``remote_num_blocks`` is the leading run the store acknowledged. Nothing is held on the prefill
engine: its blocks are freed as for any request. A write that fails (the store down or slower
than ``kv_store_timeout_s``) from the first run on answers ``"do_remote_prefill": false``: the
decode engine computes the prompt. An abort before the prompt was computed writes no more.

Decode engine (``kv_consumer`` or ``kv_both``): a request with such params (and the same
prompt) loads the blocks past its own pool hit and below ``remote_num_blocks`` on the tiers'
copy thread (``KVCopier``: one MGET), waiting in the scheduler's "waiting for KV" state; the
leading run that is in the store and verifies is kept, the rest is recomputed. A block evicted,
deleted or damaged since (a miss, whatever the params say), the store down, params of another
layout or malformed: a recompute from that block on, never an error or a wrong token.

What a client can do with these params (they may come from a public client through the
gateway): they name no key. The decode engine reads only the keys of its own chain hashes of
the prompt it was sent, under the tenant's salt (the gateway scopes it to the API key's tenant)
and the adapter, at most the prompt's blocks less the last token's: what the KV tiers read for
any request anyway. So params cannot reach another tenant's, adapter's or prompt's blocks, and
a count that lies only costs one MGET of misses.

``kv_connector_extra_config``: ``kv_store_url`` (default: the engine's ``--kv-store-url``; one
of them is required), ``kv_store_timeout_s`` (default: the engine's, 0.5), ``engine_id``. The
MAC key is the tiers' (``--kv-store-secret-file`` or ``$PAGODA_KV_STORE_SECRET``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from services.engine.kv_connector import pd_wire
from services.engine.kv_connector.base import ConnectorContext, ConnectorRequest, FinishedTransfers
from services.engine.kv_connector.config import KVTransferConfig, checked_extra
from services.engine.kv_connector.pd import TRANSPORT
from services.engine.kv_connector.transfer_stats import TransferStats
from services.engine.kv_offload.copier import KVCopier, LoadDone, LoadJob, block_payloads
from services.engine.kv_offload.remote_store import RemoteKVStore, StoreLayout, open_store
from services.protocol.block_hash import BlockHash
from services.protocol.kv_events import KVEvent, KVEventKind, Medium

logger = logging.getLogger(__name__)

NAME = "PagodaStorePDConnector"
NO_TRANSFER = {"do_remote_prefill": False, "do_remote_decode": False}
STORE = "store"  # kv_transfer_params["kv_transport"]
_EXTRA = {"kv_store_url": str, "kv_store_timeout_s": (int, float), "engine_id": str}


@dataclass(frozen=True, slots=True)
class StoreGrant:
    """What a request's params say the store holds: its prompt's first ``num_blocks``."""

    num_blocks: int

    @classmethod
    def parse(cls, params: Any, layout: str) -> StoreGrant | str | None:
        """None when the params ask for no store transfer; a failure reason when they do but
        this engine must not load it (malformed, another layout: a recompute)."""
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True or \
                params.get(TRANSPORT) != STORE:
            return None
        n = params.get("remote_num_blocks")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            return "protocol"
        if params.get("kv_layout") != layout:
            return "layout"
        return cls(n)


@dataclass(frozen=True, slots=True)
class _Loading:
    asked: int  # blocks asked of the store
    started: float  # monotonic, when planned


@dataclass(slots=True)
class _Production:
    """A prefill leg's writes so far: its blocks before ``next_block`` are handed to the
    writer, one write (a future of (blocks stored, seconds)) per run."""

    request: ConnectorRequest
    next_block: int = 0
    writes: list[Future[tuple[int, float]]] = field(default_factory=list)


class PagodaStorePDConnector:
    def __init__(self, spec: KVTransferConfig, ctx: ConnectorContext) -> None:
        extra = checked_extra(spec.kv_connector_extra_config, _EXTRA, NAME)
        config = ctx.engine_config
        where = "kv_transfer_config.kv_connector_extra_config"
        url = extra.get("kv_store_url", config.kv_store_url)
        if url is None:
            raise ValueError(f"{where}.kv_store_url: {NAME} needs the KV store's URL "
                             "(there, or --kv-store-url)")
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"{where}.kv_store_url must be a redis:// or rediss:// URL")
        if not config.enable_prefix_caching:  # the blocks' keys are the prefix cache's hashes
            raise ValueError(f"{NAME} needs enable_prefix_caching")
        if config.tensor_parallel_size != 1:
            raise ValueError(f"{NAME} is not supported with tensor_parallel_size > 1 yet")
        assert ctx.model_path is not None
        self.role = spec.kv_role
        self.block_size = bs = config.block_size
        caches = ctx.kv_caches
        store_layout = StoreLayout.of_pool(ctx.model_name, ctx.model_path, caches, bs,
                                           config.tensor_parallel_size,
                                           str(config.hash_algorithm))
        # What the router pairs engines by (the heartbeat's kv_layout): the pool's shape, the
        # transport, and the store's namespace (which has the weights' digest: a rollout never
        # pairs an old prefill engine with a new decode engine).
        self.layout = "store-" + hashlib.sha256(json.dumps(
            [pd_wire.layout_digest(ctx.model_name, bs, caches), STORE,
             store_layout.namespace()]).encode()).hexdigest()[:32]
        self.engine_id = extra.get("engine_id") or secrets.token_hex(8)
        timeout_s = float(extra.get("kv_store_timeout_s", config.kv_store_timeout_s))
        self.remote: RemoteKVStore = open_store(url, timeout_s, config.kv_store_secret_file,
                                                store_layout, ctx.seed)
        self.caches = caches
        k0 = caches[0][0]
        block_shape = (len(caches), 2, bs, k0.shape[2], k0.shape[3])
        self.block_bytes = pd_wire.block_bytes(caches)
        # Loads run on the tiers' copy thread.
        self.copier = KVCopier(caches, None, self.remote, block_shape) \
            if self.role.loads else None
        self.stats = TransferStats()
        self.block_manager = ctx.block_manager
        # A prefill leg's full blocks are written as its chunks are computed, on threads of
        # their own; its end waits only for what is still in flight.
        self._producing: dict[str, _Production] = {}
        self._writer = ThreadPoolExecutor(2, "kv-pd-store-write") if self.role.saves else None
        self.write_wait_s = max(2.0, 10 * timeout_s)  # a leg's end waits this long at most
        self._asked: tuple[str, int, int] | None = None  # id, first block, count
        self._tried: set[str] = set()  # loaded once (a preempted request recomputes)
        self._planned: list[LoadJob] = []
        self._loading: dict[str, _Loading] = {}
        # What the legs put in the store, announced as the tiers announce their writes (medium
        # SHARED): the routers then count those blocks reachable from every engine of the
        # store, and a later request with the prompt's prefix can load it from there.
        self.record_events = ctx.record_events
        self._events: list[KVEvent] = []

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        self._asked = None
        if not self.role.loads or request.request_id in self._tried:
            return 0, False
        grant = StoreGrant.parse(request.kv_transfer_params, self.layout)
        if grant is None:
            return 0, False
        if isinstance(grant, str) or not self.remote.available:
            reason = grant if isinstance(grant, str) else "connection"
            logger.warning("request_id=%s: its prompt's KV cannot be loaded from the store "
                           "(%s): recomputed", request.request_id, reason)
            self.stats.failed(reason)
            self._tried.add(request.request_id)  # said once
            return 0, False
        first = num_computed_tokens // self.block_size
        # Never the last prompt token's block; never past the prompt's own chain.
        stop = min(grant.num_blocks, (request.num_tokens - 1) // self.block_size,
                   len(request.block_hashes))
        if stop <= first:
            return 0, False
        self._asked = (request.request_id, first, stop - first)
        return (stop - first) * self.block_size, True

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        if self._writer is not None and rid not in self._producing and \
                _asks_remote_decode(request.kv_transfer_params):  # admitted (or again)
            self._producing[rid] = _Production(request)
        if not num_external_tokens:
            return
        assert self._asked is not None and self._asked[0] == request.request_id
        rid, first, count = self._asked
        assert count * self.block_size == num_external_tokens
        self._asked = None
        self._tried.add(rid)
        bs, stop = self.block_size, first + count
        self._planned.append(LoadJob(
            rid, [], request.block_hashes[first:stop],
            [tuple(request.token_ids[i * bs:(i + 1) * bs]) for i in range(first, stop)],
            block_ids[first:stop]))
        self._loading[rid] = _Loading(count, time.monotonic())

    def build_connector_meta(self) -> list[LoadJob]:
        planned, self._planned = self._planned, []
        return planned

    def request_finished(self, request: ConnectorRequest,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A prefill leg answers once the store acknowledged its blocks (see the module
        docstring): nothing is held, so never a delayed free."""
        rid = request.request_id
        self._tried.discard(rid)
        production = self._producing.pop(rid, None)
        if self._writer is None or not _asks_remote_decode(request.kv_transfer_params):
            return False, None
        # Its prompt was computed only if it sampled: an abort before that writes no more.
        if production is None or len(request.token_ids) <= len(request.prompt_token_ids):
            _cancel(production)
            return False, dict(NO_TRANSFER)
        self._write_ready(production, block_ids)  # the last chunk's
        n = self._acknowledged(production)
        if not n:
            return False, dict(NO_TRANSFER)
        return False, {"do_remote_prefill": True, "do_remote_decode": False, TRANSPORT: STORE,
                       "remote_engine_id": self.engine_id, "remote_request_id": rid,
                       "remote_num_blocks": n, "kv_layout": self.layout}

    def take_announced(self) -> dict[str, Any]:
        return {}  # a store leg answers once its blocks are stored (``kv_stream`` is ignored)

    def _write_ready(self, production: _Production, block_ids: list[int]) -> None:
        """Hands the writer the leg's blocks computed since the last call (engine thread:
        their bytes are read now, while the request owns them and their KV is final; a block
        read later could already be another request's)."""
        req, bs = production.request, self.block_size
        prompt = req.prompt_token_ids
        stop = min(self._computed_blocks(req), len(block_ids))
        first = production.next_block
        if stop <= first:
            return
        production.next_block = stop
        payloads = block_payloads(self.caches, block_ids[first:stop])
        hashes = req.block_hashes[first:stop]
        tokens = [prompt[i * bs:(i + 1) * bs] for i in range(first, stop)]
        assert self._writer is not None
        production.writes.append(self._writer.submit(self._put, hashes, tokens, payloads))

    def _computed_blocks(self, req: ConnectorRequest) -> int:
        """The prompt's full blocks computed so far, never the last prompt token's (0 once
        preempted: it holds no blocks then)."""
        computed = min(req.num_computed_tokens, len(req.prompt_token_ids) - 1)
        return min(computed // self.block_size, len(req.block_hashes))

    def _put(self, hashes: list[BlockHash], tokens: list[list[int]],
             payloads: list[bytes]) -> tuple[int, float]:
        """One run to the store (a writer thread): (blocks acknowledged, seconds)."""
        started, remote = time.monotonic(), self.remote
        items = [(h, remote.encode(h, t, p)) for h, t, p in zip(hashes, tokens, payloads,
                                                                  strict=True)]
        stored = len(items) if remote.put_many(items) else 0
        return stored, time.monotonic() - started

    def _acknowledged(self, production: _Production) -> int:
        """Waits for the leg's writes: the leading blocks the store acknowledged."""
        rid = production.request.request_id
        deadline = time.monotonic() + self.write_wait_s
        stored, seconds, reason = 0, 0.0, None
        for write in production.writes:
            try:
                n, s = write.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                reason = "timeout"
                break
            if not n:
                reason = "connection"
                break
            stored, seconds = stored + n, seconds + s
        if reason is not None:
            _cancel(production)  # what has not started: its bytes are not kept queued
            logger.warning("request_id=%s: %d of its prompt's blocks written to the store "
                           "(%s): the decode engine computes the rest", rid, stored, reason)
            self.stats.failed(reason)
        if stored:
            self.stats.done("sent", stored * self.block_bytes, seconds)
            if self.record_events:
                hashes = tuple(production.request.block_hashes[:stored])
                self._events.append(KVEvent(KVEventKind.STORED, hashes, self.block_size,
                                            medium=Medium.SHARED))
        logger.debug("request_id=%s: %d blocks written to the store in %.3f s", rid, stored,
                     seconds)
        return stored

    # -- worker side -----------------------------------------------------------------------

    def start_load_kv(self, metadata: list[LoadJob]) -> None:
        for job in metadata:
            assert self.copier is not None  # only a loading role plans loads
            self.copier.submit(job)

    def save_kv(self) -> None:
        # Every cached block holds final KV now: the prefill legs' new full blocks go out.
        for rid, production in self._producing.items():
            if self._computed_blocks(production.request) > production.next_block:
                self._write_ready(production, self.block_manager.block_ids(rid))

    def get_finished(self, timeout: float = 0.0) -> FinishedTransfers:
        out = FinishedTransfers()
        if self.copier is None:
            return out
        for item in self.copier.finished(timeout):
            assert isinstance(item, LoadDone)  # this copier is given loads only
            out.recving[item.job.request_id] = self._loaded(item)
        return out

    def _loaded(self, item: LoadDone) -> int:
        rid = item.job.request_id
        loading = self._loading.pop(rid)
        if item.num_remote:
            self.stats.done("received", item.num_remote * self.block_bytes,
                            time.monotonic() - loading.started)
        if item.num_remote < loading.asked:
            reason = "checksum" if item.num_corrupt else (
                "missing" if self.remote.available else "connection")
            logger.warning("request_id=%s: %d of its %d blocks loaded from the store (%s): "
                           "the rest recomputed", rid, item.num_remote, loading.asked, reason)
            self.stats.failed(reason)
        return item.num_remote * self.block_size

    # -- observability and lifetime ----------------------------------------------------------

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def snapshot_events(self) -> list[KVEvent]:
        # The store's contents are not listed (it is shared, and entries expire on its LRU):
        # a snapshot has only the pool's blocks; announced writes stay until they expire.
        return []

    def close(self) -> None:
        # First the threads that call the store's client: its loads, the legs' writes.
        if self.copier is not None:
            self.copier.close()
        if self._writer is not None:
            self._writer.shutdown(wait=True, cancel_futures=True)
        self.remote.close()


def _asks_remote_decode(params: Any) -> bool:
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def _cancel(production: _Production | None) -> None:
    for write in production.writes if production is not None else ():
        write.cancel()
