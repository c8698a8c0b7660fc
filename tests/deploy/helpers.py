"""Rendering the Helm chart offline and walking what it renders.

``render`` goes through Helm's own Go SDK (``helm-python-sdk``): values are checked against
``values.schema.json`` and ``required``/``fail`` run exactly as under ``helm install``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pagoda"
RELEASE = "demo"
NAMESPACE = "llm"

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")

# $(VAR) references that Kubernetes expands in args from the container's env.
_ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass
class Render:
    """One rendering: the manifests as dicts, and the NOTES text."""

    docs: list[dict[str, Any]]
    notes: str
    values: dict[str, Any] = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert found, f"no {kind} {name!r} rendered; have {self.names(kind)}"
        return found[0]

    def names(self, kind: str) -> list[str]:
        return [d["metadata"]["name"] for d in self.of_kind(kind)]

    def workloads(self) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] in WORKLOAD_KINDS]

    def pod_templates(self) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        """(workload, pod template) for every workload."""
        for w in self.workloads():
            yield w, w["spec"]["template"]

    def container(self, deployment: str, name: str | None = None) -> dict[str, Any]:
        spec = self.get("Deployment", deployment)["spec"]["template"]["spec"]
        containers = spec["containers"]
        if name is None:  # the pod's own container: sidecars (an engine's OpenAI front) follow
            return containers[0]
        return next(c for c in containers if c["name"] == name)


def render(chart: Any, values: Mapping[str, Any] | None = None, **kwargs: Any) -> Render:
    manifests = chart.render(
        values=copy.deepcopy(dict(values or {})),
        name=kwargs.get("name", RELEASE),
        namespace=kwargs.get("namespace", NAMESPACE),
    )
    docs: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append(doc)
    return Render(docs, notes, dict(values or {}))


def all_containers(pod_spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(pod_spec.get("initContainers") or []) + list(pod_spec["containers"])


def env_of(container: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env") or []}


def flag(container: Mapping[str, Any], name: str) -> str | None:
    """The value of ``--name=value`` in the container's args (None when absent)."""
    values = flags(container, name)
    assert len(values) <= 1, f"{name} given {len(values)} times"
    return values[0] if values else None


def flags(container: Mapping[str, Any], name: str) -> list[str]:
    prefix = f"--{name}="
    return [a[len(prefix) :] for a in container.get("args") or [] if a.startswith(prefix)]


def expand_env_refs(args: list[str], container: Mapping[str, Any], sample: Mapping[str, str]):
    """Args as the process sees them: each $(VAR) must name an env var of the container."""
    defined = env_of(container)
    out = []
    for arg in args:
        for ref in _ENV_REF.findall(arg):
            assert ref in defined, f"{arg!r} refers to $({ref}), not in the container's env"
        out.append(_ENV_REF.sub(lambda m: sample.get(m.group(1), "x"), arg))
    return out


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def label_selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector (matchLabels + matchExpressions In/NotIn/Exists)."""
    if not selects(selector.get("matchLabels") or {}, labels):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, vals = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in vals:
            return False
        if op == "NotIn" and labels.get(key) in vals:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
