"""Triton kernels for the GPU path: KV store, paged attention, fused RMSNorm, SiLU-and-mul,
RoPE and the experts' grouped matmul.

Triton is an optional dependency (the ``gpu`` extra). Nothing here imports it eagerly: each
kernel module guards its own import, so CPU-only installs import the package fine and only
calling a kernel without Triton fails (with a clear error).

The wrappers run once per layer, so they check nothing per call: which implementation runs is
decided once per model (``models.layer_kernels``), the caches once when allocated and each
step's metadata once per step (``attention.contract``). What a kernel needs of its arguments is
written down in a ``check_*`` function beside it, which the tests call.

``TRITON_INTERPRET=1`` runs the kernels on CPU tensors through Triton's interpreter (used by
the tests). Triton reads the variable when a ``@triton.jit`` function is *defined*, i.e. when
a kernel module is first imported, so it must be set before that import.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from typing import TypeVar

import torch

_F = TypeVar("_F", bound=Callable)


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


def triton_only(wrapper: _F) -> _F:
    """``wrapper`` itself when Triton is installed, else a stand-in that raises a clear error.

    Decided once, when the kernel module is imported, so the wrapper checks nothing per call.
    """
    if triton_available():
        return wrapper

    @functools.wraps(wrapper)
    def missing(*args: object, **kwargs: object) -> None:
        require_triton()

    return missing  # type: ignore[return-value]


def dot_modes(interpreted: bool) -> dict[torch.dtype, tuple[str, bool]]:
    """Per input dtype: (tl.dot input_precision, whether to upcast bf16 operands to fp32).

    A kernel module computes this once, when its kernels are defined (``interpreted``: they run
    in Triton's CPU interpreter). The interpreter multiplies bf16 tl.dot operands as raw uint16
    bits; there the dots run in fp32 instead (on a GPU bf16 stays on the tensor cores). fp32
    inputs would otherwise be truncated to TF32 on the tensor cores; the precision is ignored
    for fp16 and bf16.
    """
    return {
        torch.float32: ("ieee", False),
        torch.float16: ("tf32", False),
        torch.bfloat16: ("ieee", True) if interpreted else ("tf32", False),
    }
