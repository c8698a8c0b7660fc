"""Pod Security Standards: every pod the chart renders meets ``restricted``, except the
hostPath volumes of a ``hostPath`` model source, which the docs and schema say need a
``privileged`` namespace."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.deploy.helpers import CHART, REPO, Render

PRIVILEGED_LABEL = "pod-security.kubernetes.io/enforce=privileged"

# Volume types the restricted level admits (hostPath is the one the chart may add besides).
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip


def restricted_violations(pod: dict[str, Any]) -> Iterator[str]:
    """The ``restricted`` checks that can be made on a pod template alone."""
    spec = pod["spec"]
    pod_ctx = spec.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            yield key
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            yield f"volume {volume['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}"
    for c in spec.get("initContainers", []) + spec["containers"]:
        yield from (f"{c['name']}: {v}" for v in _container_violations(c, pod_ctx))


def _container_violations(c: dict[str, Any], pod_ctx: dict[str, Any]) -> Iterator[str]:
    ctx = c.get("securityContext") or {}
    if ctx.get("privileged"):
        yield "privileged"
    if ctx.get("allowPrivilegeEscalation") is not False:
        yield "allowPrivilegeEscalation not false"
    caps = ctx.get("capabilities") or {}
    if "ALL" not in (caps.get("drop") or []) or set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
        yield "capabilities"
    if not ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")):
        yield "runAsNonRoot"
    if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
        yield "runAsUser 0"
    seccomp = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"):
        yield f"seccompProfile {seccomp}"
    if any(p.get("hostPort") for p in c.get("ports") or []):
        yield "hostPort"


def violations(r: Render) -> dict[str, list[str]]:
    found = {
        w["metadata"]["name"]: list(restricted_violations(pod)) for w, pod in r.pod_templates()
    }
    return {name: v for name, v in found.items() if v}


@pytest.mark.parametrize("scenario", ["defaults", "two-models", "everything-on"])
def test_builtin_pvc_and_image_sources_meet_restricted(
    rendered: Callable[[str], Render], scenario: str
) -> None:
    assert violations(rendered(scenario)) == {}


def test_only_the_host_path_volumes_break_restricted(rendered: Callable[[str], Render]) -> None:
    # "local" has a hostPath source and the gateway reads its tokenizer from it; the other
    # model's created claim is fine, and so is everything else.
    assert violations(rendered("other-sources")) == {
        "demo-pagoda-engine-local": ["volume model: ['hostPath']"],
        "demo-pagoda-gateway": ["volume tokenizer-local: ['hostPath']"],
    }


def test_docs_and_schema_say_host_path_needs_a_privileged_namespace() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    host_path = schema["definitions"]["modelSource"]["properties"]["hostPath"]["description"]
    docs = (REPO / "docs" / "deploy.md").read_text()
    for text in (host_path, docs):
        assert PRIVILEGED_LABEL in text
        assert "baseline" in text and "restricted" in text
