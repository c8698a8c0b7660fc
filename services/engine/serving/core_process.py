"""``--engine-core process``: the engine core (scheduler, runner, sampler; with tensor
parallelism rank 0, which owns the workers) in its own process, as vLLM v1 does.

The server's event loop and the step loop then each have a GIL of their own. Two one-way
pipes join them (``core_ipc`` frames the messages): commands in (add, abort, resync, stop),
read by a thread of the core process so a client never waits on a step; one ``CoreOutputs``
message out per step (every request's new tokens, the stats snapshot, the KV events), sent
by a thread of the core process so a step never waits on the server (``OutputSender``), read
by the event loop (``add_reader``), never one message per token.

Lifecycle, never a hang and no orphans:

* the core process dies (killed, crashed): the server sees its pipe close, fails the requests
  in flight, and ``on_death`` exits the server non-zero (the pod restarts); one that stops
  stepping (alive, stuck) is failed the same way by the server's ``step_watchdog``;
* the server dies: the kernel kills the core (``PR_SET_PDEATHSIG``), which kills its workers;
* SIGTERM to the server drains as before, then ``stop`` asks the core to close (its workers
  with it) and kills it if it has not within ``_STOP_GRACE_S``. The core ignores SIGINT and
  SIGTERM sent to the process group: the server decides when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from services.common.child_process import die_with_parent
from services.engine.config import EngineConfig
from services.engine.serving import core_ipc
from services.engine.serving.core_client import CoreClient
from services.engine.serving.core_loop import Command, CoreLoop, CoreOutputs, Stop
from services.engine.serving.engine_info import EngineInfo, RequestChecks
from services.engine.serving.kv_event_queue import MAX_QUEUED_KV_EVENTS

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 10.0
START_METHOD_ENV = "PAGODA_CORE_START_METHOD"


@dataclass(frozen=True, slots=True)
class _CoreArgs:
    config: EngineConfig
    step_delay_s: float
    kv_events: bool
    log_level: int
    crash_after_steps: int = 0
    # A forked core's copies of the server's pipe ends, closed first thing: then the server's
    # ends are the only ones, as when spawned (which inherits only its own).
    server_fds: tuple[int, ...] = ()


class EngineCoreProcess(CoreClient):
    """The event loop's handle on the engine-core process."""

    def __init__(
        self, config: EngineConfig, step_delay_s: float = 0.0, publish_kv_events: bool = False,
        max_kv_events: int = MAX_QUEUED_KV_EVENTS, crash_after_steps: int = 0,
    ) -> None:
        if not step_delay_s >= 0:
            raise ValueError(f"step_delay_s must be >= 0, got {step_delay_s!r}")
        super().__init__(publish_kv_events, max_kv_events)
        self.config = config
        self.step_delay_s = step_delay_s
        self.crash_after_steps = crash_after_steps  # fault injection (CoreLoop)
        self.process: multiprocessing.process.BaseProcess | None = None
        self._commands: multiprocessing.connection.Connection | None = None
        self._outputs: multiprocessing.connection.Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        method = start_method(device=self.config.torch_device().type)
        ctx = multiprocessing.get_context(method)
        cmd_read, self._commands = ctx.Pipe(duplex=False)
        self._outputs, out_write = ctx.Pipe(duplex=False)
        server_fds = ((self._commands.fileno(), self._outputs.fileno())
                      if method == "fork" else ())
        args = _CoreArgs(self.config, self.step_delay_s, self.publish_kv_events,
                         logging.getLogger().level, self.crash_after_steps, server_fds)
        self.process = ctx.Process(target=core_main, args=(args, cmd_read, out_write),
                                   name="engine-core", daemon=False)
        self.process.start()
        # Only the core holds its ends now: its death closes the pipe under our reader.
        cmd_read.close()
        out_write.close()
        loop.add_reader(self._outputs.fileno(), self._on_readable)
        logger.info("engine core process started pid=%d (%s)", self.process.pid, method)

    def stop(self, timeout: float = _STOP_GRACE_S) -> None:
        """Asks the core to close, waits for it, kills it past ``timeout`` (any thread)."""
        self._stopping = True
        proc = self.process
        if proc is None:
            return
        if proc.is_alive():
            try:
                self._commands.send_bytes(core_ipc.encode(Stop()))
            except OSError:
                pass
            proc.join(timeout)
        if proc.is_alive():
            logger.warning("engine core did not stop within %.0f s: killing it", timeout)
            proc.kill()
            proc.join(5)
        logger.info("engine core exited code=%s", proc.exitcode)

    def _send(self, cmd: Command) -> None:
        if self.died:
            return
        try:
            self._commands.send_bytes(core_ipc.encode(cmd))
        except OSError:  # the core is gone: the reader reports it
            logger.warning("engine core pipe closed while sending %s", type(cmd).__name__)

    # -- the event loop's reader ----------------------------------------------------------------

    def _on_readable(self) -> None:
        conn = self._outputs
        try:
            while conn.poll():
                self._handle(core_ipc.decode(conn.recv_bytes()))
        except (EOFError, OSError):
            self._loop.remove_reader(conn.fileno())
            self._core_gone()

    def _handle(self, msg: object) -> None:
        if isinstance(msg, CoreOutputs):
            self._dispatch(msg)
        elif isinstance(msg, list):  # the messages the core queued while it sent the last
            for m in msg:
                self._handle(m)
        elif isinstance(msg, EngineInfo):
            # A compiler of the server's own: a bad grammar is the client's 400 before the
            # request travels; the core compiles its copy off its step loop.
            self._ready(msg, RequestChecks(msg))
        elif isinstance(msg, core_ipc.LoadFailed):
            self.load_error = RuntimeError(msg.message)
        else:
            raise TypeError(f"unexpected message from the engine core: {msg!r}")

    def _core_gone(self) -> None:
        if self._stopping or self.died:  # asked to stop, or already failed (stalled)
            return
        proc = self.process
        proc.join(1)
        code = proc.exitcode
        if self.load_error is not None and code == 0:
            return  # reported its load error and left: /health says so
        logger.error("engine core process died (exit code %s): failing %d requests in flight",
                     code, self.num_in_flight)
        self.fail(f"engine core process died (exit code {code})")


def _os_threads() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no /proc (not Linux)
        return None


# The threads the imports left (numpy's OpenBLAS parks a pool thread at load, and shuts it
# down around a fork itself); any started since is somebody's work in progress.
_IMPORT_THREADS = _os_threads()


def start_method(threads: int | None = None, device: str = "cpu") -> str:
    """How the core process starts: ``PAGODA_CORE_START_METHOD`` (``fork`` or ``spawn``), else
    ``spawn`` for a ``device`` other than the CPU (a process that has asked CUDA for its devices
    cannot use CUDA in a forked child: torch refuses it), else ``fork`` while this process runs
    no thread beyond those its imports left, as at the server's startup, and ``spawn``
    otherwise. A fork inherits the modules the server imported (torch among them), where a
    spawned core imports them again, about 3 s of every start (vLLM's engine core forks by
    default too); a fork while another thread works could inherit a lock it holds, so a thread
    started since (tracing's exporter, ZMQ's I/O, an OpenMP team) means spawn. ``threads``:
    this process's OS threads (None: read from ``/proc``)."""
    chosen = os.environ.get(START_METHOD_ENV, "")
    if chosen:
        if chosen not in ("fork", "spawn"):
            raise ValueError(f"{START_METHOD_ENV} must be fork or spawn, got {chosen!r}")
        return chosen
    if device != "cpu":
        return "spawn"
    threads = _os_threads() if threads is None else threads
    if threads is None or _IMPORT_THREADS is None:
        return "spawn"  # no way to tell: the portable way
    return "fork" if threads <= _IMPORT_THREADS and threading.active_count() == 1 else "spawn"


# -- the core process ---------------------------------------------------------------------------


def core_main(args: _CoreArgs, commands: multiprocessing.connection.Connection,
              outputs: multiprocessing.connection.Connection) -> None:
    die_with_parent()
    for fd in args.server_fds:
        os.close(fd)
    # A forked core shares the server's signal wake-up socket: a signal here must not wake the
    # server's event loop (no-op when spawned).
    signal.set_wakeup_fd(-1)
    # The server decides when the core ends (it drains first): a Ctrl-C or a SIGTERM sent to
    # the whole process group must not cut the core from under it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from services.common.logs import setup_logging
    setup_logging(args.log_level, "engine-core")
    sender = OutputSender(outputs)
    core = CoreLoop(args.config, sender.send, args.step_delay_s, args.kv_events,
                    args.crash_after_steps)
    sender.on_closed = core.stop
    try:
        info = EngineInfo.of(core.load())
    except BaseException as exc:  # reported by the server's /health
        logger.exception("engine failed to load")
        outputs.send_bytes(core_ipc.encode(core_ipc.LoadFailed(f"{type(exc).__name__}: {exc}")))
        return
    threading.Thread(target=_read_commands, args=(commands, core), name="core-input",
                     daemon=True).start()
    outputs.send_bytes(core_ipc.encode(info))
    sender.start()  # after the info: the server reads it first
    try:
        core.run()
    finally:
        sender.close()  # what the last steps emitted (a drain's aborts) still goes


class OutputSender:
    """The core's messages to the server, sent by a thread of their own, so that the step loop
    never waits on the pipe. A 256-request step's updates are about 30 KB, half of a 64 KiB
    pipe: while the server's event loop wrote its streams' frames, the step loop blocked on its
    next send, and the core stepped at the pace of the server's writes. Now the server reads
    what piled up at once, and each stream's updates merge into one frame (``_coalesced``).

    The messages queued since the last send go as one frame (a list). At most ``max_queued``
    wait; past that ``send`` waits (the server is that many steps behind). The pipe closed (the
    server is gone) or a message that cannot be sent (a bug, logged): ``on_closed`` is called
    (the core stops, and the server fails its requests at once, not at the step watchdog), and
    later messages are dropped."""

    def __init__(self, conn: multiprocessing.connection.Connection,
                 max_queued: int = 64) -> None:
        self._conn = conn
        self._queue: queue.Queue[object] = queue.Queue(max_queued)
        self._closed = False
        self.on_closed: Callable[[], None] = lambda: None
        self._thread = threading.Thread(target=self._run, name="core-output", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, msg: object) -> None:
        if not self._closed:
            self._queue.put(msg)

    def close(self, timeout: float = _STOP_GRACE_S) -> None:
        """Sends what is queued, then stops the thread."""
        if self._thread.is_alive():
            with contextlib.suppress(queue.Full):  # a server that reads nothing more
                self._queue.put(_END, timeout=timeout)
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._send_until_end()
        except BaseException as exc:  # the pipe closed (the server is gone), or a bug
            if not isinstance(exc, OSError):
                logger.exception("the engine core cannot send its outputs: stopping")
            self._closed = True
            with contextlib.suppress(queue.Empty):
                while True:  # a step waiting to queue its outputs goes on
                    self._queue.get_nowait()
            self.on_closed()  # the core ends; the server sees its pipe close

    def _send_until_end(self) -> None:
        get = self._queue.get_nowait
        while True:
            batch = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while batch[-1] is not _END:
                    batch.append(get())
            end = batch[-1] is _END
            if end:
                batch.pop()
            if batch:
                self._conn.send_bytes(core_ipc.encode(batch[0] if len(batch) == 1 else batch))
            if end:
                return


_END = object()  # ``OutputSender.close``'s mark: the last message


def _read_commands(conn: multiprocessing.connection.Connection, core: CoreLoop) -> None:
    """Moves commands from the pipe to the loop's queue as they come (a blocked read holds
    no GIL); the server gone (EOF) stops the core."""
    try:
        while True:
            core.commands.put(core_ipc.decode(conn.recv_bytes()))
    except (EOFError, OSError):
        core.stop()
