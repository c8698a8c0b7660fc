"""``POST /v1/completions`` and ``POST /v1/chat/completions``.

validate (services.protocol.openai) -> template + tokenize once -> length checks -> block-hash
chain -> router -> engine stream(s) -> detokenize + stop strings -> SSE or one JSON body.
Failures before the first byte to the client are JSON errors with their status; failures
after it end the stream with ``data: {"error": ...}`` and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from opentelemetry import trace

from services.common import tracing
from services.common.flow_control import Shed
from services.gateway.admission import HoldCost
from services.gateway.auth import TENANT_KEY, cache_salt_for
from services.gateway.errors import read_json_body
from services.gateway.generation import ChoiceJob, Generation, GenerationFailed
from services.gateway.models import ServedModel
from services.gateway.prompts import Prompt, check_length, check_logit_bias, prepare_prompts
from services.gateway.responses import ResponseBuilder, ToolOutput
from services.gateway.sse import SSEWriter
from services.gateway.state import MODEL_LABEL, STATE, GatewayState
from services.protocol import openai as oa
from services.protocol.block_hash import AdapterKey, BlockHasher
from services.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ENGINE_HEADER = "x-pagoda-engine"


@dataclass(slots=True)
class _Plan:
    """Everything decided before the first engine call."""

    req: oa.GenerationRequest
    model: ServedModel
    prompts: list[Prompt]
    jobs: list[ChoiceJob]
    salt: str | None
    rid: str
    adapter: AdapterKey | None = None  # the LoRA adapter the request's model names

    @property
    def served_name(self) -> str:
        """The model name responses carry: the adapter's, when the request named one."""
        return self.model.name if self.adapter is None else self.adapter.name


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


async def _serve(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE]
    started = time.monotonic()
    span = trace.get_current_span()  # the server span of tracing.server_span_middleware
    body = await read_json_body(
        request, state.config.max_body_bytes, state.config.body_read_timeout
    )
    parse = oa.parse_chat_request if kind == "chat" else oa.parse_completion_request
    req = parse(body, state.config.max_n)
    model = state.models.resolve_optional(req.model, state.config.default_model)
    adapter = state.models.adapter(req.model)
    request[MODEL_LABEL] = model.name
    _check_tool_choice(req, state.config.tool_call_parser)
    plan = await _plan(request, state, req, model, body, adapter)
    if span.is_recording():
        _trace_request(span, plan)
    endpoint = request.path
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.config.request_timeout
    timed_out = oa.OpenAIError("the request timed out", status=504)
    # Each choice held for an engine counts its share of the body (aiohttp keeps the bytes).
    share = -(-len(await request.read()) // len(plan.jobs))
    gen = Generation(state.upstreams, model, plan.rid, plan.jobs, plan.salt,
                     None if adapter is None else adapter.name,
                     HoldCost(request.get(TENANT_KEY), share), req.kv_transfer_params,
                     req.priority)
    timer: asyncio.TimerHandle | None = None
    admitted = False
    state.metrics.in_flight.labels(endpoint, model.name).inc()
    try:
        try:
            async with asyncio.timeout_at(deadline):
                await _admit(state, model, request.get(TENANT_KEY), req.priority)
                admitted = True
                await gen.start()
        except TimeoutError:
            raise timed_out from None
        except oa.OpenAIError as exc:
            raise _constraint_error(req, exc) from None
        timer = loop.call_at(deadline, gen.abort, timed_out)
        state.generations.add(gen)
        if req.stream:
            return await _stream(request, state, plan, gen, started)
        return await _collect(state, plan, gen, started)
    finally:
        if timer is not None:
            timer.cancel()
        state.generations.discard(gen)
        await gen.aclose()
        if admitted:  # its place on an engine is free: flow control need not wait for a report
            state.flow.finished(model.name, req.priority)
        state.metrics.in_flight.labels(endpoint, model.name).dec()
        if span.is_recording():
            _trace_usage(span, plan, gen)


async def _admit(state: GatewayState, model: ServedModel, tenant: str | None,
                 priority: int) -> None:
    """Flow control: waits while the model's engines are saturated (a 429 to shed)."""
    try:
        await state.flow.admit(model.name, tenant, priority)
    except Shed as shed:
        raise oa.OpenAIError(shed.message, status=429, code="overloaded",
                             retry_after=shed.retry_after) from None


async def _plan(
    request: web.Request,
    state: GatewayState,
    req: oa.GenerationRequest,
    model: ServedModel,
    body: dict[str, Any],
    adapter: AdapterKey | None = None,
) -> _Plan:
    choices = max(len(req.prompts), 1) * req.params.n
    if choices > oa.MAX_CHOICES:
        raise oa.OpenAIError(
            f"prompts x n must be at most {oa.MAX_CHOICES}, got {choices}", param="n"
        )
    if req.kv_transfer_params is not None and choices != 1:
        raise oa.OpenAIError("kv_transfer_params needs one prompt and n = 1",
                             param="kv_transfer_params")
    prompts = await prepare_prompts(state.tokenize_pool, model, req)
    prompt_param = "messages" if req.kind == "chat" else "prompt"
    max_param = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
    for p in prompts:
        check_length(model, len(p.token_ids), req.params.max_tokens, prompt_param, max_param)
    check_logit_bias(model, req.params.logit_bias)
    salt = cache_salt_for(request.get(TENANT_KEY), req.cache_salt)
    # The adapter is in the chain as the engine puts it there (one contract: block_hash).
    hasher = BlockHasher(model.name, model.block_size, salt, model.hash_algorithm, adapter)
    rid = oa.new_id("chatcmpl" if req.kind == "chat" else "cmpl")
    n = req.params.n
    jobs = []
    for p_idx, p in enumerate(prompts):
        hashes = hasher.chain(p.token_ids)
        for i in range(n):
            jobs.append(
                ChoiceJob(
                    index=p_idx * n + i,
                    prompt_index=p_idx,
                    prompt_ids=p.token_ids,
                    block_hashes=hashes,
                    engine_params=_engine_params(req, i),
                    client_params=req.params,
                )
            )
    return _Plan(req, model, prompts, jobs, salt, rid, adapter)


def _engine_params(req: oa.GenerationRequest, i: int) -> SamplingParams:
    """One sample's params for the engine: n = 1, seed + i, and no stop strings (the gateway
    applies them, since only it detokenizes)."""
    p = req.params
    seed = None if p.seed is None else p.seed + i
    try:
        return dataclasses.replace(p, n=1, seed=seed, stop=[], include_stop_str_in_output=False)
    except ValueError as exc:  # seed + i past the seed range
        raise oa.OpenAIError(str(exc), param="seed") from None


def _check_tool_choice(req: oa.GenerationRequest, parser: str | None) -> None:
    tools = req.constraint.tools
    if tools is not None and tools.choice == "auto" and parser is None:
        raise oa.OpenAIError(
            'tool_choice "auto" (the default with tools) needs the gateway to know the model\'s '
            'tool-call format: start it with --tool-call-parser, or send tool_choice "required", '
            '"none" or a named function',
            param="tool_choice",
        )


def _constraint_error(req: oa.GenerationRequest, exc: oa.OpenAIError) -> oa.OpenAIError:
    """The engine names ``structured_outputs`` when it cannot compile a grammar: say which
    client field it came from (response_format, tools...)."""
    c = req.constraint
    if exc.param != "structured_outputs" or c.param is None:
        return exc
    return oa.OpenAIError(c.client_message(exc.message), status=exc.status, param=c.param,
                          code=exc.code)


def _builder(state: GatewayState, plan: _Plan) -> ResponseBuilder:
    req = plan.req
    echo = None
    if req.kind == "completion" and req.echo:
        tok = plan.model.tokenizer
        echo = [p.text if p.text is not None else tok.decode(p.token_ids) for p in plan.prompts]
    return ResponseBuilder(
        req.kind,
        plan.rid,
        plan.served_name,
        {j.index: j.prompt_index for j in plan.jobs},
        want_logprobs=req.params.logprobs is not None,
        echo_texts=echo,
        prompt_logprobs=req.params.prompt_logprobs is not None,
        tools=ToolOutput.of(req.constraint.tools, state.config.tool_call_parser),
        fingerprint=plan.model.fingerprint,
    )


def _usage(plan: _Plan, gen: Generation) -> dict[str, Any]:
    prompt_tokens = sum(len(p.token_ids) for p in plan.prompts)
    completion = cached = 0
    first_of_prompt: set[int] = set()
    for job in plan.jobs:
        done, hit = gen.totals(job.index)
        completion += done
        if job.prompt_index not in first_of_prompt:  # a prompt counts once, as in OpenAI's usage
            first_of_prompt.add(job.prompt_index)
            cached += min(hit, len(job.prompt_ids))
    return oa.usage(prompt_tokens, completion, cached)


def _headers(plan: _Plan, gen: Generation) -> dict[str, str]:
    return {ENGINE_HEADER: ",".join(gen.engine_ids), "x-request-id": plan.rid}


async def _collect(
    state: GatewayState, plan: _Plan, gen: Generation, started: float
) -> web.Response:
    builder = _builder(state, plan)
    first = True
    try:
        async for delta in gen.deltas():
            if first:
                first = False
                _observe_ttft(state, plan, time.monotonic() - started)
            builder.add(delta)
    except GenerationFailed as exc:
        state.metrics.stream_errors.labels(plan.model.name).inc()
        raise oa.OpenAIError(f"generation failed: {exc}", status=502) from None
    body = builder.response(_usage(plan, gen))
    if plan.req.kv_transfer_params is not None:  # vLLM's field: the P/D leg's answer
        body["kv_transfer_params"] = gen.kv_transfer_params()
    state.metrics.e2e.labels(plan.model.name).observe(time.monotonic() - started)
    _log_done(plan, gen, "ok")
    return web.json_response(body, headers=_headers(plan, gen))


async def _stream(
    request: web.Request, state: GatewayState, plan: _Plan, gen: Generation, started: float
) -> web.StreamResponse:
    builder = _builder(state, plan)
    sse = SSEWriter(request, _headers(plan, gen))
    model = plan.model.name
    outcome = "ok"
    try:
        await sse.open()
        _observe_ttft(state, plan, time.monotonic() - started)
        for chunk in builder.opening_chunks():
            await sse.send(chunk)
        try:
            async for delta in gen.deltas():
                chunk = builder.chunk(delta)
                if plan.req.continuous_usage:  # vLLM's continuous_usage_stats
                    chunk["usage"] = _usage(plan, gen)
                if delta.finish_reason is not None and plan.req.kv_transfer_params is not None:
                    chunk["kv_transfer_params"] = gen.kv_transfer_params()  # as vLLM: the last
                await sse.send(chunk)
            if plan.req.include_usage:
                await sse.send(builder.usage_chunk(_usage(plan, gen)))
        except (GenerationFailed, oa.OpenAIError) as exc:
            outcome = "error"
            state.metrics.stream_errors.labels(model).inc()
            await sse.error(_stream_error(exc))
            return sse.response
        except ConnectionError:
            raise
        except Exception:  # the response has started: end it with an error event, never hang
            logger.exception("stream failed id=%s", plan.rid)
            outcome = "error"
            await sse.error(oa.OpenAIError("internal server error", status=500))
            return sse.response
        await sse.done()
        state.metrics.e2e.labels(model).observe(time.monotonic() - started)
    except ConnectionError:
        outcome = "client-disconnected"  # the caller's gen.aclose() aborts the engine requests
    finally:
        _log_done(plan, gen, outcome)
    return sse.response


def _stream_error(exc: Exception) -> oa.OpenAIError:
    if isinstance(exc, oa.OpenAIError):
        return exc
    return oa.OpenAIError(f"generation failed: {exc}", status=502)


def _observe_ttft(state: GatewayState, plan: _Plan, ttft_s: float) -> None:
    state.metrics.ttft.labels(plan.model.name).observe(ttft_s)
    trace.get_current_span().set_attribute("gen_ai.latency.time_to_first_token", ttft_s)


def _trace_request(span: trace.Span, plan: _Plan) -> None:
    """What the gateway span says about the request; prompt text only when
    PAGODA_TRACE_PROMPTS is on."""
    req = plan.req
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat" if req.kind == "chat" else "text_completion",
        "gen_ai.request.model": plan.model.name,
        "gen_ai.response.id": plan.rid,
        "gen_ai.usage.input_tokens": sum(len(p.token_ids) for p in plan.prompts),
        "pagoda.stream": req.stream,
        "pagoda.choices": len(plan.jobs),
    }
    if req.params.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = req.params.max_tokens
    if tracing.trace_prompts():
        tok = plan.model.tokenizer
        attrs["pagoda.prompt.text"] = [
            p.text if p.text is not None else tok.decode(p.token_ids) for p in plan.prompts
        ]
    span.set_attributes(attrs)


def _trace_usage(span: trace.Span, plan: _Plan, gen: Generation) -> None:
    use = _usage(plan, gen)
    span.set_attributes({
        "gen_ai.usage.output_tokens": use["completion_tokens"],
        "gen_ai.usage.cache_read.input_tokens": use["prompt_tokens_details"]["cached_tokens"],
        "pagoda.engine.ids": gen.engine_ids,
    })


def _log_done(plan: _Plan, gen: Generation, outcome: str) -> None:
    span = trace.get_current_span()
    span.set_attribute("pagoda.outcome", outcome)
    if outcome == "error":
        tracing.set_error(span, "generation failed after the response started")
    logger.info(
        "request done id=%s model=%s kind=%s prompts=%d choices=%d engines=%s outcome=%s",
        plan.rid,
        plan.model.name,
        plan.req.kind,
        len(plan.prompts),
        len(plan.jobs),
        ",".join(gen.engine_ids),
        outcome,
    )
