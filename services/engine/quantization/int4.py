"""4-bit weights packed eight to an int32 (GPTQ, AWQ): unpacking and dequantizing, once at load.

Both formats keep, per group of ``group_size`` input columns, a scale and a zero point per
output: ``W[o, i] = (q[i, o] - zero[g(i), o]) * scale[g(i), o]``. They differ in how nibbles are
packed (``unpack``'s ``order``) and where (GPTQ packs ``qweight`` along the input, AWQ along the
output). ``hold`` then gives the layer its weight: on the CPU, in the layout of the kernel that
reads the nibbles in its loop (``w4a16_cpu``: a quarter of bfloat16's bytes per decode step);
on a GPU (unless ``PAGODA_W4A16_TRITON=0``), in the Triton kernel's (``w4a16_triton``); elsewhere
(or where neither kernel takes the layer) dequantized once into the model's dtype, run by the
unquantized method.
"""

from __future__ import annotations

import torch

from services.engine.quantization.w4a16_cpu import W4A16_CPU, cpu_weight
from services.engine.quantization.w4a16_triton import W4A16_TRITON, gpu_weight

SEQUENTIAL = (0, 1, 2, 3, 4, 5, 6, 7)  # nibble k holds element k (GPTQ)


def unpack(packed: torch.Tensor, dim: int, order: tuple[int, ...] = SEQUENTIAL) -> torch.Tensor:
    """int32 ``packed`` -> its 4-bit values (int32, 0..15), eight per element along ``dim``:
    element ``8 * j + order[k]`` is nibble ``k`` (bits ``4k .. 4k + 3``) of ``packed[j]``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]: nibble k last
    position = torch.tensor(order, device=packed.device).argsort()  # element r is nibble pos[r]
    nibbles = nibbles.index_select(-1, position)
    nibbles = nibbles.movedim(-1, dim + 1)
    shape = list(packed.shape)
    shape[dim] *= 8
    return nibbles.reshape(shape)


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
               groups: torch.Tensor) -> torch.Tensor:
    """``q`` ``[in, out]``, ``zeros``/``scales`` ``[groups, out]``, ``groups`` ``[in]`` (each input
    column's group) -> the float32 weight ``[out, in]``."""
    z = zeros.index_select(0, groups).float()
    s = scales.index_select(0, groups).float()
    return ((q.float() - z) * s).t().contiguous()


def hold(layer: torch.nn.Module, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
         groups: torch.Tensor, packed: tuple[str, ...]) -> None:
    """The layer's weight from its unpacked values (see ``dequantize`` for the shapes). A
    row-parallel rank's inputs use some of the groups only: the others are dropped first."""
    used, groups = torch.unique(groups, return_inverse=True)
    if len(used) != len(scales):
        zeros, scales = zeros.index_select(0, used), scales.index_select(0, used)
    for layout, method in ((gpu_weight, W4A16_TRITON), (cpu_weight, W4A16_CPU)):
        weight = layout(q, zeros, scales, groups)
        if weight is not None:  # the kernel's method reads ``layer.w4``
            for name in packed:
                delattr(layer, name)
            layer.w4 = weight
            layer.method = method
            return
    replace_with_dense(layer, dequantize(q, zeros, scales, groups), packed)


def replace_with_dense(
    layer: torch.nn.Module, weight: torch.Tensor, packed: tuple[str, ...]
) -> None:
    """Drops the packed parameters and holds ``weight`` in the model's dtype; the layer's class
    default (the unquantized method) runs it from here on."""
    for name in packed:
        delattr(layer, name)
    layer.weight = torch.nn.Parameter(weight.to(layer.dtype), requires_grad=False)
    del layer.method
