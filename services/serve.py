"""`make serve`: the whole stack on one machine.

Starts a real redis-server on loopback (installing it if missing), ENGINES engine processes,
the router and the gateway; Ctrl-C (or SIGTERM) stops all of it, engines first drained.

    python -m services.serve --port 8000 --engines 1 [--model PATH]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from services.common.default_model import default_model_dir, is_converted

logger = logging.getLogger("pagoda.serve")

# Variables every child inherits untouched (OpenTelemetry is configured through OTEL_*).
_PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    logger.info("redis-server not found; installing it with apt-get")
    subprocess.run(["apt-get", "update", "-qq"], check=False)
    subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], check=True)
    path = shutil.which("redis-server")
    if not path:
        raise SystemExit("could not install redis-server; install it and retry")
    return path


def engine_cores(cores: list[int], engines: int) -> list[set[int]]:
    """Splits the cores this process may use between ``engines`` engines, one disjoint share
    each (so their threads never fight over a core); with more engines than cores, one core
    each, shared round-robin."""
    if engines >= len(cores):
        return [{cores[i % len(cores)]} for i in range(engines)]
    share = len(cores) // engines
    return [set(cores[i * share : (i + 1) * share]) for i in range(engines)]


def wait_http(url: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited with code {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become healthy in {timeout:.0f}s")


def _default_model() -> Path:
    """The converted default model, converting it first (in a child process: the converter
    imports torch and transformers, which this launcher never needs) if `make install` has not."""
    path = default_model_dir()
    if not is_converted(path):
        subprocess.run([_PY, "-m", "services.engine.models.default"], check=True)
    return path


_FIXED_ENGINE_FLAGS = {"--port", "--model", "--engine-id", "--redis-url"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8000, help="gateway port")
    ap.add_argument("--engines", type=int, default=1, help="engine processes")
    ap.add_argument("--model", default=None, help="HF model directory (default: SmolLM2)")
    ap.add_argument("--policy", default="prefix", help="routing policy")
    ap.add_argument("--dtype", default="auto", help="engine dtype (auto: float32 on the CPU)")
    ap.add_argument("--api-key", action="append", default=[], help="require this API key")
    # Any other flag is an engine flag (`python -m services.engine.serving.server --help`), passed to
    # every engine, as `vllm serve` takes the engine's arguments.
    args, engine_flags = ap.parse_known_args(argv)
    if any(f.split("=")[0] in _FIXED_ENGINE_FLAGS for f in engine_flags):
        raise SystemExit(f"these engine flags are set by serve itself: {sorted(_FIXED_ENGINE_FLAGS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # Started in the background by a shell, SIGINT arrives ignored; Ctrl-C must still stop us.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.engines < 1:
        raise SystemExit("--engines must be >= 1")

    model_dir = Path(args.model) if args.model else _default_model()
    model_name = model_dir.name
    procs: list[tuple[str, subprocess.Popen]] = []

    def start(name: str, cmd: list[str], cpus: set[int] | None = None) -> subprocess.Popen:
        logger.info("starting %s%s", name, f" on cores {sorted(cpus)}" if cpus else "")
        p = subprocess.Popen(cmd, env=os.environ.copy())
        if cpus is not None:
            # At once, while the child is still starting: the threads torch starts later
            # inherit it.
            os.sched_setaffinity(p.pid, cpus)
        procs.append((name, p))
        return p

    def stop_all(*_: object) -> None:
        for name, p in reversed(procs):  # gateway first, engines (drained), redis last
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in reversed(procs):
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop; killing it", name)
                p.kill()

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        redis_port = free_port()
        start("redis", [ensure_redis_server(), "--port", str(redis_port), "--bind", "127.0.0.1",
                        "--save", "", "--appendonly", "no", "--loglevel", "warning"])
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        engine_urls = []
        for i, cpus in enumerate(engine_cores(sorted(os.sched_getaffinity(0)), args.engines)):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            engine_urls.append(url)
            p = start(f"engine-{i}", [_PY, "-m", "services.engine.serving.server", "--port", str(port),
                                      "--model", str(model_dir), "--engine-id", f"engine-{i}",
                                      "--redis-url", redis_url, "--cpu-threads", str(len(cpus)),
                                      "--dtype", args.dtype, *engine_flags],
                      cpus=cpus if args.engines > 1 else None)
            wait_http(f"{url}/health", 600, p)
        router_port = free_port()
        p = start("router", [_PY, "-m", "services.router", "--host", "127.0.0.1",
                             "--port", str(router_port),
                             "--redis-url", redis_url, "--engines", ",".join(engine_urls),
                             "--policy", args.policy])
        wait_http(f"http://127.0.0.1:{router_port}/health", 60, p)
        gw_cmd = [_PY, "-m", "services.gateway", "--host", "127.0.0.1", "--port", str(args.port),
                  "--router-url", f"http://127.0.0.1:{router_port}",
                  "--model", f"{model_name}={model_dir}"]
        for key in args.api_key:
            gw_cmd += ["--api-key", key]
        p = start("gateway", gw_cmd)
        wait_http(f"http://127.0.0.1:{args.port}/health", 120, p)
        logger.info("Pagoda is serving %s at http://127.0.0.1:%d/v1 (Ctrl-C stops)",
                    model_name, args.port)
        for i, url in enumerate(engine_urls):  # vLLM's metric families live on each engine
            logger.info("engine-%d metrics: %s/metrics", i, url)
        logger.info("gateway metrics: http://127.0.0.1:%d/metrics; router metrics: "
                    "http://127.0.0.1:%d/metrics", args.port, router_port)
        while all(p.poll() is None for _, p in procs):
            time.sleep(0.5)
        dead = [name for name, p in procs if p.poll() is not None]
        logger.error("a process exited: %s; stopping everything", dead)
        return 1
    except KeyboardInterrupt:
        logger.info("stopping")
        return 0
    finally:
        stop_all()


if __name__ == "__main__":
    sys.exit(main())
