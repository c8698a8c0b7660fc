"""Model configuration parsed from a Hugging Face model directory (``config.json``).

Only the fields the engine needs are kept, under our own names, so that the rest of the engine
never touches a transformers config object. Architecture-specific quirks (Qwen2's q/k/v bias,
Qwen3's q/k norms) come from the registry, which is the one list of supported architectures.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.engine.models.registry import get_arch_spec, resolve_architecture

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding parameters (transformers 5 ``rope_parameters`` semantics)."""

    theta: float = _DEFAULT_ROPE_THETA
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # "linear" and "llama3"
    low_freq_factor: float = 1.0  # "llama3" only
    high_freq_factor: float = 4.0  # "llama3" only
    original_max_position_embeddings: int = 0  # "llama3" only: the pretraining context

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError("rope theta and factor must be positive")
        if self.rope_type == "llama3":
            if self.original_max_position_embeddings <= 0:
                raise ValueError("llama3 rope needs original_max_position_embeddings > 0")
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the engine needs to know about a decoder-only model."""

    architecture: str  # HF ``architectures[0]`` (else from model_type), e.g. "LlamaForCausalLM"
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    checkpoint_dtype: str | None = None  # dtype the weights were saved in, informational

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V cache one token occupies across all layers."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        """Parses ``config.json`` (and ``generation_config.json`` for eos ids) in ``path``."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        raw = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        return cls.from_hf_dict(raw, generation)

    @classmethod
    def from_hf_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Builds a config from parsed ``config.json`` (+ ``generation_config.json``) dicts."""
        # Raises ValueError, naming the supported ones, when neither names a supported model.
        architecture = resolve_architecture(raw.get("architectures"), raw.get("model_type"))
        spec = get_arch_spec(architecture)
        hidden = _required_int(raw, "hidden_size")
        heads = _required_int(raw, "num_attention_heads")
        attention_bias = bool(raw.get("attention_bias", False))
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}; only 'silu' (SwiGLU)")
        generation = generation or {}
        return cls(
            architecture=architecture,
            model_type=str(raw.get("model_type", "")),
            vocab_size=_required_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required_int(raw, "intermediate_size"),
            num_layers=_required_int(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            # head_dim may be absent, null, or differ from hidden // heads (Qwen3, Mistral).
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=_max_positions(raw),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if spec.qkv_bias is None else spec.qkv_bias,
            o_proj_bias=attention_bias if spec.o_proj_bias is None else spec.o_proj_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=spec.qk_norm,
            eos_token_ids=_token_ids(_generation_field(generation, raw, "eos_token_id")),
            bos_token_id=_optional_int(_generation_field(generation, raw, "bos_token_id")),
            pad_token_id=_optional_int(_generation_field(generation, raw, "pad_token_id")),
            checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Reads ``rope_parameters`` (transformers 5) or legacy ``rope_theta``/``rope_scaling``."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", raw.get("rope_theta")) or _DEFAULT_ROPE_THETA
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type == "linear":
        return RopeConfig(theta=float(theta), rope_type="linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        original = params.get("original_max_position_embeddings") or raw.get(
            "max_position_embeddings", 0
        )
        return RopeConfig(
            theta=float(theta),
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(original),
        )
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")


def _max_positions(raw: dict[str, Any]) -> int:
    """The usable context: capped at the sliding window when one is active.

    We only implement full causal attention. Within the window, sliding-window attention is
    identical to full attention, so capping the context keeps such models exactly correct.
    """
    max_pos = _required_int(raw, "max_position_embeddings")
    window = raw.get("sliding_window")
    # Qwen2/Qwen3 carry a window that is off unless use_sliding_window is set.
    if "use_sliding_window" in raw and not raw["use_sliding_window"]:
        window = None
    if window is not None and 0 < int(window) < max_pos:
        logger.warning(
            "sliding window attention is not implemented; capping context %s -> %s",
            max_pos,
            window,
        )
        return int(window)
    return max_pos


def _generation_field(generation: dict[str, Any], raw: dict[str, Any], key: str) -> Any:
    """generation_config.json wins over config.json; a null there falls back (id 0 is valid)."""
    value = generation.get(key)
    return raw.get(key) if value is None else value


def _required_int(raw: dict[str, Any], key: str) -> int:
    if raw.get(key) is None:
        raise ValueError(f"config.json is missing {key!r}")
    return int(raw[key])


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _token_ids(value: Any) -> tuple[int, ...]:
    """eos_token_id may be absent, one int, or a list of ints."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(dict.fromkeys(int(v) for v in value))
