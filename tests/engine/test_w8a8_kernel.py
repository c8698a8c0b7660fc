"""The int8 (W8A8) CPU kernel (``csrc/w8a8.cpp``, ``quantization.w8a8_int8``) against exact
references: the per-row quantization bit for bit against the torch path's, the product against
int64 sums scaled as the torch path scales them (so equal bit for bit too), for 1 to 67 rows,
odd sizes, the extreme int8 values, both the AVX2 path and the portable loop; the AVX512-VNNI
product from its packed layout, bit for bit against those same references; and the layer
method's choice between the kernels and ``torch._int_mm`` by the CPU's flags.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.cpu_ops import w8a8_ops
from services.engine.cpu_ops.isa import has_amx_int8, has_int8_dot
from services.engine.quantization import w8a8_int8
from services.engine.quantization.w8a8_int8 import (
    int8_linear_int_mm,
    int8_linear_kernel,
    int8_linear_vnni,
    pack_vnni,
    quantize_rows,
)

kernels = w8a8_ops()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU kernels did not build here")
PATHS = pytest.mark.parametrize("avx2", [True, False], ids=["avx2", "portable"])
VNNI = kernels is not None and kernels.has_vnni()
needs_vnni = pytest.mark.skipif(not VNNI, reason="this CPU has no AVX512-VNNI")


def _x(rows: int, inp: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, inp, generator=gen) * 3).to(dtype)


def _reference(
    q: torch.Tensor, scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """Exact int64 sums, rounded to float32 and scaled in the torch path's order."""
    sums = q.long() @ w.long().t()
    assert sums.abs().max().item() < 2**31
    return sums.to(torch.int32).float().mul_(scale).mul_(w_scale)


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 576), (3, 17), (8, 1536), (67, 100), (5, 7)])
def test_quantize_rows_is_the_torch_paths_bit_for_bit(avx2, dtype, shape) -> None:
    x = _x(*shape, dtype, seed=shape[0])
    x[0, : min(4, shape[1])] = 0  # a few exact zeros
    q, scale = kernels.quantize_rows(x, allow_avx2=avx2)
    q_ref, scale_ref = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.shape == (shape[0], 1)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


@PATHS
def test_a_row_of_zeros_quantizes_to_zeros(avx2) -> None:
    q, scale = kernels.quantize_rows(torch.zeros(2, 40), allow_avx2=avx2)
    assert torch.equal(q, torch.zeros(2, 40, dtype=torch.int8)) and (scale > 0).all()


@PATHS
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 19, 64, 67])
@pytest.mark.parametrize("inp,out", [(576, 24), (33, 7), (1536, 65), (16, 1)])
def test_product_is_the_exact_int_sum_scaled(avx2, rows, inp, out) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + inp + out)
    q = torch.randint(-128, 128, (rows, inp), generator=gen, dtype=torch.int8)
    w = torch.randint(-128, 128, (out, inp), generator=gen, dtype=torch.int8)
    scale = torch.rand(rows, 1, generator=gen) + 1e-3
    w_scale = torch.rand(out, generator=gen) + 1e-3
    y = kernels.w8a8_linear(q, scale, w, w_scale, allow_avx2=avx2)
    assert torch.equal(y, _reference(q, scale, w, w_scale))


@PATHS
def test_extreme_values_sum_without_overflow(avx2) -> None:
    """-128 everywhere: every int16 pair sum is 2 * 2^14 (a saturating instruction would clip
    it), the total 2^14 * 4096 = 2^26."""
    q = torch.full((3, 4096), -128, dtype=torch.int8)
    w = torch.full((5, 4096), -128, dtype=torch.int8)
    y = kernels.w8a8_linear(q, torch.ones(3, 1), w, torch.ones(5), allow_avx2=avx2)
    assert torch.equal(y, torch.full((3, 5), float(2**26)))


def test_no_rows_gives_an_empty_product() -> None:
    y = kernels.w8a8_linear(
        torch.empty(0, 32, dtype=torch.int8),
        torch.empty(0, 1),
        torch.ones(4, 32, dtype=torch.int8),
        torch.ones(4),
    )
    assert y.shape == (0, 4)


def test_mismatched_shapes_are_refused() -> None:
    q = torch.ones(2, 32, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="w must be"):
        kernels.w8a8_linear(q, torch.ones(2, 1), torch.ones(4, 31, dtype=torch.int8), torch.ones(4))
    with pytest.raises(RuntimeError, match="w_scale"):
        kernels.w8a8_linear(q, torch.ones(2, 1), torch.ones(4, 32, dtype=torch.int8), torch.ones(3))
    with pytest.raises(RuntimeError, match="at most 131072"):
        wide = torch.ones(1, (1 << 17) + 1, dtype=torch.int8)
        kernels.w8a8_linear(wide, torch.ones(1, 1), wide, torch.ones(1))
    with pytest.raises(RuntimeError, match="q must be"):
        kernels.w8a8_linear(
            q.t(), torch.ones(32, 1), torch.ones(4, 2, dtype=torch.int8), torch.ones(4)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_layer_product_is_the_int_mm_products(dtype) -> None:
    """The two implementations of the layer's product agree bit for bit (``_int_mm`` takes
    its reference path on this CPU when it lacks VNNI: slow, but exact)."""
    x = _x(9, 96, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    w = torch.randint(-127, 128, (40, 96), generator=gen, dtype=torch.int8)
    scale_row = torch.rand(40, generator=gen)
    expected = w8a8_int8.int8_linear_torch(x, w, scale_row)
    assert torch.equal(int8_linear_kernel(kernels, x, w, scale_row), expected)
    assert torch.equal(int8_linear_int_mm(kernels, x, w, scale_row), expected)
    # Rounded to bfloat16 in the scaling pass: the torch path's result rounded once.
    assert torch.equal(int8_linear_int_mm(kernels, x, w, scale_row, torch.bfloat16),
                       expected.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_scaling_is_the_torch_epilogue_bit_for_bit(dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    acc = torch.randint(-2**31, 2**31 - 1, (7, 37), generator=gen, dtype=torch.int64)
    acc = acc.to(torch.int32)
    acc[0, :3] = torch.tensor([-2**31, 2**31 - 1, 0], dtype=torch.int32)
    scale = torch.rand(7, 1, generator=gen) * 1e-3
    w_scale = torch.rand(37, generator=gen) * 1e-2
    expected = acc.float().mul_(scale).mul_(w_scale).to(dtype)
    assert torch.equal(kernels.scale_int32(acc, scale, w_scale, dtype), expected)
    with pytest.raises(RuntimeError, match="dtype must be float32 or bfloat16"):
        kernels.scale_int32(acc, scale, w_scale, torch.float16)
    with pytest.raises(RuntimeError, match="w_scale must be"):
        kernels.scale_int32(acc, scale, w_scale[:5].contiguous(), dtype)


def test_the_vnni_layout_holds_16_outputs_by_4_inputs_per_vector() -> None:
    """``pack_vnni``'s layout and offsets, against a torch rearrangement (any CPU: packing
    needs no VNNI)."""
    gen = torch.Generator().manual_seed(8)
    w = torch.randint(-128, 128, (21, 10), generator=gen, dtype=torch.int8)
    packed = pack_vnni(kernels, w)
    padded = torch.zeros(32, 12, dtype=torch.int8)
    padded[:21, :10] = w
    expected = padded.reshape(2, 16, 3, 4).permute(0, 2, 1, 3)
    assert packed.packed.shape == (2, 3, 16, 4) and torch.equal(packed.packed, expected)
    assert torch.equal(packed.comp, 128 * w.int().sum(dim=1)) and packed.out_features == 21


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "rows,inp,out",
    [(1, 576, 1536), (2, 7, 5), (3, 17, 33), (4, 64, 16), (5, 130, 100), (19, 96, 64),
     (67, 40, 70), (130, 36, 150)],
)
def test_vnni_product_is_the_exact_reference_bit_for_bit(dtype, rows, inp, out) -> None:
    """Rows across the 4-row tiles and 64-row blocks, inputs not a multiple of 4, outputs not
    of 16 or 64; rounded to the output dtype as ``scale_int32`` rounds."""
    gen = torch.Generator().manual_seed(rows * 1000 + inp)
    q = torch.randint(-128, 128, (rows, inp), generator=gen, dtype=torch.int8)
    w = torch.randint(-128, 128, (out, inp), generator=gen, dtype=torch.int8)
    scale = torch.rand(rows, 1, generator=gen) * 1e-2
    w_scale = torch.rand(out, generator=gen) * 1e-2
    packed = pack_vnni(kernels, w)
    y = kernels.w8a8_linear_vnni(q, scale, packed.packed, packed.comp, w_scale, out, dtype)
    assert torch.equal(y, _reference(q, scale, w, w_scale).to(dtype))


@needs_vnni
def test_vnni_sums_hold_the_extreme_values_without_overflow() -> None:
    """Every product at its largest magnitude (-128 * -128, and with the +128 offset 0 * -128),
    4,096 inputs wide."""
    inp = 4096
    q = torch.full((3, inp), -128, dtype=torch.int8)
    q[1] = 127
    w = torch.full((17, inp), -128, dtype=torch.int8)
    w[3] = 127
    packed = pack_vnni(kernels, w)
    ones = torch.ones(3, 1), torch.ones(17)
    y = kernels.w8a8_linear_vnni(q, ones[0], packed.packed, packed.comp, ones[1], 17,
                                 torch.float32)
    assert torch.equal(y, _reference(q, *ones[:1], w, ones[1]))


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vnni_layer_product_is_the_int_mm_products(dtype) -> None:
    x = _x(9, 96, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    w = torch.randint(-127, 128, (40, 96), generator=gen, dtype=torch.int8)
    scale_row = torch.rand(40, generator=gen)
    packed = pack_vnni(kernels, w)
    assert torch.equal(int8_linear_vnni(kernels, x, packed, scale_row),
                       int8_linear_int_mm(kernels, x, w, scale_row))
    assert torch.equal(int8_linear_vnni(kernels, x, packed, scale_row, torch.bfloat16),
                       int8_linear_int_mm(kernels, x, w, scale_row, torch.bfloat16))


def test_vnni_product_refuses_a_layout_not_its_own() -> None:
    if not VNNI:
        with pytest.raises(RuntimeError, match="no AVX512-VNNI"):
            kernels.w8a8_linear_vnni(torch.ones(1, 8, dtype=torch.int8), torch.ones(1, 1),
                                     torch.zeros(1, 2, 16, 4, dtype=torch.int8),
                                     torch.zeros(16, dtype=torch.int32), torch.ones(16), 16,
                                     torch.float32)
        return
    packed = pack_vnni(kernels, torch.ones(16, 8, dtype=torch.int8))
    q = torch.ones(1, 12, dtype=torch.int8)  # not the packed weight's inputs
    with pytest.raises(RuntimeError, match="packed must be"):
        kernels.w8a8_linear_vnni(q, torch.ones(1, 1), packed.packed, packed.comp,
                                 torch.ones(16), 16, torch.float32)
    with pytest.raises(RuntimeError, match="dtype must be"):
        kernels.w8a8_linear_vnni(q[:, :8].contiguous(), torch.ones(1, 1), packed.packed,
                                 packed.comp, torch.ones(16), 16, torch.float16)


class _Layer(torch.nn.Module):
    pass


def _spy(monkeypatch) -> list[str]:
    called: list[str] = []
    for name in ("int8_linear_int_mm", "int8_linear_kernel", "int8_linear_vnni"):
        real = getattr(w8a8_int8, name)
        monkeypatch.setattr(
            w8a8_int8, name, lambda *a, _real=real, _name=name: called.append(_name) or _real(*a)
        )
    return called


def _layer() -> _Layer:
    layer = _Layer()
    method = w8a8_int8.W8A8Int8Method()
    layer.weight = torch.ones(4, 8, dtype=torch.int8)
    layer.scale_row = torch.ones(4)
    layer.vnni = None
    method.pack(layer)
    return layer


def test_each_cpu_takes_its_product(monkeypatch) -> None:
    """VNNI CPUs: the packed product, the unpacked weight dropped (AMX keeps it for
    ``_int_mm`` past 32 rows); other CPUs with int8 dot products ``_int_mm``; the rest the
    AVX2 kernel."""
    called = _spy(monkeypatch)
    layer = _layer()
    method = w8a8_int8.W8A8Int8Method()
    y = method.apply(layer, torch.ones(2, 8), None)
    assert torch.equal(y, torch.full((2, 4), 8.0))
    if VNNI:
        assert called == ["int8_linear_vnni"]
        assert (layer.weight is None) == (not has_amx_int8())
    else:
        assert layer.vnni is None
        assert called == ["int8_linear_int_mm" if has_int8_dot() else "int8_linear_kernel"]


def test_a_layer_too_wide_for_exact_vnni_sums_keeps_int_mm(monkeypatch) -> None:
    monkeypatch.setattr(w8a8_int8, "VNNI_MAX_IN", 8)
    layer = _layer()  # 8 inputs
    assert layer.vnni is None and layer.weight is not None
    with pytest.raises(RuntimeError, match="in must be below 2"):
        kernels.pack_vnni(torch.zeros(1, 1 << 16, dtype=torch.int8))


@needs_vnni
def test_cpus_with_amx_send_long_steps_to_int_mm(monkeypatch) -> None:
    monkeypatch.setattr(w8a8_int8, "has_amx_int8", lambda: True)
    layer = _layer()
    assert layer.weight is not None and layer.vnni is not None
    called = _spy(monkeypatch)
    method = w8a8_int8.W8A8Int8Method()
    for rows in (1, w8a8_int8.VNNI_ROWS_BESIDE_AMX, w8a8_int8.VNNI_ROWS_BESIDE_AMX + 1):
        assert torch.equal(method.apply(layer, torch.ones(rows, 8), None),
                           torch.full((rows, 4), 8.0))
    assert called == ["int8_linear_vnni", "int8_linear_vnni", "int8_linear_int_mm"]


def test_int8_dot_products_by_the_cpu_flags() -> None:
    assert has_int8_dot(frozenset({"avx2", "avx512_vnni"}))
    assert has_int8_dot(frozenset({"amx_int8", "amx_tile"}))
    assert not has_int8_dot(frozenset({"avx2", "fma", "avx512f"}))
    assert has_amx_int8(frozenset({"amx_int8", "amx_tile", "avx512_vnni"}))
    assert not has_amx_int8(frozenset({"avx512_vnni", "amx_bf16", "amx_tile"}))
