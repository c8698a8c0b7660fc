"""The chart's autoscaling pieces: KEDA ScaledObjects on the routers' demand metrics (scale to
zero, two triggers, HPA behaviour), the gateway's hold while no engine is ready, the engines'
--shutdown-timeout within their grace period, and the router's right to patch pods, which the
rendered Role and admission policy must limit to this release's engine pods and to the
deletion-cost annotation (both evaluated here: RBAC's rules, and the policy's CEL with
cel-python)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest

from tests.deploy.conftest import SCALE_TO_ZERO
from tests.deploy.helpers import NAMESPACE, RELEASE, Render, flag, render

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk")
celpy = pytest.importorskip("celpy", reason="pip install cel-python")

FULL = f"{RELEASE}-pagoda"
GATEWAY, ROUTER = f"{FULL}-gateway", f"{FULL}-router"
ENGINE = f"{FULL}-engine-smollm2"
SERVED = "SmolLM2-135M-Instruct"
ROUTER_USER = f"system:serviceaccount:{NAMESPACE}:{ROUTER}"
COST = "controller.kubernetes.io/pod-deletion-cost"


def test_scale_to_zero_renders_two_triggers_and_the_hold(rendered) -> None:
    r = rendered("scale-to-zero")
    assert "replicas" not in r.get("Deployment", ENGINE)["spec"]  # KEDA owns it
    spec = r.get("ScaledObject", ENGINE)["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 8)
    assert (spec["cooldownPeriod"], spec["pollingInterval"]) == (120, 15)
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert behavior["scaleDown"] == {
        "stabilizationWindowSeconds": 300,
        "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
    }
    queue, arrivals = spec["triggers"]
    assert [queue["name"], arrivals["name"]] == ["router-queue", "arrival-rate"]
    for trigger in (queue, arrivals):
        assert trigger["metadata"]["activationThreshold"] == "0"  # any demand wakes it
    # The gateway holds requests while an engine starts; the router annotates pods.
    gateway = r.container(GATEWAY)
    assert flag(gateway, "engine-wait-timeout") == "240"
    assert flag(gateway, "engine-wait-max-requests") == "64"
    router = r.container(ROUTER)
    assert flag(router, "deletion-cost") == "true"
    assert flag(router, "deletion-cost-interval-s") == "5"
    assert flag(router, "deletion-cost-window-s") == "600"
    # The engines drain for the --shutdown-timeout asked, within the grace period.
    pod = r.get("Deployment", ENGINE)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert flag(c, "shutdown-timeout") == "120"
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pre_stop + 120 + 5 <= pod["terminationGracePeriodSeconds"]


def test_the_behavior_is_a_valid_hpa_behavior(rendered) -> None:
    """KEDA hands ``advanced.horizontalPodAutoscalerConfig.behavior`` to the HPA it creates:
    it must be a valid autoscaling/v2 behavior (the ScaledObject's own CRD is not in
    kubernetes-validate's schemas, the HPA is)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    so = rendered("scale-to-zero").get("ScaledObject", ENGINE)
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "keda-hpa-" + ENGINE, "namespace": NAMESPACE},
        "spec": {
            "scaleTargetRef": so["spec"]["scaleTargetRef"],
            "minReplicas": 1,
            "maxReplicas": so["spec"]["maxReplicaCount"],
            "behavior": so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
        },
    }
    for version in ("1.29.0", "1.33.0"):
        kubernetes_validate.validate(hpa, version, strict=True)


def test_the_queries_name_metrics_the_router_exports(rendered) -> None:
    from services.router.metrics import RouterMetrics

    metrics = RouterMetrics()
    for gauge in (metrics.requests_waiting, metrics.requests_in_flight, metrics.arrival_rate):
        gauge.labels(model=SERVED).set(1)
    exported = {s.name for m in metrics.registry.collect() for s in m.samples
                if s.labels == {"model": SERVED}}
    for trigger in rendered("scale-to-zero").get("ScaledObject", ENGINE)["spec"]["triggers"]:
        query = trigger["metadata"]["query"]
        (name,) = re.findall(r"pagoda_router_\w+", query)
        assert name in exported, query
        assert f'model="{SERVED}"' in query and f'namespace="{NAMESPACE}"' in query


@pytest.mark.parametrize(
    ("keda", "name", "query"),
    [
        ({}, "router-queue", f'max(pagoda_router_requests_waiting{{namespace="{NAMESPACE}",'
                             f'model="{SERVED}"}})'),
        ({"metric": "routerInFlight"}, "router-in-flight",
         f'max(pagoda_router_requests_in_flight{{namespace="{NAMESPACE}",model="{SERVED}"}})'),
        ({"metric": "engineWaiting"}, "engine-waiting",
         f'sum(vllm:num_requests_waiting{{namespace="{NAMESPACE}",model_name="{SERVED}"}})'),
        ({"query": "sum(my_queue)", "metric": "engineWaiting"}, "query", "sum(my_queue)"),
    ],
)
def test_the_scaling_metric_is_selectable(chart: Any, keda: dict, name: str, query: str) -> None:
    r = render(chart, {"keda": {"enabled": True, **keda}})
    first = r.get("ScaledObject", ENGINE)["spec"]["triggers"][0]
    assert (first["name"], first["metadata"]["query"]) == (name, query)


def test_the_arrival_trigger_can_be_left_out_and_a_model_overrides_keda(chart: Any) -> None:
    r = render(chart, {
        "keda": {"enabled": True, "arrivalTrigger": {"enabled": False}},
        "models": [{"name": "smollm2", "source": {"type": "builtin"},
                    "keda": {"minReplicaCount": 0, "maxReplicaCount": 2}}],
    })  # fmt: skip
    spec = r.get("ScaledObject", ENGINE)["spec"]
    assert [t["name"] for t in spec["triggers"]] == ["router-queue"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 2)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"engine": {"shutdownTimeoutSeconds": 290}},
         "engine.shutdownTimeoutSeconds (290) does not fit in engine.terminationGracePeriodSeconds"
         " (300) after engine.preStopSleepSeconds (10) and 5 s to exit: at most 285"),
        ({"gateway": {"engineWait": {"timeoutSeconds": 600}}},
         "gateway.engineWait.timeoutSeconds must be less than gateway.requestTimeoutSeconds"),
        ({"keda": {"enabled": True, "minReplicaCount": 5, "maxReplicaCount": 2}},
         "keda.minReplicaCount must not exceed keda.maxReplicaCount"),
        ({"keda": {"metric": "kv-usage"}}, "at '/keda/metric'"),
        ({"keda": {"behavior": {"scaleDown": {"policies": [{"type": "Pods"}]}}}},
         "at '/keda/behavior/scaleDown/policies/0': missing properties"),
    ],
)  # fmt: skip
def test_autoscaling_values_that_cannot_work_fail(chart: Any, values: dict, message: str) -> None:
    with pytest.raises(helm.HelmError) as info:
        chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(info.value)


def test_shutdown_timeout_defaults_to_the_grace_period_left(rendered) -> None:
    c = rendered("defaults").container(ENGINE)
    assert flag(c, "shutdown-timeout") == str(300 - 10 - 5)
    assert flag(rendered("defaults").container(GATEWAY), "engine-wait-timeout") == "180"


# --------------------------------------------------------------------------------------------
# Who may patch which pod: RBAC (the rendered Role and RoleBinding), then admission (the
# rendered ValidatingAdmissionPolicy, its CEL run by cel-python, as the API server runs it).


@dataclass(frozen=True)
class Attempt:
    user: str
    verb: str
    resource: str
    namespace: str
    subresource: str = ""


def rbac_allows(r: Render, a: Attempt) -> bool:
    """Kubernetes RBAC over what the chart renders (Roles and RoleBindings; it renders no
    cluster-wide role): some binding in the request's namespace names the user and points at
    a Role of that namespace with a rule for the verb, the group and the (sub)resource."""
    assert not r.of_kind("ClusterRole") and not r.of_kind("ClusterRoleBinding")
    resource = f"{a.resource}/{a.subresource}" if a.subresource else a.resource
    roles = {role["metadata"]["name"]: role for role in r.of_kind("Role")
             if role["metadata"]["namespace"] == a.namespace}
    for binding in r.of_kind("RoleBinding"):
        if binding["metadata"]["namespace"] != a.namespace:
            continue
        names = {f"system:serviceaccount:{s['namespace']}:{s['name']}"
                 for s in binding["subjects"] if s["kind"] == "ServiceAccount"}
        role = roles.get(binding["roleRef"]["name"])
        if a.user not in names or role is None:
            continue
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"], rule  # no wildcard grants
            if (a.verb in rule["verbs"] and resource in rule["resources"]
                    and "" in rule["apiGroups"] and not rule.get("resourceNames")):
                return True
    return False


def pod(name: str, labels: dict[str, str], annotations: dict[str, str] | None = None) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "labels": labels}
    if annotations is not None:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "engine", "image": "pagoda/engine:0.1.0"}]}}


ENGINE_LABELS = {"app.kubernetes.io/name": "pagoda", "app.kubernetes.io/instance": RELEASE,
                 "app.kubernetes.io/component": "engine", "pagoda.io/model": "smollm2"}


def admits(r: Render, user: str, old: dict, new: dict) -> tuple[bool, str]:
    """The rendered policy's verdict on an UPDATE of ``old`` into ``new`` by ``user``."""
    (policy,) = r.of_kind("ValidatingAdmissionPolicy")
    (binding,) = r.of_kind("ValidatingAdmissionPolicyBinding")
    spec = policy["spec"]
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["matchResources"]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["pods"] and "UPDATE" in rule["operations"]
    env = celpy.Environment()
    activation = {
        "object": celpy.json_to_cel(new),
        "oldObject": celpy.json_to_cel(old),
        "request": celpy.json_to_cel({"operation": "UPDATE", "userInfo": {"username": user},
                                      "namespace": NAMESPACE}),
    }

    def run(expression: str) -> bool:
        return bool(env.program(env.compile(expression)).evaluate(activation))

    if not all(run(c["expression"]) for c in spec["matchConditions"]):
        return True, "not matched"
    for check in spec["validations"]:
        if not run(check["expression"]):
            return False, check["message"]
    return True, "allowed"


def with_cost(p: dict, value: str = "40") -> dict:
    out = {**p, "metadata": {**p["metadata"]}}
    out["metadata"]["annotations"] = {**(p["metadata"].get("annotations") or {}), COST: value}
    return out


def test_the_router_may_patch_only_its_release_engine_pods(rendered) -> None:
    r = rendered("scale-to-zero")
    # RBAC: patch on pods of the release's namespace, and nothing more.
    assert rbac_allows(r, Attempt(ROUTER_USER, "patch", "pods", NAMESPACE))
    for refused in (
        Attempt(ROUTER_USER, "patch", "pods", "another-namespace"),
        Attempt(ROUTER_USER, "delete", "pods", NAMESPACE),
        Attempt(ROUTER_USER, "create", "pods", NAMESPACE),
        Attempt(ROUTER_USER, "update", "pods", NAMESPACE),
        Attempt(ROUTER_USER, "get", "pods", NAMESPACE),
        Attempt(ROUTER_USER, "patch", "pods", NAMESPACE, subresource="status"),
        Attempt(ROUTER_USER, "create", "pods", NAMESPACE, subresource="eviction"),
        Attempt(ROUTER_USER, "patch", "deployments", NAMESPACE),
        Attempt(f"system:serviceaccount:{NAMESPACE}:{FULL}", "patch", "pods", NAMESPACE),
    ):
        assert not rbac_allows(r, refused), refused
    # Admission: within the namespace, only this release's engine pods, only the annotation.
    mine = pod(f"{ENGINE}-7d9f-x2", ENGINE_LABELS, {"kubectl.kubernetes.io/restartedAt": "t"})
    assert admits(r, ROUTER_USER, mine, with_cost(mine)) == (True, "allowed")
    assert admits(r, ROUTER_USER, with_cost(mine, "10"), with_cost(mine, "0"))[0]
    other_release = pod("other-engine", {**ENGINE_LABELS, "app.kubernetes.io/instance": "other"})
    gateway = pod(f"{GATEWAY}-1", {**ENGINE_LABELS, "app.kubernetes.io/component": "gateway"})
    unlabelled = pod("bare", {})
    del unlabelled["metadata"]["labels"]
    for victim in (other_release, gateway, unlabelled):
        verdict, message = admits(r, ROUTER_USER, victim, with_cost(victim))
        assert not verdict and "only that release's engine pods" in message, victim
    relabelled = with_cost(mine)
    relabelled["metadata"]["labels"] = {**ENGINE_LABELS, "pagoda.io/model": "other"}
    assert admits(r, ROUTER_USER, mine, relabelled) == (
        False, "the router may not change a pod's labels or spec")
    for notes in ({"kubectl.kubernetes.io/restartedAt": "now", COST: "1"}, {COST: "1"}):
        changed = {**mine, "metadata": {**mine["metadata"], "annotations": notes}}
        verdict, message = admits(r, ROUTER_USER, mine, changed)
        assert not verdict and "only the controller.kubernetes.io/pod-deletion-cost" in message
    respec = with_cost(mine)
    respec["spec"] = {"containers": [{"name": "engine", "image": "evil/engine:1"}]}
    assert not admits(r, ROUTER_USER, mine, respec)[0]
    # Other users are not this policy's business.
    assert admits(r, "system:serviceaccount:kube-system:replicaset-controller",
                  other_release, with_cost(other_release)) == (True, "not matched")


def test_without_deletion_cost_no_pod_rule_and_no_policy(chart: Any) -> None:
    r = render(chart, {"router": {"deletionCost": {"enabled": False}}})
    (role,) = r.of_kind("Role")
    assert [rule["resources"] for rule in role["rules"]] == [["endpointslices"]]
    assert not rbac_allows(r, Attempt(ROUTER_USER, "patch", "pods", NAMESPACE))
    assert not r.of_kind("ValidatingAdmissionPolicy")
    assert flag(r.container(ROUTER), "deletion-cost") == "false"
    kept = render(chart, {"router": {"deletionCost": {"admissionPolicy": False}}})
    assert not kept.of_kind("ValidatingAdmissionPolicy")
    assert rbac_allows(kept, Attempt(ROUTER_USER, "patch", "pods", NAMESPACE))


def test_the_admission_policy_names_are_unique_per_release_and_namespace(chart: Any) -> None:
    a = render(chart, SCALE_TO_ZERO).of_kind("ValidatingAdmissionPolicy")[0]["metadata"]["name"]
    b = render(chart, SCALE_TO_ZERO, namespace="team-b").of_kind(
        "ValidatingAdmissionPolicy")[0]["metadata"]["name"]
    assert a != b and re.fullmatch(r"[a-z0-9.-]+", a) and re.fullmatch(r"[a-z0-9.-]+", b)


def test_the_autoscaling_example_in_the_docs_renders(chart: Any) -> None:
    import yaml

    from tests.deploy.helpers import CHART

    text = (CHART.parents[1] / "docs" / "deploy.md").read_text()
    block = text.split("## Autoscaling", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    spec = render(chart, yaml.safe_load(block)).get("ScaledObject", ENGINE)["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 8)
    assert [t["name"] for t in spec["triggers"]] == ["router-queue", "arrival-rate"]
