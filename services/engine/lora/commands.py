"""Loading and unloading adapters in a running engine: the commands the server sends its
engine core, and what each answers (an HTTP status the server returns as it is).

``load``: a name the engine has under the same path answers 200 and changes nothing (the
gateway's fan-out and the Redis registry's sync may both deliver one load); under another path
it is a 409 (unload it first), and so is another path while the name is being loaded (the same
path then waits for that load's answer). A runtime load's path is mapped into the adapter roots
by its text (``paths.AdapterRoots``) on the engine thread; the files are opened, read, hashed
and validated on the loader thread (``AdapterService``: one worker, so loads queue rather than
take the cores), whose result comes back to the engine thread as a ``LoadFinished`` on the
core's command queue and is registered between two steps. Steps run while a load reads.
``unload``: 200, or 404 for a name the engine does not have.

Every failure is an answer, never an exception out of the core: the caller's fault (a refused
path or adapter) a 400 naming the field, storage slower than the read deadline a 504, anything
else a 500.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from services.engine.lora.files import LoadTimeout
from services.engine.lora.manager import RUNTIME, AdapterState, LoRAManager
from services.engine.lora.paths import AdapterRoots, AdapterSource
from services.engine.lora.peft import AdapterWeights
from services.protocol.wire import BadRequest

logger = logging.getLogger(__name__)

LOAD, UNLOAD = "load", "unload"
PART = "lora"  # the commands' part of the server (``server_part``), the feature's name


@dataclass(slots=True)
class AdapterCommand:
    part: ClassVar[str] = PART  # the core loop routes it to this part's service
    op: str  # LOAD or UNLOAD
    name: str
    path: str = ""
    roots: tuple[str, ...] = ()  # the server's --lora-roots
    reply_to: int = 0  # the server's id for the answer


@dataclass(slots=True)
class AdapterReply:
    reply_to: int
    status: int  # 200, 400, 404, 409, 500 or 504
    message: str
    param: str | None = None
    adapter: AdapterState | None = None


class AdapterCore(Protocol):
    """What the server's adapter endpoints and the registry's sync use of its engine-core
    client (``serving.core_client.CoreClient``)."""

    @property
    def is_ready(self) -> bool: ...

    @property
    def stats(self) -> Any: ...  # the core's last stats (``.lora``: ``LoRAStats``), or None

    @property
    def info(self) -> Any: ...  # the engine's description (``.model_name``)

    async def command(self, cmd: AdapterCommand) -> AdapterReply: ...


@dataclass(slots=True)
class LoadFinished:
    """A read the loader thread finished (or that failed), for the engine thread."""

    part: ClassVar[str] = PART
    name: str
    future: Future[AdapterWeights]


@dataclass(slots=True)
class _Pending:
    path: str
    source: AdapterSource
    commands: list[AdapterCommand] = field(default_factory=list)  # all answered by its end


class AdapterService:
    """The engine thread's side of the adapter commands; ``post`` puts a ``LoadFinished`` on
    the engine thread's queue (called on the loader thread)."""

    def __init__(self, manager: LoRAManager | None, post: Callable[[LoadFinished], None]
                 ) -> None:
        self.manager = manager
        self.post = post
        self._pending: dict[str, _Pending] = {}
        self._loader: _Loader | None = None

    def handle(self, cmd: AdapterCommand) -> AdapterReply | None:
        """Applies ``cmd``; None when its read went to the loader (``finish`` answers it)."""
        try:
            return self._handle(cmd)
        except Exception as exc:  # noqa: BLE001 -- an answer, never a dead core
            return _error(cmd.reply_to, cmd.name, exc)

    def finish(self, done: LoadFinished) -> list[AdapterReply]:
        """Registers a finished read; the answers to every command that waited for it."""
        pending = self._pending.pop(done.name)
        try:
            weights = done.future.result()
            assert self.manager is not None
            self.manager.register(weights, RUNTIME, pending.source)
            replies = [AdapterReply(c.reply_to, 200, f"adapter {c.name!r} loaded",
                                    adapter=_state(self.manager, c.name))
                       for c in pending.commands]
        except Exception as exc:  # noqa: BLE001 -- an answer, never a dead core
            replies = [_error(c.reply_to, c.name, exc) for c in pending.commands]
        return replies

    def close(self, wait: bool = False) -> None:
        if self._loader is not None:
            self._loader.close(wait)

    def _handle(self, cmd: AdapterCommand) -> AdapterReply | None:
        manager = self.manager
        if manager is None:
            return AdapterReply(cmd.reply_to, 400, "this engine serves no LoRA adapters (start "
                                "it with --enable-lora)", "lora_name")
        if cmd.op == UNLOAD:
            if manager.unload(cmd.name):
                return AdapterReply(cmd.reply_to, 200, f"adapter {cmd.name!r} unloaded")
            return AdapterReply(cmd.reply_to, 404, f"the adapter {cmd.name!r} is not loaded",
                                "lora_name")
        entry = manager.registered.get(cmd.name)
        if entry is not None:
            if entry.path != cmd.path:
                return AdapterReply(cmd.reply_to, 409, f"the adapter {cmd.name!r} is already "
                                    f"loaded from {entry.path!r}", "lora_name")
            return AdapterReply(cmd.reply_to, 200, "already loaded",
                                adapter=_state(manager, cmd.name))
        pending = self._pending.get(cmd.name)
        if pending is not None:
            if pending.path != cmd.path:
                return AdapterReply(cmd.reply_to, 409, f"the adapter {cmd.name!r} is being "
                                    f"loaded from {pending.path!r}", "lora_name")
            pending.commands.append(cmd)
            return None
        source = AdapterRoots(cmd.roots).resolve(cmd.path)  # by its text: opens nothing
        self._pending[cmd.name] = _Pending(cmd.path, source, [cmd])
        if self._loader is None:
            self._loader = _Loader()
        future = self._loader.submit(manager.read, cmd.name, source)
        future.add_done_callback(lambda f, name=cmd.name: self.post(LoadFinished(name, f)))
        return None


_Job = tuple[Callable[..., AdapterWeights], tuple, Future]


class _Loader:
    """One daemon thread that runs reads in turn. Not a ``ThreadPoolExecutor``: its threads are
    joined at exit, and a read stuck in the kernel (a hung network mount) must not keep a
    stopping engine alive."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="lora-loader", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., AdapterWeights], *args: object) -> Future:
        future: Future[AdapterWeights] = Future()
        self._jobs.put((fn, args, future))
        return future

    def close(self, wait: bool) -> None:
        self._jobs.put(None)
        if wait:
            self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 -- the engine thread decides
                future.set_exception(exc)


def run(manager: LoRAManager | None, cmd: AdapterCommand) -> AdapterReply:
    """Applies ``cmd`` and waits for its answer (a caller without a step loop: tests, tools)."""
    finished: list[LoadFinished] = []
    service = AdapterService(manager, finished.append)
    reply = service.handle(cmd)
    service.close(wait=True)
    return reply if reply is not None else service.finish(finished[0])[0]


def _error(reply_to: int, name: str, exc: Exception) -> AdapterReply:
    if isinstance(exc, BadRequest):
        return AdapterReply(reply_to, 400, str(exc), exc.param)
    if isinstance(exc, LoadTimeout):
        logger.warning("adapter %s: %s", name, exc)
        return AdapterReply(reply_to, 504, str(exc), "lora_path")
    logger.error("adapter %s failed to load", name, exc_info=exc)
    return AdapterReply(reply_to, 500, f"internal engine error loading adapter {name!r}: "
                        f"{type(exc).__name__}: {exc}")


def _state(manager: LoRAManager, name: str) -> AdapterState:
    return next(s for s in manager.states() if s.name == name)
