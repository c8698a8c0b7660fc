"""The chart's Gateway API objects (gatewayAPI.enabled): InferencePools with the router as their
endpoint picker and HTTPRoutes from a named Gateway, validated against the published CRDs
(vendored under tests/deploy/crds/, versions in its README) and checked to fit the rest of the
release. The generic checks of test_chart.py run on this value set too ("gateway-api")."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.conftest import GATEWAY_API, LORA
from tests.deploy.helpers import Render, flag, render, selects

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk")

CRDS = Path(__file__).parent / "crds"
ROUTER = "demo-pagoda-router"
MODELS = {"llama-8b": "meta-llama/Llama-3.1-8B-Instruct", "qwen-72b": "Qwen/Qwen2.5-72B-Instruct"}


@cache
def crd_schema(file: str, version: str) -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / file).read_text())
    found = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert found and found[0]["served"], (file, version)
    return found[0]["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="module")
def on(chart: Any) -> Render:
    return render(chart, GATEWAY_API)


def test_objects_validate_against_the_published_crds(on: Render) -> None:
    pools, routes = on.of_kind("InferencePool"), on.of_kind("HTTPRoute")
    assert len(pools) == len(routes) == 2
    for doc, file in [(p, "inference.networking.k8s.io_inferencepools.yaml") for p in pools] + \
            [(r, "gateway.networking.k8s.io_httproutes.yaml") for r in routes]:
        schema = crd_schema(file, doc["apiVersion"].rsplit("/", 1)[1])
        jsonschema.validate(doc, schema)  # raises with the failing path
    # The schemas are strict enough to catch a mistake: a wrong failure mode fails.
    bad = {**pools[0], "spec": {**pools[0]["spec"], "endpointPickerRef": {
        **pools[0]["spec"]["endpointPickerRef"], "failureMode": "Sometimes"}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, crd_schema("inference.networking.k8s.io_inferencepools.yaml",
                                            "v1"))


def test_a_pool_per_model_selects_its_engines_with_the_router_as_picker(on: Render) -> None:
    router_svc = on.get("Service", ROUTER)
    svc_ports = {p["port"]: p for p in router_svc["spec"]["ports"]}
    router = on.container(ROUTER)
    container_ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    for model in MODELS:
        pool = on.get("InferencePool", f"demo-pagoda-engine-{model}")["spec"]
        engines = on.get("Deployment", f"demo-pagoda-engine-{model}")["spec"]["template"]
        others = [t for w, t in on.pod_templates()
                  if w["metadata"]["name"] != f"demo-pagoda-engine-{model}"]
        assert selects(pool["selector"]["matchLabels"], engines["metadata"]["labels"])
        assert not any(selects(pool["selector"]["matchLabels"], t["metadata"]["labels"])
                       for t in others), "a pool selects only its own model's engines"
        # The pool targets each pod's OpenAI front, not the engine's internal API.
        front = next(c for c in engines["spec"]["containers"] if c["name"] == "openai")
        front_port = {p["name"]: p["containerPort"] for p in front["ports"]}["openai"]
        engine_port = engines["spec"]["containers"][0]["ports"][0]["containerPort"]
        assert pool["targetPorts"] == [{"number": front_port}] and front_port != engine_port
        ref = pool["endpointPickerRef"]
        assert (ref["kind"], ref["name"], ref["failureMode"]) == ("Service", ROUTER, "FailOpen")
        port = svc_ports[ref["port"]["number"]]
        assert container_ports[port["targetPort"]] == ref["port"]["number"]
        assert port["appProtocol"] == "kubernetes.io/h2c"  # gRPC without TLS


def test_each_engine_pod_serves_openai_beside_its_engine(on: Render) -> None:
    """The OpenAI front: Pagoda's gateway pinned to the engine in its pod, with the engine's
    model directory, the gateway's API keys and the internal credential; ready when the engine
    is; draining as long as the engine."""
    from services.gateway.config import GatewayConfig

    gateway = on.container("demo-pagoda-gateway")
    gateway_keys = {e["name"]: e for e in gateway["env"]}["PAGODA_API_KEYS"]
    for model, served in MODELS.items():
        pod = on.get("Deployment", f"demo-pagoda-engine-{model}")["spec"]["template"]["spec"]
        engine, front = pod["containers"]
        assert (engine["name"], front["name"]) == ("engine", "openai")
        assert front["command"] == ["python", "-m", "services.gateway"]
        assert front["image"] == gateway["image"]
        config = GatewayConfig.from_args(front["args"], environ={})
        assert config.router_url is None
        assert config.engine_url == f"http://127.0.0.1:{flag(engine, 'port')}"
        assert config.port == {p["name"]: p["containerPort"] for p in front["ports"]}["openai"]
        assert [(m.name, m.path) for m in config.models] == [(served, flag(engine, "model"))]
        mounts = {m["mountPath"]: m["name"] for m in front["volumeMounts"]}
        assert mounts[flag(engine, "model")] == "model"  # the engine's own volume, read-only
        assert flag(front, "internal-token-file") == flag(engine, "internal-token-file")
        assert {e["name"]: e for e in front["env"]}["PAGODA_API_KEYS"] == gateway_keys
        assert front["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "openai"}
        assert front["resources"]["limits"]["memory"]
        assert float(flag(front, "shutdown-grace")) == float(flag(engine, "shutdown-timeout"))
        assert front["lifecycle"] == engine["lifecycle"]  # the same preStop
        # Chart-made keys are read at start: a change rolls the engine pods, as the gateway's.
        template = on.get("Deployment", f"demo-pagoda-engine-{model}")["spec"]["template"]
        assert template["metadata"]["annotations"]["checksum/api-keys"]


def test_the_picker_answers_the_openai_port(on: Render) -> None:
    """Both ways the picker learns the front's port agree with the pools': each engine
    advertises it (--openai-port, in its heartbeat), and the router's fallback flag."""
    from services.router.config import RouterConfig

    config = RouterConfig.from_args(on.container(ROUTER)["args"])
    for model in MODELS:
        pool = on.get("InferencePool", f"demo-pagoda-engine-{model}")["spec"]
        assert pool["targetPorts"] == [{"number": config.ext_proc_target_port}]
        engine = on.get("Deployment", f"demo-pagoda-engine-{model}")["spec"]["template"][
            "spec"]["containers"][0]
        assert pool["targetPorts"] == [{"number": int(flag(engine, "openai-port"))}]


def test_a_pools_route_matches_its_models_adapters(chart: Any) -> None:
    """A request naming a declared LoRA adapter (the model header body-based routing sets) is
    routed to its base model's pool, whose fronts serve it; the route still validates."""
    values = {**GATEWAY_API, "gateway": LORA["gateway"], "models": LORA["models"]}
    on = render(chart, values)
    served = {"tuned": ["meta-llama/Llama-3.1-8B-Instruct", "sql", "chat-v2"],
              "small": ["small", "summarize"]}
    schema = crd_schema("gateway.networking.k8s.io_httproutes.yaml", "v1")
    for model, names in served.items():
        route = on.get("HTTPRoute", f"demo-pagoda-engine-{model}")
        jsonschema.validate(route, schema)
        matches = route["spec"]["rules"][0]["matches"]
        assert [m["headers"] for m in matches] == [
            [{"type": "Exact", "name": "x-gateway-model-name", "value": n}] for n in names]
        assert all(m["path"] == {"type": "PathPrefix", "value": "/v1"} for m in matches)
    many = [{"name": f"a{i}", "path": f"a{i}"} for i in range(64)]  # 65 names with the base
    tuned = {**LORA["models"][0], "lora": {**LORA["models"][0]["lora"], "modules": many}}
    with pytest.raises(Exception, match="at most 64"):
        render(chart, {**values, "models": [tuned]})


@pytest.mark.parametrize(("change", "message"), [
    ({"models": [{"name": "chat", "source": {"type": "builtin"}, "gpus": 0,
                  "disaggregation": {"prefill": {}, "decode": {}}}]},
     r"models\[chat\] has disaggregation, which a Gateway API pool cannot serve"),
    ({"models": [{"name": "big", "gpus": 1,
                  "multiNode": {"size": 2, "tensorParallel": 2, "pipelineParallel": 1},
                  "source": {"type": "pvc", "pvc": {"claimName": "weights"}}}]},
     r"models\[big\] is multiNode, which a Gateway API pool does not serve"),
    ({"engine": {"port": 8000}}, "gatewayAPI.openai.port"),
])
def test_what_a_pool_cannot_serve_is_refused(chart: Any, change: dict[str, Any],
                                             message: str) -> None:
    with pytest.raises(Exception, match=message):
        render(chart, {**GATEWAY_API, **change})


def test_routes_attach_to_the_named_gateway(on: Render) -> None:
    for model, served in MODELS.items():
        route = on.get("HTTPRoute", f"demo-pagoda-engine-{model}")["spec"]
        assert route["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                        "name": "inference-gateway", "namespace": "gateways"}]
        rule = route["rules"][0]
        assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io",
                                        "kind": "InferencePool",
                                        "name": f"demo-pagoda-engine-{model}"}]
        assert rule["matches"][0]["headers"][0]["value"] == served


def test_router_serves_the_picker_with_every_models_tokenizer(on: Render) -> None:
    from services.router.config import RouterConfig, tokenizer_dirs

    router = on.container(ROUTER)
    config = RouterConfig.from_args(router["args"])
    assert config.ext_proc_port == 9002
    dirs = tokenizer_dirs(config.tokenizer)
    assert sorted(dirs) == sorted(MODELS.values())
    mounts = [m["mountPath"] for m in router["volumeMounts"]]
    for path in dirs.values():  # each tokenizer directory lies under a mounted volume
        assert any(path.startswith(m.rstrip("/") + "/") or path == m for m in mounts), path


def test_off_by_default_and_a_gateway_name_is_required(chart: Any) -> None:
    off = render(chart, {})
    assert not off.of_kind("InferencePool") and not off.of_kind("HTTPRoute")
    router = off.container(ROUTER)
    assert not any(a.startswith("--ext-proc-port") for a in router["args"])
    assert [p["name"] for p in off.get("Service", ROUTER)["spec"]["ports"]] == ["http"]
    with pytest.raises(Exception, match="gateway"):
        render(chart, {"gatewayAPI": {"enabled": True}})


def _rules(policy: dict[str, Any]) -> list[tuple[list[Any], list[Any]]]:
    return [(r.get("from", []), [p["port"] for p in r["ports"]])
            for r in policy["spec"]["ingress"]]


def test_network_policy_lets_the_gateways_proxies_reach_the_picker_and_engines(
    on: Render, chart: Any
) -> None:
    envoy = GATEWAY_API["gatewayAPI"]["gatewayFrom"]
    router = _rules(on.get("NetworkPolicy", f"{ROUTER}"))
    assert (envoy, ["grpc-ext-proc"]) in router  # the picker's port, from the proxies only
    assert not any(frm != envoy and "grpc-ext-proc" in ports for frm, ports in router)
    container_ports = {p["name"] for p in on.container(ROUTER)["ports"]}
    assert "grpc-ext-proc" in container_ports  # the policy names a port the pod has
    engines = _rules(on.get("NetworkPolicy", "demo-pagoda-engine"))
    # The proxies reach the pods' OpenAI front (the pools' targetPort), and only it: the
    # engine's internal API stays for the gateway and the router.
    assert (envoy, ["openai"]) in engines
    assert not any(frm == envoy and "http" in ports for frm, ports in engines)
    for model in MODELS:
        pod = on.get("Deployment", f"demo-pagoda-engine-{model}")["spec"]["template"]["spec"]
        named = {p["name"]: p["containerPort"] for c in pod["containers"] for p in c["ports"]}
        pool = on.get("InferencePool", f"demo-pagoda-engine-{model}")["spec"]
        assert pool["targetPorts"] == [{"number": named["openai"]}]
    # Off, the proxies get nothing; on without naming them, the chart refuses.
    off = render(chart, {})
    assert not any("grpc-ext-proc" in ports
                   for _, ports in _rules(off.get("NetworkPolicy", ROUTER)))
    values = {**GATEWAY_API, "gatewayAPI": {**GATEWAY_API["gatewayAPI"], "gatewayFrom": []}}
    with pytest.raises(Exception, match="gatewayFrom"):
        render(chart, values)


def test_flow_control_flags_reach_the_gateway_and_the_picker(on: Render, chart: Any) -> None:
    from services.gateway.config import GatewayConfig
    from services.router.config import RouterConfig

    router = RouterConfig.from_args(on.container(ROUTER)["args"]).flow_config()
    gateway_args = [a for a in on.container("demo-pagoda-gateway")["args"] if "flow" in a
                    or "shed" in a]
    gateway = GatewayConfig.from_args([
        "--router-url", "http://r:1", *gateway_args]).flow_config()
    assert router == gateway
    assert (router.enabled, router.sheddable_priority, router.shed_after_s) == (True, 1, 2.0)
    off = render(chart, {})
    assert not any("flow" in a for a in off.container("demo-pagoda-gateway")["args"])
