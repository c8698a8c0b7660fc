"""Gateway configuration: one validated dataclass; every field is one CLI flag.

``--api-key`` and ``--model`` repeat; ``PAGODA_API_KEYS`` (comma separated) adds keys from the
environment so they need not appear on a command line.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

API_KEYS_ENV = "PAGODA_API_KEYS"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A served model name and the HF directory whose tokenizer and chat template it uses."""

    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """``NAME=HF_DIR``, or just ``HF_DIR`` (named after the directory, as the engine does)."""
        name, sep, path = text.partition("=")
        if not sep:
            name, path = Path(text).name, text
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise ValueError(f"--model must be NAME=HF_DIR or HF_DIR, got {text!r}")
        return cls(name, path)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    router_url: str = "http://127.0.0.1:8100"  # comma-separated: replicas, tried in turn
    api_keys: tuple[str, ...] = ()  # none = open
    models: tuple[ModelSpec, ...] = ()  # none = the default model (resolved by __main__)
    block_size: int = 16  # used for a model until the router's /engines reports its own
    max_body_bytes: int = 8 * 1024 * 1024
    body_read_timeout: float = 30.0  # seconds a request body may take to arrive; then 408
    # Seconds a connection may stay without a complete request: idle keep-alives, and clients
    # that dribble their headers (slowloris), are closed after it. nginx's default.
    keepalive_timeout: float = 75.0
    request_timeout: float = 600.0  # seconds for one whole generation
    max_retries: int = 2  # extra engines tried when one fails before its first token
    router_timeout: float = 5.0  # seconds per router call
    engines_refresh: float = 5.0  # seconds between polls of the router's /engines
    shutdown_grace: float = 30.0  # seconds open generations get to finish on SIGTERM
    log_level: str = "INFO"

    @property
    def router_urls(self) -> tuple[str, ...]:
        """Every router replica's base URL (``router_url`` split on commas)."""
        return tuple(self.router_url.split(","))

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        urls = [u.strip().rstrip("/") for u in self.router_url.split(",") if u.strip()]
        if not urls:
            raise ValueError("router_url must name at least one router")
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"router_url must be http(s)://host:port, got {url!r}")
        object.__setattr__(self, "router_url", ",".join(urls))
        keys = tuple(k.strip() for k in self.api_keys if k.strip())
        object.__setattr__(self, "api_keys", tuple(dict.fromkeys(keys)))
        names = [m.name for m in self.models]
        if len(names) != len(set(names)):
            raise ValueError(f"--model names must be unique, got {names}")
        for name in ("block_size", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.max_retries, int) or not 0 <= self.max_retries <= 16:
            raise ValueError(f"max_retries must be in 0..16, got {self.max_retries!r}")
        for name in ("body_read_timeout", "keepalive_timeout", "request_timeout",
                     "router_timeout", "engines_refresh", "shutdown_grace"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> GatewayConfig:
        parser = build_parser()
        ns = parser.parse_args(argv)
        env = os.environ if environ is None else environ
        keys = list(ns.api_key or []) + env.get(API_KEYS_ENV, "").split(",")
        try:
            models = tuple(ModelSpec.parse(m) for m in ns.model or [])
            return cls(
                host=ns.host,
                port=ns.port,
                router_url=ns.router_url,
                api_keys=tuple(keys),
                models=models,
                block_size=ns.block_size,
                max_body_bytes=ns.max_body_bytes,
                body_read_timeout=ns.body_read_timeout,
                keepalive_timeout=ns.keepalive_timeout,
                request_timeout=ns.request_timeout,
                max_retries=ns.max_retries,
                router_timeout=ns.router_timeout,
                engines_refresh=ns.engines_refresh,
                shutdown_grace=ns.shutdown_grace,
                log_level=ns.log_level,
            )
        except ValueError as exc:
            parser.error(str(exc))
            raise  # unreachable: error() exits


def build_parser() -> argparse.ArgumentParser:
    d = GatewayConfig()
    p = argparse.ArgumentParser(
        prog="python -m services.gateway",
        description="Pagoda OpenAI-compatible gateway: auth, templating, tokenizing, routing, "
        "streaming.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=int, default=d.port, help="port to listen on")
    p.add_argument("--router-url", default=d.router_url, help="base URL of the router; comma-separate several replicas (a replica that fails is "
        "skipped for a while and the request goes to the next)")
    p.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help=f"accepted bearer key (repeatable; also ${API_KEYS_ENV}, comma separated); "
        "none = open",
    )
    p.add_argument(
        "--model",
        action="append",
        metavar="NAME=HF_DIR",
        help="served model name and the HF directory of its tokenizer and chat template "
        "(repeatable; default: the default model)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help="tokens per KV block until the router's /engines reports a model's own",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=d.max_body_bytes, help="larger request bodies get 413"
    )
    p.add_argument(
        "--body-read-timeout",
        type=float,
        default=d.body_read_timeout,
        help="seconds a request body may take to arrive (a slower client gets 408)",
    )
    p.add_argument(
        "--keepalive-timeout",
        type=float,
        default=d.keepalive_timeout,
        help="seconds a connection may go without a complete request (idle keep-alive, or "
        "headers sent too slowly) before it is closed",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout,
        help="seconds one generation may take",
    )
    p.add_argument(
        "--max-retries",
        type=int,
        default=d.max_retries,
        help="other engines tried when one fails before its first token",
    )
    p.add_argument(
        "--router-timeout", type=float, default=d.router_timeout, help="seconds per router call"
    )
    p.add_argument(
        "--engines-refresh",
        type=float,
        default=d.engines_refresh,
        help="seconds between polls of the router's /engines",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=d.shutdown_grace,
        help="seconds open generations get to finish on SIGTERM",
    )
    p.add_argument("--log-level", default=d.log_level, help="logging level")
    return p
