"""From an OpenAI request body, as an Envoy gateway forwards it to the endpoint picker, to the
``RouteRequest`` Pagoda's gateway would have sent for it: the same validation
(``protocol.openai``), chat template and tokenization (``text.chat_prompt``), tenant salt
(``protocol.tenancy``) and block-hash chain (``protocol.block_hash``), so ``/route`` and the
picker decide alike.

A model without a tokenizer here (``--tokenizer``) is still picked, by load: its prompt hashes
to no blocks. Batch completions (several prompts) are picked by their first prompt, since one
request goes to one endpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TypeVar

from services.protocol import openai as oa
from services.protocol.block_hash import BlockHasher
from services.protocol.messages import RouteRequest
from services.protocol.tenancy import bearer_token, cache_salt_for, tenant_id
from services.protocol.wire import MAX_REQUEST_ID_CHARS
from services.router.model_facts import ModelCatalog, ModelFacts
from services.router.routing import NoEngineError
from services.text.chat_prompt import chat_renderer, render_chat
from services.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PickInput:
    """The parts of an Envoy request the picker reads."""

    path: str  # ":path", without the query
    body: bytes
    authorization: str | None = None
    request_id: str | None = None  # "x-request-id", when Envoy set one


@dataclass(frozen=True, slots=True)
class PickRequest:
    """What the picker decides on: the route, and flow control's tenant and priority."""

    route: RouteRequest
    tenant: str | None  # the bearer key's one-way id (None: no key, or keys are not read)
    priority: int  # the body's vLLM priority (0 when absent)


class PromptReader:
    def __init__(self, catalog: ModelCatalog, tokenizers: Mapping[str, Tokenizer],
                 pool: Executor, *, tenant_from_key: bool = True) -> None:
        self._catalog = catalog
        self._tokenizers = dict(tokenizers)
        self._pool = pool  # one thread: HF fast tokenizers are not thread-safe
        self._tenant_from_key = tenant_from_key

    async def route_request(self, given: PickInput) -> PickRequest:
        """Raises OpenAIError (the client's fault: 4xx) or NoEngineError (503: no live engine
        serves the model)."""
        req = _parse(given.path, given.body)
        if not req.model:
            raise oa.OpenAIError("model is required", param="model")
        facts = await self._catalog.resolve(req.model)
        if facts is None:
            raise NoEngineError(503, f"no live engine serves model {req.model!r}")
        ids = await self._token_ids(facts, req)
        tenant = None
        token = bearer_token(given.authorization) if self._tenant_from_key else None
        if token is not None:
            tenant = tenant_id(token)
        salt = cache_salt_for(tenant, req.cache_salt)
        hasher = BlockHasher(facts.model, facts.block_size, salt, facts.hash_algorithm,
                             facts.adapter)
        rid = (given.request_id or "")[:MAX_REQUEST_ID_CHARS] or None
        route = RouteRequest(
            model=facts.model, block_hashes=hasher.chain(ids), prompt_len=len(ids),
            request_id=rid, lora_name=None if facts.adapter is None else facts.adapter.name,
        )
        return PickRequest(route, tenant, req.priority)

    async def _token_ids(self, facts: ModelFacts, req: oa.GenerationRequest) -> list[int]:
        tok = self._tokenizers.get(facts.model)
        if req.kind == "chat":
            if tok is None:
                return []
            messages, kwargs = chat_renderer(req)
            return (await self._run(lambda: render_chat(tok, messages, kwargs)))[1]
        first = req.prompts[0] if req.prompts else []
        if isinstance(first, list):
            return first
        if tok is None:
            return []
        try:
            return await self._run(lambda: tok.encode(first))
        except Exception:  # noqa: BLE001 -- e.g. a lone surrogate the tokenizer cannot encode
            raise oa.OpenAIError("the prompt cannot be tokenized", param="prompt") from None

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)


def _parse(path: str, body: bytes) -> oa.GenerationRequest:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
        raise oa.OpenAIError("the request body is not valid JSON") from None
    chat = path.rstrip("/").endswith("/chat/completions") or (
        not path.rstrip("/").endswith("/completions") and isinstance(obj, dict)
        and "messages" in obj
    )
    return oa.parse_chat_request(obj) if chat else oa.parse_completion_request(obj)


def load_tokenizers(dirs: Mapping[str, str]) -> dict[str, Tokenizer]:
    """Each model's tokenizer (slow: call it off the event loop)."""
    out = {}
    for model, path in dirs.items():
        logger.info("picker: loading tokenizer model=%s path=%s", model, path)
        out[model] = Tokenizer(path)
    return out
