"""The engine's internal API (gateway -> engine), as msgpack.

``POST /internal/generate`` with a msgpack ``GenerateRequest`` body answers with a chunked
stream of msgpack ``StreamFrame`` maps, one after another (decode with ``FrameDecoder``):

    {"type": "tokens", "token_ids": [...], "logprobs": [...] | None,
     "cached_tokens": n (first frame only)}                           (zero or more)
    {"type": "finished", "finish_reason": "stop"|"length"|"abort", "stop_reason": ...,
     "usage": {"prompt_tokens", "completion_tokens", "cached_tokens"}}  (last frame)
    {"type": "error", "message": ...}                                   (last frame, on failure)

A request the engine refuses (bad params, prompt too long) gets a 400 with a JSON OpenAI
error before any frame. Closing the stream aborts the request and frees its KV blocks.
``POST /internal/abort`` with ``{"request_id": ...}`` aborts explicitly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import msgpack

from services.engine.sampling_params import SamplingParams

GENERATE_PATH = "/internal/generate"
ABORT_PATH = "/internal/abort"
CONTENT_TYPE = "application/msgpack"
MAX_PROMPT_TOKENS = 1_000_000

_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None

    def to_msgpack(self) -> bytes:
        return msgpack.packb(
            {
                "request_id": self.request_id,
                "prompt_token_ids": self.prompt_token_ids,
                "params": asdict(self.params),
                "cache_salt": self.cache_salt,
            }
        )

    @classmethod
    def from_msgpack(cls, data: bytes) -> GenerateRequest:
        """Decodes and validates; any malformed input is a ValueError (a 400), never a crash."""
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            raise ValueError(f"body is not valid msgpack: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError("body must be a msgpack map")
        rid = obj.get("request_id")
        if not isinstance(rid, str) or not rid or len(rid) > 256:
            raise ValueError("request_id must be a non-empty string of at most 256 characters")
        ids = obj.get("prompt_token_ids")
        if (
            not isinstance(ids, list)
            or not ids
            or len(ids) > MAX_PROMPT_TOKENS
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        ):
            raise ValueError("prompt_token_ids must be a non-empty list of non-negative integers")
        raw = obj.get("params") or {}
        if not isinstance(raw, dict):
            raise ValueError("params must be a map")
        unknown = set(raw) - _PARAM_FIELDS
        if unknown:
            raise ValueError(f"unknown sampling params: {sorted(unknown)}")
        try:
            params = SamplingParams(**raw)
        except TypeError as exc:
            raise ValueError(f"params: {exc}") from None
        salt = obj.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError("cache_salt must be a string")
        return cls(rid, ids, params, salt)


def tokens_frame(
    token_ids: list[int], logprobs: list[Any] | None = None, cached_tokens: int | None = None
) -> bytes:
    """``cached_tokens`` rides on the first frame, so a client that closes the stream early
    (a stop string) still knows how much of the prompt the prefix cache served."""
    frame: dict[str, Any] = {"type": "tokens", "token_ids": token_ids, "logprobs": logprobs}
    if cached_tokens is not None:
        frame["cached_tokens"] = cached_tokens
    return msgpack.packb(frame)


def finished_frame(
    finish_reason: str | None,
    stop_reason: int | str | None,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
) -> bytes:
    return msgpack.packb(
        {
            "type": "finished",
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "cached_tokens": cached_tokens,
            },
        }
    )


def error_frame(message: str) -> bytes:
    return msgpack.packb({"type": "error", "message": message})


class FrameDecoder:
    """Feeds stream chunks; yields complete frames (dicts) as they become available."""

    def __init__(self) -> None:
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=64 * 1024 * 1024)

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        self._unpacker.feed(chunk)
        return [frame for frame in self._unpacker]
