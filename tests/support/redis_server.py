"""A real ``redis-server`` on a free loopback port, for tests.

    with RedisServer() as server:                 # or RedisServer(password="s3cret")
        client = redis.Redis.from_url(server.url)

The server keeps nothing on disk (``--save '' --appendonly no``) and is stopped on exit.
``stop()`` kills it mid-test (to test Redis outages); ``start()`` brings it back on the same
port.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

INSTALL_HINT = "redis-server not found: install it with `apt-get install -y redis-server`"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(
        self,
        password: str | None = None,
        port: int | None = None,
        binary: str = "redis-server",
        startup_timeout_s: float = 10.0,
    ) -> None:
        path = shutil.which(binary)
        if path is None:
            raise RuntimeError(INSTALL_HINT)
        self.binary = path
        self.password = password
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> Self:
        if self.running:
            return self
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="pagoda-redis-")
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--logfile", str(Path(self._dir.name) / "redis.log"),
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_until_ready(self._proc)
        return self

    def stop(self) -> None:
        """Kills the server at once (SIGKILL), like a crash."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=10)
        if self._proc.stderr is not None:
            self._proc.stderr.close()
        self._proc = None

    def close(self) -> None:
        self.stop()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def ping(self) -> bool:
        """One PING over a raw socket (no client library needed)."""
        auth = b""
        if self.password:
            pw = self.password.encode()
            auth = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw)
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(auth + b"*1\r\n$4\r\nPING\r\n")
                data = b""
                while b"PONG" not in data and len(data) < 256:
                    chunk = s.recv(256)
                    if not chunk:
                        break
                    data += chunk
                return b"+PONG" in data
        except OSError:
            return False

    def _wait_until_ready(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                log = self._log()
                self._proc = None
                raise RuntimeError(f"redis-server exited at start: {err or log}")
            if self.ping():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING within {self.startup_timeout_s}s")

    def _log(self) -> str:
        if self._dir is None:
            return ""
        try:
            return (Path(self._dir.name) / "redis.log").read_text()[-2000:]
        except OSError:
            return ""
