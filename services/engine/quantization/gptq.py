"""GPTQ 4-bit checkpoints (``quant_method: gptq``, AutoGPTQ/GPTQModel's v1 format).

Per linear layer: ``qweight`` int32 ``[in / 8, out]`` (eight inputs per int32, in order),
``qzeros`` int32 ``[groups, out / 8]`` (the zero point minus one, the v1 format's convention),
``scales`` ``[groups, out]`` and ``g_idx`` int32 ``[in]``, each input column's group: ``i //
group_size``, or with act-order (``desc_act``) the group its column was quantized in.
``group_size: -1`` is one group over all inputs (per channel).

Over tensor-parallel ranks a row-parallel rank reads its inputs' rows of ``qweight`` and
``g_idx`` and every group's ``qzeros`` and ``scales`` (as vLLM does for act-order, whose groups
are scattered over the inputs; here always, one rule for every layout); column-parallel ranks
read their outputs' columns of all four.
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
from services.engine.quantization.int4 import hold, unpack

_PACKED = ("qweight", "qzeros", "scales", "g_idx")


class GPTQMethod(LinearMethod):
    name = "gptq-w4a16"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size  # -1: per channel

    def create_weights(self, layer: torch.nn.Module) -> None:
        out, inp, full = layer.out_features, layer.in_features, layer.full_in_features
        g = full if self.group_size == -1 else self.group_size
        if inp % 8 or out % 8 or full % g:
            raise ValueError(f"gptq: a layer of {inp} inputs and {out} outputs on this rank "
                             f"({full} inputs in all, group size {g}) does not hold whole "
                             "packed words and groups; try another tensor_parallel_size")
        layer.qweight = frozen_param(inp // 8, out, dtype=torch.int32)
        layer.qzeros = frozen_param(full // g, out // 8, dtype=torch.int32)  # every group
        layer.scales = frozen_param(full // g, out, dtype=torch.float32)
        layer.g_idx = frozen_param(inp, dtype=torch.int32)
        layer.bias = frozen_param(out, dtype=layer.dtype) if layer.has_bias else None

    def layout(self, leaf: str) -> ParamLayout:
        return {
            "qweight": ParamLayout(1, 0, input_pack=8),
            "qzeros": ParamLayout(1, None, output_pack=8),  # every group on every rank
            "scales": ParamLayout(1, None),
            "g_idx": ParamLayout(None, 0),
        }.get(leaf, PER_OUTPUT)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        q = unpack(layer.qweight, dim=0)
        zeros = unpack(layer.qzeros, dim=1) + 1
        hold(layer, q, zeros, layer.scales, layer.g_idx.long(), _PACKED)


class GPTQConfig(QuantConfig):
    name = "gptq"

    def __init__(self, method: GPTQMethod) -> None:
        self.method = method

    @classmethod
    def from_hf(cls, raw: dict[str, Any], device: torch.device) -> GPTQConfig:
        bits, group = raw.get("bits"), raw.get("group_size", -1)
        fmt = raw.get("checkpoint_format", "gptq")
        if bits != 4 or fmt != "gptq" or raw.get("dynamic"):
            raise ValueError(f"gptq with bits={bits}, checkpoint_format={fmt!r}"
                             f"{', per-module dynamic overrides' if raw.get('dynamic') else ''}"
                             " is not supported; supported: bits=4, checkpoint_format 'gptq' (v1)")
        if not isinstance(group, int) or (group != -1 and group <= 0):
            raise ValueError(f"gptq group_size must be -1 or positive, got {group!r}")
        return cls(GPTQMethod(group))

    def linear_method(self, sources: tuple[str, ...]) -> LinearMethod | None:
        # As AutoGPTQ: every linear layer of the decoder; the LM head stays in full precision.
        return None if sources == ("lm_head",) else self.method
