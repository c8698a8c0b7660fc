"""The one validator of the internal wire messages (gateway -> router, gateway -> engine, engine
heartbeats), and the limits every service applies to them.

Every message is a frozen dataclass subclassing ``Message`` whose type hints are its schema.
Decoding (``from_dict``, ``from_msgpack``) checks, in this order: the body is a map; each
field's size against its ``bounds``, before any item is looked at (a huge list costs nothing);
each field against its type hint (``str``, ``int``, ``float``, ``bool``, ``bytes``,
``list[X]``, ``X | None``, a str ``Enum``, a nested message) or its ``codec``; then the
message's ``_check`` for its values (ranges, relations between fields). Anything wrong raises
``BadRequest`` (a ValueError, answered as a 400) whose ``param`` names the top-level field at
fault (None: the body as a whole; a sampling parameter for the engine's ``params``) and whose
text names it too; a peer can never crash a service with a bad frame.

Constructing a message in code does not validate: the code that builds it is trusted (types and
tests), and the receiver validates when it decodes: input is checked once, where it enters.

To add a message: subclass ``Message`` with ``@dataclass(frozen=True, slots=True)``, give its
fields hints from the list above, bound every str and list field
(``name: str = field(metadata=bounds(MAX_NAME_CHARS, min_len=1))``), and put value checks in
``_check``, their messages starting with ``Message.field``.

Compatibility rules, so that replicas of different versions can talk during a rolling upgrade:
unknown keys are ignored, and a field added later must have a default.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable
from enum import Enum
from typing import Any, Self, Union

import msgpack

from services.protocol.block_hash import BlockHash

# -- limits, shared by every service that sends or receives these messages -------------------
# A request id is made by the gateway ("chatcmpl-" + 32 hex digits, plus "-<choice>-r<retry>"
# on the engine side: under 60 characters); 256 leaves room for a client's X-Request-Id
# without letting a peer make every log line and span attribute megabytes long.
MAX_REQUEST_ID_CHARS = 256
# Model names (a served name or a path), engine ids (pod names, at most 253 in Kubernetes).
MAX_NAME_CHARS = 512
MAX_URL_CHARS = 2048
# Tokens in one prompt, on every hop (the router's prompt_len and the engine's token list are
# the same prompt). Above every open model's context window (the longest, Llama 4 Scout's, is
# 10M), so the wire never refuses what an engine would accept: the engine's max_model_len is
# the limit that matters, this only bounds what a peer can make a service walk through.
MAX_PROMPT_TOKENS = 2**24
MAX_EXCLUDE = 256  # engines a request may rule out (the gateway's retries)
MAX_CACHE_SALT_CHARS = 4096  # the salt keys a hasher the engine keeps per salt
BLOCK_HASH_BYTES = 16
# vLLM's request priority is any int; a 32-bit one is plenty and keeps it a small msgpack int.
MAX_PRIORITY = 2**31 - 1  # |priority|
_MAX_SHOWN_CHARS = 80  # of a bad value echoed back in an error message


class BadRequest(ValueError):
    """Input a service refuses (a 400). ``param`` names the field at fault, None when the body
    as a whole is wrong."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


Decode = Callable[[Any, str], Any]  # (wire value, "Message.field") -> the field's value
Encode = Callable[[Any], Any]


def bounds(max_len: int, min_len: int = 0) -> dict[str, Any]:
    """Field metadata: a size bound (characters of a str, items of a list), checked before
    the contents: ``name: str = field(metadata=bounds(512, min_len=1))``."""
    return {"min_len": min_len, "max_len": max_len}


def codec(decode: Decode, encode: Encode) -> dict[str, Any]:
    """Field metadata: the field's own wire form, for a type the validator does not know
    (``decode`` raises ValueError or BadRequest)."""
    return {"decode": decode, "encode": encode}


class Message:
    """Base of every wire message: dict and msgpack conversion with validation."""

    __slots__ = ()

    def _check(self) -> None:
        """Value checks after decoding (ranges, relations between fields); raise ValueError
        starting with ``Message.field``."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, encode in _encoders_of(type(self)):
            value = getattr(self, name)
            out[name] = value if encode is None else encode(value)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Self:
        name = cls.__name__
        if not isinstance(data, dict):
            raise BadRequest(f"{name}: expected a map, got {kind(data)}")
        hints = _hints_of(cls)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if not f.init:
                continue
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise BadRequest(f"{name}: missing field {f.name!r}", f.name)
                continue
            kwargs[f.name] = _decode_field(f, hints[f.name], data[f.name], f"{name}.{f.name}")
        message = cls(**kwargs)
        try:
            message._check()
        except BadRequest:
            raise
        except ValueError as exc:  # its text starts with "Name.field"
            raise BadRequest(str(exc), _field_named(cls, str(exc))) from None
        return message

    def to_msgpack(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, payload: bytes) -> Self:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise BadRequest(f"{cls.__name__}: expected bytes, got {kind(payload)}")
        try:
            data = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
            raise BadRequest(f"{cls.__name__}: body is not valid msgpack ({first_line(exc)})") \
                from None
        return cls.from_dict(data)


def _decode_field(f: dataclasses.Field, hint: Any, value: Any, where: str) -> Any:
    meta = f.metadata
    try:
        _check_size(meta, hint, value, where)
        decode = meta.get("decode")
        return decode(value, where) if decode is not None else _coerce(hint, value, where)
    except BadRequest as exc:
        if exc.param is None:
            exc.param = f.name
        raise
    except ValueError as exc:
        raise BadRequest(str(exc), f.name) from None


def _check_size(meta: typing.Mapping[str, Any], hint: Any, value: Any, where: str) -> None:
    lo, hi = meta.get("min_len", 0), meta.get("max_len")
    if hi is None and not lo:
        return
    base = _base_type(hint)
    if base is None or not isinstance(value, base):
        return  # the type check says what is wrong
    if lo <= len(value) and (hi is None or len(value) <= hi):
        return
    what = {str: "string", list: "list", bytes: "byte string"}[base]
    unit = "characters" if base is str else "items"
    need = "a non-empty " if lo else "a "
    bound = f" of at most {hi} {unit}" if hi is not None else ""
    got = f"{len(value)} {unit}" if value else "empty"
    raise ValueError(f"{where} must be {need}{what}{bound}, got {got}")


def _base_type(hint: Any) -> type | None:
    if typing.get_origin(hint) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = inner[0] if len(inner) == 1 else None
    if typing.get_origin(hint) is list:
        return list
    return hint if hint in (str, bytes) else None


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
_ENCODER_CACHE: dict[type, list[tuple[str, Encode | None]]] = {}


def _encoders_of(cls: type) -> list[tuple[str, Encode | None]]:
    """Each field with what turns it into msgpack-ready values: its codec's encode, ``_plain``
    where its type holds messages or enums, or None: the value goes as it is (a prompt's token
    list is never copied)."""
    encoders = _ENCODER_CACHE.get(cls)
    if encoders is None:
        hints = _hints_of(cls)
        encoders = [
            (f.name, f.metadata.get("encode") or (_plain if _needs_plain(hints[f.name]) else None))
            for f in dataclasses.fields(cls)
        ]
        _ENCODER_CACHE[cls] = encoders
    return encoders


def _needs_plain(hint: Any) -> bool:
    if isinstance(hint, type):
        return issubclass(hint, (Message, Enum))
    return any(_needs_plain(a) for a in typing.get_args(hint))


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
        return _coerce_list(typing.get_args(hint)[0], value, where)
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
    if _is_a(hint, value):
        return float(value) if hint is float else bytes(value) if hint is bytes else value
    if hint not in (bool, int, float, str, bytes):
        raise ValueError(f"{where}: unsupported field type {hint!r}")
    raise ValueError(f"{where}: expected {hint.__name__}, got {kind(value)}")


def _coerce_list(item: Any, value: Any, where: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if item is int and set(map(type, value)) <= {int}:  # token ids: one pass in C
            return list(value)
        return [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ValueError(f"{where}: expected a list, got {kind(value)}")


def _is_a(hint: Any, value: Any) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is bytes:
        return isinstance(value, (bytes, bytearray))
    return False


# -- helpers for messages' value checks and error texts --------------------------------------


def kind(value: Any) -> str:
    return "nil" if value is None else type(value).__name__


def show(value: Any) -> str:
    """A bad value for an error message: its repr, cut short (the body may be megabytes)."""
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN_CHARS else text[: _MAX_SHOWN_CHARS - 3] + "..."


def first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:300]
