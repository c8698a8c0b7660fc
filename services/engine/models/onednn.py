"""CPU matrix multiplies through oneDNN with weights packed once at load time.

``F.linear`` on the CPU goes to MKL's SGEMM for float32, which on AMD processors does not take
its AVX-512 code path; oneDNN's brgemm kernels do, on any x86 CPU, for float32 and bfloat16
(AVX-512-BF16/AMX where present). Packing the weight into oneDNN's blocked layout once, instead
of on every call, is what makes small-batch decode GEMMs fast too. Measured on a 2-core AMD EPYC
with AVX-512-BF16 (576 x 1536 weight): float32 at 64-1024 rows, 75-86 GFLOP/s with ``F.linear``
against 180-340 with the packed weight; bfloat16 at one row, 1.4 ms against 26 us.

CPUs without native bf16 dot products (AVX2, AVX-512 without BF16) run bf16 GEMMs an order of
magnitude slower than float32 ones: there a bf16 model's weights are packed as float32 and its
activations are multiplied in float32 (rounded back to bf16 after), as a float32 model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.cpu_ops.isa import has_native_bf16

# A packed product costs ~13 us on top of its math, a float32 ``F.linear`` ~2 us: below this many
# weight elements that is more than the whole product (64 x 512 at 256 rows: 49 against 65 us;
# equal near 200k elements; 2-core Intel Xeon). Small models' projections stay plain.
_MIN_PACKED_FLOAT32 = 1 << 16


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (a [out, in] CPU matrix) is worth packing for oneDNN: bfloat16 always
    (plain bf16 GEMMs are slow without native bf16 dot products), float32 from
    ``_MIN_PACKED_FLOAT32`` elements."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and (weight.dtype == torch.bfloat16
             or (weight.dtype == torch.float32 and weight.numel() >= _MIN_PACKED_FLOAT32))
        and torch.backends.mkldnn.is_available()
    )


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight in oneDNN's blocked layout, and the dtype its products are computed in."""

    packed: torch.Tensor  # opaque mkldnn tensor, [out, in]
    bias: torch.Tensor | None  # in the compute dtype
    compute_dtype: torch.dtype
    out_features: int


# The batch size oneDNN tunes the packed layout for; every batch size works with it.
_PACK_BATCH_HINT = 64


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
    assert can_pack(weight), (weight.device, weight.dtype, weight.shape)
    compute = weight.dtype
    if compute == torch.bfloat16 and not has_native_bf16():
        compute = torch.float32
    w = weight.detach().to(compute).contiguous()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
    b = None if bias is None else bias.detach().to(compute).contiguous()
    return PackedWeight(packed, b, compute, weight.shape[0])


# oneDNN builds (and caches, about a MB each) one primitive per distinct row count, and a step's
# row count is whatever the scheduler batched: left alone, an engine's memory grows by a GB
# over its first few thousand steps. So rows go through in chunks of at most _MAX_ROWS, each
# padded up to one of 39 sizes, finer where rows are few: 39 primitives per weight shape,
# whatever the traffic. Chunks are as large as a step's budget (2,048 for bf16 on AMX, where
# oneDNN's AMX products reach their full rate only from ~2k rows): 256-row chunks and the
# concatenation of their outputs cost a 512-token bf16 prefill step 11 of its 135 ms (2-core
# Xeon with AMX), one product of all its rows nothing extra.
_MAX_ROWS = 2048
ROW_BUCKETS = (1, 2, 4, *range(8, 64, 8), *range(64, 128, 16), *range(128, 256, 32),
               *range(256, 1024, 64), *range(1024, _MAX_ROWS + 1, 128))


# A warm-up (``ModelRunner._warm_up``) runs the model once per bucket up to this many rows,
# which warms every op of a step; past it a pass costs more than the primitives it builds
# (fp32 buckets to 1,024 took an engine's start from 5.5 to 12.3 s), so there only the
# projections run, once per weight shape (``warm_up_products``).
FULL_PASS_ROWS = 256


def warm_up_products(model: torch.nn.Module, rows: int) -> None:
    """One product of ``rows`` zero rows per distinct shape of ``model``'s packed projection
    weights (the ``packed`` of its linear layers): oneDNN builds that row count's primitives
    now."""
    seen: set[tuple] = set()
    for module in model.modules():
        w = getattr(module, "packed", None)
        if not isinstance(w, PackedWeight):
            continue
        key = (tuple(w.packed.shape), w.compute_dtype, w.bias is not None)
        if key not in seen:
            seen.add(key)
            packed_linear(torch.zeros(rows, w.packed.shape[1], dtype=w.compute_dtype), w)


def _bucket(rows: int) -> int:
    return next(b for b in ROW_BUCKETS if b >= rows)


def packed_linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """``x @ W^T + b`` (``x``: ``[rows, in]``) with the packed weight; the result has ``x``'s
    dtype."""
    rows = x.shape[0]
    xc = x if x.dtype == w.compute_dtype else x.to(w.compute_dtype)
    if rows <= _MAX_ROWS:
        y = _rows(xc, w)
    else:
        y = torch.cat([_rows(xc[s : s + _MAX_ROWS], w) for s in range(0, rows, _MAX_ROWS)])
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _rows(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    rows = x.shape[0]
    padded = _bucket(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    y = torch.ops.mkldnn._linear_pointwise(x, w.packed, w.bias, "none", [], "")
    return y if padded == rows else y[:rows]
