"""A real ``redis-server`` on a free loopback port, for tests.

    with RedisServer() as server:                 # or RedisServer(password="s3cret")
        client = redis.Redis.from_url(server.url)

    with RedisServer(tls=True) as server:         # TLS only: the plain port is off
        server.url      # rediss://127.0.0.1:PORT/0?ssl_ca_certs=/tmp/.../ca.crt
        server.ca_file  # the test CA that signed the server's certificate

The server keeps nothing on disk (``--save '' --appendonly no``) and is stopped on exit.
``stop()`` kills it mid-test (to test Redis outages); ``start()`` brings it back on the same
port. ``password_in_url=False`` leaves the password out of ``url`` (for clients that read it
from ``REDIS_PASSWORD``). With ``tls=True`` a throwaway CA and a server certificate for
127.0.0.1 and localhost are made with the ``openssl`` CLI in the server's temp directory, and
``url`` carries the CA the way the Helm chart passes it (``ssl_ca_certs=`` in the query).
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

INSTALL_HINT = "redis-server not found: install it with `apt-get install -y redis-server`"

# X.509 v3 extensions strict enough for Python's default TLS verification.
_CA_CONFIG = """[req]
prompt = no
distinguished_name = dn
x509_extensions = v3
[dn]
CN = pagoda-test-ca
[v3]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
"""
_SERVER_EXT = """basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
"""


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
        *,
        tls: bool = False,
        password_in_url: bool = True,
    ) -> None:
        path = shutil.which(binary)
        if path is None:
            raise RuntimeError(INSTALL_HINT)
        self.binary = path
        self.password = password
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self.tls = tls
        self.password_in_url = password_in_url
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password and self.password_in_url else ""
        if not self.tls:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.ca_file}"

    @property
    def ca_file(self) -> Path:
        """The test CA's certificate (PEM); only with ``tls=True``, once started."""
        if not self.tls or self._dir is None:
            raise RuntimeError("ca_file exists only for a started RedisServer(tls=True)")
        return Path(self._dir.name) / "ca.crt"

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
        if self.tls:
            args = self._tls_args(args)
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
        """One PING over a raw socket, or a TLS one trusting the test CA (no client library)."""
        auth = b""
        if self.password:
            pw = self.password.encode()
            auth = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw)
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                if not self.tls:
                    return _ping(raw, auth)
                context = ssl.create_default_context(cafile=str(self.ca_file))
                with context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                    return _ping(s, auth)
        except OSError:  # ssl.SSLError included
            return False

    def _tls_args(self, args: list[str]) -> list[str]:
        """TLS on ``self.port``, the plain port off; certificates made once per server."""
        directory = Path(self._dir.name)
        if not (directory / "server.crt").exists():
            _make_certificates(directory)
        args[args.index("--port") + 1] = "0"
        return [*args,
                "--tls-port", str(self.port),
                "--tls-cert-file", str(directory / "server.crt"),
                "--tls-key-file", str(directory / "server.key"),
                "--tls-ca-cert-file", str(directory / "ca.crt"),
                "--tls-auth-clients", "no"]  # fmt: skip

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


def _ping(sock: socket.socket, auth: bytes) -> bool:
    sock.sendall(auth + b"*1\r\n$4\r\nPING\r\n")
    data = b""
    while b"PONG" not in data and len(data) < 256:
        chunk = sock.recv(256)
        if not chunk:
            break
        data += chunk
    return b"+PONG" in data


def _make_certificates(directory: Path) -> None:
    """``ca.crt``/``ca.key`` (a throwaway CA) and ``server.crt``/``server.key`` it signed, for
    127.0.0.1 and localhost. EC P-256 keys: made in milliseconds."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl not found: install it with `apt-get install -y openssl`")
    (directory / "ca.cnf").write_text(_CA_CONFIG)
    (directory / "server.ext").write_text(_SERVER_EXT)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-config", "ca.cnf")  # fmt: skip
    run("req", *key, "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=localhost")  # fmt: skip
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "2",
        "-extfile", "server.ext")  # fmt: skip
