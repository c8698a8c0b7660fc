"""The chart's multi-LoRA pieces (issue 24): a model's ``lora`` block becomes the engine's
vLLM flags (--enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras, --lora-modules),
adapters are read from the model's volume or a volume of their own, runtime loading confines
engines to the adapter root (--lora-roots) and turns on the gateway's admin routes, whose keys
come from a Secret of their own. The flags go through the services' real parsers."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from tests.deploy.helpers import NAMESPACE, RELEASE, env_of, expand_env_refs, flag, flags

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk")

FULL = f"{RELEASE}-pagoda"
GATEWAY = f"{FULL}-gateway"
SAMPLE_ENV = {"POD_NAME": "pod-0", "POD_IP": "10.0.0.7", "POD_NAMESPACE": NAMESPACE,
              "REDIS_PASSWORD": "secret"}


def _engine_config(c: dict[str, Any]) -> Any:
    from services.engine.serving.server_config import build_parser

    return build_parser().parse_args(expand_env_refs(c["args"], c, SAMPLE_ENV))


def test_adapters_on_the_model_volume_with_runtime_loading(rendered) -> None:
    r = rendered("lora")
    c = r.container(f"{FULL}-engine-tuned")
    args = _engine_config(c)
    assert args.enable_lora and (args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (
        2, 32, 8)
    base = "meta-llama/Llama-3.1-8B-Instruct"
    assert [(m.name, m.path, m.base_model_name) for m in args.lora_modules] == [
        ("sql", "/models/tuned/adapters/sql", base),
        ("chat-v2", "/models/tuned/adapters/chat/v2", base)]
    # Runtime loads are confined to the model's directory, where the flags point.
    assert flag(c, "lora-roots") == "/models/tuned"
    assert "/models/tuned" in {m["mountPath"] for m in c["volumeMounts"]}
    # The gateway serves the admin routes; its admin keys come from their own Secret.
    gw = r.container(GATEWAY)
    assert "--allow-runtime-lora-updating" in gw["args"]
    env = env_of(gw)
    ref = env["PAGODA_ADMIN_API_KEYS"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": f"{GATEWAY}-admin-api-keys", "key": "admin-api-keys"}
    assert env["PAGODA_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == f"{GATEWAY}-api-keys"
    secret = r.get("Secret", f"{GATEWAY}-admin-api-keys")
    assert base64.b64decode(secret["data"]["admin-api-keys"]).decode() == "sk-admin"
    from services.gateway.config import GatewayConfig

    config = GatewayConfig.from_args(expand_env_refs(gw["args"], gw, SAMPLE_ENV),
                                     environ={"PAGODA_ADMIN_API_KEYS": "sk-admin"})
    assert config.allow_runtime_lora_updating and config.admin_api_keys == ("sk-admin",)


def test_adapters_from_their_own_volume_without_runtime_loading(rendered) -> None:
    r = rendered("lora")
    pod = r.get("Deployment", f"{FULL}-engine-small")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    args = _engine_config(c)
    assert args.enable_lora and (args.max_loras, args.max_lora_rank) == (1, 16)
    assert [(m.name, m.path) for m in args.lora_modules] == [
        ("summarize", "/models/small-lora/summarize")]
    assert flags(c, "lora-roots") == []  # runtime loading off: the engine refuses loads
    assert {"name": "lora", "mountPath": "/models/small-lora", "readOnly": True} in (
        c["volumeMounts"])
    (init,) = pod["initContainers"]  # the adapters' image copied into their emptyDir
    assert init["image"] == "registry.example.com/adapters/smol:3"
    assert init["command"] == ["cp", "-R", "/adapters/.", "/models/small-lora/"]
    assert {"name": "lora", "emptyDir": {}} in pod["volumes"]


def test_no_lora_block_no_lora_flags(rendered) -> None:
    r = rendered("defaults")
    c = r.container(f"{FULL}-engine-smollm2")
    assert not any(a.startswith(("--enable-lora", "--lora", "--max-lora")) for a in c["args"])
    gw = r.container(GATEWAY)
    assert "--allow-runtime-lora-updating" not in gw["args"]
    assert "PAGODA_ADMIN_API_KEYS" not in env_of(gw)
    assert not any(s["metadata"]["name"].endswith("admin-api-keys")
                   for s in r.of_kind("Secret"))


def test_an_existing_admin_secret_is_used_as_is(chart: Any) -> None:
    from tests.deploy.helpers import render

    values = json.loads(json.dumps({"gateway": {"adminApiKeys": {
        "existingSecret": "ops-keys", "secretKey": "k"}}}))
    r = render(chart, values)
    ref = env_of(r.container(GATEWAY))["PAGODA_ADMIN_API_KEYS"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "ops-keys", "key": "k"}
    assert not any(s["metadata"]["name"].endswith("admin-api-keys")
                   for s in r.of_kind("Secret"))


def _model(lora: dict[str, Any], source: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"models": [{"name": "m", "source": source or {"type": "hostPath",
                                                          "hostPath": {"path": "/w"}},
                        "lora": lora}]}


BAD_VALUES = {
    "path-escapes": (_model({"modules": [{"name": "a", "path": "../etc"}]}),
                     "models[m].lora.modules[a].path must be relative to the adapter root"),
    "path-absolute": (_model({"modules": [{"name": "a", "path": "/etc/a"}]}),
                      "models[m].lora.modules[a].path must be relative to the adapter root"),
    "runtime-without-admin-keys": (
        _model({"runtimeLoading": True}),
        "models[].lora.runtimeLoading needs gateway.adminApiKeys"),
    "builtin-without-adapter-volume": (
        _model({"modules": [{"name": "a", "path": "a"}]}, {"type": "builtin"}),
        "models[m].lora: the builtin model's directory holds no adapters"),
    "max-loras-zero": (_model({"maxLoras": 0}), "at '/models/0/lora/maxLoras': minimum"),
    "lora-typo": (_model({"max_loras": 2}), "additional properties 'max_loras' not allowed"),
    "module-without-path": (_model({"modules": [{"name": "a"}]}),
                            "at '/models/0/lora/modules/0': missing property 'path'"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_lora_values_fail_with_a_clear_message(chart: Any, case: str) -> None:
    values, message = BAD_VALUES[case]
    with pytest.raises(helm.HelmError) as info:
        chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(info.value)


def test_the_lora_example_in_the_docs_renders(chart: Any) -> None:
    import yaml

    from tests.deploy.helpers import CHART, render

    text = (CHART.parents[1] / "docs" / "deploy.md").read_text()
    block = text.split("`values-lora.yaml`:", 1)[1].split("```yaml", 1)[1]
    r = render(chart, yaml.safe_load(block.split("```", 1)[0]))
    c = r.container(f"{FULL}-engine-llama-8b")
    args = _engine_config(c)
    assert [m.name for m in args.lora_modules] == ["sql-expert", "support-bot"]
    assert flag(c, "lora-roots") == "/models/llama-8b"
    assert "--allow-runtime-lora-updating" in r.container(GATEWAY)["args"]
