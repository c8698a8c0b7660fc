"""Msgpack wire messages of the routing plane: an engine's heartbeat (engine -> Redis -> router)
and the route request and answer (gateway -> router -> gateway).

They are ``wire.Message`` subclasses, validated when decoded by the one validator the engine's
messages use too, under the same limits (``services.protocol.wire``, which says how to add one).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from services.protocol.block_hash import BlockHash, HashAlgorithm
from services.protocol.lora_api import MAX_ADAPTERS, AdapterStatus
from services.protocol.wire import (
    BLOCK_HASH_BYTES,
    MAX_EXCLUDE,
    MAX_NAME_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_REQUEST_ID_CHARS,
    MAX_URL_CHARS,
    Message,
    bounds,
    show,
)

HASH_ALGORITHMS = tuple(a.value for a in HashAlgorithm)
# A gateway holding a request for want of a ready engine asks the router again this often
# (``RouteRequest.waited_s`` > 0); the router counts the request as held for a few of these
# intervals after each ask, so a request the gateway gave up on stops counting soon.
ENGINE_WAIT_POLL_S = 0.5


def _check_engine_ref(where: str, value: str) -> None:
    """An engine id or URL, as ``exclude`` holds them: non-empty, bounded, and parseable (the
    router normalises URLs with ``urlsplit``, which refuses e.g. ``http://[::1``)."""
    if not value:
        raise ValueError(f"{where} must be a non-empty string")
    if len(value) > MAX_URL_CHARS:
        raise ValueError(f"{where} must be at most {MAX_URL_CHARS} characters")
    try:
        urlsplit(value.strip())
    except ValueError:
        raise ValueError(f"{where} is neither an engine id nor a valid URL") from None


def _check_non_negative(where: str, value: float) -> None:
    if value < 0 or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{where} must be a finite number >= 0, got {value!r}")


ENGINE_ROLES = ("prefill", "decode", "both")
# An engine's KV transfer port as peers dial it: "host:port", host a DNS name, an IPv4 address
# or a bracketed IPv6 one (engines pull from it with the internal credential, so nothing that
# could smuggle a path, a scheme or whitespace into the address is accepted).
_TRANSFER_ADDRESS = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})")
MAX_ADDRESS_CHARS = 300
# What two engines must share for one's KV blocks to be the other's (the engine's digest of its
# model, weights and per-block KV shape): opaque to the router, compared for equality only.
_KV_LAYOUT = re.compile(r"[A-Za-z0-9._:-]+")
MAX_KV_LAYOUT_CHARS = 128


def _check_transfer_address(where: str, value: str | None) -> None:
    if value is None:
        return
    m = _TRANSFER_ADDRESS.fullmatch(value)
    if m is None or not 0 < int(m.group(1)) < 65536:
        raise ValueError(f"{where} must be host:port (port 1-65535), got {show(value)}")


def _check_kv_layout(where: str, value: str | None) -> None:
    if value is not None and _KV_LAYOUT.fullmatch(value) is None:
        raise ValueError(f"{where} must be letters, digits and . _ : -, got {show(value)}")


@dataclass(frozen=True, slots=True)
class EngineHeartbeat(Message):
    """An engine's liveness and load, published to Redis every few seconds with a TTL."""

    # stable per pod (e.g. the pod name); keys its block index in Redis
    engine_id: str = field(metadata=bounds(MAX_NAME_CHARS, min_len=1))
    # where the gateway reaches the engine, e.g. "http://10.0.3.7:8000"
    url: str = field(metadata=bounds(MAX_URL_CHARS, min_len=1))
    model: str = field(metadata=bounds(MAX_NAME_CHARS, min_len=1))  # namespaces the index
    block_size: int  # tokens per KV block (must equal the gateway's hashing block size)
    running: int  # requests decoding or prefilling now
    waiting: int  # requests queued, not yet admitted
    kv_usage: float  # fraction of KV blocks in use, 0..1
    free_blocks: int
    total_blocks: int
    timestamp: float  # engine wall clock, unix seconds (informational; TTLs use Redis time)
    max_model_len: int | None = None  # longest prompt + output the engine accepts, if known
    # Median wall time of the engine's recent steps (milliseconds; 0: not measured yet).
    # Routers use it to see that an engine is slower than its peers, not just busier.
    step_ms: float = 0.0
    # The engine's block-hash function (a ``HashAlgorithm`` value): the gateway hashes prompts
    # with the same one, or no prefix would ever match.
    hash_algorithm: str = HashAlgorithm.XXH3_128.value
    # LoRA adapters the engine serves (registered), with where each one is: the router
    # prefers an engine holding a request's adapter, and the gateway lists them.
    adapters: list[AdapterStatus] = field(metadata=bounds(MAX_ADAPTERS), default_factory=list)
    # Disaggregated serving: "prefill" (its KV connector only sends), "decode" (only
    # receives) or "both" (every engine without a P/D connector).
    kv_role: str = "both"
    # An engine with a KV transfer server (P/D, pulls from a peer): where peers dial it (None:
    # no transfer server). Any engine with a P/D connector: its KV layout digest. Engines pair
    # (a decode pulls a prefill's blocks, an engine pulls a peer's prefix) only when their
    # layouts are equal.
    kv_transfer_address: str | None = field(metadata=bounds(MAX_ADDRESS_CHARS, min_len=1),
                                            default=None)
    kv_layout: str | None = field(metadata=bounds(MAX_KV_LAYOUT_CHARS, min_len=1), default=None)
    # The port of the OpenAI front that serves this engine (its pod's sidecar, or serve's
    # front beside it), on the URL's host: what the endpoint picker answers Envoy with for
    # this engine (0: none advertised; the picker's --ext-proc-target-port, else the URL's).
    openai_port: int = 0

    def _check(self) -> None:
        if not 0 <= self.openai_port <= 65535:
            raise ValueError(f"EngineHeartbeat.openai_port must be in 0..65535, got "
                             f"{self.openai_port!r}")
        _check_transfer_address("EngineHeartbeat.kv_transfer_address", self.kv_transfer_address)
        _check_kv_layout("EngineHeartbeat.kv_layout", self.kv_layout)
        if self.kv_role not in ENGINE_ROLES:
            raise ValueError(f"EngineHeartbeat.kv_role must be one of {', '.join(ENGINE_ROLES)}"
                             f", got {self.kv_role!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"EngineHeartbeat.url must be an http(s) URL, got {self.url!r}")
        if self.block_size <= 0:
            raise ValueError(f"EngineHeartbeat.block_size must be > 0, got {self.block_size!r}")
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(
                f"EngineHeartbeat.hash_algorithm must be one of {', '.join(HASH_ALGORITHMS)}, "
                f"got {self.hash_algorithm!r}"
            )
        for name in ("running", "waiting", "free_blocks", "total_blocks", "timestamp", "step_ms"):
            _check_non_negative(f"EngineHeartbeat.{name}", getattr(self, name))
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(
                f"EngineHeartbeat.max_model_len must be > 0, got {self.max_model_len!r}"
            )
        if not (0.0 <= self.kv_usage <= 1.0):
            raise ValueError(f"EngineHeartbeat.kv_usage must be in [0, 1], got {self.kv_usage!r}")
        if self.free_blocks > self.total_blocks:
            raise ValueError(
                f"EngineHeartbeat.free_blocks ({self.free_blocks}) exceeds "
                f"total_blocks ({self.total_blocks})"
            )


@dataclass(frozen=True, slots=True)
class RouteRequest(Message):
    """Gateway -> router: which engine should serve a prompt with these block hashes."""

    model: str = field(metadata=bounds(MAX_NAME_CHARS, min_len=1))
    # the prompt's chain (full blocks only), 16 bytes each: at most one per token
    block_hashes: list[BlockHash] = field(metadata=bounds(MAX_PROMPT_TOKENS))
    prompt_len: int  # tokens in the prompt: the engine's prompt_token_ids, same bound
    # engine ids or URLs that already failed
    exclude: list[str] = field(metadata=bounds(MAX_EXCLUDE), default_factory=list)
    # the gateway's id of the client request (the engine sees it with a per-choice suffix)
    request_id: str | None = field(
        metadata=bounds(MAX_REQUEST_ID_CHARS, min_len=1), default=None
    )
    # Seconds the gateway has held this request so far for want of a ready engine of the
    # model (0: its first ask). The router counts arrivals on first asks and the requests
    # held at gateways in its demand metrics (``services.router.demand``).
    waited_s: float = 0.0
    # the LoRA adapter the request runs under (its block hashes are that adapter's chain)
    lora_name: str | None = field(metadata=bounds(MAX_NAME_CHARS, min_len=1), default=None)
    # P/D: the leg to route ("prefill" or "decode": engines of that role or "both");
    # None: any engine
    role: str | None = None
    # The decode leg: the KV layout of the prefill engine that holds the prompt's blocks (its
    # ``kv_transfer_params["kv_layout"]``); only decode engines of that layout can pull them.
    kv_layout: str | None = field(metadata=bounds(MAX_KV_LAYOUT_CHARS, min_len=1), default=None)

    def _check(self) -> None:
        _check_kv_layout("RouteRequest.kv_layout", self.kv_layout)
        if self.role is not None and self.role not in ("prefill", "decode"):
            raise ValueError(f"RouteRequest.role must be prefill or decode, got {self.role!r}")
        _check_non_negative("RouteRequest.prompt_len", self.prompt_len)
        _check_non_negative("RouteRequest.waited_s", self.waited_s)
        if self.prompt_len > MAX_PROMPT_TOKENS:
            raise ValueError(
                f"RouteRequest.prompt_len must be <= {MAX_PROMPT_TOKENS}, got {self.prompt_len}"
            )
        for i, h in enumerate(self.block_hashes):
            if len(h) != BLOCK_HASH_BYTES:
                raise ValueError(
                    f"RouteRequest.block_hashes[{i}] must be {BLOCK_HASH_BYTES} raw bytes"
                )
        if len(self.block_hashes) > self.prompt_len:  # full blocks only: >= 1 token each
            raise ValueError(
                f"RouteRequest.block_hashes has {len(self.block_hashes)} blocks, more than "
                f"prompt_len ({self.prompt_len}) tokens"
            )
        for i, entry in enumerate(self.exclude):
            _check_engine_ref(f"RouteRequest.exclude[{i}]", entry)


@dataclass(frozen=True, slots=True)
class KVPeer(Message):
    """Another engine of the model, with the same KV layout, that holds more of the prompt's
    leading blocks than the chosen one: the chosen engine may pull them instead of computing
    them (what the index says: the blocks may have gone since, then it computes them)."""

    engine_id: str = field(metadata=bounds(MAX_NAME_CHARS, min_len=1))
    address: str = field(metadata=bounds(MAX_ADDRESS_CHARS, min_len=1))  # its transfer port
    blocks: int  # the prompt's leading blocks it holds in its KV pool

    def _check(self) -> None:
        _check_transfer_address("KVPeer.address", self.address)
        if self.blocks <= 0:
            raise ValueError(f"KVPeer.blocks must be > 0, got {self.blocks!r}")


@dataclass(frozen=True, slots=True)
class RouteResponse(Message):
    """Router -> gateway: the chosen engine and why."""

    engine_id: str = field(metadata=bounds(MAX_NAME_CHARS, min_len=1))
    url: str = field(metadata=bounds(MAX_URL_CHARS, min_len=1))
    matched_blocks: int  # leading blocks of the prompt the index says the engine holds
    # e.g. "prefix-hit", "least-loaded", "hot-spot", "round-robin", "degraded"
    reason: str = field(metadata=bounds(MAX_NAME_CHARS))
    policy: str = field(metadata=bounds(MAX_NAME_CHARS))  # the policy that decided
    # Where the chosen engine can pull more of the prompt's prefix than it holds (None: no
    # such peer). Never on a P/D decode leg: the prefill engine's blocks are what it pulls.
    kv_peer: KVPeer | None = None
    # The chosen engine's KV layout digest (None: it has no P/D connector): a gateway that
    # picked a decode engine before its prefill leg keeps it only when the prefill engine's
    # blocks are of this layout.
    kv_layout: str | None = field(metadata=bounds(MAX_KV_LAYOUT_CHARS, min_len=1), default=None)

    def _check(self) -> None:
        _check_kv_layout("RouteResponse.kv_layout", self.kv_layout)
        _check_non_negative("RouteResponse.matched_blocks", self.matched_blocks)
        if self.kv_peer is not None and self.kv_peer.blocks <= self.matched_blocks:
            raise ValueError("RouteResponse.kv_peer must hold more blocks than matched_blocks")
