"""The chart's internal plane: the internal credential (a generated Secret, or an existing one)
mounted into the gateway, the router and every engine; the NetworkPolicy on by default; and
the router's pod-patch right refused below Kubernetes 1.30 unless the operator accepts it, with
the admission policy forbidding ownerReferences and finalizers changes too."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.conftest import SCALE_TO_ZERO, TWO_MODELS
from tests.deploy.helpers import RELEASE, Render, flag, render
from tests.deploy.test_autoscaling_chart import ENGINE_LABELS, ROUTER_USER, admits, pod, with_cost

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk")

FULL = f"{RELEASE}-pagoda"
GATEWAY, ROUTER = f"{FULL}-gateway", f"{FULL}-router"
SECRET = f"{FULL}-internal-auth"
MOUNT = "/etc/pagoda/internal-auth"
MESH_RULE = {"ports": [{"port": 15008, "protocol": "TCP"}]}


def _workloads(r: Render) -> list[str]:
    """Every Deployment that serves or calls internal routes: gateway, router, engines."""
    return [n for n in r.names("Deployment") if n != f"{FULL}-redis"]


def _assert_mounted(r: Render, secret: str, key: str) -> None:
    names = _workloads(r)
    assert GATEWAY in names and ROUTER in names and len(names) >= 3, names
    for name in names:
        spec = r.get("Deployment", name)["spec"]["template"]["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "internal-auth"]
        assert volume["secret"]["secretName"] == secret, name
        assert volume["secret"]["items"] == [{"key": key, "path": key}], name
        c = r.container(name)
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "internal-auth"]
        assert mount == {"name": "internal-auth", "mountPath": MOUNT, "readOnly": True}, name
        assert flag(c, "internal-token-file") == f"{MOUNT}/{key}", name
        assert "insecure-no-internal-auth" not in " ".join(c.get("args") or []), name


def test_a_generated_secret_is_mounted_into_every_workload(chart: Any) -> None:
    for values in ({}, TWO_MODELS):
        r = render(chart, values)
        token = r.get("Secret", SECRET)["data"]["tokens"]
        assert len(token) >= 64  # 48 random characters, base64
        _assert_mounted(r, SECRET, "tokens")
    # Each install makes its own (lookup keeps it across upgrades in a cluster).
    assert render(chart).get("Secret", SECRET)["data"] != render(chart).get(
        "Secret", SECRET)["data"]


def test_an_existing_secret_is_used_instead(chart: Any) -> None:
    r = render(chart, {"internalAuth": {"existingSecret": "ops-internal", "secretKey": "t.txt"}})
    assert SECRET not in r.names("Secret")
    _assert_mounted(r, "ops-internal", "t.txt")


def test_network_policies_are_on_by_default(chart: Any) -> None:
    r = render(chart)
    policies = {p["metadata"]["name"]: p["spec"] for p in r.of_kind("NetworkPolicy")}
    assert set(policies) == {f"{FULL}-engine", f"{FULL}-router", f"{FULL}-gateway",
                             f"{FULL}-redis"}

    def components(rule: dict) -> list[str]:
        return [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                for p in rule["from"]]

    (engine_rule,) = policies[f"{FULL}-engine"]["ingress"]
    assert components(engine_rule) == ["gateway", "router"]
    (router_rule,) = policies[f"{FULL}-router"]["ingress"]
    assert components(router_rule) == ["gateway"]
    (redis_rule,) = policies[f"{FULL}-redis"]["ingress"]
    assert redis_rule["from"][0]["podSelector"]["matchExpressions"][0]["values"] == [
        "router", "engine"]


def test_kv_store_only_from_engines_and_extra_rules_reach_every_policy(chart: Any) -> None:
    r = render(chart, {"kvStore": {"enabled": True},
                       "networkPolicy": {"extraIngress": [MESH_RULE]}})
    policies = {p["metadata"]["name"]: p["spec"] for p in r.of_kind("NetworkPolicy")}
    assert f"{FULL}-kv-store" in policies and len(policies) == 5
    kv_from = policies[f"{FULL}-kv-store"]["ingress"][0]["from"]
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in kv_from] == [
        "engine"]
    for name, spec in policies.items():
        assert spec["ingress"][-1] == MESH_RULE, name


def test_prometheus_must_be_named_when_the_policies_are_on(chart: Any) -> None:
    with pytest.raises(helm.HelmRenderError, match="networkPolicy.metricsFrom"):
        render(chart, {"serviceMonitor": {"enabled": True}})
    render(chart, {"serviceMonitor": {"enabled": True}, "networkPolicy": {"enabled": False}})


def test_deletion_cost_below_1_30_needs_the_operators_consent(chart: Any) -> None:
    """As ``helm template --kube-version 1.29``: the SDK renders with Helm's default version,
    so the chart's ``kubeVersion`` value stands in for the cluster's."""
    old = {"kubeVersion": "v1.29.4"}
    with pytest.raises(helm.HelmRenderError, match=r"router\.deletionCost\.allowUnrestrictedPatch"):
        render(chart, old)  # deletionCost is on by default
    consent = render(chart, {**old, "router": {"deletionCost": {"allowUnrestrictedPatch": True}}})
    assert not consent.of_kind("ValidatingAdmissionPolicy")  # none exists below 1.30
    render(chart, {**old, "router": {"deletionCost": {"enabled": False}}})
    assert render(chart, {"kubeVersion": "1.30.0"}).of_kind("ValidatingAdmissionPolicy")


def test_the_admission_policy_forbids_owner_references_and_finalizers(rendered) -> None:
    r = rendered("scale-to-zero")
    assert SCALE_TO_ZERO["router"]["deletionCost"]
    mine = pod(f"{FULL}-engine-smollm2-7d9f-x2", ENGINE_LABELS)
    mine["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                           "name": "rs", "uid": "1", "controller": True}]
    assert admits(r, ROUTER_USER, mine, with_cost(mine)) == (True, "allowed")
    orphaned = with_cost(mine)
    del orphaned["metadata"]["ownerReferences"]
    assert admits(r, ROUTER_USER, mine, orphaned) == (
        False, "the router may not change a pod's ownerReferences")
    finalized = with_cost(mine)
    finalized["metadata"]["finalizers"] = ["example.com/hold"]
    assert admits(r, ROUTER_USER, mine, finalized) == (
        False, "the router may not change a pod's finalizers")
    held = {**mine, "metadata": {**mine["metadata"], "finalizers": ["example.com/hold"]}}
    released = with_cost(held)
    released["metadata"]["finalizers"] = []
    assert not admits(r, ROUTER_USER, held, released)[0]
