"""AWQ 4-bit checkpoints (``quant_method: awq``, AutoAWQ's ``gemm`` version).

Per linear layer: ``qweight`` int32 ``[in, out / 8]`` and ``qzeros`` int32 ``[groups, out / 8]``
(eight outputs per int32, interleaved: nibble k holds output ``AWQ_ORDER[k]`` of its eight),
``scales`` ``[groups, out]``; group ``i // group_size`` for input ``i``.
"""

from __future__ import annotations

from typing import Any

import torch

from services.engine.quantization.base import (
    PER_OUTPUT,
    LinearMethod,
    ParamLayout,
    QuantConfig,
    frozen_param,
)
from services.engine.quantization.int4 import (
    hold,
    unpack,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PACKED = ("qweight", "qzeros", "scales")


class AWQMethod(LinearMethod):
    name = "awq-w4a16"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_weights(self, layer: torch.nn.Module) -> None:
        out, inp, g = layer.out_features, layer.in_features, self.group_size
        if out % 8 or inp % g:  # a rank's shard must hold whole packed words and groups
            raise ValueError(f"awq: a layer of {inp} inputs and {out} outputs on this rank "
                             f"does not hold whole packed words and groups of {g}; try another "
                             "tensor_parallel_size")
        layer.qweight = frozen_param(inp, out // 8, dtype=torch.int32)
        layer.qzeros = frozen_param(inp // g, out // 8, dtype=torch.int32)
        layer.scales = frozen_param(inp // g, out, dtype=torch.float32)
        layer.bias = frozen_param(out, dtype=layer.dtype) if layer.has_bias else None

    def layout(self, leaf: str) -> ParamLayout:
        g = self.group_size
        return {
            "qweight": ParamLayout(1, 0, output_pack=8),
            "qzeros": ParamLayout(1, 0, output_pack=8, input_pack=g),
            "scales": ParamLayout(1, 0, input_pack=g),
        }.get(leaf, PER_OUTPUT)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        q = unpack(layer.qweight, dim=1, order=AWQ_ORDER)
        zeros = unpack(layer.qzeros, dim=1, order=AWQ_ORDER)
        groups = torch.arange(layer.in_features, device=q.device) // self.group_size
        hold(layer, q, zeros, layer.scales, groups, _PACKED)


class AWQConfig(QuantConfig):
    name = "awq"

    def __init__(self, method: AWQMethod, skipped: tuple[str, ...] = ()) -> None:
        self.method = method
        self.skipped = skipped  # modules_to_not_convert: names (or parts of them) kept dense

    @classmethod
    def from_hf(cls, raw: dict[str, Any], device: torch.device) -> AWQConfig:
        bits, group = raw.get("bits", raw.get("w_bit")), raw.get("group_size",
                                                                   raw.get("q_group_size"))
        version = str(raw.get("version", "gemm")).lower()
        zero_point = raw.get("zero_point", True)
        if bits != 4 or version != "gemm" or not zero_point:
            raise ValueError(f"awq with bits={bits}, version={version!r}, "
                             f"zero_point={zero_point} is not supported; supported: bits=4, "
                             "version 'gemm', zero_point true")
        if not isinstance(group, int) or group <= 0:
            raise ValueError(f"awq group_size must be positive, got {group!r}")
        skipped = tuple(raw.get("modules_to_not_convert") or ())
        return cls(AWQMethod(group), skipped)

    def linear_method(self, sources: tuple[str, ...]) -> LinearMethod | None:
        if sources == ("lm_head",) or any(s in name for s in self.skipped for name in sources):
            return None
        return self.method
