"""The engine core: requests in, one scheduled + executed + sampled step at a time out.

Not thread-safe: one thread owns an engine (the offline ``LLM``, or the server's core loop).
"""

from __future__ import annotations

import logging
import operator
import time
import weakref
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from services.engine.async_scheduling import StepPipeline
from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.kv_connector import registry as kv_connectors
from services.engine.kv_connector.base import ConnectorContext, KVConnector
from services.engine.kv_connector.compute_rate import ComputeRate
from services.engine.kv_connector.transfer_stats import TransferStats
from services.engine.kv_offload.tiers import KVTiers, KVTierStats
from services.engine.logit_bias import LogitBias, check_logit_bias
from services.engine.lora import manager as lora_manager
from services.engine.lora.admission import adapter_limit
from services.engine.lora.manager import LoRAStats
from services.engine.lora.request import LoRARequest
from services.engine.model_runner import ModelRunner, StepResult
from services.engine.pipeline_batches import BatchQueue
from services.engine.request import Request, RequestStatus
from services.engine.sampler import make_generator
from services.engine.scheduler import Scheduler, SchedulerOutput, SchedulingPolicy
from services.engine.structured.compiler import GrammarCompiler
from services.engine.structured.masks import GrammarState
from services.protocol import kv_transfer_params as kv_params
from services.protocol.block_hash import AdapterKey, BlockHasher, HashAlgorithm
from services.protocol.engine_api import TokenLogprobs
from services.protocol.kv_events import KVEvent
from services.protocol.sampling_params import SamplingParams
from services.protocol.wire import BadRequest

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestUpdate:
    """What one step did for one request: its new tokens, and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    arrival_time: float = 0.0  # monotonic seconds
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # the request's prompt logprobs (params.prompt_logprobs): only on its first update with
    # tokens (or its last, if it ends with none), never again
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    max_tokens: int = 0  # the client's max_tokens (0: none), for vllm:request_params_max_tokens
    kv_transfer_params: dict[str, Any] | None = None  # its KV connector's, on its last update

    def __reduce__(self) -> tuple[type[RequestUpdate], tuple]:
        # Pickled (to the server, from a core process) as its constructor's arguments: a
        # slotted dataclass's default state is a dict per object, which took twice the encode
        # and three times the decode time of a 256-request step's updates.
        return RequestUpdate, _update_args(self)


_update_args = operator.attrgetter(*(f.name for f in fields(RequestUpdate)))


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    lora: LoRAStats | None = None  # an engine with LoRA enabled: its adapters
    # The step features' counters (``StepFeature.stats``), each under its field:
    spec_decode: Any = None  # ``spec_decode.metrics.SpecDecodeStats``, if on
    kv_tiers: KVTierStats | None = None  # host memory / shared store, if on
    kv_transfer: TransferStats | None = None  # KV pulled from / served to other engines


# A step's logprobs entry for each token sampled without them: one list shared by all (its
# readers never write to it), not a new one per request per step.
_NO_LOGPROBS: list[TokenLogprobs | None] = [None]
_MAX_HASHERS = 4096  # one per cache salt seen; rebuilt on demand, so clearing is safe


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, kv_events: bool = False) -> None:
        """``kv_events``: record the prefix cache's changes for ``take_kv_events`` (the
        server's core, which publishes them, drains them every step; nobody else should)."""
        self.config = config = config or EngineConfig()
        model_path = config.model
        if model_path is None:
            from services.engine.models.default import default_model_path

            model_path = str(default_model_path())
        self.model_path = model_path
        config.check_target(model_path)  # before anything loads
        self.model_name = config.served_model_name or Path(model_path).name
        self.pipeline = StepPipeline(config.torch_device()) if self._async_scheduling() else None
        if self.pipeline is None:
            self.runner = ModelRunner(config, model_path)
        else:  # built (loaded, warmed up) on the thread that will run it: see StepPipeline
            self.runner = self.pipeline.start(lambda: ModelRunner(config, model_path))
        # ``close``, or the engine collected, or the interpreter's exit: whichever comes first.
        closers: list[KVConnector] = []  # filled below: closed before the runner
        self._release = weakref.finalize(self, _release, self.pipeline, self.runner, closers)
        self._hashers: dict[tuple[str | None, AdapterKey | None], BlockHasher] = {}
        mc = self.runner.model_config
        self.eos_token_ids = tuple(mc.eos_token_ids)
        self.max_model_len = self._resolve_max_model_len(mc.max_position_embeddings)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
            record_events=kv_events,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            adapter_limit(config.max_loras if config.enable_lora else 0),
            config.scheduling_policy,
        )
        # Pipeline stages: up to one step in flight per stage (``pipeline_batches``).
        self.batches = None if config.pipeline_parallel_size == 1 else BatchQueue(
            config.pipeline_parallel_size, self.scheduler, self._schedule, self.runner.prepare,
            self.runner.launch, self.runner.run, self._apply)
        # What moves KV in and out of the pool (--kv-transfer-config, the tier flags): the
        # scheduler and the step reach it only through the connector contract.
        self.compute_rate = ComputeRate()  # prompt tokens a second: what a KV pull must beat
        self.kv_connector = kv_connectors.build(config.kv_connector_specs(), ConnectorContext(
            config, self.runner.kv_caches, self.block_manager, self.model_name,
            self.hasher().seed, kv_events, model_path, self.compute_rate))
        self._kv_loads: list[object] = []  # connector metadata whose loads wait for a step
        self.tiers: KVTiers | None = None  # the tiers' own handle, for their stats
        if self.kv_connector is not None:
            self.scheduler.set_connector(self.kv_connector, config.kv_transfer_timeout_s)
            closers.append(self.kv_connector)
            parts = getattr(self.kv_connector, "connectors", [self.kv_connector])
            self.tiers = next((c for c in parts if isinstance(c, KVTiers)), None)
        # A running set that only decodes is scheduled from arrays when each step is applied
        # before the next is scheduled, no feature sets lookahead tokens before schedules and
        # no connector moves KV beside the steps: decided here, once.
        self.scheduler.decode_batches = (self.pipeline is None and self.batches is None
                                         and not self.runner.features.sets_lookahead
                                         and self.kv_connector is None)
        self._transfer_mark: tuple | None = None  # what poll_kv_transfers last saw
        self.transfer_stats: TransferStats | None = next(
            (c.stats for c in parts if isinstance(getattr(c, "stats", None), TransferStats)),
            None) if self.kv_connector is not None else None
        self.requests: dict[str, Request] = {}
        self.last_step_tokens = 0
        self.grammars = GrammarCompiler(str(model_path), mc.vocab_size, self.eos_token_ids)
        for module in config.lora_modules:  # --lora-modules: a bad one stops the start
            if module.base_model_name not in (None, self.model_name):
                raise ValueError(f"lora_modules: {module.name} is for base model "
                                 f"{module.base_model_name!r}, this engine serves "
                                 f"{self.model_name!r}")
            self.lora.load(module.name, module.path, lora_manager.STATIC)

    @property
    def lora(self) -> lora_manager.LoRAManager | None:
        """The engine's adapters (None unless ``enable_lora``)."""
        feature = self.runner.features.get("lora")
        return None if feature is None else feature.manager

    def _async_scheduling(self) -> bool:
        wanted = self.config.async_scheduling
        if wanted is None:  # measured per device: see README, "Async scheduling"
            wanted = self.config.torch_device().type == "cuda"
        if wanted and self.config.world_size > 1:
            # The other ranks get a step's input ids in its broadcast, before its placeholders
            # are known: tensor-parallel engines step synchronously (pipelines keep several
            # steps in flight their own way: ``pipeline_batches``).
            logger.info("async scheduling is off with tensor or pipeline parallelism")
            return False
        return wanted

    def _resolve_max_model_len(self, model_limit: int) -> int:
        wanted = self.config.max_model_len
        if wanted is None:
            return model_limit
        if wanted > model_limit:
            raise ValueError(
                f"max_model_len={wanted} exceeds the model's context of {model_limit} tokens"
            )
        return wanted

    def hasher(self, cache_salt: str | None = None, adapter: AdapterKey | None = None
               ) -> BlockHasher:
        h = self._hashers.get((cache_salt, adapter))
        if h is None:
            if len(self._hashers) >= _MAX_HASHERS:  # salts come from clients: stay bounded
                self._hashers.clear()
            h = BlockHasher(
                self.model_name,
                self.config.block_size,
                cache_salt,
                HashAlgorithm(self.config.hash_algorithm),
                adapter,
            )
            self._hashers[(cache_salt, adapter)] = h
        return h

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        lora_request: LoRARequest | str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        priority: int = 0,
    ) -> Request:
        """``lora_request``: the adapter to run under, a ``LoRARequest`` (the offline API: read
        on first use) or the name of a loaded adapter (the server); None: the base model.
        ``kv_transfer_params``: vLLM's, for the KV connector (P/D: hold the prompt's blocks
        for a decode engine, or pull them from a prefill engine). ``priority``: vLLM's (lower
        first), only with ``--scheduling-policy priority``; else non-zero is refused."""
        kv_transfer_params = kv_params.check(kv_transfer_params)
        check_priority(priority, self.config.scheduling_policy)
        if request_id in self.requests or self.scheduler.holds_blocks_of(request_id):
            raise BadRequest(f"request_id {request_id!r} is already in the engine", "request_id")
        max_tokens = self.check_request(prompt_token_ids, params)
        adapter = None
        if lora_request is not None:
            if self.lora is None:
                raise BadRequest("this engine serves no LoRA adapters (start it with "
                                 "--enable-lora)", "lora_name")
            adapter = self.lora.resolve(lora_request)
        grammar = None
        if params.structured_outputs is not None:  # a cache hit when the server compiled it
            compiled = self.grammars.compile(params.structured_outputs)
            grammar = GrammarState(compiled, self.eos_token_ids)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            hasher=self.hasher(cache_salt, None if adapter is None else adapter.key),
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            generator=None if params.seed is None else make_generator(params.seed,
                                                                      self.runner.device),
            logit_bias=LogitBias.build(params.logit_bias, self.runner.device),
            grammar=grammar,
            adapter=adapter,
            kv_transfer_params=kv_transfer_params,
            priority=priority,
        )
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Returns the request's max_tokens, or raises ``BadRequest`` (a ValueError: a 400 on
        the server) naming the field at fault: the limits only the loaded model knows."""
        return check_request(prompt_token_ids, params, self.runner.model_config.vocab_size,
                             self.max_model_len, self.runner.num_blocks, self.config.block_size)

    # -- adapters (vLLM's add_lora / remove_lora / list_loras) --------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Reads and registers an adapter (``BadRequest`` naming the field or module)."""
        if self.lora is None:
            raise BadRequest("this engine serves no LoRA adapters (start it with "
                             "--enable-lora)", "lora_name")
        self.lora.load(lora_request.lora_name, lora_request.lora_path, lora_manager.OFFLINE,
                       lora_request.lora_int_id)
        return True

    def remove_lora(self, lora: int | str) -> bool:
        """Forgets an adapter, by name or by its ``LoRARequest`` id."""
        if self.lora is None:
            return False
        if isinstance(lora, int):
            names = [n for n, r in self.lora.registered.items() if r.int_id == lora]
            return bool(names) and self.lora.unload(names[0])
        return self.lora.unload(lora)

    def list_loras(self) -> set[str]:
        return set() if self.lora is None else set(self.lora.registered)

    def abort_request(self, request_id: str) -> RequestUpdate | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort(req)
        self._release_rows()
        req.status = RequestStatus.FINISHED_ABORTED
        return self._update(req, [], [])

    def poll_kv_transfers(self) -> bool:
        """Between steps (an idle engine): frees blocks held for a pull once pulled or
        expired; True when something ``stats`` shows has changed since the last call."""
        if self.kv_connector is None:
            return False
        self.kv_connector.save_kv()  # nothing in flight: peers' pins are served now too
        self.scheduler.poll_transfers()
        s = self.transfer_stats
        mark = (self.block_manager.num_free_blocks, None if s is None else (
            s.sent.transfers, s.received.transfers, sum(s.failures.values()), s.expired))
        changed, self._transfer_mark = mark != self._transfer_mark, mark
        return changed

    def has_unfinished_requests(self) -> bool:
        # A step in flight is unfinished work even when all its requests are gone.
        return self.scheduler.has_unfinished() or (
            self.pipeline is not None and self.pipeline.in_flight is not None) or (
            self.batches is not None and self.batches.in_flight > 0)

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[RequestUpdate]:
        """One step: schedule -> execute -> the scheduler applies the result. A request the
        KV connector announced params for (a streamed P/D prefill) gets an update without
        tokens carrying them, ahead of its others."""
        updates = [
            self._update(req, req.token_ids[-len(lps):], lps)
            for req, lps in self.step_requests()
        ]
        if self.kv_connector is not None:
            announced = self.kv_connector.take_announced()
            if announced:
                updates[:0] = [self._announce(self.requests[rid], params)
                               for rid, params in announced.items() if rid in self.requests]
        return updates

    def _announce(self, req: Request, params: dict[str, Any]) -> RequestUpdate:
        return RequestUpdate(req.request_id, [], [], finished=False,
                             num_prompt_tokens=len(req.prompt_token_ids),
                             arrival_time=req.arrival_time,
                             first_scheduled_time=req.first_scheduled_time,
                             max_tokens=req.params.max_tokens or 0, kv_transfer_params=params)

    def step_requests(self) -> list[tuple[Request, list[TokenLogprobs | None]]]:
        """``step`` without building its updates (the offline ``LLM`` reads the requests):
        each request that got tokens this step, with one logprobs entry per token (None when
        not asked). The tokens are the request's last output tokens (one, or a run of several
        where a step feature sampled the step: ``StepResult.spec``); a finished request has
        left the engine.

        With async scheduling the step applied is the one in flight, and the next one is
        already running when this returns."""
        self.last_step_tokens = 0  # vllm:iteration_tokens_total: the applied step's (_apply)
        if self.batches is not None:
            return self.batches.step()
        if self.pipeline is None:
            sched = self._schedule()
            if sched.is_empty:
                return []
            started = time.monotonic()
            result = self.runner.execute(sched)
            self.compute_rate.observe(sched.num_batched_tokens, time.monotonic() - started)
            return self._apply(sched, result)
        try:
            return self._step_async(self.pipeline)
        except BaseException:
            self.pipeline.drain()
            raise

    def _step_async(
        self, pipe: StepPipeline
    ) -> list[tuple[Request, list[TokenLogprobs | None]]]:
        if pipe.in_flight is None:
            sched = self._schedule()
            if sched.is_empty:
                return []
            pipe.launch(sched, self.runner.prepare(sched))
        assert pipe.in_flight is not None
        if pipe.in_flight.needs_host:  # the next step needs this one's tokens on the host
            return self._apply(*pipe.wait())
        # Step n runs: schedule and prepare step n+1, with placeholders for step n's tokens.
        sched = self._schedule()
        step = None if sched.is_empty else self.runner.prepare(
            sched, pipe.in_flight.sampled_rows())
        done, result = pipe.wait()
        if step is not None:
            pipe.launch(sched, step, after=result)
        return self._apply(done, result)  # while step n+1 runs

    def _schedule(self) -> SchedulerOutput:
        # The features' lookahead tokens, which the scheduler then makes room for.
        self.runner.features.before_schedule(self.scheduler.running)
        sched = self.scheduler.schedule()
        self._release_rows()  # the preempted ones': before the runner gives rows to joiners
        if self.kv_connector is not None:
            self._kv_loads.append(sched.kv_connector_metadata)
            if self.pipeline is None or self.pipeline.in_flight is None:
                self._start_kv_loads()  # no step in flight writes to the blocks they fill
        return sched

    def _start_kv_loads(self) -> None:
        """Starts the connector's loads scheduled so far (called when no step that was in
        flight when their blocks were allocated can still write to them)."""
        for metadata in self._kv_loads:
            self.kv_connector.start_load_kv(metadata)
        self._kv_loads.clear()

    def _release_rows(self) -> None:
        """Gives the input-batch rows of the requests that left back at once (the step in
        flight, if any, owns copies of what it reads)."""
        batch = self.runner.input_batch
        for req in self.scheduler.take_left():
            batch.remove(req)
        for req, num_blocks in self.scheduler.take_trimmed():  # lookahead slots not kept
            if req.batch_row >= 0:
                batch.trim_blocks(req, num_blocks)

    def _apply(
        self, sched: SchedulerOutput, result: StepResult
    ) -> list[tuple[Request, list[TokenLogprobs | None]]]:
        self.last_step_tokens = sched.num_batched_tokens
        for index, scored in result.prompt_logprobs:
            sched.requests[index].prompt_logprobs.extend(scored)
        out, spec = result.sampler_output, result.spec
        num_finished = self.scheduler.num_finished
        sampled = self.scheduler.update(sched, out.token_ids, None if spec is None else spec.runs)
        self._release_rows()
        if self.kv_connector is not None:  # the step is done: its full blocks' KV is final
            self.kv_connector.save_kv()
            self._start_kv_loads()
        if spec is None:
            lps = ([_NO_LOGPROBS] * len(out.logprobs)
                   if out.logprobs.count(None) == len(out.logprobs)  # the common step: one list
                   else [[lp] for lp in out.logprobs])
        else:  # each run's tokens, as the scheduler cut it
            lps = [lp[: len(run)] for lp, run in zip(spec.logprobs, spec.runs, strict=True)]
        self.runner.features.applied(sched, result)
        if len(sampled) < len(lps):  # some had finished (or were aborted) since: no token
            kept = {id(req) for req in sampled}
            lps = [lp for req, lp in zip(sched.sampling_requests(), lps, strict=True)
                   if id(req) in kept]
        if self.scheduler.num_finished != num_finished:
            for req in sampled:
                if req.status.is_finished:  # the scheduler has already freed its blocks
                    del self.requests[req.request_id]
        return list(zip(sampled, lps, strict=True))

    def _update(
        self, req: Request, toks: list[int], lps: list[TokenLogprobs | None]
    ) -> RequestUpdate:
        # Built for every running request every step: plain reads, no properties.
        finished = req.status.is_finished
        n_out = req.num_output_tokens
        # The whole prompt is scored by the first token: send its logprobs with it, once.
        first = n_out == len(toks) and (n_out > 0 or finished)
        return RequestUpdate(
            request_id=req.request_id,
            new_token_ids=toks,
            new_logprobs=lps,
            finished=finished,
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=n_out,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            num_preemptions=req.num_preemptions,
            prompt_logprobs=(req.prompt_logprobs or None) if first else None,
            max_tokens=req.params.max_tokens or 0,
            # Until it finishes the field holds the client's params: never echoed back.
            kv_transfer_params=req.kv_transfer_params if finished and self.kv_connector else None,
        )

    @property
    def closed(self) -> bool:
        return not self._release.alive

    def close(self) -> None:
        """Releases what outlives the object: the step thread of async scheduling, a
        tensor-parallel engine's worker processes and its process group (so that another
        can start). Idempotent; runs by itself when the engine is garbage collected."""
        self._release()

    # -- observability ----------------------------------------------------------------------

    def take_kv_events(self) -> list[KVEvent]:
        events = self.block_manager.take_events()
        if self.kv_connector is not None:
            events.extend(self.kv_connector.take_events())
        return events

    def snapshot_kv_events(self) -> list[KVEvent]:
        """Every tier's cache as events ("cleared", then each tier's cached hashes)."""
        events = self.block_manager.snapshot_events()
        if self.kv_connector is not None:
            events.extend(self.kv_connector.snapshot_events())
        return events

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.loading),
            kv_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_total_blocks,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            lora=None if self.lora is None else self.lora.stats(self.scheduler.running,
                                                                self.scheduler.waiting),
            kv_tiers=None if self.tiers is None else self.tiers.snapshot_stats(),
            kv_transfer=None if self.transfer_stats is None else self.transfer_stats.snapshot(),
            **self.runner.features.stats(),
        )


def _release(pipeline: StepPipeline | None, runner: ModelRunner,
             connectors: list[KVConnector]) -> None:
    """``LLMEngine.close``'s work, given what it releases (never the engine: see
    ``weakref.finalize``)."""
    for c in connectors:  # their threads first: they read the runner's caches
        c.close()
    if pipeline is not None:
        pipeline.close()
    runner.close()


def check_priority(priority: int, policy: SchedulingPolicy) -> None:
    """vLLM's rule: a non-zero priority needs the priority policy (a 400 naming the field)."""
    if priority != 0 and policy is not SchedulingPolicy.PRIORITY:
        raise BadRequest(f"Got priority {priority} but Priority scheduling is not enabled "
                         "(start the engine with --scheduling-policy priority)", "priority")


def check_request(
    prompt_token_ids: list[int], params: SamplingParams, vocab: int, max_model_len: int,
    num_blocks: int, block_size: int,
) -> int:
    """``LLMEngine.check_request`` given the model's limits (the engine-core process's
    server side checks with these, without the engine)."""
    n = len(prompt_token_ids)
    if n == 0:
        raise BadRequest("prompt_token_ids must contain at least one token", "prompt_token_ids")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
        raise BadRequest(
            f"prompt_token_ids must be in [0, {vocab}) for this model", "prompt_token_ids"
        )
    check_logit_bias(params.logit_bias, vocab)
    if n >= max_model_len:
        raise BadRequest(
            f"prompt_token_ids has {n} tokens; the model's context is {max_model_len} "
            "tokens and at least one must be left to generate",
            "prompt_token_ids",
        )
    if params.max_tokens is not None and params.max_tokens > max_model_len:
        raise BadRequest(
            f"max_tokens={params.max_tokens} is too large: the model's context is "
            f"{max_model_len} tokens",
            "max_tokens",
        )
    # As vLLM: a prompt + max_tokens past the context generates up to the context and
    # finishes with "length".
    room = max_model_len - n
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    needed = -(-(n + max_tokens) // block_size)
    if needed > num_blocks:
        # Without max_tokens the prompt alone decides how much room is asked for.
        param = "prompt_token_ids" if params.max_tokens is None else "max_tokens"
        raise BadRequest(
            f"{param}: prompt + max_tokens need {needed} KV blocks but the pool has "
            f"{num_blocks}",
            param,
        )
    return max_tokens
