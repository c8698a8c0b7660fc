"""The chart's KV tiers: host memory per model (--kv-offloading-size) and the shared KV store
(a Redis of its own with a memory cap and allkeys-lru, a password, reachable by engines only)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.helpers import RELEASE, expand_env_refs, flag, label_selector_matches
from tests.deploy.test_chart import FULL, SAMPLE_ENV, engine

pytest.importorskip("helm_python", reason="pip install helm-python-sdk")

STORE = f"{FULL}-kv-store"


def _env(container: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [e for e in container["env"] if e["name"] == name]
    return found


def test_engines_are_wired_to_their_tiers(rendered) -> None:
    r = rendered("kv-tiers")
    chat, plain = r.container(engine("chat")), r.container(engine("plain"))
    assert flag(chat, "kv-offloading-size") == "2"
    assert flag(plain, "kv-offloading-size") is None  # per model
    for c in (chat, plain):
        assert flag(c, "kv-store-url") == f"redis://{STORE}:6379/0"  # no password in it
        ref = _env(c, "KV_STORE_PASSWORD")["valueFrom"]["secretKeyRef"]
        assert ref == {"name": STORE, "key": "kv-store-password"}
    secret = r.get("Secret", STORE)
    assert set(secret["data"]) == {"kv-store-password"}
    # The engine reads the flags back as the config the chart meant.
    from services.engine.serving.server_config import build_parser

    env = {**SAMPLE_ENV, "KV_STORE_PASSWORD": "x"}
    args = build_parser().parse_args(expand_env_refs(chat["args"], chat, env))
    assert (args.kv_offloading_size, args.kv_store_url) == (2.0, f"redis://{STORE}:6379/0")


def test_the_store_has_its_own_memory_cap_lru_and_password(rendered) -> None:
    r = rendered("kv-tiers")
    store = r.container(STORE)
    script = store["args"][0]
    assert "--maxmemory 2gb" in script and "--maxmemory-policy allkeys-lru" in script
    assert "requirepass" in script and "$REDIS_PASSWORD" in script
    assert _env(store, "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]["name"] == STORE
    assert r.get("Service", STORE)["spec"]["ports"][0]["port"] == 6379
    # Apart from the block index: a second Redis.
    assert f"{FULL}-redis" in r.names("Deployment") and STORE in r.names("Deployment")


def test_only_the_engines_reach_the_store(rendered) -> None:
    r = rendered("kv-tiers")
    (rule,) = r.get("NetworkPolicy", STORE)["spec"]["ingress"]
    (peer,) = rule["from"]
    allowed = {
        c for c in ("gateway", "router", "engine", "redis", "kv-store")
        if label_selector_matches(peer["podSelector"], {
            "app.kubernetes.io/name": "pagoda", "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": c})
    }
    assert allowed == {"engine"}
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]


def test_off_by_default(rendered) -> None:
    r = rendered("defaults")
    assert STORE not in r.names("Deployment")
    assert flag(r.container(engine("smollm2")), "kv-store-url") is None


def test_the_kv_tiers_example_in_the_docs_renders(chart: Any) -> None:
    import yaml

    from tests.deploy.helpers import CHART, render

    text = (CHART.parents[1] / "docs" / "deploy.md").read_text()
    block = text.split("## KV tiers", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    r = render(chart, yaml.safe_load(block))
    assert flag(r.container(engine("chat")), "kv-offloading-size") == "16"
    assert STORE in r.names("Deployment")
