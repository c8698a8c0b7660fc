"""A model's ``disaggregation``: two engine Deployments told apart by ``pagoda.io/kv-role``,
each with its PagodaPDConnector role (the engine's own parser reads the flag back), one Service
over both, the gateway driving both legs, KEDA per role on that role's demand, the transfer
port open between engines only, and both roles rolling out together. The generic checks
(Kubernetes schemas, selectors, flags every service accepts) run on this value set too, as the
``disaggregated`` scenario of tests/deploy/conftest.py."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tests.deploy.conftest import DISAGGREGATED
from tests.deploy.helpers import (
    RELEASE,
    expand_env_refs,
    flag,
    label_selector_matches,
    render,
    selects,
)

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk")

FULL = f"{RELEASE}-pagoda"
CHAT = f"{FULL}-engine-chat"
PREFILL, DECODE = f"{CHAT}-prefill", f"{CHAT}-decode"
ENV = {"POD_NAME": "pod-0", "POD_IP": "10.0.0.7"}
ROLE = "pagoda.io/kv-role"


def _pod(r: Any, deployment: str) -> dict[str, Any]:
    return r.get("Deployment", deployment)["spec"]["template"]


def _transfer_config(r: Any, deployment: str) -> dict[str, Any]:
    c = r.container(deployment)
    (arg,) = expand_env_refs([f"--kv-transfer-config={flag(c, 'kv-transfer-config')}"], c, ENV)
    return json.loads(arg.partition("=")[2])


def test_two_deployments_by_role_behind_one_service(rendered) -> None:
    r = rendered("disaggregated")
    assert CHAT not in r.names("Deployment")
    prefill, decode = _pod(r, PREFILL), _pod(r, DECODE)
    assert (prefill["metadata"]["labels"][ROLE], decode["metadata"]["labels"][ROLE]) == \
        ("prefill", "decode")
    for name, other in ((PREFILL, decode), (DECODE, prefill)):  # each owns only its pods
        selector = r.get("Deployment", name)["spec"]["selector"]["matchLabels"]
        assert not selects(selector, other["metadata"]["labels"]), name
    for service in (CHAT, f"{FULL}-engines"):  # the model's Service and the router's
        selector = r.get("Service", service)["spec"]["selector"]
        assert selects(selector, prefill["metadata"]["labels"]), service
        assert selects(selector, decode["metadata"]["labels"]), service
    assert flag(r.container(f"{FULL}-gateway"), "pd-disaggregation") is None  # a bare flag
    assert "--pd-disaggregation" in r.container(f"{FULL}-gateway")["args"]


def test_each_role_gets_its_connector_and_its_own_values(rendered) -> None:
    from services.engine.kv_connector.pd import _checked_extra
    from services.engine.serving.server_config import configs_from_args

    r = rendered("disaggregated")
    producer, consumer = _transfer_config(r, PREFILL), _transfer_config(r, DECODE)
    assert (producer["kv_connector"], producer["kv_role"]) == ("PagodaPDConnector",
                                                               "kv_producer")
    assert producer["kv_connector_extra_config"] == {
        "host": "0.0.0.0", "port": 7200, "advertise_host": ENV["POD_IP"],
        "engine_id": ENV["POD_NAME"]}
    assert (consumer["kv_connector"], consumer["kv_role"]) == ("PagodaPDConnector",
                                                               "kv_consumer")
    for cfg in (producer, consumer):
        _checked_extra(cfg["kv_connector_extra_config"])  # keys the connector knows
        config, _ = configs_from_args([f"--kv-transfer-config={json.dumps(cfg)}"])
        assert [s.kv_connector for s in config.kv_connector_specs()] == ["PagodaPDConnector"]
    ports = {p["name"]: p["containerPort"] for p in r.container(PREFILL)["ports"]}
    assert ports["kv-transfer"] == 7200
    assert "kv-transfer" not in {p["name"] for p in r.container(DECODE)["ports"]}
    # The role's values over the model's: resources merge, flags per role.
    prefill, decode = r.container(PREFILL), r.container(DECODE)
    assert prefill["resources"]["requests"] == {"cpu": "4", "memory": "2Gi"}
    assert decode["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}
    assert (flag(prefill, "max-num-batched-tokens"), flag(prefill, "max-num-seqs")) == \
        ("8192", None)
    assert flag(decode, "max-num-seqs") == "64"
    for c in (prefill, decode):
        assert flag(c, "kv-offloading-size") == "1"  # the model's own settings stay
    # The aggregated model beside it: no P/D connector, no role.
    assert flag(r.container(f"{FULL}-engine-plain"), "kv-transfer-config") is None
    assert ROLE not in _pod(r, f"{FULL}-engine-plain")["metadata"]["labels"]


def test_a_connector_of_the_model_composes_with_the_role(chart: Any) -> None:
    from services.engine.serving.server_config import configs_from_args

    values = copy.deepcopy(DISAGGREGATED)
    values["models"][0]["kvTransferConfig"] = {"kv_connector": "PagodaTiersConnector",
                                               "kv_connector_extra_config":
                                               {"kv_offloading_size": 2}}
    values["models"][0].pop("kvOffloadingSize")
    cfg = _transfer_config(render(chart, values), DECODE)
    assert cfg["kv_connector"] == "MultiConnector"
    config, _ = configs_from_args([f"--kv-transfer-config={json.dumps(cfg)}"])
    assert [s.kv_connector for s in config.kv_connector_specs()] == [
        "PagodaPDConnector", "PagodaTiersConnector"]  # the prompt from the prefill first


def test_both_roles_roll_out_together(chart: Any, rendered) -> None:
    key = "pagoda.io/pd-pair-checksum"
    r = rendered("disaggregated")
    before = {d: _pod(r, d)["metadata"]["annotations"][key] for d in (PREFILL, DECODE)}
    assert before[PREFILL] == before[DECODE]
    values = copy.deepcopy(DISAGGREGATED)
    values["models"][0]["disaggregation"]["decode"]["maxNumSeqs"] = 32  # one role changes
    after = render(chart, values)
    for d in (PREFILL, DECODE):  # both pod templates change: both Deployments roll
        assert _pod(after, d)["metadata"]["annotations"][key] != before[d], d


def test_keda_scales_each_role_on_its_own_demand(rendered) -> None:
    r = rendered("disaggregated")
    assert CHAT not in r.names("ScaledObject")
    assert f"{FULL}-engine-plain" in r.names("ScaledObject")  # the aggregated model's own
    prefill, decode = r.get("ScaledObject", PREFILL)["spec"], r.get("ScaledObject", DECODE)["spec"]
    for name, spec in ((PREFILL, prefill), (DECODE, decode)):
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                          "name": name}
        assert "replicas" not in r.get("Deployment", name)["spec"]  # KEDA owns it
    assert (prefill["maxReplicaCount"], decode["maxReplicaCount"]) == (4, 8)
    tokens, arrivals = prefill["triggers"]
    assert tokens["name"] == "prompt-tokens" and arrivals["name"] == "arrival-rate"
    assert 'pagoda_router_prompt_tokens_total{namespace="llm",model="chat",role="prefill"}' \
        in tokens["metadata"]["query"]
    assert tokens["metadata"]["threshold"] == "3000"
    running, kv, _ = decode["triggers"]
    pods = f'pod=~"{DECODE}-.+"'
    assert running["metadata"]["query"] == \
        f'sum(vllm:num_requests_running{{namespace="llm",model_name="chat",{pods}}})'
    assert running["metadata"]["threshold"] == "24"
    assert kv["metadata"]["query"].startswith("avg(vllm:kv_cache_usage_perc{")
    assert pods in kv["metadata"]["query"]
    assert (kv["metricType"], kv["metadata"]["threshold"]) == ("Value", "0.7")


def test_the_transfer_port_is_open_between_engines_only(chart: Any, rendered) -> None:
    r = rendered("disaggregated")
    policy = r.get("NetworkPolicy", f"{FULL}-engine")["spec"]
    rules = [rule for rule in policy["ingress"]
             if {"port": "kv-transfer", "protocol": "TCP"} in rule.get("ports", [])]
    (rule,) = rules
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # this namespace's pods, no ipBlock
    for d in (PREFILL, DECODE, f"{FULL}-engine-plain"):
        assert label_selector_matches(peer["podSelector"], _pod(r, d)["metadata"]["labels"])
    for other in (f"{FULL}-gateway", f"{FULL}-router"):
        assert not label_selector_matches(peer["podSelector"],
                                          _pod(r, other)["metadata"]["labels"]), other
    # Without a disaggregated model: no such rule, no flag.
    plain = render(chart, {"networkPolicy": {"enabled": True}})
    assert "kv-transfer" not in json.dumps(plain.get("NetworkPolicy", f"{FULL}-engine"))
    assert "--pd-disaggregation" not in plain.container(f"{FULL}-gateway")["args"]


def test_bad_disaggregation_values_are_refused(chart: Any) -> None:
    model = {"name": "chat", "source": {"type": "builtin"}, "gpus": 0}
    with pytest.raises(helm.HelmError, match="disaggregation"):
        render(chart, {"models": [{**model, "disaggregation": {"prefill": {}}}]})  # no decode
    with pytest.raises(helm.HelmError, match="serve"):
        render(chart, {"models": [{**model, "disaggregation": {
            "prefill": {"serve": True}, "decode": {}}}]})
    with pytest.raises(helm.HelmError, match="disaggregation and multiNode"):
        render(chart, {"models": [{**model, "gpus": 1, "multiNode": {"size": 2},
                                   "disaggregation": {"prefill": {}, "decode": {}}}]})


def _store_values() -> dict[str, Any]:
    values = copy.deepcopy(DISAGGREGATED)
    values["models"][0]["disaggregation"]["transport"] = "store"
    values["kvStore"] = {"enabled": True}
    values["gateway"] = {"pdMinPromptTokens": 256, "pdStreamKV": True}
    return values


def test_the_store_transport_uses_the_kv_store_and_opens_no_transfer_port(
        chart: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.engine.kv_connector.config import checked_extra
    from services.engine.kv_offload import pd_store
    from services.engine.serving.server_config import configs_from_args
    from services.gateway.config import GatewayConfig

    r = render(chart, _store_values())
    for deployment, role in ((PREFILL, "kv_producer"), (DECODE, "kv_consumer")):
        cfg = _transfer_config(r, deployment)
        assert (cfg["kv_connector"], cfg["kv_role"]) == ("PagodaStorePDConnector", role)
        assert cfg["kv_connector_extra_config"] == {"engine_id": ENV["POD_NAME"]}
        checked_extra(cfg["kv_connector_extra_config"], pd_store._EXTRA, pd_store.NAME)
        c = r.container(deployment)
        assert flag(c, "kv-store-secret-file")  # the store's MAC key is mounted
        monkeypatch.setenv("PAGODA_KV_STORE_SECRET", "k" * 32)  # (the mounted file's stand-in)
        config, _ = configs_from_args([f"--kv-transfer-config={json.dumps(cfg)}",
                                       f"--kv-store-url={flag(c, 'kv-store-url')}"])
        assert config.kv_store_url  # the connector's store: the engine's --kv-store-url
        assert "kv-transfer" not in {p["name"] for p in c["ports"]}
    policy = r.get("NetworkPolicy", f"{FULL}-engine")["spec"]
    assert "kv-transfer" not in json.dumps(policy)
    gateway = r.container(f"{FULL}-gateway")
    assert "--pd-disaggregation" in gateway["args"]
    parsed = GatewayConfig.from_args([a for a in gateway["args"] if a.startswith("--pd-")])
    assert (parsed.pd_min_prompt_tokens, parsed.pd_stream_kv) == (256, True)
    values = _store_values()
    values["gateway"]["pdStreamKV"] = False  # streamed by default: off only when asked
    args = render(chart, values).container(f"{FULL}-gateway")["args"]
    assert not GatewayConfig.from_args([a for a in args if a.startswith("--pd-")]).pd_stream_kv


def test_the_store_transport_needs_the_kv_store(chart: Any) -> None:
    values = _store_values()
    values["kvStore"] = {"enabled": False}
    with pytest.raises(helm.HelmError, match="kvStore.enabled"):
        render(chart, values)
    values["models"][0]["disaggregation"]["transport"] = "udp"
    with pytest.raises(helm.HelmError, match="transport"):
        render(chart, values)
