"""Triton kernels for the GPU path: KV store, paged attention, fused RMSNorm.

Triton is an optional dependency (the ``gpu`` extra). Nothing here imports it eagerly: each
kernel module guards its own import, so CPU-only installs import the package fine and only
calling a kernel without Triton fails (with a clear error).

``TRITON_INTERPRET=1`` runs the kernels on CPU tensors through Triton's interpreter (used by
the tests). Triton reads the variable when a ``@triton.jit`` function is *defined*, i.e. when
a kernel module is first imported, so it must be set before that import.
"""

from __future__ import annotations

import functools
import importlib
import os


@functools.cache
def triton_available() -> bool:
    """True when ``import triton`` works (it may still lack a GPU to launch on)."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def require_triton() -> None:
    """Raises a clear error when a kernel is called without Triton installed."""
    if not triton_available():
        raise RuntimeError("Triton is not installed; install the 'gpu' extra or use the torch path")
