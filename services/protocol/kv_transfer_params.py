"""``kv_transfer_params`` (vLLM's name): the object a client, the gateway and the engines pass
along for the KV connector (P/D: ``do_remote_decode``, then where to pull the prompt's KV).

It enters from outside (the OpenAI API, the engine API), so it is checked where it enters: a
flat object of at most ``MAX_KEYS`` string keys whose values are scalars (strings up to
``MAX_STRING_CHARS``), nothing nested. What the keys mean is the connector's business; a
connector treats the values as untrusted too.
"""

from __future__ import annotations

from typing import Any

from services.protocol.wire import BadRequest

FIELD = "kv_transfer_params"
MAX_KEYS = 32
MAX_KEY_CHARS = 64
MAX_STRING_CHARS = 512


def check(raw: Any, where: str = FIELD) -> dict[str, Any] | None:
    """The params as a new dict, None for None; ``BadRequest`` naming the field otherwise."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be an object", FIELD)
    if len(raw) > MAX_KEYS:
        raise BadRequest(f"{where} has more than {MAX_KEYS} keys", FIELD)
    for key, value in raw.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
            raise BadRequest(f"{where} keys must be strings of 1-{MAX_KEY_CHARS} characters",
                             FIELD)
        if not _scalar(value):
            raise BadRequest(f"{where}.{key} must be a string (at most {MAX_STRING_CHARS} "
                             "characters), a number, a boolean or null", FIELD)
    return dict(raw)


def _scalar(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= MAX_STRING_CHARS
    if isinstance(value, float):
        return value == value and abs(value) != float("inf")  # JSON has no NaN or infinity
    if isinstance(value, int) and not isinstance(value, bool):
        return -(2**63) <= value < 2**64  # what msgpack carries
    return value is None or isinstance(value, (bool, int))
