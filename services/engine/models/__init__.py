"""Model implementations (Llama, Mistral, Qwen2, Qwen3), the config, the loader, the default model.

The model runner needs only::

    model = load_model(path, dtype, device, attn_backend)
    hidden = model(input_ids, positions, kv_caches, meta)
    logits = model.compute_logits(hidden[rows])

The default model lives in ``services.engine.models.default`` (not imported here, so that
``python -m services.engine.models.default`` runs cleanly).
"""

from __future__ import annotations

from services.engine.models.config import ModelConfig, RopeConfig
from services.engine.models.layers import CausalLM
from services.engine.models.loader import load_model
from services.engine.models.registry import supported_architectures

__all__ = [
    "CausalLM",
    "ModelConfig",
    "RopeConfig",
    "load_model",
    "supported_architectures",
]
