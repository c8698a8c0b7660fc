"""The 4-bit (W4A16) CPU kernel (``csrc/w4a16.cpp``, ``quantization.w4a16_cpu``) against the
torch reference: the weight dequantized by ``quantization.int4.dequantize``, then multiplied in
float32. Both the AVX2 path and the portable loop, for 1 to 19 rows, group sizes 16/128 and per
channel, act-order's scattered groups; the AVX-512-BF16 path for bfloat16 rows where the CPU has
it;
and the layer method's dense path past ``DENSE_ROWS`` rows.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.cpu_ops import w4a16_ops
from services.engine.quantization.int4 import dequantize
from services.engine.quantization.w4a16_cpu import (
    DENSE_ROWS,
    W4A16_CPU,
    kernel_weight,
    pack_nibbles,
)

kernels = w4a16_ops()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU kernels did not build here")


def _layer(inp: int, out: int, group: int, act_order: bool, seed: int = 0):
    """Random 4-bit values, zero points and scales; (q [in, out], zeros, scales, groups)."""
    gen = torch.Generator().manual_seed(seed)
    g = inp if group == -1 else group
    q = torch.randint(0, 16, (inp, out), generator=gen)
    zeros = torch.randint(1, 16, (inp // g, out), generator=gen)
    scales = (torch.rand(inp // g, out, generator=gen) * 0.02 + 0.001).half().float()
    groups = torch.arange(inp) // g
    if act_order:
        groups = groups[torch.randperm(inp, generator=gen)]
    return q, zeros, scales, groups


def _reference(x: torch.Tensor, q, zeros, scales, groups) -> torch.Tensor:
    return x.double() @ dequantize(q, zeros, scales, groups).double().t()


def _close(y: torch.Tensor, expected: torch.Tensor) -> None:
    # float32 sums in another order than the float64 reference: a few ulps of the row's scale.
    tol = 2e-6 * expected.abs().max().item() * 16
    assert (y.double() - expected).abs().max().item() <= tol


def test_packing_puts_input_j_and_j_plus_8_in_one_byte() -> None:
    q = torch.arange(32).remainder(16).reshape(1, 32)
    packed = pack_nibbles(q)
    assert packed[0, :8].tolist() == [j | (j + 8) << 4 for j in range(8)]
    assert packed.shape == (1, 16) and packed.dtype == torch.uint8


@pytest.mark.parametrize("avx2", [True, False], ids=["avx2", "portable"])
@pytest.mark.parametrize("rows", [1, 2, 19])
@pytest.mark.parametrize("group", [16, 128, -1], ids=["g16", "g128", "per-channel"])
def test_kernel_matches_the_dequantized_product(avx2: bool, rows: int, group: int) -> None:
    q, zeros, scales, groups = _layer(256, 48, group, act_order=False)
    w = kernel_weight(q, zeros, scales, groups)
    assert w is not None and w.perm is None
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    y = kernels.w4a16_linear(x, w.q, w.scale, w.zs, allow_avx2=avx2)
    _close(y, _reference(x, q, zeros, scales, groups))


class _Layer(torch.nn.Module):
    pass


@pytest.mark.parametrize("rows", [1, 6, DENSE_ROWS + 1], ids=["decode", "few", "dense"])
def test_act_order_layer_gathers_its_inputs_by_group(rows: int) -> None:
    q, zeros, scales, groups = _layer(128, 16, 32, act_order=True, seed=1)
    layer = _Layer()
    layer.w4 = kernel_weight(q, zeros, scales, groups)
    assert layer.w4.perm is not None
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(16)
    y = W4A16_CPU.apply(layer, x, bias)
    _close(y - bias, _reference(x, q, zeros, scales, groups))


def test_bf16_activations_come_back_in_bf16() -> None:
    q, zeros, scales, groups = _layer(64, 8, 32, act_order=False)
    layer = _Layer()
    layer.w4 = kernel_weight(q, zeros, scales, groups)
    x = torch.randn(3, 64).bfloat16()
    y = W4A16_CPU.apply(layer, x, None)
    assert y.dtype == torch.bfloat16
    expected = _reference(x.float(), q, zeros, scales, groups)
    assert (y.double() - expected).abs().max().item() <= 2**-7 * expected.abs().max().item()


bf16_dot = pytest.mark.skipif(kernels is None or not kernels.bf16_available(),
                              reason="this CPU has no AVX-512-BF16 (the AVX2 path serves it)")


@bf16_dot
@pytest.mark.parametrize("rows", [1, 3, 19])
@pytest.mark.parametrize("group", [32, 128, -1], ids=["g32", "g128", "per-channel"])
def test_bf16_path_matches_the_dequantized_product(rows: int, group: int) -> None:
    """The bfloat16 inputs as they are, float32 sums: the float32 path's tolerance."""
    q, zeros, scales, groups = _layer(256, 48, group, act_order=False, seed=rows)
    w = kernel_weight(q, zeros, scales, groups)
    assert w is not None and w.bf16
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
    y = kernels.w4a16_linear_bf16(x, w.q, w.scale, w.zs)
    assert y.dtype == torch.float32
    _close(y, _reference(x.float(), q, zeros, scales, groups))


@bf16_dot
def test_the_layer_takes_the_bf16_path_for_bf16_rows_only(monkeypatch) -> None:
    q, zeros, scales, groups = _layer(128, 16, 32, act_order=True, seed=4)
    layer = _Layer()
    layer.w4 = kernel_weight(q, zeros, scales, groups)
    calls = []
    real = kernels.w4a16_linear_bf16
    monkeypatch.setattr(kernels, "w4a16_linear_bf16",
                        lambda *a: calls.append(a[0].dtype) or real(*a), raising=True)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    y = W4A16_CPU.apply(layer, x, None)
    assert calls == [torch.bfloat16] and y.dtype == torch.bfloat16
    W4A16_CPU.apply(layer, x.float(), None)  # float32 rows: the AVX2 path
    assert len(calls) == 1
    expected = _reference(x.float(), q, zeros, scales, groups)
    assert (y.double() - expected).abs().max().item() <= 2**-7 * expected.abs().max().item()


def test_groups_of_16_stay_on_the_avx2_path() -> None:
    q, zeros, scales, groups = _layer(64, 8, 16, act_order=False)
    assert not kernel_weight(q, zeros, scales, groups).bf16


def test_shapes_the_kernel_cannot_take_are_left_to_the_dense_path() -> None:
    q, zeros, scales, groups = _layer(96, 16, 24, act_order=False)  # groups of 24 columns
    assert kernel_weight(q, zeros, scales, groups) is None
    q, zeros, scales, groups = _layer(64, 12, 32, act_order=False)  # 12 outputs
    assert kernel_weight(q, zeros, scales, groups) is None
