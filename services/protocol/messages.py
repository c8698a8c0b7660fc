"""Msgpack wire messages shared by gateway, router and engine.

Every message is a frozen dataclass whose type hints are its schema. ``from_dict`` checks each
field against its hint (``str``, ``int``, ``float``, ``bool``, ``bytes``, ``list[X]``,
``X | None``, a str ``Enum`` or a nested message) and then ``__post_init__`` checks the values
(ranges, lengths). Anything wrong raises ``MessageError`` (a ValueError) naming the message and
the field, which its ``field`` also holds; a peer can never crash a service with a bad frame.

Compatibility rules, so that replicas of different versions can talk during a rolling upgrade:
unknown keys are ignored, and a field added later must have a default.

To add a message: subclass ``Message`` with ``@dataclass(frozen=True, slots=True)``, give the
fields type hints from the list above, and put value checks in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Self, Union
from urllib.parse import urlsplit

import msgpack

from services.protocol.block_hash import BlockHash

BLOCK_HASH_BYTES = 16
MAX_NAME_CHARS = 512  # model names, engine ids, request ids
MAX_URL_CHARS = 2048
MAX_PROMPT_LEN = 2**31 - 1
MAX_EXCLUDE = 256  # engines a request may rule out (the gateway's retries)


class MessageError(ValueError):
    """A malformed message. ``field`` is the top-level field at fault (None: the whole
    message); the text names the message and the field, e.g. ``RouteRequest.prompt_len``."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class Message:
    """Base of every wire message: dict and msgpack conversion with validation."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            out[f.name] = _plain(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Self:
        name = cls.__name__
        if not isinstance(data, dict):
            raise MessageError(f"{name}: expected a map, got {type(data).__name__}")
        hints = _hints_of(cls)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if not f.init:
                continue
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise MessageError(f"{name}: missing field {f.name!r}", f.name)
                continue
            try:
                kwargs[f.name] = _coerce(hints[f.name], data[f.name], f"{name}.{f.name}")
            except ValueError as exc:
                raise MessageError(str(exc), f.name) from None
        try:
            return cls(**kwargs)
        except ValueError as exc:  # __post_init__: its messages start with "Name.field"
            raise MessageError(str(exc), _field_named(cls, str(exc))) from None
        except TypeError as exc:  # defensive: a hint the coercer does not cover
            raise MessageError(f"{name}: {exc}") from None

    def to_msgpack(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, payload: bytes) -> Self:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise MessageError(f"{cls.__name__}: expected bytes, got {type(payload).__name__}")
        try:
            data = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
            detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            raise MessageError(f"{cls.__name__}: malformed msgpack ({detail})") from None
        return cls.from_dict(data)


def _field_named(cls: type, message: str) -> str | None:
    m = re.match(rf"{cls.__name__}\.(\w+)", message)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return m.group(1) if m and m.group(1) in names else None


def _plain(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_dict()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


_HINT_CACHE: dict[type, dict[str, Any]] = {}


def _hints_of(cls: type) -> dict[str, Any]:
    hints = _HINT_CACHE.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        _HINT_CACHE[cls] = hints
    return hints


def _coerce(hint: Any, value: Any, where: str) -> Any:
    """Checks ``value`` against a type hint; returns it (lists copied, enums and nested
    messages built). Raises ValueError naming ``where``."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None:
            if type(None) in args:
                return None
            raise ValueError(f"{where}: must not be null")
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise ValueError(f"{where}: unsupported union type {hint!r}")
        return _coerce(inner[0], value, where)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
        return [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if hint is BlockHash:
        hint = bytes
    if isinstance(hint, type) and issubclass(hint, Message):
        return hint.from_dict(value)
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in hint)
            raise ValueError(f"{where}: {value!r} is not one of {allowed}") from None
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif hint is bytes:
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
    else:
        raise ValueError(f"{where}: unsupported field type {hint!r}")
    raise ValueError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")


def _check_non_empty(where: str, value: str) -> None:
    if not value:
        raise ValueError(f"{where} must be a non-empty string")


def _check_name(where: str, value: str) -> None:
    _check_non_empty(where, value)
    if len(value) > MAX_NAME_CHARS:
        raise ValueError(f"{where} must be at most {MAX_NAME_CHARS} characters")


def _check_engine_ref(where: str, value: str) -> None:
    """An engine id or URL, as ``exclude`` holds them: non-empty, bounded, and parseable (the
    router normalises URLs with ``urlsplit``, which refuses e.g. ``http://[::1``)."""
    _check_non_empty(where, value)
    if len(value) > MAX_URL_CHARS:
        raise ValueError(f"{where} must be at most {MAX_URL_CHARS} characters")
    try:
        urlsplit(value.strip())
    except ValueError:
        raise ValueError(f"{where} is neither an engine id nor a valid URL") from None


def _check_non_negative(where: str, value: float) -> None:
    if value < 0 or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{where} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class EngineHeartbeat(Message):
    """An engine's liveness and load, published to Redis every few seconds with a TTL."""

    engine_id: str  # stable per pod (e.g. the pod name); keys its block index in Redis
    url: str  # where the gateway reaches the engine, e.g. "http://10.0.3.7:8000"
    model: str  # served model name; namespaces the block index
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

    def __post_init__(self) -> None:
        _check_non_empty("EngineHeartbeat.engine_id", self.engine_id)
        _check_non_empty("EngineHeartbeat.model", self.model)
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"EngineHeartbeat.url must be an http(s) URL, got {self.url!r}")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"EngineHeartbeat.block_size must be > 0, got {self.block_size!r}")
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

    model: str
    block_hashes: list[BlockHash]  # the prompt's chain (full blocks only), 16 bytes each
    prompt_len: int  # tokens in the prompt
    exclude: list[str] = field(default_factory=list)  # engine ids or URLs that already failed
    request_id: str | None = None

    def __post_init__(self) -> None:
        _check_name("RouteRequest.model", self.model)
        _check_non_negative("RouteRequest.prompt_len", self.prompt_len)
        if self.prompt_len > MAX_PROMPT_LEN:
            raise ValueError(
                f"RouteRequest.prompt_len must be <= {MAX_PROMPT_LEN}, got {self.prompt_len}"
            )
        for i, h in enumerate(self.block_hashes):
            if not isinstance(h, bytes) or len(h) != BLOCK_HASH_BYTES:
                raise ValueError(
                    f"RouteRequest.block_hashes[{i}] must be {BLOCK_HASH_BYTES} raw bytes"
                )
        if len(self.block_hashes) > self.prompt_len:  # full blocks only: >= 1 token each
            raise ValueError(
                f"RouteRequest.block_hashes has {len(self.block_hashes)} blocks, more than "
                f"prompt_len ({self.prompt_len}) tokens"
            )
        if len(self.exclude) > MAX_EXCLUDE:
            raise ValueError(
                f"RouteRequest.exclude must have at most {MAX_EXCLUDE} entries, "
                f"got {len(self.exclude)}"
            )
        for i, entry in enumerate(self.exclude):
            _check_engine_ref(f"RouteRequest.exclude[{i}]", entry)
        if self.request_id is not None and len(self.request_id) > MAX_NAME_CHARS:
            raise ValueError(f"RouteRequest.request_id must be at most {MAX_NAME_CHARS} characters")


@dataclass(frozen=True, slots=True)
class RouteResponse(Message):
    """Router -> gateway: the chosen engine and why."""

    engine_id: str
    url: str
    matched_blocks: int  # leading blocks of the prompt the index says the engine holds
    reason: str  # e.g. "prefix-hit", "least-loaded", "hot-spot", "round-robin", "degraded"
    policy: str  # the policy that decided

    def __post_init__(self) -> None:
        _check_non_empty("RouteResponse.engine_id", self.engine_id)
        _check_non_empty("RouteResponse.url", self.url)
        _check_non_negative("RouteResponse.matched_blocks", self.matched_blocks)
