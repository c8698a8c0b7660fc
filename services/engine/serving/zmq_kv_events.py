"""vLLM's KV-event publisher: the engine's prefix-cache changes on a ZeroMQ PUB socket, in the
frames and msgpack shape vLLM sends (``--kv-events-config``), so subscribers written for vLLM
(llm-d's precise prefix scorer) follow a Pagoda engine's cache. The Redis channel is
unaffected; both are fed from the same events.

Frames: [topic, sequence (8 bytes, big-endian, from 0), payload
(``protocol.kv_events.encode_vllm_batch``)]. One batch per engine step that changed the cache.

The event loop only queues a step's events (bounded, never blocking); a thread owns the socket.
When the queue is full the batch is dropped and the core is asked to re-announce its cache
(cleared, then every cached block), which says all the dropped batches would have said; the
sequence numbers let a subscriber see the gap meanwhile. vLLM's replay socket is not offered.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from services.engine.serving.core_client import CoreClient
from services.protocol.kv_events import KVEvent, encode_vllm_batch

logger = logging.getLogger(__name__)

_UNSUPPORTED = frozenset({"replay_endpoint", "buffer_steps"})


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` keys, as vLLM names and defaults them."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" publishes; "null" (vLLM's default) does not
    endpoint: str = "tcp://*:5557"  # bound when it holds '*', '::', ipc:// or inproc://
    topic: str = ""
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches queued for the publisher thread

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got "
                             f"{self.publisher!r}")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv_events_config.endpoint must be a ZeroMQ tcp://, ipc:// or "
                             f"inproc:// address, got {self.endpoint!r}")
        for name in ("hwm", "max_queue_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"kv_events_config.{name} must be > 0")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig | None:
        """The flag's JSON object; None when absent."""
        if not text:
            return None
        try:
            obj = json.loads(text)
        except ValueError:
            raise ValueError("kv_events_config must be a JSON object") from None
        if not isinstance(obj, dict):
            raise ValueError("kv_events_config must be a JSON object")  # noqa: TRY004 -- a flag
        known = {f.name: f.type for f in fields(cls)}
        unsupported = sorted(set(obj) & _UNSUPPORTED)
        if unsupported:
            raise ValueError(f"kv_events_config: {unsupported} not supported (no replay socket)")
        unknown = sorted(set(obj) - set(known))
        if unknown:
            raise ValueError(f"kv_events_config: unknown keys {unknown}")
        for key, value in obj.items():
            want = {"bool": bool, "str": str, "int": int}[str(known[key])]
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ValueError(f"kv_events_config.{key} must be a {want.__name__}")
        return cls(**obj)


class ZmqKVEventPublisher:
    def __init__(self, config: KVEventsConfig, resync: Callable[[], None]) -> None:
        assert config.enabled
        self.config = config
        self._resync = resync
        self._queue: queue.Queue[list[KVEvent] | None] = queue.Queue(config.max_queue_size)
        self._overflowing = False
        self.num_dropped = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)

    def start(self) -> None:
        """Opens the socket (on the thread); raises if the endpoint cannot be bound."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def submit(self, events: list[KVEvent]) -> None:
        """One step's events (on the event loop: never blocks)."""
        if not events:
            return
        try:
            self._queue.put_nowait(list(events))
            self._overflowing = False
        except queue.Full:
            self.num_dropped += 1
            if not self._overflowing:
                self._overflowing = True
                logger.warning("KV-event publisher queue full: dropping batches and asking the "
                               "engine to re-announce its cache")
                self._resync()

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUB)
        try:
            sock.set_hwm(self.config.hwm)
            _open(sock, self.config.endpoint)
        except Exception as exc:  # noqa: BLE001 -- reported to start()'s caller
            self._error = exc
            sock.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        topic = self.config.topic.encode()
        seq = 0
        try:
            while (batch := self._queue.get()) is not None:
                payload = encode_vllm_batch(time.time(), batch)
                sock.send_multipart([topic, seq.to_bytes(8, "big"), payload])
                seq += 1
        finally:
            sock.close(linger=500)


def _open(sock: Any, endpoint: str) -> None:
    """vLLM's rule: a wildcard or local address is bound, any other is connected to."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


def attach(config_text: str | None, core: CoreClient, *,
           redis_drains: bool) -> ZmqKVEventPublisher | None:
    """Starts the publisher when ``--kv-events-config`` asks for one and feeds it the core's
    events (before the core starts: nothing is missed). Without Redis nothing drains the
    Redis publisher's queue, so the core's events go to ZeroMQ alone."""
    config = KVEventsConfig.parse(config_text)
    if config is None or not config.enabled:
        return None
    publisher = ZmqKVEventPublisher(config, core.request_kv_resync)
    publisher.start()
    if not redis_drains:
        core.kv_event_sinks.remove(core.kv_events.extend)
    core.kv_event_sinks.append(publisher.submit)
    logger.info("KV events on ZeroMQ endpoint=%s topic=%r", config.endpoint, config.topic)
    return publisher


def records_events(config_text: str | None) -> bool:
    config = KVEventsConfig.parse(config_text)
    return config is not None and config.enabled
