"""The chart's side of the shared store's MAC key and of the KV events' token ids: with the
store on, every engine reads a generated (or the operator's) key from a mounted Secret, never
from its arguments; events carry no token ids unless the operator turns them on."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.helpers import flag, render
from tests.deploy.test_chart import engine
from tests.deploy.test_kv_tiers_chart import STORE

pytest.importorskip("helm_python", reason="pip install helm-python-sdk")

MAC = f"{STORE}-mac"
MOUNT = "/etc/pagoda/kv-store-mac"


def _pod(r: Any, deployment: str) -> dict[str, Any]:
    return r.get("Deployment", deployment)["spec"]["template"]["spec"]


def test_every_engine_reads_the_generated_mac_key_from_a_mounted_secret(rendered) -> None:
    r = rendered("kv-tiers")
    secret = r.get("Secret", MAC)
    assert set(secret["data"]) == {"kv-store-mac-key"}
    store_refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in r.container(STORE)["env"]
                  if "secretKeyRef" in e.get("valueFrom", {})]
    assert MAC not in store_refs  # the store never sees the key
    for name in ("chat", "plain"):
        c = r.container(engine(name))
        assert flag(c, "kv-store-secret-file") == f"{MOUNT}/kv-store-mac-key"
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == MOUNT]
        assert mount["readOnly"] is True
        (vol,) = [v for v in _pod(r, engine(name))["volumes"] if v["name"] == mount["name"]]
        assert vol["secret"]["secretName"] == MAC
        assert "--kv-events-token-ids" not in c["args"]  # off unless asked


def test_an_existing_secret_and_token_ids_on_request(chart: Any) -> None:
    from tests.deploy.conftest import KV_TIERS

    values = {**KV_TIERS, "engine": {"kvEventsTokenIds": True},
              "kvStore": {**KV_TIERS["kvStore"],
                          "macKey": {"existingSecret": "ops-kv", "secretKey": "mac"}}}
    r = render(chart, values)
    assert MAC not in r.names("Secret")
    c = r.container(engine("chat"))
    assert flag(c, "kv-store-secret-file") == f"{MOUNT}/mac"
    (vol,) = [v for v in _pod(r, engine("chat"))["volumes"] if v["name"] == "kv-store-mac"]
    assert vol["secret"] == {"secretName": "ops-kv", "items": [{"key": "mac", "path": "mac"}]}
    assert "--kv-events-token-ids" in c["args"]


def test_no_mac_key_without_the_store(rendered) -> None:
    r = rendered("defaults")
    assert MAC not in r.names("Secret")
    assert flag(r.container(engine("smollm2")), "kv-store-secret-file") is None
