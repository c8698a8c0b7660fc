"""The Dockerfiles, checked without a Docker engine: what they COPY exists and reaches the
build context, the modules they and the chart run exist and start, base images are pinned,
the images run as the chart's non-root user, and the service image's requirements cover what
the gateway and the router import (without torch)."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.helpers import CHART, REPO

DOCKER = REPO / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
SERVICE_REQUIREMENTS = DOCKER / "service-requirements.txt"
ENTRY_MODULES = ("services.engine.serving.server", "services.router", "services.gateway")


# --------------------------------------------------------------------------------------------
# A small Dockerfile reader: instructions with continuations joined, ARG defaults applied.


def instructions(path: Path) -> list[tuple[str, str]]:
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    out = []
    for line in lines:
        op, _, rest = line.partition(" ")
        out.append((op.upper(), rest.strip()))
    return out


def arg_defaults(path: Path) -> dict[str, str]:
    defaults = {}
    for op, rest in instructions(path):
        if op == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            defaults[name] = value.strip('"')
    return defaults


def substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(
        r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), text
    )


def copy_sources(path: Path) -> list[str]:
    """Sources of COPY instructions from the build context (not --from=stage)."""
    sources = []
    for op, rest in instructions(path):
        if op != "COPY":
            continue
        words = shlex.split(rest)
        if any(w.startswith("--from=") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        sources += words[:-1]
    return sources


def exec_form(rest: str) -> list[str]:
    return yaml.safe_load(rest)  # a JSON array is YAML


# --------------------------------------------------------------------------------------------
# .dockerignore, as Docker reads it: patterns in order, the last match wins, `!` re-includes,
# a pattern that matches a directory matches everything under it.


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def dockerignore_excludes(relpath: str) -> bool:
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rules.append((negate, _pattern_regex(line.lstrip("!").strip("/"))))
    parts = relpath.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negate, regex in rules:
        if any(regex.match(c) for c in candidates):
            excluded = not negate
    return excluded


# --------------------------------------------------------------------------------------------


def test_there_are_an_engine_and_a_service_dockerfile() -> None:
    assert [p.name for p in DOCKERFILES] == ["engine.Dockerfile", "service.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_path_exists_and_is_in_the_build_context(dockerfile: Path) -> None:
    sources = copy_sources(dockerfile)
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"{dockerfile.name} copies missing {source}"
        assert not dockerignore_excludes(source), f".dockerignore excludes {source}"
        if (REPO / source).is_dir():
            for file in (REPO / source).rglob("*.py"):
                rel = file.relative_to(REPO).as_posix()
                assert not dockerignore_excludes(rel), rel


def test_dockerignore_keeps_the_context_small() -> None:
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/conftest.py",
        "charts/pagoda/Chart.yaml",
        "services/gateway/__pycache__/x.cpython-311.pyc",
    ):
        assert dockerignore_excludes(path), path


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_by_tag(dockerfile: Path) -> None:
    args = arg_defaults(dockerfile)
    stages = []
    for op, rest in instructions(dockerfile):
        if op != "FROM":
            continue
        words = rest.split()
        image = substitute(words[0], args)
        if image in stages:  # FROM an earlier stage
            continue
        if len(words) == 3 and words[1].upper() == "AS":
            stages.append(words[2])
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and re.search(r"\d", tag), image
        assert "$" not in image, image


def test_engine_image_is_cuda_based_and_the_service_image_is_slim() -> None:
    engine = arg_defaults(DOCKER / "engine.Dockerfile")["CUDA_IMAGE"]
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d\d\.\d\d", engine), engine
    service = arg_defaults(DOCKER / "service.Dockerfile")["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", service), service


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_the_charts_non_root_user_with_a_healthcheck(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    runtime = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM") :]
    users = [rest for op, rest in runtime if op == "USER"]
    assert users, f"{dockerfile.name}: the final stage sets no USER"
    uid = users[-1].split(":")[0]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert uid == str(values["podSecurityContext"]["runAsUser"]) != "0"
    assert uid == str(values["containerSecurityContext"]["runAsUser"])
    healthchecks = [rest for op, rest in runtime if op == "HEALTHCHECK"]
    assert len(healthchecks) == 1 and "healthcheck.py" in healthchecks[0]
    # The chart mounts emptyDirs on /tmp and /cache: the caches must point there.
    env = " ".join(rest for op, rest in runtime if op == "ENV")
    for var in ("HF_HOME=/cache/", "XDG_CACHE_HOME=/cache", "HOME=/tmp", "HF_HUB_OFFLINE=1"):
        assert var in env, (dockerfile.name, var)


def test_torch_version_matches_pyproject() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    pinned = re.search(r'"torch==([^"]+)"', pyproject).group(1)
    for dockerfile in DOCKERFILES:
        version = arg_defaults(dockerfile).get("TORCH_VERSION")
        if version is not None:
            assert version == pinned, dockerfile.name


def _modules_run_by_images_and_chart() -> set[str]:
    modules = set()
    for dockerfile in DOCKERFILES:
        for op, rest in instructions(dockerfile):
            if op in ("CMD", "ENTRYPOINT") and rest.startswith("["):
                words = exec_form(rest)
                if "-m" in words:
                    modules.add(words[words.index("-m") + 1])
    for template in (CHART / "templates").glob("*.yaml"):
        modules.update(re.findall(r'"-m", "([\w.]+)"', template.read_text()))
    return modules


def test_entry_modules_exist_and_start() -> None:
    """Every module an image or the chart runs exists, and `python -m MODULE --help` exits 0
    (run side by side: the engine's imports torch)."""
    modules = _modules_run_by_images_and_chart()
    assert modules == set(ENTRY_MODULES)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    procs = {
        m: subprocess.Popen(
            [sys.executable, "-m", m, "--help"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for m in sorted(modules)
    }
    for module, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{module} --help: {err[-2000:]}"
        assert "usage:" in out


def test_service_image_default_command_names_its_model() -> None:
    """Without --model the gateway imports the default-model converter, which needs torch:
    the torch-free service image must start it with the baked-in tokenizer directory."""
    steps = instructions(DOCKER / "service.Dockerfile")
    (cmd,) = [exec_form(rest) for op, rest in steps if op == "CMD"]
    assert cmd[:3] == ["python", "-m", "services.gateway"]
    assert "--model" in cmd
    directory = cmd[cmd.index("--model") + 1].partition("=")[2]
    assert directory == "/opt/pagoda/models/SmolLM2-135M-Instruct"


# --------------------------------------------------------------------------------------------
# The service image's requirements: what the gateway and the router import, and no torch.


def _imports(path: Path, module: str, *, lazy: bool) -> Iterator[tuple[str, bool]]:
    """(imported module, is_services) for each import; function-level ones only when lazy.
    Imports under `if TYPE_CHECKING:` never run and are skipped."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST, in_function: bool) -> Iterator[str]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import) and (lazy or not in_function):
                yield from (a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and (lazy or not in_function):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    name = ".".join(base + ([child.module] if child.module else []))
                else:
                    name = child.module or ""
                yield name
                yield from (f"{name}.{a.name}" for a in child.names)
            yield from visit(child, nested)

    for name in visit(tree, False):
        yield name, name.split(".")[0] == "services"


def _module_file(name: str) -> Path | None:
    base = REPO / Path(*name.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def service_third_party_imports() -> set[str]:
    """Third-party modules the gateway and the router can import at run time: everything in
    services.{gateway,router,protocol,common,text}; of other services modules they reach only
    the module-level imports."""
    own = ("services.gateway", "services.router", "services.protocol", "services.common",
           "services.text")
    seen: set[str] = set()
    third: set[str] = set()
    todo = ["services.gateway.__main__", "services.router.__main__"]
    while todo:
        module = todo.pop()
        path = _module_file(module)
        if module in seen or path is None:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        lazy = module.startswith(own)
        for name, is_services in _imports(path, module, lazy=lazy):
            if is_services:
                todo.append(name)
            elif name.split(".")[0] not in sys.stdlib_module_names and name != "__future__":
                third.add(name)
    assert not any(m.startswith("services.engine") for m in seen), "the engine reached"
    return third


def _distribution_of(module: str, top_level: dict[str, list[str]]) -> str | None:
    """The installed distribution providing `module`; None for a name that is no module (a
    class imported from a module). Namespace packages (opentelemetry) are told apart by the
    files of their few candidate distributions."""
    candidates = top_level.get(module.split(".")[0])
    assert candidates, f"no installed distribution provides {module}"
    if len(candidates) == 1:
        return canonicalize_name(candidates[0])
    parts = module.split(".")
    while parts:
        base = "/".join(parts)
        for dist in candidates:
            files = {f.as_posix() for f in importlib.metadata.distribution(dist).files or []}
            if f"{base}/__init__.py" in files or f"{base}.py" in files:
                return canonicalize_name(dist)
        parts.pop()
    return None


def _requirements() -> dict[str, Requirement]:
    reqs = {}
    for line in SERVICE_REQUIREMENTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            reqs[canonicalize_name(req.name)] = req
    return reqs


def test_service_requirements_cover_gateway_and_router_imports() -> None:
    top_level = importlib.metadata.packages_distributions()
    needed = {}
    for module in sorted(service_third_party_imports()):
        dist = _distribution_of(module, top_level)
        if dist is not None:  # a name imported from a module, not a module itself
            needed.setdefault(dist, module)
    assert "torch" not in needed and "triton" not in needed, needed
    listed = _requirements()
    missing = {d: m for d, m in needed.items() if d not in listed}
    assert not missing, f"imported by the gateway/router, not in the requirements: {missing}"
    assert {"aiohttp", "redis", "transformers", "kubernetes"} <= set(needed)


def test_service_requirements_are_pinned_within_pyproject_and_torch_free() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {
        canonicalize_name(Requirement(r).name): Requirement(r) for r in project["dependencies"]
    }
    for name, req in _requirements().items():
        assert name not in ("torch", "triton", "nvidia-cuda-runtime-cu12"), name
        pins = [s for s in req.specifier if s.operator == "=="]
        assert len(pins) == 1, f"{req} is not pinned"
        if name in declared:
            assert declared[name].specifier.contains(pins[0].version), (
                f"{req} is outside pyproject.toml's {declared[name]}"
            )


# --------------------------------------------------------------------------------------------
# The HEALTHCHECK script.


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def health_server() -> Iterator[HTTPServer]:
    server = HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _healthcheck(*args: str, **env: str) -> int:
    return subprocess.run(
        [sys.executable, str(DOCKER / "healthcheck.py"), *args],
        check=False,
        env={**os.environ, **env},
        capture_output=True,
        timeout=30,
    ).returncode


def _closed_port() -> str:
    """A port nothing listens on (bound, read, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_healthcheck_script(health_server: HTTPServer) -> None:
    port = str(health_server.server_address[1])
    closed = _closed_port()
    assert _healthcheck(closed, port) == 0  # any port answering 200 is healthy
    assert _healthcheck(closed) == 1
    _Health.status = 503  # an engine still loading its model
    try:
        assert _healthcheck(port) == 1
    finally:
        _Health.status = 200
    assert _healthcheck(PAGODA_HEALTH_URL=f"http://127.0.0.1:{port}/health") == 0
    assert _healthcheck() == 2
