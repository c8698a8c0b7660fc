"""Real service processes for end-to-end tests: start, wait until healthy, stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Self

from services.common import internal_auth
from tests.support.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]


def internal_headers() -> dict[str, str]:
    """The internal credential's header, for tests that call an engine's or a router's routes
    directly (tests/conftest.py puts the session's token in the environment every service
    inherits)."""
    tokens = internal_auth.read_tokens(None, os.environ)
    return internal_auth.InternalCredential(tokens).headers()


class ServiceProcess:
    """``python -m MODULE ARGS`` on a free port; ``url`` once ``/health`` answers 200."""

    def __init__(
        self,
        module: str,
        args: list[str],
        port: int | None = None,
        env: dict[str, str] | None = None,
        health_path: str = "/health",
        startup_timeout_s: float = 180.0,
    ) -> None:
        self.module = module
        self.port = port or free_port()
        self.args = ["--port", str(self.port), *args]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.health_path = health_path
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._terminated = False  # SIGTERM sent once: a second one would cut its shutdown short
        # stderr goes to a file, not a pipe: nobody drains a pipe during a long test, and a
        # full pipe would block the service on its next log line.
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 -- lives as long as the service
            prefix=f"pagoda-{module}-", suffix=".log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        self.launch()
        self.wait_healthy()
        return self

    def launch(self) -> Self:
        """Starts the process without waiting for it (several start side by side, then each
        ``wait_healthy()``)."""
        self._terminated = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, *self.args],
            cwd=REPO,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        return self

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.log_tail()
                raise RuntimeError(f"{self.module} exited ({self.proc.returncode}):\n{err}")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.module} not healthy after {self.startup_timeout_s}s")

    def log_tail(self, chars: int = 4000) -> str:
        """The last ``chars`` characters the service wrote to stderr (its log)."""
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-chars:]

    def log_text(self) -> str:
        """Everything the service has logged so far."""
        return Path(self._log.name).read_text(errors="replace")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self) -> None:
        """Sends SIGTERM without waiting (several shut down side by side, then each
        ``stop()``, which then only waits)."""
        if self.proc is not None and self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def stop_all(procs: Iterable[ServiceProcess | None]) -> None:
    """Stops several services side by side: SIGTERM to each in the order given, then waits for
    each (their shutdowns overlap instead of adding up)."""
    live = [p for p in procs if p is not None]
    for p in live:
        p.terminate()
    for p in live:
        p.stop()


def wait_for_log(proc: subprocess.Popen, path: Path, marker: str, timeout: float) -> str:
    """The log at ``path`` of a process started by the test, once it holds ``marker``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace")
        if marker in text:
            return text
        assert proc.poll() is None, text[-3000:]
        time.sleep(0.3)
    raise AssertionError(f"no {marker!r} after {timeout}s:\n{path.read_text()[-3000:]}")
