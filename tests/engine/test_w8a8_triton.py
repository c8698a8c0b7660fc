"""The W8A8 Triton kernel (``quantization.w8a8_triton``) against ``int8_linear_torch``, bit for
bit: under ``TRITON_INTERPRET=1`` on the CPU (``make test``), compiled where CUDA runs."""

from __future__ import annotations

import pytest
import torch

from services.engine.quantization import w8a8_triton
from services.engine.quantization.w8a8_int8 import int8_linear_torch, quantize_rows
from tests.support.triton_child import kernel_device, run_under_interpreter

_CHILD_ENV = "PAGODA_TRITON_W8A8_INTERPRETER_CHILD"
INTERPRETED, DEVICE = kernel_device((w8a8_triton._w8a8_kernel,), _CHILD_ENV)
needs_kernels = pytest.mark.skipif(
    DEVICE is None, reason="kernels compiled here and no GPU: the interpreter child runs them")
# (rows, inputs, outputs): decode rows (under cuBLAS's 17-row floor for _int_mm), a prefill past
# one tile of rows, ragged outputs and inputs.
SHAPES = [(1, 64, 64), (7, 96, 136), (40, 200, 72), (70, 64, 64)]


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA: the kernel tests ran compiled")
def test_w8a8_kernel_under_the_interpreter() -> None:
    run_under_interpreter(__file__, _CHILD_ENV, "test_w8a8_kernel_under_the_interpreter")


@needs_kernels
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in SHAPES])
def test_the_kernel_equals_the_torch_path_bit_for_bit(shape) -> None:
    rows, inp, out = shape
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inp, generator=g) * 3
    x[0, :5] = 0.0
    weight = torch.randint(-128, 128, (out, inp), generator=g, dtype=torch.int8)
    weight[0] = -128  # the extreme products
    scale_row = torch.rand(out, generator=g) * 0.01 + 1e-4
    want = int8_linear_torch(x, weight, scale_row)
    q, scale = quantize_rows(x)
    got = w8a8_triton.int8_linear_triton(q.to(DEVICE), scale.to(DEVICE), weight.to(DEVICE),
                                         scale_row.to(DEVICE)).cpu()
    assert torch.equal(got, want)


def test_a_gpu_serves_w8a8_unless_turned_off(monkeypatch) -> None:
    from services.engine.quantization.compressed_tensors import CompressedTensorsConfig

    raw = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True,
                    "dynamic": False},
        "input_activations": {"type": "int", "num_bits": 8, "strategy": "token",
                              "symmetric": True, "dynamic": True}}}}
    monkeypatch.setenv(w8a8_triton.TRITON_ENV, "0")
    with pytest.raises(ValueError, match="PAGODA_W8A8_TRITON=0"):
        CompressedTensorsConfig.from_hf(raw, torch.device("cuda"))
    monkeypatch.delenv(w8a8_triton.TRITON_ENV)
    if w8a8_triton.triton is not None:
        assert CompressedTensorsConfig.from_hf(raw, torch.device("cuda")) is not None
