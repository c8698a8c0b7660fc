"""`make serve`: the whole stack on one machine.

Starts a real redis-server on loopback (installing it if missing), ENGINES engine processes,
the router and the gateway; Ctrl-C (or SIGTERM) stops all of it, engines first drained.

    python -m services.serve --port 8000 --engines 1 [--model PATH] [engine flags]
    python -m services.serve --prefill-engines 1 --decode-engines 1   # disaggregated P/D
    python -m services.serve --prefill-engines 1 --decode-engines 1 --pd-transport store
    python -m services.serve --ext-proc-port 9002   # the router is an Envoy endpoint picker too

With ``--ext-proc-port`` each engine also gets its OpenAI front: Pagoda's gateway pinned to it
(``--engine-url``, what the chart's ``openai`` sidecar runs), with the same API keys; the
engine advertises the front's port (``--openai-port``) and the picker answers Envoy with it.

Every child gets the internal credential in ``$PAGODA_INTERNAL_TOKENS``: the one in serve's
environment, else a random token made for this run (``child_env``).

Its own flags are ``ServeConfig``'s (the one CLI scheme, ``services.common.cli``); any other
flag is an engine flag (``python -m services.engine.serving.server --help``), passed to every
engine, as ``vllm serve`` takes the engine's arguments.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common import cli, internal_auth
from services.common.cli import flag
from services.common.default_model import default_model_dir, is_converted
from services.common.internal_auth import ensure_tokens
from services.common.logs import setup_logging
from services.engine.kv_offload.secret import SECRET_ENV
from services.router.config import PolicyName

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


def child_env(environ: dict[str, str]) -> dict[str, str]:
    """The environment of every child: ours, with the internal credential they share. Without
    one in ours (the usual case), a new random token for this run, so nothing else on the
    machine can call the engines' or the router's internal routes."""
    env = dict(environ)
    internal_auth.ensure_tokens(env)
    return env


def _default_model() -> Path:
    """The converted default model, converting it first (in a child process: the converter
    imports torch and transformers, which this launcher never needs) if `make install` has not."""
    path = default_model_dir()
    if not is_converted(path):
        subprocess.run([_PY, "-m", "services.engine.models.default"], check=True)
    return path


def router_flags(args: ServeConfig, port: int, redis_url: str, engine_urls: list[str],
                 model_name: str, model_dir: Path) -> list[str]:
    """The router's flags; with ``--ext-proc-port`` it is also the endpoint picker, on
    loopback, with the served model's tokenizer."""
    flags = ["--host", "127.0.0.1", "--port", str(port), "--redis-url", redis_url,
             "--engines", ",".join(engine_urls), "--policy", args.policy.value]
    if args.ext_proc_port:
        flags += ["--ext-proc-port", str(args.ext_proc_port),
                  "--tokenizer", f"{model_name}={model_dir}"]
    return flags


def key_flags(args: ServeConfig) -> list[str]:
    """The API keys of every OpenAI server serve starts: the gateway and the engines' fronts."""
    flags = []
    for key in args.api_keys:
        flags += ["--api-key", key]
    for key in args.admin_api_keys:
        flags += ["--admin-api-key", key]
    return flags


def front_flags(args: ServeConfig, port: int, engine_url: str, model_name: str,
                model_dir: Path) -> list[str]:
    """An engine's OpenAI front (with ``--ext-proc-port``): the gateway pinned to it, as the
    chart's sidecar is. Runtime adapter loads stay the gateway's (its registry reaches every
    engine; the fronts list what their engine then serves)."""
    return ["--host", "127.0.0.1", "--port", str(port), "--engine-url", engine_url,
            "--model", f"{model_name}={model_dir}", *key_flags(args)]


PROG = "python -m services.serve"
# --pd-transport: the P/D connector of each
PD_TRANSPORTS = {"tcp": "PagodaPDConnector", "store": "PagodaStorePDConnector"}
# Set by serve for each engine (--port and --model are serve's own flags as well).
_FIXED_ENGINE_FLAGS = {"--port", "--model", "--engine-id", "--redis-url", "--openai-port"}


@dataclass(frozen=True, slots=True)
class ServeConfig:
    port: int = flag(8000, help="gateway port")
    engines: int = flag(1, help="engine processes")
    model: str | None = flag(None, help="HF model directory (default: SmolLM2)")
    policy: PolicyName = flag(PolicyName.PREFIX, help="routing policy")
    dtype: str = flag("auto", help="engine dtype (auto: float32 on the CPU)")
    api_keys: tuple[str, ...] = flag(
        (), name="api-key", repeat=True, metavar="KEY",
        help="require this API key (repeat for several)",
    )
    admin_api_keys: tuple[str, ...] = flag(
        (), name="admin-api-key", repeat=True, metavar="KEY",
        help="an API key that may also load and unload LoRA adapters (repeat for several)",
    )
    prefill_engines: int = flag(0, help="disaggregated prefill/decode: prefill engines (with "
                                "--decode-engines; replaces --engines)")
    decode_engines: int = flag(0, help="disaggregated prefill/decode: decode engines")
    pd_transport: str = flag(
        "tcp", help="how the prefill engines' KV reaches the decode engines: tcp (engine to "
        "engine) or store (through a KV store serve starts: a second redis-server, 1 GiB, LRU)",
    )
    pd_min_prompt_tokens: int = flag(
        0, help="P/D: prompts with fewer than this many uncached tokens skip the prefill "
        "engines (the gateway's --pd-min-prompt-tokens; 0: none does)")
    pd_stream_kv: bool = flag(
        True, help="P/D over tcp: the prefill engines stream the prompt's KV while they "
        "compute it (the gateway's --pd-stream-kv; on by default, =false: pulled after the "
        "prefill)")
    ext_proc_port: int = flag(
        0, help="the router also serves Envoy's ext_proc (a Gateway API endpoint picker) on "
        "this gRPC port, on loopback, and each engine gets an OpenAI front (the gateway pinned "
        "to it), the endpoint the picker answers for it (0: off)",
    )
    allow_runtime_lora_updating: bool = flag(
        False, help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (or "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true); engines read adapters from --lora-roots",
    )

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not 0 <= self.ext_proc_port < 65536:
            raise ValueError(f"ext_proc_port must be in 0..65535, got {self.ext_proc_port}")
        if self.engines < 1:
            raise ValueError(f"engines must be >= 1, got {self.engines}")
        if self.prefill_engines < 0 or self.decode_engines < 0 or \
                (self.prefill_engines > 0) != (self.decode_engines > 0):
            raise ValueError("prefill_engines and decode_engines go together, each >= 1")
        if self.pd_min_prompt_tokens < 0:
            raise ValueError(f"pd_min_prompt_tokens must be >= 0, got {self.pd_min_prompt_tokens}")
        if self.ext_proc_port and self.pd:
            raise ValueError("ext_proc_port excludes prefill_engines and decode_engines: an "
                             "engine's OpenAI front serves it alone, never two legs")
        if self.pd_transport not in PD_TRANSPORTS:
            raise ValueError(f"pd_transport must be one of {', '.join(PD_TRANSPORTS)}, got "
                             f"{self.pd_transport!r}")

    @property
    def pd(self) -> bool:
        return self.prefill_engines > 0


def engine_roles(config: ServeConfig) -> list[str | None]:
    """Each engine's P/D ``kv_role`` (None: no P/D connector), in start order."""
    if not config.pd:
        return [None] * config.engines
    return ["kv_producer"] * config.prefill_engines + ["kv_consumer"] * config.decode_engines


def pd_flags(role: str | None, transport: str = "tcp", store_url: str | None = None
             ) -> list[str]:
    """An engine's --kv-transfer-config for its P/D ``role`` over ``transport`` (``store``:
    through the KV store at ``store_url``)."""
    if role is None:
        return []
    config: dict = {"kv_connector": PD_TRANSPORTS[transport], "kv_role": role}
    if transport == "store":
        assert store_url is not None
        config["kv_connector_extra_config"] = {"kv_store_url": store_url}
    return ["--kv-transfer-config", json.dumps(config)]


def args_from(argv: Sequence[str] | None = None) -> tuple[ServeConfig, list[str]]:
    """serve's config and the engine flags (every flag it has not), in order; exits 2 on a
    bad flag of its own, or on an engine flag it sets itself."""
    config, engine_flags = cli.config_and_rest(
        ServeConfig, argv, prog=PROG, description=__doc__.split("\n\n")[0],
        epilog="Any other flag is passed to every engine "
        "(python -m services.engine.serving.server --help).",
    )
    fixed = sorted({f.split("=")[0] for f in engine_flags} & (
        _FIXED_ENGINE_FLAGS | ({"--kv-transfer-config"} if config.pd else set())))
    if fixed:  # as argparse says it: status 2
        print(f"{PROG}: error: serve sets {', '.join(fixed)} for each engine itself",
              file=sys.stderr)
        raise SystemExit(2)
    return config, engine_flags


def main(argv: Sequence[str] | None = None) -> int:
    args, engine_flags = args_from(argv)
    setup_logging("INFO", "serve")
    # Started in the background by a shell, SIGINT arrives ignored; Ctrl-C must still stop us.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    model_dir = Path(args.model) if args.model else _default_model()
    model_name = model_dir.name
    procs: list[tuple[str, subprocess.Popen]] = []
    env = child_env(dict(os.environ))

    def start(name: str, cmd: list[str], cpus: set[int] | None = None) -> subprocess.Popen:
        logger.info("starting %s%s", name, f" on cores {sorted(cpus)}" if cpus else "")
        p = subprocess.Popen(cmd, env=env)
        if cpus is not None:
            # At once, while the child is still starting: the threads torch starts later
            # inherit it.
            os.sched_setaffinity(p.pid, cpus)
        procs.append((name, p))
        return p

    def stop_all(*_: object) -> None:
        for _name, p in reversed(procs):  # fronts, gateway, engines (drained), redis
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in reversed(procs):
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop; killing it", name)
                p.kill()

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    if args.pd:  # the engines' transfer ports accept only the stack's own credential
        ensure_tokens(os.environ)
    roles = engine_roles(args)
    try:
        redis_port = free_port()
        start("redis", [ensure_redis_server(), "--port", str(redis_port), "--bind", "127.0.0.1",
                        "--save", "", "--appendonly", "no", "--loglevel", "warning"])
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        store_url = None
        if args.pd and args.pd_transport == "store":  # the KV store: an instance of its own
            store_port = free_port()
            start("kv-store", [ensure_redis_server(), "--port", str(store_port), "--bind",
                               "127.0.0.1", "--save", "", "--appendonly", "no", "--loglevel",
                               "warning", "--maxmemory", "1gb", "--maxmemory-policy",
                               "allkeys-lru"])
            store_url = f"redis://127.0.0.1:{store_port}/0"
            # The store's MAC key, shared by the engines of this run (unless one is set).
            env.setdefault(SECRET_ENV, secrets.token_hex(32))
        engine_urls = []
        # With the picker, each engine's OpenAI front: its port is known before the engine
        # starts, which advertises it (the picker's answer for that engine).
        fronts = [free_port() for _ in roles] if args.ext_proc_port else []
        for i, cpus in enumerate(engine_cores(sorted(os.sched_getaffinity(0)), len(roles))):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            engine_urls.append(url)
            p = start(f"engine-{i}", [_PY, "-m", "services.engine.serving.server",
                                      "--port", str(port),
                                      "--model", str(model_dir), "--engine-id", f"engine-{i}",
                                      "--redis-url", redis_url, "--cpu-threads", str(len(cpus)),
                                      "--dtype", args.dtype,
                                      *(["--openai-port", str(fronts[i])] if fronts else []),
                                      *pd_flags(roles[i], args.pd_transport, store_url),
                                      *engine_flags],
                      cpus=cpus if len(roles) > 1 else None)
            wait_http(f"{url}/health", 600, p)
        router_port = free_port()
        p = start("router", [_PY, "-m", "services.router",
                             *router_flags(args, router_port, redis_url, engine_urls,
                                           model_name, model_dir)])
        wait_http(f"http://127.0.0.1:{router_port}/health", 60, p)
        gw_cmd = [_PY, "-m", "services.gateway", "--host", "127.0.0.1", "--port", str(args.port),
                  "--router-url", f"http://127.0.0.1:{router_port}",
                  "--model", f"{model_name}={model_dir}", *key_flags(args)]
        if args.allow_runtime_lora_updating:
            gw_cmd.append("--allow-runtime-lora-updating")
        if args.pd:
            gw_cmd += ["--pd-disaggregation",
                       "--pd-min-prompt-tokens", str(args.pd_min_prompt_tokens),
                       f"--pd-stream-kv={str(args.pd_stream_kv).lower()}"]
        p = start("gateway", gw_cmd)
        wait_http(f"http://127.0.0.1:{args.port}/health", 120, p)
        for i, front in enumerate(fronts):
            p = start(f"openai-front-{i}", [_PY, "-m", "services.gateway",
                                            *front_flags(args, front, engine_urls[i],
                                                         model_name, model_dir)])
            wait_http(f"http://127.0.0.1:{front}/ready", 120, p)
        logger.info("Pagoda is serving %s at http://127.0.0.1:%d/v1 (Ctrl-C stops)",
                    model_name, args.port)
        for i, url in enumerate(engine_urls):  # vLLM's metric families live on each engine
            logger.info("engine-%d metrics: %s/metrics", i, url)
        if args.ext_proc_port:
            logger.info("endpoint picker (Envoy ext_proc, gRPC): 127.0.0.1:%d; it answers "
                        "each engine's OpenAI front: %s", args.ext_proc_port,
                        ", ".join(f"engine-{i} 127.0.0.1:{f}" for i, f in enumerate(fronts)))
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
