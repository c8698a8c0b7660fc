"""A chat request's prompt: its template arguments checked, the template applied, the text
tokenized once. Pagoda's gateway and the router's endpoint picker both render prompts here, so
the tokens the picker hashes are the tokens the engine will see.

The functions are synchronous: callers run them on their tokenizer thread (HF fast tokenizers
are not safe to drive from several threads at once).
"""

from __future__ import annotations

from typing import Any

from services.protocol.openai import GenerationRequest, OpenAIError
from services.protocol.openai_structured import template_messages
from services.text.tokenizer import Tokenizer

# chat_template_kwargs the client may not set: they would change what the call returns, or
# (chat_template) run a template of the client's choosing.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "tokenize",
        "return_dict",
        "return_tensors",
        "conversation",
        "messages",
        "tools",
        "documents",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "chat_template",
    }
)


def template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The client's ``chat_template_kwargs``, checked (400 naming the field)."""
    bad = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise OpenAIError(f"chat_template_kwargs may not set {bad}", param="chat_template_kwargs")
    gen = kwargs.get("add_generation_prompt", True)
    if not isinstance(gen, bool):
        raise OpenAIError(
            "chat_template_kwargs.add_generation_prompt must be a boolean",
            param="chat_template_kwargs",
        )
    return kwargs


def chat_renderer(req: GenerationRequest) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and template arguments a chat request renders with (checked here, on the
    caller's thread, so a bad field is a 400 before any tokenizer work)."""
    kwargs = template_kwargs(req.chat_template_kwargs)
    tools = req.constraint.tools
    if tools is not None:  # the template shows them to the model, as transformers does
        kwargs = {**kwargs, "tools": tools.tools}
    return template_messages(req.messages), kwargs


def render_chat(
    tok: Tokenizer, messages: list[dict[str, Any]], kwargs: dict[str, Any]
) -> tuple[str, list[int]]:
    """The prompt text and its token ids. The template already holds any BOS the model wants,
    so no special tokens are added. A template error is the client's: a 400 on ``messages``."""
    try:
        text = tok.apply_chat_template(messages, **kwargs)
        return text, tok.encode(text, add_special_tokens=False)
    except OpenAIError:
        raise
    except Exception as exc:  # noqa: BLE001 -- jinja2 and tokenizers raise many types
        raise OpenAIError(
            f"cannot apply the chat template: {_first_line(exc)}", param="messages"
        ) from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
