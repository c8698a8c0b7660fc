"""The fused Triton kernels of the GPU path (SiLU-and-mul, in-place RoPE) against torch.

Run like ``test_triton_kernels.py``: compiled on a CUDA device when there is one, else on the
CPU under Triton's interpreter. The interpreter is chosen when a kernel module is first
imported, so when this process imported them compiled and has no GPU,
``test_fused_kernels_under_the_interpreter`` re-runs this file in a child pytest with
``TRITON_INTERPRET=1`` set from the start (``make test`` sets it for the whole run already).

What "matches" means: the kernels round where the torch path rounds (each product, then the
sum for RoPE; silu, then the product for SiLU-and-mul), so RoPE must equal the torch path bit
for bit, and SiLU-and-mul may differ only by the float32 ``exp``'s last-place differences
(an ulp, rarely). The interpreter rounds float32 -> bfloat16 by truncation where a GPU rounds to
nearest even, so under it the bf16 references round by truncation at the same points; on a GPU
they are torch's own ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from services.engine.kernels import activation, rotary
from services.engine.models.layers import RopeStep, apply_rotary
from tests.support.triton_child import kernel_device, run_under_interpreter

_CHILD_ENV = "PAGODA_TRITON_FUSED_INTERPRETER_CHILD"
INTERPRETED, DEVICE = kernel_device(
    (activation._silu_and_mul_kernel, rotary._rotary_kernel), _CHILD_ENV
)

needs_kernels = pytest.mark.skipif(
    DEVICE is None,
    reason="kernels are compiled in this process and there is no GPU; "
    "test_fused_kernels_under_the_interpreter runs them in a child process",
)
DTYPES = [torch.float32, torch.bfloat16]


# ---------------------------------------------------------------------- the child run


@pytest.mark.skipif(
    INTERPRETED or torch.cuda.is_available(),
    reason="the kernels run in this process (interpreted, or compiled on the GPU)",
)
def test_fused_kernels_under_the_interpreter() -> None:
    # The CUDA-only dispatch test would only skip there.
    run_under_interpreter(
        __file__, _CHILD_ENV, "test_fused_kernels_under_the_interpreter or on_cuda"
    )


# ---------------------------------------------------------------------- references


def round_to(x: torch.Tensor, dtype: torch.dtype, truncate: bool = INTERPRETED) -> torch.Tensor:
    """float32 ``x`` rounded to ``dtype``: by truncation for bf16 where the interpreter runs the
    kernels (that is how it rounds), else to nearest even as torch and a GPU do."""
    if truncate and dtype == torch.bfloat16:
        # Drop the low 16 bits; the cast below is then exact.
        x = (x.float().view(torch.int32) & -65536).view(torch.float32)
    return x.to(dtype)


def emulated_silu_and_mul(gate_up: torch.Tensor, truncate: bool) -> torch.Tensor:
    g, u = gate_up.float().chunk(2, dim=-1)
    silu = round_to(F.silu(g), gate_up.dtype, truncate)
    return round_to(silu.float() * u, gate_up.dtype, truncate)


def emulated_rope(
    x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, truncate: bool
) -> torch.Tensor:
    cs = table.index_select(0, positions.long()).float()
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1).float()
    a = round_to(x.float() * cs[:, 0:1], x.dtype, truncate)
    b = round_to(rolled * cs[:, 1:2], x.dtype, truncate)
    return round_to(a.float() + b.float(), x.dtype, truncate)


def torch_rope(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``layers.apply_rotary``'s torch path on a copy of ``x``."""
    cs = table.index_select(0, positions)
    return apply_rotary(x.clone(), RopeStep(positions, table, cs[:, 0:1], cs[:, 1:2]))


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(g) * u`` in ``gate_up``'s dtype: torch's own ops on a GPU, their rounding
    emulated under the interpreter."""
    if INTERPRETED:
        return emulated_silu_and_mul(gate_up, truncate=True)
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :half]) * gate_up[..., half:]


def rope_reference(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The torch path of ``apply_rotary`` on a GPU, its rounding emulated under the interpreter."""
    if INTERPRETED:
        return emulated_rope(x, table, positions, truncate=True)
    return torch_rope(x, table, positions)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units of the last place of ``b``'s dtype, relative to magnitude."""
    eps = torch.finfo(b.dtype).eps
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-30)
    return int(((a.float() - b.float()).abs() / (scale * eps)).max().round())


# ---------------------------------------------------------------------- SiLU-and-mul


@needs_kernels
@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype: torch.dtype, num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    inter = 1100  # two column tiles, the second masked
    # Rows of a wider tensor: a row stride that is not 2I. Scaled: exp's tails too.
    wide = (torch.randn(num_tokens, 2 * inter + 8, generator=gen) * 6).to(dtype).to(DEVICE)
    gate_up = wide[:, : 2 * inter]
    out = activation.silu_and_mul(gate_up)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype and out.is_contiguous()
    # float32: exp differs in the last place between implementations; bf16 rarely by an ulp.
    assert ulps_apart(out, silu_and_mul_reference(gate_up)) <= (4 if dtype == torch.float32 else 1)


@needs_kernels
def test_silu_and_mul_keeps_leading_dims() -> None:
    gate_up = torch.randn(2, 3, 2 * 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = activation.silu_and_mul(gate_up)
    assert out.shape == (2, 3, 64)
    assert ulps_apart(out, silu_and_mul_reference(gate_up)) <= 4


# ---------------------------------------------------------------------- RoPE


@needs_kernels
@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("heads", [(32, 8), (14, 2)], ids=["32+8", "14+2"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_a_fused_qkv_view_equals_the_torch_path(
    dtype: torch.dtype, head_dim: int, heads: tuple[int, int], num_tokens: int
) -> None:
    num_q, num_kv = heads
    gen = torch.Generator().manual_seed(head_dim + num_q + num_tokens)
    max_positions = 300
    table = torch.randn(max_positions, 2, head_dim, generator=gen).to(dtype).to(DEVICE)
    # Both position dtypes the runner may hand over, alternating over the cases.
    pos_dtype = torch.int32 if (num_tokens + num_q) % 2 else torch.int64
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen, dtype=pos_dtype)
    positions[-1] = max_positions - 1  # the table's last row
    positions = positions.to(DEVICE)
    # The model's layout: one [T, (q + 2 kv) * d] projection; q and k heads roped as one view.
    qk_size = (num_q + num_kv) * head_dim
    qkv = torch.randn(num_tokens, qk_size + num_kv * head_dim, generator=gen)
    qkv = qkv.to(dtype).to(DEVICE)
    qk = qkv[:, :qk_size].view(num_tokens, num_q + num_kv, head_dim)
    expected = rope_reference(qk, table, positions)
    v_before = qkv[:, qk_size:].clone()

    returned = rotary.apply_rotary_(qk, table, positions)

    assert returned is qk  # in place, handed back
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, qk_size:], v_before)  # v, the rest of each row, untouched


@needs_kernels
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_rotary_reads_strided_heads(pos_dtype: torch.dtype) -> None:
    """Heads not adjacent in memory (every other head of a wider tensor) and a head count that
    is not a multiple of the head tile."""
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(5, 2 * 5, 64, generator=gen).to(DEVICE)
    x = base[:, ::2]  # [5, 5, 64], head stride 128
    table = torch.randn(16, 2, 64, generator=gen).to(DEVICE)
    positions = torch.tensor([0, 3, 15, 3, 7], dtype=pos_dtype, device=DEVICE)
    odd_heads = base[:, 1::2].clone()
    expected = rope_reference(x, table, positions)
    rotary.apply_rotary_(x, table, positions)
    assert torch.equal(x, expected)
    assert torch.equal(base[:, 1::2], odd_heads)


# ---------------------------------------------------------------------- the model's dispatch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the dispatch picks Triton on CUDA")
def test_layers_use_the_triton_kernels_on_cuda() -> None:
    from services.engine.models.config import RopeConfig
    from services.engine.models.layer_kernels import select_kernels
    from services.engine.models.layers import RotaryEmbedding

    kernels = select_kernels("cuda", torch.bfloat16)
    rope = RotaryEmbedding(64, 128, RopeConfig(), torch.bfloat16).cuda()
    rope.reset_cache()
    rope.use_kernels(kernels)
    positions = torch.tensor([0, 5, 127], device="cuda")
    step = rope(positions)
    assert step.cos is None  # no gather: the kernel reads the table in place
    x = torch.randn(3, 6, 64, device="cuda").to(torch.bfloat16)
    expected = rope_reference(x, rope.cos_sin, positions)
    assert apply_rotary(x, step) is x
    assert torch.equal(x, expected)
    gate_up = torch.randn(4, 256, device="cuda").to(torch.bfloat16)
    assert ulps_apart(kernels.silu_and_mul(gate_up), silu_and_mul_reference(gate_up)) <= 1


# ---------------------------------------------------------------------- no kernel launched


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_emulated_references_round_where_torch_does(dtype: torch.dtype) -> None:
    """Rounding to nearest, the emulations equal torch's ops bit for bit: so under the
    interpreter (truncating) they check the kernels' rounding points, not just closeness."""
    gen = torch.Generator().manual_seed(12)
    gate_up = (torch.randn(7, 2 * 80, generator=gen) * 6).to(dtype)
    expected = F.silu(gate_up[:, :80]) * gate_up[:, 80:]
    assert torch.equal(emulated_silu_and_mul(gate_up, truncate=False), expected)
    x = torch.randn(9, 5, 64, generator=gen).to(dtype)
    table = torch.randn(20, 2, 64, generator=gen).to(dtype)
    positions = torch.randint(0, 20, (9,), generator=gen)
    assert torch.equal(
        emulated_rope(x, table, positions, truncate=False), torch_rope(x, table, positions)
    )


def test_rotary_args_are_checked_by_their_helper() -> None:
    """The wrapper checks nothing per call; ``check_rotary_args`` states what it indexes."""
    x = torch.zeros(3, 4, 16)
    table = torch.zeros(8, 2, 16)
    positions = torch.zeros(3, dtype=torch.int64)
    rotary.check_rotary_args(x, table, positions)
    bad = {
        "head_dim not of unit stride": (torch.zeros(3, 16, 4).transpose(1, 2), table, positions),
        "a table of another dtype": (x, table.double(), positions),
        "a table of another head_dim": (x, torch.zeros(8, 2, 8), positions),
        "positions of another length": (x, table, positions[:2]),
        "float positions": (x, table, positions.float()),
    }
    for name, args in bad.items():
        with pytest.raises(AssertionError):
            rotary.check_rotary_args(*args)
            pytest.fail(f"no AssertionError for {name}")


def test_empty_steps_launch_nothing() -> None:
    x = torch.zeros(0, 4, 16)
    assert rotary.apply_rotary_(x, torch.zeros(8, 2, 16), torch.zeros(0).long()) is x
    assert activation.silu_and_mul(torch.zeros(0, 32)).shape == (0, 16)
