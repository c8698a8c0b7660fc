"""Engine pods' controller.kubernetes.io/pod-deletion-cost, written by the router on kmock's
Kubernetes API: the engine that served a hot prefix gets the higher cost, pods outside the
engines' Service are never touched, and unchanged values are not written again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio
from kubernetes.config import incluster_config

from services.common.redis_index import KVIndexPublisher
from services.router.deletion_cost import ANNOTATION, quantized
from services.router.server import DELETION_COST_KEY, ROUTER_KEY
from tests.router.test_k8s_discovery import NS, SERVICE, SLICES, endpoint, endpoint_slice
from tests.router.util import chain, heartbeat, route, router_client, stored

pytestmark = pytest.mark.asyncio

PODS = f"/api/v1/namespaces/{NS}/pods"
HOT, COLD, STRANGER = "engine-hot", "engine-cold", "someone-elses-pod"


@pytest.fixture(autouse=True)
def no_kube_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.delenv(incluster_config.SERVICE_HOST_ENV_NAME, raising=False)
    monkeypatch.delenv(incluster_config.SERVICE_PORT_ENV_NAME, raising=False)


def pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS}}


@pytest_asyncio.fixture
async def k8s() -> AsyncIterator[kmock.KubernetesEmulator]:
    async with kmock.KubernetesEmulator() as emulator:
        emulator.resources["discovery.k8s.io/v1/endpointslices"] = {}
        emulator.resources["v1/pods"] = {}
        async with kmock.Server(emulator):
            for name in (HOT, COLD, STRANGER):
                assert (await emulator.post(PODS, json=pod(name))).status == 200
            created = await emulator.post(SLICES, json=endpoint_slice(
                "engines-a", endpoint("10.0.0.1", HOT), endpoint("10.0.0.2", COLD)))
            assert created.status == 200
            yield emulator


async def annotations(k8s: kmock.KubernetesEmulator) -> dict[str, str | None]:
    out = {}
    for name in (HOT, COLD, STRANGER):
        body = await (await k8s.get(f"{PODS}/{name}")).json()
        out[name] = ((body["metadata"].get("annotations")) or {}).get(ANNOTATION)
    return out


def patches(k8s: kmock.KubernetesEmulator) -> list[kmock.Request]:
    return [r for r in k8s if r.method == "PATCH" and "/pods/" in r.url.path]


async def test_the_engine_serving_a_hot_prefix_costs_more_to_delete(
    k8s: kmock.KubernetesEmulator, redis_url: str, publisher: KVIndexPublisher
) -> None:
    api_url = f"http://127.0.0.1:{k8s.servers[0].port}"
    for name, ip in ((HOT, "10.0.0.1"), (COLD, "10.0.0.2")):
        await publisher.publish_heartbeat(heartbeat(name, url=f"http://{ip}:8000"))
    hot_prefix = chain(8, start=1)
    await publisher.apply_events(HOT, "test-model", [stored(hot_prefix)])
    async with router_client(redis_url=redis_url, k8s_service=SERVICE, k8s_namespace=NS,
                             k8s_api_url=api_url, deletion_cost_interval_s=0.2,
                             deletion_cost_window_s=5.0) as client:
        updater = client.app[DELETION_COST_KEY]
        discovery = client.app[ROUTER_KEY].discovery
        deadline = time.monotonic() + 10
        while len(discovery.current().engines) < 2:  # the EndpointSlice watch has listed
            assert time.monotonic() < deadline, "engines not discovered"
            await asyncio.sleep(0.02)
        for _ in range(5):  # the hot prefix, again and again: each lands on its engine
            assert (await route(client, hot_prefix)).engine_id == HOT
        for i in range(5):  # prompts nobody holds: no prefix hit anywhere
            await route(client, chain(8, start=100 + i))
        # A pass may run between the routes above and write a partial count first (16 after
        # two of the five): wait for the final value, not for the first one written.
        final = str(quantized(5 * 8))
        deadline = time.monotonic() + 10
        while (seen := await annotations(k8s))[HOT] != final or seen[COLD] is None:
            assert time.monotonic() < deadline, seen
            await asyncio.sleep(0.05)
        assert int(seen[HOT]) > int(seen[COLD]) == 0
        assert seen[STRANGER] is None  # not an engine of this router: never patched
        assert all(r.headers["Content-Type"] == "application/merge-patch+json"
                   for r in patches(k8s))
        # Nothing changed: the next passes write nothing.
        written = len(patches(k8s))
        await asyncio.sleep(1.0)
        assert len(patches(k8s)) == written
        assert {r.url.path.rsplit("/", 1)[-1] for r in patches(k8s)} == {HOT, COLD}
        assert updater.written == {HOT: 40, COLD: 0}


async def test_costs_are_rounded_to_two_significant_digits() -> None:
    assert [quantized(v) for v in (0, 7, 99, 100, 12345, 987654)] == [
        0, 7, 99, 100, 12000, 980000]
    assert quantized(10**12) == 2_100_000_000  # int32, as the annotation must be
    assert quantized(-5) == 0
