"""Heartbeat links: a byte every ``PING_S`` each way, so a peer that dies or hangs is seen within
seconds, whatever the step thread is blocked in.

Two kinds of pair use them: the leader of a node group and each worker pod, over their admitted
connections (``node_join``), and a process and each local rank it starts (``local_workers``),
over a socket pair. A rank in another pod has no pidfd to watch, and a collective with a peer
that hangs (SIGSTOP, a stuck host or process) waits for the collective timeout (half an hour);
a local rank's pidfd tells its death but not its hang. So each side sends a byte every
``PING_S`` and reads the other's: a link that closes (the peer died: its kernel closes the
socket) or stays silent for ``SILENCE_S`` (the peer hangs) is lost, and ``on_lost`` runs once,
from the link thread. The leader's ``on_lost`` ends the engine (``WorkerGroup.abort``); a
worker pod's ends the pod's process; a local rank's starter ends as when that rank dies. A
clean stop says goodbye first (``_BYE``), so the peer does not read the closing as a death.

The thread only pings and reads (no GIL-heavy work), and a rank's step releases the GIL in its
torch ops and gloo waits, so a rank busy in a long step still pings.
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


class Heartbeats:
    """Watches ``links`` (peer's name in messages, e.g. "worker node rank 1" -> its connected
    socket) until ``close``; a peer that says goodbye is watched no longer.

    ``watch_silence``: False for a side that only pings and sees its peer's death (the link
    closing) but not its silence (a local rank: its starter's hang is not its to judge).
    ``from_first_ping``: a peer's silence counts only once it has pinged (a local rank starts
    pinging after its imports, which take seconds on a busy host; its hang before that is its
    rendezvous's to time out)."""

    def __init__(self, links: dict[str, socket.socket], on_lost: Callable[[str], None],
                 watch_silence: bool = True, from_first_ping: bool = False,
                 name: str = "heartbeats") -> None:
        self._links = links
        self._on_lost = on_lost
        self._watch_silence = watch_silence
        self._closing = threading.Event()
        start = None if from_first_ping else time.monotonic()
        self._heard: dict[str, float | None] = dict.fromkeys(links, start)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Heartbeats:
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
        while by_fd and not self._closing.is_set():
            now = time.monotonic()
            if now >= next_ping:
                self._ping_all()
                next_ping = now + PING_S
            readable, _, _ = select.select(list(by_fd), [], [], PING_S / 2)
            for fd in readable:
                name = by_fd[fd]
                lost = self._read(name)
                if lost == _BYE.decode():  # watched no longer
                    del by_fd[fd], self._heard[name]
                elif lost is not None:
                    return self._lose(lost)
            if (silent := self._silent()) is not None:
                return self._lose(f"{silent} went silent for over "
                                  f"{SILENCE_S:.1f}s (stopped or cut off)")
        return None

    def _silent(self) -> str | None:
        """A peer not heard from for ``SILENCE_S``, if silence is watched."""
        if not self._watch_silence:
            return None
        now = time.monotonic()
        return next((n for n, t in self._heard.items() if t is not None and now - t > SILENCE_S),
                    None)

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
