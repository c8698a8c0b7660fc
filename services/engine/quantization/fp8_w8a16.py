"""FP8 W8A16: float8_e4m3fn weights with per-channel scales, computed in the model's dtype.

The checkpoint holds ``weight`` (float8_e4m3fn ``[out, in]``) and ``weight_scale``
(``[out, 1]``), as compressed-tensors' ``float-quantized`` format writes them:
``W = weight * weight_scale``. x86 CPUs have no FP8 arithmetic, so the weight is dequantized
once at load into the model's dtype and the layer then runs the unquantized method (on the
CPU, oneDNN's packed product): the checkpoint is half the size of a bf16 one on disk, not in
memory. A kernel reading FP8 in its loop would halve the bytes decode reads as well; none is
written yet.
"""

from __future__ import annotations

import torch

from services.engine.quantization.base import (
    PER_OUTPUT,
    WEIGHT,
    LinearMethod,
    ParamLayout,
    frozen_param,
)


class FP8W8A16Method(LinearMethod):
    name = "fp8-w8a16"

    def create_weights(self, layer: torch.nn.Module) -> None:
        layer.weight = frozen_param(layer.out_features, layer.in_features,
                                    dtype=torch.float8_e4m3fn)
        layer.weight_scale = frozen_param(layer.out_features, 1, dtype=torch.float32)
        layer.bias = frozen_param(layer.out_features, dtype=layer.dtype) if layer.has_bias \
            else None

    def layout(self, leaf: str) -> ParamLayout:
        return WEIGHT if leaf == "weight" else PER_OUTPUT

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w = (layer.weight.float() * layer.weight_scale.float()).to(layer.dtype)
        del layer.weight_scale
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
        # From here on the layer is an unquantized one: its class's default method (pack, apply).
        del layer.method
