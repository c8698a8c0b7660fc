"""``PagodaPDConnector``: disaggregated prefill/decode (vLLM's request flow).

Prefill engine (``kv_producer`` or ``kv_both``): a request sent with ``kv_transfer_params``
``{"do_remote_decode": true}`` (and max_tokens 1) holds its prompt's full blocks when it
finishes, under a transfer id, and returns the params that say where to fetch them::

    {"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id", "remote_host",
     "remote_port", "remote_transfer_id", "remote_request_id", "remote_num_blocks",
     "kv_layout"}

The params carry ``remote_expires`` (unix seconds) and ``remote_signature``: a MAC under the
internal credential of the engine id, address, transfer id, block count, layout and expiry.

Decode engine (``kv_consumer`` or ``kv_both``): a request with those params (and the same
prompt) loads the prompt's full blocks past its own pool hit, never the last token, pulled on a
loader thread (``pd_server`` is the other end, ``pd_wire`` the protocol), then runs the tail.
It connects only to an address in a grant it can verify, unexpired and of its own layout: the
params may come from a public client through the gateway, and a client must not be able to
point an engine at a host of its choosing (the handshake keeps the credential from such a
host in any case). A pull that fails (engine gone, slow, checksum, unknown id, a grant that
does not verify) costs a recompute, never an error; blocks that arrived before a failure are
kept. A pull slower than recomputing its tokens (``ComputeRate``; at least ``min_pull_s``)
is abandoned for a recompute.

Streamed (``{"do_remote_decode": true, "kv_stream": true}``, ``pd_stream``): the prefill
engine issues the transfer id when it admits the request and announces the params at once
(with ``"remote_streaming": true``); the decode engine's pull then receives each block as the
prefill's chunks complete it, waiting at most ``stream_wait_s`` for the next one and never past
the grant's expiry (the "slower than recomputing" budget does not apply: the prefill is
computing it meanwhile). A prefill preempted or aborted mid-stream ends the stream: the blocks
that arrived are kept, the rest recomputed.

``kv_connector_extra_config``: ``host`` (bind, default 127.0.0.1), ``advertise_host`` (what
the params name, default ``host``), ``port`` (0: any), ``engine_id``, ``read_timeout_s`` (5),
``min_pull_s`` (0.25), ``max_connections`` (16), ``max_held_transfers`` (1024),
``pull_threads`` (4), ``stream_wait_s`` (30). The credential is the internal one
(``$PAGODA_INTERNAL_TOKENS``); the connector does not start without it.
"""

from __future__ import annotations

import logging
import queue
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from services.common import internal_mac
from services.common.internal_auth import InternalCredential, resolve
from services.engine.kv_connector import pd_wire
from services.engine.kv_connector.base import ConnectorContext, ConnectorRequest, FinishedTransfers
from services.engine.kv_connector.compute_rate import ComputeRate
from services.engine.kv_connector.config import KVTransferConfig, checked_extra
from services.engine.kv_connector.pd_server import MAX_PEER_BLOCKS, HeldTransfers, TransferServer
from services.engine.kv_connector.pd_stream import StreamedPrefills, asks_stream
from services.engine.kv_connector.pd_wire import WireError
from services.engine.kv_connector.peer_blocks import PeerBlocks
from services.engine.kv_connector.transfer_stats import TransferStats

logger = logging.getLogger(__name__)

_EXTRA = {"host": str, "advertise_host": str, "port": int, "engine_id": str,
          "read_timeout_s": (int, float), "min_pull_s": (int, float), "max_connections": int,
          "max_held_transfers": int, "pull_threads": int, "stream_wait_s": (int, float)}
GRANT = "pagoda-kv/2 transfer grant"
# ``kv_transfer_params["kv_transport"]``: which connector's params they are (absent: this one's).
TRANSPORT, TCP = "kv_transport", "tcp"


@dataclass(frozen=True, slots=True)
class Pull:
    """One planned load: blocks ``first .. first+len(block_ids)`` of a remote transfer into
    this pool's ``block_ids``."""

    request_id: str
    host: str
    port: int
    transfer_id: str
    first: int
    block_ids: list[int]
    last_hash: str  # hex chain hash of the last block: the server checks it is its own
    hashes: list[str] | None = None  # a prefix pulled from a peer: every block's chain hash
    expires: float | None = None  # a streamed prefill's: its grant's expiry (monotonic)


@dataclass(frozen=True, slots=True)
class Remote:
    host: str
    port: int
    transfer_id: str
    num_blocks: int
    # A streamed prefill's grant (``pd_stream``): its blocks arrive as its chunks are computed,
    # so the pull waits for each, up to the grant's expiry (unix s). Not in the signature: it
    # only sets how long this engine waits on an engine the grant already names.
    streaming_until: float | None = None

    @classmethod
    def parse(cls, params: Any, layout: str,
              credential: InternalCredential) -> Remote | str | None:
        """The remote prefill in a request's params; None when they ask for none; a failure
        reason when they name one this engine must not pull (another KV layout, a grant that
        does not verify or has expired: a recompute)."""
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            return None
        if params.get(TRANSPORT, TCP) != TCP:  # another transport's (``pd_store``): not ours
            return None
        engine_id, host, port = (params.get("remote_engine_id"), params.get("remote_host"),
                                 params.get("remote_port"))
        tid, n = params.get("remote_transfer_id"), params.get("remote_num_blocks")
        expires = params.get("remote_expires")
        if not (isinstance(host, str) and isinstance(tid, str) and _int(port) and _int(n)
                and _int(expires) and port <= 65535):
            return "protocol"
        if params.get("kv_layout") != layout:
            return "layout"
        if not internal_mac.signed(credential, GRANT, params.get("remote_signature"), engine_id,
                                   host, port, tid, n, layout, expires):
            return "unsigned"
        if expires < time.time():
            return "expired"
        return cls(host, port, tid, n,
                   float(expires) if params.get("remote_streaming") is True else None)

    @classmethod
    def peer(cls, params: Any) -> Remote | None:
        """A peer the gateway named to pull the prompt's prefix from (``pull_prefix_from``:
        the router's view of live engines of this model and layout), or None."""
        peer = params.get("pull_prefix_from") if isinstance(params, dict) else None
        if not isinstance(peer, dict):
            return None
        address, blocks = peer.get("address"), peer.get("blocks")
        where = _host_port(address)
        if where is None or not _int(blocks) or not blocks > 0:
            return None
        return cls(*where, "", blocks)


class PagodaPDConnector:
    def __init__(self, spec: KVTransferConfig, ctx: ConnectorContext) -> None:
        extra = _checked_extra(spec.kv_connector_extra_config)
        self.role, self.caches = spec.kv_role, ctx.kv_caches
        self.block_size = ctx.engine_config.block_size
        self.layout = pd_wire.layout_digest(ctx.model_name, self.block_size, ctx.kv_caches)
        self.credential: InternalCredential = resolve(None, False, "kv transfer")
        self.read_timeout_s = float(extra.get("read_timeout_s", 5.0))
        # A streamed pull's wait for the prefill's next block (either end).
        self.stream_wait_s = float(extra.get("stream_wait_s", 30.0))
        self.min_pull_s = float(extra.get("min_pull_s", 0.25))
        self.stats = TransferStats()
        self.rate: ComputeRate = ctx.compute_rate or ComputeRate()
        self.engine_id = extra.get("engine_id") or secrets.token_hex(8)
        host = extra.get("host", "127.0.0.1")
        self.advertise_host = extra.get("advertise_host", host)
        self.held: HeldTransfers | None = None
        self.server: TransferServer | None = None
        self.streams: StreamedPrefills | None = None
        # Prefix blocks served to peers by hash (the engine thread pins them: ``save_kv``).
        self.peers: PeerBlocks | None = PeerBlocks() if self.role.saves else None
        self.block_manager = ctx.block_manager
        if self.role.saves:
            # Given up at half the engine's hold: its blocks are never read once it frees them.
            self.held = HeldTransfers(extra.get("max_held_transfers", 1024),
                                      spec.kv_transfer_timeout / 2, self.stats)
            self.server = TransferServer(host, extra.get("port", 0), self.credential, self.held,
                                         ctx.kv_caches, self.layout, self.read_timeout_s,
                                         extra.get("max_connections", 16), self.peers,
                                         self.stream_wait_s)
            self.streams = StreamedPrefills(self.held, self.block_size, ctx.block_manager)
        self._pool = ThreadPoolExecutor(extra.get("pull_threads", 4), "kv-pd-pull")
        self._arrived: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self._asked: tuple[str, Remote, int, int] | None = None  # id, remote, first, count
        self._tried: set[str] = set()  # pulled once (a preempted request recomputes)
        self._planned: list[Pull] = []

    @property
    def transfer_address(self) -> str | None:
        """Where peers pull from ("host:port"; None: this engine serves no blocks)."""
        return None if self.server is None else f"{self.advertise_host}:{self.server.port}"

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        self._asked = None
        if not self.role.loads or request.request_id in self._tried:
            return 0, False
        remote = Remote.parse(request.kv_transfer_params, self.layout, self.credential)
        if isinstance(remote, str):
            logger.warning("request_id=%s: its remote prefill cannot be pulled (%s): "
                           "recomputed", request.request_id, remote)
            self.stats.failed(remote)
            self._tried.add(request.request_id)  # said once
            return 0, False
        if remote is None:
            remote = Remote.peer(request.kv_transfer_params)
        if remote is None:
            return 0, False
        first = num_computed_tokens // self.block_size
        stop = min(remote.num_blocks, (request.num_tokens - 1) // self.block_size,
                   len(request.block_hashes))
        if not remote.transfer_id:  # a peer's prefix: one ask names at most this many hashes
            stop = min(stop, first + MAX_PEER_BLOCKS)
        if stop <= first:
            return 0, False
        self._asked = (request.request_id, remote, first, stop - first)
        return (stop - first) * self.block_size, True

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        if self.streams is not None and asks_stream(request.kv_transfer_params):
            self.streams.open(request, self._grant)
        if not num_external_tokens:
            return
        assert self._asked is not None and self._asked[0] == request.request_id
        rid, remote, first, count = self._asked
        assert count * self.block_size == num_external_tokens
        self._tried.add(rid)
        hashes = None if remote.transfer_id else [
            h.hex() for h in request.block_hashes[first:first + count]]
        expires = None if remote.streaming_until is None else \
            time.monotonic() + remote.streaming_until - time.time()
        self._planned.append(Pull(rid, remote.host, remote.port, remote.transfer_id, first,
                                  block_ids[first:first + count],
                                  request.block_hashes[first + count - 1].hex(), hashes,
                                  expires))

    def build_connector_meta(self) -> list[Pull]:
        if self.streams:
            self.streams.ended()  # before this schedule's step can write a preempted one's
        planned, self._planned = self._planned, []
        return planned

    def take_announced(self) -> dict[str, dict[str, Any]]:
        return {} if self.streams is None else self.streams.take_announced()

    def request_finished(self, request: ConnectorRequest,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tried.discard(request.request_id)
        streamed = None if self.streams is None else self.streams.finish(request, block_ids)
        if streamed is not None:
            return streamed
        params = request.kv_transfer_params
        if self.held is None or not isinstance(params, dict) or \
                params.get("do_remote_decode") is not True:
            return False, None
        # Only blocks whose KV was computed (an abort mid-prompt leaves some unwritten).
        computed = min(request.num_computed_tokens, len(request.prompt_token_ids))
        full = block_ids[:min(computed // self.block_size, len(request.block_hashes))]
        transfer_id = self.held.add(request.request_id, full, request.block_hashes[:len(full)]) \
            if full else None
        if transfer_id is None:  # nothing full, or too many held: the decode recomputes
            return False, {"do_remote_prefill": False, "do_remote_decode": False}
        assert self.server is not None
        return True, self._grant(request.request_id, transfer_id, len(full))

    def _grant(self, request_id: str, transfer_id: str, num_blocks: int) -> dict[str, Any]:
        """The params that say where the blocks wait, signed so that no one without the
        credential can name another address (see ``Remote.parse``)."""
        assert self.server is not None and self.held is not None
        expires = int(time.time() + self.held.expiry_s) + 1
        fields = (self.engine_id, self.advertise_host, self.server.port, transfer_id,
                  num_blocks, self.layout, expires)
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_host": self.advertise_host,
                "remote_port": self.server.port, "remote_transfer_id": transfer_id,
                "remote_request_id": request_id, "remote_num_blocks": num_blocks,
                "kv_layout": self.layout, "remote_expires": expires,
                "remote_signature": internal_mac.sign(self.credential, GRANT, *fields)}

    # -- worker side -----------------------------------------------------------------------

    def start_load_kv(self, metadata: list[Pull]) -> None:
        for pull in metadata:
            self._pool.submit(self._pull, pull)

    def save_kv(self) -> None:
        # Every cached block holds final KV now: pin what peers asked for, release what they
        # read. (The prompts' held blocks are read from the pool when pulled.)
        if self.peers is not None:
            self.peers.serve(self.block_manager)
        if self.streams:  # the streamed prefills' blocks this step completed may be sent
            self.streams.advance()

    def get_finished(self, timeout: float = 0.0) -> FinishedTransfers:
        out = FinishedTransfers()
        if self.held is not None:
            out.sending = self.held.take_done()
        try:
            if timeout and not out:
                rid, n = self._arrived.get(timeout=timeout)
                out.recving[rid] = n
            while True:
                rid, n = self._arrived.get_nowait()
                out.recving[rid] = n
        except queue.Empty:
            pass
        return out

    def _pull(self, pull: Pull) -> None:
        started = time.monotonic()
        arrived = [0]  # blocks written so far: kept when the rest fails
        try:
            budget = self.read_timeout_s if pull.expires is not None else \
                self._budget(len(pull.block_ids))
            self._fetch(pull, budget, arrived)
        except Exception as exc:  # noqa: BLE001 - any failure is a recompute, never a hang
            reason = exc.reason if isinstance(exc, WireError) else "connection"
            logger.warning("request_id=%s: pulling its KV from %s:%s failed after %d of %d "
                           "blocks (%s: %s): the rest recomputed", pull.request_id, pull.host,
                           pull.port, arrived[0], len(pull.block_ids), reason, exc)
            self.stats.failed(reason)
        seconds = time.monotonic() - started
        if arrived[0]:
            self.stats.done("received", arrived[0] * pd_wire.block_bytes(self.caches), seconds)
        logger.debug("request_id=%s: %d blocks pulled in %.3f s", pull.request_id, arrived[0],
                     seconds)
        self._arrived.put((pull.request_id, arrived[0] * self.block_size))

    def _budget(self, num_blocks: int) -> float:
        """Seconds a pull of ``num_blocks`` may take: no longer than recomputing them (once
        that is measured), never under ``min_pull_s``, never over ``read_timeout_s``."""
        recompute = self.rate.seconds_for(num_blocks * self.block_size)
        if recompute is None:
            return self.read_timeout_s
        return min(self.read_timeout_s, max(self.min_pull_s, recompute))

    def _fetch(self, pull: Pull, budget_s: float, arrived: list[int]) -> None:
        deadline = time.monotonic() + budget_s
        with socket.create_connection((pull.host, pull.port), timeout=budget_s) as s:
            proof = pd_wire.client_hello(s, self.credential, deadline)
            if pull.hashes is None:
                ask = {"transfer_id": pull.transfer_id, "first": pull.first,
                       "count": len(pull.block_ids), "last_hash": pull.last_hash}
            else:
                ask = {"hashes": pull.hashes}
            pd_wire.send_json(s, {"proof": proof, **ask, "layout": self.layout})
            answer = pd_wire.recv_json(s, deadline)
            count = answer.get("count")
            wanted = len(pull.block_ids) if pull.hashes is None else range(len(pull.hashes) + 1)
            if answer.get("ok") is not True or not _int(count) or \
                    (count != wanted if isinstance(wanted, int) else count not in wanted):
                error = str(answer.get("error"))[:200]
                raise (pd_wire.Unauthorized if error == "unauthorized" else pd_wire.Refused)(
                    f"refused: {error}")
            size = pd_wire.block_bytes(self.caches)
            for block_id in pull.block_ids[:count]:
                if pull.expires is not None:  # streamed: each block once the prefill has it
                    deadline = min(pull.expires, time.monotonic() + self.stream_wait_s +
                                   self.read_timeout_s)
                try:
                    frame = pd_wire.recv_frame(s, size + 8, deadline)
                except pd_wire.TooSlow:
                    if budget_s >= self.read_timeout_s or pull.expires is not None:
                        raise
                    raise pd_wire.SlowerThanRecompute(
                        f"not done in {budget_s:.3f} s, the time to recompute it") from None
                data = pd_wire.verified(frame)
                if len(data) != size:
                    raise WireError(f"a block of {len(data)} bytes (expected {size})")
                pd_wire.write_block(self.caches, block_id, data)
                arrived[0] += 1

    # -- observability and lifetime ----------------------------------------------------------

    def take_events(self) -> list:
        return []

    def snapshot_events(self) -> list:
        return []

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _host_port(value: object) -> tuple[str, int] | None:
    """A transfer address as the heartbeat carries it ("host:port", IPv6 in brackets)."""
    if not isinstance(value, str):
        return None
    host, _, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return None
    return host, int(port)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _checked_extra(extra: Any) -> dict[str, Any]:
    checked = checked_extra(extra, _EXTRA, "PagodaPDConnector")
    if checked.get("port", 0) > 65535:
        raise ValueError("kv_transfer_config.kv_connector_extra_config.port must be at most "
                         f"65535, got {checked['port']!r}")
    return checked
