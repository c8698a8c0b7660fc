"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

/tokenize takes ``prompt`` (``add_special_tokens`` default true) or ``messages`` (the chat
template is applied; ``add_generation_prompt`` default true, ``add_special_tokens`` default
false) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``; ``token_strs`` is
filled when ``return_token_strs`` is true. /detokenize takes ``tokens`` and answers
``{"prompt"}``. ``model`` may be left out when the gateway serves only one.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.gateway.errors import read_json_body
from services.gateway.prompts import template_kwargs, tokenize_in
from services.gateway.state import MODEL_LABEL, STATE
from services.protocol.openai import OpenAIError, parse_chat_request

_MAX_TOKENS = 1_000_000


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _read_object(request)
    model = state.models.resolve_optional(body.get("model"), state.config.default_model)
    request[MODEL_LABEL] = model.name
    tok = model.tokenizer
    want_strs = _bool(body, "return_token_strs", False)
    if "messages" in body and body.get("prompt") is None:
        # Reuse the chat parser for the messages' validation; the sampling fields are moot.
        chat = parse_chat_request({
            "model": model.name,
            **{k: body.get(k) for k in ("messages", "add_generation_prompt",
                                        "continue_final_message", "chat_template_kwargs")},
        })
        special = _bool(body, "add_special_tokens", False)
        kwargs = template_kwargs(chat.chat_template_kwargs)

        def run() -> list[int]:
            text = tok.apply_chat_template(chat.messages, **kwargs)
            return tok.encode(text, add_special_tokens=special)

        param = "messages"
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise OpenAIError("prompt (a string) or messages is required", param="prompt")
        special = _bool(body, "add_special_tokens", True)

        def run() -> list[int]:
            return tok.encode(prompt, add_special_tokens=special)

        param = "prompt"
    try:
        ids = await tokenize_in(state.tokenize_pool, run)
    except OpenAIError:
        raise
    except Exception as exc:  # noqa: BLE001 -- jinja2 and tokenizers raise many types
        raise OpenAIError(f"cannot tokenize: {str(exc)[:200]}", param=param) from None
    strs = [tok.convert_id_to_token(t) for t in ids] if want_strs else None
    return web.json_response(
        {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs}
    )


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _read_object(request)
    model = state.models.resolve_optional(body.get("model"), state.config.default_model)
    request[MODEL_LABEL] = model.name
    ids = body.get("tokens")
    vocab = model.tokenizer.vocab_size
    if (
        not isinstance(ids, list)
        or len(ids) > _MAX_TOKENS
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids)
    ):
        raise OpenAIError(f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
    text = await tokenize_in(state.tokenize_pool, lambda: model.tokenizer.decode(ids))
    return web.json_response({"prompt": text})


async def _read_object(request: web.Request) -> dict[str, Any]:
    config = request.app[STATE].config
    body = await read_json_body(request, config.max_body_bytes, config.body_read_timeout)
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(f"{name} must be a boolean", param=name)
    return value
