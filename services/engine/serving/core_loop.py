"""The engine core's step loop: commands in, one ``CoreOutputs`` batch out per step.

One thread owns the ``LLMEngine`` (no locks): the server's engine thread (``--engine-core
inline``) or the main thread of the engine-core process (``--engine-core process``). Either
way the loop knows nothing about sinks or event loops; it hands each step's results, the
stats snapshot and the KV events to ``emit`` in one batch, so the server side pays one
hand-over per step (one ``call_soon_threadsafe``, or one pipe message), never one per token.

KV events are recorded only when the server publishes them (``kv_events``): the loop drains
them every step, and a ``Resync`` queues the whole prefix cache after the events before it.

A feature's command (``features.server_parts``: a ``PartCommand``) goes to its part's core
service, by the part's name; its answers leave with the next batch (``CoreOutputs.replies``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from services.engine.config import EngineConfig
from services.engine.engine import EngineStats, LLMEngine, RequestUpdate
from services.engine.features import server_parts
from services.engine.features.server_parts import CoreService, PartCommand
from services.protocol.kv_events import KVEvent
from services.protocol.sampling_params import SamplingParams
from services.protocol.wire import BadRequest

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
_STEP_WINDOW = 32  # recent steps whose median is ``step_ms``

# CoreError kinds: what the server answers for a request that failed.
BAD_REQUEST = "bad_request"  # the client's input: 400 naming the field
INTERNAL = "internal"  # an engine bug while adding the request: 500
STEP_FAILED = "step_failed"  # the model step failed: 503 (or an error frame mid-stream)


@dataclass(slots=True)
class Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    adapter_name: str | None = None  # the model's adapter it runs under (None: the base)
    kv_transfer_params: dict[str, Any] | None = None
    priority: int = 0


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class Resync:
    """Re-announce the whole prefix cache as KV events ("cleared", then every cached hash)."""


@dataclass(slots=True)
class Stop:
    pass


# A part's commands may come from its own threads too (a finished read), never the server's.
Command = Add | Abort | Resync | Stop | PartCommand


@dataclass(slots=True)
class CoreError:
    request_id: str
    kind: str  # BAD_REQUEST | INTERNAL | STEP_FAILED
    message: str
    param: str | None = None


@dataclass(slots=True)
class CoreOutputs:
    """Everything the server learns from one iteration of the loop, in one message."""

    updates: list[RequestUpdate] = field(default_factory=list)
    errors: list[CoreError] = field(default_factory=list)
    stats: EngineStats | None = None
    kv_events: list[KVEvent] = field(default_factory=list)
    step_tokens: int | None = None  # tokens the step computed; None: no step ran
    step_ms: float = 0.0  # median wall time of the recent steps
    replies: list[Any] = field(default_factory=list)  # to the parts' commands (``reply_to``)
    stats_changed: bool = False  # between steps (an idle engine freed KV held for a pull)

    def __bool__(self) -> bool:
        return bool(self.updates or self.errors or self.kv_events or self.replies
                    or self.step_tokens is not None or self.stats_changed)


class CoreLoop:
    def __init__(
        self, config: EngineConfig, emit: Callable[[CoreOutputs], None], step_delay_s: float = 0.0,
        kv_events: bool = False, crash_after_steps: int = 0,
    ) -> None:
        if not step_delay_s >= 0:
            raise ValueError(f"step_delay_s must be >= 0, got {step_delay_s!r}")
        self.config = config
        self.emit = emit
        self.kv_events = kv_events
        # Fault injection (tests, drills): a sleep before every step makes a slow engine (or,
        # past --step-timeout-s, a stuck one); an exception out of the loop after this many
        # steps (0: never) a dead one.
        self.step_delay_s = step_delay_s
        self.crash_after_steps = crash_after_steps
        self._num_steps = 0
        self.engine: LLMEngine | None = None
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._step_times: deque[float] = deque(maxlen=_STEP_WINDOW)
        self._step_ms = 0.0
        self._out = CoreOutputs()
        # Requests whose grammar compiles on a worker thread before they enter the engine (a
        # cold cache in the core process): a compile must never stall the step loop.
        self._compiling: set[str] = set()
        self._compile_pool: ThreadPoolExecutor | None = None
        # The features' services for their commands, by part name (made with the engine).
        self.parts: dict[str, CoreService] = {}

    def load(self) -> LLMEngine:
        """Loads the engine, on the thread that will run it."""
        self.engine = LLMEngine(self.config, kv_events=self.kv_events)
        for part in server_parts.parts():
            service = part.core_service(self.engine, self.commands.put)
            if service is not None:
                self.parts[part.name] = service
        return self.engine

    def stop(self) -> None:
        self._stop.set()
        self.commands.put(Stop())

    def run(self) -> None:
        """Steps until ``stop`` (or a ``Stop`` command); closes the engine on the way out."""
        engine = self.engine
        assert engine is not None, "load() first"
        try:
            self.emit(CoreOutputs(stats=engine.stats()))  # heartbeats start with it
            while not self._stop.is_set():
                self._drain_commands(block=not engine.has_unfinished_requests())
                if engine.has_unfinished_requests() and not self._stop.is_set():
                    self._step()
                    self._injected_crash()
                elif engine.poll_kv_transfers():  # idle: pulled or expired blocks, new counts
                    self._out.stats_changed = True
                if self._out:
                    self._flush()
        finally:
            # Before this thread ends: tensor-parallel workers die with the thread that
            # started them, and an unannounced death reads as a failure.
            engine.close()
            if self._compile_pool is not None:
                self._compile_pool.shutdown(wait=False, cancel_futures=True)
            for service in self.parts.values():
                service.close()

    # -- commands -------------------------------------------------------------------------------

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self.commands.get(timeout=_IDLE_WAIT_S) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: Command) -> None:
        engine, out = self.engine, self._out
        if isinstance(cmd, Add):
            self._add(cmd)
        elif isinstance(cmd, Abort):
            if cmd.request_id in self._compiling:  # not in the engine yet: it never will be
                self._compiling.discard(cmd.request_id)
                out.updates.append(_aborted(cmd.request_id))
                return
            update = engine.abort_request(cmd.request_id)
            if update is not None:
                out.updates.append(update)
                out.kv_events.extend(engine.take_kv_events())
        elif isinstance(cmd, Resync):
            out.kv_events.extend(engine.take_kv_events())
            out.kv_events.extend(engine.snapshot_kv_events())
        elif isinstance(cmd, Stop):
            self._stop.set()
        else:  # a part's command: its service answers now, or later with a command it posts
            out.replies.extend(self.parts[cmd.part].handle(cmd))

    def _add(self, cmd: Add) -> None:
        spec = cmd.params.structured_outputs
        rid = cmd.request_id
        if rid in self._compiling:  # back from its compile thread (or aborted meanwhile)
            self._compiling.discard(rid)
        elif spec is not None and not self.engine.grammars.is_cached(spec):
            self._compiling.add(rid)
            if self._compile_pool is None:
                self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="core-grammar")
            self._compile_pool.submit(self._compile_then_add, cmd)
            return
        try:
            self.engine.add_request(rid, cmd.prompt_token_ids, cmd.params, cmd.cache_salt,
                                    cmd.adapter_name, cmd.kv_transfer_params, cmd.priority)
        except BadRequest as exc:  # the client's input: a 400 naming the field
            self._out.errors.append(CoreError(rid, BAD_REQUEST, str(exc), exc.param))
        except Exception as exc:  # a bug must fail this request, never the engine loop
            logger.exception("add_request failed request_id=%s", rid)
            self._out.errors.append(CoreError(
                rid, INTERNAL, f"internal engine error adding the request: {exc}"))

    def _compile_then_add(self, cmd: Add) -> None:
        # A bad grammar raises here and again (from the cache-miss path) in add_request,
        # where it becomes the request's 400.
        with contextlib.suppress(Exception):
            self.engine.grammars.compile(cmd.params.structured_outputs)
        self.commands.put(cmd)

    # -- steps ----------------------------------------------------------------------------------

    def _step(self) -> None:
        engine, out = self.engine, self._out
        start = time.perf_counter()
        if self.step_delay_s:
            self._stop.wait(self.step_delay_s)
        try:
            out.updates.extend(engine.step())
        except Exception as exc:  # a model failure must not kill the loop silently
            logger.exception("engine step failed; aborting in-flight requests")
            for rid in list(engine.requests):
                engine.abort_request(rid)
                out.errors.append(CoreError(rid, STEP_FAILED, f"engine step failed: {exc}"))
            out.kv_events.extend(engine.take_kv_events())
            return
        out.step_tokens = engine.last_step_tokens
        self._step_times.append((time.perf_counter() - start) * 1000)
        self._step_ms = statistics.median(self._step_times)
        out.kv_events.extend(engine.take_kv_events())

    def _injected_crash(self) -> None:
        self._num_steps += 1
        if self._num_steps == self.crash_after_steps:
            raise RuntimeError(f"injected fault after {self._num_steps} steps "
                               "(--debug-crash-after-steps)")

    def _flush(self) -> None:
        out, self._out = self._out, CoreOutputs()
        out.stats = self.engine.stats()
        out.step_ms = self._step_ms
        self.emit(out)


def _aborted(request_id: str) -> RequestUpdate:
    return RequestUpdate(request_id, [], [], finished=True, finish_reason="abort")
