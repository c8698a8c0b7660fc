"""The engine server's own configuration and its command line: every field of ``EngineConfig``
and of ``ServerConfig`` is one flag (``--num-blocks``, ``--redis-url``).

``ServerConfig`` is the server's own flags (``ServerFlags``), then those the features' server
parts read (``features.server_parts``: ``ServerPart.server_fields``), then the internal API's
auth flags: one dataclass, made once the parts are registered, so a feature's flag is a field
like any other (``ServerConfig(redis_url=..., <a part's field>=...)``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from services.common import cli
from services.common.cli import flag
from services.common.internal_auth import insecure_flag, token_file_flag
from services.common.logs import check_log_level
from services.engine.config import EngineConfig
from services.engine.features import server_parts
from services.engine.features.server_parts import FieldSpec
from services.engine.parallel.node_group import from_lws_env

PROG = "python -m services.engine.serving.server"
DESCRIPTION = "Pagoda engine server: the model, its KV cache and the internal streaming API."
ENGINE_CORES = ("process", "inline")


@dataclass(slots=True)
class ServerFlags:
    """The server's own flags; ``ServerConfig`` adds the parts' and the auth flags."""

    host: str = flag("127.0.0.1", help="address to listen on")
    port: int = flag(8200, help="port to listen on")
    engine_id: str | None = flag(None, help="the engine's id in Redis (default: hostname-port)")
    advertise_url: str | None = flag(
        None, help="how gateways reach this engine (default: http://HOST:PORT)"
    )
    openai_port: int = flag(
        0, help="the port of the OpenAI front serving this engine (Pagoda's gateway pinned to "
        "it, --engine-url) on the same host, advertised in heartbeats: the router's endpoint "
        "picker answers Envoy with it for this engine (0: none; the picker's "
        "--ext-proc-target-port, else this engine's port)",
    )
    redis_url: str | None = flag(
        None, help="Redis for heartbeats and KV events (default: none, no routing index)"
    )
    kv_events_config: str | None = flag(
        None, help="vLLM's KV-event publisher, as JSON: '{\"enable_kv_cache_events\": true, "
        "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"topic\": \"\"}' (beside Redis)",
    )
    heartbeat_interval_s: float = flag(
        1.0, help="seconds between heartbeats (sooner when requests arrive or finish)")
    heartbeat_ttl_s: float = flag(5.0, help="seconds a heartbeat stays live in Redis")
    kv_events_token_ids: bool = flag(
        False,
        help="put the stored blocks' token ids in the KV events on Redis's channel, as vLLM "
        "does (every tenant's prompt tokens in clear, for a subscriber that needs them); off, "
        "events carry block hashes only, all the routers use",
    )
    shutdown_timeout: float = flag(
        30.0,
        help="on SIGTERM (or SIGINT), seconds the requests in flight get to finish once the "
        "engine has left the routing set (vLLM's --shutdown-timeout; 0: cut them at once)",
    )
    step_timeout_s: float = flag(
        120.0,
        help="seconds the engine core may go without finishing a step while requests wait "
        "before it counts as stuck: the requests fail, /health turns 503, the engine leaves "
        "the routing set and exits (0: no watchdog)",
    )
    debug_step_delay_s: float = flag(
        0.0, help="fault injection for tests and drills: seconds slept before every step"
    )
    debug_crash_after_steps: int = flag(
        0, help="fault injection for tests and drills: the engine core's loop raises after this "
        "many steps, ending its thread or process (0: never)"
    )
    log_level: str = flag("INFO", help="logging level")
    engine_core: str = flag(
        "process",
        help="where the engine core (scheduler, model, sampler) runs: 'process' (its own "
        "process, so the HTTP event loop and the step loop never share a GIL) or 'inline' "
        "(a thread of the server process)",
    )

    def __post_init__(self) -> None:
        for name in ("port", "openai_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {getattr(self, name)}")
        for name in ("heartbeat_interval_s", "heartbeat_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("shutdown_timeout", "step_timeout_s", "debug_step_delay_s",
                     "debug_crash_after_steps"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.engine_core not in ENGINE_CORES:
            raise ValueError(f"engine_core must be one of {', '.join(ENGINE_CORES)}, "
                             f"got {self.engine_core!r}")
        check_log_level(self.log_level)
        from services.engine.serving.zmq_kv_events import KVEventsConfig

        KVEventsConfig.parse(self.kv_events_config)  # validates

    def resolved_engine_id(self) -> str:
        return self.engine_id or f"{socket.gethostname()}-{self.port}"

    def resolved_url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"


def _config_class() -> type[ServerFlags]:
    """``ServerFlags`` with the parts' fields, then the auth flags (last in ``--help``)."""
    auth: list[FieldSpec] = [("internal_token_file", str | None, token_file_flag()),
                             ("insecure_no_internal_auth", bool, insecure_flag())]
    fields = [f for part in server_parts.parts() for f in part.server_fields()]
    return dataclasses.make_dataclass(
        "ServerConfig", [*fields, *auth], bases=(ServerFlags,), slots=True,
        namespace={"__module__": __name__, "__doc__": "The engine server's configuration."})


ServerConfig = _config_class()


def build_parser() -> argparse.ArgumentParser:
    return cli.build_parser(EngineConfig, ServerConfig, prog=PROG, description=DESCRIPTION)


def configs_from_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] = os.environ,
) -> tuple[EngineConfig, ServerConfig]:
    """Both configs from one command line, and in a LeaderWorkerSet the node group from its
    environment where ``--nnodes`` is not given; a bad flag, value or LWS variable exits 2
    with its message."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    engine = cli.from_namespace(EngineConfig, ns, parser)
    if engine.nnodes == 1:
        try:
            engine = replace(engine, **from_lws_env(env))
        except ValueError as exc:
            parser.error(str(exc))
    return engine, cli.from_namespace(ServerConfig, ns, parser)
