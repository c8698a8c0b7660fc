"""Quantized checkpoints: each scheme hands every linear layer its method (see ``base``).

``quant_config_for`` reads a checkpoint's ``quantization_config`` (``config.json``, as vLLM and
transformers do) and returns its ``QuantConfig``, or None for a plain checkpoint. The engine's
``--quantization`` only confirms or refuses what the checkpoint says: weights are never
quantized at load time. An unknown scheme, or one this device cannot run, stops the engine at
start with a message that names it and what is supported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from services.engine.quantization.awq import AWQConfig
from services.engine.quantization.base import QuantConfig
from services.engine.quantization.compressed_tensors import CompressedTensorsConfig
from services.engine.quantization.gptq import GPTQConfig

# quant_method -> parser of its quantization_config.
SCHEMES: dict[str, Callable[[dict[str, Any], torch.device], QuantConfig]] = {
    CompressedTensorsConfig.name: CompressedTensorsConfig.from_hf,
    GPTQConfig.name: GPTQConfig.from_hf,
    AWQConfig.name: AWQConfig.from_hf,
}


def quant_config_for(
    raw: dict[str, Any] | None, override: str | None, device: torch.device
) -> QuantConfig | None:
    """The checkpoint's scheme (``raw`` is its ``quantization_config``), checked against the
    ``--quantization`` flag (``override``) and the device; raises ValueError naming both."""
    method = None if raw is None else raw.get("quant_method")
    if override is not None and override != method:
        found = "is not quantized" if method is None else f"is quantized with {method!r}"
        raise ValueError(f"quantization={override!r}, but the checkpoint {found} (Pagoda "
                         "serves a checkpoint's own quantization and never converts one)")
    if raw is None:
        return None
    if method not in SCHEMES:
        raise ValueError(f"checkpoint quantization {method!r} is not supported; supported: "
                         f"{', '.join(sorted(SCHEMES))}")
    return SCHEMES[method](raw, torch.device(device))
