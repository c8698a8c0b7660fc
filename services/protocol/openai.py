"""OpenAI request bodies in, validated requests out; and the response objects back.

One implementation shared by the gateway and the offline batch job, so both accept the same
fields (OpenAI's, plus vLLM's sampling extensions) and refuse bad ones with the same 400.
Torch-free: ``SamplingParams`` is a plain dataclass.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.engine.sampling_params import SamplingParams

MAX_N = 16
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's legacy completions cap
MAX_TOP_LOGPROBS = 20


class OpenAIError(Exception):
    """An error the client sees, in OpenAI's JSON shape with an HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type_: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type_ or _default_type(status)
        self.code = code

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

# OpenAI/vLLM field -> SamplingParams field. The rest of the body is handled explicitly.
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
    "skip_special_tokens": "skip_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "n": "n",
}
_UNSUPPORTED = ("suffix", "logit_bias", "tools", "tool_choice", "functions", "response_format")


@dataclass(slots=True)
class GenerationRequest:
    """A validated completion or chat request: what to run and how to sample it."""

    kind: str  # "completion" | "chat"
    model: str
    params: SamplingParams
    prompts: list[str | list[int]] = field(default_factory=list)  # completions
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    top_logprobs: int | None = None  # chat: how many alternatives per token to report
    cache_salt: str | None = None
    user: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


def parse_completion_request(body: Any) -> GenerationRequest:
    body = _require_object(body)
    model = _model(body)
    prompts = _prompts(body.get("prompt"))
    logprobs = _opt_int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    params = _sampling_params(body, _max_tokens(body, "max_tokens"), logprobs)
    return GenerationRequest(
        kind="completion",
        model=model,
        params=params,
        prompts=prompts,
        echo=_opt_bool(body, "echo", False),
        **_common(body),
    )


def parse_chat_request(body: Any) -> GenerationRequest:
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
    params = _sampling_params(body, max_tokens, (top or 0) if want_logprobs else None)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise OpenAIError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    return GenerationRequest(
        kind="chat",
        model=model,
        params=params,
        messages=messages,
        top_logprobs=top if want_logprobs else None,
        chat_template_kwargs=kwargs,
        **_common(body),
    )


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, [], {}):
            raise OpenAIError(f"{name} is not supported", param=name)
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("model is required and must be a string", param="model")
    return model


def _common(body: dict[str, Any]) -> dict[str, Any]:
    stream = _opt_bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise OpenAIError("stream_options must be an object", param="stream_options")
    include_usage = bool((opts or {}).get("include_usage", False))
    if opts and not stream:
        raise OpenAIError("stream_options is only allowed when stream is true",
                          param="stream_options")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise OpenAIError("cache_salt must be a non-empty string", param="cache_salt")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise OpenAIError("user must be a string", param="user")
    return {"stream": stream, "include_usage": include_usage, "cache_salt": salt, "user": user}


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
    if len(prompts) > 256:
        raise OpenAIError("at most 256 prompts per request", param="prompt")
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
        if role not in ("system", "user", "assistant", "tool", "developer"):
            raise OpenAIError(f"messages[{i}].role is invalid: {role!r}", param="messages")
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
        return "".join(parts)
    raise OpenAIError(f"messages[{i}].content must be a string or a list", param="messages")


def _max_tokens(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise OpenAIError(f"{name} must be a positive integer, got {value!r}", param=name)
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not lo <= value <= hi:
        raise OpenAIError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}", param=name)
    return value


def _opt_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _sampling_params(
    body: dict[str, Any], max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": logprobs}
    for src, dst in _SAMPLING_FIELDS.items():
        if body.get(src) is not None:
            kwargs[dst] = body[src]
    stop = body.get("stop")
    if stop is not None:
        kwargs["stop"] = stop
        if not isinstance(stop, (str, list)):
            raise OpenAIError("stop must be a string or a list of strings", param="stop")
    if _is_int(kwargs.get("n")) and kwargs["n"] > MAX_N:
        raise OpenAIError(f"n must be at most {MAX_N}", param="n")
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise OpenAIError(str(exc), param=_param_of(str(exc))) from None


def _param_of(message: str) -> str | None:
    first = message.split(" ", 1)[0]
    known = set(_SAMPLING_FIELDS) | {"stop", "max_tokens", "logprobs"}
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
    chunk: bool = False,
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None or not chunk:
        obj["usage"] = use
    return obj


def chat_object(
    rid: str, model: str, choices: list[dict[str, Any]], use: dict[str, Any] | None,
    chunk: bool = False,
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chunk else "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None or not chunk:
        obj["usage"] = use
    return obj


@dataclass(slots=True)
class TokenLogprob:
    """One generated token's logprob and its top alternatives, already decoded to text."""

    token: str
    logprob: float
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
        "top_logprobs": [dict(it.top) for it in items],
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
