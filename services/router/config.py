"""Router configuration: one dataclass; every field is one CLI flag (``--redis-url`` for
``redis_url``), built from the fields themselves by ``services.common.cli`` so the two cannot
drift apart."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any
from urllib.parse import urlsplit

from services.common import cli
from services.common.cli import flag
from services.common.flow_control import FlowFlags
from services.common.internal_auth import insecure_flag, token_file_flag
from services.common.logs import check_log_level
from services.common.redis_index import redact_url
from services.protocol.redis_schema import (
    DEFAULT_MAX_BLOCKS_PER_ENGINE,
    DEFAULT_NAMESPACE,
    DEFAULT_PENDING_TTL_S,
    DEFAULT_PROVISIONAL_TTL_S,
    RedisKeys,
)


class PolicyName(StrEnum):
    PREFIX = "prefix"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


PROG = "python -m services.router"
DESCRIPTION = "Pagoda prefix-aware router: picks an engine for each prompt."


@dataclass(frozen=True, slots=True)
class RouterConfig(FlowFlags):
    host: str = flag("0.0.0.0", help="address to listen on")
    port: int = flag(8100, help="port to listen on")
    redis_url: str = flag(
        "redis://127.0.0.1:6379/0",
        help="Redis URL: redis://[:password@]host:port/db, rediss:// for TLS, unix:///path",
    )
    redis_namespace: str = flag(DEFAULT_NAMESPACE, help="prefix of every Redis key")
    redis_timeout_s: float = flag(0.25, help="Redis connect/read timeout per attempt")
    redis_retry_s: float = flag(
        1.0,
        help="after a Redis error, route from the fallback this long before retrying",
    )
    engines: tuple[str, ...] = flag(
        (),
        help="static engine URLs, comma separated (instead of Kubernetes discovery)",
        metavar="URL",
    )
    k8s_service: str | None = flag(None, help="discover engines from this Service's EndpointSlices")
    k8s_namespace: str | None = flag(
        None,
        help="namespace of --k8s-service (default: the pod's own, else 'default')",
    )
    k8s_port_name: str | None = flag(
        None,
        help="EndpointSlice port name to use (default: 'http' if any, else the first)",
    )
    k8s_scheme: str = flag("http", help="URL scheme of discovered engines")
    k8s_api_url: str | None = flag(
        None,
        help=(
            "Kubernetes API URL; replaces only the host of the in-cluster config, else of the"
            " kubeconfig, keeping their CA and credentials (with neither: used bare, as for"
            " 'kubectl proxy'). Default: the host of that config"
        ),
    )
    k8s_backoff_max_s: float = flag(30.0, help="longest wait between watch restarts")
    policy: PolicyName = flag(PolicyName.PREFIX, help="routing policy")
    load_weight: float = flag(
        0.5,
        help="prefix policy: weight of load (0..1 of the busiest) vs matched ratio",
    )
    hot_spot_ratio: float = flag(
        2.0,
        help="prefix policy: balance when the chosen engine is this many times busier",
    )
    hot_spot_min_load: int = flag(
        # 4 diverted ~10% of agent turns away from their cache at 128 engines (fleet benchmark);
        # 6 keeps max/mean load near 1.15 while prefix TTFT beats round-robin 3x.
        default=6,
        help="...than the least busy one and has at least this running+waiting+pending",
    )
    provisional_ttl_s: float = flag(
        DEFAULT_PROVISIONAL_TTL_S,
        help="how long a routing write-back claims the prompt's blocks",
    )
    pending_ttl_s: float = flag(
        DEFAULT_PENDING_TTL_S,
        help="how long a routed request counts as load before a heartbeat",
    )
    max_blocks_per_engine: int = flag(
        DEFAULT_MAX_BLOCKS_PER_ENGINE,
        help="cap of an engine's entries in the Redis block index",
    )
    fallback_max_age_s: float = flag(
        300.0, help="Redis down: route by heartbeats seen at most this long ago"
    )
    deletion_cost: bool = flag(
        True,
        help="with --k8s-service: keep each engine pod's controller.kubernetes.io/"
        "pod-deletion-cost annotation at the prefix blocks it served recently, so a scale-in "
        "removes the engine with the coldest cache (needs RBAC: patch pods)",
    )
    deletion_cost_interval_s: float = flag(
        10.0, help="seconds between pod-deletion-cost passes (at most one write per pod each)"
    )
    deletion_cost_window_s: float = flag(
        300.0, help="the window of prefix hits a pod's deletion cost counts"
    )
    # -- the endpoint picker (Envoy ext_proc, services.router.ext_proc) --------------------
    ext_proc_port: int = flag(
        0, help="serve Envoy's ext_proc as a Gateway API InferencePool endpoint picker on this "
        "gRPC port (0: off)",
    )
    ext_proc_max_body_bytes: int = flag(
        4 * 1024 * 1024, help="picker: a request body past this many bytes is refused (413)"
    )
    ext_proc_max_buffered_bytes: int = flag(
        256 * 1024 * 1024, help="picker: request-body bytes all streams may hold at once "
        "(past it a 503)",
    )
    ext_proc_max_streams: int = flag(
        1024, help="picker: concurrent ext_proc streams (more are refused by gRPC)"
    )
    ext_proc_body_timeout_s: float = flag(
        30.0, help="picker: seconds from a request's headers to the end of its body (else 408), "
        "and for its pick (else 503)"
    )
    ext_proc_stream_timeout_s: float = flag(
        3600.0, help="picker: longest life of one ext_proc stream (request and response)"
    )
    ext_proc_endpoints: int = flag(
        3, help="picker: endpoints in the ordered list it answers (the pick, then fallbacks)"
    )
    ext_proc_shed_waiting: int = flag(
        0, help="picker: answer 429 when every eligible engine has at least this many requests "
        "waiting or pending (0: never shed)",
    )
    ext_proc_target_port: int = flag(
        0, help="picker: the port of the endpoints it answers, in place of each engine's own "
        "(its URL's): the engine pods' OpenAI front, the InferencePool's targetPorts (0: the "
        "engine's port); an engine that advertises its front's port (the engine's "
        "--openai-port, in its heartbeat) is answered with that one",
    )
    ext_proc_tenant_from_key: bool = flag(
        True, help="picker: scope the cache salt to the tenant of the request's bearer key, "
        "as Pagoda's gateway does with --api-key",
    )
    tokenizer: tuple[str, ...] = flag(
        (), repeat=True, metavar="MODEL=HF_DIR",
        help="picker: the tokenizer and chat template of a base model (repeatable); a model "
        "without one is picked by load only",
    )
    log_level: str = flag("INFO", help="logging level")
    internal_token_file: str | None = token_file_flag()
    insecure_no_internal_auth: bool = insecure_flag()

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        self._check_ext_proc()
        if urlsplit(self.redis_url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"redis_url must be redis://, rediss:// or unix://: {redact_url(self.redis_url)!r}"
            )
        RedisKeys(self.redis_namespace)  # validates
        object.__setattr__(self, "policy", _enum(PolicyName, self.policy, "policy"))
        object.__setattr__(self, "engines", tuple(u.strip() for u in self.engines if u.strip()))
        for url in self.engines:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"engine URL must be http(s)://host:port, got {url!r}")
        if self.engines and self.k8s_service:
            raise ValueError("use either --engines or --k8s-service, not both")
        if self.k8s_scheme not in ("http", "https"):
            raise ValueError(f"k8s_scheme must be http or https, got {self.k8s_scheme!r}")
        for name in (
            "redis_timeout_s",
            "redis_retry_s",
            "k8s_backoff_max_s",
            "provisional_ttl_s",
            "pending_ttl_s",
            "fallback_max_age_s",
            "deletion_cost_interval_s",
            "deletion_cost_window_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.load_weight <= 10:
            raise ValueError(f"load_weight must be in [0, 10], got {self.load_weight}")
        if not self.hot_spot_ratio >= 1:
            raise ValueError(f"hot_spot_ratio must be >= 1, got {self.hot_spot_ratio}")
        if self.hot_spot_min_load < 0:
            raise ValueError(f"hot_spot_min_load must be >= 0, got {self.hot_spot_min_load}")
        check_log_level(self.log_level)
        if self.max_blocks_per_engine <= 0:
            raise ValueError(f"max_blocks_per_engine must be > 0, got {self.max_blocks_per_engine}")

    def _check_ext_proc(self) -> None:
        for name in ("ext_proc_port", "ext_proc_target_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {getattr(self, name)}")
        for name in ("ext_proc_max_body_bytes", "ext_proc_max_buffered_bytes",
                     "ext_proc_max_streams", "ext_proc_endpoints",
                     "ext_proc_body_timeout_s", "ext_proc_stream_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.ext_proc_shed_waiting < 0:
            raise ValueError(f"ext_proc_shed_waiting must be >= 0, got "
                             f"{self.ext_proc_shed_waiting}")
        tokenizer_dirs(self.tokenizer)  # validates
        self.flow_config()  # its own checks

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> RouterConfig:
        return cli.config_from_args(cls, argv, prog=PROG, description=DESCRIPTION)


def _enum(cls: type[Enum], value: Any, name: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(m.value for m in cls)
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}") from None


def tokenizer_dirs(specs: Sequence[str]) -> dict[str, str]:
    """``MODEL=HF_DIR`` flags as {model: directory}."""
    out = {}
    for spec in specs:
        name, sep, path = (x.strip() for x in spec.partition("="))
        if not sep or not name or not path:
            raise ValueError(f"tokenizer must be MODEL=HF_DIR, got {spec!r}")
        out[name] = path
    return out


def build_parser() -> argparse.ArgumentParser:
    return cli.build_parser(RouterConfig, prog=PROG, description=DESCRIPTION)
