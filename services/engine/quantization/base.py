"""The seam between a linear layer and how it holds and applies its weight.

After vLLM's ``QuantizationConfig.get_quant_method(layer)``: a checkpoint's quantization
scheme (``QuantConfig``, read from its ``config.json`` ``quantization_config``) hands each
linear layer a ``LinearMethod``, and the layer asks its method for everything about its weight:

* ``create_weights(layer)``: registers the parameters the checkpoint fills (on the meta device,
  before the model is materialised), with the names the checkpoint stores them under
  (``weight``, ``weight_scale``, ``qweight``, ...);
* ``layout(leaf)``: which dims of a parameter run along the layer's output rows (stacked
  projections and column-parallel shards cut there) and input columns (row-parallel shards);
* ``process_weights_after_loading(layer)``: once, after the checkpoint is read (unpacking,
  transposing into the kernel's layout);
* ``pack(layer)``: once, on the CPU, after the step features have read the layer's sizes
  (oneDNN's layout);
* ``apply(layer, x, bias)``: the product, ``[T, in]`` -> ``[T, out]`` in ``x``'s dtype.

A layer without a scheme keeps the unquantized method (``models.unquantized_linear``), which is
the engine's plain path. A new scheme is one module of this package and one entry in its
registry (``quantization.registry``). Methods hold no per-layer state: one instance serves
every layer it is handed to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """Where a parameter's dims meet the layer's ``[out, in]`` weight. ``None``: the parameter
    does not run along that dim (a per-channel scale has no input dim: a row-parallel rank reads
    all of it). A pack is how many outputs (inputs) share one index of that dim: 8 for 4-bit
    values packed in int32, the group size for a group's scale."""

    output_dim: int | None = 0
    input_dim: int | None = 1
    output_pack: int = 1
    input_pack: int = 1


WEIGHT = ParamLayout()
PER_OUTPUT = ParamLayout(0, None)  # biases, per-channel scales: [out] or [out, 1]


class LinearMethod:
    """How one kind of linear layer holds and applies its weight (see the module docstring).

    ``layer`` is a ``models.layers.Linear``: it carries ``in_features`` (this rank's),
    ``out_features`` (this rank's, ``sum(shard_sizes)``), ``has_bias`` and ``dtype`` (the
    activations', and the bias's).
    """

    name = "base"

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def layout(self, leaf: str) -> ParamLayout:
        return PER_OUTPUT if leaf == "bias" else WEIGHT

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once, with the checkpoint loaded, on the model's device."""

    def pack(self, layer: nn.Module) -> None:
        """Called once on the CPU after the features built before packing (adapter slots) read
        the layer; a no-op by default."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        raise NotImplementedError


class QuantConfig:
    """A checkpoint's quantization scheme: which method each linear layer gets."""

    name = "base"

    def linear_method(self, sources: tuple[str, ...]) -> LinearMethod | None:
        """The method for a layer whose weight is the checkpoint's ``sources`` (HF module names,
        several for a fused projection, in their stacking order); None: unquantized."""
        raise NotImplementedError


def frozen_param(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    """An uninitialised frozen parameter (the loader fills it)."""
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
