"""The prefill engine's side of a P/D transfer: the blocks it holds for transfer ids it issued
(``HeldTransfers``), and the TCP server that lets a decode engine pull them (``TransferServer``).

The port is reachable by any pod in the cluster, so: a peer proves it holds the internal
credential before its ask is read (``pd_wire``'s handshake; the token never crosses the wire),
frames are bounded and read against a deadline, a peer names a transfer id (unguessable, issued
here), a range inside it and the chain hash of the range's last block (so only the same prompt
of the same tenant and adapter gets it), never a block id, and connections and held transfers
are bounded in number. A transfer is served once: its blocks are copied out of the pool under
the table's lock, then it is done.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from services.common.internal_auth import InternalCredential
from services.engine.kv_connector import pd_wire
from services.engine.kv_connector.pd_wire import WireError
from services.engine.kv_connector.peer_blocks import PeerBlocks
from services.engine.kv_connector.transfer_stats import TransferStats
from services.protocol.block_hash import BlockHash

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Held:
    request_id: str
    block_ids: list[int]  # the pool's, in token order; never sent to a peer
    hashes: list[BlockHash]  # their chain hashes: a pull names the last one it wants
    expires: float  # monotonic: unpulled by then, it is given up


class HeldTransfers:
    """Transfer id -> held blocks; shared by the engine thread and the server's threads."""

    def __init__(self, max_held: int, expiry_s: float, stats: TransferStats) -> None:
        self.max_held, self.expiry_s, self.stats = max_held, expiry_s, stats
        self._lock = threading.Lock()
        self._held: dict[str, Held] = {}
        self._done: set[str] = set()  # request ids whose blocks may be freed now

    def add(self, request_id: str, block_ids: list[int],
            hashes: list[BlockHash]) -> str | None:
        """A new transfer id for these blocks, or None when the table is full."""
        assert len(hashes) == len(block_ids)
        with self._lock:
            if len(self._held) >= self.max_held:
                return None
            transfer_id = secrets.token_urlsafe(24)
            self._held[transfer_id] = Held(request_id, list(block_ids), list(hashes),
                                           time.monotonic() + self.expiry_s)
            return transfer_id

    def copy_out(self, transfer_id: str, first: int, count: int, last_hash: str,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[bytes] | str:
        """The blocks ``first .. first+count`` of a live transfer, copied out of the pool (then
        the transfer is over), or why not. ``last_hash`` (hex) must be the chain hash of the
        range's last block: the asker's prompt, tenant and adapter are the held one's."""
        with self._lock:
            held = self._held.get(transfer_id)
            if held is None or held.expires <= time.monotonic():
                return "unknown transfer id"
            if not (0 <= first and 0 < count and first + count <= len(held.block_ids)):
                return "blocks out of the transfer's range"
            if not hmac.compare_digest(held.hashes[first + count - 1].hex(), last_hash):
                return "another prompt's blocks"
            del self._held[transfer_id]
            self._done.add(held.request_id)
            # Copied while the lock keeps get_finished from reporting the blocks free.
            return [pd_wire.read_block(kv_caches, b) for b in held.block_ids[first:first + count]]

    def take_done(self) -> set[str]:
        """Request ids whose blocks were pulled or expired since the last call."""
        now = time.monotonic()
        with self._lock:
            expired = [t for t, h in self._held.items() if h.expires <= now]
            for tid in expired:
                self._done.add(self._held.pop(tid).request_id)
            if expired:
                self.stats.add_expired(len(expired))
            done, self._done = self._done, set()
            return done

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


class TransferServer:
    """Serves pulls on ``host:port`` (port 0: any free one, see ``port``), one thread per
    connection, at most ``max_connections`` at once (more are closed unanswered)."""

    def __init__(self, host: str, port: int, credential: InternalCredential,
                 held: HeldTransfers, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 layout: str, read_timeout_s: float, max_connections: int,
                 peers: PeerBlocks | None = None) -> None:
        self.credential, self.held, self.kv_caches = credential, held, kv_caches
        self.peers = peers
        self.layout, self.read_timeout_s = layout, read_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._sock = socket.create_server((host, port), backlog=max_connections)
        self.port: int = self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kv-pd-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                conn.close()  # too many at once: refused before reading anything
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="kv-pd-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._answer(conn)
        except WireError as exc:
            logger.info("kv transfer: a pull ended: %s", exc)
            self.held.stats.failed(exc.reason)
        except OSError as exc:
            logger.info("kv transfer: a pull ended: %s", exc)
            self.held.stats.failed("connection")
        finally:
            self._slots.release()

    def _answer(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.read_timeout_s  # for the whole request
        nonces = pd_wire.server_hello(conn, self.credential, deadline)
        ask = pd_wire.recv_json(conn, deadline, pd_wire.MAX_ASK_BYTES)
        if not pd_wire.client_proven(self.credential, nonces, ask.get("proof")):
            pd_wire.send_json(conn, {"ok": False, "error": "unauthorized"})
            raise pd_wire.Unauthorized("a peer without the internal credential")
        blocks = self._by_hash(ask, deadline) if "hashes" in ask else self._blocks_for(ask)
        if isinstance(blocks, str):
            pd_wire.send_json(conn, {"ok": False, "error": blocks})
            raise pd_wire.Refused(blocks)
        started = time.monotonic()
        pd_wire.send_json(conn, {"ok": True, "count": len(blocks)})
        conn.settimeout(self.read_timeout_s)  # sends: a peer that stops reading is dropped
        for data in blocks:
            pd_wire.send_frame(conn, pd_wire.checksummed(data))
        self.held.stats.done("sent", sum(map(len, blocks)), time.monotonic() - started)

    def _by_hash(self, ask: dict[str, Any], deadline: float) -> list[bytes] | str:
        """A peer's prefix pull: the leading run of the asked chain hashes this engine's cache
        holds (maybe none), pinned while copied."""
        hashes = ask.get("hashes")
        if self.peers is None:
            return "this engine serves no prefix blocks"
        if ask.get("layout") != self.layout:
            return "KV layout mismatch"
        if not isinstance(hashes, list) or not 0 < len(hashes) <= MAX_PEER_BLOCKS or not all(
                isinstance(h, str) and len(h) == 32 for h in hashes):
            return f"hashes must be 1-{MAX_PEER_BLOCKS} block hashes (32 hex characters)"
        try:
            wanted = [BlockHash(bytes.fromhex(h)) for h in hashes]
        except ValueError:
            return "hashes must be hex"
        ids = self.peers.pin(wanted, max(0.0, deadline - time.monotonic()))
        if ids is None:
            return "the engine is busy"
        try:
            return [pd_wire.read_block(self.kv_caches, b) for b in ids]
        finally:
            self.peers.unpin(ids)

    def _blocks_for(self, ask: dict[str, Any]) -> list[bytes] | str:
        tid, first, count = ask.get("transfer_id"), ask.get("first"), ask.get("count")
        last_hash = ask.get("last_hash")
        if not isinstance(tid, str) or not _is_int(first) or not _is_int(count) or \
                not isinstance(last_hash, str):
            return "transfer_id, last_hash (strings), first and count (integers) are required"
        if ask.get("layout") != self.layout:
            return "KV layout mismatch"
        return self.held.copy_out(tid, first, count, last_hash, self.kv_caches)


MAX_PEER_BLOCKS = 1024  # one ask's hashes (16k tokens of 16): ~35 KB of JSON


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
