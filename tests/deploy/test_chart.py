"""The Helm chart, rendered offline by Helm's own SDK for several value sets.

Every rendered object must validate against the Kubernetes OpenAPI schemas (strict: unknown
fields fail) of the oldest and a recent supported version, and the objects must fit
together: Services select pods that exist, flags name Services that are rendered, every
container runs unprivileged, and the services' own argument parsers accept the flags.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from tests.deploy.conftest import EVERYTHING_ON, OTHER_SOURCES, TWO_MODELS
from tests.deploy.helpers import (
    CHART,
    NAMESPACE,
    RELEASE,
    Render,
    all_containers,
    deep_merge,
    env_of,
    expand_env_refs,
    flag,
    flags,
    label_selector_matches,
    render,
    selects,
)

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="pip install kubernetes-validate"
)

# kubernetes-validate 1.37 bundles schemas for 1.25 ... 1.37: the chart's oldest supported
# version (Chart.yaml kubeVersion >=1.29) and a recent one.
KUBE_VERSIONS = ("1.29.0", "1.33.0")
# Custom resources: no bundled schema; their fields are checked by the tests below.
CUSTOM_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1", "ScaledObject": "keda.sh/v1alpha1",
                # checked against their vendored CRDs in test_gateway_api_chart.py
                "InferencePool": "inference.networking.k8s.io/v1",
                "HTTPRoute": "gateway.networking.k8s.io/v1"}
# Cluster-scoped, and GA (admissionregistration.k8s.io/v1) from Kubernetes 1.30: the chart
# renders them only there (Capabilities.KubeVersion), so they validate against 1.30+ schemas.
ADMISSION_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")

FULL = f"{RELEASE}-pagoda"
GATEWAY, ROUTER, REDIS = f"{FULL}-gateway", f"{FULL}-router", f"{FULL}-redis"
ENGINES = f"{FULL}-engines"
BUILTIN_DIR = "/opt/pagoda/models/SmolLM2-135M-Instruct"
SAMPLE_ENV = {
    "POD_NAME": "pod-0",
    "POD_IP": "10.0.0.7",
    "POD_NAMESPACE": NAMESPACE,
    "REDIS_PASSWORD": "secret",
}


def engine(model: str) -> str:
    return f"{FULL}-engine-{model}"


def model_names(r: Render) -> list[str]:
    models = r.values.get("models")
    return [m["name"] for m in models] if models else ["smollm2"]


def engine_deployments(r: Render) -> list[str]:
    """Every model's engine Deployments: one, or a disaggregated model's prefill and decode."""
    names = set(r.names("Deployment"))
    out = []
    for m in model_names(r):
        roles = [f"{engine(m)}-prefill", f"{engine(m)}-decode"]
        out += roles if set(roles) <= names else [engine(m)]
    return out


# --------------------------------------------------------------------------------------------
# Every value set: schemas and cross-references.


def test_every_object_validates_against_kubernetes_schemas(scenario: Render) -> None:
    for doc in scenario.docs:
        if doc["kind"] in CUSTOM_KINDS:
            assert doc["apiVersion"] == CUSTOM_KINDS[doc["kind"]]
            continue
        for version in KUBE_VERSIONS:
            if doc["kind"] in ADMISSION_KINDS and version < "1.30":
                continue
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} on {version}: {exc}")


def test_objects_are_namespaced_labelled_and_unique(scenario: Render) -> None:
    seen = set()
    for doc in scenario.docs:
        meta = doc["metadata"]
        key = (doc["kind"], meta["name"])
        assert key not in seen, f"{key} rendered twice"
        seen.add(key)
        cluster_scoped = doc["kind"] in ADMISSION_KINDS
        assert meta.get("namespace") == (None if cluster_scoped else NAMESPACE), key
        assert meta["labels"]["app.kubernetes.io/instance"] == RELEASE, key
        assert len(meta["name"]) <= 63, key


def test_workload_selectors_match_their_pod_templates(scenario: Render) -> None:
    for w, template in scenario.pod_templates():
        name = w["metadata"]["name"]
        assert selects(w["spec"]["selector"]["matchLabels"], template["metadata"]["labels"]), name


def test_every_service_selects_rendered_pods_on_a_declared_port(scenario: Render) -> None:
    for svc in scenario.of_kind("Service"):
        selector = svc["spec"]["selector"]
        pods = [
            t for _, t in scenario.pod_templates() if selects(selector, t["metadata"]["labels"])
        ]
        assert pods, f"Service {svc['metadata']['name']} selects no rendered pod"
        for port in svc["spec"]["ports"]:
            target = port["targetPort"]
            for pod in pods:
                names = {p.get("name") for c in pod["spec"]["containers"] for p in c["ports"]}
                assert target in names, (svc["metadata"]["name"], target, names)


def test_volume_mounts_and_volumes_agree(scenario: Render) -> None:
    for w, template in scenario.pod_templates():
        spec = template["spec"]
        volumes = {v["name"] for v in spec.get("volumes") or []}
        mounted = set()
        for c in all_containers(spec):
            for m in c.get("volumeMounts") or []:
                assert m["name"] in volumes, (w["metadata"]["name"], c["name"], m["name"])
                mounted.add(m["name"])
        assert volumes == mounted, f"{w['metadata']['name']}: unused volumes {volumes - mounted}"


def test_references_to_secrets_claims_and_accounts_resolve(scenario: Render) -> None:
    v = scenario.values
    existing_secrets = {
        (v.get("gateway") or {}).get("apiKeys", {}).get("existingSecret"),
        (v.get("redis") or {}).get("auth", {}).get("existingSecret"),
        (v.get("redis") or {}).get("tls", {}).get("caSecret"),
    } - {None, ""}
    secrets = set(scenario.names("Secret")) | existing_secrets
    claims = set(scenario.names("PersistentVolumeClaim")) | {
        m["source"]["pvc"]["claimName"]
        for m in v.get("models") or []
        if m["source"]["type"] == "pvc" and "claimName" in m["source"]["pvc"]
    }
    accounts = set(scenario.names("ServiceAccount"))
    for w, template in scenario.pod_templates():
        spec = template["spec"]
        assert spec["serviceAccountName"] in accounts, w["metadata"]["name"]
        for vol in spec.get("volumes") or []:
            if "secret" in vol:
                assert vol["secret"]["secretName"] in secrets, vol
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in claims, vol
        for c in all_containers(spec):
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in secrets, (w["metadata"]["name"], e)
    for secret in scenario.of_kind("Secret"):
        assert secret["data"], secret["metadata"]["name"]


def test_autoscalers_budgets_and_policies_target_rendered_objects(scenario: Render) -> None:
    deployments = set(scenario.names("Deployment"))
    for hpa in scenario.of_kind("HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
    for so in scenario.of_kind("ScaledObject"):
        assert so["spec"]["scaleTargetRef"]["name"] in deployments
    pod_labels = [t["metadata"]["labels"] for _, t in scenario.pod_templates()]
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for doc in scenario.of_kind(kind):
            selector = doc["spec"]["selector" if kind == "PodDisruptionBudget" else "podSelector"]
            assert any(label_selector_matches(selector, labels) for labels in pod_labels), (
                f"{kind} {doc['metadata']['name']} selects no rendered pod"
            )


def test_no_container_runs_as_root_or_privileged(scenario: Render) -> None:
    for w, template in scenario.pod_templates():
        spec = template["spec"]
        pod_sc = spec.get("securityContext") or {}
        assert not spec.get("hostNetwork") and not spec.get("hostPID"), w["metadata"]["name"]
        for c in all_containers(spec):
            sc = c.get("securityContext") or {}
            where = f"{w['metadata']['name']}/{c['name']}"
            assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, where
            assert sc.get("runAsUser", pod_sc.get("runAsUser", 0)) > 0, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("privileged", False) is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not sc.get("capabilities", {}).get("add"), where
            seccomp = sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}
            assert seccomp.get("type") == "RuntimeDefault", where
            # Writable scratch for a read-only root filesystem (init copies need only theirs).
            if c in spec["containers"]:
                mounts = {m["mountPath"] for m in c.get("volumeMounts") or []}
                assert "/tmp" in mounts, where


def test_only_the_router_gets_an_api_token(scenario: Render) -> None:
    for w, template in scenario.pod_templates():
        expected = w["metadata"]["name"] == ROUTER
        assert template["spec"]["automountServiceAccountToken"] is expected, w["metadata"]["name"]


def test_router_role_grants_only_the_endpointslice_watch_and_pod_patches(
    scenario: Render,
) -> None:
    assert not scenario.of_kind("ClusterRole") and not scenario.of_kind("ClusterRoleBinding")
    (role,) = scenario.of_kind("Role")
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["list", "watch"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},  # deletion cost
    ]
    (binding,) = scenario.of_kind("RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": ROUTER, "namespace": NAMESPACE}
    ]
    router_pod = scenario.get("Deployment", ROUTER)["spec"]["template"]["spec"]
    assert router_pod["serviceAccountName"] == ROUTER


def test_flags_name_rendered_services(scenario: Render) -> None:
    # gateway -> router
    router_url = urlsplit(flag(scenario.container(GATEWAY), "router-url"))
    svc = scenario.get("Service", router_url.hostname)
    assert router_url.port in [p["port"] for p in svc["spec"]["ports"]]
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    # router -> the engines' EndpointSlices: a headless Service over every engine pod, with
    # the port the router looks for.
    router = scenario.container(ROUTER)
    svc = scenario.get("Service", flag(router, "k8s-service"))
    assert svc["spec"]["clusterIP"] == "None"
    assert flag(router, "k8s-namespace") == NAMESPACE
    assert flag(router, "k8s-port-name") in [p["name"] for p in svc["spec"]["ports"]]
    for name in engine_deployments(scenario):
        labels = scenario.get("Deployment", name)["spec"]["template"]["metadata"]
        assert selects(svc["spec"]["selector"], labels["labels"]), name
    # router + engines -> Redis
    external = (scenario.values.get("redis") or {}).get("url")
    for c in [router] + [scenario.container(d) for d in engine_deployments(scenario)]:
        url = urlsplit(flag(c, "redis-url"))
        if external:
            assert url.hostname == urlsplit(external).hostname
            assert not scenario.of_kind("Deployment") or REDIS not in scenario.names("Deployment")
        else:
            redis_svc = scenario.get("Service", url.hostname)
            assert url.port in [p["port"] for p in redis_svc["spec"]["ports"]]
            assert redis_svc["spec"]["selector"]["app.kubernetes.io/component"] == "redis"


def test_services_accept_the_flags_the_chart_passes(scenario: Render) -> None:
    """The chart's args go through the services' real argument parsers and config checks."""
    from services.gateway.config import GatewayConfig
    from services.router.config import RouterConfig

    gateway = scenario.container(GATEWAY)
    assert gateway["command"] == ["python", "-m", "services.gateway"]
    config = GatewayConfig.from_args(
        expand_env_refs(gateway["args"], gateway, SAMPLE_ENV), environ={}
    )
    assert config.port == gateway["ports"][0]["containerPort"]
    router = scenario.container(ROUTER)
    assert router["command"] == ["python", "-m", "services.router"]
    rconfig = RouterConfig.from_args(expand_env_refs(router["args"], router, SAMPLE_ENV))
    assert rconfig.port == router["ports"][0]["containerPort"]
    assert rconfig.k8s_service == ENGINES


def test_engines_accept_their_flags(scenario: Render) -> None:
    from services.engine.serving.server_config import build_parser

    parser = build_parser()
    for name in engine_deployments(scenario):
        c = scenario.container(name)
        assert c["command"] == ["python", "-m", "services.engine.serving.server"]
        args = vars(parser.parse_args(expand_env_refs(c["args"], c, SAMPLE_ENV)))
        assert args["host"] == "0.0.0.0"
        assert args["port"] == c["ports"][0]["containerPort"]
        assert args["engine_id"] == SAMPLE_ENV["POD_NAME"]
        assert args["advertise_url"] == f"http://{SAMPLE_ENV['POD_IP']}:{args['port']}"
        # One model rank per GPU of the pod; a CPU engine is one rank.
        gpus = ((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0)
        assert args.get("tensor_parallel_size", 1) == max(1, gpus)


def test_model_directories_are_mounted_where_the_flags_point(scenario: Render) -> None:
    def mounted(c: dict[str, Any], directory: str) -> bool:
        if directory == BUILTIN_DIR:  # baked into both images
            return True
        return directory in {m["mountPath"] for m in c.get("volumeMounts") or []}

    gateway = scenario.container(GATEWAY)
    served = []
    for spec in flags(gateway, "model"):
        served_name, _, directory = spec.rpartition("=")
        served.append(served_name)
        assert mounted(gateway, directory), spec
    for name in engine_deployments(scenario):
        c = scenario.container(name)
        assert mounted(c, flag(c, "model")), name
        assert flag(c, "served-model-name") in served, "the gateway must serve every engine"
    assert len(served) == len(model_names(scenario))


def test_engine_pods_are_ready_only_with_the_model_loaded_and_drain_on_stop(
    scenario: Render,
) -> None:
    for name in engine_deployments(scenario):
        pod = scenario.get("Deployment", name)["spec"]["template"]["spec"]
        c = pod["containers"][0]  # the engine; with gatewayAPI its OpenAI front follows
        assert c["name"] == "engine"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
        grace = pod["terminationGracePeriodSeconds"]
        pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pre_stop + float(flag(c, "shutdown-timeout")) + 5 <= grace
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
        assert {"mountPath": "/dev/shm", "name": "dshm"} in c["volumeMounts"]
        assert pod["enableServiceLinks"] is False


def test_otel_env_only_when_an_endpoint_is_set(scenario: Render) -> None:
    endpoint = (scenario.values.get("otel") or {}).get("endpoint")
    pods = {GATEWAY: "gateway", ROUTER: "router"}
    pods.update({d: "engine" for d in engine_deployments(scenario)})
    for deployment, component in pods.items():
        env = env_of(scenario.container(deployment))
        if not endpoint:
            assert not [k for k in env if k.startswith("OTEL_")], deployment
            continue
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == endpoint
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"]["value"] in ("grpc", "http/protobuf")
        assert env["OTEL_SERVICE_NAME"]["value"] == f"pagoda-{component}"
        # $(POD_NAME) in OTEL_RESOURCE_ATTRIBUTES expands only if defined earlier.
        names = list(env)
        assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")


def test_notes_tell_how_to_reach_the_api(scenario: Render) -> None:
    notes = scenario.notes
    assert f"kubectl -n {NAMESPACE} port-forward svc/{GATEWAY} 8000:8000" in notes
    assert "curl -s http://127.0.0.1:8000/v1/chat/completions" in notes
    assert 'base_url="http://127.0.0.1:8000/v1"' in notes


# --------------------------------------------------------------------------------------------
# Particular value sets.


def test_defaults_lint_clean_and_serve_the_builtin_model(chart: Any, rendered) -> None:
    report = helm.lint(str(CHART), strict=True, namespace=NAMESPACE)
    assert report["errors"] == [], report["messages"]
    r = rendered("defaults")
    assert sorted(r.names("Deployment")) == sorted([GATEWAY, ROUTER, REDIS, engine("smollm2")])
    c = r.container(engine("smollm2"))
    assert flag(c, "model") == BUILTIN_DIR
    assert flag(c, "served-model-name") == "SmolLM2-135M-Instruct"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert flags(r.container(GATEWAY), "model") == [f"SmolLM2-135M-Instruct={BUILTIN_DIR}"]
    # Bundled Redis with a generated password that never appears in a manifest.
    secret = r.get("Secret", REDIS)
    assert len(secret["data"]["redis-password"]) >= 32
    # The password reaches the services through the environment, not their arguments.
    assert flag(r.container(ROUTER), "redis-url") == f"redis://{REDIS}:6379/0"
    assert "secretKeyRef" in env_of(r.container(ROUTER))["REDIS_PASSWORD"]["valueFrom"]
    assert "WARNING: no API key" in r.notes
    # NetworkPolicy is on by default (tests/deploy/test_internal_auth_chart.py).
    for kind in (
        "HorizontalPodAutoscaler",
        "ScaledObject",
        "ServiceMonitor",
        "ConfigMap",
        "PersistentVolumeClaim",
    ):
        assert not r.of_kind(kind), kind


def test_each_engine_gets_its_model_flags_and_gpus(rendered) -> None:
    r = rendered("two-models")
    llama = r.get("Deployment", engine("llama-8b"))
    c = llama["spec"]["template"]["spec"]["containers"][0]
    assert llama["spec"]["replicas"] == 2
    assert flag(c, "model") == "/models/llama-8b"
    assert flag(c, "served-model-name") == "meta-llama/Llama-3.1-8B-Instruct"
    assert flag(c, "block-size") == "32"
    assert flag(c, "kv-cache-memory") == "21474836480"
    assert flag(c, "max-model-len") == "8192"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert flag(c, "tensor-parallel-size") == "1"
    pod = llama["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    model_vol = next(v for v in pod["volumes"] if v["name"] == "model")
    assert model_vol["persistentVolumeClaim"] == {"claimName": "model-weights", "readOnly": True}
    mount = next(m for m in c["volumeMounts"] if m["name"] == "model")
    assert mount == {
        "name": "model",
        "mountPath": "/models/llama-8b",
        "readOnly": True,
        "subPath": "Llama-3.1-8B-Instruct",
    }

    qwen = r.get("Deployment", engine("qwen-72b"))
    pod = qwen["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert flag(c, "block-size") == "16" and flag(c, "kv-cache-memory") is None
    assert flag(c, "max-model-len") == "32768"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert flag(c, "tensor-parallel-size") == "4"  # the model split over the pod's 4 GPUs
    assert {"mountPath": "/dev/shm", "name": "dshm"} in c["volumeMounts"]  # NCCL's buffers
    assert next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["medium"] == "Memory"
    assert pod["tolerations"] == [{"key": "dedicated", "value": "llm", "effect": "NoSchedule"}]
    assert next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "16Gi"
    # The image source: an init container copies the weights into the model emptyDir.
    (init,) = pod["initContainers"]
    assert init["image"] == "registry.example.com/models/qwen2.5-72b:1"
    assert init["command"] == ["cp", "-R", "/model/.", "/models/qwen-72b/"]
    assert {"name": "model", "emptyDir": {"sizeLimit": "200Gi"}} in pod["volumes"]

    # The gateway knows both models; llama's tokenizer comes from its own small image.
    gateway = r.get("Deployment", GATEWAY)["spec"]["template"]["spec"]
    assert flags(gateway["containers"][0], "model") == [
        "meta-llama/Llama-3.1-8B-Instruct=/models/llama-8b",
        "Qwen/Qwen2.5-72B-Instruct=/models/qwen-72b",
    ]
    images = [i["image"] for i in gateway["initContainers"]]
    assert images == [
        "registry.example.com/tokenizers/llama-3.1-8b:1",
        "registry.example.com/models/qwen2.5-72b:1",
    ]
    assert all(i["command"][:2] == ["sh", "-c"] for i in gateway["initContainers"])
    assert all("tokenizer" in i["command"][2] for i in gateway["initContainers"])
    # Each model's engines have their own Service, and the router's covers them all.
    for name in ("llama-8b", "qwen-72b"):
        svc = r.get("Service", engine(name))
        assert svc["spec"]["selector"]["pagoda.io/model"] == name
    assert "pagoda.io/model" not in r.get("Service", ENGINES)["spec"]["selector"]


def test_speculative_decoding_flags_and_the_draft_volume(rendered) -> None:
    r = rendered("speculative")
    lookup = r.container(engine("lookup"))
    assert json.loads(flag(lookup, "speculative-config")) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "disable_by_batch_size": 8}
    pod = r.get("Deployment", engine("drafted"))["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert json.loads(flag(c, "speculative-config")) == {
        "method": "draft_model", "num_speculative_tokens": 3, "model": "/models/drafted-draft"}
    assert {"name": "draft", "mountPath": "/models/drafted-draft", "readOnly": True} in \
        c["volumeMounts"]
    (init,) = pod["initContainers"]  # the draft's image is copied into its emptyDir
    assert init["image"] == "registry.example.com/models/llama-1b:1"
    assert init["command"] == ["cp", "-R", "/model/.", "/models/drafted-draft/"]
    assert {"name": "draft", "emptyDir": {}} in pod["volumes"]
    # The engine reads the flag back as the config the chart meant.
    from services.engine.serving.server_config import build_parser

    args = build_parser().parse_args(expand_env_refs(lookup["args"], lookup, SAMPLE_ENV))
    assert args.speculative_config.prompt_lookup_max == 4


def test_external_redis_with_tls(rendered) -> None:
    r = rendered("external-redis-tls")
    for kind in ("Deployment", "Service", "Secret"):
        assert REDIS not in r.names(kind), kind
    ca_path = "/etc/pagoda/redis-tls/ca.crt"
    for c in [r.container(ROUTER), r.container(engine("smollm2"))]:
        url = urlsplit(flag(c, "redis-url"))
        assert url.scheme == "rediss" and url.hostname == "redis.example.com" and url.port == 6380
        assert url.password is None and url.username is None and url.path == "/0"
        assert parse_qs(url.query) == {"ssl_ca_certs": [ca_path]}
        ref = env_of(c)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "pagoda-redis", "key": "password"}
        assert {"name": "redis-tls", "mountPath": "/etc/pagoda/redis-tls", "readOnly": True} in (
            c["volumeMounts"]
        )
    # The URL the router builds is one redis-py accepts, CA file included.
    from services.common.redis_index import connect

    url = flag(r.container(ROUTER), "redis-url")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("REDIS_PASSWORD", "pw")
        kwargs = connect(url).connection_pool.connection_kwargs
    assert kwargs["ssl_ca_certs"] == ca_path and kwargs["password"] == "pw"


def test_external_redis_without_password(chart: Any) -> None:
    r = render(chart, {"redis": {"url": "redis://redis.cache.svc:6379/2"}})
    router = r.container(ROUTER)
    assert flag(router, "redis-url") == "redis://redis.cache.svc:6379/2"
    assert "REDIS_PASSWORD" not in env_of(router)


def test_autoscaling_monitoring_and_network_policies(rendered) -> None:
    r = rendered("everything-on")
    # HPA owns the gateway's replica count; KEDA the engines'.
    assert "replicas" not in r.get("Deployment", GATEWAY)["spec"]
    hpa = r.get("HorizontalPodAutoscaler", GATEWAY)
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    for model in EVERYTHING_ON["models"]:
        name = engine(model["name"])
        assert "replicas" not in r.get("Deployment", name)["spec"]
        so = r.get("ScaledObject", name)
        assert so["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": name,
        }
        assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
        queue, arrivals = so["spec"]["triggers"]
        assert queue["type"] == arrivals["type"] == "prometheus"
        assert queue["metricType"] == arrivals["metricType"] == "AverageValue"
        meta = queue["metadata"]
        assert meta["serverAddress"].startswith("http")
        selector = f'namespace="{NAMESPACE}",model="{model["servedModelName"]}"'
        assert meta["query"] == f"max(pagoda_router_requests_waiting{{{selector}}})"
        assert meta["threshold"] == "3"  # KEDA wants a string
        assert arrivals["metadata"]["query"] == f"sum(pagoda_router_arrival_rate{{{selector}}})"
        behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 300
    # ServiceMonitor: gateway, router and each model's engines, each exactly once.
    (sm,) = r.of_kind("ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] == "http"
    scraped = [
        s
        for s in r.of_kind("Service")
        if label_selector_matches(sm["spec"]["selector"], s["metadata"]["labels"])
    ]
    assert sorted(s["metadata"]["name"] for s in scraped) == sorted(
        [GATEWAY, ROUTER] + [engine(m["name"]) for m in EVERYTHING_ON["models"]]
    )
    for svc in scraped:
        assert endpoint["port"] in [p["name"] for p in svc["spec"]["ports"]]
    # Engines: from the gateway and the router (and the metrics namespace) only.
    policy = r.get("NetworkPolicy", f"{FULL}-engine")
    peers = policy["spec"]["ingress"][0]["from"]
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers] == [
        "gateway",
        "router",
    ]
    assert all(
        p["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE for p in peers
    )
    assert policy["spec"]["ingress"][1]["from"] == EVERYTHING_ON["networkPolicy"]["metricsFrom"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    # Redis: the router and the engines of this release only.
    redis_policy = r.get("NetworkPolicy", f"{FULL}-redis")
    (rule,) = redis_policy["spec"]["ingress"]
    (peer,) = rule["from"]
    selector = peer["podSelector"]
    allowed = {
        c
        for c in ("gateway", "router", "engine", "redis")
        if label_selector_matches(
            selector,
            {
                "app.kubernetes.io/name": "pagoda",
                "app.kubernetes.io/instance": RELEASE,
                "app.kubernetes.io/component": c,
            },
        )
    }
    assert allowed == {"router", "engine"}
    assert not label_selector_matches(selector, {"app.kubernetes.io/component": "engine"})
    # The gateway reads its API keys from the existing Secret.
    env = env_of(r.container(GATEWAY))
    assert env["PAGODA_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": "pagoda-api-keys",
        "key": "api-keys",
    }
    assert "pagoda-api-keys" in r.notes


def test_router_replicas(rendered) -> None:
    assert rendered("three-routers").get("Deployment", ROUTER)["spec"]["replicas"] == 3
    assert rendered("defaults").get("Deployment", ROUTER)["spec"]["replicas"] >= 1


def test_other_sources_cpu_engine_created_claim_and_api_keys(rendered) -> None:
    r = rendered("other-sources")
    local = r.get("Deployment", engine("local"))["spec"]["template"]["spec"]
    c = local["containers"][0]
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert flag(c, "device") == "cpu" and flag(c, "tensor-parallel-size") is None
    assert {"name": "model", "hostPath": {"path": "/mnt/models/tiny", "type": "Directory"}} in (
        local["volumes"]
    )
    (pvc,) = r.of_kind("PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == f"{FULL}-model-shared"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "100Gi"
    assert pvc["spec"]["storageClassName"] == "nfs"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    shared = r.get("Deployment", engine("shared"))["spec"]["template"]["spec"]
    assert shared["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    # API keys from values: the chart's Secret, comma-joined as the gateway expects.
    secret = r.get("Secret", f"{GATEWAY}-api-keys")
    assert base64.b64decode(secret["data"]["api-keys"]).decode() == "sk-one,sk-two"
    assert (
        env_of(r.container(GATEWAY))["PAGODA_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"]
        == f"{GATEWAY}-api-keys"
    )
    # grafanaDashboards is on: one ConfigMap with each JSON file of dashboards/, if any.
    assert OTHER_SOURCES["grafanaDashboards"]["enabled"]
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    configmaps = r.of_kind("ConfigMap")
    if not files:
        assert configmaps == []
    else:
        (cm,) = configmaps
        assert sorted(cm["data"]) == files
        for name in files:
            assert json.loads(cm["data"][name]) == json.loads(
                (CHART / "dashboards" / name).read_text()
            )


def test_pdbs_rendered_only_when_enabled(chart: Any, rendered) -> None:
    on = rendered("two-models")
    assert sorted(on.names("PodDisruptionBudget")) == sorted(
        [GATEWAY, ROUTER, engine("llama-8b"), engine("qwen-72b")]
    )
    for pdb in on.of_kind("PodDisruptionBudget"):
        assert pdb["spec"]["maxUnavailable"] == 1
    off = render(
        chart,
        deep_merge(
            TWO_MODELS,
            {
                "gateway": {"pdb": {"enabled": False}},
                "router": {"pdb": {"enabled": False}},
                "engine": {"pdb": {"enabled": False}},
            },
        ),
    )
    assert off.of_kind("PodDisruptionBudget") == []
    only_router = render(
        chart, {"gateway": {"pdb": {"enabled": False}}, "engine": {"pdb": {"enabled": False}}}
    )
    assert only_router.names("PodDisruptionBudget") == [ROUTER]


def test_dashboards_configmap_ships_the_json_files(chart: Any, tmp_path: Path) -> None:
    copy = tmp_path / "pagoda"
    shutil.copytree(CHART, copy)
    for existing in (copy / "dashboards").glob("*.json"):
        existing.unlink()
    on = {"grafanaDashboards": {"enabled": True, "annotations": {"grafana_folder": "LLM"}}}
    with helm.Chart.load(str(copy)) as empty:
        assert not render(empty, on).of_kind("ConfigMap")  # nothing to ship
    (copy / "dashboards" / "fleet.json").write_text('{"title": "Fleet", "expr": "{{x}}"}\n')
    (copy / "dashboards" / "notes.txt").write_text("not a dashboard\n")
    with helm.Chart.load(str(copy)) as with_json:
        (cm,) = render(with_json, on).of_kind("ConfigMap")
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
        assert cm["data"] == {"fleet.json": '{"title": "Fleet", "expr": "{{x}}"}'}
        assert not render(with_json).of_kind("ConfigMap")  # off by default


# --------------------------------------------------------------------------------------------
# Bad values fail with a message that names the key.

BAD_VALUES = {
    "replicas-three": (
        {"gateway": {"replicas": "three"}},
        "at '/gateway/replicas': got string, want integer",
    ),
    "model-replicas-three": (
        {"models": [{"name": "m", "source": {"type": "builtin"}, "replicas": "three"}]},
        "at '/models/0/replicas': got string, want integer",
    ),
    "no-router": ({"router": {"replicas": 0}}, "at '/router/replicas': minimum"),
    "model-without-source": (
        {"models": [{"name": "m", "gpus": 1}]},
        "at '/models/0': missing property 'source'",
    ),
    "unknown-source-type": (
        {"models": [{"name": "m", "source": {"type": "s3"}}]},
        "at '/models/0/source/type': value must be one of 'builtin', 'pvc', 'image', 'hostPath'",
    ),
    "pvc-without-claim": (
        {"models": [{"name": "m", "source": {"type": "pvc", "pvc": {"subPath": "x"}}}]},
        "at '/models/0/source/pvc': missing property 'claimName'",
    ),
    "image-without-path": (
        {
            "models": [
                {"name": "m", "source": {"type": "image", "image": {"repository": "r", "tag": "1"}}}
            ]
        },
        "at '/models/0/source/image': missing property 'path'",
    ),
    "source-type-without-its-block": (
        {"models": [{"name": "m", "source": {"type": "hostPath"}}]},
        "missing property 'hostPath'",
    ),
    "bad-model-name": (
        {"models": [{"name": "Llama_8B", "source": {"type": "builtin"}}]},
        "at '/models/0/name'",
    ),
    "no-models": ({"models": []}, "at '/models': minItems"),
    "gpus-negative": (
        {"models": [{"name": "m", "source": {"type": "builtin"}, "gpus": -1}]},
        "at '/models/0/gpus': minimum",
    ),
    "typo-key": ({"gatway": {"replicas": 2}}, "additional properties 'gatway' not allowed"),
    "redis-url-with-password": (
        {"redis": {"url": "rediss://:hunter2@redis:6380/0"}},
        "at '/redis/url'",
    ),
    "redis-url-not-redis": ({"redis": {"url": "http://redis:6379"}}, "at '/redis/url'"),
    "bad-otel-protocol": (
        {"otel": {"endpoint": "http://c:4317", "protocol": "udp"}},
        "at '/otel/protocol'",
    ),
    "duplicate-model-names": (
        {
            "models": [
                {"name": "m", "source": {"type": "builtin"}},
                {"name": "m", "source": {"type": "builtin"}},
            ]
        },
        'models[].name must be unique: "m" appears twice',
    ),
    "claim-and-create": (
        {
            "models": [
                {
                    "name": "m",
                    "source": {"type": "pvc", "pvc": {"claimName": "c", "create": {"size": "1Gi"}}},
                }
            ]
        },
        "set claimName (an existing claim) or create (a new one), not both",
    ),
    "draft-without-source": (
        {"models": [{"name": "m", "source": {"type": "builtin"},
                     "speculativeConfig": {"method": "draft_model",
                                           "num_speculative_tokens": 2}}]},
        "models[m].speculativeConfig: method draft_model needs a draftSource",
    ),
    "speculative-typo": (
        {"models": [{"name": "m", "source": {"type": "builtin"},
                     "speculativeConfig": {"method": "ngram", "num_speculative_token": 2}}]},
        "at '/models/0/speculativeConfig'",
    ),
    "ca-without-tls": (
        {"redis": {"url": "redis://r:6379/0", "tls": {"caSecret": "ca"}}},
        "redis.tls.caSecret is set but redis.url is not rediss://",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_fail_with_a_clear_message(chart: Any, case: str) -> None:
    values, message = BAD_VALUES[case]
    with pytest.raises(helm.HelmError) as info:
        chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(info.value)


def test_lint_reports_schema_errors(chart: Any) -> None:
    report = helm.lint(str(CHART), {"gateway": {"replicas": "three"}}, namespace=NAMESPACE)
    assert any("/gateway/replicas" in e for e in report["errors"]), report


def test_the_two_model_example_in_the_docs_renders(chart: Any) -> None:
    text = (CHART.parents[1] / "docs" / "deploy.md").read_text()
    block = text.split("`values-two-models.yaml`:", 1)[1].split("```yaml", 1)[1]
    values = yaml.safe_load(block.split("```", 1)[0])
    r = render(chart, values)
    assert sorted(r.names("Deployment")) == sorted(
        [GATEWAY, ROUTER, REDIS, engine("llama-8b"), engine("qwen-72b")]
    )
    for doc in r.docs:
        kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)


def test_values_schema_is_draft_07_and_describes_every_default() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(defaults)
    assert set(defaults) == set(schema["properties"])  # no undocumented top-level key


def test_no_empty_keys(scenario: Render) -> None:
    """A key rendered with nothing under it (`annotations:` alone) is null, not empty."""

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                assert value is not None, f"{path}.{key} is null"
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{path}[{i}]")

    for doc in scenario.docs:
        walk(doc, f"{doc['kind']}/{doc['metadata']['name']}")


def test_lint_is_clean(scenario: Render) -> None:
    report = helm.lint(str(CHART), scenario.values, strict=True, namespace=NAMESPACE)
    assert report["errors"] == [], report["messages"]
