"""The linear method of a full-precision weight: the engine's plain path.

``weight`` ``[out, in]`` and ``bias`` in the model's dtype; ``F.linear`` until, on the CPU,
``pack`` moves the weight into oneDNN's blocked layout (``models.onednn``) and drops the plain
copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine.models.onednn import can_pack, pack, packed_linear
from services.engine.quantization.base import LinearMethod, frozen_param


class UnquantizedMethod(LinearMethod):
    name = "unquantized"

    def create_weights(self, layer: torch.nn.Module) -> None:
        layer.weight = frozen_param(layer.out_features, layer.in_features, dtype=layer.dtype)
        layer.bias = frozen_param(layer.out_features, dtype=layer.dtype) if layer.has_bias \
            else None

    def pack(self, layer: torch.nn.Module) -> None:
        if layer.packed is None and can_pack(layer.weight):
            layer.packed = pack(layer.weight, layer.bias)
            layer.weight = layer.bias = None  # the packed copy is the only one needed

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if layer.packed is not None:
            return packed_linear(x, layer.packed)
        return F.linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedMethod()
