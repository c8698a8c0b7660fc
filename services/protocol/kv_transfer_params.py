"""``kv_transfer_params`` (vLLM's name): the object a client, the gateway and the engines pass
along for the KV connector (P/D: ``do_remote_decode``, then where to pull the prompt's KV).

It enters from outside (the OpenAI API, the engine API), so it is checked where it enters: a
flat object of at most ``MAX_KEYS`` string keys whose values are scalars (strings up to
``MAX_STRING_CHARS``), nothing nested but ``pull_prefix_from`` (one flat object of scalars).
What the keys mean is the connector's business; a connector treats the values as untrusted too.

``pull_prefix_from`` (``{"engine_id", "address", "blocks"}``: a peer engine that holds more of
the prompt's prefix) is Pagoda's, written by the gateway from the router's answer: a public
client may not send it (``check_client``), or it could point an engine at any address.
"""

from __future__ import annotations

from typing import Any

from services.protocol.wire import BadRequest

FIELD = "kv_transfer_params"
PEER_PULL = "pull_prefix_from"  # the gateway's, never a client's
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
        if key == PEER_PULL and isinstance(value, dict):
            check_flat(value, f"{where}.{key}", 8)
        elif not _scalar(value):
            raise BadRequest(f"{where}.{key} must be a string (at most {MAX_STRING_CHARS} "
                             "characters), a number, a boolean or null", FIELD)
    return {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}


def check_client(raw: Any) -> dict[str, Any] | None:
    """``check`` for a public client's params: the keys the gateway writes are refused."""
    params = check(raw)
    if params is not None and PEER_PULL in params:
        raise BadRequest(f"{FIELD}.{PEER_PULL} is set by the gateway, not by a client", FIELD)
    return params


def check_flat(raw: dict, where: str, max_keys: int) -> None:
    if len(raw) > max_keys:
        raise BadRequest(f"{where} has more than {max_keys} keys", FIELD)
    for key, value in raw.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS or not _scalar(value):
            raise BadRequest(f"{where} must be a flat object of scalars", FIELD)


def _scalar(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= MAX_STRING_CHARS
    if isinstance(value, float):
        return value == value and abs(value) != float("inf")  # JSON has no NaN or infinity
    if isinstance(value, int) and not isinstance(value, bool):
        return -(2**63) <= value < 2**64  # what msgpack carries
    return value is None or isinstance(value, (bool, int))
