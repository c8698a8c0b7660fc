"""The prefill engine's side of a P/D transfer: the blocks it holds for transfer ids it issued
(``HeldTransfers``), and the TCP server that lets a decode engine pull them (``TransferServer``).

The port is reachable by any pod in the cluster, so: a peer proves it holds the internal
credential before its ask is read (``pd_wire``'s handshake; the token never crosses the wire),
frames are bounded and read against a deadline, a peer names a transfer id (unguessable, issued
here), a range inside it and the chain hash of the range's last block (so only the same prompt
of the same tenant and adapter gets it), never a block id, and connections and held transfers
are bounded in number. A transfer is served once: its blocks are copied out of the pool under
the table's lock, then it is done.

A streamed transfer (``HeldTransfers.open_stream``) is issued when the prefill is admitted and
its blocks are sent as its chunks fill them: the pull waits for each next block, at most
``stream_wait_s`` and never past the transfer's expiry, so a peer naming a live transfer id
holds a connection slot for a bounded time and no memory beyond the run being sent.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Iterator
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
    block_ids: list[int]  # the pool's, in token order, of the blocks ready to send; never sent
    hashes: list[BlockHash]  # every block's chain hash: a pull names the last one it wants
    expires: float  # monotonic: unpulled by then, it is given up
    finished: bool = True  # the request left (its blocks are held); False: it still prefills
    reading: bool = False  # a pull reads it now (one at a time)
    over: bool = False  # a pull ended: it is never served again


class HeldTransfers:
    """Transfer id -> held blocks; shared by the engine thread and the server's threads.

    A transfer is either complete when issued (``add``: a finished prefill's blocks) or
    streamed (``open_stream``: issued when the prefill is admitted, its blocks made ready by
    the engine thread as its chunks are computed, ``advance``). Either is served by one pull
    (``runs``), which waits for blocks not ready yet; ``cancel`` ends a streamed one whose
    blocks are no longer the prompt's (its request was preempted or aborted). Blocks are
    copied out under the lock, and the engine thread takes the lock before any block of a
    cancelled transfer can be reused, so a block sent is always its final computed KV.
    """

    def __init__(self, max_held: int, expiry_s: float, stats: TransferStats) -> None:
        self.max_held, self.expiry_s, self.stats = max_held, expiry_s, stats
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # blocks became ready, or a transfer ended
        self._held: dict[str, Held] = {}
        self._done: set[str] = set()  # request ids whose blocks may be freed now

    def add(self, request_id: str, block_ids: list[int],
            hashes: list[BlockHash]) -> str | None:
        """A new transfer id for these (computed) blocks, or None when the table is full."""
        assert len(hashes) == len(block_ids)
        return self._issue(Held(request_id, list(block_ids), list(hashes),
                                time.monotonic() + self.expiry_s))

    def open_stream(self, request_id: str, hashes: list[BlockHash]) -> str | None:
        """A transfer id for a prompt still being prefilled: its ``len(hashes)`` blocks are
        served as ``advance`` makes them ready. None when the table is full."""
        assert hashes
        return self._issue(Held(request_id, [], list(hashes), time.monotonic() + self.expiry_s,
                                finished=False))

    def _issue(self, held: Held) -> str | None:
        with self._lock:
            if len(self._held) >= self.max_held:
                return None
            transfer_id = secrets.token_urlsafe(24)
            self._held[transfer_id] = held
            return transfer_id

    # -- the engine thread -----------------------------------------------------------------

    def advance(self, transfer_id: str, block_ids: list[int]) -> None:
        """The streamed transfer's leading ``block_ids`` hold final KV now."""
        with self._ready:
            held = self._held.get(transfer_id)
            if held is None:
                return  # expired meanwhile
            assert held.block_ids == block_ids[:len(held.block_ids)], "ready blocks changed"
            assert len(block_ids) <= len(held.hashes)
            held.block_ids = list(block_ids)
            self._ready.notify_all()

    def cancel(self, transfer_id: str) -> None:
        """Ends a streamed transfer for good. Returns only once no pull is copying its blocks:
        the caller may then let them be reused."""
        with self._ready:
            self._held.pop(transfer_id, None)
            self._ready.notify_all()

    def finish(self, transfer_id: str, block_ids: list[int]) -> bool:
        """The streamed transfer's request finished with all its blocks computed: whether its
        blocks must be held (False: its pull is over, or it expired)."""
        with self._ready:
            held = self._held.get(transfer_id)
            if held is None or held.over:
                self._held.pop(transfer_id, None)
                return False
            assert len(block_ids) == len(held.hashes)
            held.block_ids, held.finished = list(block_ids), True
            held.expires = time.monotonic() + self.expiry_s  # from now, as a complete one's
            self._ready.notify_all()
            return True

    def take_done(self) -> set[str]:
        """Request ids whose held blocks were pulled or expired since the last call."""
        now = time.monotonic()
        with self._ready:
            expired = [t for t, h in self._held.items() if h.expires <= now]
            for tid in expired:
                self._done.add(self._held.pop(tid).request_id)
            if expired:
                self.stats.add_expired(len(expired))
                self._ready.notify_all()
            done, self._done = self._done, set()
            return done

    # -- the server's threads --------------------------------------------------------------

    def runs(self, transfer_id: str, first: int, count: int, last_hash: str,
             kv_caches: list[tuple[torch.Tensor, torch.Tensor]], wait_s: float) -> Runs | str:
        """The one pull of a live transfer's blocks ``first .. first+count`` (``Runs``), or
        why not. ``last_hash`` (hex) must be the chain hash of the range's last block: the
        asker's prompt, tenant and adapter are the held one's."""
        with self._lock:
            held = self._held.get(transfer_id)
            if held is None or held.expires <= time.monotonic() or held.over:
                return "unknown transfer id"
            if held.reading:
                return "the transfer is being pulled"
            if not (0 <= first and 0 < count and first + count <= len(held.hashes)):
                return "blocks out of the transfer's range"
            if not hmac.compare_digest(held.hashes[first + count - 1].hex(), last_hash):
                return "another prompt's blocks"
            held.reading = True
        return Runs(self, transfer_id, held, first, first + count, kv_caches, wait_s)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


class Runs:
    """One pull of a held transfer: iterates runs of block bytes, in order, each as soon as
    its blocks are ready (waiting at most ``wait_s`` for the next, never past the transfer's
    expiry: ``TooSlow``; ``Refused`` when it was cancelled or expired meanwhile). ``close``
    (always: it is a context manager) ends the transfer for good, however far it got."""

    def __init__(self, table: HeldTransfers, transfer_id: str, held: Held, at: int, stop: int,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], wait_s: float) -> None:
        self.count = stop - at
        self._table, self._tid, self._held = table, transfer_id, held
        self._at, self._stop, self._caches, self._wait_s = at, stop, kv_caches, wait_s

    def __enter__(self) -> Runs:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[list[bytes]]:
        return self

    def __next__(self) -> list[bytes]:
        if self._at >= self._stop:
            raise StopIteration
        table, held = self._table, self._held
        with table._ready:
            deadline = min(time.monotonic() + self._wait_s, held.expires)
            while table._held.get(self._tid) is held and len(held.block_ids) <= self._at:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise pd_wire.TooSlow("the prefill did not reach the next block in time")
                table._ready.wait(left)
            if table._held.get(self._tid) is not held:
                raise pd_wire.Refused("the transfer was cancelled or expired")
            ready = min(len(held.block_ids), self._stop)
            # Copied under the lock: cancel (then reuse) and take_done wait for it.
            run = [pd_wire.read_block(self._caches, b) for b in held.block_ids[self._at:ready]]
        self._at = ready
        return run

    def close(self) -> None:
        table, held = self._table, self._held
        with table._ready:
            if held.over:
                return
            held.reading, held.over = False, True
            if held.finished and table._held.get(self._tid) is held:
                del table._held[self._tid]
                table._done.add(held.request_id)


class TransferServer:
    """Serves pulls on ``host:port`` (port 0: any free one, see ``port``), one thread per
    connection, at most ``max_connections`` at once (more are closed unanswered)."""

    def __init__(self, host: str, port: int, credential: InternalCredential,
                 held: HeldTransfers, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 layout: str, read_timeout_s: float, max_connections: int,
                 peers: PeerBlocks | None = None, stream_wait_s: float = 30.0) -> None:
        self.credential, self.held, self.kv_caches = credential, held, kv_caches
        self.stream_wait_s = stream_wait_s  # a streamed pull's wait for the prefill's next block
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
        runs = self._by_hash(ask, deadline) if "hashes" in ask else self._runs_for(ask)
        if isinstance(runs, str):
            pd_wire.send_json(conn, {"ok": False, "error": runs})
            raise pd_wire.Refused(runs)
        with runs:
            started, sent = time.monotonic(), 0
            pd_wire.send_json(conn, {"ok": True, "count": runs.count})
            conn.settimeout(self.read_timeout_s)  # sends: a peer that stops reading is dropped
            for run in runs:  # a streamed transfer's: as the prefill computes them
                for data in run:
                    pd_wire.send_frame(conn, pd_wire.checksummed(data))
                sent += sum(map(len, run))
        self.held.stats.done("sent", sent, time.monotonic() - started)

    def _by_hash(self, ask: dict[str, Any], deadline: float) -> _Copied | str:
        """A peer's prefix pull: the leading run of the asked chain hashes this engine holds
        in its pool or host tier (maybe none), pinned while copied."""
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
        lent = self.peers.pin(wanted, max(0.0, deadline - time.monotonic()))
        if lent is None:
            return "the engine is busy"
        try:
            return _Copied(self.peers.read(self.kv_caches, lent))
        finally:
            self.peers.unpin(lent)

    def _runs_for(self, ask: dict[str, Any]) -> Runs | str:
        tid, first, count = ask.get("transfer_id"), ask.get("first"), ask.get("count")
        last_hash = ask.get("last_hash")
        if not isinstance(tid, str) or not _is_int(first) or not _is_int(count) or \
                not isinstance(last_hash, str):
            return "transfer_id, last_hash (strings), first and count (integers) are required"
        if ask.get("layout") != self.layout:
            return "KV layout mismatch"
        return self.held.runs(tid, first, count, last_hash, self.kv_caches, self.stream_wait_s)


@dataclass(slots=True)
class _Copied:
    """Blocks already copied out (a peer's prefix pull), served as ``Runs`` are: one run."""

    blocks: list[bytes]

    @property
    def count(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[list[bytes]]:
        return iter([self.blocks])

    def __enter__(self) -> _Copied:
        return self

    def __exit__(self, *_: object) -> None:
        pass


MAX_PEER_BLOCKS = 1024  # one ask's hashes (16k tokens of 16): ~35 KB of JSON


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
