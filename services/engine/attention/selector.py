"""Picks the attention backend: Triton on CUDA when it imports, the C++ kernels on the CPU when
they are built, torch everywhere else."""

from __future__ import annotations

import logging

import torch

from services.engine.attention.base import AttentionBackend
from services.engine.attention.cpu_backend import CpuAttentionBackend
from services.engine.attention.torch_backend import TorchAttentionBackend
from services.engine.cpu_ops import KERNEL_DTYPES, ops
from services.engine.kernels import interpreter_enabled, triton_available

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("torch", "triton", "cpu")


def get_attention_backend(
    device: torch.device | str, name: str | None = None, dtype: torch.dtype | None = None
) -> AttentionBackend:
    """Returns a new backend for ``device`` and a KV cache of ``dtype`` (None: any the backend
    takes); ``name`` None picks automatically.

    An explicit ``"triton"`` needs the triton package and a CUDA device (or a CPU device under
    ``TRITON_INTERPRET=1``, which is how the kernels are tested); ``"torch"`` runs anywhere;
    ``"cpu"`` needs the built CPU kernels and a float32 or bfloat16 cache.
    """
    device = torch.device(device)
    if name is None:
        name = _automatic_choice(device, dtype)
    key = name.strip().lower()
    if key == "torch":
        return TorchAttentionBackend()
    if key == "cpu":
        if device.type != "cpu" or ops() is None:
            raise ValueError(
                f"attention backend 'cpu' needs a CPU device and the built CPU kernels "
                f"(`python -m services.engine.cpu_ops`), not {device}"
            )
        if dtype is not None and dtype not in KERNEL_DTYPES:
            raise ValueError(f"attention backend 'cpu' runs float32 and bfloat16, not {dtype}")
        return CpuAttentionBackend()
    if key == "triton":
        _check_triton_usable(device)
        # Imported here so CPU-only engines never import triton at all.
        from services.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; valid names: {', '.join(BACKEND_NAMES)}")


def _automatic_choice(device: torch.device, dtype: torch.dtype | None) -> str:
    if device.type == "cpu" and ops() is not None and dtype in (None, *KERNEL_DTYPES):
        return "cpu"
    if device.type != "cuda":
        return "torch"
    if triton_available():
        return "triton"
    logger.warning("triton is not installed; attention on %s falls back to torch", device)
    return "torch"


def _check_triton_usable(device: torch.device) -> None:
    if not triton_available():
        raise ValueError(
            "attention backend 'triton' needs the triton package (the 'gpu' extra); "
            "use 'torch' instead"
        )
    if device.type != "cuda" and not interpreter_enabled():
        raise ValueError(
            f"attention backend 'triton' runs on CUDA devices, not {device} "
            "(set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter)"
        )
