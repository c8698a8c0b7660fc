"""Pagoda's CPU kernels, compiled once per environment: ``csrc/cpu_ops.cpp`` (attention, norms,
sampling) and, as a library of its own so that neither rebuilds when the other changes,
``csrc/w4a16.cpp`` (the 4-bit weights' product) and ``csrc/w8a8.cpp`` (the int8 product for CPUs
without int8 dot-product instructions).

``make install`` builds them (``python -m services.engine.cpu_ops``, about a minute); later
imports load the cached libraries from the virtualenv. ``ops()``, ``w4a16_ops()`` and
``w8a8_ops()`` return the loaded module, or None when it cannot be used (no compiler, a non-x86
CPU, ``PAGODA_CPU_OPS=0``): callers then take the torch implementation, which is also each
kernel's reference in the tests.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from services.common.logs import setup_logging

logger = logging.getLogger(__name__)

ENV_SWITCH = "PAGODA_CPU_OPS"  # "0" turns the kernels off (the torch paths run instead)
_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]
# The dtypes the kernels compute in (csrc/cpu_ops.cpp); float16 models take the torch paths.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class Library:
    name: str
    source: Path


CORE = Library("pagoda_cpu_ops", Path(__file__).parent / "csrc" / "cpu_ops.cpp")
W4A16 = Library("pagoda_w4a16", Path(__file__).parent / "csrc" / "w4a16.cpp")
W8A8 = Library("pagoda_w8a8", Path(__file__).parent / "csrc" / "w8a8.cpp")


def build_dir(library: Library = CORE) -> Path:
    """Next to the interpreter's packages, so a new virtualenv (a new torch) builds afresh;
    one directory per source version and checkout, so checkouts sharing a virtualenv each keep
    their own build instead of rebuilding over one another (the build file names the source's
    path: two checkouts of one version in one directory rebuilt at every switch, and a build
    killed midway left a lock that every later load waited on)."""
    version = torch.__version__.replace("+", "_")
    source = hashlib.sha256(library.source.read_bytes()).hexdigest()[:12]
    checkout = hashlib.sha256(str(library.source.resolve()).encode()).hexdigest()[:6]
    return Path(sys.prefix) / "pagoda-ext" / f"{library.name}-torch{version}-{source}-{checkout}"


def ops() -> ModuleType | None:
    """The core kernels (``csrc/cpu_ops.cpp``)."""
    return _loaded(CORE)


def w4a16_ops() -> ModuleType | None:
    """The 4-bit weights' product (``csrc/w4a16.cpp``)."""
    return _loaded(W4A16)


def w8a8_ops() -> ModuleType | None:
    """The int8 product and per-row quantization (``csrc/w8a8.cpp``)."""
    return _loaded(W8A8)


@functools.cache
def _loaded(library: Library) -> ModuleType | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        return _load(library, verbose=False)
    except Exception as exc:  # noqa: BLE001 -- any build failure means: use the torch paths
        logger.warning(
            "CPU kernels %s unavailable (%s: %s); using the torch implementations",
            library.name,
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        return None


def kernels_for(x: torch.Tensor) -> ModuleType | None:
    """The kernels for ``x``'s ops, or None (not a CPU tensor, or the kernels are not built)."""
    return ops() if x.device.type == "cpu" else None


def _load(library: Library, verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    directory = build_dir(library)
    directory.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=library.name,
        sources=[str(library.source)],
        extra_cflags=_CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        verbose=verbose,
    )


def main() -> None:
    """Builds (or finds) the kernels and says where they are."""
    setup_logging("INFO", "cpu-ops")
    for library in (CORE, W4A16, W8A8):
        module = _load(library, verbose=False)
        print(f"{library.name}: {module.__file__}")
