"""OpenAI request bodies in, validated requests out; and the response objects back.

One implementation shared by the gateway and the offline batch job, so both accept the same
fields (OpenAI's, plus vLLM's sampling extensions) and refuse bad ones with the same 400.
Torch-free: ``SamplingParams`` is a plain dataclass.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.protocol import kv_transfer_params as kv_params
from services.protocol.openai_structured import (
    Constraint,
    FieldError,
    check_tool_messages,
    parse_constraint,
)
from services.protocol.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams
from services.protocol.wire import MAX_PRIORITY

# -- limits ---------------------------------------------------------------------------------
# What one request may ask for. The 400s below and the gateway's /openapi.json both read these.
MAX_N = 128  # samples per prompt: the default of the gateway's --max-n (vLLM accepts n=100)
MAX_PROMPTS = 256  # prompts in one /v1/completions request
MAX_CHOICES = 256  # prompts x n: the engine requests one client request may fan out to
MAX_COMPLETION_LOGPROBS = 20  # /v1/completions ``logprobs``: vLLM's default max_logprobs
MAX_TOP_LOGPROBS = MAX_LOGPROBS  # /v1/chat/completions ``top_logprobs`` (20, as OpenAI)
MAX_STOP = MAX_STOP_STRINGS  # ``stop`` strings (64; what the engine's SamplingParams accepts)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's and vLLM's)
_MAX_SHOWN = 60  # characters of a bad value quoted back in an error message
_MAX_MESSAGE = 500  # characters of an error message


class OpenAIError(Exception):
    """An error the client sees, in OpenAI's JSON shape with an HTTP status (and, for a 429 or
    503 the client should retry, the seconds to wait, sent as ``Retry-After``)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type_: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        message = message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 3] + "..."
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type_ or _default_type(status)
        self.code = code
        self.retry_after = retry_after

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _default_type(status: int) -> str:
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")


# -- requests -------------------------------------------------------------------------------

# OpenAI/vLLM sampling fields (SamplingParams uses the same names) and the JSON type each must
# have; SamplingParams checks the ranges. The rest of the body is handled explicitly.
_SAMPLING_FIELDS = {
    "temperature": "number",
    "top_p": "number",
    "top_k": "integer",
    "min_p": "number",
    "seed": "integer",
    "presence_penalty": "number",
    "frequency_penalty": "number",
    "repetition_penalty": "number",
    "min_tokens": "integer",
    "ignore_eos": "boolean",
    "stop_token_ids": "array of integers",
    "skip_special_tokens": "boolean",
    "include_stop_str_in_output": "boolean",
    "n": "integer",
}
_UNSUPPORTED = ("suffix", "functions")


@dataclass(slots=True)
class GenerationRequest:
    """A validated completion or chat request: what to run and how to sample it."""

    kind: str  # "completion" | "chat"
    model: str | None  # None: the gateway's default model (the only one, or --default-model)
    params: SamplingParams
    prompts: list[str | list[int]] = field(default_factory=list)  # completions
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    echo: bool = False
    top_logprobs: int | None = None  # chat: how many alternatives per token to report
    cache_salt: str | None = None
    user: str | None = None
    # vLLM's, passed to the engine's KV connector (P/D legs) and returned in the response
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: lower is more urgent; the engine's scheduling and the gateway's flow control
    priority: int = 0
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # response_format / structured_outputs / tools: what the engine enforces, and the tools
    constraint: Constraint = field(default_factory=Constraint)


def parse_completion_request(body: Any, max_n: int = MAX_N) -> GenerationRequest:
    body = _require_object(body)
    model = _model(body)
    prompts = _prompts(body.get("prompt"))
    logprobs = _opt_int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    echo = _opt_bool(body, "echo", False)
    max_tokens = _max_tokens(body, "max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    constraint = _constraint(body, chat=False)
    params = _sampling_params(
        body, max_tokens, logprobs, max_n, _prompt_logprobs(body, echo), constraint
    )
    return GenerationRequest(
        kind="completion",
        model=model,
        params=params,
        prompts=prompts,
        echo=echo,
        constraint=constraint,
        **_common(body),
    )


def parse_chat_request(body: Any, max_n: int = MAX_N) -> GenerationRequest:
    body = _require_object(body)
    model = _model(body)
    messages = _messages(body.get("messages"))
    want_logprobs = _opt_bool(body, "logprobs", False)
    top = _opt_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not want_logprobs:
        raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
    max_tokens = _max_tokens(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _max_tokens(body, "max_tokens")
    constraint = _constraint(body, chat=True)
    params = _sampling_params(
        body,
        max_tokens,
        (top or 0) if want_logprobs else None,
        max_n,
        _prompt_logprobs(body),
        constraint,
    )
    return GenerationRequest(
        kind="chat",
        model=model,
        params=params,
        messages=messages,
        top_logprobs=top if want_logprobs else None,
        chat_template_kwargs=_template_kwargs(body),
        constraint=constraint,
        **_common(body),
    )


def _constraint(body: dict[str, Any], chat: bool) -> Constraint:
    try:
        if chat:
            check_tool_messages(body["messages"])
        return parse_constraint(body, chat)
    except FieldError as exc:
        raise OpenAIError(str(exc), param=exc.param) from None


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, [], {}):
            raise OpenAIError(f"{name} is not supported", param=name)
    return body


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is None:
        return None  # the served model, when there is only one (or --default-model)
    if not isinstance(model, str) or not model:
        raise OpenAIError("model must be a non-empty string", param="model")
    return model


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs`` over the top-level ``add_generation_prompt`` and
    ``continue_final_message`` (vLLM's precedence: the explicit kwargs win)."""
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise OpenAIError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    merged = {
        "add_generation_prompt": _opt_bool(body, "add_generation_prompt", True),
        "continue_final_message": _opt_bool(body, "continue_final_message", False),
        **kwargs,
    }
    if merged["add_generation_prompt"] is True and merged["continue_final_message"] is True:
        raise OpenAIError(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    return merged


def _prompt_logprobs(body: dict[str, Any], echo: bool = False) -> int | None:
    """vLLM's ``prompt_logprobs`` extension; completions' ``echo`` with ``logprobs`` asks for
    as many per prompt token as per generated one."""
    value = _opt_int(body, "prompt_logprobs", 0, MAX_COMPLETION_LOGPROBS)
    if value is None and echo:
        value = _opt_int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    return value


def _common(body: dict[str, Any]) -> dict[str, Any]:
    stream = _opt_bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise OpenAIError("stream_options must be an object", param="stream_options")
    include_usage = _opt_bool(opts or {}, "include_usage", False, "stream_options.include_usage")
    continuous = _opt_bool(opts or {}, "continuous_usage_stats", False,
                           "stream_options.continuous_usage_stats")
    if opts and not stream:
        raise OpenAIError("stream_options is only allowed when stream is true",
                          param="stream_options")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise OpenAIError("cache_salt must be a non-empty string", param="cache_salt")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise OpenAIError("user must be a string", param="user")
    try:
        kv = kv_params.check_client(body.get("kv_transfer_params"))
    except ValueError as exc:  # BadRequest: its text names the field
        raise OpenAIError(str(exc), param="kv_transfer_params") from None
    priority = _opt_int(body, "priority", -MAX_PRIORITY, MAX_PRIORITY) or 0
    return {"stream": stream, "include_usage": include_usage,
            "continuous_usage": include_usage and continuous, "cache_salt": salt, "user": user,
            "kv_transfer_params": kv, "priority": priority}


def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt)
    ):
        prompts = [list(p) for p in prompt]
    else:
        raise OpenAIError(
            "prompt must be a non-empty string, a list of strings, a list of token ids, "
            "or a list of lists of token ids",
            param="prompt",
        )
    if any(p == "" for p in prompts):
        raise OpenAIError("prompt must not be empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise OpenAIError(
            f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt"
        )
    return prompts


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise OpenAIError(f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if role == "developer":  # OpenAI's new name for the system role; templates know "system"
            m = {**m, "role": "system"}
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise OpenAIError(
                f"messages[{i}].role must be one of system, user, assistant, tool, developer; "
                f"got {_shown(role)}",
                param="messages",
            )
        out.append({**m, "content": _content_text(m.get("content"), i)})
    return out


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise OpenAIError(
                    f"messages[{i}].content: only text parts are supported", param="messages"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise OpenAIError(f"messages[{i}].content text must be a string", param="messages")
            parts.append(text)
        return "\n".join(parts)  # as vLLM joins text parts
    raise OpenAIError(f"messages[{i}].content must be a string or a list", param="messages")


def _max_tokens(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise OpenAIError(f"{name} must be a positive integer, got {_shown(value)}", param=name)
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not lo <= value <= hi:
        raise OpenAIError(
            f"{name} must be an integer in [{lo}, {hi}], got {_shown(value)}", param=name
        )
    return value


def _opt_bool(body: dict[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        param = param or name
        raise OpenAIError(f"{param} must be a boolean, got {_shown(value)}", param=param)
    return value


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": _is_int,
    "boolean": lambda v: isinstance(v, bool),
    "array of integers": lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
}


def _shown(value: Any) -> str:
    """A bad value as quoted back to the client: short, and never a deep or huge repr."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _sampling_params(
    body: dict[str, Any],
    max_tokens: int | None,
    logprobs: int | None,
    max_n: int,
    prompt_logprobs: int | None,
    constraint: Constraint | None = None,
) -> SamplingParams:
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "logit_bias": parse_logit_bias(body.get("logit_bias")),
    }
    if constraint is not None and constraint.params is not None:
        kwargs["structured_outputs"] = constraint.params
    for name, kind in _SAMPLING_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        if not _JSON_TYPES[kind](value):
            article = "an" if kind[0] in "aeiou" else "a"
            raise OpenAIError(f"{name} must be {article} {kind}, got {_shown(value)}", param=name)
        kwargs[name] = value
    stop = body.get("stop")
    if stop is not None:
        kwargs["stop"] = _stop(stop)
    if kwargs.get("n", 1) > max_n:
        raise OpenAIError(f"n must be at most {max_n}, got {kwargs['n']}", param="n")
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise OpenAIError(str(exc), param=_param_of(str(exc))) from None


def parse_logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: a JSON object from token ids (as strings) to biases."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise OpenAIError("logit_bias must be an object of token id -> bias", param="logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key.strip() if isinstance(key, str) else ""
        if not token.isdigit():
            raise OpenAIError(
                f"logit_bias keys must be token ids, got {_shown(key)}", param="logit_bias"
            )
        if not _JSON_TYPES["number"](bias):
            raise OpenAIError(
                f"logit_bias values must be numbers, got {_shown(bias)}", param="logit_bias"
            )
        out[int(token)] = bias
    return out


def _stop(stop: Any) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise OpenAIError("stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP:
        raise OpenAIError(
            f"stop may have at most {MAX_STOP} strings, got {len(stops)}", param="stop"
        )
    return stops


def _param_of(message: str) -> str | None:
    first = message.split(" ", 1)[0]
    known = set(_SAMPLING_FIELDS) | {
        "stop", "max_tokens", "logprobs", "prompt_logprobs", "logit_bias"
    }
    return first if first in known else None


# -- responses ------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_object(
    rid: str, model: str, choices: list[dict[str, Any]], use: dict[str, Any] | None,
    chunk: bool = False, fingerprint: str | None = None,
) -> dict[str, Any]:
    return _response_object(rid, "text_completion", model, choices, use, chunk, fingerprint)


def chat_object(
    rid: str, model: str, choices: list[dict[str, Any]], use: dict[str, Any] | None,
    chunk: bool = False, fingerprint: str | None = None,
) -> dict[str, Any]:
    kind = "chat.completion.chunk" if chunk else "chat.completion"
    return _response_object(rid, kind, model, choices, use, chunk, fingerprint)


def _response_object(
    rid: str, kind: str, model: str, choices: list[dict[str, Any]],
    use: dict[str, Any] | None, chunk: bool, fingerprint: str | None,
) -> dict[str, Any]:
    """A response body or stream chunk: usage on every body, on a chunk only when given;
    ``system_fingerprint`` (the serving configuration) when known."""
    obj: dict[str, Any] = {"id": rid, "object": kind, "created": int(time.time()), "model": model}
    if fingerprint is not None:
        obj["system_fingerprint"] = fingerprint
    obj["choices"] = choices
    if use is not None or not chunk:
        obj["usage"] = use
    return obj


@dataclass(slots=True)
class TokenLogprob:
    """One generated token's logprob and its top alternatives, already decoded to text."""

    token: str
    logprob: float | None  # None: the first prompt token of an echo (nothing predicts it)
    top: list[tuple[str, float]]


def completion_logprobs(items: list[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object."""
    offsets = []
    pos = text_offset
    for it in items:
        offsets.append(pos)
        pos += len(it.token)
    return {
        "tokens": [it.token for it in items],
        "token_logprobs": [it.logprob for it in items],
        # The chosen token is always among its alternatives, as vLLM (logprobs=0 included).
        "top_logprobs": [
            None if it.logprob is None else {it.token: it.logprob, **dict(it.top)}
            for it in items
        ],
        "text_offset": offsets,
    }


def chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    """The chat completions ``logprobs`` object."""

    def entry(token: str, lp: float) -> dict[str, Any]:
        return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**entry(it.token, it.logprob), "top_logprobs": [entry(t, v) for t, v in it.top]}
            for it in items
        ]
    }
