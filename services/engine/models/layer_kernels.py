"""Which implementation a model's norms, activation, rotary and experts run: chosen once.

A ``LayerKernels`` is one set of functions for one device and dtype, picked by
``select_kernels`` when the model is loaded (the loader binds it to every layer through
``CausalLM.use_kernels``): Triton kernels on CUDA when Triton imports, the C++ kernels on the
CPU when they are built (float32 and bfloat16), torch everywhere else. Layers then call
``self.kernels.<op>`` and check nothing per call: no device test, no import, no dtype branch.

Until a model is bound its layers use ``torch_kernels(dtype)``, which run on any device (a
layer built directly, as some tests do, just works).

What the layers pass, which every implementation relies on: norms and the activation take
``[T, hidden]`` rows (unit stride within a row), the residual stream is a contiguous tensor the
forward pass owns, the rotary table is ``RotaryEmbedding.cos_sin`` in the model's dtype.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from services.engine.cpu_ops import KERNEL_DTYPES, ops
from services.engine.kernels import triton_available
from services.engine.models import experts as expert_paths

logger = logging.getLogger(__name__)

Tensor = torch.Tensor


@dataclass(frozen=True, slots=True)
class LayerKernels:
    """One device's implementations of the per-layer ops (see the module docstring)."""

    name: str  # "triton", "cpu" or "torch"
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]  # (x, weight, eps) -> normalised x
    # (x, residual, weight, eps) -> (normalised residual + x, residual): residual += x in place.
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]  # [T, 2I] -> [T, I]
    # In place on (x [T, heads, d], cos_sin table, positions [T]), returning x; None: the torch
    # path, which gathers each step's cos/sin rows once (``RotaryEmbedding``).
    rotary: Callable[[Tensor, Tensor, Tensor], Tensor] | None
    # (x, gate_up [E, 2I, H], down [E, H, I], weights [T, K], experts [T, K]) -> [T, H]
    experts: expert_paths.ExpertsFn


def select_kernels(device: torch.device | str, dtype: torch.dtype) -> LayerKernels:
    """The kernels for a model on ``device`` in ``dtype``; called once, when it is loaded."""
    device = torch.device(device)
    if device.type == "cuda" and triton_available():
        kernels = triton_kernels()
    elif device.type == "cpu" and dtype in KERNEL_DTYPES and ops() is not None:
        kernels = cpu_kernels(ops())
    else:
        kernels = torch_kernels(dtype)
    logger.info("layer kernels for %s %s: %s", device, dtype, kernels.name)
    return kernels


@functools.cache
def triton_kernels() -> LayerKernels:
    """The Triton kernels (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``). Their modules are
    imported here, once: a CPU-only engine never imports Triton."""
    from services.engine.kernels import activation, grouped_gemm, rmsnorm, rotary

    return LayerKernels(
        name="triton",
        rms_norm=rmsnorm.rms_norm,
        add_rms_norm=rmsnorm.fused_add_rms_norm,
        silu_and_mul=activation.silu_and_mul,
        rotary=rotary.apply_rotary_,
        experts=functools.partial(
            expert_paths.routed_experts,
            gemm=grouped_gemm.grouped_gemm,
            act=activation.silu_and_mul,
        ),
    )


def cpu_kernels(cpu: ModuleType) -> LayerKernels:
    """The C++ kernels of ``services.engine.cpu_ops`` (float32, bfloat16)."""

    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return cpu.rms_norm(x, None, weight, eps)

    def add_rms_norm(
        x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        return cpu.rms_norm(x, residual, weight, eps), residual  # residual += x inside

    def rotary(x: Tensor, cos_sin: Tensor, positions: Tensor) -> Tensor:
        cpu.rotary_(x, cos_sin, positions)
        return x

    return LayerKernels(
        name="cpu",
        rms_norm=rms_norm,
        add_rms_norm=add_rms_norm,
        silu_and_mul=cpu.silu_and_mul,
        rotary=rotary,
        # On the CPU reading the expert counts costs nothing (no device to wait for) and the
        # engine captures no graphs: the host-grouped path, which measured faster there.
        experts=functools.partial(expert_paths.grouped_experts, act=cpu.silu_and_mul),
    )


@functools.cache
def torch_kernels(dtype: torch.dtype) -> LayerKernels:
    """Torch implementations for ``dtype``, on any device; also the kernels' references."""
    norm = _rms_norm_f32 if dtype == torch.float32 else _rms_norm_upcast

    def add_rms_norm(
        x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        residual.add_(x)
        return norm(residual, weight, eps), residual

    return LayerKernels(
        name="torch",
        rms_norm=norm,
        add_rms_norm=add_rms_norm,
        silu_and_mul=silu_and_mul_torch,
        rotary=None,
        experts=functools.partial(expert_paths.grouped_experts, act=silu_and_mul_torch),
    )


# --------------------------------------------------------------------------- torch paths


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim; statistics in float32, like the HF reference."""
    return (_rms_norm_f32 if x.dtype == torch.float32 else _rms_norm_upcast)(x, weight, eps)


def _rms_norm_f32(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rms_norm_upcast(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    # HF rounds to the model dtype before the weight multiply; keep its rounding order.
    return weight * normed.to(x.dtype)


def silu_and_mul_torch(gate_up: Tensor) -> Tensor:
    """SwiGLU on a fused ``[gate | up]`` projection: ``F.silu(gate) * up``, as HF rounds it."""
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :half]) * gate_up[..., half:]
