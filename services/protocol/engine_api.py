"""The engine's internal API (gateway -> engine), as msgpack.

``POST /internal/generate`` with a msgpack ``GenerateRequest`` body answers with a chunked
stream of msgpack frames, one after another: ``TokensFrame``, ``FinishedFrame`` and
``ErrorFrame`` encode themselves, and ``FrameDecoder`` turns bytes back into them. On the wire:

    {"type": "tokens", "token_ids": [...], "logprobs": [...] | None,
     "cached_tokens": n (first frame only)}                           (zero or more)
    {"type": "finished", "finish_reason": "stop"|"length"|"abort", "stop_reason": ...,
     "usage": {"prompt_tokens", "completion_tokens", "cached_tokens"},
     "kv_transfer_params": {...} (only when the KV connector returned some)}  (last frame)
    {"type": "error", "message": ...}                                   (last frame, on failure)
    {"type": "kv_transfer", "kv_transfer_params": {...}}   (a streamed P/D prefill, before any
                                                            token: where its KV can be pulled)

A request the engine refuses (malformed body, bad params, prompt too long) gets a 400 with a
JSON OpenAI error before any frame, its ``param`` naming the field at fault. Closing the stream
aborts the request and frees its KV blocks. ``POST /internal/abort`` with the JSON body
``{"request_id": ...}`` aborts explicitly.

The request messages are validated by the one validator of every internal message
(``services.protocol.wire``), under the limits the router applies to the same prompt and id;
``BadRequest`` (the refusal, a 400 naming its field) is the engine's own too, for the limits
only it knows (vocabulary, context, grammars).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import msgpack

from services.protocol import kv_transfer_params as kv_params
from services.protocol.sampling_params import SamplingParams
from services.protocol.wire import (
    MAX_CACHE_SALT_CHARS,
    MAX_NAME_CHARS,
    MAX_PRIORITY,
    MAX_PROMPT_TOKENS,
    MAX_REQUEST_ID_CHARS,
    BadRequest,
    Message,
    bounds,
    codec,
    first_line,
    kind,
    show,
)

GENERATE_PATH = "/internal/generate"
ABORT_PATH = "/internal/abort"
CONTENT_TYPE = "application/msgpack"

_PARAM_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def _params_from_wire(raw: Any, where: str) -> SamplingParams:
    """``params``: a map of SamplingParams fields (nil: all defaults). Its errors name the
    parameter at fault (``temperature``), as the gateway's 400s do."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be a map, got {kind(raw)}", "params")
    unknown = sorted(show(k) for k in raw if k not in _PARAM_FIELDS)
    if unknown:
        raise BadRequest(f"{where} has unknown fields: {', '.join(unknown[:8])}", "params")
    try:
        params = SamplingParams(**raw)
    except (ValueError, TypeError, OverflowError) as exc:
        # Every SamplingParams error starts with the field's name.
        m = re.match(r"[a-z_]+", str(exc))
        name = m.group(0) if m and m.group(0) in _PARAM_FIELDS else "params"
        raise BadRequest(first_line(exc), name) from None
    if params.n != 1:
        raise BadRequest(
            f"n must be 1 on the engine API (the gateway fans out n), got {params.n}", "n"
        )
    return params


def _params_to_wire(params: SamplingParams) -> dict[str, Any]:
    raw = asdict(params)
    if params.logit_bias is not None:  # msgpack maps here have string keys only
        raw["logit_bias"] = [[t, b] for t, b in params.logit_bias.items()]
    return raw


@dataclass(frozen=True, slots=True)
class GenerateRequest(Message):
    """``POST /internal/generate`` body. Ids past the vocabulary and prompts past the context
    are the engine's to refuse (``LLMEngine.check_request``): only it knows the model."""

    request_id: str = field(metadata=bounds(MAX_REQUEST_ID_CHARS, min_len=1))
    prompt_token_ids: list[int] = field(metadata=bounds(MAX_PROMPT_TOKENS, min_len=1))
    params: SamplingParams = field(
        metadata=codec(_params_from_wire, _params_to_wire), default_factory=SamplingParams
    )
    cache_salt: str | None = field(metadata=bounds(MAX_CACHE_SALT_CHARS), default=None)
    # a LoRA adapter the engine has loaded (None: the base model)
    lora_name: str | None = field(metadata=bounds(MAX_NAME_CHARS, min_len=1), default=None)
    # vLLM's, for the engine's KV connector (P/D); checked flat and bounded
    kv_transfer_params: dict[str, Any] | None = field(
        metadata=codec(kv_params.check, lambda v: v), default=None)
    # vLLM's: lower first under --scheduling-policy priority (non-zero without it: a 400)
    priority: int = 0

    @property
    def adapter_name(self) -> str | None:
        """The model's adapter the request runs under, by the engine's own name for it
        (``lora_name`` is vLLM's, on the wire)."""
        return self.lora_name

    def _check(self) -> None:
        if abs(self.priority) > MAX_PRIORITY:
            raise ValueError(f"GenerateRequest.priority must be in [-{MAX_PRIORITY}, "
                             f"{MAX_PRIORITY}], got {self.priority}")
        if min(self.prompt_token_ids) < 0:
            i = next(i for i, t in enumerate(self.prompt_token_ids) if t < 0)
            raise ValueError(
                f"GenerateRequest.prompt_token_ids[{i}] must be >= 0, "
                f"got {self.prompt_token_ids[i]}"
            )


@dataclass(frozen=True, slots=True)
class AbortRequest(Message):
    """``POST /internal/abort`` body, JSON: ``{"request_id": str}``."""

    request_id: str = field(metadata=bounds(MAX_REQUEST_ID_CHARS, min_len=1))

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict()).encode()

    @classmethod
    def from_json(cls, data: bytes) -> AbortRequest:
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise BadRequest(f"AbortRequest: body is not valid JSON: {first_line(exc)}") \
                from None
        return cls.from_dict(obj)


# -- the stream ------------------------------------------------------------------------------


class MalformedFrame(ValueError):
    """A stream frame that is not one of the three below (the engine and the gateway disagree
    on the protocol, or the bytes were corrupted)."""


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The chosen token's logprob under the model's raw distribution, and the N most likely."""

    token_id: int
    logprob: float
    rank: int  # tokens at least as likely, itself included (as vLLM): 1 = the most likely
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first; [] when N = 0

    def to_wire(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "logprob": self.logprob, "rank": self.rank,
                "top": [[t, v] for t, v in self.top]}

    @classmethod
    def from_wire(cls, raw: Any) -> TokenLogprobs:
        if not isinstance(raw, dict):
            raise MalformedFrame("logprobs entries must be maps")
        top = raw.get("top") or []
        if not isinstance(top, list) or not all(
                isinstance(p, list) and len(p) == 2 and _is_token_id(p[0]) and _is_number(p[1])
                for p in top):
            raise MalformedFrame("logprobs top must be [token_id, logprob] pairs")
        token_id, logprob, rank = raw.get("token_id"), raw.get("logprob"), raw.get("rank")
        if not (_is_token_id(token_id) and _is_number(logprob) and _is_count(rank)):
            raise MalformedFrame("logprobs entries need token_id, logprob and rank")
        return cls(token_id, float(logprob), rank, [(t, float(v)) for t, v in top])


@dataclass(frozen=True, slots=True)
class TokensFrame:
    """New tokens of the request (zero or more frames). ``cached_tokens`` rides on the first
    one, so a client that closes the stream early (a stop string) still knows how much of the
    prompt the prefix cache served."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None  # one per token when asked for
    cached_tokens: int | None = None
    # First frame only, when params.prompt_logprobs is set: one per prompt token, the first None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def to_msgpack(self) -> bytes:
        frame: dict[str, Any] = {"type": "tokens", "token_ids": self.token_ids, "logprobs": None}
        if self.logprobs is not None:
            frame["logprobs"] = [None if lp is None else lp.to_wire() for lp in self.logprobs]
        if self.cached_tokens is not None:
            frame["cached_tokens"] = self.cached_tokens
        if self.prompt_logprobs is not None:
            frame["prompt_logprobs"] = [
                None if lp is None else lp.to_wire() for lp in self.prompt_logprobs
            ]
        return msgpack.packb(frame)

    @classmethod
    def _from_map(cls, raw: dict[str, Any]) -> TokensFrame:
        ids = raw.get("token_ids")
        if not isinstance(ids, list) or not all(_is_token_id(t) for t in ids):
            raise MalformedFrame("malformed engine frame: token_ids")
        lps = raw.get("logprobs")
        if lps is not None:
            if not isinstance(lps, list) or len(lps) != len(ids):
                raise MalformedFrame("malformed engine frame: logprobs")
            lps = [None if lp is None else TokenLogprobs.from_wire(lp) for lp in lps]
        cached = raw.get("cached_tokens")
        if cached is not None and not _is_count(cached):
            raise MalformedFrame("malformed engine frame: cached_tokens")
        prompt = raw.get("prompt_logprobs")
        if prompt is not None:
            if not isinstance(prompt, list):
                raise MalformedFrame("malformed engine frame: prompt_logprobs")
            prompt = [None if lp is None else TokenLogprobs.from_wire(lp) for lp in prompt]
        return cls(ids, lps, cached, prompt)


@dataclass(frozen=True, slots=True)
class FinishedFrame:
    """The request is over (the last frame)."""

    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: int | str | None  # the stop token id or string, when one ended it
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    kv_transfer_params: dict[str, Any] | None = None  # the KV connector's (P/D: where to pull)

    def to_msgpack(self) -> bytes:
        frame: dict[str, Any] = {
            "type": "finished",
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens,
            },
        }
        if self.kv_transfer_params is not None:
            frame["kv_transfer_params"] = self.kv_transfer_params
        return msgpack.packb(frame)

    @classmethod
    def _from_map(cls, raw: dict[str, Any]) -> FinishedFrame:
        usage = raw.get("usage")
        reason, stop = raw.get("finish_reason"), raw.get("stop_reason")
        if not isinstance(usage, dict) or not isinstance(reason, str) or not (
                stop is None or isinstance(stop, str) or _is_token_id(stop)):
            raise MalformedFrame("malformed engine frame: finished")
        counts = [usage.get(k) for k in ("prompt_tokens", "completion_tokens", "cached_tokens")]
        if not all(_is_count(c) for c in counts):
            raise MalformedFrame("malformed engine frame: usage")
        try:
            params = kv_params.check(raw.get("kv_transfer_params"))
        except BadRequest:
            raise MalformedFrame("malformed engine frame: kv_transfer_params") from None
        return cls(reason, stop, *counts, params)


@dataclass(frozen=True, slots=True)
class ErrorFrame:
    """The request failed in the engine (the last frame)."""

    message: str

    def to_msgpack(self) -> bytes:
        return msgpack.packb({"type": "error", "message": self.message})

    @classmethod
    def _from_map(cls, raw: dict[str, Any]) -> ErrorFrame:
        return cls(str(raw.get("message"))[:_MAX_ERROR_CHARS])


@dataclass(frozen=True, slots=True)
class KVTransferFrame:
    """The KV connector announced params before the request finished (a prefill asked with
    ``"kv_stream": true``: the decode leg may start pulling now). Only to a request that
    asked for it, so a client that does not know it never sees one."""

    kv_transfer_params: dict[str, Any]

    def to_msgpack(self) -> bytes:
        return msgpack.packb({"type": "kv_transfer", "kv_transfer_params": self.kv_transfer_params})

    @classmethod
    def _from_map(cls, raw: dict[str, Any]) -> KVTransferFrame:
        try:
            params = kv_params.check(raw.get("kv_transfer_params"))
        except BadRequest:
            params = None
        if params is None:
            raise MalformedFrame("malformed engine frame: kv_transfer_params")
        return cls(params)


StreamFrame = TokensFrame | FinishedFrame | ErrorFrame | KVTransferFrame
_FRAME_TYPES: dict[str, Any] = {
    "tokens": TokensFrame, "finished": FinishedFrame, "error": ErrorFrame,
    "kv_transfer": KVTransferFrame,
}
_MAX_ERROR_CHARS = 500


class FrameDecoder:
    """Feeds stream chunks; returns the complete frames, typed and checked, as they arrive.
    Raises ``MalformedFrame`` on bytes that are not a frame."""

    def __init__(self) -> None:
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=64 * 1024 * 1024)

    def feed(self, chunk: bytes) -> list[StreamFrame]:
        try:
            self._unpacker.feed(chunk)
            raws = list(self._unpacker)
        except Exception as exc:  # noqa: BLE001 -- msgpack raises several unrelated types
            raise MalformedFrame(f"malformed engine frame: {type(exc).__name__}") from None
        frames: list[StreamFrame] = []
        for raw in raws:
            tag = raw.get("type") if isinstance(raw, dict) else None
            kind = _FRAME_TYPES.get(tag) if isinstance(tag, str) else None
            if kind is None:
                raise MalformedFrame("malformed engine frame")
            frames.append(kind._from_map(raw))
        return frames


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_is_count = _is_token_id


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
