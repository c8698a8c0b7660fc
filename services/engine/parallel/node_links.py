"""Heartbeats between the leader and its worker nodes, over their admitted connections.

A rank in another pod has no pidfd to watch, and a collective with a peer that hangs (SIGSTOP,
a stuck host) waits for the collective timeout (half an hour). So each side sends a byte every
``PING_S`` and reads the other's: a link that closes (the peer died: its kernel closes the
socket) or stays silent for ``SILENCE_S`` (the peer hangs) is lost, and ``on_lost`` runs once,
from the link thread, whatever the step thread is blocked in. The leader's ``on_lost`` ends the
engine (``WorkerGroup.abort``); a worker's ends the worker. A clean stop says goodbye first
(``_BYE``), so the peer does not read the closing as a death.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

PING_S = 0.5
# Five missed pings. The link threads only ping (no GIL-heavy work), so silence this long is a
# peer that is stopped or cut off, not a busy one.
SILENCE_S = 2.5
_PING, _BYE = b".", b"!"


class NodeLinks:
    """Watches ``links`` (peer's name in messages, e.g. "worker node rank 1" -> its connected
    socket) until ``close``, or until a peer says goodbye."""

    def __init__(self, links: dict[str, socket.socket], on_lost: Callable[[str], None]) -> None:
        self._links = links
        self._on_lost = on_lost
        self._closing = threading.Event()
        self._heard = dict.fromkeys(links, time.monotonic())
        self._thread = threading.Thread(target=self._run, name="node-links", daemon=True)

    def start(self) -> NodeLinks:
        self._thread.start()
        return self

    def close(self) -> None:
        """Says goodbye on every link and closes them; ``on_lost`` never runs after this."""
        if self._closing.is_set():
            return
        self._closing.set()
        for conn in self._links.values():
            try:
                conn.send(_BYE, socket.MSG_DONTWAIT)
            except OSError:
                pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(2 * PING_S)
        for conn in self._links.values():
            conn.close()

    def _run(self) -> None:
        by_fd = {conn.fileno(): name for name, conn in self._links.items()}
        next_ping = 0.0
        while not self._closing.is_set():
            now = time.monotonic()
            if now >= next_ping:
                self._ping_all()
                next_ping = now + PING_S
            readable, _, _ = select.select(list(by_fd), [], [], PING_S / 2)
            for fd in readable:
                lost = self._read(by_fd[fd])
                if lost == _BYE.decode():
                    return None  # watched no longer
                if lost is not None:
                    return self._lose(lost)
            silent = [n for n, t in self._heard.items() if time.monotonic() - t > SILENCE_S]
            if silent:
                return self._lose(f"{silent[0]} went silent for over "
                                  f"{SILENCE_S:.1f}s (stopped or cut off)")
        return None

    def _ping_all(self) -> None:
        for conn in self._links.values():
            try:  # a full buffer means the peer stopped reading: silence will tell
                conn.send(_PING, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                pass  # closed: the read side reports it

    def _read(self, name: str) -> str | None:
        """Reads what ``name`` sent; why the link is lost, ``"!"`` for a goodbye, or None."""
        try:
            data = self._links[name].recv(4096)
        except ConnectionResetError:  # closed with our pings unread: a death too
            data = b""
        except OSError as exc:
            return f"{name}'s connection failed ({exc})"
        if not data:
            return f"{name} closed its connection (it died)"
        if _BYE in data:  # a clean stop: the step group carries the stop itself
            return _BYE.decode()
        self._heard[name] = time.monotonic()
        return None

    def _lose(self, reason: str) -> None:
        if not self._closing.is_set():
            self._on_lost(reason)
