"""The wire contracts of multi-LoRA serving, shared by gateway, router and engine.

* Engine (internal, JSON): ``POST /internal/lora/load`` with ``LoadAdapter`` reads, validates
  and registers an adapter (200 with its ``AdapterStatus``; the same name and path again: 200,
  nothing changes; 400 naming the field or module; 409 when the name holds another path);
  ``POST /internal/lora/unload`` with ``UnloadAdapter`` (200, or 404 for an unknown name);
  ``GET /internal/lora/adapters``: ``{"adapters": [AdapterStatus]}``, what its heartbeat
  reports (an OpenAI front pinned to the engine, with no router, learns its adapters there).
* Router (JSON): ``GET /adapters?model=M`` lists the runtime adapters registered for a base
  model (``{"adapters": [{"lora_name", "lora_path"}], "generation": n}``); ``POST /adapters``
  (``RegisterAdapter``) and ``DELETE /adapters`` (``UnregisterAdapter``) change that registry,
  which lives in Redis (``redis_schema.RedisKeys.lora_adapters``) so that an engine that starts
  later, or restarts, loads what is registered when it comes up.
* Heartbeats carry each engine's adapters (``AdapterStatus``): name, the version of its
  weights (the block-hash chain's ``AdapterKey``), where it is (``residency``: a device slot,
  host memory, or only registered) and its path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Self

from services.protocol.wire import (
    MAX_NAME_CHARS,
    BadRequest,
    Message,
    bounds,
    first_line,
)

LOAD_PATH = "/internal/lora/load"
UNLOAD_PATH = "/internal/lora/unload"
ADAPTERS_PATH = "/internal/lora/adapters"
REGISTRY_PATH = "/adapters"

MAX_ADAPTERS = 256  # adapters one heartbeat lists
MAX_PATH_CHARS = 4096
MAX_VERSION_CHARS = 64

# Where an engine holds an adapter (higher is readier to serve it).
ON_DISK, IN_HOST, IN_SLOT = 0, 1, 2
RESIDENCIES = (ON_DISK, IN_HOST, IN_SLOT)


class JsonMessage(Message):
    """A message whose body is JSON (the LoRA endpoints are called by operators' tools too)."""

    __slots__ = ()

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict()).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Self:
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise BadRequest(f"{cls.__name__}: body is not valid JSON: {first_line(exc)}") \
                from None
        return cls.from_dict(obj)


@dataclass(frozen=True, slots=True)
class LoadAdapter(JsonMessage):
    lora_name: str = field(metadata=bounds(MAX_NAME_CHARS, min_len=1))
    lora_path: str = field(metadata=bounds(MAX_PATH_CHARS, min_len=1))


@dataclass(frozen=True, slots=True)
class UnloadAdapter(JsonMessage):
    lora_name: str = field(metadata=bounds(MAX_NAME_CHARS, min_len=1))


@dataclass(frozen=True, slots=True)
class RegisterAdapter(JsonMessage):
    model: str = field(metadata=bounds(MAX_NAME_CHARS, min_len=1))
    lora_name: str = field(metadata=bounds(MAX_NAME_CHARS, min_len=1))
    lora_path: str = field(metadata=bounds(MAX_PATH_CHARS, min_len=1))


@dataclass(frozen=True, slots=True)
class UnregisterAdapter(JsonMessage):
    model: str = field(metadata=bounds(MAX_NAME_CHARS, min_len=1))
    lora_name: str = field(metadata=bounds(MAX_NAME_CHARS, min_len=1))


@dataclass(frozen=True, slots=True)
class AdapterStatus(Message):
    """One adapter of an engine, as its heartbeat reports it."""

    name: str = field(metadata=bounds(MAX_NAME_CHARS, min_len=1))
    version: str = field(metadata=bounds(MAX_VERSION_CHARS, min_len=1))
    residency: int
    path: str = field(metadata=bounds(MAX_PATH_CHARS), default="")

    def _check(self) -> None:
        if self.residency not in RESIDENCIES:
            raise ValueError(f"AdapterStatus.residency must be one of {RESIDENCIES}, got "
                             f"{self.residency!r}")
