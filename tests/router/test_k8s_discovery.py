"""Kubernetes discovery against kmock's API emulator (the official client's list and watch)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio
from kubernetes.config import ConfigException, incluster_config

from services.common.redis_index import KVIndexPublisher
from services.router.discovery import KubernetesDiscovery, default_api_client, endpoints_of
from tests.router.util import heartbeat, route_raw, router_client
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.asyncio

NS = "serving"
SERVICE = "llama-engines"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"


def endpoint(ip: str, pod: str, ready: bool | None = True) -> dict[str, Any]:
    conditions = {} if ready is None else {"ready": ready}
    return {"addresses": [ip], "conditions": conditions, "targetRef": {"kind": "Pod", "name": pod}}


def endpoint_slice(name: str, *endpoints: dict[str, Any], service: str = SERVICE) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
        "endpoints": list(endpoints),
    }


@pytest.fixture(autouse=True)
def no_kube_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither in-cluster config nor a kubeconfig, whatever the machine running the tests has;
    a test that wants one sets it up again."""
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.delenv(incluster_config.SERVICE_HOST_ENV_NAME, raising=False)
    monkeypatch.delenv(incluster_config.SERVICE_PORT_ENV_NAME, raising=False)


@pytest_asyncio.fixture
async def k8s() -> AsyncIterator[kmock.KubernetesEmulator]:
    async with kmock.KubernetesEmulator() as emulator:
        emulator.resources["discovery.k8s.io/v1/endpointslices"] = {}
        async with kmock.Server(emulator):
            yield emulator


@pytest_asyncio.fixture
async def proxy(k8s: kmock.KubernetesEmulator) -> AsyncIterator[TcpProxy]:
    """The router reaches the API server through this, so tests can drop its connection."""
    async with TcpProxy(k8s.servers[0].port) as p:
        yield p


@pytest_asyncio.fixture
async def discovery(proxy: TcpProxy) -> AsyncIterator[KubernetesDiscovery]:
    d = KubernetesDiscovery(
        SERVICE,
        NS,
        api_client_factory=lambda: default_api_client(proxy.url),
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
    )
    await d.start()
    yield d
    started = time.monotonic()
    await d.stop()
    assert time.monotonic() - started < 3, "stop() must not wait for the watch to time out"


async def eventually(check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def urls(d: KubernetesDiscovery) -> set[str]:
    return {e.url for e in d.current().engines}


async def test_engines_follow_ready_endpoints(
    k8s: kmock.KubernetesEmulator, discovery: KubernetesDiscovery
) -> None:
    await eventually(lambda: discovery.synced)
    assert urls(discovery) == set()

    created = await k8s.post(SLICES, json=endpoint_slice(
        "llama-a", endpoint("10.0.0.1", "pod-1"), endpoint("10.0.0.2", "pod-2", ready=False),
        endpoint("10.0.0.5", "pod-5", ready=None),
    ))  # fmt: skip
    assert created.status == 200
    await eventually(lambda: urls(discovery) == {"http://10.0.0.1:8000"})
    assert {e.name for e in discovery.current().engines} == {"pod-1"}

    # pod-2 turns ready, pod-1 stops being ready.
    await k8s.patch(f"{SLICES}/llama-a", json={"endpoints": [
        endpoint("10.0.0.1", "pod-1", ready=False), endpoint("10.0.0.2", "pod-2"),
    ]})  # fmt: skip
    await eventually(lambda: urls(discovery) == {"http://10.0.0.2:8000"})

    # A second slice adds engines; another Service's slice is ignored (kmock ignores selectors).
    await k8s.post(SLICES, json=endpoint_slice("llama-b", endpoint("10.0.1.1", "pod-3")))
    await k8s.post(SLICES, json=endpoint_slice(
        "other", endpoint("10.9.9.9", "x"), service="other-svc"))  # fmt: skip
    await eventually(lambda: urls(discovery) == {"http://10.0.0.2:8000", "http://10.0.1.1:8000"})

    await k8s.delete(f"{SLICES}/llama-a")
    await eventually(lambda: urls(discovery) == {"http://10.0.1.1:8000"})


async def test_watch_recovers_after_the_connection_drops(
    k8s: kmock.KubernetesEmulator, proxy: TcpProxy, discovery: KubernetesDiscovery
) -> None:
    await k8s.post(SLICES, json=endpoint_slice("llama-a", endpoint("10.0.0.1", "pod-1")))
    await eventually(lambda: urls(discovery) == {"http://10.0.0.1:8000"})

    await proxy.cut()
    await eventually(lambda: discovery.restarts >= 1)
    # Changes while disconnected: the relist after reconnecting must catch them.
    await k8s.delete(f"{SLICES}/llama-a")
    await k8s.post(SLICES, json=endpoint_slice("llama-b", endpoint("10.0.2.1", "pod-9")))
    await asyncio.sleep(0.3)  # a few failed reconnects, with back-off
    assert urls(discovery) == {"http://10.0.0.1:8000"}  # last known state meanwhile

    await proxy.resume()
    await eventually(lambda: urls(discovery) == {"http://10.0.2.1:8000"})
    # And the new watch streams changes again.
    await k8s.patch(f"{SLICES}/llama-b", json={"endpoints": [endpoint("10.0.2.2", "pod-10")]})
    await eventually(lambda: urls(discovery) == {"http://10.0.2.2:8000"})


async def test_router_sends_traffic_only_to_discovered_live_engines(
    k8s: kmock.KubernetesEmulator, proxy: TcpProxy, redis_url: str, publisher: KVIndexPublisher
) -> None:
    # Heartbeats carry the pod IP URL (e1) or only the pod name as engine id (e2's URL differs).
    await publisher.publish_heartbeat(heartbeat("pod-1", url="http://10.0.0.1:8000"))
    await publisher.publish_heartbeat(heartbeat("pod-2", url="http://pod-2.internal:8000"))
    async with router_client(
        redis_url=redis_url, k8s_service=SERVICE, k8s_namespace=NS, k8s_api_url=proxy.url
    ) as client:
        await _wait_ready(client)
        status, _ = await route_raw(client)
        assert status == 503  # live heartbeats, but nothing discovered yet

        await k8s.post(SLICES, json=endpoint_slice(
            "llama-a", endpoint("10.0.0.1", "pod-1"), endpoint("10.0.0.2", "pod-2", ready=False),
            endpoint("10.0.0.3", "pod-3"),  # discovered, but no heartbeat: no traffic
        ))  # fmt: skip
        await _wait_routable(client, {"pod-1"})
        await k8s.patch(f"{SLICES}/llama-a", json={"endpoints": [
            endpoint("10.0.0.1", "pod-1", ready=False), endpoint("10.0.0.2", "pod-2"),
            endpoint("10.0.0.3", "pod-3"),
        ]})  # fmt: skip
        await _wait_routable(client, {"pod-2"})  # matched by engine id = pod name
        health = await (await client.get("/health")).json()
        assert health["discovery"] == {"kind": "KubernetesDiscovery", "synced": True, "engines": 2}


async def _wait_ready(client: Any) -> None:
    deadline = time.monotonic() + 15
    while (await client.get("/ready")).status != 200:
        if time.monotonic() > deadline:
            raise AssertionError("router never became ready")
        await asyncio.sleep(0.05)


async def _wait_routable(client: Any, expected: set[str]) -> None:
    # Until the router's discovery has seen the change, a route may still find no engine (503).
    deadline = time.monotonic() + 15
    while True:
        answers = [await route_raw(client) for _ in range(4)]
        seen = {body.engine_id if status == 200 else status for status, body in answers}
        if seen == expected:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"routed to {seen}, expected {expected}")
        await asyncio.sleep(0.05)


def write_kubeconfig(tmp_path: Path, server: str, token: str) -> Path:
    """A kubeconfig (JSON is valid YAML) with a bearer token and a CA file."""
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\nplaceholder\n-----END CERTIFICATE-----\n")
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "c", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "ctx",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(kubeconfig))
    return path


def fake_incluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, token: str) -> Path:
    """What a pod sees: the service env vars and the service account's token and CA files."""
    token_file, ca = tmp_path / "sa-token", tmp_path / "sa-ca.crt"
    token_file.write_text(token)
    ca.write_text("-----BEGIN CERTIFICATE-----\nplaceholder\n-----END CERTIFICATE-----\n")
    monkeypatch.setenv(incluster_config.SERVICE_HOST_ENV_NAME, "10.96.0.1")
    monkeypatch.setenv(incluster_config.SERVICE_PORT_ENV_NAME, "443")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token_file))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    return ca


async def sent_authorizations(k8s: kmock.KubernetesEmulator, api_url: str) -> set[str | None]:
    """Runs a discovery through ``default_api_client(api_url)`` until it has listed; returns
    the Authorization headers the API server received."""
    d = KubernetesDiscovery(
        SERVICE, NS, api_client_factory=lambda: default_api_client(api_url), backoff_max_s=0.2
    )
    await d.start()
    try:
        await eventually(lambda: d.synced)
    finally:
        await d.stop()
    return {
        next((v for k, v in r.headers.items() if k.lower() == "authorization"), None)
        for r in k8s
        if r.namespace == NS
    }


async def test_api_url_keeps_the_kubeconfig_ca_and_token(
    k8s: kmock.KubernetesEmulator, proxy: TcpProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = write_kubeconfig(tmp_path, "https://kubernetes.invalid:6443", "kc-token")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))

    api = default_api_client(proxy.url)
    cfg = api.configuration
    assert cfg.host == proxy.url
    assert cfg.ssl_ca_cert == str(tmp_path / "ca.crt")
    assert cfg.get_api_key_with_prefix("BearerToken") == "Bearer kc-token"
    assert cfg.host == proxy.url, "the token-refresh hook must not restore the kubeconfig host"
    api.close()
    # Only the overriding host is ever contacted (kubernetes.invalid would never sync), and with
    # the kubeconfig's token.
    assert await sent_authorizations(k8s, proxy.url) == {"Bearer kc-token"}


async def test_api_url_keeps_the_in_cluster_ca_and_token(
    k8s: kmock.KubernetesEmulator, proxy: TcpProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = fake_incluster(tmp_path, monkeypatch, "sa-token")
    # In-cluster config wins over a kubeconfig, as in kubectl.
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path, "https://x.invalid", "kc")))

    api = default_api_client(proxy.url)
    assert api.configuration.ssl_ca_cert == str(ca)
    api.close()
    assert await sent_authorizations(k8s, proxy.url) == {"bearer sa-token"}


async def test_without_api_url_the_loaded_host_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = write_kubeconfig(tmp_path, "https://kubernetes.example:6443", "kc-token")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    api = default_api_client()
    assert api.configuration.host == "https://kubernetes.example:6443"
    assert api.configuration.ssl_ca_cert == str(tmp_path / "ca.crt")
    api.close()


async def test_api_url_without_any_config_is_used_bare_like_kubectl_proxy(
    k8s: kmock.KubernetesEmulator, proxy: TcpProxy
) -> None:
    api = default_api_client(proxy.url)
    assert api.configuration.host == proxy.url
    assert api.configuration.ssl_ca_cert is None
    assert api.configuration.api_key == {}
    api.close()
    assert await sent_authorizations(k8s, proxy.url) == {None}


async def test_no_api_url_and_no_config_is_a_clear_error() -> None:
    with pytest.raises(ConfigException, match="--k8s-api-url or KUBECONFIG"):
        default_api_client()


async def test_endpoints_of_handles_ipv6_ports_and_foreign_slices() -> None:
    s = endpoint_slice("x", endpoint("fd00::1", "p"))
    s["addressType"] = "IPv6"
    assert {e.url for e in endpoints_of(s, SERVICE, None, "http")} == {"http://[fd00::1]:8000"}
    assert {e.url for e in endpoints_of(s, SERVICE, "metrics", "http")} == {"http://[fd00::1]:9000"}
    assert endpoints_of(s, SERVICE, "grpc", "http") == frozenset()
    assert endpoints_of(s, "another", None, "http") == frozenset()
    assert endpoints_of({"metadata": {}}, SERVICE, None, "http") == frozenset()
