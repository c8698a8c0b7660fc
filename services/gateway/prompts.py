"""From a validated request to token ids: chat template, tokenization (once), length checks.

Tokenizing runs on a single worker thread (``tokenize_in``), off the event loop; HF fast
tokenizers are not safe to drive from several threads at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TypeVar

from services.gateway.models import ServedModel
from services.protocol.openai import GenerationRequest, OpenAIError
from services.text.chat_prompt import chat_renderer, render_chat, template_kwargs

T = TypeVar("T")

__all__ = ["Prompt", "prepare_prompts", "template_kwargs", "tokenize_in"]


@dataclass(slots=True)
class Prompt:
    text: str | None  # None when the client sent token ids (decoded lazily for echo)
    token_ids: list[int]


async def tokenize_in(pool: Executor, fn: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(pool, fn)


async def prepare_prompts(
    pool: Executor, model: ServedModel, req: GenerationRequest
) -> list[Prompt]:
    tok = model.tokenizer
    if req.kind == "chat":
        messages, kwargs = chat_renderer(req)

        def render() -> Prompt:
            return Prompt(*render_chat(tok, messages, kwargs))

        return [await tokenize_in(pool, render)]

    texts = [p for p in req.prompts if isinstance(p, str)]
    encoded = iter(await tokenize_in(pool, lambda: [tok.encode(t) for t in texts]) if texts else [])
    prompts = []
    for p in req.prompts:
        if isinstance(p, str):
            prompts.append(Prompt(p, next(encoded)))
        else:
            _check_vocab(model, p)
            prompts.append(Prompt(None, p))
    return prompts


def _check_vocab(model: ServedModel, ids: list[int]) -> None:
    vocab = model.tokenizer.vocab_size
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise OpenAIError(
            f"prompt token id {bad} is out of range for the vocabulary ({vocab} tokens)",
            param="prompt",
        )


def check_logit_bias(model: ServedModel, bias: dict[int, float] | None) -> None:
    vocab = model.tokenizer.vocab_size
    if bias and max(bias) >= vocab:
        raise OpenAIError(
            f"logit_bias token id {max(bias)} is out of range for the vocabulary "
            f"({vocab} tokens)",
            param="logit_bias",
        )


def check_length(
    model: ServedModel,
    prompt_len: int,
    max_tokens: int | None,
    prompt_param: str,
    max_tokens_param: str,
) -> None:
    """400 when the prompt alone leaves no room to generate, or ``max_tokens`` is larger than
    the whole context. A prompt + max_tokens past the context is served as vLLM does: the
    engine generates up to the context and finishes with "length"."""
    if prompt_len == 0:
        raise OpenAIError("the prompt is empty after tokenization", param=prompt_param)
    limit = model.max_model_len
    if limit is None:
        return
    if prompt_len >= limit:
        raise OpenAIError(
            f"This model's maximum context length is {limit} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room for a completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and max_tokens > limit:
        raise OpenAIError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for "
            f"the completion). Please reduce {max_tokens_param}.",
            param=max_tokens_param,
            code="context_length_exceeded",
        )

