"""W8A8 int8: static per-channel symmetric int8 weights, dynamic per-token int8 activations.

The checkpoint holds ``weight`` (int8 ``[out, in]``) and ``weight_scale`` (``[out, 1]``), as
compressed-tensors' ``int-quantized`` format writes them: ``W ~= weight * weight_scale``.
Each step every row of the input is quantized on its own (``scale = max|x| / 127``,
``q = round(x / scale)``), the product runs on int8 with int32 sums, and the sums are scaled back
in float32: ``y = (q @ weight^T) * scale * weight_scale + bias``.

Three implementations of that one math, bit for bit the same results, all with the rows
quantized by ``csrc/w8a8.cpp``'s fused op where the kernels are built:

- ``csrc/w8a8.cpp``'s VNNI product (``w8a8_linear_vnni``) on CPUs with AVX512-VNNI, from a copy
  of the weight packed once (``pack``) into 64-byte vectors of 16 outputs by 4 inputs. On a
  2-core AMD EPYC with AVX512-VNNI (two threads, best of 15) it took 0.3-1.0 ms at 1-16 rows of a
  2048 -> 8192 weight, where ``_int_mm`` took 0.6-2.7 ms and the packed bfloat16 product 1.0-2.0;
  12.6 ms at 256 rows against 15.9 and 20.8 (docs/benchmarks.md, "Quantized checkpoints").
  There the packed copy is the only one kept.
- ``torch._int_mm`` (oneDNN's int8 GEMM) on CPUs with AMX-INT8, for steps of more than
  ``VNNI_ROWS_BESIDE_AMX`` rows: oneDNN's AMX tiles (never measured here; no such machine has
  run it). Those CPUs keep both copies of the weight.
- ``csrc/w8a8.cpp``'s AVX2 product elsewhere (AVX2 only, or a non-x86 CPU): there ``_int_mm``
  takes a reference path 10-35x slower than float32. The kernel's sums are exact int32 (int16
  pair products); it serves every row count (it matches float32 ``F.linear`` at 1,024 rows, and
  beats it 2.5x at one).

On a GPU (unless ``PAGODA_W8A8_TRITON=0``) the rows are quantized in torch and multiplied by
``w8a8_triton``'s kernel, the same results bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from services.engine.cpu_ops import w8a8_ops
from services.engine.cpu_ops.isa import has_amx_int8, has_int8_dot
from services.engine.quantization.base import (
    PER_OUTPUT,
    WEIGHT,
    LinearMethod,
    ParamLayout,
    frozen_param,
)
from services.engine.quantization.w8a8_triton import int8_linear_triton

# Any positive scale quantizes a row of zeros to zeros; this one keeps 0 / 0 out.
_MIN_SCALE = 1e-30
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# On CPUs with AMX-INT8, steps of more rows than this go to ``_int_mm`` (oneDNN's AMX tiles):
# below it oneDNN's small-row path is 2-6x slower than the VNNI kernel on AVX512-VNNI.
VNNI_ROWS_BESIDE_AMX = 32
# The VNNI product's sums are exact for narrower inputs only (|sum| <= in * 255 * 128 < 2^31);
# a wider layer keeps ``_int_mm``.
VNNI_MAX_IN = 1 << 16


@dataclass(frozen=True, slots=True)
class VnniWeight:
    """An int8 weight in ``csrc/w8a8.cpp``'s ``pack_vnni`` layout: ``packed`` int8
    ``[out / 16, in / 4, 16, 4]`` (padded), ``comp`` int32 ``[out]`` (128 times each output's
    weight sum: the activations go in offset by 128)."""

    packed: torch.Tensor
    comp: torch.Tensor
    out_features: int


def pack_vnni(kernels: ModuleType, weight: torch.Tensor) -> VnniWeight:
    packed, comp = kernels.pack_vnni(weight.contiguous())
    return VnniWeight(packed, comp, weight.shape[0])


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: (q ``[T, in]`` int8, scale ``[T, 1]`` float32), with
    ``x ~= q * scale``."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).div_(127.0).clamp_min_(_MIN_SCALE)
    q = (xf / scale).round_().clamp_(-128, 127).to(torch.int8)
    return q, scale


def int8_linear_torch(
    x: torch.Tensor, weight: torch.Tensor, scale_row: torch.Tensor
) -> torch.Tensor:
    """``x`` ``[T, in]`` times the int8 ``weight`` ``[out, in]`` -> float32 ``[T, out]``."""
    q, scale = quantize_rows(x)
    return torch._int_mm(q, weight.t()).float().mul_(scale).mul_(scale_row)


def quantize_rows_fused(kernels: ModuleType, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows``' result in one pass over each row (``csrc/w8a8.cpp``): 2-3 us instead
    of ~25 for one 576-wide row."""
    return kernels.quantize_rows((x if x.dtype in _KERNEL_DTYPES else x.float()).contiguous())


def int8_linear_kernel(
    kernels: ModuleType, x: torch.Tensor, weight: torch.Tensor, scale_row: torch.Tensor
) -> torch.Tensor:
    """``int8_linear_torch``'s result from ``csrc/w8a8.cpp``."""
    q, scale = quantize_rows_fused(kernels, x)
    return kernels.w8a8_linear(q, scale, weight, scale_row)


def int8_linear_int_mm(
    kernels: ModuleType, x: torch.Tensor, weight: torch.Tensor, scale_row: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``int8_linear_torch``'s result with the rows quantized by the fused op (CPUs with int8
    dot products: ``_int_mm`` is oneDNN's VNNI/AMX GEMM there), scaled back and rounded to
    ``dtype`` (float32 or bfloat16) in one pass: the same values as the torch path's
    ``.to(dtype)``."""
    q, scale = quantize_rows_fused(kernels, x)
    return kernels.scale_int32(torch._int_mm(q, weight.t()), scale, scale_row, dtype)


def int8_linear_vnni(
    kernels: ModuleType, x: torch.Tensor, weight: VnniWeight, scale_row: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``int8_linear_int_mm``'s result (the same bits) from the packed weight."""
    q, scale = quantize_rows_fused(kernels, x)
    return kernels.w8a8_linear_vnni(
        q, scale, weight.packed, weight.comp, scale_row, weight.out_features, dtype
    )


def kernels_for(x: torch.Tensor) -> ModuleType | None:
    """``csrc/w8a8.cpp`` for ``x``'s rows (a CPU tensor, the kernels built), else None."""
    return w8a8_ops() if x.device.type == "cpu" else None


class W8A8Int8Method(LinearMethod):
    name = "w8a8-int8"

    def create_weights(self, layer: torch.nn.Module) -> None:
        layer.weight = frozen_param(layer.out_features, layer.in_features, dtype=torch.int8)
        layer.weight_scale = frozen_param(layer.out_features, 1, dtype=torch.float32)
        layer.bias = frozen_param(layer.out_features, dtype=layer.dtype) if layer.has_bias else None
        layer.vnni = None

    def layout(self, leaf: str) -> ParamLayout:
        return WEIGHT if leaf == "weight" else PER_OUTPUT

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # One float32 row of scales, multiplied into the product's columns.
        layer.scale_row = layer.weight_scale.detach().reshape(-1).float().contiguous()
        assert layer.weight.is_contiguous(), "the int8 kernel reads the weight's rows in place"

    def pack(self, layer: torch.nn.Module) -> None:
        kernels = w8a8_ops()
        if (layer.vnni is not None or kernels is None or not kernels.has_vnni()
                or layer.weight.shape[1] >= VNNI_MAX_IN):
            return
        layer.vnni = pack_vnni(kernels, layer.weight)
        if not has_amx_int8():
            layer.weight = None  # the packed copy serves every step

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        kernels = kernels_for(x)
        # Rounded to the activations' dtype in the scaling pass when no bias follows.
        out = x.dtype if bias is None and x.dtype in _KERNEL_DTYPES else torch.float32
        if x.is_cuda:
            y = int8_linear_triton(*quantize_rows(x), layer.weight, layer.scale_row)
        elif kernels is None:
            y = int8_linear_torch(x, layer.weight, layer.scale_row)
        elif layer.vnni is not None and (
            layer.weight is None or x.shape[0] <= VNNI_ROWS_BESIDE_AMX
        ):
            y = int8_linear_vnni(kernels, x, layer.vnni, layer.scale_row, out)
        elif has_int8_dot():
            y = int8_linear_int_mm(kernels, x, layer.weight, layer.scale_row, out)
        else:
            y = int8_linear_kernel(kernels, x, layer.weight, layer.scale_row)
        if bias is not None:
            y.add_(bias)
        return y.to(x.dtype)
