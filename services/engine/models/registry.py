"""The one list of supported architectures: HF ``architectures[0]`` -> implementation + quirks."""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.models.layers import CausalLM
from services.engine.models.llama import LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """How one HF architecture maps onto our implementation."""

    model_class: type[CausalLM]
    # Fixed by the architecture; None means "follow config.json's attention_bias".
    qkv_bias: bool | None = None
    o_proj_bias: bool | None = None
    qk_norm: bool = False


# Llama, Mistral, Qwen2 and Qwen3 share one decoder; they differ only in these switches.
ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(LlamaForCausalLM),
    "MistralForCausalLM": ArchSpec(LlamaForCausalLM, qkv_bias=False, o_proj_bias=False),
    "Qwen2ForCausalLM": ArchSpec(LlamaForCausalLM, qkv_bias=True, o_proj_bias=False),
    "Qwen3ForCausalLM": ArchSpec(LlamaForCausalLM, qk_norm=True),
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(ARCHITECTURES)


def get_arch_spec(architecture: str) -> ArchSpec:
    """Returns the spec for ``architecture`` or raises ValueError naming the supported ones."""
    spec = ARCHITECTURES.get(architecture)
    if spec is None:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    return spec


def get_model_class(architecture: str) -> type[CausalLM]:
    return get_arch_spec(architecture).model_class
