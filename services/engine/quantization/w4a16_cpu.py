"""4-bit weights (GPTQ, AWQ) run on the CPU from their nibbles: ``csrc/w4a16.cpp``.

At load the unpacked values are laid out as the kernel reads them (``KernelWeight``): two
nibbles a byte along each output's inputs, scales and zero points per output and group. An
act-order checkpoint's groups are scattered over the inputs (``g_idx``); sorting the inputs by
group makes each group one run of columns, and every step then gathers the activations' columns
in that order (a copy of ``[T, in]``, small beside the weight). The product accumulates in
float32; the result is rounded to the activations' dtype once.

Decode steps read a quarter of bfloat16's weight bytes. bfloat16 activations on a CPU with
AVX-512-BF16 take the kernel's ``vdpbf16ps`` path (``KernelWeight.bf16``: groups of a multiple of
32 inputs), the same float32 sums from the bfloat16 values as they are; float32 ones, or other
CPUs, the AVX2 path. The kernel takes rows one at a time; past
``DENSE_ROWS`` rows (a prefill) the weight is dequantized into a float32 matrix for that call and
multiplied by torch (oneDNN), whose blocked GEMM reuses each weight over many rows.

Measured on a 2-core AMD EPYC with AVX2 only, one thread, best of 20, while the machine ran
about seven times as many jobs as it has cores (so only calls that fit a time slice show their
own cost): one row through 2048 -> 8192, the kernel 2.6 ms against bfloat16 ``F.linear`` 20.6 ms
and oneDNN's packed bfloat16 41 ms (this CPU has no bfloat16 instructions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.cpu_ops import w4a16_ops
from services.engine.quantization.base import LinearMethod

CHUNK = 16  # inputs per 8-byte run of the kernel's layout
BF16_STEP = 32  # inputs per vdpbf16ps step of the AVX-512-BF16 path (two runs)
DENSE_ROWS = 64


@dataclass(frozen=True, slots=True)
class KernelWeight:
    q: torch.Tensor  # uint8 [out, in / 2]: see pack_nibbles
    scale: torch.Tensor  # float32 [out, groups]
    zs: torch.Tensor  # float32 [out, groups]: zero point times scale
    perm: torch.Tensor | None  # int64 [in]: the input column each kernel column reads
    bf16: bool = False  # bfloat16 activations may take the AVX-512-BF16 path (see the module)

    def dense(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` in the kernel's column order."""
        out, half = self.q.shape
        groups = self.scale.shape[1]
        v = self.q.view(out, half // 8, 1, 8).long()
        nibbles = torch.cat([v & 0xF, v >> 4], dim=2).reshape(out, groups, -1).float()
        w = nibbles * self.scale.unsqueeze(-1) - self.zs.unsqueeze(-1)
        return w.reshape(out, -1)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``q`` ``[out, in]`` (values 0..15) -> uint8 ``[out, in / 2]``: per run of 16 inputs, byte
    j holds input j in its low nibble and input j + 8 in its high one."""
    out, inp = q.shape
    runs = q.to(torch.uint8).view(out, inp // CHUNK, 2, 8)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(out, inp // 2).contiguous()


def kernel_weight(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                  groups: torch.Tensor) -> KernelWeight | None:
    """From the unpacked ``q`` ``[in, out]``, ``zeros``/``scales`` ``[G, out]`` and each input's
    group ``groups`` ``[in]``; None when the kernel cannot hold the layer (its inputs or groups
    not a multiple of 16 columns, its outputs not of 8, groups of unequal sizes)."""
    inp, out = q.shape
    n_groups = scales.shape[0]
    if inp % n_groups or (inp // n_groups) % CHUNK or out % 8:
        return None
    order = torch.argsort(groups, stable=True)
    if not torch.equal(groups[order], torch.arange(inp, device=groups.device) // (inp // n_groups)):
        return None
    identity = torch.equal(order, torch.arange(inp, device=order.device))
    q_sorted = q if identity else q.index_select(0, order)
    scale = scales.float().t().contiguous()
    return KernelWeight(q=pack_nibbles(q_sorted.t()),
                        scale=scale,
                        zs=(zeros.float().t() * scale).contiguous(),
                        perm=None if identity else order,
                        bf16=(inp // n_groups) % BF16_STEP == 0 and _bf16_dot())


def _bf16_dot() -> bool:
    """The kernels are built and this CPU has AVX-512-BF16."""
    ops = w4a16_ops()
    return ops is not None and ops.bf16_available()


class W4A16CpuMethod(LinearMethod):
    """A GPTQ or AWQ layer once loaded on the CPU: ``layer.w4`` is its ``KernelWeight``."""

    name = "w4a16-cpu"

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        w: KernelWeight = layer.w4
        if w.perm is not None:
            x = x.index_select(-1, w.perm)
        if x.shape[0] > DENSE_ROWS:
            y = x.float() @ w.dense().t()
        elif w.bf16 and x.dtype is torch.bfloat16:
            y = w4a16_ops().w4a16_linear_bf16(x.contiguous(), w.q, w.scale, w.zs)
        else:
            y = w4a16_ops().w4a16_linear(x.float().contiguous(), w.q, w.scale, w.zs)
        if bias is not None:
            y.add_(bias)
        return y.to(x.dtype)


W4A16_CPU = W4A16CpuMethod()


def cpu_weight(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
               groups: torch.Tensor) -> KernelWeight | None:
    """The kernel's layout when it runs here (a CPU layer, the kernels built, a layout it
    takes), else None."""
    if q.device.type != "cpu" or w4a16_ops() is None:
        return None
    return kernel_weight(q, zeros, scales, groups)
