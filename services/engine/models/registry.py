"""The one list of supported architectures: HF ``architectures[0]`` -> implementation + quirks.

A config.json without ``architectures`` is matched by its ``model_type`` instead, as
transformers does; the model types come from the same list. The table names each
implementation by module and class; only the one a model needs is imported (reading the
table, e.g. to check a tensor-parallel size, imports no model code).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.engine.models.layers import CausalLM


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """How one HF architecture maps onto our implementation."""

    model_class: str  # "module:Class" under services.engine.models, imported when needed
    model_type: str  # HF ``model_type`` of this architecture's config.json, e.g. "llama"
    # Fixed by the architecture; None means "follow config.json's attention_bias".
    qkv_bias: bool | None = None
    o_proj_bias: bool | None = None
    qk_norm: bool = False
    activation: str = "silu"  # the one MLP activation the implementation computes
    # Without layer_types in config.json: every pattern-th layer is global, the others slide
    # (Gemma); 0 = a sliding_window applies to every layer.
    sliding_pattern: int = 0
    # Shardable over ranks (services/engine/parallel); Phi-3's checkpoint fuses q/k/v rows in
    # one tensor, which the per-rank slice reader does not split yet.
    tensor_parallel: bool = True


_GELU = "gelu_pytorch_tanh"
_LLAMA = "llama:LlamaForCausalLM"

# Llama, Mistral, Qwen2 and Qwen3 share one decoder; they differ only in these switches. The
# other families reuse its attention and layers in modules of their own.
ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(_LLAMA, "llama"),
    "MistralForCausalLM": ArchSpec(_LLAMA, "mistral", qkv_bias=False, o_proj_bias=False),
    "Qwen2ForCausalLM": ArchSpec(_LLAMA, "qwen2", qkv_bias=True, o_proj_bias=False),
    "Qwen3ForCausalLM": ArchSpec(_LLAMA, "qwen3", qk_norm=True),
    "MixtralForCausalLM": ArchSpec(
        "moe:MixtralForCausalLM", "mixtral", qkv_bias=False, o_proj_bias=False
    ),
    "Qwen2MoeForCausalLM": ArchSpec(
        "moe:QwenMoeForCausalLM", "qwen2_moe", qkv_bias=True, o_proj_bias=False
    ),
    "Qwen3MoeForCausalLM": ArchSpec("moe:QwenMoeForCausalLM", "qwen3_moe", qk_norm=True),
    "Gemma2ForCausalLM": ArchSpec(
        "gemma:GemmaForCausalLM", "gemma2", activation=_GELU, sliding_pattern=2
    ),
    "Gemma3ForCausalLM": ArchSpec(
        "gemma:GemmaForCausalLM", "gemma3_text", qk_norm=True, activation=_GELU, sliding_pattern=6
    ),
    "Phi3ForCausalLM": ArchSpec(
        "phi3:Phi3ForCausalLM", "phi3", qkv_bias=False, o_proj_bias=False, tensor_parallel=False
    ),
}

# model_type -> architecture, for configs that name no architecture.
MODEL_TYPES: dict[str, str] = {spec.model_type: name for name, spec in ARCHITECTURES.items()}


def supported_architectures() -> tuple[str, ...]:
    return tuple(ARCHITECTURES)


def supported_model_types() -> tuple[str, ...]:
    return tuple(MODEL_TYPES)


def resolve_architecture(architectures: Sequence[str] | None, model_type: str | None) -> str:
    """The architecture a config.json names: ``architectures[0]``, else, when that entry is
    missing or empty, the one its ``model_type`` maps to. Raises ValueError naming what is
    supported.

    An unsupported ``architectures[0]`` is an error even when ``model_type`` is known: it names
    another head on the same backbone (``LlamaForSequenceClassification`` is model_type "llama"),
    which is not a causal LM."""
    if architectures:
        get_arch_spec(architectures[0])
        return architectures[0]
    name = MODEL_TYPES.get(model_type or "")
    if name is None:
        raise ValueError(
            _unsupported(f"model_type {model_type!r} (config.json has no architectures)")
        )
    return name


def get_arch_spec(architecture: str) -> ArchSpec:
    """Returns the spec for ``architecture`` or raises ValueError naming the supported ones."""
    spec = ARCHITECTURES.get(architecture)
    if spec is None:
        raise ValueError(_unsupported(f"model architecture {architecture!r}"))
    return spec


def _unsupported(what: str) -> str:
    return (
        f"unsupported {what}; supported architectures: {', '.join(ARCHITECTURES)}; "
        f"model types (used when config.json has no architectures): {', '.join(MODEL_TYPES)}"
    )


def get_model_class(architecture: str) -> type[CausalLM]:
    module, name = get_arch_spec(architecture).model_class.split(":")
    return getattr(importlib.import_module(f"services.engine.models.{module}"), name)
