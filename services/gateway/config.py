"""Gateway configuration: one validated dataclass; every field is one CLI flag.

``--api-key`` and ``--model`` repeat; ``PAGODA_API_KEYS`` (comma separated) adds keys from the
environment so they need not appear on a command line, as ``PAGODA_ADMIN_API_KEYS`` does for
``--admin-api-key``; ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`` turns on
``--allow-runtime-lora-updating``, as in vLLM.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from services.common import cli
from services.common.cli import flag
from services.common.flow_control import FlowFlags
from services.common.internal_auth import insecure_flag, token_file_flag
from services.common.logs import check_log_level
from services.protocol.openai import MAX_CHOICES, MAX_N

API_KEYS_ENV = "PAGODA_API_KEYS"
ADMIN_KEYS_ENV = "PAGODA_ADMIN_API_KEYS"
# vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter, accepted as it is.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
PROG = "python -m services.gateway"
DESCRIPTION = (
    "Pagoda OpenAI-compatible gateway: auth, templating, tokenizing, routing, streaming."
)
TOOL_PARSERS = ("hermes", "llama3_json")  # services/gateway/tool_parsers
DEFAULT_ROUTER_URL = "http://127.0.0.1:8100"


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
            raise ValueError(f"expected NAME=HF_DIR or HF_DIR, got {text!r}")
        return cls(name, path)


@dataclass(frozen=True, slots=True)
class GatewayConfig(FlowFlags):
    host: str = flag("0.0.0.0", help="address to listen on")
    port: int = flag(8000, help="port to listen on")
    router_url: str | None = flag(
        None,
        help=f"base URL of the router (default {DEFAULT_ROUTER_URL}, unless --engine-url); "
        "comma-separate several replicas (a replica that fails is skipped for a while and the "
        "request goes to the next)",
    )
    engine_url: str | None = flag(
        None,
        metavar="URL",
        help="pin the gateway to the one engine at this URL, with no router: the OpenAI front "
        "of an engine pod (the chart runs it beside the engine, http://127.0.0.1:PORT, as a "
        "Gateway API InferencePool's target); excludes --router-url, --pd-disaggregation and "
        "--flow-control; with --allow-runtime-lora-updating a load reaches this engine alone",
    )
    api_keys: tuple[str, ...] = flag(
        (),
        name="api-key",
        repeat=True,
        metavar="KEY",
        help=f"accepted bearer key (repeatable; also ${API_KEYS_ENV}, comma separated); "
        "none = open",
    )
    models: tuple[ModelSpec, ...] = flag(
        (),  # resolved to the default model by __main__
        name="model",
        repeat=True,
        parse=ModelSpec.parse,
        metavar="NAME=HF_DIR",
        help="served model name and the HF directory of its tokenizer and chat template "
        "(repeatable; default: the default model)",
    )
    default_model: str | None = flag(
        None,
        metavar="NAME",
        help="served model used by requests that name none (default: the only --model; with "
        "several, such requests get a 400)",
    )
    max_n: int = flag(
        MAX_N, help=f"most samples (n) one prompt may ask for; prompts x n stays at most "
        f"{MAX_CHOICES}"
    )
    block_size: int = flag(
        16, help="tokens per KV block until the router's /engines reports a model's own"
    )
    max_body_bytes: int = flag(8 * 1024 * 1024, help="larger request bodies get 413")
    body_read_timeout: float = flag(
        30.0, help="seconds a request body may take to arrive (a slower client gets 408)"
    )
    # nginx's default; it also closes clients that dribble their headers (slowloris).
    keepalive_timeout: float = flag(
        75.0,
        help="seconds a connection may go without a complete request (idle keep-alive, or "
        "headers sent too slowly) before it is closed",
    )
    request_timeout: float = flag(600.0, help="seconds one generation may take")
    max_retries: int = flag(2, help="other engines tried when one fails before its first token")
    pd_disaggregation: bool = flag(
        False, help="disaggregated prefill/decode: each choice's prompt runs on a prefill engine "
        "first (max_tokens 1), then on a decode engine that pulls its KV (the router picks each "
        "by the role in the engines' heartbeats); the client sees one completion")
    pd_min_prompt_tokens: int = flag(
        0, help="with --pd-disaggregation: prompts with fewer than this many tokens to compute "
        "skip the prefill leg and are computed by the decode engine itself (llm-d's selective "
        "P/D: a short prompt is cheaper to compute than to queue behind long ones on a prefill "
        "engine); only the part the decode engine the router picks neither holds nor pulls "
        "from a peer counts; 0: every prompt takes the prefill leg")
    pd_stream_kv: bool = flag(
        True, help="with --pd-disaggregation: the prefill engine streams the prompt's KV "
        "(its PagodaPDConnector): the decode leg starts when the prefill engine admits the "
        "prompt and pulls each block as the prefill's chunks compute it, so only the last "
        "chunk's blocks move after the prefill (on by default: measured no worse on the mixed "
        "workload's p99 inter-token latency and TTFT; --pd-stream-kv=false: the decode leg "
        "starts once the prefill ended; ignored without --pd-disaggregation)")
    router_timeout: float = flag(
        5.0, help="seconds per router call (with --engine-url: per call of the engine's /health)")
    engines_refresh: float = flag(
        5.0, help="seconds between polls of the router's /engines (with --engine-url: of the "
        "engine's /health)")
    shutdown_grace: float = flag(30.0, help="seconds open generations get to finish on SIGTERM")
    engine_wait_timeout: float = flag(
        0.0,
        help="seconds a request may wait for an engine when its model has none ready (scale "
        "from zero); past it a 503 with Retry-After. 0: a 503 at once",
    )
    engine_wait_max_requests: int = flag(
        256,
        help="engine requests per model that may wait so at once; the next one gets a 429 "
        "with Retry-After",
    )
    # Defaults sized for the chart's 2 GiB gateway: a held body costs 2-3x its bytes in the
    # process (the bytes, the parsed JSON, the token ids), with several models held at once.
    engine_wait_max_bytes: int = flag(
        128 * 1024 * 1024,
        help="request body bytes per model that may wait so at once (each engine request "
        "counts its share of its body); past it a 429 with Retry-After",
    )
    engine_wait_max_tenant_bytes: int = flag(
        32 * 1024 * 1024,
        help="request body bytes one API key's tenant may have waiting so, over all models; "
        "past it a 429 with Retry-After (no bound per tenant when keys are off)",
    )
    log_level: str = flag("INFO", help="logging level")
    admin_api_keys: tuple[str, ...] = flag(
        (),
        name="admin-api-key",
        repeat=True,
        metavar="KEY",
        help=f"a bearer key that may also load and unload LoRA adapters (repeatable; also "
        f"${ADMIN_KEYS_ENV}); admin keys are accepted wherever --api-key keys are",
    )
    allow_runtime_lora_updating: bool = flag(
        False,
        help=f"serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (admin keys only "
        f"when keys are configured); ${RUNTIME_LORA_ENV}=true turns it on too, as in vLLM. "
        "With --engine-url the adapter is loaded on that one engine, registered nowhere, as "
        "vLLM's server loads it on itself",
    )
    tool_call_parser: str | None = flag(
        None,
        help="how tool calls are read from the output of tool_choice auto (as vLLM's flag): "
        "hermes (<tool_call> JSON: Qwen2.5, Qwen3, Hermes) or llama3_json (Llama 3.x); "
        "none = tool_choice auto is refused (required and named functions always work)",
    )
    internal_token_file: str | None = token_file_flag()
    insecure_no_internal_auth: bool = insecure_flag()

    @property
    def router_urls(self) -> tuple[str, ...]:
        """Every router replica's base URL (``router_url`` split on commas); none when the
        gateway is pinned to one engine (``engine_url``)."""
        return tuple(self.router_url.split(",")) if self.router_url else ()

    def __post_init__(self) -> None:
        if self.pd_min_prompt_tokens < 0:
            raise ValueError(f"pd_min_prompt_tokens must be >= 0, got {self.pd_min_prompt_tokens}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.engine_url is not None:
            self._check_pinned()
        else:
            self._check_router_url(DEFAULT_ROUTER_URL if self.router_url is None
                                   else self.router_url)
        keys = tuple(k.strip() for k in self.api_keys if k.strip())
        object.__setattr__(self, "api_keys", tuple(dict.fromkeys(keys)))
        admin = tuple(k.strip() for k in self.admin_api_keys if k.strip())
        object.__setattr__(self, "admin_api_keys", tuple(dict.fromkeys(admin)))
        names = [m.name for m in self.models]
        if len(names) != len(set(names)):
            raise ValueError(f"--model names must be unique, got {names}")
        if self.default_model is not None and names and self.default_model not in names:
            raise ValueError(f"--default-model must be one of the --model names {names}")
        for name in ("block_size", "max_body_bytes", "max_n", "engine_wait_max_requests",
                     "engine_wait_max_bytes", "engine_wait_max_tenant_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.max_retries, int) or not 0 <= self.max_retries <= 16:
            raise ValueError(f"max_retries must be in 0..16, got {self.max_retries!r}")
        for name in ("body_read_timeout", "keepalive_timeout", "request_timeout",
                     "router_timeout", "engines_refresh", "shutdown_grace"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.engine_wait_timeout < self.request_timeout:
            raise ValueError(f"engine_wait_timeout must be in [0, request_timeout), got "
                             f"{self.engine_wait_timeout!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        check_log_level(self.log_level)
        self.flow_config()  # its own checks

    def _check_router_url(self, value: str) -> None:
        urls = [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
        if not urls:
            raise ValueError("router_url must name at least one router")
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"router_url must be http(s)://host:port, got {url!r}")
        object.__setattr__(self, "router_url", ",".join(urls))

    def _check_pinned(self) -> None:
        """One engine, no router: what needs a router (or other engines) is refused here,
        each naming its flag, rather than half working."""
        url = self.engine_url.strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path:
            raise ValueError(f"engine_url must be http(s)://host:port, got {self.engine_url!r}")
        try:
            parts.port  # noqa: B018 -- raises on a port out of range
        except ValueError:
            raise ValueError(f"engine_url has a bad port: {self.engine_url!r}") from None
        object.__setattr__(self, "engine_url", url)
        if self.router_url is not None:
            raise ValueError("engine_url excludes --router-url: a gateway pinned to one engine "
                             "asks no router")
        if self.pd_disaggregation:
            raise ValueError("engine_url excludes --pd-disaggregation: the prefill and decode "
                             "legs run on two engines, which only the router pairs")
        if self.flow_control:
            raise ValueError("engine_url excludes --flow-control: in front of a Gateway API "
                             "pool the endpoint picker (the router's ext_proc) queues requests")

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> GatewayConfig:
        """The flags in ``argv``, plus the keys in ``$PAGODA_API_KEYS`` of ``environ``."""
        parser = build_parser()
        ns = parser.parse_args(argv)
        env = os.environ if environ is None else environ
        keys = (*getattr(ns, "api_keys", ()), *env.get(API_KEYS_ENV, "").split(","))
        admin = (*getattr(ns, "admin_api_keys", ()), *env.get(ADMIN_KEYS_ENV, "").split(","))
        runtime = getattr(ns, "allow_runtime_lora_updating", False) or env.get(
            RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true", "yes", "on")
        return cli.from_namespace(cls, ns, parser, api_keys=keys, admin_api_keys=admin,
                                  allow_runtime_lora_updating=runtime)


def build_parser() -> argparse.ArgumentParser:
    return cli.build_parser(GatewayConfig, prog=PROG, description=DESCRIPTION)
