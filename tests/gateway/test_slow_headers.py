"""Slowloris on the headers: a connection that never completes its request (idle, or headers
dribbled a byte at a time) is closed after --keepalive-timeout, and others are served."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis_server import free_port
from tests.support.services import ServiceProcess

KEEPALIVE_S = 2.0


@pytest.fixture(scope="module")
def gateway(fast_model_dir: Path) -> Iterator[ServiceProcess]:
    # No router is needed to hold a connection open: the gateway starts without one.
    args = ["--host", "127.0.0.1", "--router-url", f"http://127.0.0.1:{free_port()}",
            "--model", f"m={fast_model_dir}", "--keepalive-timeout", str(KEEPALIVE_S)]
    with ServiceProcess("services.gateway", args) as proc:
        yield proc


def _closed_after(sock: socket.socket, dribble: bytes | None) -> float:
    """Seconds until the server closes ``sock``, sending one byte of ``dribble`` every 0.3 s."""
    start = time.monotonic()
    sock.settimeout(0.3)
    sent = 0
    while time.monotonic() - start < 30:
        try:
            if sock.recv(1024) == b"":
                return time.monotonic() - start
        except TimeoutError:
            pass
        except OSError:
            return time.monotonic() - start
        if dribble is not None:
            try:
                sock.send(dribble[sent % len(dribble):sent % len(dribble) + 1])
                sent += 1
            except OSError:
                return time.monotonic() - start
    raise AssertionError("the server kept the connection open for 30 s")


@pytest.mark.parametrize("dribble", [None, b"X-Pad: " + b"a" * 200], ids=["idle", "headers"])
def test_incomplete_requests_are_closed(gateway: ServiceProcess, dribble: bytes | None) -> None:
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=5)
    try:
        if dribble is not None:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        # Others are served meanwhile.
        with urllib.request.urlopen(gateway.url + "/health", timeout=5) as resp:
            assert resp.status == 200
        waited = _closed_after(sock, dribble)
    finally:
        sock.close()
    assert KEEPALIVE_S * 0.5 <= waited < KEEPALIVE_S + 3, waited
