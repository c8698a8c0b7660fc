"""The layering DESIGN.md states, checked on every import in the source (lazy ones inside
functions, and type-checking ones, included): contracts import no service, shared code imports
no service, the three services meet only in protocol, common and text; and inside the engine
no two of its parts import each other, however indirectly. The engine's parts are its
subpackages (attention, models, parallel, serving, ...) and "core", its top-level modules
taken together (engine, scheduler, model runner, ...)."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parents[2] / "services"
ENGINE = SERVICES / "engine"
CORE = "core"
# package -> the services packages its modules may import (besides itself)
ALLOWED = {
    "protocol": set(),
    "common": {"protocol"},
    "text": {"protocol", "common"},  # common.model_files: the tokenizer's end-of-sequence ids
    "engine": {"protocol", "common", "text"},
    # text: the endpoint picker renders and tokenizes prompts as the gateway does (DESIGN.md:
    # the services meet in protocol, common and text)
    "router": {"protocol", "common", "text"},
    "gateway": {"protocol", "common", "text"},
}
# Engine seams with a direction, named so that a failure says which one broke (the cycle check
# alone would pass while the other direction happens to be unused).
FORBIDDEN = {
    ("parallel", "models"): "the models' parallel layers build on parallel.group, not back",
    ("parallel", CORE): "the core starts the workers (by module name), not back",
    (CORE, "serving"): "serving runs the engine; the engine knows nothing of serving",
}


def _module_name(path: Path) -> list[str]:
    parts = list(path.relative_to(SERVICES.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(path: Path) -> Iterator[tuple[str, int]]:
    """(dotted name, line) of everything a module imports, wherever the statement is:
    ``m.a`` for ``from m import a`` (``a`` may be a module: ``from services.engine import
    models`` imports models, not ``services.engine``); relative imports resolved."""
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                yield f"{module}.{alias.name}", node.lineno


def _imported_packages(path: Path) -> set[str]:
    """The ``services.<package>`` names a module imports."""
    out = set()
    for name, _ in _imports(path):
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


# -- inside the engine ---------------------------------------------------------------------------


def _engine_parts() -> set[str]:
    return {p.name for p in ENGINE.iterdir() if (p / "__init__.py").is_file()}


def _part_of(name: str, parts: set[str]) -> str | None:
    """The engine part a dotted name lies in; None outside the engine. ``services.engine``
    itself, and anything named from it that is not a subpackage, is core."""
    dotted = name.split(".")
    if dotted[:2] != ["services", "engine"]:
        return None
    return dotted[2] if len(dotted) > 2 and dotted[2] in parts else CORE


def _engine_edges() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) part -> where (file:line), for every import across parts."""
    parts = _engine_parts()
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ENGINE.rglob("*.py")):
        rel = path.relative_to(ENGINE)
        source = rel.parts[0] if len(rel.parts) > 1 else CORE
        for name, line in _imports(path):
            target = _part_of(name, parts)
            if target is None or target == source:
                continue
            edges.setdefault((source, target), []).append(f"{rel}:{line}")
    return edges


def _find_cycle(edges: set[tuple[str, str]]) -> list[str] | None:
    """One cycle of the graph as its nodes, first repeated at the end; None if it has none."""
    after: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        after.setdefault(a, []).append(b)
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in after.get(node, []):
            if found := visit(nxt, path + [node]):
                return found
        done.add(node)
        return None

    for start in sorted(after):
        if found := visit(start, []):
            return found
    return None


def test_engine_parts_import_each_other_one_way_only() -> None:
    edges = _engine_edges()
    cycle = _find_cycle(set(edges))
    where = {} if cycle is None else {
        f"{a} -> {b}": edges[a, b][:3] for a, b in itertools.pairwise(cycle)}
    assert cycle is None, f"the engine's parts import each other: {' -> '.join(cycle)} {where}"


@pytest.mark.parametrize(("importer", "imported"), sorted(FORBIDDEN))
def test_engine_seams_keep_their_direction(importer: str, imported: str) -> None:
    found = _engine_edges().get((importer, imported))
    assert not found, f"{importer} imports {imported} ({FORBIDDEN[importer, imported]}): {found}"


def test_the_checks_see_what_they_check() -> None:
    """The graph has the parts and the edges the layout is known to have (lazy and relative
    imports resolved), so the checks above cannot pass by seeing nothing."""
    edges = _engine_edges()
    assert {"attention", "models", "parallel", "serving", "structured"} <= _engine_parts()
    assert {(CORE, "parallel"), ("models", "parallel"), ("serving", CORE)} <= set(edges)
    assert _find_cycle({("a", "b"), ("b", "c"), ("c", "a")}) == ["a", "b", "c", "a"]
    assert _find_cycle({("a", "b"), ("b", "c"), ("a", "c")}) is None
