"""Which engines may receive traffic: a static URL list, the EndpointSlices of a Kubernetes
Service, or (no discovery configured) every engine with a live heartbeat.

An engine gets traffic only when it is discovered AND has a live heartbeat in Redis; the two
are matched by URL or by engine id (= the pod name, the endpoint's ``targetRef.name``).

The Kubernetes watch uses the official ``kubernetes`` client, which blocks; it runs in its own
thread and hands every change to the event loop with ``loop.call_soon_threadsafe``, so the loop
never blocks and all state is touched by the loop thread only. After any error (the API
connection dropped, 410 Gone, a timeout) the thread lists again and re-watches, with
exponential back-off. ``stop()`` shuts the open stream's socket, so the thread ends at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from services.protocol.messages import EngineHeartbeat

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, Configuration

logger = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def normalize_url(url: str) -> str:
    """Lower-case scheme and host, no trailing slash: 'HTTP://Pod:8000/' -> 'http://pod:8000'."""
    parts = urlsplit(url.strip())
    if not parts.scheme or not parts.netloc:
        return url.strip().rstrip("/")
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{parts.path.rstrip('/')}"


@dataclass(frozen=True, slots=True)
class DiscoveredEngine:
    url: str  # normalized
    name: str | None = None  # pod name when known; matches the heartbeat's engine_id


@dataclass(frozen=True, slots=True)
class EngineFilter:
    """The discovered set, ready for matching heartbeats. ``open`` admits everything."""

    engines: frozenset[DiscoveredEngine]
    open: bool = False

    def admits(self, hb: EngineHeartbeat) -> bool:
        if self.open:
            return True
        url = normalize_url(hb.url)
        return any(e.url == url or e.name == hb.engine_id for e in self.engines)


class Discovery(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    @property
    def synced(self) -> bool:
        """True once the engine set is known (a Kubernetes watch has listed once)."""
        ...

    def current(self) -> EngineFilter: ...


class OpenDiscovery:
    """No discovery configured: every engine with a live heartbeat is eligible."""

    synced = True

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def current(self) -> EngineFilter:
        return EngineFilter(frozenset(), open=True)


class StaticDiscovery:
    def __init__(self, urls: tuple[str, ...] | list[str]) -> None:
        if not urls:
            raise ValueError("static discovery needs at least one engine URL")
        self._filter = EngineFilter(frozenset(DiscoveredEngine(normalize_url(u)) for u in urls))

    synced = True

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def current(self) -> EngineFilter:
        return self._filter


# ---------------------------------------------------------------------------------------------
# Kubernetes.


def endpoints_of(
    slice_obj: Mapping[str, Any], service: str, port_name: str | None, scheme: str
) -> frozenset[DiscoveredEngine]:
    """Ready engine endpoints of one EndpointSlice (a JSON dict). Not-ready, terminating or
    unknown-readiness endpoints, and slices of other Services, give nothing."""
    labels = (slice_obj.get("metadata") or {}).get("labels") or {}
    if labels.get(SERVICE_NAME_LABEL) != service:
        return frozenset()
    port = _pick_port(slice_obj.get("ports") or [], port_name)
    if port is None:
        return frozenset()
    ipv6 = slice_obj.get("addressType") == "IPv6"
    found = set()
    for ep in slice_obj.get("endpoints") or []:
        if not isinstance(ep, Mapping) or (ep.get("conditions") or {}).get("ready") is not True:
            continue
        name = (ep.get("targetRef") or {}).get("name")
        for addr in ep.get("addresses") or []:
            host = f"[{addr}]" if ipv6 else str(addr)
            found.add(DiscoveredEngine(normalize_url(f"{scheme}://{host}:{port}"), name))
    return frozenset(found)


def _pick_port(ports: list[Any], port_name: str | None) -> int | None:
    valid = [p for p in ports if isinstance(p, Mapping) and isinstance(p.get("port"), int)]
    if port_name is not None:
        valid = [p for p in valid if p.get("name") == port_name]
    elif any(p.get("name") == "http" for p in valid):
        valid = [p for p in valid if p.get("name") == "http"]
    return valid[0]["port"] if valid else None


def default_namespace() -> str:
    try:
        return _SA_NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"


def default_api_client(api_url: str | None = None) -> ApiClient:
    """A client configured like kubectl: in-cluster config in a pod, else the kubeconfig.

    ``api_url`` replaces only the host, so the CA and credentials of that config still apply
    (a bare configuration would fail TLS verification, then get 401). With ``api_url`` and no
    config at all, the client talks to ``api_url`` bare: the ``kubectl proxy`` case, where the
    proxy adds the credentials."""
    # Imported here: the client is large and only a Kubernetes-discovering router needs it.
    from kubernetes import client, config

    cfg = _load_configuration()
    if cfg is None:
        if not api_url:
            raise config.ConfigException(
                "no in-cluster config and no kubeconfig found; set --k8s-api-url or KUBECONFIG"
            )
        logger.info("no in-cluster config or kubeconfig, using api_url=%s bare", api_url)
        cfg = client.Configuration()
    if api_url:
        _override_host(cfg, api_url)
    return client.ApiClient(cfg)


def _override_host(cfg: Configuration, host: str) -> None:
    """Point ``cfg`` at ``host``. The loaders' token-refresh hook runs before every request and
    writes the loaded host back, so it is wrapped to put ``host`` back after it."""
    cfg.host = host
    refresh = cfg.refresh_api_key_hook
    if refresh is None:
        return

    def refresh_keeping_host(c: Configuration) -> None:
        refresh(c)
        c.host = host

    cfg.refresh_api_key_hook = refresh_keeping_host


def _load_configuration() -> Configuration | None:
    """In-cluster config, else the kubeconfig, in a fresh Configuration (the library's global
    default is left alone); None when neither exists."""
    from kubernetes import client, config

    try:
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        return cfg
    except config.ConfigException:
        pass
    try:
        cfg = client.Configuration()
        # KUBECONFIG is read now: the library's own default froze it when it was imported.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=cfg)
        return cfg
    except config.ConfigException:
        return None


class _Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): list again."""


class KubernetesDiscovery:
    """Watches ``discovery.k8s.io/v1`` EndpointSlices labelled
    ``kubernetes.io/service-name=<service>`` in ``namespace``."""

    def __init__(
        self,
        service: str,
        namespace: str | None = None,
        *,
        port_name: str | None = None,
        scheme: str = "http",
        api_client_factory: Callable[[], ApiClient] | None = None,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 30.0,
        watch_timeout_s: int = 240,
        on_restart: Callable[[], None] | None = None,
    ) -> None:
        if not service:
            raise ValueError("service must be a non-empty string")
        self.service = service
        self.namespace = namespace or default_namespace()
        self._port_name = port_name
        self._scheme = scheme
        self._api_client_factory = api_client_factory or default_api_client
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._watch_timeout_s = watch_timeout_s
        self._on_restart = on_restart
        # Loop-thread state.
        self._slices: dict[str, frozenset[DiscoveredEngine]] = {}
        self._filter = EngineFilter(frozenset())
        self._synced = False
        self.restarts = 0
        # Watch-thread plumbing.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stream_lock = threading.Lock()
        self._stream: Any = None

    @property
    def synced(self) -> bool:
        return self._synced

    def current(self) -> EngineFilter:
        return self._filter

    async def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("KubernetesDiscovery already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(
            target=self._run, name=f"k8s-watch-{self.service}", daemon=True
        )
        self._thread.start()
        logger.info("watching endpointslices service=%s namespace=%s", self.service, self.namespace)

    async def stop(self) -> None:
        self._stopping.set()
        self._abort_stream()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
            if self._thread.is_alive():
                logger.warning("k8s watch thread did not stop in time service=%s", self.service)
            self._thread = None

    # --- loop thread -------------------------------------------------------------------------

    def _apply(self, kind: str, name: str | None, payload: Any) -> None:
        if kind == "reset":
            self._slices = dict(payload)
            self._synced = True
        elif kind == "upsert":
            self._slices[name] = payload
        elif kind == "delete":
            self._slices.pop(name, None)
        elif kind == "restart":
            self.restarts += 1
            if self._on_restart is not None:
                self._on_restart()
            return
        engines = frozenset().union(*self._slices.values()) if self._slices else frozenset()
        if engines != self._filter.engines:
            logger.info("discovered engines service=%s count=%d", self.service, len(engines))
        self._filter = EngineFilter(engines)

    # --- watch thread ------------------------------------------------------------------------

    def _post(self, kind: str, name: str | None = None, payload: Any = None) -> None:
        loop = self._loop
        if loop is None or self._stopping.is_set():
            return
        try:
            loop.call_soon_threadsafe(self._apply, kind, name, payload)
        except RuntimeError:  # the loop closed under us
            self._stopping.set()

    def _run(self) -> None:
        from kubernetes.client import DiscoveryV1Api
        from kubernetes.client.exceptions import ApiException

        initial, cap = self._backoff
        delay = initial
        api_client = None
        try:
            while not self._stopping.is_set():
                try:
                    if api_client is None:
                        api_client = self._api_client_factory()
                    api = DiscoveryV1Api(api_client)
                    version = self._list(api)
                    delay = initial
                    while not self._stopping.is_set():
                        started = time.monotonic()
                        version = self._watch(api, version)
                        if time.monotonic() - started < 1.0:  # no tight loop on instant ends
                            self._stopping.wait(initial)
                except _Gone:
                    logger.info(
                        "endpointslice watch expired, listing again service=%s", self.service
                    )
                except ApiException as exc:
                    if exc.status == 410:
                        continue
                    delay = self._failed(exc, delay, cap)
                except Exception as exc:  # noqa: BLE001 - dropped connection, timeout, bad payload: restart
                    delay = self._failed(exc, delay, cap)
        finally:
            if api_client is not None:
                api_client.close()

    def _failed(self, exc: BaseException, delay: float, cap: float) -> float:
        if self._stopping.is_set():
            return delay
        logger.warning(
            "endpointslice watch failed service=%s retry_in=%.1fs error=%r",
            self.service,
            delay,
            exc,
        )
        self._post("restart")
        self._stopping.wait(delay)
        return min(cap, delay * 2)

    def _request_timeout(self) -> tuple[float, float]:
        return (5.0, self._watch_timeout_s + 30.0)

    def _list(self, api: Any) -> str | None:
        resp = api.list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=f"{SERVICE_NAME_LABEL}={self.service}",
            _preload_content=False,
            _request_timeout=(5.0, 30.0),
        )
        try:
            body = json.loads(resp.data)
        finally:
            resp.release_conn()
        slices = {}
        for item in body.get("items") or []:
            name = (item.get("metadata") or {}).get("name")
            if name:
                slices[name] = self._engines(item)
        self._post("reset", None, slices)
        return (body.get("metadata") or {}).get("resourceVersion")

    def _watch(self, api: Any, version: str | None) -> str | None:
        """Streams events until the server ends the watch; returns the last resourceVersion.
        Raises on errors (the caller lists again)."""
        resp = api.list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=f"{SERVICE_NAME_LABEL}={self.service}",
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=version,
            timeout_seconds=self._watch_timeout_s,
            _preload_content=False,
            _request_timeout=self._request_timeout(),
        )
        with self._stream_lock:
            self._stream = resp
        try:
            if self._stopping.is_set():
                return version
            for line in _lines(resp):
                if self._stopping.is_set():
                    break
                version = self._handle(json.loads(line), version)
        finally:
            with self._stream_lock:
                self._stream = None
            resp.release_conn()
        return version

    def _handle(self, event: Mapping[str, Any], version: str | None) -> str | None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone()
            raise RuntimeError(f"watch error: {obj.get('message')!r}")
        meta = obj.get("metadata") or {}
        version = meta.get("resourceVersion") or version
        name = meta.get("name")
        if kind in ("ADDED", "MODIFIED") and name:
            self._post("upsert", name, self._engines(obj))
        elif kind == "DELETED" and name:
            self._post("delete", name)
        return version

    def _engines(self, slice_obj: Mapping[str, Any]) -> frozenset[DiscoveredEngine]:
        try:
            return endpoints_of(slice_obj, self.service, self._port_name, self._scheme)
        except (TypeError, AttributeError, ValueError) as exc:
            logger.warning("ignoring malformed endpointslice error=%r", exc)
            return frozenset()

    def _abort_stream(self) -> None:
        with self._stream_lock:
            stream = self._stream
        if stream is not None:
            try:
                stream.shutdown()  # urllib3 >= 2.3: unblocks a read in another thread
            except Exception as exc:  # noqa: BLE001 - already closed: nothing to abort
                logger.debug("closing watch stream error=%r", exc)


def _lines(resp: Any) -> Iterator[bytes]:
    buffer = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer
