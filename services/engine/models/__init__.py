"""Model implementations, the config, the loader, the default model.

Llama, Mistral, Qwen2 and Qwen3 are switches on one decoder (``llama``); Mixtral and the Qwen
MoE models (``moe``), Gemma 2/3 (``gemma``) and Phi-3 (``phi3``) reuse its pieces. The registry
lists them all.

The model runner needs only::

    model = load_model(path, dtype, device, attn_backend)
    hidden = model(input_ids, positions, kv_caches, meta)
    logits = model.compute_logits(hidden[rows])

The default model lives in ``services.engine.models.default`` (not imported here, so that
``python -m services.engine.models.default`` runs cleanly).
"""

from __future__ import annotations

import importlib
from typing import Any

# Lazy, so `services.engine.models.default` (which the torch-free gateway uses to find the
# default model's directory) does not import torch through this package.
_EXPORTS = {
    "CausalLM": "services.engine.models.layers",
    "ModelConfig": "services.engine.models.config",
    "RopeConfig": "services.engine.models.config",
    "load_model": "services.engine.models.loader",
    "supported_architectures": "services.engine.models.registry",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(name)
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = [
    "CausalLM",
    "ModelConfig",
    "RopeConfig",
    "load_model",
    "supported_architectures",
]
