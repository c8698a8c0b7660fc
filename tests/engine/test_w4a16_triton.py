"""The 4-bit Triton kernel (``quantization.w4a16_triton``) against the dequantized weight's
product: under ``TRITON_INTERPRET=1`` on the CPU (``make test``), compiled where CUDA runs."""

from __future__ import annotations

import pytest
import torch

from services.engine.quantization import w4a16_triton as w4
from services.engine.quantization.int4 import dequantize
from tests.support.triton_child import kernel_device, run_under_interpreter

_CHILD_ENV = "PAGODA_TRITON_W4A16_INTERPRETER_CHILD"
INTERPRETED, DEVICE = kernel_device((w4._w4a16_kernel,), _CHILD_ENV)
needs_kernels = pytest.mark.skipif(
    DEVICE is None, reason="kernels compiled here and no GPU: the interpreter child runs them")
# (rows, inputs, outputs, group size or -1 for per channel, act-order): a decode row, a few
# rows, a prefill past one tile of rows, outputs past one tile of columns with a ragged end.
SHAPES = [
    (1, 64, 64, 32, False),
    (5, 128, 96, 64, False),
    (37, 96, 136, 32, True),
    (70, 64, 64, -1, False),
    (3, 256, 72, 128, True),
]


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA: the kernel tests ran compiled")
def test_w4a16_kernel_under_the_interpreter() -> None:
    run_under_interpreter(__file__, _CHILD_ENV, "test_w4a16_kernel_under_the_interpreter")


def _weight(inp: int, out: int, group: int, act_order: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    size = inp if group == -1 else group
    n_groups = inp // size
    q = torch.randint(0, 16, (inp, out), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (n_groups, out), generator=g, dtype=torch.int32)
    scales = torch.rand(n_groups, out, generator=g) * 0.02 + 0.001
    groups = torch.arange(inp) // size
    if act_order:  # GPTQ's desc_act: each input column keeps the group it was quantized in
        groups = groups[torch.randperm(inp, generator=g)]
    return q, zeros, scales, groups


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{k}x{n}-g{g}{'-act' if a else ''}"
                                                for m, k, n, g, a in SHAPES])
def test_the_kernel_equals_the_dequantized_product(shape, dtype) -> None:
    rows, inp, out, group, act_order = shape
    q, zeros, scales, groups = _weight(inp, out, group, act_order, seed=rows)
    weight = w4.triton_weight(q, zeros, scales, groups)
    assert weight is not None and (weight.perm is not None) == act_order
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(1)).to(dtype)
    dense = dequantize(q, zeros, scales, groups)  # [out, in], float32: the format's own math
    want = x.double() @ dense.double().t()
    ref = w4.w4a16_linear_torch(x, weight)
    weight = w4.TritonWeight(*(t.to(DEVICE) if isinstance(t, torch.Tensor) else t
                               for t in (weight.qw, weight.scale, weight.zs, weight.group,
                                         weight.perm)))
    got = w4.w4a16_linear(x.to(DEVICE), weight).cpu()
    assert got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() < tol * scale
    assert (ref.double() - want).abs().max().item() < tol * scale


def test_a_layout_the_kernel_cannot_take_is_left_to_the_dense_path() -> None:
    q, zeros, scales, groups = _weight(64, 64, 32, False, seed=0)
    assert w4.triton_weight(q[:60], zeros, scales, groups[:60]) is None  # not whole words
    uneven = groups.clone()
    uneven[:40] = 0  # groups of 40 and 24 inputs
    assert w4.triton_weight(q, zeros, scales, uneven) is None


def test_the_kernel_is_on_by_default_on_a_gpu_only(monkeypatch) -> None:
    monkeypatch.setenv(w4.TRITON_ENV, "0")
    assert not w4.wanted(torch.device("cuda")) and not w4.wanted(torch.device("cpu"))
    monkeypatch.delenv(w4.TRITON_ENV)
    assert not w4.wanted(torch.device("cpu"))  # the CPU has its own kernel
    assert w4.wanted(torch.device("cuda")) == (w4.triton is not None)
