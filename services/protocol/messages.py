"""Msgpack wire messages shared by gateway, router and engine.

Every message is a frozen dataclass whose type hints are its schema. ``from_dict`` checks each
field against its hint (``str``, ``int``, ``float``, ``bool``, ``bytes``, ``list[X]``,
``X | None``, a str ``Enum`` or a nested message) and then ``__post_init__`` checks the values
(ranges, lengths). Anything wrong raises ``ValueError`` naming the message and the field; a
peer can never crash a service with a bad frame.

Compatibility rules, so that replicas of different versions can talk during a rolling upgrade:
unknown keys are ignored, and a field added later must have a default.

To add a message: subclass ``Message`` with ``@dataclass(frozen=True, slots=True)``, give the
fields type hints from the list above, and put value checks in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Self, Union

import msgpack

from services.protocol.block_hash import BlockHash

BLOCK_HASH_BYTES = 16


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
            raise ValueError(f"{name}: expected a map, got {type(data).__name__}")  # noqa: TRY004
        hints = _hints_of(cls)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if not f.init:
                continue
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ValueError(f"{name}: missing field {f.name!r}")
                continue
            kwargs[f.name] = _coerce(hints[f.name], data[f.name], f"{name}.{f.name}")
        try:
            return cls(**kwargs)
        except TypeError as exc:  # defensive: a hint the coercer does not cover
            raise ValueError(f"{name}: {exc}") from None

    def to_msgpack(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, payload: bytes) -> Self:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise ValueError(  # noqa: TRY004 - bad input from a peer is a ValueError here
                f"{cls.__name__}: expected bytes, got {type(payload).__name__}"
            )
        try:
            data = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise ValueError(f"{cls.__name__}: malformed msgpack ({exc})") from None
        return cls.from_dict(data)


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

    def __post_init__(self) -> None:
        _check_non_empty("EngineHeartbeat.engine_id", self.engine_id)
        _check_non_empty("EngineHeartbeat.model", self.model)
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"EngineHeartbeat.url must be an http(s) URL, got {self.url!r}")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"EngineHeartbeat.block_size must be > 0, got {self.block_size!r}")
        for name in ("running", "waiting", "free_blocks", "total_blocks", "timestamp"):
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
        _check_non_empty("RouteRequest.model", self.model)
        _check_non_negative("RouteRequest.prompt_len", self.prompt_len)
        for i, h in enumerate(self.block_hashes):
            if not isinstance(h, bytes) or len(h) != BLOCK_HASH_BYTES:
                raise ValueError(
                    f"RouteRequest.block_hashes[{i}] must be {BLOCK_HASH_BYTES} raw bytes"
                )


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
