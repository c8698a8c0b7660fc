"""The layering DESIGN.md states, checked on every import in the source (lazy ones inside
functions included): contracts import no service, shared code imports no service, and the
three services meet only in protocol, common and text."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parents[2] / "services"
# package -> the services packages its modules may import (besides itself)
ALLOWED = {
    "protocol": set(),
    "common": {"protocol"},
    "text": {"protocol", "common"},  # common.model_files: the tokenizer's end-of-sequence ids
    "engine": {"protocol", "common", "text"},
    "router": {"protocol", "common"},
    "gateway": {"protocol", "common", "text"},
}


def _imported_packages(path: Path) -> set[str]:
    """The ``services.<package>`` names a module imports, wherever the import statement is."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] in ALLOWED:
                out.add(parts[1])
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_it_may(package: str) -> None:
    bad = {}
    for path in sorted((SERVICES / package).rglob("*.py")):
        wrong = _imported_packages(path) - ALLOWED[package] - {package}
        if wrong:
            bad[str(path.relative_to(SERVICES))] = sorted(wrong)
    assert not bad, f"imports across the layering: {bad}"


def test_every_package_is_covered() -> None:
    packages = {p.name for p in SERVICES.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(ALLOWED)
