"""One client request's generation: ``n × prompts`` engine streams, merged by choice index.

``await gen.start()`` routes and opens every choice's engine stream (each asks the router,
and when an engine fails before its first token asks again excluding it, at most
``max_retries`` times), then ``gen.deltas()`` yields ``ChoiceDelta``s of all choices as they
arrive. ``await gen.aclose()`` (always, in a ``finally``: after success, an error, or the
cancellation that a client disconnect causes) cancels the readers and closes every engine
stream still open, so the engines abort and free the KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp
from opentelemetry import trace

from services.gateway.admission import FREE, EngineWait, HoldCost
from services.gateway.choice import ChoiceDecoder, ChoiceDelta
from services.gateway.engine_client import (
    EngineStream,
    EngineStreamError,
    EngineUnavailable,
    open_stream,
)
from services.gateway.engine_watch import EngineWatch
from services.gateway.metrics import GatewayMetrics
from services.gateway.models import ServedModel
from services.gateway.router_client import Routing
from services.protocol.block_hash import BlockHash
from services.protocol.engine_api import FinishedFrame, GenerateRequest, KVTransferFrame
from services.protocol.messages import RouteRequest, RouteResponse
from services.protocol.openai import OpenAIError
from services.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_QUEUE_SIZE = 256  # deltas buffered per request before the engine readers wait for the client


@dataclass(slots=True)
class ChoiceJob:
    """One engine request: one sample (choice) of one prompt."""

    index: int  # the choice index the client sees
    prompt_index: int
    prompt_ids: list[int]
    block_hashes: list[BlockHash]
    engine_params: SamplingParams  # n = 1, its own seed, no stop strings
    client_params: SamplingParams  # what the client asked (stop strings are applied here)


@dataclass(slots=True)
class Upstreams:
    """What every generation shares (one per app)."""

    session: aiohttp.ClientSession
    router: Routing
    metrics: GatewayMetrics
    max_retries: int
    connect_timeout: float
    tracer: trace.Tracer | None = None  # None: the global one (no-op unless tracing is set up)
    watch: EngineWatch | None = None  # fails over waits on engines that stopped answering
    engine_wait: EngineWait | None = None  # holds requests while their model has no engine
    pd: bool = False  # disaggregated prefill/decode: a prefill leg before each choice
    pd_min_prompt_tokens: int = 0  # ... for prompts this long; shorter ones decode directly
    # ... and the prefill engine streams the prompt's KV: the decode leg starts as soon as the
    # prefill engine admits the prompt and pulls its blocks as its chunks are computed
    pd_stream_kv: bool = False


class GenerationFailed(Exception):
    """An engine failed after the first token; the request cannot be moved any more."""


class _Wakeup:
    """Queue sentinel: look at the abort flag."""


class Generation:
    def __init__(
        self,
        up: Upstreams,
        model: ServedModel,
        request_id: str,
        jobs: Sequence[ChoiceJob],
        cache_salt: str | None,
        lora_name: str | None = None,
        hold: HoldCost = FREE,
        kv_transfer_params: dict | None = None,
        priority: int = 0,
    ) -> None:
        """``lora_name``: the LoRA adapter every choice runs under (None: the base model).
        ``hold``: what each choice costs while it waits for an engine (``EngineWait``).
        ``kv_transfer_params``: the client's, for the engine's KV connector (one choice).
        ``priority``: vLLM's, sent to the engines."""
        assert kv_transfer_params is None or len(jobs) == 1
        self._kv_params = kv_transfer_params
        self._priority = priority
        self._up = up
        self._lora = lora_name
        self._hold = hold
        self._model = model
        self.request_id = request_id
        self._jobs = list(jobs)
        self._salt = cache_salt
        self._streams: list[EngineStream] = []
        self._decoders = [
            ChoiceDecoder(j.index, model.tokenizer, j.prompt_ids, j.client_params) for j in jobs
        ]
        self._queue: asyncio.Queue[ChoiceDelta | GenerationFailed | OpenAIError | _Wakeup] = (
            asyncio.Queue(_QUEUE_SIZE))
        self._readers: list[asyncio.Task[None]] = []
        self._prefills: list[asyncio.Task[None]] = []  # streamed prefill legs still running
        self._abort: OpenAIError | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        tasks = [asyncio.create_task(self._open(job)) for job in self._jobs]
        try:
            await _all_or_first_error(tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, EngineStream):
                    result.close()
            raise
        self._streams = [t.result() for t in tasks]

    async def aclose(self) -> None:
        for t in [*self._readers, *self._prefills]:
            t.cancel()
        if self._readers or self._prefills:
            await asyncio.gather(*self._readers, *self._prefills, return_exceptions=True)
        for s in self._streams:
            s.close()

    def abort(self, err: OpenAIError) -> None:
        """Ends the generation from outside (timeout, server shutdown): ``deltas()`` raises
        ``err``."""
        self._abort = err
        for t in self._readers:
            t.cancel()
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(_Wakeup())

    @property
    def engine_ids(self) -> list[str]:
        """The engines serving this request, each once, in choice order."""
        return list(dict.fromkeys(s.engine_id for s in self._streams))

    def totals(self, index: int) -> tuple[int, int]:
        """(completion tokens, cached prompt tokens) of choice ``index`` so far."""
        t = self._decoders[self._position(index)].totals
        return t.completion_tokens, t.cached_tokens

    def kv_transfer_params(self) -> dict | None:
        """What the engine's KV connector returned for the (one) choice, once finished."""
        return self._decoders[0].kv_transfer_params if self._decoders else None

    def _position(self, index: int) -> int:
        for pos, job in enumerate(self._jobs):
            if job.index == index:
                return pos
        raise KeyError(index)

    # -- streaming ---------------------------------------------------------------------------

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas as they arrive; the last one of each has a finish_reason.
        Raises GenerationFailed when an engine fails mid-stream, an OpenAIError (500) when
        its output could not be decoded, or the abort error."""
        self._readers = [
            asyncio.create_task(self._read(stream, decoder))
            for stream, decoder in zip(self._streams, self._decoders, strict=True)
        ]
        remaining = len(self._readers)
        while remaining:
            item = await self._queue.get()
            if self._abort is not None:
                raise self._abort
            if isinstance(item, GenerationFailed | OpenAIError):
                raise item
            if isinstance(item, _Wakeup):
                continue
            if item.finish_reason is not None:
                remaining -= 1
            yield item

    async def _read(self, stream: EngineStream, decoder: ChoiceDecoder) -> None:
        watch = self._up.watch
        if watch is not None:
            watch.add_stream(stream.engine_id, stream)
        try:
            async for frame in stream.frames():
                delta = decoder.on_frame(frame)
                if (delta.text or delta.logprobs or delta.finish_reason is not None
                        or delta.prompt_logprobs is not None):
                    await self._queue.put(delta)
                if decoder.finished:
                    return
        except EngineStreamError as exc:
            logger.warning(
                "engine failed mid-stream request_id=%s engine=%s: %s",
                self.request_id,
                stream.engine_id,
                exc,
            )
            await self._queue.put(GenerationFailed(str(exc)))
        except Exception:  # noqa: BLE001 -- a bug decoding (detokenizer, parser): fail it now
            # Never a silent reader death: the client would wait out the request timeout.
            # Closing the stream (below) aborts the request in the engine.
            logger.exception("decoding the engine's output failed request_id=%s engine=%s",
                             self.request_id, stream.engine_id)
            await self._queue.put(OpenAIError("internal error decoding the engine's output",
                                              status=500))
        finally:
            if watch is not None:
                watch.remove_stream(stream.engine_id, stream)
            stream.close()  # a stop string ended it early: the engine aborts the rest

    # -- routing with retries ---------------------------------------------------------------

    async def _open(self, job: ChoiceJob) -> EngineStream:
        up, model = self._up, self._model
        exclude: list[str] = []
        attempts = up.max_retries + 1
        kv_params, role, picked = self._kv_params, None, None
        if up.pd and kv_params is None:  # the client drives no legs itself: the gateway does
            role = "decode"
            kv_params, picked = await self._pd_legs(job)
        layout = kv_params.get("kv_layout") if role == "decode" and kv_params else None
        for attempt in range(attempts):
            route = picked if picked is not None and not attempt else await self._route(
                job, exclude, role, layout)
            rid = f"{self.request_id}-{job.index}" + (f"-r{attempt}" if attempt else "")
            req = GenerateRequest(rid, job.prompt_ids, job.engine_params, self._salt, self._lora,
                                  kv_params if kv_params is not None else _peer_pull(route),
                                  self._priority)
            guard = (up.watch.guard(route.engine_id, route.url) if up.watch is not None
                     else contextlib.nullcontext())
            try:
                async with guard:
                    return await open_stream(
                        up.session, route.engine_id, route.url, req, up.connect_timeout,
                        up.tracer,
                    )
            except (EngineUnavailable, TimeoutError) as exc:  # TimeoutError: declared dead
                logger.warning(
                    "engine failed before the first token request_id=%s engine=%s "
                    "attempt=%d/%d: %s",
                    self.request_id,
                    route.engine_id,
                    attempt + 1,
                    attempts,
                    exc or "it stopped answering",
                )
                exclude.append(route.engine_id)
                if attempt + 1 < attempts:
                    up.metrics.engine_retries.labels(model.name).inc()
        raise OpenAIError(
            f"no engine could serve the request ({attempts} tried)",
            status=503,
            code="engine_unavailable",
        )


    async def _pd_legs(self, job: ChoiceJob) -> tuple[dict | None, RouteResponse | None]:
        """Selective P/D: the prefill leg's params (None: no prefill leg, or it failed; the
        decode engine computes the prompt) and the decode engine already picked (None: the
        caller routes the decode leg).

        Only the part of the prompt the decode engine must compute counts against
        ``pd_min_prompt_tokens``: a prompt at least that long first gets its decode engine
        (the router weighs prefix, load and the peer tier for a leg that computes its
        prompt), and the leading blocks it holds or pulls from a peer are subtracted. The
        engine is kept for the decode leg unless the prefill engine's blocks are of another
        KV layout (a rollout: the router then pairs one that shares it)."""
        up, model = self._up, self._model
        threshold, n = up.pd_min_prompt_tokens, len(job.prompt_ids)
        if n < threshold:
            up.metrics.pd_legs.labels(model.name, "short").inc()
            return None, None
        picked = None
        if threshold:  # 0: every prompt has a prefill leg, no need to weigh what is cached
            picked = await self._route(job, [], "decode")
            lent = picked.kv_peer.blocks if picked.kv_peer is not None else 0
            if n - max(picked.matched_blocks, lent) * model.block_size < threshold:
                up.metrics.pd_legs.labels(model.name, "cached").inc()
                return None, picked
        up.metrics.pd_legs.labels(model.name, "prefill").inc()
        kv_params = await self._prefill(job)
        if picked is not None and kv_params is not None and \
                kv_params.get("kv_layout") != picked.kv_layout:
            picked = None
        return kv_params, picked

    async def _prefill(self, job: ChoiceJob) -> dict | None:
        """The prefill leg: the prompt on a prefill engine, which holds its KV; returns the
        params that tell the decode engine where to pull it, or None when the leg failed (the
        decode engine then computes the prompt itself)."""
        up = self._up
        rid = f"{self.request_id}-{job.index}-prefill"
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        kv = {"do_remote_decode": True, **({"kv_stream": True} if up.pd_stream_kv else {})}
        stream = None
        try:
            route = await self._route(job, [], "prefill")
            req = GenerateRequest(rid, job.prompt_ids, params, self._salt, self._lora, kv,
                                  self._priority)
            stream = await open_stream(up.session, route.engine_id, route.url, req,
                                       up.connect_timeout, up.tracer)
            async for frame in stream.frames():
                if isinstance(frame, KVTransferFrame):  # streamed: the decode leg starts now
                    self._prefills.append(asyncio.create_task(self._prefill_runs_on(stream)))
                    stream = None  # closed by that task, once the prefill finished
                    return frame.kv_transfer_params
                if isinstance(frame, FinishedFrame):
                    return frame.kv_transfer_params
        except (OpenAIError, EngineUnavailable, EngineStreamError, TimeoutError) as exc:
            logger.warning("prefill leg failed request_id=%s: %s: the decode engine computes "
                           "the prompt", self.request_id, exc)
        finally:
            if stream is not None:
                stream.close()
        return None

    async def _prefill_runs_on(self, stream: EngineStream) -> None:
        """A streamed prefill leg while the decode leg pulls its KV: its stream stays open
        until it finishes (closing it would abort the prefill). A failure here costs the decode
        engine a recompute of what it has not pulled, never the client an error."""
        try:
            async for frame in stream.frames():
                if isinstance(frame, FinishedFrame):
                    return
        except EngineStreamError as exc:
            logger.warning("streamed prefill leg failed request_id=%s: %s: the decode engine "
                           "computes what it did not pull", self.request_id, exc)
        finally:
            stream.close()

    async def _route(self, job: ChoiceJob, exclude: list[str], role: str | None = None,
                     kv_layout: str | None = None) -> RouteResponse:
        """The router's choice; a first ask may wait for an engine (``EngineWait``)."""
        up, model = self._up, self._model

        async def ask(waited_s: float) -> RouteResponse:
            return await up.router.route(
                RouteRequest(
                    model=model.name,
                    block_hashes=job.block_hashes,
                    prompt_len=len(job.prompt_ids),
                    exclude=list(exclude),
                    request_id=self.request_id,
                    waited_s=waited_s,
                    lora_name=self._lora,
                    role=role,
                    kv_layout=kv_layout if isinstance(kv_layout, str) else None,
                )
            )

        if exclude or up.engine_wait is None:
            return await ask(0.0)
        return await up.engine_wait.route(model.name, ask, self._hold)


def _peer_pull(route: RouteResponse) -> dict | None:
    """The params that tell the chosen engine to pull the prompt's prefix from the peer the
    router named (Pagoda's ``pull_prefix_from``; a client may never send it: the gateway
    refuses it at its edge, so only an address from the router's view of live engines of
    this model and KV layout is ever dialled)."""
    peer = route.kv_peer
    if peer is None:
        return None
    return {"pull_prefix_from": {"engine_id": peer.engine_id, "address": peer.address,
                                 "blocks": peer.blocks}}


async def _all_or_first_error(tasks: list[asyncio.Task[EngineStream]]) -> None:
    """Waits until every task succeeded, or raises the first error one of them raised."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
